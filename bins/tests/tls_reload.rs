//! Certificates from `iop-ca`, and hot reload in the three binaries that hold workload
//! certificates: `iop-ca issue --force` over a running workload's files (as SPIRE's
//! spiffe-helper or cert-manager would rewrite them) makes **new** connections present the new
//! certificate, while established connections continue; a bad new file is refused with a log
//! line and the old certificate stays in use.
//!
//! - Edge: a raw TLS client (holding a Node certificate) sees the Edge's leaf before and after
//!   the rotation; a Node connected before the rotation keeps serving chat without
//!   reconnecting.
//! - Node: a test "Edge" (a bare rustls server) records the client certificate of each dial;
//!   after the rotation the Node's next dial presents the new one.
//! - Control Plane (managed mode, mTLS): as for the Edge.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iop_tests::upstream::{Kind, Upstream};
use rustls_pki_types::{CertificateDer, ServerName};
use support::{Proc, TempDir, iop_ca, wait_until};
use workload_identity::{ExpectedPeer, WorkloadTls, role};

const LIMIT: Duration = Duration::from_secs(20);
const KEY: &str = "gw-reload-key";

fn material(dir: &Path, name: &str) -> Arc<WorkloadTls> {
    let read = |p: &str| std::fs::read(dir.join(p)).unwrap();
    WorkloadTls::from_pem(
        &read("ca/ca.pem"),
        &read(&format!("{name}.pem")),
        &read(&format!("{name}.key")),
    )
    .unwrap()
}

/// A full handshake to `port` as workload `client` (its files in `dir`), expecting `server`;
/// the server's leaf.
fn server_leaf(
    dir: &Path,
    client: &str,
    server: ExpectedPeer,
    port: u16,
) -> CertificateDer<'static> {
    let config = material(dir, client).client_config(server).unwrap();
    let conn =
        rustls::ClientConnection::new(Arc::new(config), ServerName::try_from("localhost").unwrap())
            .unwrap();
    let sock = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, sock);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock).unwrap();
    }
    tls.conn.peer_certificates().unwrap()[0]
        .clone()
        .into_owned()
}

fn file_leaf(dir: &Path, name: &str) -> CertificateDer<'static> {
    material(dir, name).leaf()
}

/// `iop-ca issue --force` over `<dir>/<out>.{pem,key}`.
fn rotate(dir: &Path, role: &str, name: &str, out: &str, dns: bool) {
    let ca = dir.join("ca");
    let out = dir.join(out);
    let mut args = vec![
        "issue",
        "--force",
        "--dir",
        ca.to_str().unwrap(),
        "--role",
        role,
        "--name",
        name,
        "--out",
        out.to_str().unwrap(),
    ];
    if dns {
        args.extend(["--dns", "localhost", "--ip", "127.0.0.1"]);
    }
    iop_ca(&args);
}

fn chat_ok(http_port: u16) -> bool {
    let (status, body) = support::http_post(
        &format!("http://127.0.0.1:{http_port}/v1/chat/completions"),
        &[("authorization", &format!("Bearer {KEY}"))],
        r#"{"model":"mesh-model","messages":[{"role":"user","content":"still here"}]}"#,
    );
    status == 200 && body.contains("echo: still here")
}

#[test]
fn iop_ca_refuses_to_overwrite_and_writes_private_files() {
    let dir = TempDir::new("ca-cli");
    let ca = dir.path().join("ca");
    let ca = ca.to_str().unwrap();
    iop_ca(&["init", "--dir", ca, "--trust-domain", "iop.test"]);
    let again = std::process::Command::new(env!("CARGO_BIN_EXE_iop-ca"))
        .args(["init", "--dir", ca, "--trust-domain", "iop.test"])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("refusing to overwrite it without --force")
    );
    let out = dir.path().join("n1");
    iop_ca(&[
        "issue",
        "--dir",
        ca,
        "--role",
        "node",
        "--name",
        "n1",
        "--out",
        out.to_str().unwrap(),
    ]);
    #[cfg(unix)]
    for f in ["ca/ca.pem", "ca/ca.key", "n1.pem", "n1.key"] {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f}");
    }
    let tls = material(dir.path(), "n1");
    assert_eq!(tls.identity().as_str(), "spiffe://iop.test/node/n1");
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_iop-ca"))
        .args(["issue", "--dir", ca, "--role", "node", "--name", "a/b"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
}

#[test]
fn edge_reloads_its_certificate_and_keeps_established_connections() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, "sk-reload", "fake-model"));
    let dir = TempDir::new("reload-edge");
    support::pki(dir.path(), &["node-1"]);
    let ports = support::edge_config(dir.path(), &upstream.base_url(), "chat_only", KEY);
    let edge = support::spawn_edge(dir.path(), &[]);
    let node = support::spawn_node(dir.path(), "node-1", ports.nodes, "sk-reload", &[]);
    wait_until("the Node to be ready", LIMIT, || chat_ok(ports.http));
    let edge_peer = || ExpectedPeer::exact("iop.test", role::EDGE, "edge-1").unwrap();
    let first = server_leaf(dir.path(), "node-1", edge_peer(), ports.nodes);
    assert_eq!(first, file_leaf(dir.path(), "edge"));

    rotate(dir.path(), "edge", "edge-1", "edge", true);
    let second = file_leaf(dir.path(), "edge");
    assert_ne!(first, second);
    wait_until("the Edge to present the new certificate", LIMIT, || {
        server_leaf(dir.path(), "node-1", edge_peer(), ports.nodes) == second
    });
    assert!(
        edge.log_text().contains("tls material reloaded"),
        "{}",
        edge.log_text()
    );
    // The Node's connection from before the rotation still serves, and it never redialled.
    assert!(chat_ok(ports.http));
    assert_eq!(
        node.log_text().matches("dispatch-ready").count(),
        1,
        "{}",
        node.log_text()
    );

    // A broken certificate file: refused, logged, and the current certificate stays.
    std::fs::write(dir.path().join("edge.pem"), "not a certificate").unwrap();
    wait_until("the refusal to be logged", LIMIT, || {
        edge.log_text().contains("new tls material refused")
    });
    assert_eq!(
        server_leaf(dir.path(), "node-1", edge_peer(), ports.nodes),
        second
    );
    assert!(chat_ok(ports.http));
}

