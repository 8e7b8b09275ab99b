//! `mesh_load`: a load tool for the Edge ⇄ Node runtime over real loopback mTLS, with its
//! baselines measured in the same run. Prints a table; numbers go to `benches/README.md`.
//!
//! ```text
//! cargo run --release -p iop-benches --bin mesh_load            # all three parts
//! cargo run --release -p iop-benches --bin mesh_load -- latency # or: throughput, idle
//! cargo run --release -p iop-benches --bin mesh_load -- storm   # not in the default set
//! ```
//!
//! - **latency**: small streamed chat completions (6 SSE events) at a fixed rate, through
//!   Edge → Node (`openai_compat` tunnel) → local provider, against the same requests sent
//!   straight to the provider; p50/p99 of time to the last byte, and the added latency.
//! - **throughput**: one bulk SSE stream through the tunnel, against the same provider called
//!   directly, against raw TLS 1.3 on loopback, and against the relay floor (the provider's
//!   response copied by a bare relay into one TLS connection: the mesh's hops without its
//!   code; once by one task that reads then writes, once by a reader task and a writer task
//!   that run at the same time); rates and this process's CPU per MiB.
//!   `MESH_LOAD_PROFILE_MESH=N` runs only the mesh path, N times (for `perf record`).
//! - **idle**: memory per idle connected Node at the Edge: the Edge runs in a child process
//!   (this binary with `--edge-child`) and its RSS is read from `/proc` before and after N Nodes
//!   (default 1000) connect and become ready.
//! - **storm**: a restarted Edge's reconnect storm: `MESH_LOAD_NODES` (default 5000) Nodes with
//!   their own supervisors (`STORM_INTERVAL` s, default 1, 20 % jitter) connected to an Edge
//!   child, which is killed and restarted on the same port; time until all are ready again,
//!   double registrations and fences, RSS, against the raw mTLS handshake rate (8 concurrent,
//!   the same certificates, a child process doing only handshakes) measured in the same run.
//!
//! Everything runs on 127.0.0.1 and stops by itself.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::convert::Infallible;
use std::io::BufRead as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::{get, post};
use bytes::Bytes;
use iop_edge::registry::RegistryConfig;
use iop_edge::{EdgeHandle, Lifecycle, TransportConfig, TunnelEvent, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::{Ca, TRUST_DOMAIN};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, Header, NodeConfigPayload,
    OpenAiCompatSettings, Operation, ProviderTunnelRequest,
};
use iop_wire::tunnel_order::Delivery;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;
use workload_identity::{ExpectedPeer, client_cert_verifier, role};

use iop_benches::load::{at_rate, cpu, edge_tls, ms, node_tls, percentile, rss_kib};

const SMALL_EVENTS: usize = 6;
const BULK_BYTES: usize = 256 * 1024 * 1024;
const BULK_CHUNK: usize = 64 * 1024;

fn small_body() -> Vec<Bytes> {
    (0..SMALL_EVENTS)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"id\":\"c\",\"choices\":[{{\"delta\":{{\"content\":\"tok{i}\"}}}}]}}\n\n"
            ))
        })
        .collect()
}

