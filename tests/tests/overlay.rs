//! Edge terminal handoff and CAPABILITIES recovery over real mTLS: a stall whose exact-target
//! probe says `unavailable` sets the runtime-unavailable overlay; only a fresher `available`
//! recovery answer clears it.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use iop_edge::pool::ContextSize;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::Response;
use axum::routing::{get, post};
use bytes::Bytes;
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{
    DispatchError, Dispatched, EdgeHandle, Lifecycle, PoolRequest, TransportConfig, TunnelEvent,
    bind,
};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::Ca;
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, Header, HealthEvidence,
    NodeConfigPayload, OpenAiCompatSettings, Operation, ProviderTunnelRequest,
};
use iop_wire::tunnel_order::Delivery;
use iop_wire::validate::ResponseStallTimeout;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);

async fn upstream(healthy: Arc<AtomicBool>) -> std::net::SocketAddr {
    let app = Router::new()
        .route(
            "/v1/models",
            get(move || {
                let healthy = healthy.load(Ordering::SeqCst);
                async move {
                    if healthy {
                        "{\"data\":[{\"id\":\"gpt-test\"}]}"
                    } else {
                        "{\"data\":[]}"
                    }
                }
            }),
        )
        .route(
            "/v1/hang",
            post(|| async {
                let first = futures_util::stream::once(async {
                    Ok::<_, Infallible>(Bytes::from_static(b"data: {}\n\n"))
                });
                let body = futures_util::StreamExt::chain(first, futures_util::stream::pending());
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(body))
                    .unwrap()
            }),
        )
        .route("/v1/ok", post(|| async { "data: [DONE]\n\n" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn key() -> ProviderKey {
    ProviderKey {
        node_id: "node-1".into(),
        provider_id: "up".into(),
    }
}

async fn setup(ca: &Ca, healthy: Arc<AtomicBool>) -> EdgeHandle {
    let up = upstream(healthy).await;
    let adapter = AdapterConfig {
        name: "openai-a".into(),
        adapter_type: "openai_compat".into(),
        enabled: true,
        capacity: 2,
        long_context_capacity: 0,
        targets: vec!["gpt-test".into()],
        settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
            base_url: format!("http://{up}/v1"),
            protocol_profile: ConcreteProtocolProfile {
                name: "openai".into(),
                operation_paths: [(Operation::Models, "/models".to_owned())]
                    .into_iter()
                    .collect(),
                ..Default::default()
            },
            request_timeout_sec: 30,
        }),
    };
    let spec = ProviderSpec {
        key: key(),
        adapter: "openai-a".into(),
        target: "gpt-test".into(),
        kind: ProviderKind::OpenAiCompat,
        category: "api".into(),
        capacity: 2,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_millis(300),
        enabled: true,
    };
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
        providers: vec![spec],
        models: vec![("m".into(), vec![key()])],
        max_queue: 4,
    });
    let edge = bind(cfg).await.unwrap().0;
    let mut life = edge.subscribe();
    let tls = iop_tests::pki::node_client_tls(ca, role::NODE, "node-1", "edge-1");
    let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins());
    tokio::spawn(run_node(opts, CancellationToken::new()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    edge
}

fn tunnel(path: &'static str) -> PoolRequest {
    {
        PoolRequest::Tunnel(ProviderTunnelRequest {
            run_id: format!("ov{}", path.replace('/', "-")),
            adapter: String::new(),
            target: String::new(),
            method: "POST".into(),
            path: path.into(),
            headers: vec![Header {
                name: "content-type".into(),
                value: Bytes::from_static(b"application/json"),
            }],
            body: Bytes::from_static(b"{}"),
            stream: true,
            response_stall_timeout: ResponseStallTimeout::DEFAULT, // replaced from the lease
            ..Default::default()
        })
    }
}

async fn last_event(edge: &EdgeHandle, path: &'static str) -> TunnelEvent {
    let Dispatched::Tunnel(mut s) = edge
        .dispatch(
            "m",
            ContextSize::Standard,
            Duration::from_secs(5),
            tunnel(path),
        )
        .await
        .unwrap()
    else {
        panic!()
    };
    let mut last = None;
    while let Some(ev) = s.next().await {
        last = Some(ev);
    }
    last.unwrap()
}

#[tokio::test]
async fn stall_sets_the_overlay_and_only_a_fresh_available_probe_clears_it() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let healthy = Arc::new(AtomicBool::new(false));
        let edge = setup(&ca, healthy.clone()).await;

        // The lease's 300 ms stall timeout was copied into the request: the hang stalls, and the
        // exact-target probe (the models list lacks the target) says unavailable.
        let last = last_event(&edge, "/hang").await;
        let TunnelEvent::Frame(Delivery::Error {
            execution_failure,
            metadata,
            ..
        }) = last
        else {
            panic!("expected a stall, got {last:?}")
        };
        // The Edge terminal handoff of a validated current stall, on the tunnel's terminal too.
        assert_eq!(metadata.get("provider_id").map(String::as_str), Some("up"));
        assert_eq!(
            metadata.get("provider_health").map(String::as_str),
            Some("unavailable")
        );
        assert_eq!(
            metadata.get("recovery_handoff").map(String::as_str),
            Some("confirmed")
        );
        assert!(!metadata.contains_key("recovery_eligible"));
        assert_eq!(
            execution_failure.unwrap().valid().unwrap().health,
            HealthEvidence::Unavailable
        );
        let s = &edge.snapshot()[0];
        assert_eq!(
            (
                s.status.as_str(),
                s.health.as_str(),
                s.capacity,
                s.in_flight,
                s.provider_id.as_str()
            ),
            ("unavailable", "unavailable", 0, 0, "up")
        );
        // Overlaid: not a live candidate any more.
        assert_eq!(
            edge.dispatch(
                "m",
                ContextSize::Standard,
                Duration::from_millis(200),
                tunnel("/ok")
            )
            .await
            .unwrap_err(),
            DispatchError::WaitTimeout
        );
        // A recovery answer that still says unavailable changes nothing.
        assert_eq!(edge.recover("node-1").await.unwrap(), 0);
        assert_eq!(edge.snapshot()[0].health, "unavailable");
        // The provider recovers; a fresh available answer clears the overlay.
        healthy.store(true, Ordering::SeqCst);
        assert_eq!(edge.recover("node-1").await.unwrap(), 1);
        let s = &edge.snapshot()[0];
        assert_eq!(
            (s.status.as_str(), s.health.as_str(), s.capacity),
            ("available", "healthy", 2)
        );
        assert!(matches!(
            last_event(&edge, "/ok").await,
            TunnelEvent::Frame(Delivery::End { .. })
        ));
        let metrics = edge.metrics().render(0, 0);
        for line in [
            "iop_edge_provider_health_evidence_total{provider_health=\"unavailable\"} 1",
            "iop_edge_provider_health_transitions_total{to=\"unavailable\"} 1",
            "iop_edge_provider_health_transitions_total{to=\"available\"} 1",
            "iop_edge_liveness_recovery_eligibility_total{eligibility=\"confirmed\"} 1",
            "iop_edge_liveness_recovery_results_total{result=\"cleared\"} 1",
            "iop_edge_liveness_recovery_results_total{result=\"unchanged\"} 1",
        ] {
            assert!(metrics.contains(line), "missing {line}\n{metrics}");
        }
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn a_validated_run_stall_gets_handoff_metadata_and_available_evidence_sets_no_overlay() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let adapter = AdapterConfig {
            name: "demo-a".into(),
            adapter_type: "demo".into(),
            enabled: true,
            capacity: 1,
            long_context_capacity: 0,
            targets: vec!["demo-model".into()],
            settings: AdapterSettings::Native(iop_wire::runtime::NativeSettings {
                base_url: String::new(),
                options: [("delay_ms".to_owned(), "5000".to_owned())]
                    .into_iter()
                    .collect(),
            }),
        };
        let key = ProviderKey {
            node_id: "node-1".into(),
            provider_id: "demo".into(),
        };
        let spec = ProviderSpec {
            key: key.clone(),
            adapter: "demo-a".into(),
            target: "demo-model".into(),
            kind: ProviderKind::Native,
            category: "local_inference".into(),
            capacity: 1,
            long_context_capacity: 0,
            response_stall_timeout: Duration::from_millis(200),
            enabled: true,
        };
        let mut cfg = TransportConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            iop_tests::pki::edge_server_tls(&ca, "edge-1"),
        );
        cfg.node_configs = vec![(
            "node-1".into(),
            NodeConfigPayload {
                adapters: vec![adapter],
                ..Default::default()
            },
        )];
        cfg.pool = Some(PoolConfig {
            providers: vec![spec],
            models: vec![("m".into(), vec![key])],
            max_queue: 4,
        });
        let edge = bind(cfg).await.unwrap().0;
        let mut life = edge.subscribe();
        let tls = iop_tests::pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1");
        let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
            .unwrap()
            .with_adapters(AdapterRegistry::with_builtins());
        tokio::spawn(run_node(opts, CancellationToken::new()));
        while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}

        let build = {
            PoolRequest::Run(iop_wire::runtime::RunRequest {
                run_id: "stall-run".into(),
                adapter: String::new(),
                target: String::new(),
                input: Bytes::from_static(b"slow"),
                metadata: Default::default(),
                response_stall_timeout: ResponseStallTimeout::DEFAULT,
                timeout: None,
                long_context: false,
                credential: None,
                trace: None,
            })
        };
        let Dispatched::Run(mut s) = edge
            .dispatch("m", ContextSize::Standard, Duration::from_secs(5), build)
            .await
            .unwrap()
        else {
            panic!()
        };
        let mut last = None;
        while let Some(ev) = s.next().await {
            last = Some(ev);
        }
        let last = last.unwrap();
        assert_eq!(last.error, iop_node::RESPONSE_STALLED);
        assert_eq!(
            last.execution_failure
                .as_ref()
                .unwrap()
                .valid()
                .unwrap()
                .health,
            HealthEvidence::Available
        );
        assert_eq!(
            last.metadata.get("provider_id").map(String::as_str),
            Some("demo")
        );
        assert_eq!(
            last.metadata.get("provider_health").map(String::as_str),
            Some("available")
        );
        assert_eq!(
            last.metadata.get("recovery_handoff").map(String::as_str),
            Some("confirmed")
        );
        assert!(!last.metadata.contains_key("recovery_eligible"));
        // Available evidence is not an unavailable observation: no overlay, lease released.
        let snap = &edge.snapshot()[0];
        assert_eq!(
            (snap.health.as_str(), snap.capacity, snap.in_flight),
            ("healthy", 1, 0)
        );
    })
    .await
    .expect("scenario finishes");
}
