//! The Control Plane ⇄ Edge wire over real TLS sockets: hello refusals (identity mismatch,
//! mode mismatch, missing projection), projection generation fencing, the unauthenticated
//! managed connector, legacy mode without lease traffic, the status view, commands with phase
//! events, relayed Node lifecycle events, and reconnection after a Control Plane restart.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use iop_cp::admin::Admin;
use iop_cp::lease::{DEFAULT_LEASE_TTL, LeaseService};
use iop_cp::seal::MasterKey;
use iop_cp::server::{self, ControlPlane, ServerConfig};
use iop_cp::store::{SqliteStore, Store};
use iop_edge::control::{
    ControlConfig, ControlConfigError, ControlConnector, LeaseError, SessionState,
};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{EdgeHandle, Lifecycle, TransportConfig, bind};
use iop_node::{NodeOptions, run_node};
use iop_tests::pki::{self, Ca};
use iop_wire::codec::{FrameCodec, TokioCodec};
use iop_wire::control::{
    ControlFrame, ControlMessage, EdgeCommandRequest, EdgeHelloResponse, NodeEventKind,
    PrincipalProjection, PrincipalProjectionApplyResponse,
};
use iop_wire::runtime::{AdapterConfig, AdapterSettings, NativeSettings, NodeConfigPayload};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(30);

async fn admin() -> Admin {
    let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory().unwrap());
    let g = store.generation().await.unwrap();
    Admin::new(store, Arc::new(MasterKey::generate().unwrap().0), g)
}

async fn control_plane(ca: &Ca, managed: bool, listen: &str) -> (ControlPlane, Admin) {
    control_plane_framed(ca, managed, listen, iop_wire::codec::DEFAULT_MAX_FRAME_LEN).await
}

/// A Control Plane that reads and writes frames of at most `max_frame_len` bytes.
async fn control_plane_framed(
    ca: &Ca,
    managed: bool,
    listen: &str,
    max_frame_len: usize,
) -> (ControlPlane, Admin) {
    let admin = admin().await;
    let tls = if managed {
        pki::server_tls(ca, role::CONTROL_PLANE, "cp-1", role::EDGE)
    } else {
        // Legacy: TLS, no client certificates.
        let leaf = ca.workload(role::CONTROL_PLANE, "cp-1", true);
        Arc::new(
            rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(leaf.chain.clone(), leaf.key())
            .unwrap(),
        )
    };
    if managed {
        admin
            .ensure_issuer_key(|| Ok(iop_lease::IssuerSigningKey::generate_derived().unwrap()))
            .await
            .unwrap();
    }
    let leases = managed.then(|| {
        Arc::new(LeaseService::new(
            admin.store().clone(),
            admin.master_key().clone(),
            DEFAULT_LEASE_TTL,
        ))
    });
    let mut config = ServerConfig::new(listen.parse().unwrap(), tls, managed);
    config.max_frame_len = max_frame_len;
    // The default heartbeat (10 s, silence limit 30 s): no test here waits on liveness (the
    // seed 001 machines' pair harness covers it in virtual time), and a short one would drop
    // sessions whenever a shared machine pauses for a second.
    let (cp, _task) = server::serve(config, admin.clone(), leases).await.unwrap();
    (cp, admin)
}

fn native(name: &str) -> AdapterConfig {
    AdapterConfig {
        name: name.into(),
        adapter_type: "demo".into(),
        enabled: true,
        capacity: 2,
        long_context_capacity: 0,
        targets: vec!["demo-model".into()],
        settings: AdapterSettings::Native(NativeSettings {
            base_url: String::new(),
            options: Default::default(),
        }),
    }
}

fn spec(node: &str) -> ProviderSpec {
    ProviderSpec {
        key: ProviderKey {
            node_id: node.into(),
            provider_id: "demo".into(),
        },
        adapter: "demo".into(),
        target: "demo-model".into(),
        kind: ProviderKind::Native,
        category: "local_inference".into(),
        capacity: 2,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_secs(60),
        enabled: true,
    }
}

/// An Edge with `node-1` and `node-2` configured (one provider each).
async fn edge(ca: &Ca) -> EdgeHandle {
    edge_with(ca, &["node-1".into(), "node-2".into()]).await
}

