//! The runtime wire end to end over real loopback mTLS sockets: `iop_wire`'s Node session and
//! Edge registry, each driven by a minimal tokio loop with the `tokio-codec` frame codec.
//!
//! The drivers here make no protocol decision: they move frames between the socket and the
//! machine, re-arm one timer from `poll_timeout`, and forward events. (The production drivers
//! live in `iop-node` and `iop-edge`.)
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use iop_edge::registry::{
    ConnId, FenceCause, Generation, Registry, RegistryConfig, RegistryEvent, reason,
};
use iop_tests::pki::{Ca, TRUST_DOMAIN};
use iop_wire::codec::TokioCodec;
use iop_wire::node::{CloseReason, NodeEvent, NodeSession, NodeSessionConfig};
use iop_wire::runtime::{
    NodeConfigPayload, RegisterRequest, RunEvent, RunEventKind, RunRequest, RuntimeFrame,
    RuntimeMessage,
};
use iop_wire::validate::ResponseStallTimeout;
use rustls_pki_types::ServerName;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::codec::Framed;
use workload_identity::{
    ExpectedPeer, client_cert_verifier, peer_identity, role, server_cert_verifier,
};

/// Guards against a hung test; nothing depends on it elapsing.
const LIMIT: Duration = Duration::from_secs(20);

enum EdgeInput {
    Accepted {
        peer: String,
        out: mpsc::UnboundedSender<Option<RuntimeFrame>>,
        reply: tokio::sync::oneshot::Sender<ConnId>,
    },
    Frame(ConnId, RuntimeFrame),
    Closed(ConnId),
    Send {
        node_id: String,
        generation: Generation,
        frame: RuntimeFrame,
    },
}

/// Starts an Edge on a free loopback port; returns its address, an input handle and the
/// registry's events.
async fn start_edge(
    ca: &Ca,
) -> (
    std::net::SocketAddr,
    mpsc::UnboundedSender<EdgeInput>,
    mpsc::UnboundedReceiver<RegistryEvent>,
) {
    let leaf = ca.workload(role::EDGE, "edge-1", true);
    let verifier = client_cert_verifier(
        ca.roots(),
        ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).unwrap(),
    )
    .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(
        workload_identity::server_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (input_tx, mut input_rx) = mpsc::unbounded_channel::<EdgeInput>();
    let (event_tx, event_rx) = mpsc::unbounded_channel();

    // Accept loop: TLS handshake, learn the authenticated name, then one reader per connection.
    let inputs = input_tx.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tcp.set_nodelay(true).unwrap();
            let acceptor = acceptor.clone();
            let inputs = inputs.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let peer = peer_identity(tls.get_ref().1).unwrap().name().to_owned();
                let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Option<RuntimeFrame>>();
                let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
                let _ = inputs.send(EdgeInput::Accepted {
                    peer,
                    out: out_tx,
                    reply: reply_tx,
                });
                let Ok(conn) = reply_rx.await else { return };
                let mut framed = Framed::new(tls, TokioCodec::<RuntimeFrame>::default());
                loop {
                    tokio::select! {
                        out = out_rx.recv() => match out {
                            Some(Some(frame)) => { if framed.send(frame).await.is_err() { break } }
                            _ => break, // close requested
                        },
                        frame = framed.next() => match frame {
                            Some(Ok(frame)) => { let _ = inputs.send(EdgeInput::Frame(conn, frame)); }
                            _ => break,
                        },
                    }
                }
                let _ = inputs.send(EdgeInput::Closed(conn));
            });
        }
    });

    // The registry loop: the only owner of the machine.
    tokio::spawn(async move {
        let mut registry = Registry::new(RegistryConfig::default());
        registry.set_node_config(
            "node-1",
            Some(NodeConfigPayload {
                revision: 3,
                ..Default::default()
            }),
        );
        let mut outs: HashMap<ConnId, mpsc::UnboundedSender<Option<RuntimeFrame>>> = HashMap::new();
        loop {
            let deadline = registry.poll_timeout().map(Instant::from_std);
            let input = tokio::select! {
                i = input_rx.recv() => match i { Some(i) => Some(i), None => return },
                () = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => None,
            };
            let now = Instant::now().into_std();
            match input {
                Some(EdgeInput::Accepted { peer, out, reply }) => {
                    let conn = registry.accept(now, Some(peer));
                    outs.insert(conn, out);
                    let _ = reply.send(conn);
                }
                Some(EdgeInput::Frame(conn, frame)) => registry.handle_frame(now, conn, frame),
                Some(EdgeInput::Closed(conn)) => {
                    registry.handle_close(conn);
                    outs.remove(&conn);
                }
                Some(EdgeInput::Send {
                    node_id,
                    generation,
                    frame,
                }) => {
                    registry.send(now, &node_id, generation, frame).unwrap();
                }
                None => registry.handle_timeout(now),
            }
            while let Some((conn, frame)) = registry.poll_transmit() {
                if let Some(out) = outs.get(&conn) {
                    let _ = out.send(Some(frame));
                }
            }
            while let Some(event) = registry.poll_event() {
                if let RegistryEvent::CloseConnection { conn, .. } = &event
                    && let Some(out) = outs.remove(conn)
                {
                    let _ = out.send(None);
                }
                let _ = event_tx.send(event);
            }
        }
    });
    (addr, input_tx, event_rx)
}