async fn provider() -> SocketAddr {
    let app = Router::new()
        .route(
            "/v1/models",
            get(|| async { "{\"data\":[{\"id\":\"m\"}]}" }),
        )
        .route(
            "/v1/chat/completions",
            post(|| async {
                let chunks: Vec<Result<Bytes, Infallible>> =
                    small_body().into_iter().map(Ok).collect();
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(futures_util::stream::iter(chunks)))
                    .unwrap()
            }),
        )
        .route(
            "/v1/bulk",
            post(|| async {
                let chunk = Bytes::from(vec![b'x'; BULK_CHUNK]);
                let n = BULK_BYTES / BULK_CHUNK;
                let stream = futures_util::stream::iter(
                    (0..n).map(move |_| Ok::<_, Infallible>(chunk.clone())),
                );
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(stream))
                    .unwrap()
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn adapter_config(provider: SocketAddr) -> NodeConfigPayload {
    NodeConfigPayload {
        adapters: vec![AdapterConfig {
            name: "openai-a".into(),
            adapter_type: "openai_compat".into(),
            enabled: true,
            capacity: 1024,
            long_context_capacity: 0,
            targets: vec!["m".into()],
            settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                base_url: format!("http://{provider}/v1"),
                protocol_profile: ConcreteProtocolProfile {
                    name: "openai".into(),
                    operation_paths: [(Operation::ChatCompletions, "/chat/completions".to_owned())]
                        .into_iter()
                        .collect(),
                    ..Default::default()
                },
                request_timeout_sec: 600,
            }),
        }],
        ..Default::default()
    }
}

async fn mesh(ca: &Ca, provider: SocketAddr) -> EdgeHandle {
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), edge_tls(ca));
    cfg.node_configs = vec![("node-1".into(), adapter_config(provider))];
    // Without per-stream credit (`MESH_LOAD_WINDOW=0`, as before #33) a reader slower than
    // the Node, however fast, is cut once it is `max_stream_buffer` behind (4 MiB by default).
    // This tool's reader shares the two cores with the Node and the provider and can fall that
    // far behind on a 256 MiB stream; the bound is raised so that the throughput of the path
    // is what is measured. With credit (the default window, 1 MiB) the Node paces itself.
    cfg.max_stream_buffer = 1 << 30;
    cfg.stream_window = std::env::var("MESH_LOAD_WINDOW")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cfg.stream_window);
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    let opts = NodeOptions::new(
        "node-1",
        &edge.local_addr().to_string(),
        "localhost",
        node_tls(ca, "node-1"),
    )
    .unwrap()
    .with_adapters(AdapterRegistry::with_builtins());
    tokio::spawn(run_node(opts, CancellationToken::new()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    edge
}

fn tunnel_request(id: u64, operation: Option<Operation>, path: &str) -> ProviderTunnelRequest {
    ProviderTunnelRequest {
        run_id: format!("r{id}"),
        adapter: "openai-a".into(),
        target: "m".into(),
        method: "POST".into(),
        path: path.into(),
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body: Bytes::from_static(b"{\"model\":\"m\",\"stream\":true}"),
        stream: true,
        operation,
        ..Default::default()
    }
}

/// Runs one tunnel to its terminal; returns body bytes.
async fn tunnel_once(edge: &EdgeHandle, req: ProviderTunnelRequest) -> usize {
    let mut s = edge.tunnel("node-1", req).await.unwrap();
    let mut n = 0;
    while let Some(ev) = s.next().await {
        match ev {
            TunnelEvent::Frame(Delivery::Body(b)) => n += b.len(),
            TunnelEvent::Frame(Delivery::End { .. }) => break,
            TunnelEvent::Frame(Delivery::Start { .. } | Delivery::Usage(_)) => {}
            other => panic!("tunnel failed: {other:?}"),
        }
    }
    n
}

async fn direct_once(client: &reqwest::Client, url: &str) -> usize {
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body("{\"model\":\"m\",\"stream\":true}")
        .send()
        .await
        .unwrap();
    let mut n = 0;
    let mut body = resp.bytes_stream();
    while let Some(chunk) = futures_util::StreamExt::next(&mut body).await {
        n += chunk.unwrap().len();
    }
    n
}

async fn latency(ca: &Ca) {
    let p = provider().await;
    let edge = mesh(ca, p).await;
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let url = format!("http://{p}/v1/chat/completions");
    let (rate, count) = (200, 2000);
    // Warm up both paths (connection pools, JIT of nothing, page faults).
    for i in 0..50 {
        tunnel_once(
            &edge,
            tunnel_request(1_000_000 + i, Some(Operation::ChatCompletions), ""),
        )
        .await;
        direct_once(&client, &url).await;
    }
    let c = client.clone();
    let u = url.clone();
    let direct = at_rate(rate, count, move |_| {
        let (c, u) = (c.clone(), u.clone());
        async move {
            direct_once(&c, &u).await;
        }
    })
    .await;
    let e = edge.clone();
    let mesh = at_rate(rate, count, move |i| {
        let e = e.clone();
        async move {
            tunnel_once(&e, tunnel_request(i, Some(Operation::ChatCompletions), "")).await;
        }
    })
    .await;
    println!("\n## latency: {count} small streamed completions at {rate}/s (time to last byte)\n");
    println!("| path | p50 | p99 |");
    println!("|---|---:|---:|");
    let row = |name: &str, v: &[Duration]| {
        println!(
            "| {name} | {:.3} ms | {:.3} ms |",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99))
        )
    };
    row("direct to provider (baseline)", &direct);
    row("edge → node → provider", &mesh);
    println!(
        "| **added by the mesh** | **{:.3} ms** | **{:.3} ms** |",
        ms(percentile(&mesh, 0.5)) - ms(percentile(&direct, 0.5)),
        ms(percentile(&mesh, 0.99)) - ms(percentile(&direct, 0.99))
    );
}

