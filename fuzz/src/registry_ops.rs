//! Arbitrary accept/register/ready/close/timeout/app-frame sequences against the Edge
//! `Registry`, in virtual time, checked against the ownership rules of `iop_edge_core::registry`:
//!
//! - per Node id, `NodeReady` and `NodeFenced` alternate strictly: a fence names the
//!   generation that is ready (so it had a `NodeReady` and was not fenced yet), and no
//!   generation is fenced twice or made ready twice;
//! - `Frame` events come only from the currently ready generation, on its connection;
//! - generations increase; a connection is closed at most once; fence causes match the input;
//! - the registry's own view (`ready_generation`, `connection_count`) matches its events.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use iop_edge_core::registry::{
    ConnId, FenceCause, Generation, Registry, RegistryConfig, RegistryEvent,
};
use iop_wire::runtime::{
    NodeConfigPayload, NodeReadyRequest, RegisterRequest, RunEvent, RunEventKind, RuntimeFrame,
    RuntimeMessage,
};

use crate::seed::{ToSeed, variant};

/// The Node ids inputs choose from.
pub const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

/// Most virtual time one step advances.
pub const MAX_STEP_MS: u64 = 60_000;

/// One step. Connection indexes pick from every connection accepted so far (modulo), closed
/// ones included; node indexes pick from [`NODES`] (modulo).
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Accept a connection whose peer identity names a Node, or none.
    Accept(Option<u8>),
    /// `RegisterRequest` on a connection.
    Register {
        /// Connection index.
        conn: u8,
        /// Node index.
        node: u8,
    },
    /// `NodeReadyRequest` on a connection.
    Ready {
        /// Connection index.
        conn: u8,
        /// Node index.
        node: u8,
    },
    /// The transport of a connection closed.
    Close(u8),
    /// Advance virtual time by `ms % (MAX_STEP_MS + 1)` and fire timers.
    AdvanceTime(u16),
    /// A `RunEvent` on stream 1 from a connection.
    AppFrame(u8),
}

fn node(i: u8) -> String {
    NODES[usize::from(i) % NODES.len()].to_owned()
}

/// What the events have said so far.
#[derive(Debug, Default)]
struct Model {
    accepted: Vec<ConnId>,
    closed: HashSet<ConnId>,
    /// Generation → (node, connection), from `Registered`.
    registered: HashMap<Generation, (String, ConnId)>,
    last_generation: Option<Generation>,
    /// Node → its ready connection and generation.
    ready: HashMap<String, (ConnId, Generation)>,
    made_ready: HashSet<Generation>,
    fenced: HashSet<Generation>,
}

impl Model {
    fn conn(&self, i: u8) -> Option<ConnId> {
        let n = self.accepted.len();
        (n > 0).then(|| self.accepted[usize::from(i) % n])
    }

