//! The Edge's OpenAI-compatible HTTP surface end to end: HTTP client → Edge (axum, pool) →
//! mTLS → Nodes → demo provider (normalized runs) and a local OpenAI-style upstream (tunnel
//! passthrough).
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{Lifecycle, TransportConfig, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, NativeSettings, NodeConfigPayload,
    OpenAiCompatSettings, Operation,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);

/// Requests the upstream saw for `gpt-broken` and `gpt-after` (only the no-fallback test uses
/// these models).
static BROKEN_SEEN: AtomicUsize = AtomicUsize::new(0);
static AFTER_SEEN: AtomicUsize = AtomicUsize::new(0);
/// Breaks `gpt-broken`'s connection (after its first event reached the caller).
static BREAK: Notify = Notify::const_new();
const UPSTREAM_SSE: &[&[u8]] = &[
    b"data: {\"id\":\"u1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"from upstream\"}}]}\n\n",
    b"data: [DONE]\n\n",
];

struct DropNotify(Arc<Notify>);
impl Drop for DropNotify {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

struct Watched<S>(S, #[allow(dead_code)] DropNotify);
impl<S: futures_util::Stream + Unpin> futures_util::Stream for Watched<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        std::pin::Pin::new(&mut self.0).poll_next(cx)
    }
}

