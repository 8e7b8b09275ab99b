//! The README's "Deploy on three hosts" section, run as written: every ```sh block marked
//! `<!-- walkthrough: … -->` is executed with bash, in order, in a fresh directory, with the
//! built binaries on `PATH`.
//!
//! - `env` blocks are the prelude of every other block. After them the test sets only what a
//!   single machine must change: `EDGE_HOST=localhost`, free ports for `EDGE_NODE_PORT` and
//!   `EDGE_HTTP_PORT`, `UPSTREAM_URL` and `MODEL` of a fake upstream that needs a key, and that
//!   key as `OPENAI_API_KEY`.
//! - `setup` blocks must exit 0.
//! - `service NAME "TEXT"` blocks run in the background until their log shows `TEXT`; they are
//!   stopped with SIGTERM at the end and must exit 0.
//! - `client` blocks must exit 0; their output must show the upstream's answers.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::os::unix::process::CommandExt as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use iop_tests::upstream::{Kind, Upstream};
use support::{TempDir, wait_until};

const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
const KEY: &str = "sk-walkthrough-upstream-key";

/// `(marker arguments, code)` of every marked block, in order.
fn blocks(readme: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(marker) = line
            .strip_prefix("<!-- walkthrough: ")
            .and_then(|m| m.strip_suffix(" -->"))
        else {
            continue;
        };
        assert_eq!(lines.next(), Some("```sh"), "a ```sh block follows {line}");
        let code: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        out.push((marker.to_owned(), code.join("\n")));
    }
    out
}

struct Service {
    name: String,
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl Service {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // The whole process group: bash and what it started. `--` is required: procps-ng
        // 4.0.2's `kill -KILL -PGID` signals every process (as `-1`), this test runner included.
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

#[test]
fn the_readme_deploys_on_three_hosts() {
    let readme = std::fs::read_to_string(README).unwrap();
    let blocks = blocks(&readme);
    assert!(
        blocks.len() >= 6,
        "the walkthrough blocks are in the README"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, KEY, "fake-model"));
    let dir = TempDir::new("walkthrough");
    let mut prelude: String = blocks
        .iter()
        .filter(|(m, _)| m == "env")
        .map(|(_, c)| format!("{c}\n"))
        .collect();
    prelude.push_str(&format!(
        "export EDGE_HOST=localhost EDGE_NODE_PORT={} EDGE_HTTP_PORT={}\nexport UPSTREAM_URL={} MODEL=fake-model OPENAI_API_KEY={KEY}\n",
        support::free_port(),
        support::free_port(),
        upstream.base_url()
    ));
    let path = format!(
        "{}:{}",
        support::bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let bash = |code: &str| {
        let mut c = Command::new("bash");
        c.arg("-c")
            .arg(format!("set -euo pipefail\n{prelude}{code}"))
            .current_dir(dir.path())
            .env("PATH", &path);
        c
    };
    let mut services: Vec<Service> = Vec::new();
    let mut answers = String::new();
    for (marker, code) in &blocks {
        let (kind, rest) = marker.split_once(' ').unwrap_or((marker.as_str(), ""));
        match kind {
            "env" => {}
            "setup" => {
                let out = bash(code).output().unwrap();
                assert!(
                    out.status.success(),
                    "setup block failed:\n{code}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            "service" => {
                let (name, ready) = rest.split_once(' ').unwrap();
                let ready = ready.trim_matches('"');
                let log = dir.path().join(format!("{name}.log"));
                let file = std::fs::File::create(&log).unwrap();
                let child = bash(code)
                    .stdout(Stdio::from(file.try_clone().unwrap()))
                    .stderr(Stdio::from(file))
                    .process_group(0)
                    .spawn()
                    .unwrap();
                let service = Service {
                    name: name.to_owned(),
                    child,
                    log,
                };
                wait_until(
                    &format!("{name} to log `{ready}`"),
                    Duration::from_secs(30),
                    || service.log_text().contains(ready),
                );
                services.push(service);
            }
            "client" => {
                let out = bash(code).output().unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
                assert!(
                    out.status.success(),
                    "client block failed:\n{stdout}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                answers.push_str(&stdout);
            }
            other => panic!("unknown walkthrough block `{other}`"),
        }
    }
    println!("{answers}");
    assert!(answers.contains("echo: hello from the client"), "{answers}");
    assert!(
        answers.contains("echo: hello from an Anthropic client"),
        "{answers}"
    );
    // The upstream saw the Nodes' key, and only it.
    let seen = upstream.seen();
    assert!(seen.iter().any(|s| s.path == "/v1/chat/completions"));
    for s in &seen {
        assert_eq!(
            s.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
    }
    for s in services.iter_mut().rev() {
        let _ = Command::new("kill")
            .args(["-TERM", &s.child.id().to_string()])
            .status();
        let status = s.child.wait().unwrap();
        assert_eq!(
            status.code(),
            Some(0),
            "{} stops cleanly:\n{}",
            s.name,
            s.log_text()
        );
        assert!(
            !s.log_text().contains(KEY),
            "{} logged the upstream key",
            s.name
        );
    }
}