/// Runs a Node whose certificate names `cert_name` and which registers as `node_id`. It answers
/// every RunRequest with START, one DELTA echoing the input, COMPLETE. Returns the close reason.
async fn run_node(
    ca: &Ca,
    addr: std::net::SocketAddr,
    cert_name: &str,
    node_id: &str,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> CloseReason {
    let leaf = ca.workload(role::NODE, cert_name, false);
    let verifier = server_cert_verifier(
        ca.roots(),
        ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, "edge-1").unwrap(),
    )
    .unwrap();
    let connector = TlsConnector::from(Arc::new(
        workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier).unwrap(),
    ));
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let mut framed = Framed::new(tls, TokioCodec::<RuntimeFrame>::default());
    let register = RegisterRequest {
        node_id: node_id.into(),
        version: "test".into(),
        ..Default::default()
    };
    let mut session = NodeSession::new(
        NodeSessionConfig::default(),
        register,
        Instant::now().into_std(),
    );
    let mut stop = stop;
    loop {
        // Drain output until the machine is quiet: handling an event may queue frames.
        let mut progressed = true;
        while progressed {
            progressed = false;
            while let Some(frame) = session.poll_transmit() {
                progressed = true;
                if framed.send(frame).await.is_err() {
                    session.handle_transport_closed();
                }
            }
            while let Some(event) = session.poll_event() {
                progressed = true;
                let now = Instant::now().into_std();
                match event {
                    NodeEvent::ApplyConfig { config, .. } => {
                        assert_eq!(config.revision, 3);
                        session.config_applied(now).unwrap();
                    }
                    NodeEvent::Frame(RuntimeFrame {
                        stream_id,
                        message: RuntimeMessage::RunRequest(req),
                        ..
                    }) => {
                        for kind in [
                            RunEventKind::Start,
                            RunEventKind::Delta,
                            RunEventKind::Complete,
                        ] {
                            let mut ev = RunEvent::new(kind);
                            if kind == RunEventKind::Delta {
                                ev.delta = String::from_utf8(req.input.to_vec()).unwrap();
                            }
                            session
                                .send(
                                    now,
                                    RuntimeFrame::on_stream(
                                        stream_id,
                                        RuntimeMessage::RunEvent(ev),
                                    ),
                                )
                                .unwrap();
                        }
                    }
                    NodeEvent::Closed(reason) => return reason,
                    _ => {}
                }
            }
        }
        let deadline = session.poll_timeout().map(Instant::from_std);
        tokio::select! {
            frame = framed.next() => match frame {
                Some(Ok(frame)) => session.handle_frame(Instant::now().into_std(), frame),
                _ => session.handle_transport_closed(),
            },
            () = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                session.handle_timeout(Instant::now().into_std());
            }
            _ = &mut stop => session.close_local(),
        }
    }
}

