//! `http_load`: a load tool for the Edge's OpenAI-compatible HTTP surface, end to end, with its
//! baseline measured in the same run. Prints Markdown tables; numbers go to `benches/README.md`.
//!
//! ```text
//! cargo run --release -p iop-benches --bin http_load              # all three parts
//! cargo run --release -p iop-benches --bin http_load -- latency   # or: max, cancel
//! HTTP_LOAD_RATES=100,300,600 HTTP_LOAD_COUNT=5000 cargo run --release -p iop-benches --bin http_load -- latency
//! ```
//!
//! One process on 127.0.0.1: a local OpenAI-style provider (axum), an `iop-edge` transport with
//! a provider pool and the axum HTTP surface, and one `iop-node` with the `openai_compat`
//! adapter, Edge ⇄ Node over mTLS with SPIFFE identities. Every request is the same streamed
//! chat completion (`POST /v1/chat/completions`, 6 SSE events), sent either straight to the
//! provider (the baseline) or to the Edge (pool admission → provider tunnel → Node → provider →
//! passthrough).
//!
//! - **latency**: open-loop arrivals at fixed rates (`HTTP_LOAD_RATES`, default `200,500`/s,
//!   `HTTP_LOAD_COUNT` requests each, default 4000); p50/p99/p99.9 of time to the last byte for
//!   both paths, and what the mesh adds.
//! - **max**: closed loop with 16 and 64 concurrent clients for 4 s each; completed requests/s
//!   for both paths (the highest is the max sustained rate on this machine).
//! - **cancel**: 200 times, a streamed request to a provider target that ticks every 5 ms until
//!   its response is dropped; the client reads the first chunk, drops the response, and the tool
//!   measures the time until the provider sees its response dropped (through the mesh: HTTP
//!   disconnect → Edge `CancelRequest` → Node drops the upstream request). The baseline is the
//!   same disconnect made directly against the provider.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use futures_util::StreamExt as _;
use iop_benches::load::{at_rate, edge_tls, ms, node_tls, percentile};
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{Lifecycle, TransportConfig, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, NodeConfigPayload,
    OpenAiCompatSettings, Operation,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const SMALL_EVENTS: usize = 6;
const CANCEL_ROUNDS: usize = 200;
const TICK: Duration = Duration::from_millis(5);
const REQUEST: &str =
    r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}"#;
const SLOW_REQUEST: &str =
    r#"{"model":"slow","stream":true,"messages":[{"role":"user","content":"hello"}]}"#;

/// Sends the instant it is dropped.
struct OnDrop(mpsc::UnboundedSender<Instant>);
impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Instant::now());
    }
}

/// A body stream that reports when it is dropped (the connection to its client went away).
struct Watched<S>(S, #[allow(dead_code)] OnDrop);
impl<S: futures_util::Stream + Unpin> futures_util::Stream for Watched<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        std::pin::Pin::new(&mut self.0).poll_next(cx)
    }
}

/// The local provider: model `m` answers 6 SSE events at once; model `slow` ticks every
/// [`TICK`] until its response is dropped, which is reported on the returned channel.
async fn provider() -> (SocketAddr, mpsc::UnboundedReceiver<Instant>) {
    let (dropped_tx, dropped_rx) = mpsc::unbounded_channel();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::Json<serde_json::Value>| {
            let dropped = dropped_tx.clone();
            async move {
                let stream: Box<
                    dyn futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + Unpin,
                > = if body["model"] == "slow" {
                    let ticks = futures_util::stream::unfold(0u64, |i| async move {
                        if i > 0 {
                            tokio::time::sleep(TICK).await;
                        }
                        Some((Ok(Bytes::from(format!("data: {{\"tick\":{i}}}\n\n"))), i + 1))
                    });
                    Box::new(Watched(Box::pin(ticks), OnDrop(dropped)))
                } else {
                    Box::new(futures_util::stream::iter((0..SMALL_EVENTS).map(|i| {
                        Ok(Bytes::from(format!(
                            "data: {{\"id\":\"c\",\"choices\":[{{\"delta\":{{\"content\":\"tok{i}\"}}}}]}}\n\n"
                        )))
                    })))
                };
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(stream))
                    .unwrap()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, dropped_rx)
}

