//! `peer_load`: what slow and hostile peers cost the Edge, measured from outside on the
//! `iop-edge` and `iop-node` binaries (separate processes, default limits), with the Edge's
//! resident memory and open descriptors read from `/proc`. Prints a Markdown table; numbers go
//! to `benches/README.md`.
//!
//! ```text
//! cargo build --release -p iop-bins && cargo run --release -p iop-benches --bin peer_load
//! IOP_EDGE_BIN=/old/iop-edge IOP_NODE_BIN=/old/iop-node cargo run --release -p iop-benches --bin peer_load
//! ```
//!
//! The configs use only keys every version since the standalone Edge understands (no
//! `[limits]`, no `[auth]`), so the same run measures an older build for comparison.
//!
//! - **stalled**: 4 streaming requests to a provider that sends 16 KiB chunks as fast as it
//!   can, from clients that never read, for up to 15 s: the Edge's peak RSS growth, and how many
//!   streams were cancelled upstream.
//! - **idle**: 200 silent TCP connections to the HTTP port and 200 to the Node port, held
//!   35 s (past the 30 s header timeout): RSS growth per connection, and how many the Edge had closed.
//! - **pings**: a peer with a valid Node certificate sends pings before registering and reads
//!   nothing, for up to 15 s: pings sent, RSS growth, whether and when the Edge closed it (the
//!   register timeout is 10 s; a full outbound queue closes it sooner).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use iop_benches::load::{Killed, bin, free_port, rss_kib};
use iop_tests::pki::{self, Ca};
use iop_tests::upstream::{Kind, Upstream};
use workload_identity::role;

struct Mesh {
    edge: Killed,
    _node: Killed,
    http: u16,
    nodes: u16,
}

