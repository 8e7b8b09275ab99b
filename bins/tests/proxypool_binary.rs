//! The `proxypool-controller` binary: disabled by default, invalid configuration exits 2 with
//! the key named, Redis unavailable exits 1, and SIGTERM stops it cleanly (exit 0); and what the
//! standard Python gRPC clients see of it (reflection v1 and v1alpha, health that follows its
//! Redis).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

mod support;

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

/// A private `redis-server` on `port` (killed on drop).
struct Redis(std::process::Child);

impl Redis {
    fn start(port: u16) -> Self {
        let child = iop_tests::redis_cluster::server(port)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is required (scripts/test-all.sh installs it: apt-get install redis-server)");
        support::wait_until("redis-server", std::time::Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Self(child)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const GRPC_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/python/grpc_conformance.py"
);
const WORKER: &str = "controlplane.v1.WorkerControlPlane";

/// Standard gRPC clients (Python `grpcio-health-checking`, `grpcio-reflection`) against the
/// binary: reflection v1 and v1alpha list the worker control plane and health; gRPC health
/// follows readiness — `NOT_SERVING` while its Redis is down (and `/readyz` 503), `SERVING`
/// again after Redis is back, each change streamed by `Watch`.
#[test]
fn standard_grpc_clients_see_reflection_and_health_that_follows_redis() {
    support::require_grpc_clients();
    let dir = support::TempDir::new("proxypool-grpc-clients");
    let redis_port = support::free_port();
    let mut redis = Some(Redis::start(redis_port));
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        format!("[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\nshutdownTimeout = \"2s\"\n[redis]\nurl = \"redis://127.0.0.1:{redis_port}/\"\nnamespace = \"grpc-clients\"\n[admin]\nlisten = \"127.0.0.1:0\"\n"),
    )
    .unwrap();
    let mut controller = Command::new(env!("CARGO_BIN_EXE_proxypool-controller"))
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(controller.stdout.take().unwrap()).lines();
    let grpc = lines.next().unwrap().unwrap();
    let grpc = grpc
        .strip_prefix("proxypool-controller: gRPC on ")
        .unwrap()
        .to_owned();
    let admin = lines.next().unwrap().unwrap();
    let readyz = format!(
        "{}/readyz",
        admin
            .strip_prefix("proxypool-controller: admin on ")
            .unwrap()
    );
    let check = |service: &str| support::python(GRPC_SCRIPT, &[&grpc, "check", service]);
    assert_eq!(check(""), "SERVING\n");
    assert_eq!(check(WORKER), "SERVING\n");
    assert_eq!(support::python(GRPC_SCRIPT, &[&grpc, "reflection"]), "ok\n");
    assert!(support::http_ok(&readyz));

    // Watch the server's health while Redis goes away and comes back.
    let mut watch = Command::new("python3")
        .args([GRPC_SCRIPT, &grpc, "watch", ""])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, statuses) = std::sync::mpsc::channel::<String>();
    let out = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let next = || {
        statuses
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("a health change within 30 s")
    };
    assert_eq!(next(), "SERVING");
    drop(redis.take());
    assert_eq!(next(), "NOT_SERVING", "Redis is down");
    assert_eq!(check(""), "NOT_SERVING\n");
    assert_eq!(check(WORKER), "NOT_SERVING\n");
    assert!(!support::http_ok(&readyz), "/readyz fails with Redis down");
    let _redis = Redis::start(redis_port);
    assert_eq!(next(), "SERVING", "Redis is back");
    assert_eq!(check(""), "SERVING\n");
    support::wait_until("/readyz", std::time::Duration::from_secs(10), || {
        support::http_ok(&readyz)
    });
    let _ = watch.kill();
    let _ = watch.wait();
    let _ = Command::new("kill")
        .args(["-TERM", &controller.id().to_string()])
        .status();
    assert_eq!(controller.wait().unwrap().code(), Some(0));
}
