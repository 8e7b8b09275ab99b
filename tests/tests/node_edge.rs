//! `iop-node` and `iop-edge` end to end over real loopback mTLS: the supervisor, the session
//! driver with the demo adapter, and the Edge transport (its `EdgeCore` driver).
//!
//! A small TCP proxy sits between Node and Edge where a test needs to cut the network.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use iop_edge::{DispatchError, EdgeHandle, Lifecycle, RunStream, TransportConfig, bind};
use iop_node::{AdapterRegistry, Exit, NodeOptions, ReconnectPolicy, run_node};
use iop_tests::pki::{Ca, TRUST_DOMAIN};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConfigRefreshOutcome, NativeSettings, NodeCommandKind,
    NodeCommandRequest, NodeConfigPayload, ProviderStatus, RunEvent, RunEventKind, RunRequest,
};
use iop_wire::validate::ResponseStallTimeout;
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use workload_identity::{ExpectedPeer, role, server_cert_verifier};

/// Guards against a hung test; no assertion depends on it.
const LIMIT: Duration = Duration::from_secs(30);

fn demo_config(delay_ms: u32, repeat: u32) -> NodeConfigPayload {
    NodeConfigPayload {
        adapters: vec![AdapterConfig {
            name: "demo-a".into(),
            adapter_type: "demo".into(),
            enabled: true,
            capacity: 4,
            long_context_capacity: 0,
            targets: vec!["demo-model".into()],
            settings: AdapterSettings::Native(NativeSettings {
                base_url: String::new(),
                options: [
                    ("delay_ms".to_owned(), delay_ms.to_string()),
                    ("repeat".to_owned(), repeat.to_string()),
                ]
                .into_iter()
                .collect(),
            }),
        }],
        revision: 1,
        ..Default::default()
    }
}

async fn start_edge(ca: &Ca, config: NodeConfigPayload) -> EdgeHandle {
    let tls = iop_tests::pki::edge_server_tls(ca, "edge-1");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.node_configs = vec![("node-1".into(), config)];
    bind(cfg).await.unwrap().0
}

fn node_options(
    ca: &Ca,
    cert_name: &str,
    node_id: &str,
    edge: SocketAddr,
    policy: ReconnectPolicy,
) -> NodeOptions {
    let tls = iop_tests::pki::node_client_tls(ca, role::NODE, cert_name, "edge-1");
    NodeOptions::new(node_id, &edge.to_string(), "localhost", tls)
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins())
        .with_reconnect(policy)
}

fn run(id: &str, input: &str) -> RunRequest {
    RunRequest {
        run_id: id.into(),
        adapter: "demo-a".into(),
        target: "demo-model".into(),
        input: bytes::Bytes::copy_from_slice(input.as_bytes()),
        metadata: Default::default(),
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    }
}

async fn connected(events: &mut broadcast::Receiver<Lifecycle>) -> iop_edge::registry::Generation {
    loop {
        if let Lifecycle::Connected { generation, .. } = events.recv().await.unwrap() {
            return generation;
        }
    }
}

async fn collect(stream: &mut RunStream) -> Vec<RunEvent> {
    let mut out = Vec::new();
    while let Some(ev) = stream.next().await {
        out.push(ev);
    }
    out
}

fn text(events: &[RunEvent]) -> String {
    events
        .iter()
        .filter(|e| e.kind == RunEventKind::Delta)
        .map(|e| e.delta.as_str())
        .collect()
}