/// Raw TLS 1.3 loopback: the same number of bytes, server → client, in 64 KiB writes.
async fn raw_tls_throughput(ca: &Ca) -> f64 {
    let (acceptor, connector) = tls_pair(ca);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let mut tls = acceptor.accept(tcp).await.unwrap();
        let chunk = vec![b'x'; BULK_CHUNK];
        for _ in 0..BULK_BYTES / BULK_CHUNK {
            tls.write_all(&chunk).await.unwrap();
        }
        tls.shutdown().await.ok();
    });
    let t = Instant::now();
    let n = read_tls_to_end(&connector, addr).await;
    assert_eq!(n, BULK_BYTES);
    n as f64 / t.elapsed().as_secs_f64()
}

/// The bare relay floor: the mesh's hops without its code. A relay reads the provider's
/// HTTP/1.1 response (the same provider, plain TCP, 64 KiB reads) and copies the bytes as they
/// come into one TLS 1.3 connection, whose reader counts them: a provider hop and a TLS hop,
/// as Edge → Node → provider has, with nothing parsed, framed or credited. Returns the body's
/// bytes per second (the count includes the response's head and chunk sizes).
///
/// With `pipelined`, the relay reads the provider in one task and writes TLS in another (a
/// channel of eight 64 KiB chunks between them), so that the read and the encryption run on
/// both cores at once, as the mesh's Node and Edge do; without it, one task reads and then
/// writes, as `tokio::io::copy` does.
async fn relay_floor_throughput(ca: &Ca, provider: SocketAddr, pipelined: bool) -> f64 {
    let (acceptor, connector) = tls_pair(ca);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let mut tls = acceptor.accept(tcp).await.unwrap();
        let mut up = tokio::net::TcpStream::connect(provider).await.unwrap();
        up.set_nodelay(true).unwrap();
        let body = "{\"model\":\"m\",\"stream\":true}";
        up.write_all(
            format!(
                "POST /v1/bulk HTTP/1.1\r\nhost: provider\r\nconnection: close\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        if pipelined {
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(8);
            tokio::spawn(async move {
                loop {
                    let mut buf = vec![0u8; BULK_CHUNK];
                    match up.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => {
                            buf.truncate(k);
                            if tx.send(buf).await.is_err() {
                                break;
                            }
                        }
                    }
                }
            });
            while let Some(chunk) = rx.recv().await {
                tls.write_all(&chunk).await.unwrap();
            }
        } else {
            let mut buf = vec![0u8; BULK_CHUNK];
            loop {
                match up.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => tls.write_all(&buf[..k]).await.unwrap(),
                }
            }
        }
        tls.shutdown().await.ok();
    });
    let t = Instant::now();
    let n = read_tls_to_end(&connector, addr).await;
    assert!(n >= BULK_BYTES, "the relay forwarded {n} bytes");
    BULK_BYTES as f64 / t.elapsed().as_secs_f64()
}

