//! Normalized runs through the `ollama` adapter against a local fake Ollama (NDJSON over HTTP).
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use iop_edge::{Lifecycle, TransportConfig, bind};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, NativeSettings, NodeCommandKind, NodeCommandRequest,
    NodeConfigPayload, ProviderStatus, RunEventKind, RunRequest, Usage,
};
use iop_wire::validate::ResponseStallTimeout;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);

const NDJSON: &str = concat!(
    "{\"model\":\"llama3.1:8b\",\"message\":{\"role\":\"assistant\",\"content\":\"Hel\"},\"done\":false}\n",
    "{\"model\":\"llama3.1:8b\",\"message\":{\"role\":\"assistant\",\"content\":\"lo\"},\"done\":false}\n",
    "{\"model\":\"llama3.1:8b\",\"message\":{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"function\":{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Seoul\"}}}]},\"done\":false}\n",
    "{\"model\":\"llama3.1:8b\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"prompt_eval_count\":11,\"eval_count\":4}\n",
);

#[tokio::test]
async fn ollama_stream_becomes_normalized_run_events() {
    tokio::time::timeout(LIMIT, async {
        let seen: Arc<Mutex<Option<serde_json::Value>>> = Arc::default();
        let seen2 = seen.clone();
        let app = Router::new()
            .route("/api/tags", get(|| async { "{\"models\":[{\"name\":\"llama3.1:8b\"}]}" }))
            .route(
                "/api/chat",
                post(move |body: axum::Json<serde_json::Value>| {
                    *seen2.lock().unwrap() = Some(body.0);
                    async { NDJSON }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ollama = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

        let ca = Ca::new("test CA");
        let tls = iop_tests::pki::edge_server_tls(&ca, "edge-1");
        let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
        let adapter = AdapterConfig {
            name: String::new(), // the legacy single instance
            adapter_type: "ollama".into(),
            enabled: true,
            capacity: 2,
            long_context_capacity: 0,
            targets: vec!["llama3.1:8b".into()],
            settings: AdapterSettings::Native(NativeSettings { base_url: format!("http://{ollama}"), options: Default::default() }),
        };
        cfg.node_configs = vec![("node-1".into(), NodeConfigPayload { adapters: vec![adapter], ..Default::default() })];
        let edge = bind(cfg).await.unwrap().0;
        let mut life = edge.subscribe();
        let node_tls = iop_tests::pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1");
        let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", node_tls).unwrap().with_adapters(AdapterRegistry::with_builtins());
        let shutdown = CancellationToken::new();
        tokio::spawn(run_node(opts, shutdown.clone()));
        while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}

        let request = RunRequest {
            run_id: "o-1".into(),
            adapter: String::new(), // empty: the legacy single instance
            target: "llama3.1:8b".into(),
            input: bytes::Bytes::from_static(br#"{"messages":[{"role":"user","content":"weather?"}],"options":{"temperature":0}}"#),
            metadata: Default::default(),
            response_stall_timeout: ResponseStallTimeout::DEFAULT,
            timeout: Some(Duration::from_secs(20)),
            long_context: false,
            credential: None,
            trace: None,
        };
        let mut s = edge.run("node-1", request).await.unwrap();
        let mut events = Vec::new();
        while let Some(ev) = s.next().await {
            events.push(ev);
        }
        let kinds: Vec<_> = events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [RunEventKind::Start, RunEventKind::Delta, RunEventKind::Delta, RunEventKind::Complete]);
        let text: String = events.iter().map(|e| e.delta.as_str()).collect();
        assert_eq!(text, "Hello");
        let done = events.last().unwrap();
        assert_eq!(done.usage, Some(Usage { prompt_tokens: 11, completion_tokens: 4, total_tokens: 15 , cached_prompt_tokens: 0}));
        let calls: serde_json::Value = serde_json::from_str(&done.metadata["openai_tool_calls"]).unwrap();
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Seoul\"}");
        // What Ollama received: the target as the model, the normalized messages and options.
        let body = seen.lock().unwrap().clone().unwrap();
        assert_eq!(body["model"], "llama3.1:8b");
        assert_eq!(body["messages"][0]["content"], "weather?");
        assert_eq!(body["options"]["temperature"], 0);
        assert_eq!(body["stream"], true);

        let caps = edge.command("node-1", NodeCommandRequest { kind: NodeCommandKind::Capabilities, adapter: String::new(), target: String::new() }).await.unwrap();
        assert_eq!((caps.capabilities[0].adapter_key.as_str(), caps.capabilities[0].provider_status), ("ollama", ProviderStatus::Available));
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
