//! The `iop-node` binary: config validation, reconnect policy outcomes and exit codes, and a
//! clean exit on SIGTERM while connected to a real Edge.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use iop_edge::{Lifecycle, TransportConfig, bind};
use iop_tests::pki::{Ca, TRUST_DOMAIN};
use iop_wire::runtime::NodeConfigPayload;
use workload_identity::{ExpectedPeer, client_cert_verifier, role};

const BIN: &str = env!("CARGO_BIN_EXE_iop-node");
const LIMIT: Duration = Duration::from_secs(60);

struct Files {
    dir: PathBuf,
    ca: Ca,
}

fn files(name: &str) -> Files {
    let dir = std::env::temp_dir().join(format!("iop-node-bin-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = Ca::new("bin test CA");
    let leaf = ca.workload(role::NODE, "node-1", false);
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("node.pem"), &leaf.cert_pem).unwrap();
    std::fs::write(dir.join("node.key"), &leaf.key_pem).unwrap();
    Files { dir, ca }
}

fn config(f: &Files, address: &str, reconnect: &str) -> PathBuf {
    let d = f.dir.display();
    let text = format!(
        "node_id = \"node-1\"\n[edge]\naddress = \"{address}\"\nserver_name = \"localhost\"\nname = \"edge-1\"\n\
         [tls]\ntrust_domain = \"{TRUST_DOMAIN}\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/node.pem\"\nkey = \"{d}/node.key\"\n{reconnect}"
    );
    let path = f.dir.join(format!("node-{}.toml", text.len()));
    std::fs::write(&path, text).unwrap();
    path
}

/// A TCP listener that counts connection attempts and closes each at once (the TLS handshake
/// then fails: a retryable remote failure).
async fn counting_listener() -> (String, Arc<AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = n.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            n2.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, n)
}

async fn run_to_exit(config: &Path) -> (i32, String) {
    let out = tokio::process::Command::new(BIN)
        .arg("--config")
        .arg(config)
        .output();
    let out = tokio::time::timeout(LIMIT, out)
        .await
        .expect("binary exits")
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn exact_finite_budget_exits_1_after_that_many_attempts() {
    let f = files("finite");
    let (addr, attempts) = counting_listener().await;
    let (code, _) = run_to_exit(&config(
        &f,
        &addr,
        "[reconnect]\ninterval_sec = 0\nmax_attempts = 3\n",
    ))
    .await;
    assert_eq!(code, 1);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn omitted_max_attempts_means_ten() {
    let f = files("default");
    let (addr, attempts) = counting_listener().await;
    let (code, _) = run_to_exit(&config(&f, &addr, "[reconnect]\ninterval_sec = 0\n")).await;
    assert_eq!(code, 1);
    assert_eq!(attempts.load(Ordering::SeqCst), 10);
}

#[tokio::test]
async fn unlimited_keeps_trying_until_sigterm_then_exits_0() {
    let f = files("unlimited");
    let (addr, attempts) = counting_listener().await;
    let mut child = tokio::process::Command::new(BIN)
        .arg("--config")
        .arg(config(
            &f,
            &addr,
            "[reconnect]\ninterval_sec = 1\nmax_attempts = 0\n",
        ))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::timeout(LIMIT, async {
        while attempts.load(Ordering::SeqCst) < 3 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("three attempts");
    assert!(
        child.try_wait().unwrap().is_none(),
        "still running after 3 failed attempts"
    );
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(LIMIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn invalid_config_exits_1_naming_the_key() {
    let f = files("invalid");
    let (code, stderr) = run_to_exit(&config(
        &f,
        "127.0.0.1:1",
        "[reconnect]\nmax_attempts = -1\n",
    ))
    .await;
    assert_eq!(code, 1);
    assert!(stderr.contains("reconnect.max_attempts"), "{stderr}");
    let (code, stderr) = run_to_exit(&config(
        &f,
        "127.0.0.1:1",
        "[reconnect]\nmax_attempts = 0\ninterval_sec = 0\n",
    ))
    .await;
    assert_eq!(code, 1);
    assert!(stderr.contains("reconnect.interval_sec"), "{stderr}");
    // A certificate for another Node id.
    let other = f.ca.workload(role::NODE, "node-2", false);
    std::fs::write(f.dir.join("node.pem"), &other.cert_pem).unwrap();
    std::fs::write(f.dir.join("node.key"), &other.key_pem).unwrap();
    let (code, stderr) = run_to_exit(&config(&f, "127.0.0.1:1", "")).await;
    assert_eq!(code, 1);
    assert!(stderr.contains("tls.cert"), "{stderr}");
    assert!(!stderr.contains("PRIVATE KEY"));
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("max_attempts"));
}

#[tokio::test]
async fn connected_node_exits_0_on_sigterm_and_the_edge_fences_it() {
    let f = files("connected");
    let leaf = f.ca.workload(role::EDGE, "edge-1", true);
    let verifier = client_cert_verifier(
        f.ca.roots(),
        ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).unwrap(),
    )
    .unwrap();
    let tls = Arc::new(
        workload_identity::server_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
    );
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.node_configs = vec![("node-1".into(), NodeConfigPayload::default())];
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    let mut child = tokio::process::Command::new(BIN)
        .arg("--config")
        .arg(config(&f, &edge.local_addr().to_string(), ""))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let generation = tokio::time::timeout(LIMIT, async {
        loop {
            if let Lifecycle::Connected { generation, .. } = life.recv().await.unwrap() {
                return generation;
            }
        }
    })
    .await
    .expect("node connects");
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(LIMIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let fenced = tokio::time::timeout(LIMIT, async {
        loop {
            if let Lifecycle::Disconnected { generation, .. } = life.recv().await.unwrap() {
                return generation;
            }
        }
    })
    .await
    .expect("edge fences");
    assert_eq!(fenced, generation);
}