/// A TLS 1.3 server (the Edge's leaf) and a client trusting it, both on ring.
fn tls_pair(ca: &Ca) -> (tokio_rustls::TlsAcceptor, tokio_rustls::TlsConnector) {
    let leaf = ca.workload(role::EDGE, "edge-1", true);
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(leaf.chain.clone(), leaf.key())
    .unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(ca.roots())
    .with_no_client_auth();
    (
        tokio_rustls::TlsAcceptor::from(Arc::new(server)),
        tokio_rustls::TlsConnector::from(Arc::new(client)),
    )
}

/// Connects to `addr` and reads until the server closes; returns the bytes read.
async fn read_tls_to_end(connector: &tokio_rustls::TlsConnector, addr: SocketAddr) -> usize {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let mut tls = connector
        .connect(
            rustls_pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let mut buf = vec![0u8; BULK_CHUNK];
    let mut n = 0;
    loop {
        match tls.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    n
}

/// Runs `f`, returning its rate (bytes per second, from what it returns) and the CPU this
/// process spent per MiB meanwhile (every part runs in this process).
async fn rate_and_cpu<F: Future<Output = f64>>(f: F) -> (f64, Duration) {
    let pid = std::process::id();
    let cpu0 = cpu(pid);
    let t = Instant::now();
    let rate = f.await;
    let bytes = rate * t.elapsed().as_secs_f64();
    let spent = cpu(pid).saturating_sub(cpu0);
    (rate, spent.div_f64(bytes / (1024.0 * 1024.0)))
}

async fn throughput(ca: &Ca) {
    let p = provider().await;
    let edge = mesh(ca, p).await;
    if let Some(times) = std::env::var("MESH_LOAD_PROFILE_MESH")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        // Only the mesh path, `times` times: for `perf record`, without the baselines.
        for i in 0..times {
            let (rate, cpu) = rate_and_cpu(async {
                let t = Instant::now();
                let n = tunnel_once(&edge, tunnel_request(100 + i, None, "/bulk")).await;
                n as f64 / t.elapsed().as_secs_f64()
            })
            .await;
            println!(
                "mesh: {:.0} MiB/s, {:.3} ms CPU per MiB",
                rate / (1024.0 * 1024.0),
                cpu.as_secs_f64() * 1e3
            );
        }
        return;
    }
    let client = reqwest::Client::new();
    let raw = rate_and_cpu(raw_tls_throughput(ca)).await;
    let floor = rate_and_cpu(relay_floor_throughput(ca, p, false)).await;
    let floor2 = rate_and_cpu(relay_floor_throughput(ca, p, true)).await;
    let direct = rate_and_cpu(async {
        let t = Instant::now();
        let n = direct_once(&client, &format!("http://{p}/v1/bulk")).await;
        n as f64 / t.elapsed().as_secs_f64()
    })
    .await;
    let mesh = rate_and_cpu(async {
        let t = Instant::now();
        let n = tunnel_once(&edge, tunnel_request(7, None, "/bulk")).await;
        assert_eq!(n, BULK_BYTES);
        n as f64 / t.elapsed().as_secs_f64()
    })
    .await;
    let mib = |b: f64| b / (1024.0 * 1024.0);
    println!("\n## throughput: one {} MiB SSE stream\n", BULK_BYTES >> 20);
    println!(
        "| path | MiB/s | vs raw TLS | vs one-task relay | vs two-task relay | CPU ms per MiB (both cores) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, (rate, cpu)) in [
        ("raw TLS 1.3 loopback (baseline)", raw),
        ("relay floor, one task: provider → bare relay → TLS", floor),
        ("relay floor, two tasks (read ∥ encrypt)", floor2),
        ("direct to provider (HTTP/1.1)", direct),
        ("edge → node → provider", mesh),
    ] {
        println!(
            "| {name} | {:.0} | {:.2}× | {:.2}× | {:.2}× | {:.3} |",
            mib(rate),
            rate / raw.0,
            rate / floor.0,
            rate / floor2.0,
            cpu.as_secs_f64() * 1e3
        );
    }
}

async fn idle(ca: &Ca, nodes: usize) {
    let dir = child_dir(ca, "idle");
    let (mut child, lines, addr) = spawn_child("--edge-child", &dir, 0);
    let pid = child.id();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pid);
    let shutdown = CancellationToken::new();
    let t = Instant::now();
    for i in 0..nodes {
        let name = format!("node-{i}");
        let opts =
            NodeOptions::new(&name, &addr.to_string(), "localhost", node_tls(ca, &name)).unwrap();
        tokio::spawn(run_node(opts, shutdown.clone()));
    }
    let ready = tokio::task::spawn_blocking(move || {
        for line in lines {
            let line = line.unwrap();
            if line == format!("ready {nodes}") {
                return true;
            }
        }
        false
    })
    .await
    .unwrap();
    assert!(ready, "all nodes ready");
    let connect = t.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib(pid);
    // Idle cost: the Edge's CPU, and this process's (the Nodes'), over a window with every
    // Node ready and nothing to run (heartbeats, and the timers behind them).
    let window = Duration::from_secs(10);
    let (edge0, nodes0) = (cpu(pid), cpu(std::process::id()));
    tokio::time::sleep(window).await;
    let (edge_idle, nodes_idle) = (cpu(pid) - edge0, cpu(std::process::id()) - nodes0);
    child.kill().ok();
    child.wait().ok();
    shutdown.cancel();
    println!("\n## idle connected Nodes at the Edge ({nodes} Nodes, mTLS, ready)\n");
    println!("| measure | value |");
    println!("|---|---:|");
    println!("| Edge RSS before | {:.1} MiB |", before as f64 / 1024.0);
    println!(
        "| Edge RSS with {nodes} ready Nodes | {:.1} MiB |",
        after as f64 / 1024.0
    );
    println!(
        "| **per connected Node** | **{:.1} KiB** |",
        (after.saturating_sub(before)) as f64 / nodes as f64
    );
    let per_node_s = |d: Duration| d.as_secs_f64() * 1e6 / nodes as f64 / window.as_secs_f64();
    println!(
        "| Edge CPU per idle Node, per second ({} s window) | {:.2} µs |",
        window.as_secs(),
        per_node_s(edge_idle)
    );
    println!(
        "| a Node's CPU idle, per second (this process, all Nodes) | {:.2} µs |",
        per_node_s(nodes_idle)
    );
    println!(
        "| time to connect + register + ready all | {:.2} s ({:.0} Nodes/s) |",
        connect.as_secs_f64(),
        nodes as f64 / connect.as_secs_f64()
    );
}