/// Edge (pool + HTTP surface) and one Node in front of `provider`; returns the Edge's `/v1` URL.
async fn mesh(ca: &Ca, provider: SocketAddr) -> String {
    let adapter = AdapterConfig {
        name: "openai-a".into(),
        adapter_type: "openai_compat".into(),
        enabled: true,
        capacity: 4096,
        long_context_capacity: 0,
        targets: vec!["m".into(), "slow".into()],
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
    };
    let spec = |target: &str| ProviderSpec {
        key: ProviderKey {
            node_id: "node-1".into(),
            provider_id: target.into(),
        },
        adapter: "openai-a".into(),
        target: target.into(),
        kind: ProviderKind::OpenAiCompat,
        category: "api".into(),
        capacity: 4096,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_secs(60),
        enabled: true,
    };
    let providers = vec![spec("m"), spec("slow")];
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), edge_tls(ca));
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters: vec![adapter],
            ..Default::default()
        },
    )];
    cfg.pool = Some(PoolConfig {
        models: vec![
            ("m".into(), vec![providers[0].key.clone()]),
            ("slow".into(), vec![providers[1].key.clone()]),
        ],
        providers,
        max_queue: 4096,
    });
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
    let app = http::router(
        edge,
        HttpConfig {
            models: vec!["m".into(), "slow".into()],
            queue_wait: Duration::from_secs(10),
            api_keys: None,
            limiter: None,
            usage: None,
            no_stream_usage: Default::default(),
            control: None,
            body_timeout: http::DEFAULT_BODY_TIMEOUT,
            telemetry: Default::default(),
            no_trace_propagation: Default::default(),
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(http::serve(listener, app, std::future::pending()));
    base
}

/// One streamed chat completion read to its last byte; panics on anything but a full answer.
async fn once(client: &reqwest::Client, url: &str) {
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(REQUEST)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.bytes().await.unwrap();
    assert!(body.ends_with(b"tok5\"}}]}\n\n"), "full answer");
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(256)
        .build()
        .unwrap()
}

struct Setup {
    direct: String,
    mesh: String,
    dropped: mpsc::UnboundedReceiver<Instant>,
}

async fn setup(ca: &Ca) -> Setup {
    let (p, dropped) = provider().await;
    let base = mesh(ca, p).await;
    let s = Setup {
        direct: format!("http://{p}/v1/chat/completions"),
        mesh: format!("{base}/chat/completions"),
        dropped,
    };
    let c = client();
    for _ in 0..200 {
        once(&c, &s.direct).await;
        once(&c, &s.mesh).await;
    }
    s
}

fn env_list(name: &str, default: &[u32]) -> Vec<u32> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .filter(|v: &Vec<u32>| !v.is_empty())
        .unwrap_or_else(|| default.to_vec())
}

async fn latency(s: &Setup) {
    let rates = env_list("HTTP_LOAD_RATES", &[200, 500]);
    let count = env_list("HTTP_LOAD_COUNT", &[4000])[0];
    println!(
        "\n## latency: {count} streamed chat completions per rate, open loop (time to last byte)\n"
    );
    println!("| rate | path | p50 | p99 | p99.9 |\n|---:|---|---:|---:|---:|");
    for rate in rates {
        let run = |url: String| {
            let c = client();
            at_rate(rate, count, move |_| {
                let (c, u) = (c.clone(), url.clone());
                async move { once(&c, &u).await }
            })
        };
        let direct = run(s.direct.clone()).await;
        let mesh = run(s.mesh.clone()).await;
        let q = |v: &[Duration], p| ms(percentile(v, p));
        for (name, v) in [
            ("direct to provider (baseline)", &direct),
            ("client → Edge HTTP → Node → provider", &mesh),
        ] {
            println!(
                "| {rate}/s | {name} | {:.3} ms | {:.3} ms | {:.3} ms |",
                q(v, 0.5),
                q(v, 0.99),
                q(v, 0.999)
            );
        }
        println!(
            "| {rate}/s | **added by the mesh** | **{:.3} ms** | **{:.3} ms** | **{:.3} ms** |",
            q(&mesh, 0.5) - q(&direct, 0.5),
            q(&mesh, 0.99) - q(&direct, 0.99),
            q(&mesh, 0.999) - q(&direct, 0.999)
        );
    }
}

