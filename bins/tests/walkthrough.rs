//! The README's deployment sections, run as written: every ```sh block marked
//! `<!-- walkthrough: … -->` ("Deploy on three hosts") or `<!-- managed: … -->` ("Managed
//! mode") is executed with bash, in order, in a fresh directory, with the built binaries on
//! `PATH`.
//!
//! - `env` blocks are the prelude of every other block. After them the test sets only what a
//!   single machine must change: host names `localhost`, free ports, `UPSTREAM_URL` and
//!   `MODEL` of a fake upstream that needs a key, that key as `OPENAI_API_KEY`, and (managed)
//!   the Control Plane's data directory inside the test's directory.
//! - `setup` blocks must exit 0.
//! - `service NAME "TEXT"` blocks run in the background until their log shows `TEXT`; they are
//!   stopped with SIGTERM at the end and must exit 0.
//! - `client` blocks must exit 0; their output must show the upstream's answers.
//!
//! The managed walkthrough then drives two principals' clients at a steady rate while the CLI
//! makes 50 admin changes (see [`the_readme_runs_managed_mode_and_admin_changes_fail_nothing_they_do_not_concern`]).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::os::unix::process::CommandExt as _;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use iop_tests::upstream::{Kind, Upstream};
use support::{TempDir, wait_until};

const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
const KEY: &str = "sk-walkthrough-upstream-key";