    fn event(&mut self, op: Op, event: RegistryEvent) {
        match event {
            RegistryEvent::Registered {
                conn,
                node_id,
                generation,
                ..
            } => {
                assert!(
                    self.last_generation < Some(generation),
                    "generations increase"
                );
                self.last_generation = Some(generation);
                assert!(!self.closed.contains(&conn), "registered on a closed conn");
                self.registered.insert(generation, (node_id, conn));
            }
            RegistryEvent::NodeReady {
                conn,
                node_id,
                generation,
            } => {
                assert_eq!(
                    self.registered.get(&generation),
                    Some(&(node_id.clone(), conn))
                );
                assert!(self.made_ready.insert(generation), "NodeReady twice");
                assert!(
                    !self.fenced.contains(&generation),
                    "NodeReady after its fence"
                );
                let previous = self.ready.insert(node_id, (conn, generation));
                assert_eq!(
                    previous, None,
                    "NodeReady while another generation is ready"
                );
            }
            RegistryEvent::NodeFenced {
                node_id,
                generation,
                cause,
            } => {
                let current = self.ready.remove(&node_id).map(|(_, g)| g);
                assert_eq!(
                    current,
                    Some(generation),
                    "fenced a generation that is not ready"
                );
                assert!(self.fenced.insert(generation), "fenced twice");
                let expected = match op {
                    Op::Close(_) => FenceCause::Closed,
                    Op::AdvanceTime(_) => FenceCause::HeartbeatTimeout,
                    Op::Register { .. } => FenceCause::Superseded,
                    // A ready owner that sends ready for another Node id is refused.
                    Op::Ready { .. } => FenceCause::Rejected,
                    Op::Accept(_) | Op::AppFrame(_) => panic!("{op:?} fenced {generation:?}"),
                };
                assert_eq!(cause, expected, "fence cause for {op:?}");
            }
            RegistryEvent::Frame {
                conn,
                node_id,
                generation,
                frame,
            } => {
                assert!(matches!(op, Op::AppFrame(_)), "frame event from {op:?}");
                assert_eq!(self.ready.get(&node_id), Some(&(conn, generation)));
                assert_eq!(frame.stream_id, 1);
            }
            RegistryEvent::CloseConnection { conn, .. } => {
                assert!(self.accepted.contains(&conn));
                assert!(self.closed.insert(conn), "closed twice");
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
}

/// Runs one input.
pub fn run(ops: &[Op]) {
    let base = Instant::now();
    let mut elapsed_ms: u64 = 0;
    let mut registry = Registry::new(RegistryConfig {
        default_node_config: Some(NodeConfigPayload::default()),
        // The model covers ownership and fencing; the handshake timeout has its own test.
        handshake_timeout: Duration::MAX,
        ..Default::default()
    });
    let mut model = Model::default();

    for &op in ops {
        let now = base + Duration::from_millis(elapsed_ms);
        match op {
            Op::Accept(peer) => {
                let conn = registry.accept(now, peer.map(node));
                assert!(!model.accepted.contains(&conn), "ConnId reused");
                model.accepted.push(conn);
            }
            Op::Register { conn, node: n } => {
                if let Some(conn) = model.conn(conn) {
                    let req = RegisterRequest {
                        node_id: node(n),
                        ..Default::default()
                    };
                    let frame = RuntimeFrame::new(RuntimeMessage::RegisterRequest(req));
                    registry.handle_frame(now, conn, frame);
                }
            }
            Op::Ready { conn, node: n } => {
                if let Some(conn) = model.conn(conn) {
                    let req = NodeReadyRequest { node_id: node(n) };
                    let frame = RuntimeFrame::new(RuntimeMessage::NodeReadyRequest(req));
                    registry.handle_frame(now, conn, frame);
                }
            }
            Op::Close(conn) => {
                if let Some(conn) = model.conn(conn) {
                    registry.handle_close(conn);
                    // A transport close emits no `CloseConnection`: record it here.
                    model.closed.insert(conn);
                }
            }
            Op::AdvanceTime(ms) => {
                elapsed_ms += u64::from(ms) % (MAX_STEP_MS + 1);
                registry.handle_timeout(base + Duration::from_millis(elapsed_ms));
            }
            Op::AppFrame(conn) => {
                if let Some(conn) = model.conn(conn) {
                    let event = RunEvent::new(RunEventKind::Delta);
                    let frame = RuntimeFrame::on_stream(1, RuntimeMessage::RunEvent(event));
                    registry.handle_frame(now, conn, frame);
                }
            }
        }
        while let Some((conn, _frame)) = registry.poll_transmit() {
            assert!(model.accepted.contains(&conn));
        }
        while let Some(event) = registry.poll_event() {
            model.event(op, event);
        }
        for n in NODES {
            assert_eq!(
                registry.ready_generation(n),
                model.ready.get(n).copied(),
                "{n}"
            );
        }
        assert_eq!(
            registry.connection_count(),
            model.accepted.len() - model.closed.len()
        );
    }
}

impl ToSeed for Op {
    fn write_seed(&self, out: &mut Vec<u8>) {
        match *self {
            Self::Accept(peer) => {
                variant(out, 0, 6);
                peer.write_seed(out);
            }
            Self::Register { conn, node } => {
                variant(out, 1, 6);
                conn.write_seed(out);
                node.write_seed(out);
            }
            Self::Ready { conn, node } => {
                variant(out, 2, 6);
                conn.write_seed(out);
                node.write_seed(out);
            }
            Self::Close(conn) => {
                variant(out, 3, 6);
                conn.write_seed(out);
            }
            Self::AdvanceTime(ms) => {
                variant(out, 4, 6);
                ms.write_seed(out);
            }
            Self::AppFrame(conn) => {
                variant(out, 5, 6);
                conn.write_seed(out);
            }
        }
    }
}
