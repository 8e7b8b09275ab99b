//! The standalone `iop-edge` binary: configuration errors exit 2 naming the key; a Node (in
//! process) connects over mTLS and a chat completion goes through the binary's HTTP surface;
//! SIGTERM stops it cleanly; `iop-edge usage` reports a usage file as a table and JSON.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::io::BufRead as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::{self, Ca};
use tokio_util::sync::CancellationToken;
use workload_identity::role;

fn config(dir: &Path, ca: &Ca, edge_cert_name: &str, extra: &str) -> std::path::PathBuf {
    let leaf = ca.workload(role::EDGE, edge_cert_name, true);
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("edge.pem"), &leaf.cert_pem).unwrap();
    std::fs::write(dir.join("edge.key"), &leaf.key_pem).unwrap();
    let text = format!(
        r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:0"
http = "127.0.0.1:0"
[tls]
trust_domain = "{td}"
ca = "{d}/ca.pem"
cert = "{d}/edge.pem"
key = "{d}/edge.key"
[[nodes]]
node_id = "node-1"
[[nodes.adapters]]
name = "demo"
type = "demo"
capacity = 2
targets = ["demo-model"]
[[models]]
name = "demo"
[[models.providers]]
node_id = "node-1"
provider_id = "demo"
adapter = "demo"
target = "demo-model"
capacity = 2
{extra}"#,
        td = pki::TRUST_DOMAIN,
        d = dir.display()
    );
    let path = dir.join("edge.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn run_check(path: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_iop-edge"))
        .arg("--check-config")
        .arg("--config")
        .arg(path)
        .output()
        .unwrap()
}

#[test]
fn configuration_errors_name_their_key() {
    let dir = std::env::temp_dir().join(format!("iop-edge-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = Ca::new("edge bin CA");
    assert!(run_check(&config(&dir, &ca, "edge-1", "")).status.success());
    // The certificate names another Edge.
    let out = run_check(&config(&dir, &ca, "edge-2", ""));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tls.cert"));
    // An unknown key.
    let out = run_check(&config(&dir, &ca, "edge-1", "bogus = 1\n"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn serves_a_node_and_stops_on_sigterm() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("iop-edge-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = Ca::new("edge bin CA");
    let path = config(&dir, &ca, "edge-1", "");
    let mut child = Command::new(env!("CARGO_BIN_EXE_iop-edge"))
        .arg("--config")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let nodes = lines
        .next()
        .unwrap()
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned();
    let base = lines
        .next()
        .unwrap()
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned();
    let stop = CancellationToken::new();
    let opts = NodeOptions::new(
        "node-1",
        &nodes,
        "localhost",
        pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1"),
    )
    .unwrap()
    .with_adapters(AdapterRegistry::with_builtins());
    tokio::spawn(run_node(opts, stop.clone()));
    let http = reqwest::Client::new();
    let ready = base.replace("/v1", "/readyz");
    let deadline = Instant::now() + Duration::from_secs(20);
    while http
        .get(&ready)
        .send()
        .await
        .map(|r| r.status() != 200)
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "the Node never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v: serde_json::Value = http
        .post(format!("{base}/chat/completions"))
        .json(&serde_json::json!({"model": "demo", "messages": [{"role": "user", "content": "hello edge"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "chat.completion");
    // The demo adapter's reply is deterministic: the last user message, echoed.
    assert_eq!(
        v["choices"][0]["message"]["content"], "echo: hello edge",
        "{v}"
    );
    assert_eq!(v["model"], "demo", "{v}");
    assert!(
        Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status()
            .unwrap()
            .success()
    );
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(rest.iter().any(|l| l == "iop-edge: stopped"), "{rest:?}");
    assert_eq!(child.wait().unwrap().code(), Some(0));
    stop.cancel();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_usage_subcommand_reports_the_daily_rollup() {
    use iop_edge::usage::{Outcome, SqliteUsage, UsageConfig, UsageRecord, UsageSink as _};
    let dir = std::env::temp_dir().join(format!("iop-edge-usage-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("usage.db");
    let _ = std::fs::remove_file(&db);
    let store = SqliteUsage::open(&db, UsageConfig::default()).unwrap();
    let at_ms = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    for (i, outcome) in [Outcome::Completed, Outcome::Completed, Outcome::Refused]
        .into_iter()
        .enumerate()
    {
        store.record(UsageRecord {
            request_id: format!("r{i}"),
            at_ms,
            key: "team-a".into(),
            model: "gpt-4o-mini".into(),
            provider: "node-1/p".into(),
            input_tokens: 100,
            output_tokens: 50,
            cached_input_tokens: 0,
            estimated: false,
            cost_pusd: 1_500_000_000,
            outcome,
            duration_us: 1000,
            first_byte_us: 400,
            added_us: 150,
        });
    }
    store.flush();
    store.close();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_iop-edge"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let db_arg = db.to_str().unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&run(&["usage", "--db", db_arg, "--json"])).unwrap();
    let rows = json.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{json}");
    let completed = rows.iter().find(|r| r["status"] == "completed").unwrap();
    assert_eq!(completed["key"], "team-a");
    assert_eq!(completed["requests"], 2);
    assert_eq!(completed["input_tokens"], 200);
    assert_eq!(completed["cost_pusd"], 3_000_000_000u64);
    let table = run(&["usage", "--db", db_arg]);
    assert!(table.starts_with("day "), "{table}");
    assert!(
        table.contains("team-a") && table.contains("0.003000"),
        "{table}"
    );
    assert!(run(&["usage", "--db", db_arg, "--since", "9999-01-01", "--json"]).trim() == "[]");
    // A file that is not there: exit 2, named.
    let out = Command::new(env!("CARGO_BIN_EXE_iop-edge"))
        .args(["usage", "--db", dir.join("none.db").to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("none.db"));
    std::fs::remove_dir_all(&dir).ok();
}
