//! The text tool-call fallback end to end: HTTP client → Edge surface → mTLS → Node `ollama`
//! adapter → a local fake Ollama whose `tiny` model rejects the native tool API.
//!
//! - `tiny`: `tools` → 400 "does not support tools"; the retry (no tools, instruction in the
//!   leading system message) answers with a `<tool_call>` in its text → the Edge returns
//!   `tool_calls`, streamed and not.
//! - `plain`: accepts tools and answers the same text without the fallback mark → the Edge
//!   returns the text unchanged (the seed forbids parsing ordinary content into tool calls).
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{Lifecycle, TransportConfig, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{AdapterConfig, AdapterSettings, NativeSettings, NodeConfigPayload};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);

/// The answer text, split across NDJSON lines so that the tag straddles deltas.
const PIECES: [&str; 4] = [
    "Checking the weather.\n<tool",
    "_call>{\"name\": \"get_weather\", ",
    "\"arguments\": {\"city\": \"Paris\"}}",
    "</tool_call>",
];

fn ndjson(model: &str) -> String {
    let mut out = String::new();
    for p in PIECES {
        let line =
            json!({"model": model, "message": {"role": "assistant", "content": p}, "done": false});
        out.push_str(&format!("{line}\n"));
    }
    let done = json!({"model": model, "message": {"role": "assistant", "content": ""}, "done": true, "prompt_eval_count": 9, "eval_count": 7});
    out.push_str(&format!("{done}\n"));
    out
}

/// Every `/api/chat` body the fake Ollama received.
type Seen = Arc<Mutex<Vec<Value>>>;

async fn fake_ollama(seen: Seen) -> std::net::SocketAddr {
    let app = Router::new().route(
        "/api/chat",
        post(move |body: axum::Json<Value>| {
            let seen = seen.clone();
            async move {
                let body = body.0;
                seen.lock().unwrap().push(body.clone());
                let model = body["model"].as_str().unwrap_or_default().to_owned();
                if model == "tiny" && body.get("tools").is_some() {
                    let err = json!({"error": "registry.ollama.ai/library/tiny:latest does not support tools"});
                    return (StatusCode::BAD_REQUEST, err.to_string()).into_response();
                }
                ndjson(&model).into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn surface(ca: &Ca, ollama: std::net::SocketAddr) -> String {
    let adapter = AdapterConfig {
        name: "ollama".into(),
        adapter_type: "ollama".into(),
        enabled: true,
        capacity: 4,
        long_context_capacity: 0,
        targets: vec!["tiny".into(), "plain".into()],
        settings: AdapterSettings::Native(NativeSettings {
            base_url: format!("http://{ollama}"),
            options: Default::default(),
        }),
    };
    let spec = |id: &str| ProviderSpec {
        key: ProviderKey {
            node_id: "node-1".into(),
            provider_id: id.into(),
        },
        adapter: "ollama".into(),
        target: id.into(),
        kind: ProviderKind::Native,
        category: "local_inference".into(),
        capacity: 4,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_secs(60),
        enabled: true,
    };
    let providers = vec![spec("tiny"), spec("plain")];
    let mut cfg = TransportConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        iop_tests::pki::edge_server_tls(ca, "edge-1"),
    );
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters: vec![adapter],
            ..Default::default()
        },
    )];
    cfg.pool = Some(PoolConfig {
        models: vec![
            ("tiny".into(), vec![providers[0].key.clone()]),
            ("plain".into(), vec![providers[1].key.clone()]),
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
            models: vec!["tiny".into(), "plain".into()],
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

fn request(model: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "stream": stream,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    })
}

/// The `data:` payloads of an SSE body, `[DONE]` excluded.
fn sse_events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn text_tool_calls_are_recovered_only_under_the_fallback_mark() {
    tokio::time::timeout(LIMIT, async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let seen: Seen = Arc::default();
        let ca = Ca::new("test CA");
        let base = surface(&ca, fake_ollama(seen.clone()).await).await;
        let client = reqwest::Client::new();
        let url = format!("{base}/chat/completions");

        // Fallback, not streamed: one rejected native attempt, one text retry.
        let r = client
            .post(&url)
            .json(&request("tiny", false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], "Checking the weather.");
        let call = &choice["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        {
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), 2, "one native attempt, one text retry");
            assert!(seen[0].get("tools").is_some());
            let retry = &seen[1];
            assert!(retry.get("tools").is_none() && retry.get("tool_choice").is_none());
            let messages = retry["messages"].as_array().unwrap();
            assert_eq!(messages.len(), 2, "the instruction is merged, not added");
            let system = messages[0]["content"].as_str().unwrap();
            assert!(system.starts_with("Be brief.") && system.contains("<tool_call>"));
            assert!(system.contains("get_weather"));
        }

        // Fallback, streamed: the tag never leaks as content; the call arrives as a delta.
        let body = client
            .post(&url)
            .json(&request("tiny", true))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(body.ends_with("data: [DONE]\n\n"));
        let events = sse_events(&body);
        let content: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect();
        // Text before the tag was streamed as it came (newline included); nothing after it.
        assert_eq!(content, "Checking the weather.\n");
        assert!(
            !body.contains("<tool"),
            "held-back text must not be streamed: {body}"
        );
        let last = events.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
        // As OpenAI streams a call: its start (index, id, name), then its argument fragments.
        let calls: Vec<&Value> = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].get(0))
            .collect();
        assert_eq!(calls[0]["index"], 0);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: String = calls
            .iter()
            .filter_map(|c| c["function"]["arguments"].as_str())
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&args).unwrap(),
            json!({"city": "Paris"})
        );

        // No fallback mark: the same text is ordinary content, streamed and not.
        seen.lock().unwrap().clear();
        let v: Value = client
            .post(&url)
            .json(&request("plain", false))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["choices"][0]["message"]["content"], PIECES.concat());
        assert!(v["choices"][0]["message"].get("tool_calls").is_none());
        let body = client
            .post(&url)
            .json(&request("plain", true))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let events = sse_events(&body);
        let content: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, PIECES.concat());
        assert_eq!(
            events.last().unwrap()["choices"][0]["finish_reason"],
            "stop"
        );
        assert_eq!(
            seen.lock().unwrap().len(),
            2,
            "no retry when tools are accepted"
        );
    })
    .await
    .unwrap();
}
