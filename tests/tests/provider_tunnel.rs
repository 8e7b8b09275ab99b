//! Provider raw tunnel end to end: Edge → (mTLS) → Node `openai_compat` adapter → a real local
//! HTTP server speaking OpenAI-style SSE (axum on loopback).
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use axum::routing::{get, post};
use bytes::Bytes;
use iop_edge::pool::{ContextSize, PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{
    Dispatched, EdgeHandle, Lifecycle, PoolRequest, TransportConfig, TunnelEvent, bind,
};
use iop_node::{AdapterRegistry, NodeOptions, ReconnectPolicy, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, Fence, Header, HealthEvidence,
    NativeSettings, NodeCommandKind, NodeCommandRequest, NodeConfigPayload, OpenAiCompatSettings,
    Operation, ProviderStatus, ProviderTunnelRequest, RunEventKind, RunRequest, Usage,
};
use iop_wire::tunnel_order::Delivery;
use iop_wire::validate::ResponseStallTimeout;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);

/// The exact SSE bytes the fake provider streams for a chat completion, in chunks.
fn sse_chunks() -> Vec<&'static [u8]> {
    vec![
        b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
        b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
        // A chunk boundary inside an event, and a multi-byte character split across chunks.
        b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"lo \xe2\x9c",
        b"\x93\"}}]}\n\n",
        b"data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9}}\n\n",
        b"data: [DONE]\n\n",
    ]
}

/// A stream that tells `dropped` when the client goes away.
struct Watched<S> {
    inner: S,
    dropped: Arc<Notify>,
    flag: Arc<AtomicBool>,
}

impl<S> Drop for Watched<S> {
    fn drop(&mut self) {
        self.flag.store(true, Ordering::SeqCst);
        self.dropped.notify_waiters();
        self.dropped.notify_one();
    }
}

impl<S: futures_util::Stream + Unpin> futures_util::Stream for Watched<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

struct Provider {
    addr: SocketAddr,
    slow_dropped: Arc<Notify>,
    slow_flag: Arc<AtomicBool>,
    late_dropped: Arc<Notify>,
}

/// Notifies when dropped (the handler future of a request whose client went away).
struct DropNotify(Arc<Notify>);

