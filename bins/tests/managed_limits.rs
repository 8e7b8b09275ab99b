//! Managed mode's principal limits, as processes: `iop-cp serve` (SQLite, managed) ⇄ one
//! `iop-edge` (managed, `[usage]` in a local SQLite file, `[prices]`) ⇄ one `iop-node`, a keyed
//! fake upstream.
//!
//! - Limits set with the CLI before the server starts reach the Edge with the first projection:
//!   the principal's requests per minute are enforced (429 `rate_limit_exceeded` with
//!   `retry-after`), and every answer carries the `x-ratelimit-*` headers.
//! - Limits changed through the admin API (`PUT /admin/v1/principals/{id}/limits`) reach the
//!   Edge with the next projection, with no restart; `GET` reads them back.
//! - A spend budget set the same way is refused for good (`insufficient_quota`,
//!   `x-should-retry: false`).
//! - Usage records name the principal (never the token).
//! - The Control Plane killed for 30 s under a steady load and started again: every request
//!   the Edge recorded is stored at the Control Plane exactly once (the Edge's spool).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use iop_tests::upstream::{Kind, Upstream};
use support::{Proc, TempDir, iop_ca, wait_until};

const KEY: &str = "sk-managed-limits-upstream-key";
const LIMIT: Duration = Duration::from_secs(60);

/// `iop-cp` on data directory `data`; stdout.
fn cli(data: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .env("OPENAI_API_KEY", KEY)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "iop-cp {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn field(out: &str, prefix: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap()
        .to_owned()
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }
}

/// One chat request; status 0 when the Edge does not answer (not listening yet).
async fn chat(client: &reqwest::Client, port: u16, token: &str) -> Answer {
    let sent = client
        .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .bearer_auth(token)
        .json(&serde_json::json!({
            "model": "fake-model",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
        }))
        .send()
        .await;
    let Ok(r) = sent else {
        return Answer {
            status: 0,
            headers: reqwest::header::HeaderMap::new(),
            body: String::new(),
        };
    };
    Answer {
        status: r.status().as_u16(),
        headers: r.headers().clone(),
        body: r.text().await.unwrap(),
    }
}

/// The mesh as processes, in a temporary directory.
struct Mesh {
    rt: tokio::runtime::Runtime,
    _upstream: Upstream,
    dir: TempDir,
    data: std::path::PathBuf,
    cp_port: u16,
    cp: Proc,
    /// The admin API's `host:port`.
    admin: String,
    edge: Proc,
    node: Proc,
    http: u16,
    token: String,
    client: reqwest::Client,
}