/// An Edge with these Nodes configured (one provider each).
async fn edge_with(ca: &Ca, nodes: &[String]) -> EdgeHandle {
    let mut cfg = TransportConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        pki::edge_server_tls(ca, "edge-1"),
    );
    let payload = NodeConfigPayload {
        adapters: vec![native("demo")],
        revision: 7,
        ..Default::default()
    };
    cfg.node_configs = (nodes.iter())
        .map(|n| (n.clone(), payload.clone()))
        .collect();
    cfg.pool = Some(PoolConfig {
        models: vec![("demo".into(), nodes.iter().map(|n| spec(n).key).collect())],
        providers: nodes.iter().map(|n| spec(n)).collect(),
        max_queue: 4,
    });
    bind(cfg).await.unwrap().0
}

fn connector_config(
    address: String,
    tls: Arc<rustls::ClientConfig>,
    edge_id: &str,
    managed: bool,
) -> ControlConfig {
    ControlConfig {
        addresses: vec![address],
        server_name: "localhost".try_into().unwrap(),
        tls,
        edge_id: edge_id.into(),
        managed,
        max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
        dialer: None,
        jitter_seed: None,
        binding: Default::default(),
    }
}

async fn state_until(c: &ControlConnector, pred: impl Fn(&SessionState) -> bool) -> SessionState {
    let mut rx = c.state();
    loop {
        let s = rx.borrow_and_update().clone();
        if pred(&s) {
            return s;
        }
        rx.changed().await.unwrap();
    }
}

fn legacy_client_tls(ca: &Ca) -> Arc<rustls::ClientConfig> {
    let expected =
        workload_identity::ExpectedPeer::exact(pki::TRUST_DOMAIN, role::CONTROL_PLANE, "cp-1")
            .unwrap();
    let verifier = workload_identity::server_cert_verifier(ca.roots(), expected).unwrap();
    Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth(),
    )
}

