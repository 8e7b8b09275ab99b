//! `mesh_load`: a load tool for the Edge ⇄ Node runtime over real loopback mTLS, with its
//! baselines measured in the same run. Prints a table; numbers go to `benches/README.md`.
//!
//! ```text
//! cargo run --release -p iop-benches --bin mesh_load            # all three parts
//! cargo run --release -p iop-benches --bin mesh_load -- latency # or: throughput, idle
//! ```
//!
//! - **latency**: small streamed chat completions (6 SSE events) at a fixed rate, through
//!   Edge → Node (`openai_compat` tunnel) → local provider, against the same requests sent
//!   straight to the provider; p50/p99 of time to the last byte, and the added latency.
//! - **throughput**: one bulk SSE stream through the tunnel, against the same provider called
//!   directly and against raw TLS 1.3 on loopback.
//! - **idle**: memory per idle connected Node at the Edge: the Edge runs in a child process
//!   (this binary with `--edge-child`) and its RSS is read from `/proc` before and after N Nodes
//!   (default 1000) connect and become ready.
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
use iop_edge::{EdgeHandle, Lifecycle, TransportConfig, TunnelEvent, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::{Ca, TRUST_DOMAIN};
use iop_wire::identity::{self, ExpectedPeer, client_cert_verifier, role};
use iop_wire::registry::RegistryConfig;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, Header, NodeConfigPayload,
    OpenAiCompatSettings, Operation, ProviderTunnelRequest,
};
use iop_wire::tunnel::Delivery;
use iop_wire::validate::ResponseStallTimeout;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;

use iop_benches::load::{at_rate, edge_tls, ms, node_tls, percentile};

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
    // The wire has no per-stream window: a reader slower than the Node, however fast, is cut
    // once it is `max_stream_buffer` behind (4 MiB by default). This tool's reader shares the
    // two cores with the Node and the provider and can fall that far behind on a 256 MiB
    // stream; the bound is raised so that the throughput of the path is what is measured.
    cfg.max_stream_buffer = 1 << 30;
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
        timeout: None,
        metadata: Default::default(),
        session_id: String::new(),
        long_context: false,
        operation,
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        credential: None,
    }
}

/// Runs one tunnel to its terminal; returns body bytes.
async fn tunnel_once(edge: &EdgeHandle, req: ProviderTunnelRequest) -> usize {
    let mut s = edge.tunnel("node-1", req).await.unwrap();
    let mut n = 0;
    while let Some(ev) = s.next().await {
        match ev {
            TunnelEvent::Frame(Delivery::Body(b)) => n += b.len(),
            TunnelEvent::Frame(Delivery::End) => break,
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
    let leaf = ca.workload(role::EDGE, "edge-1", true);
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(leaf.chain.clone(), leaf.key())
    .unwrap();
    let roots = ca.roots();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
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
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let t = Instant::now();
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
    assert_eq!(n, BULK_BYTES);
    n as f64 / t.elapsed().as_secs_f64()
}

async fn throughput(ca: &Ca) {
    let p = provider().await;
    let edge = mesh(ca, p).await;
    let client = reqwest::Client::new();
    let raw = raw_tls_throughput(ca).await;
    let t = Instant::now();
    let n = direct_once(&client, &format!("http://{p}/v1/bulk")).await;
    let direct = n as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let n = tunnel_once(&edge, tunnel_request(7, None, "/bulk")).await;
    assert_eq!(n, BULK_BYTES);
    let mesh = n as f64 / t.elapsed().as_secs_f64();
    let mib = |b: f64| b / (1024.0 * 1024.0);
    println!("\n## throughput: one {} MiB SSE stream\n", BULK_BYTES >> 20);
    println!("| path | MiB/s | vs raw TLS |");
    println!("|---|---:|---:|");
    println!(
        "| raw TLS 1.3 loopback (baseline) | {:.0} | 1.00× |",
        mib(raw)
    );
    println!(
        "| direct to provider (HTTP/1.1) | {:.0} | {:.2}× |",
        mib(direct),
        direct / raw
    );
    println!(
        "| edge → node → provider | {:.0} | {:.2}× |",
        mib(mesh),
        mesh / raw
    );
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn idle(ca: &Ca, nodes: usize) {
    let dir = std::env::temp_dir().join(format!("mesh-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let leaf = ca.workload(role::EDGE, "edge-1", true);
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("edge.pem"), &leaf.cert_pem).unwrap();
    std::fs::write(dir.join("edge.key"), &leaf.key_pem).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .arg("--edge-child")
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let addr: SocketAddr = lines.next().unwrap().unwrap().parse().unwrap();
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
    println!(
        "| time to connect + register + ready all | {:.2} s ({:.0} Nodes/s) |",
        connect.as_secs_f64(),
        nodes as f64 / connect.as_secs_f64()
    );
}

/// The Edge child process of `idle`: prints its address, then `ready N` on every ready Node.
async fn edge_child(dir: &std::path::Path) {
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
    let tls = Arc::new(identity::server_config(chain, key, verifier).unwrap());
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.registry = RegistryConfig {
        default_node_config: Some(NodeConfigPayload::default()),
        ..Default::default()
    };
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    println!("{}", edge.local_addr());
    let mut ready = 0usize;
    loop {
        match life.recv().await {
            Ok(Lifecycle::Connected { .. }) => {
                ready += 1;
                println!("ready {ready}");
            }
            Ok(Lifecycle::Disconnected { .. }) => ready -= 1,
            Err(_) => {}
        }
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--edge-child") {
        edge_child(std::path::Path::new(&args[2])).await;
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
}