/// The server side of the storm's baseline, in its own process like the Edge: accepts on
/// `port`, completes the mTLS handshake with the Edge's own server config, drops the
/// connection. Prints its address.
async fn tls_child(dir: &std::path::Path, port: u16) {
    let tls = child_tls(dir);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    println!("{}", listener.local_addr().unwrap());
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let _ = acceptor.accept(tcp).await;
        });
    }
}

/// The Edge's server TLS config from the files `idle` and `storm` write.
fn child_tls(dir: &std::path::Path) -> Arc<rustls::ServerConfig> {
    use rustls_pki_types::pem::PemObject as _;
    let ca = std::fs::read(dir.join("ca.pem")).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_slice_iter(&ca) {
        roots.add(c.unwrap()).unwrap();
    }
    let chain = rustls_pki_types::CertificateDer::pem_file_iter(dir.join("edge.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls_pki_types::PrivateKeyDer::from_pem_file(dir.join("edge.key")).unwrap();
    let verifier = client_cert_verifier(
        Arc::new(roots),
        ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).unwrap(),
    )
    .unwrap();
    Arc::new(workload_identity::server_config(chain, key, verifier).unwrap())
}

/// Writes the CA and the Edge's certificate and key for a child process.
fn child_dir(ca: &Ca, name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mesh-load-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let leaf = ca.workload(role::EDGE, "edge-1", true);
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("edge.pem"), &leaf.cert_pem).unwrap();
    std::fs::write(dir.join("edge.key"), &leaf.key_pem).unwrap();
    dir
}