impl Drop for DropNotify {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

async fn provider() -> Provider {
    let slow_dropped = Arc::new(Notify::new());
    let slow_flag = Arc::new(AtomicBool::new(false));
    let (d, f) = (slow_dropped.clone(), slow_flag.clone());
    let late_dropped = Arc::new(Notify::new());
    let late = late_dropped.clone();
    let app = Router::new()
        .route(
            "/v1/late",
            post(move || {
                let guard = DropNotify(late.clone());
                async move {
                    // Headers would come only after 30 s; the client gives up long before.
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    drop(guard);
                    "late"
                }
            }),
        )
        .route(
            "/v1/models",
            get(|| async { axum::Json(serde_json_value()) }),
        )
        .route(
            "/v1/chat/completions",
            post(|| async {
                let chunks = sse_chunks();
                let stream = futures_util::stream::unfold(0usize, move |i| {
                    let chunks = chunks.clone();
                    async move {
                        let chunk = *chunks.get(i)?;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        Some((Ok::<_, Infallible>(Bytes::from_static(chunk)), i + 1))
                    }
                });
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .header("x-provider-request-id", "req-123")
                    .body(Body::from_stream(stream))
                    .unwrap()
            }),
        )
        .route(
            "/v1/sizes",
            post(|| async {
                let chunks: Vec<Result<Bytes, Infallible>> =
                    sized_chunks().into_iter().map(Ok).collect();
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .body(Body::from_stream(futures_util::stream::iter(chunks)))
                    .unwrap()
            }),
        )
        .route(
            "/v1/hang",
            post(|| async {
                // One event, then silence: the connection stays open, nothing more comes.
                let first = futures_util::stream::once(async {
                    Ok::<_, Infallible>(Bytes::from_static(b"data: {\"id\":\"h\"}\n\n"))
                });
                let stream = futures_util::StreamExt::chain(first, futures_util::stream::pending());
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .body(Body::from_stream(stream))
                    .unwrap()
            }),
        )
        .route(
            "/v1/slow",
            post(move || {
                let (d, f) = (d.clone(), f.clone());
                async move {
                    let ticks = futures_util::stream::unfold(0u64, |i| async move {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Some((
                            Ok::<_, Infallible>(Bytes::from(format!("data: {{\"tick\":{i}}}\n\n"))),
                            i + 1,
                        ))
                    });
                    let stream = Watched {
                        inner: Box::pin(ticks),
                        dropped: d,
                        flag: f,
                    };
                    Response::builder()
                        .header(header::CONTENT_TYPE, "text/event-stream")
                        .body(Body::from_stream(stream))
                        .unwrap()
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Provider {
        addr,
        slow_dropped,
        slow_flag,
        late_dropped,
    }
}

fn serde_json_value() -> std::collections::HashMap<
    &'static str,
    Vec<std::collections::HashMap<&'static str, &'static str>>,
> {
    [("data", vec![[("id", "gpt-test")].into_iter().collect()])]
        .into_iter()
        .collect()
}

fn node_config(provider: SocketAddr) -> NodeConfigPayload {
    NodeConfigPayload {
        adapters: vec![AdapterConfig {
            name: "openai-a".into(),
            adapter_type: "openai_compat".into(),
            enabled: true,
            capacity: 8,
            long_context_capacity: 0,
            targets: vec!["gpt-test".into()],
            settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                base_url: format!("http://{provider}/v1"),
                protocol_profile: ConcreteProtocolProfile {
                    name: "openai".into(),
                    operation_paths: [
                        (Operation::ChatCompletions, "/chat/completions".to_owned()),
                        (Operation::Models, "/models".to_owned()),
                    ]
                    .into_iter()
                    .collect(),
                    ..Default::default()
                },
                request_timeout_sec: 30,
            }),
        }],
        revision: 1,
        ..Default::default()
    }
}

async fn mesh(ca: &Ca, provider: SocketAddr) -> (EdgeHandle, CancellationToken) {
    mesh_with(ca, provider, None).await
}

/// [`mesh`] with the Node's `openai-a` instance as the one provider of model `gpt` in the
/// pool.
async fn pooled_mesh(ca: &Ca, provider: SocketAddr) -> (EdgeHandle, CancellationToken) {
    let key = ProviderKey {
        node_id: "node-1".into(),
        provider_id: "openai-a-node-1".into(),
    };
    let pool = PoolConfig {
        providers: vec![ProviderSpec {
            key: key.clone(),
            adapter: "openai-a".into(),
            target: "gpt-test".into(),
            kind: ProviderKind::OpenAiCompat,
            category: "api".into(),
            capacity: 4,
            long_context_capacity: 4,
            response_stall_timeout: Duration::from_secs(300),
            enabled: true,
        }],
        models: vec![("gpt".into(), vec![key])],
        max_queue: 16,
    };
    mesh_with(ca, provider, Some(pool)).await
}

async fn mesh_with(
    ca: &Ca,
    provider: SocketAddr,
    pool: Option<PoolConfig>,
) -> (EdgeHandle, CancellationToken) {
    let tls = iop_tests::pki::edge_server_tls(ca, "edge-1");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.node_configs = vec![("node-1".into(), node_config(provider))];
    cfg.pool = pool;
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    let node_tls = iop_tests::pki::node_client_tls(ca, role::NODE, "node-1", "edge-1");
    let opts = NodeOptions::new(
        "node-1",
        &edge.local_addr().to_string(),
        "localhost",
        node_tls,
    )
    .unwrap()
    .with_adapters(AdapterRegistry::with_builtins());
    let shutdown = CancellationToken::new();
    tokio::spawn(run_node(opts, shutdown.clone()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    (edge, shutdown)
}

/// Provider chunks around the Node's split threshold (16 KiB: larger bodies are written after
/// their frame's head, not copied into the frame buffer), the credit window (1 MiB) and the
/// Edge's whole-frame reservation, each byte told apart from its neighbours.
fn sized_chunks() -> Vec<Bytes> {
    [
        1,
        16_383,
        16_384,
        16_385,
        70_000,
        1 << 20,
        (1 << 20) + 4097,
        3 << 20,
        5,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, n)| {
        (0..n)
            .map(|j: usize| (j.wrapping_mul(31) ^ (j >> 8) ^ i) as u8)
            .collect::<Vec<u8>>()
            .into()
    })
    .collect()
}

fn chat(run_id: &str, operation: Option<Operation>, path: &str) -> ProviderTunnelRequest {
    ProviderTunnelRequest {
        run_id: run_id.into(),
        adapter: "openai-a".into(),
        target: "gpt-test".into(),
        method: "POST".into(),
        path: path.into(),
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body: Bytes::from_static(b"{\"model\":\"gpt-test\",\"stream\":true,\"messages\":[]}"),
        stream: true,
        operation,
        ..Default::default()
    }
}

#[tokio::test]
async fn sse_bytes_arrive_identical_and_in_order_with_usage_on_the_side() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = mesh(&ca, p.addr).await;
        let mut stream = edge
            .tunnel("node-1", chat("t-1", Some(Operation::ChatCompletions), ""))
            .await
            .unwrap();
        let mut body = Vec::new();
        let mut usage = Vec::new();
        let mut start = None;
        let mut terminals = 0;
        while let Some(ev) = stream.next().await {
            match ev {
                TunnelEvent::Frame(Delivery::Start { status, headers }) => {
                    assert!(start.is_none(), "RESPONSE_START at most once");
                    assert!(body.is_empty(), "RESPONSE_START first");
                    start = Some((status, headers));
                }
                TunnelEvent::Frame(Delivery::Body(b)) => body.extend_from_slice(&b),
                TunnelEvent::Frame(Delivery::Usage(u)) => usage.push(u),
                TunnelEvent::Frame(Delivery::End { .. }) => terminals += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        let (status, headers) = start.unwrap();
        assert_eq!(status, 200);
        assert!(
            headers
                .iter()
                .any(|h| h.name == "content-type" && h.value == "text/event-stream")
        );
        assert!(
            headers
                .iter()
                .any(|h| h.name == "x-provider-request-id" && h.value == "req-123")
        );
        assert!(
            !headers.iter().any(|h| h.name == "transfer-encoding"),
            "hop-by-hop headers are not forwarded"
        );
        assert_eq!(
            body,
            sse_chunks().concat(),
            "body passes through byte for byte"
        );
        assert_eq!(
            usage,
            [Usage {
                prompt_tokens: 7,
                completion_tokens: 2,
                total_tokens: 9,
                cached_prompt_tokens: 0
            }]
        );
        assert_eq!(terminals, 1);

        // The exact-target probe reads the provider's models list.
        let caps = edge
            .command(
                "node-1",
                NodeCommandRequest {
                    kind: NodeCommandKind::Capabilities,
                    adapter: String::new(),
                    target: String::new(),
                },
            )
            .await
            .unwrap();
        assert_eq!(
            caps.capabilities[0].provider_status,
            ProviderStatus::Available
        );
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// Bodies of every size the Node writes apart from their frame's head, cut by the credit
/// window or not, arrive byte for byte over the real mTLS connection.
#[tokio::test]
async fn large_bodies_arrive_byte_for_byte() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = mesh(&ca, p.addr).await;
        for run in ["t-sizes-1", "t-sizes-2"] {
            let mut stream = edge
                .tunnel("node-1", chat(run, None, "/sizes"))
                .await
                .unwrap();
            let mut body = Vec::new();
            let mut terminals = 0;
            while let Some(ev) = stream.next().await {
                match ev {
                    TunnelEvent::Frame(Delivery::Body(b)) => body.extend_from_slice(&b),
                    TunnelEvent::Frame(Delivery::End { .. }) => terminals += 1,
                    TunnelEvent::Frame(Delivery::Start { .. } | Delivery::Usage(_)) => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(terminals, 1);
            let want = sized_chunks().concat();
            assert_eq!(body.len(), want.len());
            assert!(body == want, "{run}: the body passes through byte for byte");
        }
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn cancel_from_the_edge_aborts_the_upstream_request() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = mesh(&ca, p.addr).await;
        // No operation: the fallback path is used (relative to the instance's base URL).
        let mut stream = edge
            .tunnel("node-1", chat("slow-1", None, "/slow"))
            .await
            .unwrap();
        assert!(matches!(
            stream.next().await.unwrap(),
            TunnelEvent::Frame(Delivery::Start { status: 200, .. })
        ));
        assert!(matches!(
            stream.next().await.unwrap(),
            TunnelEvent::Frame(Delivery::Body(_))
        ));
        assert!(!p.slow_flag.load(Ordering::SeqCst));
        let dropped = p.slow_dropped.notified();
        edge.cancel("node-1", "slow-1", "caller_cancelled");
        let mut terminal = None;
        while let Some(ev) = stream.next().await {
            if ev.is_terminal() {
                terminal = Some(ev);
            }
        }
        assert!(matches!(
            terminal,
            Some(TunnelEvent::Frame(Delivery::Error { ref error, .. })) if error == "cancelled"
        ));
        // The provider observes the disconnect.
        dropped.await;
        assert!(p.slow_flag.load(Ordering::SeqCst));
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn dropping_the_tunnel_stream_cancels_upstream() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = mesh(&ca, p.addr).await;
        let mut stream = edge
            .tunnel("node-1", chat("slow-2", None, "/slow"))
            .await
            .unwrap();
        assert!(matches!(
            stream.next().await.unwrap(),
            TunnelEvent::Frame(Delivery::Start { .. })
        ));
        let dropped = p.slow_dropped.notified();
        drop(stream); // the HTTP caller went away
        dropped.await;
        assert!(p.slow_flag.load(Ordering::SeqCst));
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn a_stalled_upstream_produces_exactly_one_response_stalled_terminal() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = mesh(&ca, p.addr).await;
        let mut req = chat("hang-1", None, "/hang");
        req.response_stall_timeout = ResponseStallTimeout::from_wire_ms(300).unwrap();
        let mut stream = edge.tunnel("node-1", req).await.unwrap();
        let mut events = Vec::new();
        while let Some(ev) = stream.next().await {
            events.push(ev);
        }
        assert!(matches!(
            events[0],
            TunnelEvent::Frame(Delivery::Start { status: 200, .. })
        ));
        assert!(matches!(events[1], TunnelEvent::Frame(Delivery::Body(_))));
        assert_eq!(events.iter().filter(|e| e.is_terminal()).count(), 1);
        let TunnelEvent::Frame(Delivery::Error {
            error,
            execution_failure,
            ..
        }) = events.last().unwrap()
        else {
            panic!("expected an ERROR terminal, got {:?}", events.last());
        };
        assert_eq!(error, iop_node::RESPONSE_STALLED);
        let failure = execution_failure
            .as_ref()
            .and_then(|e| e.valid())
            .expect("typed stall evidence");
        // The provider answers its models list with the target: available → request_stalled.
        assert_eq!(failure.health, HealthEvidence::Available);
        assert_eq!(failure.fence, Fence::Confirmed);
        assert_eq!(
            (
                failure.adapter.as_str(),
                failure.target.as_str(),
                failure.run_id.as_str()
            ),
            ("openai-a", "gpt-test", "hang-1")
        );
        assert!(
            failure.idle_duration >= Duration::from_millis(300),
            "{:?}",
            failure.idle_duration
        );
        assert!(failure.attempt_id.starts_with("attempt-"));
        let seq = failure
            .health_observation_seq
            .expect("bound session stamps the sequence");
        // The sequence is session-owned: a later CAPABILITIES answer continues it.
        let caps = edge
            .command(
                "node-1",
                NodeCommandRequest {
                    kind: NodeCommandKind::Capabilities,
                    adapter: String::new(),
                    target: String::new(),
                },
            )
            .await
            .unwrap();
        assert!(caps.capabilities[0].health_observation_seq > seq);
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn response_wait_timeout_ends_the_tunnel_and_cancels_upstream() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = mesh(&ca, p.addr).await;
        let dropped = p.late_dropped.notified();
        let mut stream = edge
            .tunnel_with_wait(
                "node-1",
                chat("late-1", None, "/late"),
                Some(Duration::from_millis(300)),
            )
            .await
            .unwrap();
        assert_eq!(stream.next().await.unwrap(), TunnelEvent::WaitTimeout);
        assert!(stream.next().await.is_none());
        // The Edge's CancelRequest made the Node drop the upstream request.
        dropped.await;
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// The pool path has the same response wait (`Admission::with_response_wait`): a tunnel sent
/// on an admission with a wait ends with `WaitTimeout`, the upstream request is dropped, and
/// the provider lease is released (the next admission is granted at once).
#[tokio::test]
async fn the_pool_path_has_the_same_response_wait() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = pooled_mesh(&ca, p.addr).await;
        let dropped = p.late_dropped.notified();
        let admission = edge
            .admit("gpt", ContextSize::Standard, Duration::from_secs(5))
            .await
            .unwrap()
            .with_response_wait(Duration::from_millis(300));
        let dispatched = edge
            .send_admitted(
                admission,
                PoolRequest::Tunnel(chat("late-pool", None, "/late")),
            )
            .await
            .unwrap();
        let Dispatched::Tunnel(mut stream) = dispatched else {
            panic!("a tunnel was sent")
        };
        assert_eq!(stream.next().await.unwrap(), TunnelEvent::WaitTimeout);
        assert!(stream.next().await.is_none());
        dropped.await;
        assert_eq!(edge.pool_stats(), (0, 0), "the lease was released");
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// The response wait bounds the time to the response's start only: a stream that started in
/// time keeps flowing after the wait's deadline. No count of bodies is asserted (that would be
/// a rate on a shared machine): the claim is that bodies still arrive once the deadline has
/// passed, and the wait (3 s) is far longer than a local provider takes to start, even on a
/// loaded machine.
#[tokio::test]
async fn a_response_that_started_in_time_is_not_cut_by_the_wait_timeout() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let (edge, shutdown) = mesh(&ca, p.addr).await;
        let wait = Duration::from_secs(3);
        let sent = tokio::time::Instant::now();
        let mut stream = edge
            .tunnel_with_wait("node-1", chat("slow-wait", None, "/slow"), Some(wait))
            .await
            .unwrap();
        let mut after_deadline = 0;
        // The slow provider ticks every 20 ms without end: read until three bodies arrived
        // past the deadline (plus a margin for the timer).
        while after_deadline < 3 {
            match stream.next().await.unwrap() {
                TunnelEvent::Frame(Delivery::Start { .. }) => {
                    assert!(
                        sent.elapsed() < wait,
                        "the provider did not start within the wait"
                    );
                }
                TunnelEvent::Frame(Delivery::Body(_)) => {
                    if sent.elapsed() > wait + Duration::from_millis(200) {
                        after_deadline += 1;
                    }
                }
                other => panic!("the stream was cut: {other:?}"),
            }
        }
        drop(stream);
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// Seed 000 ("precedence and ownership"): a session lifetime context cancels the active run
/// and tunnel handlers on disconnect. The network between Node and Edge is cut (neither side
/// sends a cancel): the Node drops its upstream request (the provider sees its client go) and
/// frees both adapters' capacity; nothing runs on after the session that asked for it. (A
/// Node that kept the handlers would keep the upstream stream open and report `in_flight=1`
/// for the demo run, which lasts hours.)
#[tokio::test]
async fn a_disconnect_cancels_the_nodes_run_and_tunnel_handlers() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let p = provider().await;
        let mut config = node_config(p.addr);
        config.adapters.push(AdapterConfig {
            name: "demo-a".into(),
            adapter_type: "demo".into(),
            enabled: true,
            capacity: 4,
            long_context_capacity: 0,
            targets: vec!["demo-model".into()],
            settings: AdapterSettings::Native(NativeSettings {
                base_url: String::new(),
                options: [
                    ("delay_ms".to_owned(), "100".to_owned()),
                    ("repeat".to_owned(), "1000000".to_owned()),
                ]
                .into_iter()
                .collect(),
            }),
        });
        let tls = iop_tests::pki::edge_server_tls(&ca, "edge-1");
        let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
        cfg.node_configs = vec![("node-1".into(), config)];
        let edge = bind(cfg).await.unwrap().0;
        let mut life = edge.subscribe();
        let net = iop_tests::net::Proxy::start(edge.local_addr()).await;
        let node_tls = iop_tests::pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1");
        let opts = NodeOptions::new("node-1", &net.addr.to_string(), "localhost", node_tls)
            .unwrap()
            .with_adapters(AdapterRegistry::with_builtins())
            .with_reconnect(ReconnectPolicy::from_config(Some(0), Some(5)).unwrap());
        let shutdown = CancellationToken::new();
        tokio::spawn(run_node(opts, shutdown.clone()));
        while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}

        let mut tunnel = edge
            .tunnel("node-1", chat("slow-cut", None, "/slow"))
            .await
            .unwrap();
        assert!(matches!(
            tunnel.next().await.unwrap(),
            TunnelEvent::Frame(Delivery::Start { .. })
        ));
        let mut run = edge
            .run(
                "node-1",
                RunRequest {
                    run_id: "demo-cut".into(),
                    adapter: "demo-a".into(),
                    target: "demo-model".into(),
                    input: Bytes::from_static(b"a b c"),
                    metadata: Default::default(),
                    response_stall_timeout: ResponseStallTimeout::DEFAULT,
                    timeout: None,
                    long_context: false,
                    credential: None,
                    trace: None,
                },
            )
            .await
            .unwrap();
        assert_eq!(run.next().await.unwrap().kind, RunEventKind::Start);
        for adapter in ["openai-a", "demo-a"] {
            assert_eq!(
                iop_tests::node::in_flight(&edge, "node-1", adapter).await,
                Some(1),
                "{adapter}'s handler holds its capacity"
            );
        }

        let dropped = p.slow_dropped.notified();
        net.cut();
        tokio::time::timeout(Duration::from_secs(10), dropped)
            .await
            .expect("the Node dropped its upstream request when the session ended");
        // Back on a new session: both adapters idle.
        while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
        // The run and tunnel handlers were cancelled: both adapters idle.
        for adapter in ["openai-a", "demo-a"] {
            iop_tests::node::wait_idle(&edge, "node-1", adapter).await;
        }
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
