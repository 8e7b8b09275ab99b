//! The Edge transport's registry rules over real mTLS connections, driven by a raw client that
//! sends exactly the frames a scenario needs: duplicate ready, a second Node id on one
//! connection, supersede and the stale connection's fate.
#![allow(
    clippy::unwrap_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use iop_edge::registry::reason;
use iop_edge::{EdgeHandle, Lifecycle, TransportConfig, bind};
use iop_tests::pki::{Ca, TRUST_DOMAIN};
use iop_wire::codec::TokioCodec;
use iop_wire::runtime::{
    NodeConfigPayload, NodeReadyRequest, NodeReadyResponse, RegisterRequest, RegisterResponse,
    RuntimeFrame, RuntimeMessage,
};
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_util::codec::Framed;
use workload_identity::{ExpectedPeer, role, server_cert_verifier};

const LIMIT: Duration = Duration::from_secs(20);

type Conn = Framed<tokio_rustls::client::TlsStream<TcpStream>, TokioCodec<RuntimeFrame>>;

async fn edge(ca: &Ca) -> EdgeHandle {
    let tls = iop_tests::pki::edge_server_tls(ca, "edge-1");
    let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    cfg.node_configs = vec![
        ("node-1".into(), NodeConfigPayload::default()),
        ("node-2".into(), NodeConfigPayload::default()),
    ];
    bind(cfg).await.unwrap().0
}

async fn connect(ca: &Ca, edge: &EdgeHandle, name: &str) -> Conn {
    let leaf = ca.workload(role::NODE, name, false);
    let verifier = server_cert_verifier(
        ca.roots(),
        ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, "edge-1").unwrap(),
    )
    .unwrap();
    let tls = workload_identity::client_config(leaf.chain.clone(), leaf.key(), verifier).unwrap();
    let tcp = TcpStream::connect(edge.local_addr()).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let stream = TlsConnector::from(Arc::new(tls))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    Framed::new(stream, TokioCodec::default())
}

async fn send(c: &mut Conn, m: RuntimeMessage) {
    c.send(RuntimeFrame::new(m)).await.unwrap();
}

/// The next non-ping frame.
async fn recv(c: &mut Conn) -> Option<RuntimeMessage> {
    loop {
        match c.next().await {
            Some(Ok(f)) if f.message == RuntimeMessage::Ping => {}
            Some(Ok(f)) => return Some(f.message),
            _ => return None,
        }
    }
}

fn register(id: &str) -> RuntimeMessage {
    RuntimeMessage::RegisterRequest(RegisterRequest {
        node_id: id.into(),
        ..Default::default()
    })
}

fn ready(id: &str) -> RuntimeMessage {
    RuntimeMessage::NodeReadyRequest(NodeReadyRequest { node_id: id.into() })
}

#[tokio::test]
async fn duplicate_ready_second_node_id_supersede_and_stale_connection() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = edge(&ca).await;
        let mut life = edge.subscribe();

        let mut a = connect(&ca, &edge, "node-1").await;
        send(&mut a, register("node-1")).await;
        assert!(matches!(
            recv(&mut a).await,
            Some(RuntimeMessage::RegisterResponse(
                RegisterResponse::Accepted { .. }
            ))
        ));
        // Registered is pending: not dispatch-ready, no lifecycle event yet.
        assert!(edge.ready_nodes().is_empty());
        send(&mut a, ready("node-1")).await;
        assert_eq!(
            recv(&mut a).await,
            Some(RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready))
        );
        let Lifecycle::Connected { generation: g1, .. } = life.recv().await.unwrap() else {
            panic!("expected connected")
        };

        // Duplicate ready from the same ready owner: acked again, no second event.
        send(&mut a, ready("node-1")).await;
        assert_eq!(
            recv(&mut a).await,
            Some(RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready))
        );

        // A second Node id on the same connection: refused, the first binding untouched.
        send(&mut a, register("node-2")).await;
        assert_eq!(
            recv(&mut a).await,
            Some(RuntimeMessage::RegisterResponse(
                RegisterResponse::Rejected {
                    reason: reason::CONNECTION_OWNS_ANOTHER_NODE.into()
                }
            ))
        );
        assert_eq!(edge.ready_nodes(), [("node-1".to_owned(), g1)]);

        // A new connection for node-1 supersedes the first with a new generation.
        let mut b = connect(&ca, &edge, "node-1").await;
        send(&mut b, register("node-1")).await;
        assert!(matches!(
            recv(&mut b).await,
            Some(RuntimeMessage::RegisterResponse(
                RegisterResponse::Accepted { .. }
            ))
        ));
        // The next lifecycle event is the fence of g1 (so the duplicate ready made none).
        assert_eq!(
            life.recv().await.unwrap(),
            Lifecycle::Disconnected {
                node_id: "node-1".into(),
                generation: g1
            }
        );
        // The stale connection is told why and closed; its late ready changes nothing.
        assert_eq!(
            recv(&mut a).await,
            Some(RuntimeMessage::NodeReadyResponse(
                NodeReadyResponse::NotReady {
                    reason: reason::SUPERSEDED.into()
                }
            ))
        );
        let _ = a.send(RuntimeFrame::new(ready("node-1"))).await;
        assert_eq!(recv(&mut a).await, None, "the stale connection is closed");
        send(&mut b, ready("node-1")).await;
        assert_eq!(
            recv(&mut b).await,
            Some(RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready))
        );
        let Lifecycle::Connected { generation: g2, .. } = life.recv().await.unwrap() else {
            panic!("expected connected")
        };
        assert!(g2 > g1);
        assert_eq!(edge.ready_nodes(), [("node-1".to_owned(), g2)]);
        // The Edge closed exactly one connection, as superseded.
        let metrics = edge.metrics().render(0, 0);
        assert!(
            metrics.contains("iop_edge_node_connections_closed_total{cause=\"superseded\"} 1"),
            "{metrics}"
        );
        assert!(
            metrics
                .contains("iop_edge_node_connections_closed_total{cause=\"protocol_violation\"} 0"),
            "{metrics}"
        );
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test]
async fn application_frames_before_ready_close_the_connection_without_events() {
    tokio::time::timeout(LIMIT, async {
        let ca = Ca::new("test CA");
        let edge = edge(&ca).await;
        let mut life = edge.subscribe();
        let mut a = connect(&ca, &edge, "node-1").await;
        send(&mut a, register("node-1")).await;
        assert!(matches!(
            recv(&mut a).await,
            Some(RuntimeMessage::RegisterResponse(
                RegisterResponse::Accepted { .. }
            ))
        ));
        let ev = iop_wire::runtime::RunEvent::new(iop_wire::runtime::RunEventKind::Start);
        a.send(RuntimeFrame::on_stream(1, RuntimeMessage::RunEvent(ev)))
            .await
            .unwrap();
        assert_eq!(
            recv(&mut a).await,
            None,
            "closed for the protocol violation"
        );
        assert!(edge.ready_nodes().is_empty());
        assert!(matches!(
            life.try_recv(),
            Err(tokio::sync::broadcast::error::TryRecvError::Empty)
        ));
        let metrics = edge.metrics().render(0, 0);
        assert!(
            metrics
                .contains("iop_edge_node_connections_closed_total{cause=\"protocol_violation\"} 1"),
            "{metrics}"
        );
    })
    .await
    .expect("scenario finishes");
}
