//! Seed 000 admission rules at the Node, end to end (Edge → mTLS → `iop-node` → a keyed fake
//! upstream):
//!
//! - "Node adapter instance는 normalized RunRequest와 ProviderTunnelRequest가 공유하는 local
//!   capacity gate를 사용한다": one gate per adapter instance, whichever kind of request holds
//!   it.
//! - "Do not open a lease before adapter capacity admission": a managed tunnel refused for
//!   capacity leaves its lease unopened, so the very same lease is accepted once there is room
//!   (an opened lease would be refused as replayed).
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::time::Duration;

use bytes::Bytes;
use iop_edge::{
    EdgeHandle, Lifecycle, RunStream, TransportConfig, TunnelEvent, TunnelStream, bind,
};
use iop_lease::{
    Credential, HeaderSpec, Issuer, IssuerSigningKey, OpenPolicy, Recipient, RecipientSecretKey,
    Secret, TrustedIssuers,
};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_tests::upstream::{Kind, Upstream};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, CredentialLeaseBinding, Header,
    ManagedCredential, NativeSettings, NodeConfigPayload, OpenAiCompatSettings, Operation,
    ProviderTunnelRequest, RunEventKind, RunRequest,
};
use iop_wire::tunnel_order::Delivery;
use iop_wire::validate::ResponseStallTimeout;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);
const KEY: &str = "sk-admission-upstream";
const CAPACITY_EXHAUSTED: &str = "adapter capacity exhausted";
/// What an adapter answers for a kind of request it does not serve (`AdapterError::Unsupported`).
const UNSUPPORTED: &str = "operation not supported by this adapter";

/// `openai-a` (openai_compat, capacity 1, target `slow`, the fake upstream) and `demo-a`
/// (demo, capacity 1, a run that lasts hours).
fn config(upstream: &Upstream) -> NodeConfigPayload {
    NodeConfigPayload {
        adapters: vec![
            AdapterConfig {
                name: "openai-a".into(),
                adapter_type: "openai_compat".into(),
                enabled: true,
                capacity: 1,
                long_context_capacity: 0,
                targets: vec!["slow".into()],
                settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                    base_url: upstream.base_url(),
                    protocol_profile: ConcreteProtocolProfile {
                        name: "openai".into(),
                        operation_paths: [(Operation::ChatCompletions, "/chat/completions".into())]
                            .into_iter()
                            .collect(),
                        ..Default::default()
                    },
                    request_timeout_sec: 30,
                }),
            },
            AdapterConfig {
                name: "demo-a".into(),
                adapter_type: "demo".into(),
                enabled: true,
                capacity: 1,
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
            },
        ],
        revision: 1,
        ..Default::default()
    }
}

