//! `route_load`: what translation costs on each of the five HTTP routes, beside the same request
//! passed through and the provider called directly, in the same run. Prints Markdown tables;
//! numbers go to `benches/README.md`.
//!
//! ```text
//! cargo run --release -p iop-benches --bin route_load               # latency and cancel
//! cargo run --release -p iop-benches --bin route_load -- latency    # or: cancel
//! ROUTE_LOAD_RATE=300 ROUTE_LOAD_COUNT=3000 cargo run --release -p iop-benches --bin route_load
//! ```
//!
//! One process on 127.0.0.1: a local provider that speaks every dialect (chat completions,
//! Responses and Messages as SSE, count_tokens, models; canned answers of 6 text deltas with
//! finish and usage), an Edge (pool + HTTP surface) and one Node over mTLS with three
//! `openai_compat` adapters on that provider: `pass` (all five operations: everything passes
//! through), `via-chat` (`chat_only`: Responses and Messages are translated to chat) and
//! `via-anth` (`anthropic`: chat is translated to Messages; count_tokens passes through).
//!
//! - **latency**: per route, open-loop arrivals at `ROUTE_LOAD_RATE`/s (default 200),
//!   `ROUTE_LOAD_COUNT` requests (default 1000) on each path — direct to the provider, through
//!   the mesh passed through, through the mesh translated — time to the last byte of a streamed
//!   answer (count_tokens and models: the whole JSON); p50 and p99, and what translation adds
//!   over the passthrough.
//! - **cancel**: per streamed route and plan, 100 times: the client reads the first chunk and
//!   disconnects; the time until the provider sees its response dropped (HTTP disconnect → Edge
//!   `CancelRequest` → Node drops the upstream request), beside the same disconnect made
//!   directly; count_tokens likewise on a provider that never answers (the client gives up
//!   after its first 20 ms). Models is answered by the Edge itself: there is no upstream
//!   request to cancel.
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
use axum::routing::{get, post};
use bytes::Bytes;
use futures_util::StreamExt as _;
use iop_benches::load::{at_rate, edge_tls, ms, node_tls, percentile};
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::profile::Profile;
use iop_edge::{Lifecycle, TransportConfig, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{AdapterConfig, AdapterSettings, NodeConfigPayload, OpenAiCompatSettings};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const TICK: Duration = Duration::from_millis(5);
const CANCEL_ROUNDS: usize = 100;

/// Sends the instant it is dropped.
struct OnDrop(mpsc::UnboundedSender<Instant>);
impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Instant::now());
    }
}