fn start(dir: &Path, ca: &Ca, upstream: &Upstream) -> Mesh {
    let edge_leaf = ca.workload(role::EDGE, "edge-1", true);
    let node_leaf = ca.workload(role::NODE, "node-1", false);
    for (name, text) in [
        ("ca.pem", ca.pem()),
        ("edge.pem", edge_leaf.cert_pem.clone()),
        ("edge.key", edge_leaf.key_pem.clone()),
        ("node.pem", node_leaf.cert_pem.clone()),
        ("node.key", node_leaf.key_pem.clone()),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let (http, nodes) = (free_port(), free_port());
    let d = dir.display();
    let model = |name: &str, target: &str| {
        format!(
            "[[models]]\nname = \"{name}\"\n[[models.providers]]\nnode_id = \"node-1\"\nprovider_id = \"{name}\"\nadapter = \"up\"\ntarget = \"{target}\"\ncapacity = 64\n"
        )
    };
    let edge = format!(
        "edge_id = \"edge-1\"\n[listen]\nnodes = \"127.0.0.1:{nodes}\"\nhttp = \"127.0.0.1:{http}\"\n[tls]\ntrust_domain = \"{td}\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/edge.pem\"\nkey = \"{d}/edge.key\"\n[[nodes]]\nnode_id = \"node-1\"\n[[nodes.adapters]]\nname = \"up\"\ntype = \"openai_compat\"\nbase_url = \"{u}\"\ncapacity = 64\n{m1}{m2}",
        td = pki::TRUST_DOMAIN,
        u = upstream.base_url(),
        m1 = model("mesh-model", "fake-model"),
        m2 = model("firehose", "firehose"),
    );
    let node = format!(
        "node_id = \"node-1\"\n[edge]\naddress = \"127.0.0.1:{nodes}\"\nserver_name = \"localhost\"\nname = \"edge-1\"\n[tls]\ntrust_domain = \"{td}\"\nca = \"{d}/ca.pem\"\ncert = \"{d}/node.pem\"\nkey = \"{d}/node.key\"\n[reconnect]\ninterval_sec = 1\nmax_attempts = 0\n",
        td = pki::TRUST_DOMAIN,
    );
    std::fs::write(dir.join("edge.toml"), edge).unwrap();
    std::fs::write(dir.join("node.toml"), node).unwrap();
    let spawn = |var: &str, name: &str, config: &str| {
        Killed(
            Command::new(bin(var, name))
                .arg("--config")
                .arg(dir.join(config))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let edge = spawn("IOP_EDGE_BIN", "iop-edge", "edge.toml");
    let node = spawn("IOP_NODE_BIN", "iop-node", "node.toml");
    let start = Instant::now();
    while !chat_ok(http) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "mesh did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Mesh {
        edge,
        _node: node,
        http,
        nodes,
    }
}

fn chat_ok(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let body = r#"{"model":"mesh-model","messages":[{"role":"user","content":"hi"}]}"#;
    let _ = write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

/// Whether the Edge closed `s` (EOF or reset; not merely nothing to read).
fn closed(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let r = match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    s.set_nonblocking(false).unwrap();
    r
}

fn stalled(m: &Mesh, upstream: &Upstream) -> String {
    let pid = m.edge.0.id();
    let before = rss_kib(pid);
    let body = r#"{"model":"firehose","stream":true,"messages":[]}"#;
    let conns: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", m.http)).unwrap();
            write!(
                s,
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            s
        })
        .collect();
    let start = Instant::now();
    let mut peak = before;
    while start.elapsed() < Duration::from_secs(15) && upstream.dropped_count() < 4 {
        peak = peak.max(rss_kib(pid));
        std::thread::sleep(Duration::from_millis(50));
    }
    let cancelled = upstream.dropped_count();
    let when = start.elapsed();
    drop(conns);
    format!(
        "| 4 stalled streaming readers, fast provider | +{:.1} MiB peak (+{:.1} MiB per reader) | {cancelled} of 4 cancelled upstream{} |",
        (peak - before) as f64 / 1024.0,
        (peak - before) as f64 / 4096.0,
        if cancelled > 0 {
            format!(" after {when:.1?}")
        } else {
            " in 15 s".into()
        }
    )
}

fn idle(m: &Mesh) -> String {
    let pid = m.edge.0.id();
    let before = rss_kib(pid);
    let mut http: Vec<TcpStream> = (0..200)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", m.http)).ok())
        .collect();
    let mut nodes: Vec<TcpStream> = (0..200)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", m.nodes)).ok())
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let held = rss_kib(pid);
    std::thread::sleep(Duration::from_secs(34));
    let http_closed = http.iter_mut().map(closed).filter(|c| *c).count();
    let nodes_closed = nodes.iter_mut().map(closed).filter(|c| *c).count();
    format!(
        "| 200 silent HTTP + 200 silent Node-port connections, 35 s | +{:.1} KiB per connection (after 1 s) | closed by the Edge: {http_closed} HTTP, {nodes_closed} Node-port |",
        held.saturating_sub(before) as f64 / 400.0
    )
}

fn pings(m: &Mesh, ca: &Ca) -> String {
    let pid = m.edge.0.id();
    let before = rss_kib(pid);
    let config = pki::node_client_tls(ca, role::NODE, "node-1", "edge-1");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (sent, peak, closed_after) = rt.block_on(async {
        use tokio::io::AsyncWriteExt as _;
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", m.nodes))
            .await
            .unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap();
        let codec = iop_wire::codec::FrameCodec::new();
        let mut batch = bytes::BytesMut::new();
        for _ in 0..1000 {
            let ping =
                iop_wire::runtime::RuntimeFrame::new(iop_wire::runtime::RuntimeMessage::Ping);
            codec.encode(&ping, &mut batch).unwrap();
        }
        let batch = batch.freeze();
        let start = Instant::now();
        let (mut sent, mut peak, mut closed) = (0u64, before, false);
        while start.elapsed() < Duration::from_secs(15) {
            match tokio::time::timeout(Duration::from_secs(2), tls.write_all(&batch)).await {
                Ok(Ok(())) => sent += 1000,
                Ok(Err(_)) => {
                    closed = true;
                    break;
                }
                Err(_) => {}
            }
            peak = peak.max(rss_kib(pid));
        }
        (sent, peak, closed.then(|| start.elapsed()))
    });
    format!(
        "| pings before registering, reading nothing (≤ 15 s) | +{:.1} MiB peak after {sent} pings | {} |",
        (peak.saturating_sub(before)) as f64 / 1024.0,
        closed_after.map_or_else(
            || "still open after 15 s".to_owned(),
            |t| format!("closed by the Edge after {t:.1?}")
        )
    )
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, "", "fake-model"));
    let ca = Ca::new("peer_load CA");
    let dir = std::env::temp_dir().join(format!("iop-peer-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    println!(
        "# peer_load: {}\n",
        bin("IOP_EDGE_BIN", "iop-edge").display()
    );
    println!("| probe | Edge memory | outcome |\n|---|---:|---|");
    for scenario in ["stalled", "idle", "pings"] {
        // A fresh mesh per probe, so one does not pay for another.
        let m = start(&dir, &ca, &upstream);
        let row = match scenario {
            "stalled" => stalled(&m, &upstream),
            "idle" => idle(&m),
            _ => pings(&m, &ca),
        };
        println!("{row}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