impl Mesh {
    /// CA and certificates, the store (principal `team-a` with a route, a token and the
    /// `iop-cp principal limits` arguments `limits`, if any), then `iop-cp serve`, the Edge
    /// and the Node; returns once a request is served (its status is not 503).
    fn start(tag: &str, limits: &[&str]) -> Self {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, KEY, "fake-model"));
        let dir = TempDir::new(tag);
        let d = dir.path();
        let ca = d.join("ca");
        let ca = ca.to_str().unwrap();
        iop_ca(&["init", "--dir", ca, "--trust-domain", "iop.test"]);
        let out = |name: &str| d.join(name).to_str().unwrap().to_owned();
        for (role, name) in [
            ("control-plane", "cp-1"),
            ("edge", "edge-1"),
            ("node", "node-1"),
        ] {
            let mut args = vec!["issue", "--dir", ca, "--role", role, "--name", name];
            if role != "node" {
                args.extend(["--dns", "localhost"]);
            }
            let path = out(if role == "control-plane" { "cp" } else { name });
            args.extend(["--out", &path]);
            iop_ca(&args);
        }
        let data = d.join("cp-data");
        cli(&data, &["init"]);
        cli(
            &data,
            &[
                "slot",
                "put",
                "openai-prod",
                "--profile",
                "openai",
                "--credential-env",
                "OPENAI_API_KEY",
            ],
        );
        cli(&data, &["principal", "create", "team-a"]);
        cli(
            &data,
            &[
                "route",
                "put",
                "r1",
                "--principal",
                "team-a",
                "--model",
                "fake-model",
                "--slot",
                "openai-prod",
                "--target",
                "fake-model",
            ],
        );
        let token = field(
            &cli(&data, &["token", "create", "--principal", "team-a"]),
            "token: ",
        );
        if !limits.is_empty() {
            let mut args = vec!["principal", "limits", "team-a"];
            args.extend(limits);
            cli(&data, &args);
        }
        std::fs::write(d.join("cp-issuer.pub.pem"), cli(&data, &["issuer-key"])).unwrap();
        let cp_port = support::free_port();
        let (cp, admin) = serve(d, &data, cp_port, "cp");

        let (nodes, http) = (support::free_port(), support::free_port());
        let dd = d.display();
        std::fs::write(
            d.join("edge.toml"),
            format!(
                r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:{nodes}"
http = "127.0.0.1:{http}"
[tls]
trust_domain = "iop.test"
ca = "{dd}/ca/ca.pem"
cert = "{dd}/edge-1.pem"
key = "{dd}/edge-1.key"
[control_plane]
address = "127.0.0.1:{cp_port}"
server_name = "localhost"
name = "cp-1"
credential_plane = true
[usage]
sqlite = "{dd}/usage.sqlite3"
[prices.fake-model]
input = 1000.0
output = 1000.0
[[models]]
name = "fake-model"
[[models.providers]]
node_id = "node-1"
provider_id = "upstream-1"
adapter = "openai"
target = "fake-model"
capacity = 8
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "openai"
type = "openai_compat"
base_url = "{base}"
profile = "openai"
capacity = 8
"#,
                base = upstream.base_url(),
            ),
        )
        .unwrap();
        let node_cfg =
            support::managed_node_config(d, "node-1", "edge-1", nodes, &["cp-issuer.pub.pem"]);
        let edge = Proc::spawn(
            env!("CARGO_BIN_EXE_iop-edge"),
            &["--config", &out("edge.toml")],
            &[],
            d,
            "edge",
        );
        let node = Proc::spawn(
            env!("CARGO_BIN_EXE_iop-node"),
            &["--config", node_cfg.to_str().unwrap()],
            &[],
            d,
            "node",
        );
        let _ = rustls::crypto::ring::default_provider().install_default();
        let m = Self {
            rt,
            _upstream: upstream,
            data,
            cp_port,
            cp,
            admin,
            edge,
            node,
            http,
            token,
            client: reqwest::Client::new(),
            dir,
        };
        let last = std::cell::Cell::new(0);
        support::wait_until_with(
            "the mesh to serve team-a",
            LIMIT,
            || {
                last.set(m.chat().status);
                ![0, 503].contains(&last.get())
            },
            || m.logs(&format!("last status {}", last.get())),
        );
        m
    }

    /// `what`, then the last lines of each process's output (for a failure message).
    fn logs(&self, what: &str) -> String {
        format!(
            "{what}\n--- iop-cp:\n{}\n--- iop-edge:\n{}\n--- iop-node:\n{}",
            self.cp.log_tail(30),
            self.edge.log_tail(30),
            self.node.log_tail(30)
        )
    }

    fn out(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }

    fn chat(&self) -> Answer {
        self.rt.block_on(chat(&self.client, self.http, &self.token))
    }

    /// The Edge's `/metrics` value of the series `name` (0 when absent).
    fn metric(&self, name: &str) -> u64 {
        let (_, text) = support::http_get(&format!("http://127.0.0.1:{}/metrics", self.http), &[]);
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u64)
            .sum()
    }
}

/// `iop-cp serve` (managed) on `data`, Edge wire on `port`; the process and its admin API's
/// `host:port`.
fn serve(d: &Path, data: &Path, port: u16, name: &str) -> (Proc, String) {
    let cp = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-cp"),
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin-listen",
            "127.0.0.1:0",
            "--tls-ca",
            &format!("{}/ca/ca.pem", d.display()),
            "--tls-cert",
            &format!("{}/cp.pem", d.display()),
            "--tls-key",
            &format!("{}/cp.key", d.display()),
            "--trust-domain",
            "iop.test",
            "--credential-plane",
        ],
        &[],
        d,
        name,
    );
    support::wait_until_with(
        "iop-cp to serve",
        LIMIT,
        || cp.log_text().contains("admin API on"),
        || format!("--- {name}:\n{}", cp.log_tail(30)),
    );
    let admin = cp
        .log_text()
        .lines()
        .find_map(|l| l.split("admin API on http://").nth(1))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    (cp, admin)
}