/// Starts this binary as a child (`mode`, `dir`, `port`) and reads the address it prints.
fn spawn_child(
    mode: &str,
    dir: &std::path::Path,
    port: u16,
) -> (
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    SocketAddr,
) {
    // `MESH_LOAD_CHILD_WRAP="heaptrack -o /tmp/edge"` (or `perf record -g -o …`) runs the child
    // under a profiler.
    let wrap = std::env::var("MESH_LOAD_CHILD_WRAP").unwrap_or_default();
    let mut words = wrap.split_whitespace();
    let exe = std::env::current_exe().unwrap();
    let mut child = match words.next() {
        Some(tool) => {
            let mut c = std::process::Command::new(tool);
            c.args(words).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    };
    let mut child = child
        .arg(mode)
        .arg(dir)
        .arg(port.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    // The first line that is an address (a profiler's wrapper may print before it).
    let addr: SocketAddr = loop {
        if let Ok(a) = lines.next().unwrap().unwrap().parse() {
            break a;
        }
    };
    (child, lines, addr)
}

/// Reconnect storm: `nodes` Nodes (their own supervisors: `interval_sec` = `STORM_INTERVAL`,
/// default 1, the default 20 % downward jitter, unlimited attempts) connected to an Edge in a
/// child process; the Edge is killed (SIGKILL) and restarted on the same port; time until every
/// Node is ready again, against the raw mTLS handshake rate (8 concurrent, same certificates,
/// server in a child process) measured in the same run.
async fn storm(ca: &Ca, nodes: usize) {
    let interval: i64 = std::env::var("STORM_INTERVAL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let dir = child_dir(ca, "storm");
    // Baseline: raw mTLS handshakes per second, 8 at a time.
    let (mut tls, _tls_lines, tls_addr) = spawn_child("--tls-child", &dir, 0);
    let client = node_tls(ca, "node-0");
    let connector = tokio_rustls::TlsConnector::from(client);
    let count = std::sync::atomic::AtomicUsize::new(0);
    let count = Arc::new(count);
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let connector = connector.clone();
        let count = count.clone();
        tasks.push(tokio::spawn(async move {
            while count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < nodes {
                let tcp = tokio::net::TcpStream::connect(tls_addr).await.unwrap();
                let _ = tcp.set_nodelay(true);
                let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
                let _tls = connector.connect(name, tcp).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let raw_rate = nodes as f64 / t.elapsed().as_secs_f64();
    tls.kill().ok();
    tls.wait().ok();

    let port = iop_benches::load::free_port();
    let (mut edge, lines, addr) = spawn_child("--edge-child", &dir, port);
    let shutdown = CancellationToken::new();
    let policy = iop_node::ReconnectPolicy::from_config(Some(interval), Some(0)).unwrap();
    for i in 0..nodes {
        let name = format!("node-{i}");
        let opts = NodeOptions::new(&name, &addr.to_string(), "localhost", node_tls(ca, &name))
            .unwrap()
            .with_reconnect(policy);
        tokio::spawn(run_node(opts, shutdown.clone()));
    }
    let t = Instant::now();
    let (first, _) = wait_ready(lines, nodes).await;
    let first_connect = t.elapsed();
    assert_eq!(first.dups, 0, "double registrations on the first connect");

    // The restart.
    edge.kill().ok();
    edge.wait().ok();
    let killed = Instant::now();
    let (mut edge, lines, _) = spawn_child("--edge-child", &dir, port);
    let listening = killed.elapsed();
    let (after, lines) = wait_ready(lines, nodes).await;
    let all_ready = killed.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss = rss_kib(edge.id());
    let closes = edge_closes(&mut edge, lines).await;
    edge.kill().ok();
    edge.wait().ok();
    shutdown.cancel();
    let storm = after.last.saturating_sub(after.first);
    println!(
        "\n## reconnect storm ({nodes} Nodes, Edge killed and restarted, interval {interval} s, jitter 20 %)\n"
    );
    println!("| measure | value |");
    println!("|---|---:|");
    println!(
        "| raw mTLS handshakes (baseline, 8 concurrent) | {raw_rate:.0}/s ({:.2} s for {nodes}) |",
        nodes as f64 / raw_rate
    );
    println!(
        "| first connect of all {nodes} | {:.2} s ({:.0} Nodes/s) |",
        first_connect.as_secs_f64(),
        nodes as f64 / first_connect.as_secs_f64()
    );
    println!(
        "| restarted Edge listening after the kill | {:.2} s |",
        listening.as_secs_f64()
    );
    println!(
        "| all ready after the kill | **{:.2} s** |",
        all_ready.as_secs_f64()
    );
    println!(
        "| first to last ready of the storm | {:.2} s ({:.0} Nodes/s, **{:.2}× the raw handshake rate**) |",
        storm.as_secs_f64(),
        nodes as f64 / storm.as_secs_f64().max(1e-9),
        nodes as f64 / storm.as_secs_f64().max(1e-9) / raw_rate
    );
    println!(
        "| double registrations / Nodes fenced during the storm | {} / {} |",
        after.dups, after.gone
    );
    println!(
        "| connections the restarted Edge closed, by cause | {} |",
        closes.join(", ")
    );
    println!(
        "| Nodes ready per 100 ms after the restart | {} |",
        after
            .hist
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "| Edge RSS with {nodes} ready Nodes | {:.1} MiB ({:.1} KiB per Node) |",
        rss as f64 / 1024.0,
        rss as f64 / nodes as f64
    );
}

/// What an Edge child reported until every Node was ready.
struct Ready {
    /// From the call to the first and the last `ready`.
    first: Duration,
    last: Duration,
    /// `Connected` of a Node id already connected (a second registration of it).
    dups: usize,
    /// `Disconnected` events (a ready generation fenced).
    gone: usize,
    /// Ready Nodes per 100 ms since the call.
    hist: Vec<usize>,
}

type ChildLines = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;

async fn wait_ready(mut lines: ChildLines, nodes: usize) -> (Ready, ChildLines) {
    tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        let mut out = Ready {
            first: Duration::ZERO,
            last: Duration::ZERO,
            dups: 0,
            gone: 0,
            hist: Vec::new(),
        };
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(n) = line.strip_prefix("ready ") {
                let slot = (t.elapsed().as_millis() / 100) as usize;
                if out.hist.len() <= slot {
                    out.hist.resize(slot + 1, 0);
                }
                out.hist[slot] += 1;
                if n == "1" {
                    out.first = t.elapsed();
                }
                if n == nodes.to_string() {
                    out.last = t.elapsed();
                    return (out, lines);
                }
            } else if line.starts_with("dup ") {
                out.dups += 1;
            } else if line.starts_with("gone") {
                out.gone += 1;
            }
        }
        panic!("the Edge child ended before every Node was ready");
    })
    .await
    .unwrap()
}

/// Asks an Edge child for its `iop_edge_node_connections_closed_total` series: `superseded`,
/// `protocol_violation` and any other non-zero one, as `cause=N` (a frame of a superseded generation closes its connection as
/// `protocol_violation`; a second registration of a Node id closes the first as `superseded`).
async fn edge_closes(edge: &mut std::process::Child, mut lines: ChildLines) -> Vec<String> {
    use std::io::Write as _;
    let stdin = edge.stdin.as_mut().unwrap();
    stdin.write_all(b"closes\n").unwrap();
    stdin.flush().unwrap();
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if line == "end" {
                break;
            }
            if let Some(series) = line.strip_prefix("closed ") {
                // `iop_edge_node_connections_closed_total{cause="x"} N`
                let (labels, n) = series.rsplit_once(' ').unwrap();
                let cause = labels.split('"').nth(1).unwrap_or(labels);
                if n != "0" || cause == "superseded" || cause == "protocol_violation" {
                    out.push(format!("{cause}={n}"));
                }
            }
        }
        out
    })
    .await
    .unwrap()
}

/// The Edge child process of `idle` and `storm`: prints its address, then `ready N` on every
/// ready Node (`dup ID` when a Node id already connected connects again, `gone` on a fence).
/// A `closes` line on stdin prints its closed-connection counters (`closed SERIES`, then `end`).
async fn edge_child(dir: &std::path::Path, port: u16) {
    let tls = child_tls(dir);
    let mut cfg = TransportConfig::new(SocketAddr::from(([127, 0, 0, 1], port)), tls);
    cfg.registry = RegistryConfig {
        default_node_config: Some(NodeConfigPayload::default()),
        ..Default::default()
    };
    // Every Node dials from 127.0.0.1 here; the per-address handshake cap is meant for one
    // host, so the whole cap is allowed to this one address.
    if let Some(n) = std::env::var("STORM_MAX_HANDSHAKES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        cfg.max_unauthenticated = n;
    }
    cfg.max_unauthenticated_per_ip = cfg.max_unauthenticated;
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    println!("{}", edge.local_addr());
    let metrics = edge.metrics().clone();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            if line.is_ok_and(|l| l == "closes") {
                for series in metrics.render(0, 0).lines() {
                    if series.starts_with("iop_edge_node_connections_closed_total") {
                        println!("closed {series}");
                    }
                }
                println!("end");
            }
        }
    });
    let mut ready = 0usize;
    let mut seen = std::collections::HashSet::new();
    loop {
        match life.recv().await {
            Ok(Lifecycle::Connected { node_id, .. }) => {
                ready += 1;
                if !seen.insert(node_id.clone()) {
                    println!("dup {node_id}");
                }
                println!("ready {ready}");
            }
            Ok(Lifecycle::Disconnected { .. }) => {
                ready -= 1;
                println!("gone");
            }
            Err(e) => println!("lagged {e}"),
        }
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let port = || args.get(3).and_then(|p| p.parse().ok()).unwrap_or(0);
    if args.get(1).map(String::as_str) == Some("--edge-child") {
        edge_child(std::path::Path::new(&args[2]), port()).await;
        return;
    }
    if args.get(1).map(String::as_str) == Some("--tls-child") {
        tls_child(std::path::Path::new(&args[2]), port()).await;
        return;
    }
    // The baseline's plain HTTP client (reqwest with rustls-no-provider) needs a process-wide
    // provider even for http:// URLs; the mesh itself passes ring explicitly everywhere.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let which = args.get(1).cloned().unwrap_or_default();
    let nodes = std::env::var("MESH_LOAD_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let ca = Ca::new("mesh_load CA");
    println!("# mesh_load (loopback, release build expected)");
    if which.is_empty() || which == "latency" {
        latency(&ca).await;
    }
    if which.is_empty() || which == "throughput" {
        throughput(&ca).await;
    }
    if which.is_empty() || which == "idle" {
        idle(&ca, nodes).await;
    }
    if which == "storm" {
        let nodes = std::env::var("MESH_LOAD_NODES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5000);
        storm(&ca, nodes).await;
    }
}