/// An Edge and a Node (`with_credential_plane` when `managed`), connected.
async fn mesh(
    ca: &Ca,
    config: NodeConfigPayload,
    managed: Option<Recipient>,
) -> (EdgeHandle, CancellationToken) {
    let tls = iop_tests::pki::edge_server_tls(ca, "edge-1");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.node_configs = vec![("node-1".into(), config)];
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    let node_tls = iop_tests::pki::node_client_tls(ca, role::NODE, "node-1", "edge-1");
    let mut opts = NodeOptions::new(
        "node-1",
        &edge.local_addr().to_string(),
        "localhost",
        node_tls,
    )
    .unwrap()
    .with_adapters(AdapterRegistry::with_builtins());
    if let Some(r) = managed {
        opts = opts.with_credential_plane(r);
    }
    let shutdown = CancellationToken::new();
    tokio::spawn(run_node(opts, shutdown.clone()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    (edge, shutdown)
}

fn tunnel_request(run_id: &str, adapter: &str, target: &str) -> ProviderTunnelRequest {
    ProviderTunnelRequest {
        run_id: run_id.into(),
        adapter: adapter.into(),
        target: target.into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body: Bytes::from_static(b"{\"model\":\"slow\",\"stream\":true,\"messages\":[]}"),
        stream: true,
        operation: Some(Operation::ChatCompletions),
        ..Default::default()
    }
}

fn run_request(run_id: &str, adapter: &str, target: &str) -> RunRequest {
    RunRequest {
        run_id: run_id.into(),
        adapter: adapter.into(),
        target: target.into(),
        input: Bytes::from_static(b"a b c"),
        metadata: Default::default(),
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    }
}

/// The tunnel's first event: `Ok(())` for a started response, `Err(text)` for an error.
async fn first(stream: &mut TunnelStream) -> Result<(), String> {
    match stream.next().await.unwrap() {
        TunnelEvent::Frame(Delivery::Start { .. }) => Ok(()),
        TunnelEvent::Frame(Delivery::Error { error, .. }) => Err(error),
        other => Err(format!("{other:?}")),
    }
}

/// The run's terminal error, skipping its START.
async fn run_error(stream: &mut RunStream) -> String {
    loop {
        let ev = stream.next().await.unwrap();
        if ev.kind.is_terminal() {
            assert_eq!(ev.kind, RunEventKind::Error, "{ev:?}");
            return ev.error;
        }
    }
}

async fn idle(edge: &EdgeHandle, adapter: &str) {
    iop_tests::node::wait_idle(edge, "node-1", adapter).await;
}

/// The gate is the adapter instance's, not the request kind's. Each refusal is told apart from
/// what a separate gate would give: the openai_compat adapter does not run normalized requests
/// and the demo adapter does not tunnel, so a request admitted by a gate of its own would end
/// with the adapter's "unsupported" error instead of the gate's refusal.
#[tokio::test]
async fn runs_and_tunnels_share_one_capacity_gate_per_adapter_instance() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let upstream = Upstream::start(Kind::ChatOnly, "", "slow").await;
        let (edge, shutdown) = mesh(&ca, config(&upstream), None).await;

        // A tunnel holds openai-a: a normalized run on openai-a is refused by the gate.
        let mut t = edge
            .tunnel("node-1", tunnel_request("t1", "openai-a", "slow"))
            .await
            .unwrap();
        assert_eq!(first(&mut t).await, Ok(()));
        let mut r = edge
            .run("node-1", run_request("r1", "openai-a", "slow"))
            .await
            .unwrap();
        assert_eq!(run_error(&mut r).await, CAPACITY_EXHAUSTED);
        // With the tunnel gone, the same run is admitted (and the adapter says it does not run
        // normalized requests: the gate was the only thing in the way before).
        drop(t);
        idle(&edge, "openai-a").await;
        let mut r = edge
            .run("node-1", run_request("r2", "openai-a", "slow"))
            .await
            .unwrap();
        assert_eq!(run_error(&mut r).await, UNSUPPORTED);

        // A run holds demo-a: a tunnel on demo-a is refused by the gate.
        let mut run = edge
            .run("node-1", run_request("r3", "demo-a", "demo-model"))
            .await
            .unwrap();
        assert_eq!(run.next().await.unwrap().kind, RunEventKind::Start);
        assert_eq!(run.next().await.unwrap().kind, RunEventKind::Delta);
        let mut t = edge
            .tunnel("node-1", tunnel_request("t2", "demo-a", "demo-model"))
            .await
            .unwrap();
        assert_eq!(first(&mut t).await, Err(CAPACITY_EXHAUSTED.to_owned()));
        drop(run);
        idle(&edge, "demo-a").await;
        let mut t = edge
            .tunnel("node-1", tunnel_request("t3", "demo-a", "demo-model"))
            .await
            .unwrap();
        assert_eq!(first(&mut t).await, Err(UNSUPPORTED.to_owned()));
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// A managed tunnel refused for capacity never opens its lease: the same lease, sent again
/// once the adapter has room, is accepted and its credential reaches the upstream.
#[tokio::test]
async fn a_lease_is_opened_only_after_capacity_admission() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let upstream = Upstream::start(Kind::ChatOnly, KEY, "slow").await;
        let issuer = Issuer::new(
            IssuerSigningKey::generate_derived().unwrap(),
            Duration::from_secs(60),
        )
        .unwrap();
        let node_key = RecipientSecretKey::generate("node-1-key").unwrap();
        let recipient_public = node_key.public_key();
        let trusted: TrustedIssuers = [issuer.public_key()].into_iter().collect();
        let recipient = Recipient::new(node_key, trusted, OpenPolicy::default());
        let (edge, shutdown) = mesh(&ca, config(&upstream), Some(recipient)).await;
        let credential = Credential::new(
            HeaderSpec::new("authorization", "Bearer ").unwrap(),
            Secret::new(KEY.as_bytes().to_vec()),
        )
        .unwrap();
        let lease = |run_id: &str| -> ManagedCredential {
            let binding = CredentialLeaseBinding {
                principal_id: "team-a".into(),
                slot_id: "slot-1".into(),
                route_id: format!("route-{run_id}"),
                profile: "openai".into(),
                upstream_target: "slow".into(),
                node_id: "node-1".into(),
                recipient_key_id: "node-1-key".into(),
                credential_revision: 1,
                route_revision: 1,
                projection_generation: 1,
            };
            let now = iop_wire::time::unix_ms(std::time::SystemTime::now());
            issuer
                .issue(
                    &binding,
                    &recipient_public,
                    &credential,
                    now,
                    Duration::from_secs(30),
                )
                .unwrap()
        };
        let managed = |run_id: &str, c: &ManagedCredential| {
            let mut req = tunnel_request(run_id, "openai-a", "slow");
            req.credential = Some(Box::new(c.clone()));
            req
        };

        let la = lease("a");
        let mut a = edge.tunnel("node-1", managed("a", &la)).await.unwrap();
        assert_eq!(first(&mut a).await, Ok(()));
        let lb = lease("b");
        let mut b = edge.tunnel("node-1", managed("b1", &lb)).await.unwrap();
        assert_eq!(first(&mut b).await, Err(CAPACITY_EXHAUSTED.to_owned()));
        drop(a);
        idle(&edge, "openai-a").await;
        // The same lease: not replayed, because it was never opened.
        let mut b = edge.tunnel("node-1", managed("b2", &lb)).await.unwrap();
        assert_eq!(first(&mut b).await, Ok(()));
        drop(b);
        idle(&edge, "openai-a").await;
        // ...whereas a lease that was opened is refused the second time.
        let mut again = edge.tunnel("node-1", managed("b3", &lb)).await.unwrap();
        assert_eq!(
            first(&mut again).await,
            Err("credential rejected: lease replayed".to_owned())
        );
        let seen = upstream.seen();
        assert_eq!(seen.len(), 2, "two provider calls: a and the second b");
        for s in &seen {
            assert_eq!(
                s.header("authorization"),
                Some(format!("Bearer {KEY}").as_str())
            );
        }
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// Seed 000: `runtime.concurrency` is legacy metadata, not a Node-wide gate. With it at 1, two
/// adapter instances each admit a stream at once (each instance's own capacity is the only
/// gate), and a second stream on a full instance is still refused by that instance's gate.
#[tokio::test]
async fn runtime_concurrency_is_not_a_node_wide_gate() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let upstream = Upstream::start(Kind::ChatOnly, "", "slow").await;
        let mut payload = config(&upstream);
        payload.runtime.concurrency = 1;
        let (edge, shutdown) = mesh(&ca, payload, None).await;
        let mut t = edge
            .tunnel("node-1", tunnel_request("t1", "openai-a", "slow"))
            .await
            .unwrap();
        assert_eq!(first(&mut t).await, Ok(()));
        let mut run = edge
            .run("node-1", run_request("r1", "demo-a", "demo-model"))
            .await
            .unwrap();
        assert_eq!(run.next().await.unwrap().kind, RunEventKind::Start);
        assert_eq!(run.next().await.unwrap().kind, RunEventKind::Delta);
        let mut r = edge
            .run("node-1", run_request("r2", "openai-a", "slow"))
            .await
            .unwrap();
        assert_eq!(run_error(&mut r).await, CAPACITY_EXHAUSTED);
        drop((t, run));
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
