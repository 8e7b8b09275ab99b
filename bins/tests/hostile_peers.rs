//! The Edge bounded under slow and hostile peers, probed from outside as an attacker would: the
//! `iop-edge` and `iop-node` binaries as processes, raw sockets, the Edge's resident memory and
//! open descriptors read from `/proc`. One test per way a peer can cost the Edge:
//!
//! - streaming clients that never read, on a provider that sends as fast as it can: the Edge's
//!   memory stays bounded, each stalled stream is ended and cancelled upstream, and a normal
//!   stream on the same Node connection completes meanwhile;
//! - slowloris (headers one byte at a time) and silent HTTP connections: closed by the header
//!   timeout while the API keeps answering;
//! - TCP connections to the Node port that never start TLS, and a TLS-authenticated Node that
//!   never registers: closed by their timeouts;
//! - the Node port flooded with silent connections beyond the handshake cap, under a low
//!   file-descriptor limit: the extras are closed at once and the HTTP API keeps answering;
//! - a Node certificate holder that floods pings before registering and reads nothing: its
//!   connection is closed (its pongs fill its queue) with bounded memory.
//!
//! The limits are the `[limits]` of the Edge's config, set low here so that each test takes
//! seconds; every wait is for an observable event, bounded by a generous limit.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod support;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use iop_tests::upstream::{Kind, Upstream};
use support::{Proc, TempDir, wait_until};

const KEY: &str = "gw-hostile-key";
const UPSTREAM_KEY: &str = "sk-hostile-upstream";
const LIMIT: Duration = Duration::from_secs(30);

const LIMITS: &str = r#"
[[models]]
name = "firehose"
[[models.providers]]
node_id = "node-1"
provider_id = "firehose-1"
adapter = "upstream"
target = "firehose"
capacity = 8
[limits]
tls_handshake_timeout_sec = 1
register_timeout_sec = 2
max_unauthenticated = 64
max_unauthenticated_per_ip = 64
stream_buffer_bytes = 1048576
slow_consumer_timeout_sec = 2
http_header_timeout_sec = 2
http_body_timeout_sec = 2
"#;

struct Mesh {
    dir: TempDir,
    upstream: Upstream,
    edge: Proc,
    _node: Option<Proc>,
    http: u16,
    nodes: u16,
    _rt: tokio::runtime::Runtime,
}

/// Edge and (optionally) Node processes; `wrap` runs the Edge under `bash -c` with a prefix
/// (e.g. `ulimit -n 256;`).
fn mesh(with_node: bool, wrap: Option<&str>) -> Mesh {
    mesh_with(with_node, wrap, LIMITS)
}

fn mesh_with(with_node: bool, wrap: Option<&str>, limits: &str) -> Mesh {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let upstream = rt.block_on(Upstream::start(Kind::ChatOnly, UPSTREAM_KEY, "fake-model"));
    let dir = TempDir::new("hostile");
    support::pki(dir.path(), &["node-1"]);
    let ports =
        support::edge_config_with(dir.path(), &upstream.base_url(), "chat_only", KEY, limits);
    let edge = match wrap {
        None => support::spawn_edge(dir.path(), &[]),
        Some(prefix) => {
            let script = format!(
                "{prefix} exec {} --config {}",
                env!("CARGO_BIN_EXE_iop-edge"),
                dir.path().join("edge.toml").display()
            );
            Proc::spawn("bash", &["-c", &script], &[], dir.path(), "edge")
        }
    };
    let node = with_node
        .then(|| support::spawn_node(dir.path(), "node-1", ports.nodes, UPSTREAM_KEY, &[]));
    let http = ports.http;
    wait_until("the Edge to serve", LIMIT, || {
        edge.log_text().contains("HTTP API on")
    });
    if with_node {
        wait_until("the Node to be ready", LIMIT, || chat_ok(http));
    }
    Mesh {
        dir,
        upstream,
        edge,
        _node: node,
        http,
        nodes: ports.nodes,
        _rt: rt,
    }
}