async fn next_event(
    events: &mut mpsc::UnboundedReceiver<RegistryEvent>,
    want: impl Fn(&RegistryEvent) -> bool,
) -> RegistryEvent {
    loop {
        let e = events.recv().await.expect("edge alive");
        if want(&e) {
            return e;
        }
    }
}

#[tokio::test]
async fn node_registers_becomes_ready_runs_and_is_fenced_on_close() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("iop test CA");
        let (addr, edge, mut events) = start_edge(&ca).await;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let node = tokio::spawn({
            let ca_node = ca;
            async move { run_node(&ca_node, addr, "node-1", "node-1", stop_rx).await }
        });

        let RegistryEvent::NodeReady { node_id, generation, .. } =
            next_event(&mut events, |e| matches!(e, RegistryEvent::NodeReady { .. })).await
        else { unreachable!() };
        assert_eq!(node_id, "node-1");

        let run = RunRequest {
            run_id: "run-1".into(),
            adapter: "demo".into(),
            target: "demo-model".into(),
            input: bytes::Bytes::from_static(b"hello over mTLS"),
            metadata: Default::default(),
            response_stall_timeout: ResponseStallTimeout::DEFAULT,
            timeout: None,
            long_context: false,
            credential: None,
            trace: None,
        };
        edge.send(EdgeInput::Send { node_id: "node-1".into(), generation, frame: RuntimeFrame::on_stream(5, RuntimeMessage::RunRequest(run)) }).ok().unwrap();
        let mut kinds = Vec::new();
        while kinds.last() != Some(&RunEventKind::Complete) {
            let RegistryEvent::Frame { node_id, generation: g, frame, .. } =
                next_event(&mut events, |e| matches!(e, RegistryEvent::Frame { .. })).await
            else { unreachable!() };
            assert_eq!((node_id.as_str(), g, frame.stream_id), ("node-1", generation, 5));
            let RuntimeMessage::RunEvent(ev) = frame.message else { panic!("not a run event") };
            if ev.kind == RunEventKind::Delta {
                assert_eq!(ev.delta, "hello over mTLS");
            }
            kinds.push(ev.kind);
        }
        assert_eq!(kinds, [RunEventKind::Start, RunEventKind::Delta, RunEventKind::Complete]);

        // Local shutdown of the Node closes the socket; the Edge fences the generation once.
        stop_tx.send(()).unwrap();
        assert_eq!(node.await.unwrap(), CloseReason::Local);
        let fenced = next_event(&mut events, |e| matches!(e, RegistryEvent::NodeFenced { .. })).await;
        assert!(matches!(
            fenced,
            RegistryEvent::NodeFenced { generation: g, cause: FenceCause::Closed, .. } if g == generation
        ));
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn node_registering_under_another_identity_is_rejected() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("iop test CA");
        let (addr, _edge, mut events) = start_edge(&ca).await;
        let (_stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        // Certificate says node-2, registration claims node-1.
        let reason = run_node(&ca, addr, "node-2", "node-1", stop_rx).await;
        assert_eq!(
            reason,
            CloseReason::RegistrationRejected {
                reason: reason::IDENTITY_MISMATCH.into()
            }
        );
        let close = next_event(&mut events, |e| {
            matches!(e, RegistryEvent::CloseConnection { .. })
        })
        .await;
        assert!(matches!(
            close,
            RegistryEvent::CloseConnection {
                cause: FenceCause::Rejected,
                ..
            }
        ));
    })
    .await
    .expect("scenario finishes");
}
