//! One trace from the client to the provider, through the real binaries (issue #30): an
//! `iop-edge` exporting over OTLP/HTTP (its `[telemetry]` table), two `iop-node`s exporting
//! over OTLP/gRPC (the standard `OTEL_*` variables), the in-process collector of
//! `iop_tests::otlp`, and a fake upstream per Node that records the headers it receives.
//!
//! - A request with the client's `traceparent`: one trace, Edge server span → dispatch
//!   attempt → the Node's `execute` → the provider call, parent to child across the wire; the
//!   provider got the same trace id with the provider call span as its parent.
//! - A streamed request without one: the Edge starts the trace, and the streamed usage lands on
//!   the spans when the stream ends.
//! - A Node killed while the upstream holds its request: the request falls back to the other
//!   Node, and the trace shows two attempt spans (the first failed `node_disconnected`).
//! - The collector gone: requests are unaffected, and the Edge counts the spans it could not
//!   export on `/metrics`.

#![allow(clippy::unwrap_used, reason = "tests")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use iop_tests::otlp::{Collector, ReceivedSpan};
use serde_json::{Value, json};
use support::{Proc, TempDir, bin_dir, free_port, pki};

const LIMIT: Duration = Duration::from_secs(30);
const KEY: &str = "sk-gateway-trace";
const CLIENT_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CLIENT_SPAN: &str = "b7ad6b7169203331";

/// What one fake upstream saw: the `traceparent` of each request, and how many held requests
/// arrived (the first one `hold` request of all upstreams never gets an answer).
#[derive(Default)]
struct Seen {
    traceparents: std::sync::Mutex<Vec<String>>,
    holds: AtomicUsize,
}

struct Up {
    seen: Arc<Seen>,
    /// Shared by both upstreams: the first `hold` request anywhere is held.
    held: Arc<AtomicUsize>,
}

async fn chat(State(up): State<Arc<Up>>, headers: HeaderMap, body: String) -> Response {
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        up.seen.traceparents.lock().unwrap().push(tp.to_owned());
    }
    let req: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let text = req["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    if text == "hold" {
        up.seen.holds.fetch_add(1, Ordering::SeqCst);
        if up.held.fetch_add(1, Ordering::SeqCst) == 0 {
            // Never answered: the test kills this upstream's Node meanwhile.
            std::future::pending::<()>().await;
        }
    }
    if text == "stall" {
        // The response starts, then the provider goes silent (the Node's stall watchdog ends
        // it).
        let first = format!(
            "data: {}\n\n",
            json!({"id":"c1","object":"chat.completion.chunk","model":"fake-model","choices":[{"index":0,"delta":{"content":"a"}}]})
        );
        use futures_util::StreamExt as _;
        let body = futures_util::stream::once(async move { Ok::<_, std::io::Error>(first) })
            .chain(futures_util::stream::pending());
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(body))
            .unwrap();
    }
    let usage = json!({"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14});
    if req["stream"] == true {
        let chunk = |c: &str| {
            format!(
                "data: {}\n\n",
                json!({"id":"c1","object":"chat.completion.chunk","model":"fake-model","choices":[{"index":0,"delta":{"content":c}}]})
            )
        };
        let mut sse = chunk("a") + &chunk(" b") + &chunk(" c");
        if req["stream_options"]["include_usage"] == true {
            sse += &format!(
                "data: {}\n\n",
                json!({"id":"c1","object":"chat.completion.chunk","model":"fake-model","choices":[],"usage":usage})
            );
        }
        sse += "data: [DONE]\n\n";
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from(sse))
            .unwrap();
    }
    axum::Json(json!({
        "id": "c1",
        "object": "chat.completion",
        "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}, "finish_reason": "stop"}],
        "usage": usage,
    }))
    .into_response()
}