#[test]
fn node_presents_its_new_certificate_on_the_next_connection() {
    let dir = TempDir::new("reload-node");
    support::pki(dir.path(), &["node-1"]);
    // A bare "Edge": records each Node certificate, then closes (the Node redials every second).
    let edge = material(dir.path(), "edge");
    let server = Arc::new(
        edge.server_config(ExpectedPeer::any_name("iop.test", role::NODE).unwrap())
            .unwrap(),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<CertificateDer<'static>>>> = Arc::default();
    let record = seen.clone();
    std::thread::spawn(move || {
        for sock in listener.incoming().flatten() {
            let conn = rustls::ServerConnection::new(server.clone()).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, sock);
            let mut byte = [0u8; 1];
            // The handshake completes on the first read (the Node then sends its register).
            if tls.read(&mut byte).is_ok()
                && let Some(certs) = tls.conn.peer_certificates()
            {
                record.lock().unwrap().push(certs[0].clone().into_owned());
            }
            let _ = tls.flush();
        }
    });
    let node_toml = support::node_config(dir.path(), "node-1", port);
    let node = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-node"),
        &["--config", node_toml.to_str().unwrap()],
        &[("UPSTREAM_KEY", "unused")],
        dir.path(),
        "node",
    );
    let first = file_leaf(dir.path(), "node-1");
    wait_until("a first dial", LIMIT, || {
        seen.lock().unwrap().contains(&first)
    });
    rotate(dir.path(), "node", "node-1", "node-1", false);
    let second = file_leaf(dir.path(), "node-1");
    wait_until("a dial with the new certificate", LIMIT, || {
        seen.lock().unwrap().contains(&second)
    });
    assert!(
        node.log_text().contains("tls material reloaded"),
        "{}",
        node.log_text()
    );
    // A certificate of another workload is refused; dials keep presenting the current one.
    let other = dir.path().join("other");
    iop_ca(&[
        "issue",
        "--dir",
        dir.path().join("ca").to_str().unwrap(),
        "--role",
        "node",
        "--name",
        "node-2",
        "--out",
        other.to_str().unwrap(),
    ]);
    std::fs::copy(dir.path().join("other.pem"), dir.path().join("node-1.pem")).unwrap();
    std::fs::copy(dir.path().join("other.key"), dir.path().join("node-1.key")).unwrap();
    wait_until("the refusal to be logged", LIMIT, || {
        node.log_text().contains("certificate identity changed")
    });
    let n = seen.lock().unwrap().len();
    wait_until("two more dials", LIMIT, || {
        seen.lock().unwrap().len() >= n + 2
    });
    assert!(seen.lock().unwrap()[n..].iter().all(|c| *c == second));
}

#[test]
fn control_plane_reloads_its_certificate() {
    let dir = TempDir::new("reload-cp");
    support::pki(dir.path(), &[]);
    let cp = dir.path().join("cp");
    iop_ca(&[
        "issue",
        "--dir",
        dir.path().join("ca").to_str().unwrap(),
        "--role",
        "control-plane",
        "--name",
        "cp-1",
        "--dns",
        "localhost",
        "--out",
        cp.to_str().unwrap(),
    ]);
    let port = support::free_port();
    let d = dir.path().display().to_string();
    let proc = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-cp"),
        &[
            "--data-dir",
            &format!("{d}/data"),
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin-listen",
            "127.0.0.1:0",
            "--tls-ca",
            &format!("{d}/ca/ca.pem"),
            "--tls-cert",
            &format!("{d}/cp.pem"),
            "--tls-key",
            &format!("{d}/cp.key"),
            "--trust-domain",
            "iop.test",
            "--credential-plane",
            "--tls-reload-sec",
            "1",
        ],
        &[],
        dir.path(),
        "cp",
    );
    let cp_peer = || ExpectedPeer::exact("iop.test", role::CONTROL_PLANE, "cp-1").unwrap();
    wait_until("the Control Plane to listen", LIMIT, || {
        proc.log_text().contains("edge wire on")
    });
    let first = server_leaf(dir.path(), "edge", cp_peer(), port);
    assert_eq!(first, file_leaf(dir.path(), "cp"));
    rotate(dir.path(), "control-plane", "cp-1", "cp", true);
    let second = file_leaf(dir.path(), "cp");
    // A generous outer limit (the reload runs every second; one full-suite run once took more
    // than 20 s here), and the Control Plane's log if it is ever reached.
    let start = std::time::Instant::now();
    while server_leaf(dir.path(), "edge", cp_peer(), port) != second {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "timed out waiting for the Control Plane to present the new certificate; its log:\n{}",
            proc.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::write(dir.path().join("cp.key"), "garbage").unwrap();
    wait_until("the refusal to be logged", LIMIT, || {
        proc.log_text().contains("new tls material refused")
    });
    assert_eq!(server_leaf(dir.path(), "edge", cp_peer(), port), second);
}