/// `(marker arguments, code)` of every marked block, in order.
fn blocks(readme: &str, prefix: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = readme.lines();
    let open = format!("<!-- {prefix}: ");
    while let Some(line) = lines.next() {
        let Some(marker) = line
            .strip_prefix(open.as_str())
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
    /// The block and the text that says it is up, to start it again.
    code: String,
    ready: String,
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

/// The services a walkthrough started, the client blocks' output, and a bash with the
/// walkthrough's prelude in its directory.
struct Run {
    services: Vec<Service>,
    answers: String,
    prelude: String,
    path: String,
    dir: TempDir,
}

impl Run {
    fn bash(&self, code: &str) -> Command {
        let mut c = Command::new("bash");
        c.arg("-c")
            .arg(format!("set -euo pipefail\n{}{code}", self.prelude))
            .current_dir(self.dir.path())
            .env("PATH", &self.path);
        c
    }

    /// Runs `code` (must exit 0) and returns its stdout.
    fn sh(&self, code: &str) -> String {
        let out = self.bash(code).output().unwrap();
        assert!(
            out.status.success(),
            "{code} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs the README's blocks marked `prefix`, with `overrides` after its `env` blocks.
    fn start(prefix: &str, overrides: &str) -> Self {
        let readme = std::fs::read_to_string(README).unwrap();
        let blocks = blocks(&readme, prefix);
        assert!(blocks.len() >= 6, "the {prefix} blocks are in the README");
        let dir = TempDir::new(prefix);
        let mut prelude: String = blocks
            .iter()
            .filter(|(m, _)| m == "env")
            .map(|(_, c)| format!("{c}\n"))
            .collect();
        prelude.push_str(overrides);
        let path = format!(
            "{}:{}",
            support::bin_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut run = Self {
            services: Vec::new(),
            answers: String::new(),
            prelude,
            path,
            dir,
        };
        for (marker, code) in &blocks {
            let (kind, rest) = marker.split_once(' ').unwrap_or((marker.as_str(), ""));
            match kind {
                "env" => {}
                "setup" => {
                    let out = run.bash(code).output().unwrap();
                    assert!(
                        out.status.success(),
                        "setup block failed:\n{code}\n{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                "service" => {
                    let (name, ready) = rest.split_once(' ').unwrap();
                    let service = run.service(name, code, ready.trim_matches('"'));
                    run.services.push(service);
                }
                "client" => {
                    let out = run.bash(code).output().unwrap();
                    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
                    assert!(
                        out.status.success(),
                        "client block failed:\n{stdout}\n{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    run.answers.push_str(&stdout);
                }
                other => panic!("unknown {prefix} block `{other}`"),
            }
        }
        run
    }

    /// Starts `code` in the background, its output in `<name>.log`, and waits for `ready` in
    /// that log.
    fn service(&self, name: &str, code: &str, ready: &str) -> Service {
        let log = self.dir.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = self
            .bash(code)
            .stdout(Stdio::from(file.try_clone().unwrap()))
            .stderr(Stdio::from(file))
            .process_group(0)
            .spawn()
            .unwrap();
        let mut service = Service {
            name: name.to_owned(),
            child,
            log,
            code: code.to_owned(),
            ready: ready.to_owned(),
        };
        // Until it is ready, a service that exits, or does not get there, fails the test with
        // its own log (a timeout alone says nothing about why).
        let started = Instant::now();
        while !service.log_text().contains(ready) {
            if let Ok(Some(status)) = service.child.try_wait() {
                panic!(
                    "{name} exited ({status}) before logging `{ready}`:\n{}",
                    service.log_text()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{name} did not log `{ready}` within 60 s:\n{}",
                service.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        service
    }

    /// SIGTERM to service `name`; it must exit 0. Its log is returned.
    fn terminate(&mut self, name: &str) -> String {
        let s = self.services.iter_mut().find(|s| s.name == name).unwrap();
        let _ = Command::new("kill")
            .args(["-TERM", &s.child.id().to_string()])
            .status();
        let status = s.child.wait().unwrap();
        let log = s.log_text();
        assert_eq!(status.code(), Some(0), "{name} stops cleanly:\n{log}");
        log
    }

    /// Starts the terminated service `name` again from its block (its new log replaces the
    /// old one, which is returned).
    fn restart(&mut self, name: &str) -> String {
        let i = self.services.iter().position(|s| s.name == name).unwrap();
        let old = self.services.remove(i);
        let log = old.log_text();
        let again = self.service(&old.name, &old.code, &old.ready);
        self.services.insert(i, again);
        log
    }

    /// SIGTERM to every service, last started first: each must exit 0 and none may have
    /// logged the upstream key.
    fn stop(mut self) {
        for s in self.services.iter_mut().rev() {
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

    fn log(&self, name: &str) -> String {
        self.services
            .iter()
            .find(|s| s.name == name)
            .map(Service::log_text)
            .unwrap_or_default()
    }
}

#[test]
fn the_readme_deploys_on_three_hosts() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, KEY, "fake-model"));
    let run = Run::start(
        "walkthrough",
        &format!(
            "export EDGE_HOST=localhost EDGE_NODE_PORT={} EDGE_HTTP_PORT={}\nexport UPSTREAM_URL={} MODEL=fake-model OPENAI_API_KEY={KEY}\n",
            support::free_port(),
            support::free_port(),
            upstream.base_url()
        ),
    );
    let answers = run.answers.clone();
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
    run.stop();
}

use support::{chat, steady};

fn failures(results: &[(u16, String)]) -> Vec<&(u16, String)> {
    results
        .iter()
        .filter(|(status, _)| *status != 200)
        .collect()
}

/// The README's managed mode, then the claim it makes: an admin change never fails a request
/// it does not concern. Team A's client runs at 20 requests/s while the CLI makes 50
/// mutations (10 rounds of: a new principal, a new slot, a route for it, that route disabled,
/// and team B's slot rotated); team B's client runs alongside. Team A is untouched: zero
/// failures. Team B's key is rotated ten times under it: zero failures too (a request caught
/// by a rotation is re-bound). Then team B's token is revoked: its requests end with 401 (403
/// for one in flight as the change lands), never a 5xx. Also: `/readyz` is 503 with the reason
/// while the Control Plane is down and 200 again once the Edge rejoined it, and a clean Edge
/// stop is logged by the Control Plane as a close, not as an invalid frame.
#[test]
fn the_readme_runs_managed_mode_and_admin_changes_fail_nothing_they_do_not_concern() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, KEY, "fake-model"));
    let http = support::free_port();
    let mut run = Run::start(
        "managed",
        &format!(
            "export CP_HOST=localhost CP_PORT={} CP_ADMIN_PORT={} EDGE_HOST=localhost EDGE_NODE_PORT={} EDGE_HTTP_PORT={http}\n\
             export UPSTREAM_URL={} MODEL=fake-model OPENAI_API_KEY={KEY} IOP_CP_DATA_DIR=\"$PWD/cp-data\"\n",
            support::free_port(),
            support::free_port(),
            support::free_port(),
            upstream.base_url()
        ),
    );
    assert!(
        run.answers.contains("echo: hello from team a"),
        "{}",
        run.answers
    );
    let team_a = std::fs::read_to_string(run.dir.path().join("team-a.token"))
        .unwrap()
        .trim()
        .to_owned();
    // Team B: its own slot (the same upstream key), route and token.
    let out = run.sh(
        "iop-cp slot put team-b-slot --profile openai --credential-env OPENAI_API_KEY
         iop-cp principal create team-b
         iop-cp route put team-b-mini --principal team-b --model \"$MODEL\" --slot team-b-slot --target \"$MODEL\"
         iop-cp token create --principal team-b",
    );
    let field = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap()
            .to_owned()
    };
    let (team_b, team_b_id) = (field("token: "), field("token_id: "));
    wait_until(
        "team B's route to reach the Edge",
        Duration::from_secs(10),
        || chat(http, &team_b, "b").0 == 200,
    );

    // 50 mutations under a steady load.
    let stop = Arc::new(AtomicBool::new(false));
    let a = steady(http, team_a.clone(), stop.clone());
    let b = steady(http, team_b.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let script: String = (1..=10)
        .map(|i| {
            format!(
                "iop-cp principal create other-{i}
                 iop-cp slot put other-slot-{i} --profile openai --credential-env OPENAI_API_KEY
                 iop-cp route put other-route-{i} --principal other-{i} --model \"$MODEL\" --slot other-slot-{i} --target \"$MODEL\"
                 iop-cp route disable other-route-{i}
                 iop-cp slot put team-b-slot --profile openai --credential-env OPENAI_API_KEY\n"
            )
        })
        .collect();
    let log = run.sh(&script);
    assert_eq!(log.lines().count(), 50, "50 mutations:\n{log}");
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    println!(
        "50 mutations in {:.1} s; team A: {} requests, {} failed; team B (slot rotated 10 times): {} requests, {} failed",
        took.as_secs_f64(),
        a.len(),
        failures(&a).len(),
        b.len(),
        failures(&b).len()
    );
    assert!(
        a.len() >= 40 && b.len() >= 40,
        "the load ran: {} and {}",
        a.len(),
        b.len()
    );
    assert!(failures(&a).is_empty(), "team A failed: {:?}", failures(&a));
    assert!(failures(&b).is_empty(), "team B failed: {:?}", failures(&b));

    // Team B's token revoked under load: 401 once the projection has it, 403 for a request in
    // flight as it lands, nothing else; and the last answer is 401.
    let stop = Arc::new(AtomicBool::new(false));
    let b = steady(http, team_b.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    run.sh(&format!("iop-cp token revoke {team_b_id}"));
    // The push is immediate; the bound is generous for a loaded machine (it is the test's
    // outer limit, not the rule).
    wait_until(
        "the revoked token to be refused",
        Duration::from_secs(30),
        || chat(http, &team_b, "revoked").0 == 401,
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let b = b.join().unwrap();
    let statuses: Vec<u16> = b.iter().map(|(s, _)| *s).collect();
    println!("team B around its token's revocation: {statuses:?}");
    assert!(
        statuses.iter().all(|s| [200, 401, 403].contains(s)),
        "{statuses:?}"
    );
    assert_eq!(statuses.last(), Some(&401), "{statuses:?}");
    assert_eq!(chat(http, &team_a, "a").0, 200, "team A is unaffected");

    // Readiness follows the Control Plane session.
    let ready = || support::http_get(&format!("http://127.0.0.1:{http}/readyz"), &[]);
    assert_eq!(ready().0, 200);
    run.terminate("cp");
    wait_until(
        "/readyz to fail without the Control Plane",
        Duration::from_secs(10),
        || ready().0 == 503,
    );
    let (_, why) = ready();
    assert!(why.contains("control plane"), "{why}");
    run.restart("cp");
    wait_until(
        "/readyz after the Edge rejoined",
        Duration::from_secs(30),
        || ready().0 == 200,
    );
    assert_eq!(chat(http, &team_a, "a").0, 200);

    // A clean Edge stop is a clean close at the Control Plane.
    run.terminate("node-1");
    run.terminate("edge");
    wait_until(
        "the Control Plane to see the Edge go",
        Duration::from_secs(10),
        || run.log("cp").contains("edge disconnected"),
    );
    // With TLS close_notify: no I/O error ("edge connection closed: … close_notify"), no
    // "invalid frame".
    let cp_log = run.log("cp");
    assert!(
        !cp_log.contains("invalid frame") && !cp_log.contains("edge connection closed"),
        "{cp_log}"
    );
    // The upstream saw the slot's key only; nobody logged it.
    for s in upstream.seen() {
        assert_eq!(
            s.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
    }
    for name in ["cp", "edge", "node-1"] {
        assert!(
            !run.log(name).contains(KEY),
            "{name} logged the upstream key"
        );
    }
    run.terminate("cp");
    run.services.clear();
}