/// A local OpenAI-style upstream: `gpt-test` answers two SSE events; `gpt-slow` sends one
/// event and then nothing until the client goes away (then `dropped` is notified), so only a
/// cancel sent when the caller disconnects — not one noticed on the next frame — reaches it;
/// `gpt-hang` never answers at all (its handler notifies `dropped` when it is dropped).
async fn upstream(dropped: Arc<Notify>) -> SocketAddr {
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::Json<serde_json::Value>| {
            let dropped = dropped.clone();
            async move {
                if body["model"] == "gpt-broken" {
                    BROKEN_SEEN.fetch_add(1, Ordering::SeqCst);
                    // One event; then, once the test has read it, the connection breaks.
                    let first = futures_util::stream::iter([Ok(Bytes::from_static(
                        b"data: {\"tick\":0}\n\n",
                    ))]);
                    let broken = futures_util::stream::once(async {
                        BREAK.notified().await;
                        Err(std::io::Error::other("upstream broke"))
                    });
                    let stream = futures_util::StreamExt::chain(first, broken);
                    return Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(stream))
                        .unwrap();
                }
                if body["model"] == "gpt-after" {
                    AFTER_SEEN.fetch_add(1, Ordering::SeqCst);
                }
                if body["model"] == "gpt-hang" {
                    let _guard = DropNotify(dropped.clone());
                    std::future::pending::<()>().await;
                }
                let stream: Box<
                    dyn futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + Unpin,
                > = if body["model"] == "gpt-slow" {
                    let first = futures_util::stream::iter([Ok(Bytes::from_static(
                        b"data: {\"tick\":0}\n\n",
                    ))]);
                    let silent =
                        futures_util::StreamExt::chain(first, futures_util::stream::pending());
                    Box::new(Watched(Box::pin(silent), DropNotify(dropped)))
                } else {
                    Box::new(futures_util::stream::iter(
                        UPSTREAM_SSE.iter().map(|c| Ok(Bytes::from_static(c))),
                    ))
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
    addr
}

fn provider(node: &str, id: &str, adapter: &str, target: &str, kind: ProviderKind) -> ProviderSpec {
    ProviderSpec {
        key: ProviderKey {
            node_id: node.into(),
            provider_id: id.into(),
        },
        adapter: adapter.into(),
        target: target.into(),
        kind,
        category: "api".into(),
        capacity: 4,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_secs(60),
        enabled: true,
    }
}

async fn surface(ca: &Ca, upstream: SocketAddr) -> String {
    let adapters = vec![
        AdapterConfig {
            name: "demo".into(),
            adapter_type: "demo".into(),
            enabled: true,
            capacity: 4,
            long_context_capacity: 0,
            targets: vec!["demo-model".into()],
            settings: AdapterSettings::Native(NativeSettings {
                base_url: String::new(),
                options: [("delay_ms".to_owned(), "5".to_owned())]
                    .into_iter()
                    .collect(),
            }),
        },
        AdapterConfig {
            name: "openai".into(),
            adapter_type: "openai_compat".into(),
            enabled: true,
            capacity: 4,
            long_context_capacity: 0,
            targets: vec![],
            settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                base_url: format!("http://{upstream}/v1"),
                protocol_profile: ConcreteProtocolProfile {
                    name: "openai".into(),
                    operation_paths: [(Operation::ChatCompletions, "/chat/completions".to_owned())]
                        .into_iter()
                        .collect(),
                    ..Default::default()
                },
                request_timeout_sec: 30,
            }),
        },
    ];
    let providers = vec![
        provider("node-1", "demo", "demo", "demo-model", ProviderKind::Native),
        provider(
            "node-1",
            "up",
            "openai",
            "gpt-test",
            ProviderKind::OpenAiCompat,
        ),
        provider(
            "node-1",
            "slow",
            "openai",
            "gpt-slow",
            ProviderKind::OpenAiCompat,
        ),
        provider(
            "node-1",
            "hang",
            "openai",
            "gpt-hang",
            ProviderKind::OpenAiCompat,
        ),
        provider(
            "node-1",
            "broken-a",
            "openai",
            "gpt-broken",
            ProviderKind::OpenAiCompat,
        ),
        provider(
            "node-1",
            "broken-b",
            "openai",
            "gpt-after",
            ProviderKind::OpenAiCompat,
        ),
    ];
    let mut cfg = TransportConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        iop_tests::pki::edge_server_tls(ca, "edge-1"),
    );
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters,
            ..Default::default()
        },
    )];
    cfg.pool = Some(PoolConfig {
        models: vec![
            ("demo".into(), vec![providers[0].key.clone()]),
            ("gpt-4o-mini".into(), vec![providers[1].key.clone()]),
            ("slow".into(), vec![providers[2].key.clone()]),
            ("hang".into(), vec![providers[3].key.clone()]),
            // Two candidates; with both free the first in configuration order is chosen.
            (
                "broken".into(),
                vec![providers[4].key.clone(), providers[5].key.clone()],
            ),
        ],
        providers,
        max_queue: 8,
    });
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    let tls = iop_tests::pki::node_client_tls(ca, role::NODE, "node-1", "edge-1");
    let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins());
    tokio::spawn(run_node(opts, CancellationToken::new()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    let app = http::router(
        edge,
        HttpConfig {
            models: vec!["demo".into(), "gpt-4o-mini".into(), "broken".into()],
            queue_wait: Duration::from_secs(5),
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

fn client() -> reqwest::Client {
    // reqwest's rustls backend needs a process-wide provider even for plain http://.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

#[tokio::test]
async fn models_chat_and_stream_through_the_mesh() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let base = surface(&ca, upstream(Arc::new(Notify::new())).await).await;
        let http = client();

        let models: serde_json::Value = http.get(format!("{base}/models")).send().await.unwrap().json().await.unwrap();
        assert_eq!(models["data"][0]["id"], "demo");

        let chat = serde_json::json!({"model": "demo", "messages": [{"role": "user", "content": "hello mesh"}]});
        let r: serde_json::Value = http.post(format!("{base}/chat/completions")).json(&chat).send().await.unwrap().json().await.unwrap();
        assert_eq!(r["object"], "chat.completion");
        assert_eq!(r["choices"][0]["message"]["content"], "echo: hello mesh");
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
        assert!(r["usage"]["total_tokens"].as_u64().unwrap() > 0);

        let mut stream_req = chat.clone();
        stream_req["stream"] = true.into();
        let resp = http.post(format!("{base}/chat/completions")).json(&stream_req).send().await.unwrap();
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let text = resp.text().await.unwrap();
        let content: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(content, "echo: hello mesh");
        assert!(text.trim_end().ends_with("data: [DONE]"));

        // An OpenAI-compatible provider: the upstream's bytes pass through unchanged, and the
        // external model name was translated to the provider's target.
        let up = serde_json::json!({"model": "gpt-4o-mini", "stream": true, "messages": []});
        let body = http.post(format!("{base}/chat/completions")).json(&up).send().await.unwrap().bytes().await.unwrap();
        assert_eq!(&body[..], &UPSTREAM_SSE.concat()[..]);

        let missing = http.post(format!("{base}/chat/completions")).json(&serde_json::json!({"model": "nope", "messages": []})).send().await.unwrap();
        assert_eq!(missing.status(), 404);
        let e: serde_json::Value = missing.json().await.unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        let bad = http.post(format!("{base}/chat/completions")).body("{").send().await.unwrap();
        assert_eq!(bad.status(), 400);
        // Anthropic Messages API on a native provider.
        let msg = serde_json::json!({"model": "demo", "max_tokens": 64, "system": "be brief", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]});
        let r: serde_json::Value = http.post(format!("{base}/messages")).json(&msg).send().await.unwrap().json().await.unwrap();
        assert_eq!((r["type"].as_str(), r["content"][0]["text"].as_str(), r["stop_reason"].as_str()), (Some("message"), Some("echo: hi there"), Some("end_turn")));
        let mut streamed = msg.clone();
        streamed["stream"] = true.into();
        let text = http.post(format!("{base}/messages")).json(&streamed).send().await.unwrap().text().await.unwrap();
        let deltas: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter(|v| v["type"] == "content_block_delta")
            .filter_map(|v| v["delta"]["text"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(deltas, "echo: hi there");
        assert!(text.contains("event: message_start") && text.contains("event: message_stop"));
        let count: serde_json::Value = http.post(format!("{base}/messages/count_tokens")).json(&msg).send().await.unwrap().json().await.unwrap();
        // The documented estimate: 16 bytes of text / 4, plus 4 for each of the 2 messages.
        assert_eq!((count["input_tokens"].as_u64(), count["estimated"].as_bool()), (Some(12), Some(true)));
        let root = base.trim_end_matches("/v1");
        let metrics = http.get(format!("{root}/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("iop_edge_requests_total{endpoint=\"chat_completions\",outcome=\"ok\"} 3"), "{metrics}");
        assert!(metrics.contains("iop_edge_requests_total{endpoint=\"chat_completions\",outcome=\"error\"} 2"), "{metrics}");
        assert!(metrics.contains("iop_edge_pool_in_flight 0"), "{metrics}");
    })
    .await
    .expect("scenario finishes");
}

/// One word larger than the Edge's per-stream buffer (4 MiB): the demo echoes it as one
/// delta, which the Node sends in pieces of at most `MAX_FRAME_PAYLOAD`. Before, the one
/// 5 MiB event ended the stream as a slow consumer and the caller got 502.
#[tokio::test]
async fn a_word_larger_than_the_stream_buffer_is_answered_whole() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let base = surface(&ca, upstream(Arc::new(Notify::new())).await).await;
        let http = client();
        // Two-byte characters after an odd prefix: the Node's cuts must fall on characters.
        let word = format!("x{}", "é".repeat(5 * 512 * 1024));
        assert!(word.len() > iop_edge::transport::DEFAULT_MAX_STREAM_BUFFER);
        let chat =
            serde_json::json!({"model": "demo", "messages": [{"role": "user", "content": word}]});
        let resp = http
            .post(format!("{base}/chat/completions"))
            .json(&chat)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let r: serde_json::Value = resp.json().await.unwrap();
        assert!(
            r["choices"][0]["message"]["content"].as_str() == Some(&format!("echo: {word}")[..]),
            "the reply is the whole word"
        );

        let mut stream_req = chat.clone();
        stream_req["stream"] = true.into();
        let text = http
            .post(format!("{base}/chat/completions"))
            .json(&stream_req)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let deltas: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert!(
            deltas.concat() == format!("echo: {word}"),
            "the streamed reply is the whole word"
        );
        assert!(
            deltas
                .iter()
                .all(|d| d.len() <= iop_node::MAX_FRAME_PAYLOAD)
        );
        assert!(text.trim_end().ends_with("data: [DONE]"));
    })
    .await
    .expect("scenario finishes");
}

/// A tunnelled request just under the HTTP body limit, whose frame (the body, the model
/// rewritten, `stream_options` added, headers) is over the wire's frame limit: 413, and the
/// Node's connection untouched. Before, the frame failed the Edge's writer, which closed the
/// connection (every stream on it ended), and the request was sent again to the next
/// candidate, which it disconnected too.
#[tokio::test]
async fn a_request_too_large_for_one_frame_is_refused_alone() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let base = surface(&ca, upstream(Arc::new(Notify::new())).await).await;
        let http = client();
        let mut chat = serde_json::json!({"model": "gpt-4o-mini", "stream": true, "messages": [{"role": "user", "content": ""}]});
        let bare = serde_json::to_vec(&chat).unwrap().len();
        chat["messages"][0]["content"] = "x".repeat(http::MAX_REQUEST_BODY - bare).into();
        let body = serde_json::to_vec(&chat).unwrap();
        assert_eq!(body.len(), http::MAX_REQUEST_BODY);
        let resp = http.post(format!("{base}/chat/completions")).header("content-type", "application/json").body(body).send().await.unwrap();
        assert_eq!(resp.status(), 413);
        let e: serde_json::Value = resp.json().await.unwrap();
        assert!(e["error"]["message"].as_str().unwrap().contains("Edge–Node frame"), "{e}");
        // The Node still answers.
        let up = serde_json::json!({"model": "gpt-4o-mini", "stream": true, "messages": []});
        let ok = http.post(format!("{base}/chat/completions")).json(&up).send().await.unwrap();
        assert_eq!(ok.status(), 200);
        assert_eq!(&ok.bytes().await.unwrap()[..], &UPSTREAM_SSE.concat()[..]);
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let dropped = Arc::new(Notify::new());
        let base = surface(&ca, upstream(dropped.clone()).await).await;
        let http = client();
        let req = serde_json::json!({"model": "slow", "stream": true, "messages": []});
        let mut resp = http
            .post(format!("{base}/chat/completions"))
            .json(&req)
            .send()
            .await
            .unwrap();
        assert!(
            resp.chunk().await.unwrap().is_some(),
            "the stream is flowing"
        );
        let gone = dropped.notified();
        let t = Instant::now();
        drop(resp); // the HTTP client disconnects
        gone.await;
        println!("client disconnect → upstream cancel: {:?}", t.elapsed());
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn client_disconnect_before_any_response_cancels_the_upstream_request() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let dropped = Arc::new(Notify::new());
        let base = surface(&ca, upstream(dropped.clone()).await).await;
        let gone = dropped.notified();
        // A non-streamed request whose provider never answers: the client gives up.
        let req = serde_json::json!({"model": "hang", "messages": []});
        let r = client()
            .post(format!("{base}/chat/completions"))
            .timeout(Duration::from_millis(300))
            .json(&req)
            .send()
            .await;
        assert!(r.unwrap_err().is_timeout());
        gone.await;
    })
    .await
    .expect("the upstream request is dropped after the client disconnects");
}