#[tokio::test]
async fn hello_refusals_are_clear() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let (cp, _) = control_plane(&ca, true, "127.0.0.1:0").await;
        let e = edge(&ca).await;
        let stop = CancellationToken::new();
        // The certificate says edge-2, the hello says edge-1.
        let tls = pki::client_tls(&ca, role::EDGE, "edge-2", role::CONTROL_PLANE, "cp-1");
        let c = ControlConnector::start(
            e.clone(),
            connector_config(cp.local_addr().to_string(), tls, "edge-1", true),
            stop.clone(),
        )
        .unwrap();
        let s = state_until(&c, |s| !matches!(s, SessionState::Connecting)).await;
        assert_eq!(
            s,
            SessionState::Rejected("hello edge_id does not match the certificate".into())
        );
        assert!(c.projection().is_none());
        // A legacy Edge against a managed Control Plane.
        let tls = pki::client_tls(&ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1");
        let c = ControlConnector::start(
            e.clone(),
            connector_config(cp.local_addr().to_string(), tls, "edge-1", false),
            stop.clone(),
        )
        .unwrap();
        let s = state_until(&c, |s| !matches!(s, SessionState::Connecting)).await;
        assert_eq!(
            s,
            SessionState::Rejected("control plane is in managed mode; edge is not".into())
        );
        // Managed mode without a client certificate: refused before anything is sent.
        let err = ControlConnector::start(
            e.clone(),
            connector_config(
                cp.local_addr().to_string(),
                legacy_client_tls(&ca),
                "edge-1",
                true,
            ),
            stop.clone(),
        )
        .unwrap_err();
        assert_eq!(err, ControlConfigError::ManagedWithoutClientCertificate);
        assert!(err.to_string().contains("requires mTLS"));
        // And the managed server itself refuses a TLS client without a certificate.
        let tcp = tokio::net::TcpStream::connect(cp.local_addr())
            .await
            .unwrap();
        let tls = tokio_rustls::TlsConnector::from(legacy_client_tls(&ca))
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap();
        let mut io = Framed::new(tls, TokioCodec::<ControlFrame>::new(FrameCodec::new()));
        let hello = iop_wire::control::EdgeHelloRequest {
            edge_id: "edge-1".into(),
            managed: true,
            ..Default::default()
        };
        let _ = io
            .send(ControlFrame::new(ControlMessage::EdgeHelloRequest(hello)))
            .await;
        assert!(
            !matches!(io.next().await, Some(Ok(_))),
            "no answer without a client certificate"
        );
        assert!(cp.edges().is_empty());
        stop.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// A fake Control Plane: accepts one managed Edge's hello with `projection`, then runs `then`.
async fn fake_cp<F, Fut>(ca: &Ca, projection: Option<PrincipalProjection>, then: F) -> String
where
    F: FnOnce(
            Framed<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, TokioCodec<ControlFrame>>,
        ) -> Fut
        + Send
        + 'static,
    Fut: Future<Output = ()> + Send,
{
    let acceptor = tokio_rustls::TlsAcceptor::from(pki::server_tls(
        ca,
        role::CONTROL_PLANE,
        "cp-1",
        role::EDGE,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let tls = acceptor.accept(tcp).await.unwrap();
        let mut io = Framed::new(tls, TokioCodec::<ControlFrame>::new(FrameCodec::new()));
        let hello = io.next().await.unwrap().unwrap();
        let accepted = EdgeHelloResponse::Accepted {
            projection,
            heartbeat_interval_ms: Some(60_000),
            // As a Control Plane from before usage records and frame limits.
            accepts_usage: false,
            max_frame_len: 0,
        };
        io.send(ControlFrame::correlated(
            hello.correlation_id,
            ControlMessage::EdgeHelloResponse(accepted),
        ))
        .await
        .unwrap();
        then(io).await;
    });
    addr
}

fn projection(generation: u64) -> PrincipalProjection {
    PrincipalProjection {
        generation,
        ..Default::default()
    }
}

#[tokio::test]
async fn projection_is_required_and_fenced_by_generation() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let e = edge(&ca).await;
        let stop = CancellationToken::new();
        let tls = pki::client_tls(&ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1");

        // An accepted hello without a projection: a managed Edge drops the session.
        let addr = fake_cp(&ca, None, |_io| async {}).await;
        let c = ControlConnector::start(
            e.clone(),
            connector_config(addr, tls.clone(), "edge-1", true),
            stop.clone(),
        )
        .unwrap();
        let s = state_until(&c, |s| !matches!(s, SessionState::Connecting)).await;
        assert_eq!(s, SessionState::MissingProjection);
        assert!(c.projection().is_none());

        // Generation 5 in the hello; then 5 (equal), 4 (older): refused; 6: accepted.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let addr = fake_cp(&ca, Some(projection(5)), move |mut io| async move {
            for (id, g) in [(11, 5), (12, 4), (13, 6)] {
                io.send(ControlFrame::correlated(
                    id,
                    ControlMessage::PrincipalProjectionApplyRequest(projection(g)),
                ))
                .await
                .unwrap();
                loop {
                    match io.next().await.unwrap().unwrap() {
                        ControlFrame {
                            correlation_id,
                            message: ControlMessage::PrincipalProjectionApplyResponse(r),
                        } => {
                            assert_eq!(correlation_id, id);
                            tx.send(r).unwrap();
                            break;
                        }
                        _ => continue, // pings, node events
                    }
                }
            }
            std::future::pending::<()>().await;
        })
        .await;
        let c = ControlConnector::start(
            e.clone(),
            connector_config(addr, tls, "edge-1", true),
            stop.clone(),
        )
        .unwrap();
        let refused = |generation, reason: &str| PrincipalProjectionApplyResponse {
            accepted: false,
            generation,
            reason: reason.into(),
        };
        assert_eq!(rx.recv().await.unwrap(), refused(5, "stale generation"));
        assert_eq!(rx.recv().await.unwrap(), refused(5, "stale generation"));
        let ok = rx.recv().await.unwrap();
        assert!(ok.accepted && ok.generation == 6, "{ok:?}");
        assert_eq!(c.projection().unwrap().generation(), 6);
        stop.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn legacy_mode_carries_no_lease_traffic() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let (cp, _) = control_plane(&ca, false, "127.0.0.1:0").await;
        let e = edge(&ca).await;
        let stop = CancellationToken::new();
        let c = ControlConnector::start(
            e.clone(),
            connector_config(
                cp.local_addr().to_string(),
                legacy_client_tls(&ca),
                "edge-1",
                false,
            ),
            stop.clone(),
        )
        .unwrap();
        state_until(&c, |s| *s == SessionState::Connected).await;
        assert!(c.projection().is_none());
        let binding = iop_wire::runtime::CredentialLeaseBinding {
            principal_id: "p".into(),
            slot_id: "s".into(),
            route_id: "r".into(),
            profile: "openai".into(),
            upstream_target: "t".into(),
            node_id: "node-1".into(),
            recipient_key_id: "k".into(),
            credential_revision: 1,
            route_revision: 1,
            projection_generation: 1,
        };
        assert_eq!(
            c.acquire_lease(binding.clone(), [9; 32]).await.unwrap_err(),
            LeaseError::Disabled
        );
        // A raw Edge asking anyway gets a refusal, never a lease.
        let tcp = tokio::net::TcpStream::connect(cp.local_addr())
            .await
            .unwrap();
        let tls = tokio_rustls::TlsConnector::from(legacy_client_tls(&ca))
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap();
        let mut io = Framed::new(tls, TokioCodec::<ControlFrame>::new(FrameCodec::new()));
        let hello = iop_wire::control::EdgeHelloRequest {
            edge_id: "edge-raw".into(),
            ..Default::default()
        };
        io.send(ControlFrame::new(ControlMessage::EdgeHelloRequest(hello)))
            .await
            .unwrap();
        let ControlMessage::EdgeHelloResponse(EdgeHelloResponse::Accepted { projection, .. }) =
            io.next().await.unwrap().unwrap().message
        else {
            panic!("legacy hello accepted")
        };
        assert!(projection.is_none());
        let req = iop_wire::control::AcquireLeaseRequest {
            binding,
            recipient_public_key: [9; 32],
            trace: None,
        };
        io.send(ControlFrame::correlated(
            5,
            ControlMessage::AcquireLeaseRequest(req),
        ))
        .await
        .unwrap();
        let answer = io.next().await.unwrap().unwrap();
        assert_eq!(answer.correlation_id, 5);
        assert_eq!(
            answer.message,
            ControlMessage::AcquireLeaseResponse(
                iop_wire::control::AcquireLeaseResponse::Refused {
                    reason: "credential_plane_disabled".into()
                }
            )
        );
        // A second connection of the same Edge takes over; the first is closed (cleanly),
        // not left open until its silence limit.
        let tcp = tokio::net::TcpStream::connect(cp.local_addr())
            .await
            .unwrap();
        let tls = tokio_rustls::TlsConnector::from(legacy_client_tls(&ca))
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap();
        let mut second = Framed::new(tls, TokioCodec::<ControlFrame>::new(FrameCodec::new()));
        let hello = iop_wire::control::EdgeHelloRequest {
            edge_id: "edge-raw".into(),
            ..Default::default()
        };
        second
            .send(ControlFrame::new(ControlMessage::EdgeHelloRequest(hello)))
            .await
            .unwrap();
        assert!(matches!(
            second.next().await.unwrap().unwrap().message,
            ControlMessage::EdgeHelloResponse(EdgeHelloResponse::Accepted { .. })
        ));
        // The first one stays alive (it pings), so only the replacement can close it.
        let closed = async {
            loop {
                tokio::select! {
                    f = io.next() => match f {
                        Some(Ok(f)) if f.message == ControlMessage::Pong => {}
                        Some(Ok(f)) => panic!("unexpected {f:?}"),
                        _ => break,
                    },
                    () = tokio::time::sleep(Duration::from_millis(100)) => {
                        if io.send(ControlFrame::new(ControlMessage::Ping)).await.is_err() {
                            break;
                        }
                    }
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .expect("the replaced connection is closed although it is alive");
        stop.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// `edge-1` connected to `cp` (managed), and its session state with the connection seen.
async fn connect_managed(
    ca: &Ca,
    cp: &ControlPlane,
    e: &EdgeHandle,
    stop: &CancellationToken,
) -> (ControlConnector, tokio::sync::watch::Receiver<SessionState>) {
    let c = ControlConnector::start(
        e.clone(),
        connector_config(
            cp.local_addr().to_string(),
            pki::client_tls(ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1"),
            "edge-1",
            true,
        ),
        stop.clone(),
    )
    .unwrap();
    state_until(&c, |s| *s == SessionState::Connected).await;
    let mut state = c.state();
    state.borrow_and_update();
    (c, state)
}

/// An Edge with more Nodes than one frame of the Control Plane's holds (400 Nodes, about
/// 50 KB of status, against a Control Plane that reads frames of 16 KiB and says so in its
/// hello answer) answers with the first Nodes in `node_id` order and counts the rest: the
/// session stays up. Before, the Control Plane's codec refused the frame, closed the session,
/// and the Edge reconnected only to lose it again at the next status request.
#[tokio::test]
async fn a_status_larger_than_the_control_planes_frame_is_cut_not_fatal() {
    const NODES: usize = 400;
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let (cp, _) = control_plane_framed(&ca, true, "127.0.0.1:0", 16 * 1024).await;
        let names: Vec<String> = (0..NODES).map(|i| format!("node-{i:03}")).collect();
        let e = edge_with(&ca, &names).await;
        let stop = CancellationToken::new();
        let (_connector, state) = connect_managed(&ca, &cp, &e, &stop).await;

        let status = cp.status("edge-1").await.unwrap();
        let listed = status.nodes.len();
        assert!(
            listed >= 50 && status.omitted_nodes > 0,
            "{listed} listed, {} left out",
            status.omitted_nodes
        );
        assert_eq!(listed + status.omitted_nodes as usize, NODES);
        let ids: Vec<_> = status.nodes.iter().map(|n| n.node_id.clone()).collect();
        assert_eq!(ids, names[..listed]);
        assert!(status.nodes.iter().all(|n| n.provider_snapshots.len() == 1));
        // The same session answers again; it never dropped.
        assert_eq!(cp.status("edge-1").await.unwrap(), status);
        assert!(!state.has_changed().unwrap(), "{:?}", *state.borrow());
        stop.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// Usage reports fit the Control Plane's frame. Against a Control Plane that reads frames of
/// 16 KiB (a full report of 512 records takes about 50 KB here): a full report is refused by
/// the Edge's own session with how many records fit, and nothing is sent; the shipper then
/// sends 1,200 spooled records in reports that fit, every one stored once, on one session.
/// Before, the first full report closed the session, and every session after it.
#[tokio::test]
async fn usage_reports_fit_the_control_planes_frame() {
    use iop_edge::control::UsageReportError;
    use iop_edge::usage::{Outcome, SqliteUsage, UsageConfig, UsageRecord, UsageSink as _};
    use iop_wire::control::EdgeUsageReport;
    const SPOOLED: usize = 1200;
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let (cp, admin) = control_plane_framed(&ca, true, "127.0.0.1:0", 16 * 1024).await;
        admin.create_principal("team-a", "Team A").await.unwrap();
        let e = edge(&ca).await;
        let stop = CancellationToken::new();
        let (c, state) = connect_managed(&ca, &cp, &e, &stop).await;
        let record = |i: usize| UsageRecord {
            request_id: format!("request-{i:06}-of-the-usage-frame-test"),
            at_ms: 1_800_000_000_000,
            key: "team-a".into(),
            model: "demo".into(),
            provider: "node-1/demo".into(),
            input_tokens: 1200,
            output_tokens: 300,
            cached_input_tokens: 0,
            estimated: false,
            cost_pusd: 42,
            outcome: Outcome::Completed,
            duration_us: 123_456,
            first_byte_us: 45_678,
            added_us: 90,
        };

        let full: Vec<_> = (0..512)
            .map(|i| iop_edge::usage::wire_record(&record(i)))
            .collect();
        let err = c
            .report_usage(EdgeUsageReport {
                records: full.clone(),
            })
            .await
            .unwrap_err();
        let UsageReportError::TooLarge { fit } = err else {
            panic!("{err:?}")
        };
        assert!(fit > 10 && fit < 512, "{fit}");
        let ack = c
            .report_usage(EdgeUsageReport {
                records: full[..fit].to_vec(),
            })
            .await
            .unwrap();
        assert_eq!(ack.stored as usize, fit);

        let db = std::env::temp_dir().join(format!("iop-usage-frame-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&db);
        let sink = SqliteUsage::open(
            &db,
            UsageConfig {
                ship: true,
                ..UsageConfig::default()
            },
        )
        .unwrap();
        for i in 0..SPOOLED {
            sink.record(record(100_000 + i));
        }
        sink.flush();
        assert_eq!(sink.spooled(), SPOOLED as u64);
        let shipping = tokio::spawn(iop_edge::usage::ship(sink.clone(), c.clone(), stop.clone()));
        while sink.spooled() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rows = admin.store().usage_daily(None, 100).await.unwrap();
        let stored: u64 = rows.iter().map(|r| r.requests).sum();
        assert_eq!(stored, (fit + SPOOLED) as u64);
        assert!(!state.has_changed().unwrap(), "{:?}", *state.borrow());
        stop.cancel();
        shipping.await.unwrap();
        sink.close();
        let _ = std::fs::remove_file(&db);
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn status_commands_events_and_reconnect() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let (cp, _) = control_plane(&ca, true, "127.0.0.1:0").await;
        let addr = cp.local_addr();
        let e = edge(&ca).await;
        let stop = CancellationToken::new();
        let c = ControlConnector::start(
            e.clone(),
            connector_config(
                addr.to_string(),
                pki::client_tls(&ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1"),
                "edge-1",
                true,
            ),
            stop.clone(),
        )
        .unwrap();
        state_until(&c, |s| *s == SessionState::Connected).await;
        let mut events = cp.events();

        // node-1 connects; node-2 never does.
        let mut life = e.subscribe();
        let node_stop = CancellationToken::new();
        let opts = NodeOptions::new(
            "node-1",
            &e.local_addr().to_string(),
            "localhost",
            pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1"),
        )
        .unwrap()
        .with_adapters(iop_node::AdapterRegistry::with_builtins());
        tokio::spawn(run_node(opts, node_stop.clone()));
        while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
        let (edge_id, ev) = events.recv().await.unwrap();
        assert_eq!(
            (edge_id.as_str(), ev.kind, ev.node_id.as_str()),
            ("edge-1", NodeEventKind::Connected, "node-1")
        );

        let status = cp.status("edge-1").await.unwrap();
        assert_eq!(status.edge_id, "edge-1");
        let ids: Vec<_> = status
            .nodes
            .iter()
            .map(|n| (n.node_id.as_str(), n.connected))
            .collect();
        assert_eq!(ids, [("node-1", true), ("node-2", false)]);
        let n2 = &status.nodes[1];
        assert_eq!(n2.config.revision, 7);
        assert_eq!(n2.config.adapters, [("demo".to_owned(), "demo".to_owned())]);
        let p = &n2.provider_snapshots[0];
        assert_eq!(
            (
                p.status.as_str(),
                p.health.as_str(),
                p.capacity,
                p.in_flight,
                p.queued
            ),
            ("unavailable", "offline", 0, 0, 0)
        );
        assert_eq!(status.nodes[0].provider_snapshots[0].capacity, 2);

        let (resp, phases) = cp
            .command(
                "edge-1",
                EdgeCommandRequest {
                    command_id: "c-1".into(),
                    operation: "ping".into(),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(resp.ok && resp.result["reply"] == "pong");
        let phases: Vec<_> = phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(phases, ["accepted", "completed"]);
        let (resp, _) = cp
            .command(
                "edge-1",
                EdgeCommandRequest {
                    command_id: "c-2".into(),
                    operation: "schedule".into(),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(!resp.ok && resp.error == "unknown operation");

        // node-1 goes away: relayed after the fence.
        node_stop.cancel();
        let (_, ev) = events.recv().await.unwrap();
        assert_eq!(
            (ev.kind, ev.node_id.as_str()),
            (NodeEventKind::Disconnected, "node-1")
        );

        // The Control Plane restarts on the same address: the Edge reconnects by itself.
        cp.shutdown();
        state_until(&c, |s| *s != SessionState::Connected).await;
        let mut cp2 = None;
        for _ in 0..50 {
            // The old listener is gone once its task sees the stop; retry the bind briefly.
            let bound = tokio::net::TcpListener::bind(addr).await;
            if let Ok(l) = bound {
                drop(l);
                cp2 = Some(control_plane(&ca, true, &addr.to_string()).await.0);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let cp2 = cp2.expect("rebound the control plane address");
        state_until(&c, |s| *s == SessionState::Connected).await;
        assert_eq!(cp2.edges()[0].edge_id, "edge-1");
        stop.cancel();
    })
    .await
    .expect("scenario finishes");
}

/// A principal projection larger than the frames the Edge reads arrives in parts over real
/// mTLS, from the hello and from a push after a mutation, and is installed whole (every token
/// authenticates). An Edge that does not say it takes parts is refused with a reason that
/// says why, rather than sent a frame it cannot read.
#[tokio::test]
async fn a_projection_larger_than_a_frame_arrives_in_parts() {
    const FRAME: usize = 8 * 1024;
    const PRINCIPALS: usize = 300;
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let e = edge(&ca).await;
        let (cp, admin) = control_plane(&ca, true, "127.0.0.1:0").await;
        admin
            .put_slot("slot-1", "openai", "authorization", "Bearer ", b"sk-test")
            .await
            .unwrap();
        let mut tokens = Vec::new();
        for i in 0..PRINCIPALS {
            let id = format!("principal-{i}");
            admin
                .create_principal(&id, &format!("Team {i}"))
                .await
                .unwrap();
            tokens.push(admin.create_token(&id).await.unwrap().token);
            admin
                .put_route(
                    &format!("route-{i}"),
                    &id,
                    "demo",
                    "slot-1",
                    "demo-model",
                    "",
                )
                .await
                .unwrap();
        }
        let whole = admin
            .projection(admin.store().generation().await.unwrap())
            .await
            .unwrap();
        assert!(whole.encoded_len() > 4 * FRAME, "{}", whole.encoded_len());

        let stop = CancellationToken::new();
        let tls = pki::client_tls(&ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1");
        let mut config = connector_config(cp.local_addr().to_string(), tls, "edge-1", true);
        config.max_frame_len = FRAME;
        let c = ControlConnector::start(e.clone(), config, stop.clone()).unwrap();
        let s = state_until(&c, |s| !matches!(s, SessionState::Connecting)).await;
        assert_eq!(s, SessionState::Connected);
        let p = c.projection().unwrap();
        assert_eq!(p.projection(), &*whole);
        for token in [&tokens[0], &tokens[PRINCIPALS / 2], &tokens[PRINCIPALS - 1]] {
            assert!(p.authenticate(token).is_some());
        }

        // A mutation: the next projection is pushed in parts too.
        admin
            .create_principal("principal-late", "Late")
            .await
            .unwrap();
        let late = admin.create_token("principal-late").await.unwrap();
        loop {
            if c.projection().unwrap().generation() >= late.generation {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let p = c.projection().unwrap();
        assert_eq!(p.authenticate(&late.token), Some("principal-late"));
        assert!(p.authenticate(&tokens[PRINCIPALS - 1]).is_some());
        assert_eq!(c.state().borrow().clone(), SessionState::Connected);

        // An Edge whose hello does not take parts, as an older one's does not, naming 8 KiB
        // frames so that this projection does not fit one (an older Edge names none: 8 MiB).
        let tcp = tokio::net::TcpStream::connect(cp.local_addr())
            .await
            .unwrap();
        let tls = tokio_rustls::TlsConnector::from(pki::client_tls(
            &ca,
            role::EDGE,
            "edge-2",
            role::CONTROL_PLANE,
            "cp-1",
        ))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
        let mut io = Framed::new(tls, TokioCodec::<ControlFrame>::new(FrameCodec::new()));
        let hello = iop_wire::control::EdgeHelloRequest {
            edge_id: "edge-2".into(),
            managed: true,
            projection_parts: false,
            max_frame_len: u32::try_from(FRAME).unwrap(),
            ..Default::default()
        };
        io.send(ControlFrame::new(ControlMessage::EdgeHelloRequest(hello)))
            .await
            .unwrap();
        match io.next().await.unwrap().unwrap().message {
            ControlMessage::EdgeHelloResponse(EdgeHelloResponse::Rejected { reason }) => {
                assert!(reason.contains("does not take it in parts"), "{reason}");
            }
            other => panic!("refused, not {other:?}"),
        }
        stop.cancel();
    })
    .await
    .expect("scenario finishes");
}