async fn upstream(held: Arc<AtomicUsize>) -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route("/v1/chat/completions", axum::routing::post(chat))
        // The Node's health probe after a stall: the provider is up.
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                axum::Json(
                    json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}),
                )
            }),
        )
        .with_state(Arc::new(Up {
            seen: seen.clone(),
            held,
        }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/v1"), seen)
}

fn edge_toml(dir: &std::path::Path, nodes_port: u16, http_port: u16, bases: &[String], otlp: &str) {
    let d = dir.display();
    std::fs::write(dir.join("api-keys"), format!("{KEY}\n")).unwrap();
    support::set_mode(&dir.join("api-keys"), 0o600);
    let mut text = format!(
        r#"edge_id = "edge-1"
[listen]
nodes = "127.0.0.1:{nodes_port}"
http = "127.0.0.1:{http_port}"
[tls]
trust_domain = "iop.test"
ca = "{d}/ca/ca.pem"
cert = "{d}/edge.pem"
key = "{d}/edge.key"
[auth]
keys_file = "{d}/api-keys"
[pool]
queue_wait_sec = 10
[telemetry]
otlp_endpoint = "{otlp}"
otlp_protocol = "http/protobuf"
"#
    );
    for (i, base) in bases.iter().enumerate() {
        let n = i + 1;
        text += &format!(
            r#"[[nodes]]
node_id = "node-{n}"
[[nodes.adapters]]
name = "upstream"
type = "openai_compat"
base_url = "{base}"
profile = "openai"
capacity = 8
"#
        );
    }
    text += "[[models]]\nname = \"mesh-model\"\n";
    for n in 1..=bases.len() {
        text += &format!(
            r#"[[models.providers]]
node_id = "node-{n}"
provider_id = "upstream-{n}"
adapter = "upstream"
target = "fake-model"
capacity = 8
response_stall_timeout_sec = 1
"#
        );
    }
    std::fs::write(dir.join("edge.toml"), text).unwrap();
}

fn node(dir: &std::path::Path, name: &str, nodes_port: u16, grpc: &str) -> Proc {
    let config = support::node_config(dir, name, nodes_port);
    Proc::spawn(
        bin_dir().join("iop-node").to_str().unwrap(),
        &["--config", config.to_str().unwrap()],
        &[
            ("UPSTREAM_KEY", "sk-upstream"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", grpc),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
        dir,
        name,
    )
}

async fn post(
    client: &reqwest::Client,
    http_port: u16,
    body: Value,
    traceparent: Option<&str>,
) -> (u16, String) {
    let mut r = client
        .post(format!("http://127.0.0.1:{http_port}/v1/chat/completions"))
        .bearer_auth(KEY)
        .json(&body);
    if let Some(tp) = traceparent {
        r = r.header("traceparent", tp);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

fn one<'a>(
    spans: &'a [ReceivedSpan],
    what: &str,
    f: impl Fn(&ReceivedSpan) -> bool,
) -> &'a ReceivedSpan {
    let found: Vec<_> = spans.iter().filter(|s| f(s)).collect();
    assert_eq!(found.len(), 1, "exactly one {what} in {spans:#?}");
    found[0]
}

/// The trace id and parent span id of a `traceparent`.
fn ids(tp: &str) -> (String, String) {
    let parts: Vec<&str> = tp.split('-').collect();
    (parts[1].to_owned(), parts[2].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_edge_node_and_provider() {
    let dir = TempDir::new("tracing");
    pki(dir.path(), &["node-1", "node-2"]);
    let collector = Collector::start().await;
    let held = Arc::new(AtomicUsize::new(0));
    let (base1, seen1) = upstream(held.clone()).await;
    let (base2, seen2) = upstream(held.clone()).await;
    let (nodes_port, http_port) = (free_port(), free_port());
    edge_toml(
        dir.path(),
        nodes_port,
        http_port,
        &[base1, base2],
        &collector.http,
    );
    let mut edge = Proc::spawn(
        bin_dir().join("iop-edge").to_str().unwrap(),
        &["--config", dir.path().join("edge.toml").to_str().unwrap()],
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
        dir.path(),
        "edge",
    );
    let mut nodes = vec![
        node(dir.path(), "node-1", nodes_port, &collector.grpc),
        node(dir.path(), "node-2", nodes_port, &collector.grpc),
    ];
    let metrics_url = format!("http://127.0.0.1:{http_port}/metrics");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let ready = async {
        for _ in 0..1500 {
            if let Ok(r) = client
                .get(format!("http://127.0.0.1:{http_port}/readyz"))
                .send()
                .await
                && r.status().is_success()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    };
    assert!(
        ready.await,
        "the mesh did not become ready:\n{}",
        edge.log_text()
    );
    assert!(
        edge.log_text().contains("exporting spans over OTLP"),
        "{}",
        edge.log_text()
    );
    // Both Nodes are ready (each logs it).
    let both = async {
        for _ in 0..1500 {
            if nodes
                .iter()
                .all(|n| n.log_text().contains("dispatch-ready"))
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    };
    assert!(
        both.await,
        "{}\n{}",
        nodes[0].log_text(),
        nodes[1].log_text()
    );

    // 1. The client's trace is continued to the provider.
    let client_tp = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let (status, body) = post(
        &client,
        http_port,
        json!({"model": "mesh-model", "messages": [{"role": "user", "content": "hello"}]}),
        Some(&client_tp),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let spans = collector
        .wait_for(LIMIT, |s| {
            s.iter().filter(|x| x.trace_id == CLIENT_TRACE).count() >= 4
        })
        .await;
    let t: Vec<ReceivedSpan> = spans
        .into_iter()
        .filter(|s| s.trace_id == CLIENT_TRACE)
        .collect();
    let server = one(&t, "Edge server span", |s| {
        s.service == "iop-edge" && s.kind == 2
    });
    assert_eq!(server.name, "POST /v1/chat/completions");
    assert_eq!(
        server.parent_span_id, CLIENT_SPAN,
        "the client's span is the parent"
    );
    assert_eq!(server.attr("gen_ai.request.model"), Some("mesh-model"));
    assert_eq!(server.attr("gen_ai.operation.name"), Some("chat"));
    assert_eq!(server.attr("http.response.status_code"), Some("200"));
    assert_eq!(server.attr("gen_ai.usage.input_tokens"), Some("11"));
    assert!(
        server.attr("iop.gateway.overhead_us").is_some(),
        "{server:#?}"
    );
    let attempt = one(&t, "attempt span", |s| {
        s.service == "iop-edge" && s.name == "dispatch"
    });
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(attempt.attr("iop.attempt"), Some("1"));
    assert_eq!(attempt.attr("gen_ai.response.model"), Some("fake-model"));
    let exec = one(&t, "Node execute span", |s| {
        s.service == "iop-node" && s.name == "execute"
    });
    assert_eq!(
        exec.parent_span_id, attempt.span_id,
        "the Node's span is the attempt's child"
    );
    assert_eq!(exec.transport, "grpc");
    let provider = one(&t, "provider span", |s| {
        s.service == "iop-node" && s.kind == 3
    });
    assert_eq!(provider.parent_span_id, exec.span_id);
    assert_eq!(provider.name, "chat fake-model");
    assert_eq!(provider.attr("server.address"), Some("127.0.0.1"));
    assert_eq!(provider.attr("gen_ai.usage.output_tokens"), Some("3"));
    let sent: Vec<String> = seen1
        .traceparents
        .lock()
        .unwrap()
        .iter()
        .chain(seen2.traceparents.lock().unwrap().iter())
        .cloned()
        .collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        ids(&sent[0]),
        (CLIENT_TRACE.to_owned(), provider.span_id.clone()),
        "the provider's parent is the provider call span"
    );
    for s in &t {
        assert!(!format!("{s:?}").contains(KEY), "no secret in a span");
        assert!(
            !format!("{s:?}").contains("sk-upstream"),
            "no secret in a span"
        );
        assert!(
            !format!("{s:?}").contains("hello"),
            "no prompt text in a span"
        );
    }

    // 2. A stream without a client context: the Edge starts the trace; streamed usage lands
    // on the spans when the stream ends.
    let (status, body) = post(
        &client,
        http_port,
        json!({"model": "mesh-model", "stream": true, "messages": [{"role": "user", "content": "stream"}]}),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert!(body.contains("[DONE]"), "{body}");
    let tp = {
        let all: Vec<String> = seen1
            .traceparents
            .lock()
            .unwrap()
            .iter()
            .chain(seen2.traceparents.lock().unwrap().iter())
            .cloned()
            .collect();
        assert_eq!(all.len(), 2);
        all.into_iter().find(|t| !t.contains(CLIENT_TRACE)).unwrap()
    };
    let (trace, _) = ids(&tp);
    let spans = collector
        .wait_for(LIMIT, |s| {
            s.iter().filter(|x| x.trace_id == trace).count() >= 4
        })
        .await;
    let t: Vec<ReceivedSpan> = spans.into_iter().filter(|s| s.trace_id == trace).collect();
    let server = one(&t, "Edge server span", |s| {
        s.service == "iop-edge" && s.kind == 2
    });
    assert_eq!(server.parent_span_id, "", "a new trace's root");
    assert_eq!(
        server.attr("gen_ai.usage.input_tokens"),
        Some("11"),
        "{server:#?}"
    );
    assert_eq!(server.attr("gen_ai.usage.output_tokens"), Some("3"));
    let attempt = one(&t, "attempt span", |s| s.name == "dispatch");
    assert_eq!(attempt.attr("gen_ai.usage.output_tokens"), Some("3"));
    assert!(
        server.end_ns >= attempt.end_ns,
        "the attempt ends inside the server span"
    );

    // 2b. The provider goes silent mid-stream: the Node's stall watchdog ends the stream, and
    // both the attempt and the Node's span show it.
    let stall_trace = "6bf92f3577b34da6a3ce929d0e0e4737";
    let (status, _) = post(
        &client,
        http_port,
        json!({"model": "mesh-model", "stream": true, "messages": [{"role": "user", "content": "stall"}]}),
        Some(&format!("00-{stall_trace}-00f067aa0ba902b7-01")),
    )
    .await;
    assert_eq!(status, 200, "the stream had started");
    let spans = collector
        .wait_for(LIMIT, |s| {
            s.iter().filter(|x| x.trace_id == stall_trace).count() >= 4
        })
        .await;
    let t: Vec<ReceivedSpan> = spans
        .into_iter()
        .filter(|s| s.trace_id == stall_trace)
        .collect();
    let attempt = one(&t, "attempt span", |s| s.name == "dispatch");
    assert!(
        attempt.events.iter().any(|e| e == "response_stalled"),
        "{attempt:#?}"
    );
    let exec = one(&t, "execute span", |s| s.name == "execute");
    assert!(
        exec.events.iter().any(|e| e == "response_stalled"),
        "{exec:#?}"
    );
    assert_eq!(exec.attr("error.type"), Some("response_stalled"));
    let server = one(&t, "Edge server span", |s| {
        s.service == "iop-edge" && s.kind == 2
    });
    assert_eq!(
        server.attr("error.type"),
        Some("provider_error"),
        "{server:#?}"
    );

    // 3. A Node dies with the request at its upstream: the request falls back to the other
    // Node; two attempt spans.
    let fallback_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let handle = {
        let client = client.clone();
        tokio::spawn(async move {
            post(
                &client,
                http_port,
                json!({"model": "mesh-model", "messages": [{"role": "user", "content": "hold"}]}),
                Some(&format!("00-{fallback_trace}-00f067aa0ba902b7-01")),
            )
            .await
        })
    };
    let which = async {
        for _ in 0..1500 {
            if seen1.holds.load(Ordering::SeqCst) > 0 {
                return 0;
            }
            if seen2.holds.load(Ordering::SeqCst) > 0 {
                return 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the held request never reached an upstream");
    }
    .await;
    nodes[which].child.kill().unwrap();
    let _ = nodes[which].child.wait();
    let (status, body) = tokio::time::timeout(LIMIT, handle).await.unwrap().unwrap();
    assert_eq!(status, 200, "the fallback served it: {body}");
    let spans = collector
        .wait_for(LIMIT, |s| {
            s.iter()
                .filter(|x| x.trace_id == fallback_trace && x.name == "execute")
                .count()
                >= 1
                && s.iter()
                    .filter(|x| {
                        x.trace_id == fallback_trace && x.kind == 2 && x.service == "iop-edge"
                    })
                    .count()
                    >= 1
        })
        .await;
    let t: Vec<ReceivedSpan> = spans
        .into_iter()
        .filter(|s| s.trace_id == fallback_trace)
        .collect();
    let server = one(&t, "Edge server span", |s| {
        s.service == "iop-edge" && s.kind == 2
    });
    let mut attempts: Vec<&ReceivedSpan> = t.iter().filter(|s| s.name == "dispatch").collect();
    attempts.sort_by_key(|s| s.start_ns);
    assert_eq!(attempts.len(), 2, "{t:#?}");
    for a in &attempts {
        assert_eq!(a.parent_span_id, server.span_id);
    }
    assert_eq!(attempts[0].attr("iop.attempt.reason"), Some("first"));
    assert_eq!(attempts[0].attr("error.type"), Some("node_disconnected"));
    assert!(
        attempts[0].events.iter().any(|e| e == "node_disconnected"),
        "{:?}",
        attempts[0]
    );
    assert_eq!(attempts[1].attr("iop.attempt.reason"), Some("fallback"));
    assert_eq!(attempts[1].attr("error.type"), None);
    assert_ne!(
        attempts[0].attr("iop.node.id"),
        attempts[1].attr("iop.node.id")
    );
    let exec = one(&t, "surviving Node's execute span", |s| s.name == "execute");
    assert_eq!(exec.parent_span_id, attempts[1].span_id);
    // The log line of the fallback carries the trace id.
    let line = edge
        .log_text()
        .lines()
        .find(|l| l.contains("sending the request to another candidate"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no fallback log line:\n{}", edge.log_text()));
    assert!(
        line.contains(&format!("trace_id={fallback_trace}")),
        "{line}"
    );

    // 4. The collector goes away: requests are unaffected, and the Edge counts the spans it
    // could not export.
    drop(collector);
    for i in 0..20 {
        let (status, body) = post(
            &client,
            http_port,
            json!({"model": "mesh-model", "messages": [{"role": "user", "content": format!("after {i}")}]}),
            None,
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let lost = async {
        for _ in 0..1500 {
            let m = client
                .get(&metrics_url)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let count = |outcome: &str| -> u64 {
                m.lines()
                    .find(|l| {
                        l.starts_with(&format!(
                            "iop_telemetry_spans_total{{outcome=\"{outcome}\"}}"
                        ))
                    })
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            // Each request: a server and an attempt span.
            if count("failed") + count("dropped") >= 40 {
                return (count("exported"), m);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the lost spans were not counted");
    };
    let (exported, m) = lost.await;
    assert!(exported > 0, "{m}");
    assert!(
        m.contains("iop_edge_gateway_overhead_seconds_count{endpoint=\"chat_completions\"}"),
        "{m}"
    );
    assert!(
        m.contains("gen_ai_server_time_to_first_token_seconds_bucket"),
        "{m}"
    );
    assert!(m.contains("gen_ai_client_token_usage_bucket"), "{m}");
    assert!(!m.contains(KEY));
    edge.stop();
    for n in &mut nodes {
        let _ = n.child.kill();
    }
    let logs = edge.log_text();
    assert!(!logs.contains(KEY), "no secret in the Edge's log");
}

/// Managed mode through `iop-mesh --managed --otlp-endpoint`: the lease acquisition is a span
/// of the request's trace, and so is the Control Plane's answer to it (service `iop-cp`),
/// parent to child across the Control Plane wire; every service exports to the one endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_lease_is_a_span_of_the_same_trace() {
    let dir = TempDir::new("tracing-managed");
    let collector = Collector::start().await;
    let held = Arc::new(AtomicUsize::new(0));
    let (base, seen) = upstream(held).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mesh = Proc::spawn(
        env!("CARGO_BIN_EXE_iop-mesh"),
        &[
            "--managed",
            "--nodes",
            "1",
            "--listen",
            &listen,
            "--openai-url",
            &base,
            "--model",
            "mesh-model",
            "--upstream-model",
            "fake-model",
            "--upstream-api-key-env",
            "UPSTREAM_KEY",
            "--otlp-endpoint",
            &collector.grpc,
            "--otlp-protocol",
            "grpc",
        ],
        &[
            ("UPSTREAM_KEY", "sk-upstream-managed"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
        dir.path(),
        "mesh",
    );
    let up = async {
        for _ in 0..3000 {
            if mesh.log_text().contains("base URL") {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    };
    assert!(up.await, "{}", mesh.log_text());
    let log = mesh.log_text();
    assert!(log.contains("exporting spans over OTLP"), "{log}");
    let token = log
        .lines()
        .find_map(|l| l.strip_prefix("iop-mesh: token: "))
        .expect("the mesh prints a token")
        .trim()
        .to_owned();
    let trace = "5af7651916cd43dd8448eb211c80319d";
    let _ = rustls::crypto::ring::default_provider().install_default();
    let resp = reqwest::Client::new()
        .post(format!("http://{listen}/v1/chat/completions"))
        .bearer_auth(&token)
        .header("traceparent", format!("00-{trace}-a7ad6b7169203332-01"))
        .json(&json!({"model": "mesh-model", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    let spans = collector
        .wait_for(LIMIT, |s| {
            let t: Vec<_> = s.iter().filter(|x| x.trace_id == trace).collect();
            ["iop-edge", "iop-node", "iop-cp"]
                .iter()
                .all(|svc| t.iter().any(|x| x.service == *svc))
                && t.iter().any(|x| x.name == "execute")
                && t.iter().any(|x| x.kind == 2 && x.service == "iop-edge")
        })
        .await;
    let t: Vec<ReceivedSpan> = spans.into_iter().filter(|s| s.trace_id == trace).collect();
    let attempt = one(&t, "attempt span", |s| s.name == "dispatch");
    let lease = one(&t, "lease acquire span", |s| s.name == "lease acquire");
    assert_eq!(lease.service, "iop-edge");
    assert_eq!(
        lease.parent_span_id, attempt.span_id,
        "the lease is part of the attempt"
    );
    let issue = one(&t, "Control Plane lease span", |s| s.name == "lease issue");
    assert_eq!(issue.service, "iop-cp");
    assert_eq!(
        issue.parent_span_id, lease.span_id,
        "across the Control Plane wire"
    );
    assert_eq!(issue.attr("iop.principal.id"), Some("mesh"));
    let exec = one(&t, "execute span", |s| s.name == "execute");
    assert_eq!(exec.parent_span_id, attempt.span_id);
    let sent = seen.traceparents.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert_eq!(ids(&sent[0]).0, trace);
    for s in &t {
        let text = format!("{s:?}");
        assert!(!text.contains(&token), "no token in a span");
        assert!(
            !text.contains("sk-upstream-managed"),
            "no upstream key in a span"
        );
    }
}