/// Seed 000: once a provider's bytes reached the caller there is no fallback to another
/// candidate of the same model. The first candidate sends one event and then its connection
/// breaks: the caller gets that event and an ended stream, and the second candidate (free,
/// same model) never sees a request.
#[tokio::test]
async fn no_fallback_to_another_candidate_after_bytes_were_sent() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let base = surface(&ca, upstream(Arc::new(Notify::new())).await).await;
        let req = serde_json::json!({"model": "broken", "stream": true, "messages": []});
        let mut resp = client()
            .post(format!("{base}/chat/completions"))
            .json(&req)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.chunk().await.unwrap().unwrap().to_vec();
        assert!(
            String::from_utf8_lossy(&body).contains("tick"),
            "the first bytes reached the caller"
        );
        BREAK.notify_one();
        while let Ok(Some(chunk)) = resp.chunk().await {
            body.extend_from_slice(&chunk);
        }
        let body = String::from_utf8_lossy(&body);
        assert!(
            body.contains("tick"),
            "the first bytes reached the caller: {body}"
        );
        assert!(!body.contains("from upstream"), "{body}");
        assert_eq!(BROKEN_SEEN.load(Ordering::SeqCst), 1);
        assert_eq!(
            AFTER_SEEN.load(Ordering::SeqCst),
            0,
            "the other candidate was tried after bytes were sent"
        );
    })
    .await
    .expect("scenario finishes");
}
