//! The Node's response-stall watchdog on normalized runs, with an embedder's own adapter:
//! an unconfirmed fence keeps admission until the provider call really returns, and health
//! evidence comes from the exact-target probe.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use iop_edge::{EdgeHandle, Lifecycle, TransportConfig, bind};
use iop_node::{
    Adapter, AdapterError, AdapterRegistry, NodeOptions, RunCompletion, RunEvents, run_node,
};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, Fence, HealthEvidence, NodeConfigPayload, ProviderStatus,
    RunEvent, RunEventKind, RunRequest,
};
use iop_wire::validate::ResponseStallTimeout;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);
const CLOSE_GRACE: Duration = Duration::from_millis(200);

/// Sends one delta, then never makes progress; once fenced it returns only when the test adds
/// a permit to `close` (a provider connection slow to close, for as long as the test needs:
/// no wall-clock window decides what the test observes). Its probe says the provider is down.
struct StallingAdapter {
    returned: Arc<AtomicBool>,
    close: Arc<tokio::sync::Semaphore>,
}

#[async_trait]
impl Adapter for StallingAdapter {
    async fn run(
        &self,
        _request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError> {
        events.delta("partial ").await;
        events.cancelled().await;
        if let Ok(permit) = self.close.acquire().await {
            permit.forget();
        }
        self.returned.store(true, Ordering::SeqCst);
        Err(AdapterError::Provider("closed".into()))
    }

    async fn probe(
        &self,
        _target: &str,
        _credential: Option<&iop_node::credential::UpstreamCredential>,
    ) -> ProviderStatus {
        ProviderStatus::Unavailable
    }
}

async fn mesh(
    ca: &Ca,
    returned: Arc<AtomicBool>,
    close: Arc<tokio::sync::Semaphore>,
) -> (EdgeHandle, CancellationToken) {
    let tls = iop_tests::pki::edge_server_tls(ca, "edge-1");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    let adapter = AdapterConfig {
        name: "stall-a".into(),
        adapter_type: "stalling".into(),
        enabled: true,
        capacity: 1,
        long_context_capacity: 0,
        targets: vec!["m".into()],
        settings: AdapterSettings::None,
    };
    cfg.node_configs = vec![(
        "node-1".into(),
        NodeConfigPayload {
            adapters: vec![adapter],
            ..Default::default()
        },
    )];
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();

    let mut registry = AdapterRegistry::new();
    registry.register(
        "stalling",
        Arc::new(move |_: &AdapterConfig| {
            Ok(Arc::new(StallingAdapter {
                returned: returned.clone(),
                close: close.clone(),
            }) as Arc<dyn Adapter>)
        }),
    );
    let node_tls = iop_tests::pki::node_client_tls(ca, role::NODE, "node-1", "edge-1");
    let mut opts = NodeOptions::new(
        "node-1",
        &edge.local_addr().to_string(),
        "localhost",
        node_tls,
    )
    .unwrap()
    .with_adapters(registry);
    opts.close_grace = CLOSE_GRACE;
    let shutdown = CancellationToken::new();
    tokio::spawn(run_node(opts, shutdown.clone()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    (edge, shutdown)
}

fn request(run_id: &str, stall_ms: i64) -> RunRequest {
    RunRequest {
        run_id: run_id.into(),
        adapter: "stall-a".into(),
        target: "m".into(),
        input: bytes::Bytes::new(),
        metadata: Default::default(),
        response_stall_timeout: ResponseStallTimeout::from_wire_ms(stall_ms).unwrap(),
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    }
}

async fn all(edge: &EdgeHandle, req: RunRequest) -> Vec<RunEvent> {
    let mut s = edge.run("node-1", req).await.unwrap();
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        out.push(ev);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unconfirmed_fence_keeps_admission_until_the_provider_returns() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let returned = Arc::new(AtomicBool::new(false));
        let close = Arc::new(tokio::sync::Semaphore::new(0));
        let (edge, shutdown) = mesh(&ca, returned.clone(), close.clone()).await;

        let events = all(&edge, request("s-1", 200)).await;
        let kinds: Vec<_> = events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                RunEventKind::Start,
                RunEventKind::Delta,
                RunEventKind::Error
            ]
        );
        let terminal = events.last().unwrap();
        assert_eq!(terminal.error, iop_node::RESPONSE_STALLED);
        let f = terminal
            .execution_failure
            .as_ref()
            .and_then(|e| e.valid())
            .unwrap();
        assert_eq!(f.health, HealthEvidence::Unavailable);
        assert_eq!(f.health.liveness_classification(), "provider_unhealthy");
        assert_eq!(
            f.fence,
            Fence::Unconfirmed,
            "the provider had not returned within the grace"
        );
        assert!(f.health_observation_seq.is_some());
        // The terminal came before the provider returned, and admission is still held: the
        // next run on this capacity-1 instance is refused...
        assert!(!returned.load(Ordering::SeqCst));
        let refused = all(&edge, request("s-2", 200)).await;
        assert_eq!(refused.last().unwrap().error, "adapter capacity exhausted");
        assert!(
            refused.last().unwrap().execution_failure.is_none(),
            "non-stall failures carry no ExecutionFailure"
        );
        // ...until the provider call really returns (the test lets it now). The permit is
        // released right after the adapter's future completes, so the first runs after
        // `returned` may still be refused for capacity: retry on exactly that refusal (the
        // event), never after a fixed sleep.
        assert!(!returned.load(Ordering::SeqCst));
        // (Enough permits that the next stalled run's provider returns at once too.)
        close.add_permits(1000);
        while !returned.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut attempt = 0;
        let again = loop {
            attempt += 1;
            let events = all(&edge, request(&format!("s-3-{attempt}"), 200)).await;
            if events.last().unwrap().error != "adapter capacity exhausted" {
                break events;
            }
            tokio::task::yield_now().await;
        };
        assert_eq!(again.first().unwrap().kind, RunEventKind::Start);
        assert_eq!(again.last().unwrap().error, iop_node::RESPONSE_STALLED);
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_cancel_before_the_stall_keeps_its_own_terminal() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        // A cancelled provider returns at once here.
        let close = Arc::new(tokio::sync::Semaphore::new(1000));
        let (edge, shutdown) = mesh(&ca, Arc::new(AtomicBool::new(false)), close).await;
        let mut s = edge.run("node-1", request("c-1", 60_000)).await.unwrap();
        assert_eq!(s.next().await.unwrap().kind, RunEventKind::Start);
        assert_eq!(s.next().await.unwrap().kind, RunEventKind::Delta);
        edge.cancel("node-1", "c-1", "caller_cancelled");
        let terminal = s.next().await.unwrap();
        assert_eq!(terminal.kind, RunEventKind::Cancelled);
        assert!(terminal.execution_failure.is_none());
        assert!(s.next().await.is_none());
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