/// The Control Plane's usage rollup (`iop-cp usage --json`): requests in all.
fn cp_requests(data: &Path) -> u64 {
    let out = cli(data, &["usage", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["usage"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["requests"].as_u64().unwrap())
        .sum()
}

#[test]
fn principal_limits_set_on_the_control_plane_are_enforced_by_the_edge() {
    let mut m = Mesh::start("managed-limits", &["--requests-per-minute", "3"]);
    assert_eq!(
        cli(&m.data, &["principal", "limits", "team-a", "--show"]).trim(),
        r#"{"requests_per_minute":3}"#
    );
    // That first request was admitted (or refused) under the limit; count from a fresh minute
    // is not possible, so read what the headers say remains and spend it.
    let mut statuses = Vec::new();
    let mut last = None;
    for _ in 0..4 {
        let a = m.chat();
        statuses.push(a.status);
        last = Some(a);
    }
    let refused = last.unwrap();
    assert_eq!(refused.status, 429, "{statuses:?} {}", refused.body);
    assert!(
        refused.body.contains("rate_limit_exceeded"),
        "{}",
        refused.body
    );
    assert_eq!(refused.header("x-ratelimit-limit-requests"), "3");
    let retry: u64 = refused.header("retry-after").parse().unwrap();
    assert!(
        (1..=20).contains(&retry),
        "one request frees in 20 s: {retry}"
    );
    assert!(
        statuses.iter().filter(|s| **s == 200).count() <= 2,
        "3 a minute, one spent on the first request: {statuses:?}"
    );

    // Raised through the admin API: the next projection carries it, no restart.
    let put = |doc: &str| {
        support::http_request_json(
            "PUT",
            &format!("http://{}/admin/v1/principals/team-a/limits", m.admin),
            doc,
        )
    };
    let (status, body) = put(r#"{"requests_per_minute": 600, "tokens_per_minute": 100000}"#);
    assert_eq!(status, 200, "{body}");
    // The key's past use counts at the old rate (20 s a request), so the new rate's burst is
    // not there at once: wait for admissions, never assume them.
    wait_until("the raised limit to reach the Edge", LIMIT, || {
        let a = m.chat();
        a.status == 200
            && a.header("x-ratelimit-limit-requests") == "600"
            && a.header("x-ratelimit-limit-tokens") == "100000"
    });
    let (status, body) = support::http_get(
        &format!("http://{}/admin/v1/principals/team-a/limits", m.admin),
        &[],
    );
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        serde_json::json!({"requests_per_minute": 600, "tokens_per_minute": 100000})
    );
    // A bad document is refused and changes nothing.
    let (status, _) = put(r#"{"requests_per_minute": 600, "models": {"bad model": {}}}"#);
    assert_eq!(status, 400);

    // A budget smaller than any request: refused for good, in the OpenAI form the SDKs do not
    // retry.
    let (status, body) = put(r#"{"budget_usd_per_day": 0.000001}"#);
    assert_eq!(status, 200, "{body}");
    wait_until("the budget to reach the Edge", LIMIT, || {
        m.chat().status == 429
    });
    let a = m.chat();
    assert_eq!(a.status, 429);
    assert!(a.body.contains("insufficient_quota"), "{}", a.body);
    assert_eq!(a.header("x-should-retry"), "false");

    // Cleared: served again.
    let (status, _) = put("{}");
    assert_eq!(status, 200);
    wait_until("the cleared limits to reach the Edge", LIMIT, || {
        m.chat().status == 200
    });

    // Usage records are the principal's, and never carry the token.
    m.edge.stop();
    let usage = Command::new(env!("CARGO_BIN_EXE_iop-edge"))
        .args(["usage", "--db", &m.out("usage.sqlite3"), "--json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&usage.stdout);
    assert!(usage.status.success(), "{usage:?}");
    assert!(text.contains("team-a"), "{text}");
    assert!(!text.contains(&m.token));
    let db = std::fs::read(m.dir.path().join("usage.sqlite3")).unwrap();
    assert!(!db.windows(m.token.len()).any(|w| w == m.token.as_bytes()));
}

/// The Control Plane stopped (killed) for 30 s under a steady load, then started again on the
/// same store: every request the Edge admitted has exactly one usage record at the Control
/// Plane afterwards (the spool held them meanwhile; none is counted twice).
#[test]
fn usage_records_survive_a_control_plane_outage_exactly_once() {
    let mut m = Mesh::start("managed-usage", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let load = support::steady(m.http, m.token.clone(), Arc::clone(&stop));
    std::thread::sleep(Duration::from_secs(2));
    let _ = m.cp.child.kill();
    let _ = m.cp.child.wait();
    let down = std::time::Instant::now();
    // Requests keep arriving (they fail: no lease without the Control Plane) and their
    // records wait in the spool.
    support::wait_until_with(
        "records to wait in the spool",
        LIMIT,
        || m.metric("iop_edge_usage_spooled") > 0,
        || m.logs("the Control Plane was killed"),
    );
    let mut spooled_max = 0;
    while down.elapsed() < Duration::from_secs(30) {
        spooled_max = spooled_max.max(m.metric("iop_edge_usage_spooled"));
        std::thread::sleep(Duration::from_millis(500));
    }
    let (cp, _) = serve(m.dir.path(), &m.data, m.cp_port, "cp-restarted");
    m.cp = cp;
    support::wait_until_with(
        "the Edge to serve again",
        Duration::from_secs(120),
        || m.chat().status == 200,
        || m.logs("the Control Plane was restarted"),
    );
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let answers = load.join().unwrap();
    let unanswered: Vec<String> = answers
        .iter()
        .enumerate()
        .filter(|(_, (s, _))| *s == 0)
        .map(|(i, (_, why))| format!("request {i} (sent at {} ms): {why}", i * 50))
        .collect();
    assert!(
        unanswered.is_empty(),
        "every request was answered; not these (the Control Plane was killed at ~2000 ms, \
         for 30 s):\n{}",
        unanswered.join("\n")
    );
    let statuses: Vec<u16> = answers.into_iter().map(|(s, _)| s).collect();
    let failed = statuses.iter().filter(|s| **s != 200).count();
    assert!(
        failed > 0,
        "requests failed while the Control Plane was away"
    );
    assert!(spooled_max > 0);
    // Everything the Edge recorded reaches the Control Plane, once.
    let draining = std::time::Instant::now();
    while m.metric("iop_edge_usage_spooled") != 0 {
        assert!(
            draining.elapsed() < LIMIT,
            "the spool drains: {} spooled, {} shipped of {} recorded",
            m.metric("iop_edge_usage_spooled"),
            m.metric("iop_edge_usage_shipped_total"),
            m.metric("iop_edge_usage_records_total")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let recorded = m.metric("iop_edge_usage_records_total");
    assert!(
        recorded >= statuses.len() as u64,
        "{recorded} records for {} load requests",
        statuses.len()
    );
    assert_eq!(m.metric("iop_edge_usage_spool_dropped_total"), 0);
    assert_eq!(m.metric("iop_edge_usage_dropped_total"), 0);
    assert_eq!(
        cp_requests(&m.data),
        recorded,
        "the Control Plane holds each recorded request once ({} load requests, {failed} failed)",
        statuses.len()
    );
    assert_eq!(m.metric("iop_edge_usage_shipped_total"), recorded);
    let table = cli(&m.data, &["usage"]);
    assert!(
        table.contains("team-a") && table.contains("failed") && table.contains("completed"),
        "{table}"
    );
    let (status, body) = support::http_get(
        &format!("http://{}/admin/v1/usage?since=2000-01-01", admin_of(&m)),
        &[],
    );
    assert_eq!(status, 200);
    assert!(body.contains("\"principal_id\":\"team-a\""), "{body}");
    m.edge.stop();
}

fn admin_of(m: &Mesh) -> String {
    m.cp.log_text()
        .lines()
        .find_map(|l| l.split("admin API on http://").nth(1))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}