fn chat_ok(port: u16) -> bool {
    let (status, body) = support::http_post(
        &format!("http://127.0.0.1:{port}/v1/chat/completions"),
        &[("authorization", &format!("Bearer {KEY}"))],
        r#"{"model":"mesh-model","messages":[{"role":"user","content":"still answering"}]}"#,
    );
    status == 200 && body.contains("echo: still answering")
}

/// Whether the server closed `s` (EOF or reset) — without waiting longer than `wait`.
fn closed_by_server(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn stalled_readers_cost_a_bounded_buffer_and_are_cancelled_upstream() {
    let m = mesh(true, None);
    let pid = m.edge.child.id();
    let before = iop_tests::proc::rss_kib(pid);
    // Four clients ask for an endless fast stream and never read a byte of it.
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
        r#"{"model":"firehose","stream":true,"messages":[]}"#.len(),
        r#"{"model":"firehose","stream":true,"messages":[]}"#
    );
    let stalled: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", m.http)).unwrap();
            s.write_all(request.as_bytes()).unwrap();
            s
        })
        .collect();
    // Meanwhile a normal client on the same Node connection gets its whole answer.
    let t = Instant::now();
    assert!(
        chat_ok(m.http),
        "a normal request completes while four readers are stalled"
    );
    println!("normal request beside 4 stalled streams: {:?}", t.elapsed());
    let mut peak = before;
    let started = Instant::now();
    while m.upstream.dropped_count() < 4 {
        peak = peak.max(iop_tests::proc::rss_kib(pid));
        assert!(
            started.elapsed() < LIMIT,
            "{} of 4 stalled streams cancelled upstream\nedge:\n{}\nnode:\n{}",
            m.upstream.dropped_count(),
            m.edge.log_text(),
            m._node.as_ref().map(Proc::log_text).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "stalled streams cancelled upstream after {:?}; Edge RSS {before} KiB → peak {peak} KiB (+{} KiB)",
        started.elapsed(),
        peak.saturating_sub(before)
    );
    // 4 × the 1 MiB stream bound, plus sockets and allocator slack; before the bound this
    // probe grew the Edge by ≈53 MiB per stalled reader.
    assert!(
        peak.saturating_sub(before) < 48 * 1024,
        "Edge RSS grew by {} KiB",
        peak - before
    );
    let (_, metrics) = support::http_get(&format!("http://127.0.0.1:{}/metrics", m.http), &[]);
    assert!(
        metrics.contains("iop_edge_slow_consumers_total 4"),
        "{metrics}"
    );
    assert!(chat_ok(m.http));
    drop(stalled);
}

