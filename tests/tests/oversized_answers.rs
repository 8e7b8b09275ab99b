//! A provider's answer the Edge could not take ends its own run, never the Node's session: an
//! adapter's error text over the wire's text limit, and a `COMPLETE` whose tool calls are larger
//! than a frame (and than the wire's bound on metadata). Before, both were protocol violations
//! at the Edge (the second, had it passed validation, would have failed the Node's writer);
//! either closed the connection and ended every run on it. Edge and Node
//! over real mTLS sockets.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use iop_edge::{EdgeHandle, TransportConfig};
use iop_node::{Adapter, AdapterError, AdapterRegistry, RunCompletion, RunEvents};
use iop_tests::pki::Ca;
use iop_wire::codec::DEFAULT_MAX_FRAME_LEN;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, NodeConfigPayload, ProviderStatus, RunEvent, RunEventKind,
    RunRequest,
};
use iop_wire::validate::{MAX_TEXT_LEN, ResponseStallTimeout};
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(60);

/// Answers by its input: `long-error` fails with 10 KB of text, `huge-tools` completes with
/// tool calls larger than a frame, anything else with one delta.
struct Oversized;

#[async_trait]
impl Adapter for Oversized {
    async fn run(
        &self,
        request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        match &request.input[..] {
            b"long-error" => Err(AdapterError::Provider("e".repeat(10_000))),
            b"huge-tools" => {
                let mut done = RunCompletion::default();
                done.metadata.insert(
                    "openai_tool_calls".into(),
                    "x".repeat(DEFAULT_MAX_FRAME_LEN),
                );
                Ok(done)
            }
            _ => {
                events.delta("fine").await;
                Ok(RunCompletion::default())
            }
        }
    }

    async fn probe(
        &self,
        _target: &str,
        _credential: Option<&iop_node::credential::UpstreamCredential>,
    ) -> ProviderStatus {
        ProviderStatus::Available
    }
}

async fn mesh(ca: &Ca) -> (EdgeHandle, CancellationToken) {
    let tls = iop_tests::pki::edge_server_tls(ca, "edge-1");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters: vec![AdapterConfig {
                name: "big".into(),
                adapter_type: "oversized".into(),
                enabled: true,
                capacity: 4,
                long_context_capacity: 0,
                targets: vec!["m".into()],
                settings: AdapterSettings::None,
            }],
            ..Default::default()
        },
    )];
    let mut adapters = AdapterRegistry::new();
    adapters.register(
        "oversized",
        Arc::new(|_: &AdapterConfig| Ok(Arc::new(Oversized) as Arc<dyn Adapter>)),
    );
    iop_tests::node::bind_with_node(ca, cfg, adapters).await
}

fn request(run_id: &str, input: &'static [u8]) -> RunRequest {
    RunRequest {
        run_id: run_id.into(),
        adapter: "big".into(),
        target: "m".into(),
        input: bytes::Bytes::from_static(input),
        metadata: Default::default(),
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    }
}

/// Every event of the run, up to its terminal.
async fn answer(edge: &EdgeHandle, run_id: &str, input: &'static [u8]) -> Vec<RunEvent> {
    let mut stream = edge.run("node-1", request(run_id, input)).await.unwrap();
    let mut events = Vec::new();
    while let Some(ev) = stream.next().await {
        let terminal = ev.kind.is_terminal();
        events.push(ev);
        if terminal {
            break;
        }
    }
    events
}

#[tokio::test]
async fn an_answer_the_edge_could_not_take_ends_its_run_and_not_the_session() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let (edge, shutdown) = mesh(&ca).await;
        let session = edge.ready_nodes();
        assert_eq!(session.len(), 1);

        // A long error text arrives cut to what the Edge accepts.
        let events = answer(&edge, "r-1", b"long-error").await;
        let last = events.last().unwrap();
        assert_eq!(last.kind, RunEventKind::Error);
        assert!(
            last.error.starts_with("provider error: eee"),
            "{}",
            last.error
        );
        assert!(last.error.len() <= MAX_TEXT_LEN);

        // Tool calls larger than a frame (and than the wire's metadata bound): an error that
        // says so.
        let events = answer(&edge, "r-2", b"huge-tools").await;
        let last = events.last().unwrap();
        assert_eq!(last.kind, RunEventKind::Error);
        assert!(
            last.error.contains("on the Edge-Node wire") && last.error.contains("metadata"),
            "{}",
            last.error
        );

        // The same session (same generation) still serves.
        assert_eq!(edge.ready_nodes(), session);
        let events = answer(&edge, "r-3", b"hello").await;
        assert_eq!(events.last().unwrap().kind, RunEventKind::Complete);
        assert!(events.iter().any(|e| e.delta == "fine"));
        assert_eq!(edge.ready_nodes(), session);
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
