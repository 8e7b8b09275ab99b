//! The `proxypool-controller` binary: disabled by default, invalid configuration exits 2 with
//! the key named, Redis unavailable exits 1, and SIGTERM stops it cleanly (exit 0).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::io::BufRead as _;
use std::process::{Command, Stdio};

fn run(config: &str) -> std::process::Output {
    let dir = std::env::temp_dir().join(format!(
        "proxypool-bin-{}-{}",
        std::process::id(),
        config.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_proxypool-controller"))
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    out
}

#[test]
fn exit_codes() {
    let out = run("");
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("enabled is false"));
    let out = run(
        "[controlPlane]\nenabled = true\nsessionTTL = \"5s\"\n[redis]\nurl = \"redis://127.0.0.1:1/\"\n",
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("controlPlane.sessionTTL"));
    let out = run(
        "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\n[redis]\nurl = \"redis://127.0.0.1:1/\"\n",
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("redis unavailable"));
}

#[test]
fn sigterm_stops_cleanly() {
    let url = std::env::var("PROXYPOOL_TEST_REDIS_URL").expect(
        "PROXYPOOL_TEST_REDIS_URL is not set: run scripts/test-all.sh (it starts redis-server)",
    );
    let dir = std::env::temp_dir().join(format!("proxypool-term-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    std::fs::write(
        &path,
        format!("[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\nshutdownTimeout = \"2s\"\n[redis]\nurl = \"{url}\"\nnamespace = \"term\"\n[admin]\nlisten = \"127.0.0.1:0\"\n"),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_proxypool-controller"))
        .arg("--config")
        .arg(&path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(
        first.starts_with("proxypool-controller: gRPC on 127.0.0.1:"),
        "{first}"
    );
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(
        rest.iter().any(|l| l == "proxypool-controller: stopped"),
        "{rest:?}"
    );
    assert_eq!(child.wait().unwrap().code(), Some(0));
    std::fs::remove_dir_all(&dir).unwrap();
}