#[test]
fn a_reader_that_stops_under_the_byte_bound_is_ended_by_the_slow_consumer_timeout() {
    // A generous byte bound, so that only the timeout can end the stream: 64 KiB every 100 ms
    // fills the sockets' buffers, then the Edge's, more slowly than 64 MiB.
    let limits = LIMITS
        .replace(
            "stream_buffer_bytes = 1048576",
            "stream_buffer_bytes = 67108864",
        )
        .replace("target = \"firehose\"", "target = \"trickle\"");
    let m = mesh_with(true, None, &limits);
    let body = r#"{"model":"firehose","stream":true,"messages":[]}"#;
    let mut s = TcpStream::connect(("127.0.0.1", m.http)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let started = Instant::now();
    wait_until(
        "the stalled stream to be cancelled upstream",
        Duration::from_secs(120),
        || m.upstream.dropped_count() >= 1,
    );
    println!(
        "a reader stopped under the byte bound: cancelled upstream after {:?}",
        started.elapsed()
    );
    let (_, metrics) = support::http_get(&format!("http://127.0.0.1:{}/metrics", m.http), &[]);
    assert!(
        metrics.contains("iop_edge_slow_consumers_total 1"),
        "{metrics}"
    );
    assert!(m.edge.log_text().contains("slow consumer"));
    drop(s);
}

#[test]
fn slowloris_and_silent_http_connections_are_closed_while_the_api_answers() {
    let m = mesh(true, None);
    let mut dripping: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(("127.0.0.1", m.http)).unwrap())
        .collect();
    let mut silent: Vec<TcpStream> = (0..50)
        .map(|_| TcpStream::connect(("127.0.0.1", m.http)).unwrap())
        .collect();
    let start = Instant::now();
    let header = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n";
    // One header byte per 250 ms from each dripping client, until the Edge hangs up on it.
    let mut open = dripping.len();
    let mut i = 0;
    while open > 0 {
        assert!(
            start.elapsed() < LIMIT,
            "{open} slowloris connections still open"
        );
        open = 0;
        for s in &mut dripping {
            if s.write_all(&header[i % header.len()..][..1]).is_ok() {
                open += 1;
            }
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(250));
        assert!(chat_ok(m.http), "the API answers during the attack");
    }
    let dripped_for = start.elapsed();
    for s in &mut silent {
        assert!(closed_by_server(s, LIMIT), "a silent connection was closed");
    }
    println!("slowloris closed after {dripped_for:?} (header timeout 2 s); silent ones too");
    // The body, too, must arrive in time.
    let mut s = TcpStream::connect(("127.0.0.1", m.http)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{"
    )
    .unwrap();
    let mut answer = String::new();
    s.set_read_timeout(Some(LIMIT)).unwrap();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("request body not received within 2 s"),
        "{answer}"
    );
}

#[test]
fn node_port_handshake_and_registration_have_deadlines() {
    let m = mesh(false, None);
    // Never start TLS: closed after the 1 s handshake timeout.
    let mut idle: Vec<TcpStream> = (0..50)
        .map(|_| TcpStream::connect(("127.0.0.1", m.nodes)).unwrap())
        .collect();
    let t = Instant::now();
    for s in &mut idle {
        assert!(closed_by_server(s, LIMIT), "pre-TLS connection closed");
    }
    println!("50 pre-TLS connections closed after {:?}", t.elapsed());
    // A valid Node certificate that never registers: closed after the 2 s register timeout.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t = Instant::now();
    let closed = rt.block_on(async {
        let mut tls = node_tls(&m).await;
        let mut buf = [0u8; 1024];
        use tokio::io::AsyncReadExt as _;
        loop {
            match tokio::time::timeout(LIMIT, tls.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(_)) => {}
                Err(_) => return false,
            }
        }
    });
    assert!(closed, "an unregistered Node connection is closed");
    println!(
        "unregistered Node connection closed after {:?}",
        t.elapsed()
    );
    assert!(
        closed,
        "the Edge did not drop the connection within {LIMIT:?}"
    );
    wait_until("the close to be logged", LIMIT, || {
        m.edge.log_text().contains("handshake_timeout")
    });
}

#[test]
fn a_flooded_node_port_under_a_low_fd_limit_leaves_the_http_api_answering() {
    // 256 descriptors in all for the Edge; the flood alone would take them.
    let m = mesh(true, Some("ulimit -n 256;"));
    let pid = m.edge.child.id();
    let mut flood = Vec::new();
    for _ in 0..300 {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", m.nodes)) {
            flood.push(s);
        }
    }
    let t = Instant::now();
    assert!(
        chat_ok(m.http),
        "the HTTP API answers while the Node port is flooded"
    );
    println!(
        "chat during the flood: {:?}; Edge open fds {}",
        t.elapsed(),
        iop_tests::proc::fd_count(pid)
    );
    assert!(
        iop_tests::proc::fd_count(pid) < 200,
        "{} fds",
        iop_tests::proc::fd_count(pid)
    );
    // The extras were closed at once; all of them within the handshake timeout.
    let mut closed = 0;
    for s in &mut flood {
        if closed_by_server(s, LIMIT) {
            closed += 1;
        }
    }
    assert_eq!(closed, flood.len(), "every silent connection was closed");
    assert!(chat_ok(m.http));
    let (_, metrics) = support::http_get(&format!("http://127.0.0.1:{}/metrics", m.http), &[]);
    assert!(
        metrics.contains("iop_edge_node_connections_refused_total{reason=\"capacity\"}"),
        "{metrics}"
    );
    // Refusals are counted, not logged one line each.
    let lines = m.edge.log_text().matches("node connection refused").count();
    assert!(lines <= 3, "{lines} refusal lines:\n{}", m.edge.log_text());
}