fn sse(events: Vec<String>) -> Response {
    let stream = futures_util::stream::iter(
        events
            .into_iter()
            .map(|e| Ok::<_, Infallible>(Bytes::from(e))),
    );
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// Ticks `frame` every [`TICK`] until the response is dropped.
fn slow(dropped: mpsc::UnboundedSender<Instant>, frame: String) -> Response {
    let guard = OnDrop(dropped);
    let stream = futures_util::stream::unfold((guard, 0u64), move |(g, i)| {
        let frame = frame.clone();
        async move {
            if i > 0 {
                tokio::time::sleep(TICK).await;
            }
            Some((Ok::<_, Infallible>(Bytes::from(frame)), (g, i + 1)))
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn chat_events() -> Vec<String> {
    let chunk = |delta: Value, finish: Value| {
        format!(
            "data: {}\n\n",
            json!({ "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
        )
    };
    let mut out = vec![chunk(
        json!({ "role": "assistant", "content": "" }),
        Value::Null,
    )];
    for i in 0..6 {
        out.push(chunk(json!({ "content": format!("tok{i} ") }), Value::Null));
    }
    out.push(chunk(json!({}), json!("stop")));
    out.push(format!("data: {}\n\n", json!({ "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": { "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11 } })));
    out.push("data: [DONE]\n\n".into());
    out
}

fn messages_events() -> Vec<String> {
    let ev = |kind: &str, data: Value| format!("event: {kind}\ndata: {data}\n\n");
    let mut out = vec![
        ev(
            "message_start",
            json!({ "type": "message_start", "message": { "id": "m", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": null, "stop_sequence": null, "usage": { "input_tokens": 5, "output_tokens": 1 } } }),
        ),
        ev(
            "content_block_start",
            json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } }),
        ),
        ev("ping", json!({ "type": "ping" })),
    ];
    for i in 0..6 {
        out.push(ev("content_block_delta", json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": format!("tok{i} ") } })));
    }
    out.push(ev(
        "content_block_stop",
        json!({ "type": "content_block_stop", "index": 0 }),
    ));
    out.push(ev("message_delta", json!({ "type": "message_delta", "delta": { "stop_reason": "end_turn", "stop_sequence": null }, "usage": { "output_tokens": 6 } })));
    out.push(ev("message_stop", json!({ "type": "message_stop" })));
    out
}

fn responses_events() -> Vec<String> {
    // What OpenAI's Responses API streams for a short text answer.
    let mut e = iop_dialect::encode::ResponsesStreamEncoder::new(
        iop_dialect::Meta {
            id: "resp_1".into(),
            model: "m".into(),
            created: 1,
        },
        json!({}),
    );
    let mut out = Vec::new();
    for i in 0..6 {
        e.event(&iop_dialect::Event::Text(format!("tok{i} ")), &mut out);
    }
    e.event(
        &iop_dialect::Event::Usage(iop_dialect::Usage {
            input_tokens: Some(5),
            output_tokens: Some(6),
        }),
        &mut out,
    );
    e.finish(&mut out);
    let mut bytes = Vec::new();
    iop_dialect::sse::SseEvent::write_all(&out, &mut bytes);
    vec![String::from_utf8(bytes).unwrap()]
}

/// The local provider; `slow` models tick until dropped (reported on the channel) and
/// `slow` count_tokens never answers.
async fn provider() -> (SocketAddr, mpsc::UnboundedReceiver<Instant>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let (t1, t2, t3, t4) = (tx.clone(), tx.clone(), tx.clone(), tx);
    let app = Router::new()
        .route("/v1/models", get(|| async { axum::Json(json!({ "object": "list", "data": [{ "id": "m", "object": "model", "created": 0, "owned_by": "x" }] })) }))
        .route(
            "/v1/chat/completions",
            post(move |body: axum::Json<Value>| {
                let t = t1.clone();
                async move {
                    if body["model"] == "slow" {
                        return slow(t, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t\"}}]}\n\n".into());
                    }
                    sse(chat_events())
                }
            }),
        )
        .route(
            "/v1/messages",
            post(move |body: axum::Json<Value>| {
                let t = t2.clone();
                async move {
                    if body["model"] == "slow" {
                        return slow(t, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"t\"}}\n\n".into());
                    }
                    sse(messages_events())
                }
            }),
        )
        .route(
            "/v1/responses",
            post(move |body: axum::Json<Value>| {
                let t = t3.clone();
                async move {
                    if body["model"] == "slow" {
                        return slow(t, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"t\"}\n\n".into());
                    }
                    sse(responses_events())
                }
            }),
        )
        .route(
            "/v1/messages/count_tokens",
            post(move |body: axum::Json<Value>| {
                let t = t4.clone();
                async move {
                    if body["model"] == "slow" {
                        let _guard = OnDrop(t);
                        std::future::pending::<()>().await;
                    }
                    axum::Json(json!({ "input_tokens": 12 }))
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, rx)
}

/// The Edge and one Node; returns the Edge's root URL.
async fn mesh(ca: &Ca, provider: SocketAddr) -> String {
    let all: std::collections::BTreeMap<String, String> = [
        ("models", "/models"),
        ("chat_completions", "/chat/completions"),
        ("responses", "/responses"),
        ("messages", "/messages"),
        ("count_tokens", "/messages/count_tokens"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect();
    let profiles = [
        ("pass", Profile::custom("pass", "openai", &all).unwrap()),
        ("via-chat", Profile::preset("chat_only").unwrap()),
        ("via-anth", Profile::preset("anthropic").unwrap()),
    ];
    let adapters = profiles
        .iter()
        .map(|(name, profile)| AdapterConfig {
            name: (*name).into(),
            adapter_type: "openai_compat".into(),
            enabled: true,
            capacity: 4096,
            long_context_capacity: 0,
            targets: vec![],
            settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                base_url: format!("http://{provider}/v1"),
                protocol_profile: profile.clone(),
                request_timeout_sec: 600,
            }),
        })
        .collect();
    let mut providers = Vec::new();
    let mut models = Vec::new();
    for (adapter, _) in &profiles {
        for target in ["m", "slow"] {
            let id = format!("{adapter}-{target}");
            let key = ProviderKey {
                node_id: "node-1".into(),
                provider_id: id.clone(),
            };
            providers.push(ProviderSpec {
                key: key.clone(),
                adapter: (*adapter).into(),
                target: target.into(),
                kind: ProviderKind::OpenAiCompat,
                category: "api".into(),
                capacity: 4096,
                long_context_capacity: 0,
                response_stall_timeout: Duration::from_secs(60),
                enabled: true,
            });
            models.push((id, vec![key]));
        }
    }
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), edge_tls(ca));
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters,
            ..Default::default()
        },
    )];
    let names = models.iter().map(|(m, _)| m.clone()).collect();
    cfg.pool = Some(PoolConfig {
        models,
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
            models: names,
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
    let root = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(http::serve(listener, app, std::future::pending()));
    root
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Models,
    Chat,
    Responses,
    Messages,
    CountTokens,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Self::Models => "/v1/models",
            Self::Chat => "/v1/chat/completions",
            Self::Responses => "/v1/responses",
            Self::Messages => "/v1/messages",
            Self::CountTokens => "/v1/messages/count_tokens",
        }
    }

    fn body(self, model: &str) -> String {
        let msgs = json!([{ "role": "user", "content": "hello" }]);
        match self {
            Self::Models => String::new(),
            Self::Chat => json!({ "model": model, "stream": true, "messages": msgs }).to_string(),
            Self::Responses => {
                json!({ "model": model, "stream": true, "input": "hello" }).to_string()
            }
            Self::Messages => {
                json!({ "model": model, "stream": true, "max_tokens": 64, "messages": msgs })
                    .to_string()
            }
            Self::CountTokens => json!({ "model": model, "messages": msgs }).to_string(),
        }
    }

    /// What the end of a complete answer contains.
    fn done_marker(self) -> &'static [u8] {
        match self {
            Self::Models => b"\"data\"",
            Self::Chat => b"[DONE]",
            Self::Responses => b"response.completed",
            Self::Messages => b"message_stop",
            Self::CountTokens => b"input_tokens",
        }
    }

    /// (passthrough model, translated model) on the mesh.
    fn models(self) -> (&'static str, &'static str) {
        match self {
            Self::Models => ("pass-m", "pass-m"),
            Self::Chat => ("pass-m", "via-anth-m"),
            Self::Responses | Self::Messages | Self::CountTokens => ("pass-m", "via-chat-m"),
        }
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(256)
        .build()
        .unwrap()
}

async fn once(c: &reqwest::Client, url: &str, route: Route, body: &str) {
    let resp = if route == Route::Models {
        c.get(url).send().await.unwrap()
    } else {
        c.post(url)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
    };
    assert_eq!(resp.status(), 200, "{url}");
    let bytes = resp.bytes().await.unwrap();
    let marker = route.done_marker();
    assert!(
        bytes.windows(marker.len()).any(|w| w == marker),
        "{url}: incomplete answer {}",
        String::from_utf8_lossy(&bytes)
    );
}

async fn latency(direct: &str, root: &str) {
    let rate = std::env::var("ROUTE_LOAD_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let count = std::env::var("ROUTE_LOAD_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    println!(
        "\n## latency per route: {count} requests per path at {rate}/s, open loop (time to last byte)\n"
    );
    println!(
        "| route | direct to provider | mesh, passed through | mesh, translated | translated − passed through |\n|---|---:|---:|---:|---:|"
    );
    for route in [
        Route::Models,
        Route::Chat,
        Route::Responses,
        Route::Messages,
        Route::CountTokens,
    ] {
        let (pass, translated) = route.models();
        let run = |url: String, body: String| {
            let c = client();
            at_rate(rate, count, move |_| {
                let (c, u, b) = (c.clone(), url.clone(), body.clone());
                async move { once(&c, &u, route, &b).await }
            })
        };
        let path = route.name();
        // Warm-up.
        for model in [pass, translated] {
            let c = client();
            for _ in 0..50 {
                once(&c, &format!("{root}{path}"), route, &route.body(model)).await;
            }
        }
        let d = run(format!("{direct}{path}"), route.body("m")).await;
        let p = run(format!("{root}{path}"), route.body(pass)).await;
        let t = run(format!("{root}{path}"), route.body(translated)).await;
        let cell = |v: &[Duration]| {
            format!(
                "{:.3} / {:.3} ms",
                ms(percentile(v, 0.5)),
                ms(percentile(v, 0.99))
            )
        };
        let translated_cell = if route == Route::Models {
            "— (answered by the Edge)".to_owned()
        } else {
            cell(&t)
        };
        let added = if route == Route::Models {
            "—".to_owned()
        } else {
            format!(
                "**{:+.3} / {:+.3} ms**",
                ms(percentile(&t, 0.5)) - ms(percentile(&p, 0.5)),
                ms(percentile(&t, 0.99)) - ms(percentile(&p, 0.99))
            )
        };
        println!(
            "| `{path}` | {} | {} | {translated_cell} | {added} |",
            cell(&d),
            cell(&p)
        );
    }
    println!(
        "\n(cells: p50 / p99. Translated = Responses and Messages over a chat-only upstream, chat over an Anthropic upstream, count_tokens estimated by the Edge without an upstream call.)"
    );
}

async fn disconnect_to_cancel(
    url: &str,
    route: Route,
    body: &str,
    dropped: &mut mpsc::UnboundedReceiver<Instant>,
) -> Vec<Duration> {
    let c = client();
    let mut out = Vec::with_capacity(CANCEL_ROUNDS);
    for _ in 0..CANCEL_ROUNDS {
        while dropped.try_recv().is_ok() {}
        let t0;
        if route == Route::CountTokens {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_owned())
                .timeout(Duration::from_millis(20))
                .send()
                .await;
            assert!(r.is_err(), "the provider never answers");
            t0 = Instant::now();
        } else {
            let resp = c
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_owned())
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let mut stream = resp.bytes_stream();
            stream.next().await.unwrap().unwrap();
            t0 = Instant::now();
            drop(stream);
        }
        let t1 = tokio::time::timeout(Duration::from_secs(10), dropped.recv())
            .await
            .expect("the upstream request is cancelled")
            .unwrap();
        out.push(t1.saturating_duration_since(t0));
    }
    out.sort();
    out
}

async fn cancel(direct: &str, root: &str, dropped: &mut mpsc::UnboundedReceiver<Instant>) {
    println!(
        "\n## client disconnect → upstream request dropped, per route ({CANCEL_ROUNDS} rounds; streams tick every {TICK:?})\n"
    );
    println!(
        "| route | direct to provider | mesh, passed through | mesh, translated |\n|---|---:|---:|---:|"
    );
    for route in [
        Route::Chat,
        Route::Responses,
        Route::Messages,
        Route::CountTokens,
    ] {
        let path = route.name();
        let (pass, translated) = match route {
            Route::Chat => ("pass-slow", Some("via-anth-slow")),
            Route::CountTokens => ("pass-slow", None),
            _ => ("pass-slow", Some("via-chat-slow")),
        };
        let cell = |v: &[Duration]| {
            format!(
                "{:.3} / {:.3} ms",
                ms(percentile(v, 0.5)),
                ms(percentile(v, 0.99))
            )
        };
        let d = disconnect_to_cancel(
            &format!("{direct}{path}"),
            route,
            &route.body("slow"),
            dropped,
        )
        .await;
        let p =
            disconnect_to_cancel(&format!("{root}{path}"), route, &route.body(pass), dropped).await;
        let t = match translated {
            Some(m) => cell(
                &disconnect_to_cancel(&format!("{root}{path}"), route, &route.body(m), dropped)
                    .await,
            ),
            None => "— (estimated: no upstream call)".to_owned(),
        };
        println!("| `{path}` | {} | {} | {t} |", cell(&d), cell(&p));
    }
    println!("| `/v1/models` | — | — (answered by the Edge: no upstream request) | — |");
    println!(
        "\n(cells: p50 / p99 from the disconnect — for count_tokens, from the client's 20 ms timeout — to the provider seeing its response dropped.)"
    );
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let which = std::env::args().nth(1).unwrap_or_default();
    let ca = Ca::new("route_load CA");
    let (p, mut dropped) = provider().await;
    let root = mesh(&ca, p).await;
    let direct = format!("http://{p}");
    println!("# route_load (loopback, release build expected)");
    if which.is_empty() || which == "latency" {
        latency(&direct, &root).await;
    }
    if which.is_empty() || which == "cancel" {
        cancel(&direct, &root, &mut dropped).await;
    }
}