/// Completed requests per second with `concurrency` clients in a closed loop for `window`.
async fn closed_loop(url: &str, concurrency: usize, window: Duration) -> f64 {
    let c = client();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (c, u) = (c.clone(), url.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while start.elapsed() < window {
                once(&c, &u).await;
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

async fn max(s: &Setup) {
    let window = Duration::from_secs(4);
    println!("\n## max sustained: closed loop, {window:?} per cell (requests/s)\n");
    println!(
        "| concurrency | direct to provider (baseline) | through the mesh | mesh ÷ direct |\n|---:|---:|---:|---:|"
    );
    for concurrency in [16, 64] {
        let direct = closed_loop(&s.direct, concurrency, window).await;
        let mesh = closed_loop(&s.mesh, concurrency, window).await;
        println!(
            "| {concurrency} | {direct:.0} | {mesh:.0} | {:.2}× |",
            mesh / direct
        );
    }
}

/// Disconnect → the provider sees its response dropped, `CANCEL_ROUNDS` times.
async fn disconnect_to_cancel(
    url: &str,
    dropped: &mut mpsc::UnboundedReceiver<Instant>,
) -> Vec<Duration> {
    let c = client();
    let mut out = Vec::with_capacity(CANCEL_ROUNDS);
    for _ in 0..CANCEL_ROUNDS {
        let resp = c
            .post(url)
            .header("content-type", "application/json")
            .body(SLOW_REQUEST)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.bytes_stream();
        let first = body.next().await.unwrap().unwrap();
        assert!(first.starts_with(b"data: {\"tick\""));
        while dropped.try_recv().is_ok() {}
        let t0 = Instant::now();
        drop(body);
        let t1 = tokio::time::timeout(Duration::from_secs(10), dropped.recv())
            .await
            .expect("the upstream request is cancelled")
            .unwrap();
        out.push(t1.saturating_duration_since(t0));
    }
    out.sort();
    out
}

async fn cancel(s: &mut Setup) {
    let direct = disconnect_to_cancel(&s.direct.clone(), &mut s.dropped).await;
    let mesh = disconnect_to_cancel(&s.mesh.clone(), &mut s.dropped).await;
    println!(
        "\n## client disconnect → upstream request dropped ({CANCEL_ROUNDS} rounds, provider ticks every {TICK:?})\n"
    );
    println!("| path | p50 | p99 | max |\n|---|---:|---:|---:|");
    for (name, v) in [
        ("direct to provider (baseline)", &direct),
        ("through the mesh (Edge CancelRequest → Node)", &mesh),
    ] {
        println!(
            "| {name} | {:.3} ms | {:.3} ms | {:.3} ms |",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99)),
            ms(*v.last().unwrap())
        );
    }
}

#[tokio::main]
async fn main() {
    // reqwest's rustls backend needs a process-wide provider even for http:// URLs.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let which = std::env::args().nth(1).unwrap_or_default();
    let ca = Ca::new("http_load CA");
    let mut s = setup(&ca).await;
    println!("# http_load (loopback, release build expected)");
    if which.is_empty() || which == "latency" {
        latency(&s).await;
    }
    if which.is_empty() || which == "max" {
        max(&s).await;
    }
    if which.is_empty() || which == "cancel" {
        cancel(&mut s).await;
    }
}