#[test]
fn a_ping_flood_before_registering_is_closed_with_bounded_memory() {
    let m = mesh(false, None);
    let pid = m.edge.child.id();
    let before = iop_tests::proc::rss_kib(pid);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (sent, peak, closed) = rt.block_on(async {
        use tokio::io::AsyncWriteExt as _;
        let mut tls = node_tls(&m).await;
        let codec = iop_wire::codec::FrameCodec::new();
        let mut batch = bytes::BytesMut::new();
        for _ in 0..1000 {
            let ping =
                iop_wire::runtime::RuntimeFrame::new(iop_wire::runtime::RuntimeMessage::Ping);
            codec.encode(&ping, &mut batch).unwrap();
        }
        let batch = batch.freeze();
        let mut sent = 0u64;
        let mut peak = before;
        // Pings as fast as the Edge takes them, reading nothing, until it hangs up: a write
        // fails only once the Edge has dropped the socket (a blocked write is woken by the
        // reset), not merely logged that it closes it.
        let start = Instant::now();
        let mut closed = false;
        while start.elapsed() < LIMIT {
            match tokio::time::timeout(Duration::from_secs(1), tls.write_all(&batch)).await {
                Ok(Ok(())) => sent += 1000,
                Ok(Err(_)) => {
                    closed = true;
                    break;
                }
                Err(_) => {}
            }
            peak = peak.max(iop_tests::proc::rss_kib(pid));
        }
        (sent, peak, closed)
    });
    println!(
        "{sent} pings sent before the Edge closed the connection; Edge RSS {before} → peak {peak} KiB"
    );
    assert!(
        peak.saturating_sub(before) < 32 * 1024,
        "Edge RSS grew by {} KiB",
        peak - before
    );
    assert!(
        closed,
        "the Edge did not drop the connection within {LIMIT:?}"
    );
    wait_until("the close to be logged", LIMIT, || {
        let log = m.edge.log_text();
        log.contains("not reading its frames") || log.contains("handshake_timeout")
    });
    // Closed and forgotten: a fresh Node registers fine.
    let node_toml = support::node_config(m.dir.path(), "node-1", m.nodes);
    let _node = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-node"),
        &["--config", node_toml.to_str().unwrap()],
        &[("UPSTREAM_KEY", UPSTREAM_KEY)],
        m.dir.path(),
        "node-after",
    );
    wait_until("a Node to be ready after the flood", LIMIT, || {
        chat_ok(m.http)
    });
}

/// A TLS connection to the Node port with node-1's certificate.
async fn node_tls(m: &Mesh) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let read = |p: &str| std::fs::read(m.dir.path().join(p)).unwrap();
    let tls = workload_identity::WorkloadTls::from_pem(
        &read("ca/ca.pem"),
        &read("node-1.pem"),
        &read("node-1.key"),
    )
    .unwrap();
    let expected =
        workload_identity::ExpectedPeer::exact("iop.test", workload_identity::role::EDGE, "edge-1")
            .unwrap();
    let config = std::sync::Arc::new(tls.client_config(expected).unwrap());
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", m.nodes))
        .await
        .unwrap();
    tokio_rustls::TlsConnector::from(config)
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap()
}