#[tokio::test]
async fn node_connects_runs_answers_commands_and_refreshes() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = start_edge(&ca, demo_config(0, 1)).await;
        let mut life = edge.subscribe();
        // Nothing is dispatched before ready.
        assert_eq!(
            edge.run("node-1", run("r0", "x")).await.unwrap_err(),
            DispatchError::NotReady
        );
        let shutdown = CancellationToken::new();
        let node = tokio::spawn(run_node(
            node_options(
                &ca,
                "node-1",
                "node-1",
                edge.local_addr(),
                ReconnectPolicy::default(),
            ),
            shutdown.clone(),
        ));
        let generation = connected(&mut life).await;
        assert_eq!(edge.ready_nodes(), [("node-1".to_owned(), generation)]);

        let mut stream = edge.run("node-1", run("r1", "hello mesh")).await.unwrap();
        let events = collect(&mut stream).await;
        assert_eq!(events.first().unwrap().kind, RunEventKind::Start);
        assert_eq!(events.last().unwrap().kind, RunEventKind::Complete);
        assert_eq!(events.iter().filter(|e| e.kind.is_terminal()).count(), 1);
        assert_eq!(text(&events), "echo: hello mesh");
        assert_eq!(events.last().unwrap().usage.unwrap().completion_tokens, 3);

        // CAPABILITIES: exact-target probe results with a session-owned increasing sequence.
        let caps = |edge: EdgeHandle| async move {
            let r = edge
                .command(
                    "node-1",
                    NodeCommandRequest {
                        kind: NodeCommandKind::Capabilities,
                        adapter: String::new(),
                        target: String::new(),
                    },
                )
                .await
                .unwrap();
            assert!(r.ok);
            r.capabilities
        };
        let first = caps(edge.clone()).await;
        let second = caps(edge.clone()).await;
        assert_eq!(first.len(), 1);
        assert_eq!(
            (
                first[0].adapter_key.as_str(),
                first[0].target.as_str(),
                first[0].provider_status
            ),
            ("demo-a", "demo-model", ProviderStatus::Available)
        );
        assert!(second[0].health_observation_seq > first[0].health_observation_seq);

        // A refresh that cannot be applied keeps the old config; a good one applies.
        let mut bad = demo_config(0, 1);
        bad.adapters[0].adapter_type = "no-such-adapter".into();
        bad.revision = 2;
        let r = edge.refresh("node-1", bad).await.unwrap();
        assert_eq!(r.outcome, ConfigRefreshOutcome::Failed);
        let events = collect(&mut edge.run("node-1", run("r2", "still")).await.unwrap()).await;
        assert_eq!(text(&events), "echo: still");
        let r = edge.refresh("node-1", demo_config(0, 2)).await.unwrap();
        assert_eq!(r.outcome, ConfigRefreshOutcome::Applied);
        let events = collect(&mut edge.run("node-1", run("r3", "twice")).await.unwrap()).await;
        assert_eq!(text(&events), "echo: twiceecho: twice");

        // Local shutdown: exit code 0, and the Edge fences the generation once.
        shutdown.cancel();
        let exit = node.await.unwrap();
        assert_eq!((exit, exit.exit_code()), (Exit::Shutdown, 0));
        loop {
            if let Lifecycle::Disconnected { generation: g, .. } = life.recv().await.unwrap() {
                assert_eq!(g, generation);
                break;
            }
        }
        assert!(edge.ready_nodes().is_empty());
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn caller_cancel_ends_the_run_with_cancelled() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = start_edge(&ca, demo_config(20, 1000)).await;
        let mut life = edge.subscribe();
        let shutdown = CancellationToken::new();
        let _node = tokio::spawn(run_node(
            node_options(
                &ca,
                "node-1",
                "node-1",
                edge.local_addr(),
                ReconnectPolicy::default(),
            ),
            shutdown.clone(),
        ));
        connected(&mut life).await;
        let mut stream = edge.run("node-1", run("long-1", "a b c")).await.unwrap();
        assert_eq!(stream.next().await.unwrap().kind, RunEventKind::Start);
        assert_eq!(stream.next().await.unwrap().kind, RunEventKind::Delta);
        edge.cancel("node-1", "long-1", "caller_cancelled");
        let rest = collect(&mut stream).await;
        assert_eq!(rest.last().unwrap().kind, RunEventKind::Cancelled);
        assert_eq!(rest.iter().filter(|e| e.kind.is_terminal()).count(), 1);
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn network_cut_mid_stream_fences_once_and_the_node_reconnects_on_a_new_generation() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = start_edge(&ca, demo_config(20, 1000)).await;
        let mut life = edge.subscribe();
        let net = iop_tests::net::Proxy::start(edge.local_addr()).await;
        let policy = ReconnectPolicy::from_config(Some(0), Some(5)).unwrap();
        let shutdown = CancellationToken::new();
        let node = tokio::spawn(run_node(
            node_options(&ca, "node-1", "node-1", net.addr, policy),
            shutdown.clone(),
        ));
        let g1 = connected(&mut life).await;

        let mut stream = edge.run("node-1", run("mid-1", "x y z")).await.unwrap();
        assert_eq!(stream.next().await.unwrap().kind, RunEventKind::Start);
        assert_eq!(stream.next().await.unwrap().kind, RunEventKind::Delta);
        net.cut();

        // The caller gets exactly one terminal: the Edge's synthetic one for the fenced generation.
        let rest = collect(&mut stream).await;
        let terminals: Vec<_> = rest.iter().filter(|e| e.kind.is_terminal()).collect();
        assert_eq!(terminals.len(), 1);
        assert_eq!(
            (terminals[0].kind, terminals[0].error.as_str()),
            (RunEventKind::Error, iop_edge::transport::NODE_DISCONNECTED)
        );

        // Fenced once; the Node reconnects under its policy and is ready on a new generation.
        let mut fences = 0;
        let g2 = loop {
            match life.recv().await.unwrap() {
                Lifecycle::Disconnected { generation, .. } => {
                    assert_eq!(generation, g1);
                    fences += 1;
                }
                Lifecycle::Connected { generation, .. } => break generation,
            }
        };
        assert_eq!(fences, 1);
        assert!(g2 > g1);
        let mut fresh = edge.run("node-1", run("after-1", "back")).await.unwrap();
        assert_eq!(fresh.generation, g2);
        assert_eq!(fresh.next().await.unwrap().kind, RunEventKind::Start);
        shutdown.cancel();
        assert_eq!(node.await.unwrap(), Exit::Shutdown);
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn finite_reconnect_budget_exhausts_with_exit_code_1() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        // Nothing listens here.
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let policy = ReconnectPolicy::from_config(Some(0), Some(3)).unwrap();
        let exit = run_node(
            node_options(&ca, "node-1", "node-1", closed, policy),
            CancellationToken::new(),
        )
        .await;
        assert_eq!(
            (exit, exit.exit_code()),
            (Exit::Exhausted { attempts: 3 }, 1)
        );

        // A Node whose certificate names another Node is refused at registration, every time.
        let edge = start_edge(&ca, demo_config(0, 1)).await;
        let policy = ReconnectPolicy::from_config(Some(0), Some(2)).unwrap();
        let exit = run_node(
            node_options(&ca, "node-2", "node-1", edge.local_addr(), policy),
            CancellationToken::new(),
        )
        .await;
        assert_eq!(exit, Exit::Exhausted { attempts: 2 });
        assert!(edge.ready_nodes().is_empty());
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn shutdown_while_waiting_to_reconnect_exits_0() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        // Unlimited attempts, 1 s apart: only a local shutdown ends it.
        let policy = ReconnectPolicy::from_config(Some(1), Some(0)).unwrap();
        let shutdown = CancellationToken::new();
        let node = tokio::spawn(run_node(
            node_options(&ca, "node-1", "node-1", closed, policy),
            shutdown.clone(),
        ));
        tokio::task::yield_now().await;
        shutdown.cancel();
        let exit = node.await.unwrap();
        assert_eq!((exit, exit.exit_code()), (Exit::Shutdown, 0));
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn a_second_connection_for_the_same_node_supersedes_the_first_with_a_new_generation() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = start_edge(&ca, demo_config(0, 1)).await;
        let mut life = edge.subscribe();
        // The first Node waits 4-5 s before it would redial after being superseded; the test is
        // over (and stops it) long before, so the two do not keep taking the id from each other.
        let first_policy = ReconnectPolicy::from_config(Some(5), Some(1)).unwrap();
        let stop_first = CancellationToken::new();
        let first = tokio::spawn(run_node(
            node_options(&ca, "node-1", "node-1", edge.local_addr(), first_policy),
            stop_first.clone(),
        ));
        let g1 = connected(&mut life).await;
        let stop_second = CancellationToken::new();
        let _second = tokio::spawn(run_node(
            node_options(
                &ca,
                "node-1",
                "node-1",
                edge.local_addr(),
                ReconnectPolicy::default(),
            ),
            stop_second.clone(),
        ));
        // Exactly one fence for the superseded generation, then the new one becomes ready.
        let mut saw = Vec::new();
        let g2 = loop {
            match life.recv().await.unwrap() {
                Lifecycle::Disconnected { generation, .. } => saw.push(generation),
                Lifecycle::Connected { generation, .. } => break generation,
            }
        };
        assert_eq!(saw, [g1]);
        assert!(g2 > g1);
        assert_eq!(edge.ready_nodes(), [("node-1".to_owned(), g2)]);
        let events =
            collect(&mut edge.run("node-1", run("sup-1", "new owner")).await.unwrap()).await;
        assert_eq!(text(&events), "echo: new owner");
        stop_first.cancel();
        stop_second.cancel();
        let _ = first.await;
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn peers_with_the_wrong_identity_never_register() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = start_edge(&ca, demo_config(0, 1)).await;
        let policy = ReconnectPolicy::from_config(Some(0), Some(2)).unwrap();
        // A client certificate with role `edge`: refused by the Edge's TLS verifier.
        let leaf = ca.workload(role::EDGE, "node-1", false);
        let verifier = server_cert_verifier(
            ca.roots(),
            ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, "edge-1").unwrap(),
        )
        .unwrap();
        let tls = Arc::new(
            workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
        );
        let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
            .unwrap()
            .with_reconnect(policy);
        assert_eq!(
            run_node(opts, CancellationToken::new()).await,
            Exit::Exhausted { attempts: 2 }
        );
        // A Node certificate from another CA: refused.
        let other = Ca::new("other CA");
        let leaf = other.workload(role::NODE, "node-1", false);
        let verifier = server_cert_verifier(
            ca.roots(),
            ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, "edge-1").unwrap(),
        )
        .unwrap();
        let tls = Arc::new(
            workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
        );
        let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
            .unwrap()
            .with_reconnect(policy);
        assert_eq!(
            run_node(opts, CancellationToken::new()).await,
            Exit::Exhausted { attempts: 2 }
        );
        // The Node expects another Edge name: it refuses the Edge.
        let leaf = ca.workload(role::NODE, "node-1", false);
        let verifier = server_cert_verifier(
            ca.roots(),
            ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, "edge-9").unwrap(),
        )
        .unwrap();
        let tls = Arc::new(
            workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
        );
        let opts = NodeOptions::new("node-1", &edge.local_addr().to_string(), "localhost", tls)
            .unwrap()
            .with_reconnect(policy);
        assert_eq!(
            run_node(opts, CancellationToken::new()).await,
            Exit::Exhausted { attempts: 2 }
        );
        assert!(
            edge.ready_nodes().is_empty(),
            "no registration from any of them"
        );
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn transport_and_lifecycle_commands_answer() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = start_edge(&ca, demo_config(0, 1)).await;
        let mut life = edge.subscribe();
        let shutdown = CancellationToken::new();
        let _node = tokio::spawn(run_node(
            node_options(
                &ca,
                "node-1",
                "node-1",
                edge.local_addr(),
                ReconnectPolicy::default(),
            ),
            shutdown.clone(),
        ));
        connected(&mut life).await;
        let t = edge
            .command(
                "node-1",
                NodeCommandRequest {
                    kind: NodeCommandKind::Transport,
                    adapter: String::new(),
                    target: String::new(),
                },
            )
            .await
            .unwrap();
        assert_eq!(
            (t.result["node_id"].as_str(), t.result["state"].as_str()),
            ("node-1", "ready")
        );
        let l = edge
            .command(
                "node-1",
                NodeCommandRequest {
                    kind: NodeCommandKind::ProviderLifecycle,
                    adapter: String::new(),
                    target: String::new(),
                },
            )
            .await
            .unwrap();
        assert_eq!(l.result["demo-a"], "in_flight=0 capacity=4");
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn an_invalid_or_too_large_request_is_refused_at_the_edge_and_the_session_survives() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = start_edge(&ca, demo_config(0, 1)).await;
        let mut life = edge.subscribe();
        let shutdown = CancellationToken::new();
        let _node = tokio::spawn(run_node(
            node_options(
                &ca,
                "node-1",
                "node-1",
                edge.local_addr(),
                ReconnectPolicy::default(),
            ),
            shutdown.clone(),
        ));
        let generation = connected(&mut life).await;
        // A run id the Node's validation forbids: refused before it is sent.
        let err = edge.run("node-1", run("bad/id", "x")).await.unwrap_err();
        assert_eq!(err, DispatchError::InvalidRequest);
        // A request one frame cannot carry: refused before it is queued. Written, it would
        // have failed the connection's writer and ended every stream of the Node.
        let max = iop_wire::codec::DEFAULT_MAX_FRAME_LEN;
        let err = edge
            .run("node-1", run("big-1", &"x".repeat(max)))
            .await
            .unwrap_err();
        assert!(
            matches!(err, DispatchError::TooLarge { len, max: m } if len > max && m == max),
            "{err:?}"
        );
        // The session was not touched: same generation, and it still serves.
        assert_eq!(edge.ready_nodes(), [("node-1".to_owned(), generation)]);
        let events = collect(
            &mut edge
                .run("node-1", run("good-1", "still here"))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(text(&events), "echo: still here");
        shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
