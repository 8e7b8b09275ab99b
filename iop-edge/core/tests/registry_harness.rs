//! Deterministic two-party harness: Node sessions and the Edge registry exchange real encoded
//! frames in virtual time (quinn-proto's `Pair`, str0m's `progress`). No sockets, no sleeps:
//! time only moves when a test advances it to the earliest `poll_timeout`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use iop_edge_core::registry::{
    ConnId, FenceCause, Generation, Registry, RegistryConfig, RegistryEvent, reason,
};
use iop_wire::HeartbeatConfig;
use iop_wire::codec::FrameCodec;
use iop_wire::node::{CloseReason, NodeEvent, NodeSession, NodeSessionConfig, NodeState};
use iop_wire::reconnect::{Action, Exit, Failure, ReconnectPolicy, Supervisor};
use iop_wire::runtime::{
    NodeConfigPayload, NodeReadyRequest, NodeReadyResponse, RegisterRequest, RegisterResponse,
    RunEvent, RunEventKind, RunRequest, RuntimeFrame, RuntimeMessage,
};
use iop_wire::validate::ResponseStallTimeout;

/// One Node connection as the harness sees it.
struct Link {
    conn: ConnId,
    node: NodeSession,
    /// Frames from the Node are dropped (simulates a silent, half-dead peer).
    node_to_edge_blocked: bool,
    /// Apply config automatically when asked.
    auto_apply: bool,
    /// Every event the Node emitted.
    node_events: Vec<NodeEvent>,
    /// Frames the Edge sent on this connection.
    received_by_node: Vec<RuntimeFrame>,
    /// The transport is gone.
    down: bool,
    /// Edge frames are recorded but not delivered to the session (the test plays the Node).
    raw: bool,
}

struct Harness {
    now: Instant,
    codec: FrameCodec,
    edge: Registry,
    links: Vec<Link>,
    by_conn: HashMap<ConnId, usize>,
    edge_events: Vec<RegistryEvent>,
}

impl Harness {
    fn new() -> Self {
        let mut edge = Registry::new(RegistryConfig {
            heartbeat: HeartbeatConfig::from_interval(Duration::from_secs(10)),
            default_node_config: None,
            handshake_timeout: Duration::from_secs(10),
            ..Default::default()
        });
        for n in ["node-1", "node-2"] {
            edge.set_node_config(
                n,
                Some(NodeConfigPayload {
                    revision: 7,
                    ..Default::default()
                }),
            );
        }
        Self {
            now: Instant::now(),
            codec: FrameCodec::new(),
            edge,
            links: Vec::new(),
            by_conn: HashMap::new(),
            edge_events: Vec::new(),
        }
    }

    /// A Node dials: the Edge accepts (with `peer` as the authenticated name) and the Node
    /// session starts. Returns the link index.
    fn connect(&mut self, node_id: &str, peer: Option<&str>, auto_apply: bool) -> usize {
        self.connect_with(node_id, peer, auto_apply, false)
    }

    fn connect_with(
        &mut self,
        node_id: &str,
        peer: Option<&str>,
        auto_apply: bool,
        blocked: bool,
    ) -> usize {
        let conn = self.edge.accept(self.now, peer.map(str::to_owned));
        let register = RegisterRequest {
            node_id: node_id.to_owned(),
            ..Default::default()
        };
        let node = NodeSession::new(NodeSessionConfig::default(), register, self.now);
        self.links.push(Link {
            conn,
            node,
            node_to_edge_blocked: blocked,
            auto_apply,
            node_events: Vec::new(),
            received_by_node: Vec::new(),
            down: false,
            raw: false,
        });
        let idx = self.links.len() - 1;
        self.by_conn.insert(conn, idx);
        self.settle();
        idx
    }

    /// A peer that is accepted but never registers: the test plays it (nothing its session
    /// would send reaches the Edge).
    fn connect_silent(&mut self, node_id: &str) -> usize {
        let i = self.connect_with(node_id, None, false, true);
        self.links[i].raw = true;
        i
    }

    /// Through real bytes, both ways.
    fn wire(&self, frame: &RuntimeFrame) -> RuntimeFrame {
        let mut buf = BytesMut::new();
        self.codec.encode(frame, &mut buf).expect("encodes");
        let back = self
            .codec
            .decode(&mut buf)
            .expect("decodes")
            .expect("whole frame");
        assert!(buf.is_empty());
        back
    }

    /// Injects a frame from link `i`'s side, as if its Node sent it. From now on the test
    /// plays that Node: Edge frames are recorded, not delivered to the session.
    fn inject(&mut self, i: usize, message: RuntimeMessage) {
        self.inject_frame(i, RuntimeFrame::new(message));
    }

    fn inject_frame(&mut self, i: usize, frame: RuntimeFrame) {
        self.links[i].raw = true;
        let frame = self.wire(&frame);
        let conn = self.links[i].conn;
        self.edge.handle_frame(self.now, conn, frame);
        self.settle();
    }

    /// Moves frames and events until nothing changes.
    fn settle(&mut self) {
        loop {
            let mut moved = false;
            for i in 0..self.links.len() {
                while let Some(frame) = self.links[i].node.poll_transmit() {
                    moved = true;
                    let link = &self.links[i];
                    if link.down || link.node_to_edge_blocked {
                        continue;
                    }
                    let frame = self.wire(&frame);
                    self.edge.handle_frame(self.now, link.conn, frame);
                }
                while let Some(event) = self.links[i].node.poll_event() {
                    moved = true;
                    match &event {
                        NodeEvent::ApplyConfig { .. } if self.links[i].auto_apply => {
                            self.links[i]
                                .node
                                .config_applied(self.now)
                                .expect("configuring");
                        }
                        NodeEvent::Closed(_) if !self.links[i].down => {
                            self.links[i].down = true;
                            self.edge.handle_close(self.links[i].conn);
                        }
                        _ => {}
                    }
                    self.links[i].node_events.push(event);
                }
            }
            while let Some((conn, frame)) = self.edge.poll_transmit() {
                moved = true;
                let frame = self.wire(&frame);
                let i = self.by_conn[&conn];
                if self.links[i].down {
                    continue;
                }
                self.links[i].received_by_node.push(frame.clone());
                if !self.links[i].raw {
                    self.links[i].node.handle_frame(self.now, frame);
                }
            }
            while let Some(event) = self.edge.poll_event() {
                moved = true;
                if let RegistryEvent::CloseConnection { conn, .. } = &event {
                    let i = self.by_conn[conn];
                    if !self.links[i].down {
                        self.links[i].down = true;
                        self.links[i].node.handle_transport_closed();
                    }
                }
                self.edge_events.push(event);
            }
            if !moved {
                break;
            }
        }
    }

    /// Advances virtual time to the earliest timer of any party and fires it.
    fn step_time(&mut self) -> Duration {
        let mut next = self.edge.poll_timeout();
        for l in &self.links {
            if let Some(t) = l.node.poll_timeout() {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        let next = next.expect("some timer is armed");
        let elapsed = next.saturating_duration_since(self.now);
        self.now = self.now.max(next);
        self.edge.handle_timeout(self.now);
        for l in &mut self.links {
            l.node.handle_timeout(self.now);
        }
        self.settle();
        elapsed
    }

    fn advance_by(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            let mut next = self.edge.poll_timeout();
            for l in &self.links {
                if let Some(t) = l.node.poll_timeout() {
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
            match next {
                Some(t) if t <= end => {
                    self.step_time();
                }
                _ => break,
            }
        }
        self.now = end;
    }

    fn take_edge_events(&mut self) -> Vec<RegistryEvent> {
        std::mem::take(&mut self.edge_events)
    }
}

fn count<T>(v: &[T], f: impl Fn(&T) -> bool) -> usize {
    v.iter().filter(|e| f(e)).count()
}

fn is_ready_event(e: &RegistryEvent) -> bool {
    matches!(e, RegistryEvent::NodeReady { .. })
}

fn is_fence(e: &RegistryEvent) -> bool {
    matches!(e, RegistryEvent::NodeFenced { .. })
}

fn run_request() -> RuntimeMessage {
    RuntimeMessage::RunRequest(RunRequest {
        run_id: "run-1".into(),
        adapter: "demo".into(),
        target: "demo-model".into(),
        input: bytes::Bytes::from_static(b"{\"prompt\":\"hi\"}"),
        metadata: Default::default(),
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    })
}

#[test]
fn happy_path_register_config_ready_dispatch() {
    let mut h = Harness::new();
    let i = h.connect("node-1", Some("node-1"), true);

    let link = &h.links[i];
    assert_eq!(link.node.state(), NodeState::Ready);
    // ApplyConfig came before Ready, with the configured payload.
    assert!(matches!(
        &link.node_events[..],
        [NodeEvent::ApplyConfig { node_id, config }, NodeEvent::Ready]
            if node_id == "node-1" && config.revision == 7
    ));
    let link_conn = link.conn;
    let events = h.take_edge_events();
    assert!(matches!(
        &events[..],
        [RegistryEvent::Registered { generation: g1, .. }, RegistryEvent::NodeReady { generation: g2, .. }]
            if g1 == g2
    ));
    let (conn, generation) = h.edge.ready_generation("node-1").unwrap();
    assert_eq!(conn, link_conn);

    // Dispatch flows only now, and reaches the Node.
    let run = RuntimeFrame::on_stream(1, run_request());
    h.edge.send(h.now, "node-1", generation, run).unwrap();
    h.settle();
    assert!(matches!(
        h.links[i].node_events.last(),
        Some(NodeEvent::Frame(RuntimeFrame {
            stream_id: 1,
            message: RuntimeMessage::RunRequest(_),
            ..
        }))
    ));
    // The Node answers; the Edge tags it with the transport reception identity.
    let ev = RuntimeFrame::on_stream(
        1,
        RuntimeMessage::RunEvent(RunEvent::new(RunEventKind::Complete)),
    );
    h.links[i].node.send(h.now, ev).unwrap();
    h.settle();
    assert!(matches!(
        h.take_edge_events().as_slice(),
        [RegistryEvent::Frame { node_id, generation: g, .. }] if node_id == "node-1" && *g == generation
    ));
}

#[test]
fn nothing_is_dispatched_or_accepted_before_ready() {
    let mut h = Harness::new();
    let i = h.connect("node-1", None, false);
    assert_eq!(h.links[i].node.state(), NodeState::Configuring);
    let (_, generation) = h.edge.pending_generation("node-1").unwrap();
    // The Edge refuses to send to a pending owner...
    assert!(
        h.edge
            .send(
                h.now,
                "node-1",
                generation,
                RuntimeFrame::on_stream(1, run_request())
            )
            .is_err()
    );
    // ...the Node refuses to send application frames before its ack...
    let ev = RuntimeFrame::on_stream(
        1,
        RuntimeMessage::RunEvent(RunEvent::new(RunEventKind::Start)),
    );
    assert!(h.links[i].node.send(h.now, ev).is_err());
    // ...and an application frame from a pending connection is a protocol violation that
    // closes it without any lifecycle event.
    h.take_edge_events();
    h.inject_frame(
        i,
        RuntimeFrame::on_stream(
            1,
            RuntimeMessage::RunEvent(RunEvent::new(RunEventKind::Start)),
        ),
    );
    let events = h.take_edge_events();
    assert_eq!(count(&events, is_ready_event) + count(&events, is_fence), 0);
    assert!(events.iter().any(|e| matches!(
        e,
        RegistryEvent::CloseConnection {
            cause: FenceCause::ProtocolViolation,
            ..
        }
    )));
    assert!(h.edge.pending_generation("node-1").is_none());
}

#[test]
fn second_node_id_on_one_connection_is_rejected_without_touching_the_first() {
    let mut h = Harness::new();
    let i = h.connect("node-1", None, true);
    let before = h.edge.ready_generation("node-1").unwrap();
    h.take_edge_events();

    h.inject(
        i,
        RuntimeMessage::RegisterRequest(RegisterRequest {
            node_id: "node-2".into(),
            ..Default::default()
        }),
    );

    assert_eq!(
        h.edge.ready_generation("node-1"),
        Some(before),
        "binding and generation unchanged"
    );
    assert!(
        h.edge.ready_generation("node-2").is_none()
            && h.edge.pending_generation("node-2").is_none()
    );
    assert!(
        h.take_edge_events().is_empty(),
        "no lifecycle event for a rejected registration"
    );
    let last = h.links[i].received_by_node.last().unwrap();
    assert!(matches!(
        &last.message,
        RuntimeMessage::RegisterResponse(RegisterResponse::Rejected { reason: r }) if r == reason::CONNECTION_OWNS_ANOTHER_NODE
    ));
    // The same Node id again is also refused, and also changes nothing.
    h.inject(
        i,
        RuntimeMessage::RegisterRequest(RegisterRequest {
            node_id: "node-1".into(),
            ..Default::default()
        }),
    );
    assert_eq!(h.edge.ready_generation("node-1"), Some(before));
    assert!(h.take_edge_events().is_empty());
}

#[test]
fn registration_must_match_the_peer_identity_and_configuration() {
    let mut h = Harness::new();
    let i = h.connect("node-1", Some("node-2"), true);
    assert!(matches!(
        h.links[i].node_events.last(),
        Some(NodeEvent::Closed(CloseReason::RegistrationRejected { reason: r })) if r == reason::IDENTITY_MISMATCH
    ));
    let j = h.connect("node-9", None, true);
    assert!(matches!(
        h.links[j].node_events.last(),
        Some(NodeEvent::Closed(CloseReason::RegistrationRejected { reason: r })) if r == reason::NODE_NOT_CONFIGURED
    ));
    assert_eq!(count(&h.take_edge_events(), is_ready_event), 0);
}

/// Seed 001/000 (managed): a Node that does not trust the key the Control Plane signs leases
/// with is refused at registration (never ready, so never selected), with a reason naming both
/// sides and one `RegisterRefused` event; a Node trusting it, or naming no ids (older Nodes),
/// is served as before.
#[test]
fn a_node_that_does_not_trust_the_lease_issuer_key_is_refused_at_registration() {
    let mut h = Harness::new();
    h.edge.set_required_issuer(Some("p256:aaaa".into()));
    let register = |ids: &[&str]| {
        RuntimeMessage::RegisterRequest(RegisterRequest {
            node_id: "node-1".into(),
            issuer_key_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        })
    };
    let i = h.connect_silent("node-1");
    h.inject(i, register(&["p256:bbbb", "p256:cccc"]));
    let last = h.links[i].received_by_node.last().unwrap();
    assert!(
        matches!(
            &last.message,
            RuntimeMessage::RegisterResponse(RegisterResponse::Rejected { reason: r })
                if r.starts_with(reason::ISSUER_KEY_NOT_TRUSTED) && r.contains("p256:aaaa") && r.contains("p256:bbbb, p256:cccc")
        ),
        "{last:?}"
    );
    let events = h.take_edge_events();
    assert_eq!(
        count(
            &events,
            |e| matches!(e, RegistryEvent::RegisterRefused { node_id, .. } if node_id == "node-1")
        ),
        1,
        "{events:?}"
    );
    assert!(
        h.edge.pending_generation("node-1").is_none()
            && h.edge.ready_generation("node-1").is_none()
    );
    assert_eq!(count(&events, is_ready_event), 0);
    // Trusting it (among others), or naming nothing: accepted.
    for ids in [&["p256:bbbb", "p256:aaaa"][..], &[]] {
        let j = h.connect_silent("node-1");
        h.inject(j, register(ids));
        let last = h.links[j].received_by_node.last().unwrap();
        assert!(
            matches!(
                &last.message,
                RuntimeMessage::RegisterResponse(RegisterResponse::Accepted { .. })
            ),
            "{ids:?}: {last:?}"
        );
    }
    // Without a required key (legacy, or before the first projection) nothing is checked.
    h.edge.set_required_issuer(None);
    let k = h.connect_silent("node-1");
    h.inject(k, register(&["p256:zzzz"]));
    assert!(matches!(
        &h.links[k].received_by_node.last().unwrap().message,
        RuntimeMessage::RegisterResponse(RegisterResponse::Accepted { .. })
    ));
}

#[test]
fn stale_ready_after_supersede_is_refused_and_changes_nothing() {
    let mut h = Harness::new();
    // The first connection registers but has not sent ready yet.
    let old = h.connect("node-1", None, false);
    let (_, g1) = h.edge.pending_generation("node-1").unwrap();
    // A second connection for the same Node supersedes it with a new generation.
    let new = h.connect("node-1", None, false);
    let (conn2, g2) = h.edge.pending_generation("node-1").unwrap();
    assert!(g2 > g1);
    assert_eq!(conn2, h.links[new].conn);
    // The old connection was told and closed; its Node session ended with the reason.
    assert!(h.links[old].down);
    assert!(matches!(
        h.links[old].node_events.last(),
        Some(NodeEvent::Closed(CloseReason::NotReady { reason: r })) if r == reason::SUPERSEDED
    ));
    // A late ready from the stale connection (raced past the close) changes nothing.
    let stale_conn = h.links[old].conn;
    h.take_edge_events();
    h.edge.handle_frame(
        h.now,
        stale_conn,
        RuntimeFrame::new(RuntimeMessage::NodeReadyRequest(NodeReadyRequest {
            node_id: "node-1".into(),
        })),
    );
    h.edge.handle_close(stale_conn);
    h.settle();
    assert!(h.take_edge_events().is_empty());
    assert_eq!(h.edge.pending_generation("node-1"), Some((conn2, g2)));
    // The current owner becomes ready under the new generation.
    h.links[new].node.config_applied(h.now).unwrap();
    h.settle();
    let events = h.take_edge_events();
    assert!(
        matches!(&events[..], [RegistryEvent::NodeReady { generation, .. }] if *generation == g2)
    );
}

#[test]
fn supersede_of_a_ready_owner_fences_it_exactly_once() {
    let mut h = Harness::new();
    let old = h.connect("node-1", None, true);
    let (_, g1) = h.edge.ready_generation("node-1").unwrap();
    h.take_edge_events();
    let new = h.connect("node-1", None, true);
    let (_, g2) = h.edge.ready_generation("node-1").unwrap();
    // The stale connection's own close arrives later and must not fence again.
    h.edge.handle_close(h.links[old].conn);
    h.settle();
    let events = h.take_edge_events();
    let fences: Vec<_> = events.iter().filter(|e| is_fence(e)).collect();
    assert!(matches!(
        fences[..],
        [RegistryEvent::NodeFenced { generation, cause: FenceCause::Superseded, .. }] if *generation == g1
    ));
    assert!(
        matches!(&events[..], [.., RegistryEvent::NodeReady { generation, .. }] if *generation == g2)
    );
    assert!(h.links[new].node.is_ready());
    // Sending on the old generation is refused (generation fencing at dispatch).
    assert!(
        h.edge
            .send(
                h.now,
                "node-1",
                g1,
                RuntimeFrame::on_stream(1, run_request())
            )
            .is_err()
    );
    assert!(
        h.edge
            .send(
                h.now,
                "node-1",
                g2,
                RuntimeFrame::on_stream(1, run_request())
            )
            .is_ok()
    );
}

#[test]
fn duplicate_ready_is_acked_without_a_second_event() {
    let mut h = Harness::new();
    let i = h.connect("node-1", None, true);
    h.take_edge_events();
    h.inject(
        i,
        RuntimeMessage::NodeReadyRequest(NodeReadyRequest {
            node_id: "node-1".into(),
        }),
    );
    assert!(h.take_edge_events().is_empty());
    assert!(matches!(
        h.links[i].received_by_node.last().map(|f| &f.message),
        Some(RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready))
    ));
    // A Node session that receives the duplicate ack stays ready.
    let ack = h.links[i].received_by_node.last().unwrap().clone();
    h.links[i].node.handle_frame(h.now, ack);
    assert!(
        h.links[i].node.is_ready(),
        "the duplicate ack does not disturb the Node"
    );
    assert_eq!(h.links[i].node.poll_event(), None);
}

#[test]
fn ready_for_another_node_id_or_unregistered_is_refused_and_closed() {
    let mut h = Harness::new();
    let i = h.connect("node-1", None, false);
    h.take_edge_events();
    h.inject(
        i,
        RuntimeMessage::NodeReadyRequest(NodeReadyRequest {
            node_id: "node-2".into(),
        }),
    );
    let events = h.take_edge_events();
    assert_eq!(count(&events, is_ready_event), 0);
    assert!(events.iter().any(|e| matches!(
        e,
        RegistryEvent::CloseConnection {
            cause: FenceCause::Rejected,
            ..
        }
    )));
    assert!(
        h.edge.pending_generation("node-1").is_none(),
        "the pending claim ended with its connection"
    );

    // Ready on a connection that never registered.
    let conn = h.edge.accept(h.now, None);
    h.edge.handle_frame(
        h.now,
        conn,
        RuntimeFrame::new(RuntimeMessage::NodeReadyRequest(NodeReadyRequest {
            node_id: "node-1".into(),
        })),
    );
    let (c, frame) = h.edge.poll_transmit().unwrap();
    assert_eq!(c, conn);
    assert!(matches!(
        frame.message,
        RuntimeMessage::NodeReadyResponse(NodeReadyResponse::NotReady { reason: ref r }) if r == reason::NOT_REGISTERED
    ));
}

#[test]
fn disconnect_of_the_ready_owner_fences_exactly_once() {
    let mut h = Harness::new();
    let i = h.connect("node-1", None, true);
    let (_, g) = h.edge.ready_generation("node-1").unwrap();
    h.take_edge_events();
    let conn = h.links[i].conn;
    h.edge.handle_close(conn);
    h.edge.handle_close(conn);
    h.edge
        .handle_frame(h.now, conn, RuntimeFrame::new(RuntimeMessage::Ping));
    h.settle();
    let events = h.take_edge_events();
    assert!(matches!(
        &events[..],
        [RegistryEvent::NodeFenced { node_id, generation, cause: FenceCause::Closed }] if node_id == "node-1" && *generation == g
    ));
    assert!(h.edge.ready_generation("node-1").is_none());
}

#[test]
fn heartbeat_timeout_fences_after_the_idle_timeout_in_virtual_time() {
    let mut h = Harness::new();
    let i = h.connect("node-1", None, true);
    let (_, g) = h.edge.ready_generation("node-1").unwrap();
    h.take_edge_events();

    // A healthy idle connection stays up for a long (virtual) time: pings keep it alive.
    h.advance_by(Duration::from_secs(600));
    assert!(h.take_edge_events().iter().all(|e| !is_fence(e)));
    assert!(h.edge.is_current_ready("node-1", g));
    assert!(h.links[i].node.is_ready());

    // Now the Node goes silent (its frames are lost).
    h.links[i].node_to_edge_blocked = true;
    let silent_since = h.now;
    let mut fenced_at = None;
    for _ in 0..100 {
        h.step_time();
        if h.edge_events.iter().any(is_fence) {
            fenced_at = Some(h.now);
            break;
        }
    }
    let fenced_at = fenced_at.expect("the silent Node is fenced");
    let silent_for = fenced_at - silent_since;
    // Idle timeout is 3 × 10 s after the last frame received (at most one interval before
    // the Node went silent).
    assert!(
        silent_for >= Duration::from_secs(20) && silent_for <= Duration::from_secs(30),
        "{silent_for:?}"
    );
    let events = h.take_edge_events();
    assert_eq!(count(&events, is_fence), 1);
    assert!(events.iter().any(|e| matches!(
        e,
        RegistryEvent::NodeFenced { generation, cause: FenceCause::HeartbeatTimeout, .. } if *generation == g
    )));
    assert!(h.links[i].down);
}

#[test]
fn a_connection_that_does_not_get_ready_in_time_is_closed_even_while_it_pings() {
    let mut h = Harness::new();
    // Registers, but never applies its config (so never reports ready); keeps pinging.
    let slow = h.connect("node-1", None, false);
    // Sends only pings, never registers.
    let pinger = h.connect_silent("node-2");
    let accepted = h.now;
    let mut closed = HashMap::new();
    while closed.len() < 2 {
        h.advance_by(Duration::from_secs(1));
        h.inject(pinger, RuntimeMessage::Ping);
        for e in h.take_edge_events() {
            if let RegistryEvent::CloseConnection { conn, cause } = e {
                closed.insert(conn, (cause, h.now - accepted));
            }
        }
        assert!(h.now - accepted <= Duration::from_secs(11), "{closed:?}");
    }
    for link in [slow, pinger] {
        let (cause, after) = closed[&h.links[link].conn];
        assert_eq!(cause, FenceCause::HandshakeTimeout);
        assert_eq!(after, Duration::from_secs(10));
        assert!(h.links[link].down);
    }
    assert!(
        h.edge.pending_generation("node-1").is_none(),
        "the pending claim is gone"
    );
    // A Node that gets ready in time is never closed by it.
    let ok = h.connect("node-1", None, true);
    h.advance_by(Duration::from_secs(60));
    assert!(!h.links[ok].down);
    assert!(h.edge.ready_generation("node-1").is_some());
}

#[test]
fn node_gives_up_on_a_silent_edge() {
    let mut h = Harness::new();
    let i = h.connect("node-1", None, true);
    // The Edge vanishes without a close: the Node hears nothing more.
    h.links[i].down = true;
    let mut reason = None;
    for _ in 0..100 {
        h.step_time();
        if let Some(NodeEvent::Closed(r)) = h.links[i].node_events.last() {
            reason = Some(r.clone());
            break;
        }
    }
    assert_eq!(reason, Some(CloseReason::HeartbeatTimeout));
}

#[test]
fn handshake_timeout_when_the_edge_never_answers() {
    let mut h = Harness::new();
    let register = RegisterRequest {
        node_id: "node-1".into(),
        ..Default::default()
    };
    let config = NodeSessionConfig {
        handshake_timeout: Duration::from_secs(5),
        ..Default::default()
    };
    let mut node = NodeSession::new(config, register, h.now);
    let _ = node.poll_transmit();
    let deadline = node.poll_timeout().unwrap();
    assert_eq!(deadline - h.now, Duration::from_secs(5));
    h.now = deadline;
    node.handle_timeout(h.now);
    assert_eq!(
        node.poll_event(),
        Some(NodeEvent::Closed(CloseReason::HandshakeTimeout))
    );
    assert_eq!(node.poll_timeout(), None);
}

// === reconnect policy, driven in virtual time ===

/// Runs a supervisor against an Edge whose reachability per attempt is `reachable(attempt)`;
/// returns the dial times and the exit.
fn drive_supervisor(
    policy: ReconnectPolicy,
    mut outcome: impl FnMut(u32) -> Option<Failure>,
    max_steps: usize,
) -> (Vec<(u32, Duration)>, Option<Exit>) {
    let start = Instant::now();
    let mut now = start;
    let mut s = Supervisor::new(policy);
    let mut dials = Vec::new();
    let mut rng = 0x9e37_79b9_u32;
    for _ in 0..max_steps {
        match s.poll_action() {
            Some(Action::Dial { attempt }) => {
                dials.push((attempt, now - start));
                rng = rng.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                match outcome(u32::try_from(dials.len()).expect("few dials")) {
                    Some(f) => s.handle_failure(now, f, rng),
                    None => s.handle_ready(),
                }
            }
            Some(Action::Exit(e)) => return (dials, Some(e)),
            None => match s.poll_timeout() {
                Some(t) => {
                    now = t;
                    s.handle_timeout(now);
                }
                None => break,
            },
        }
    }
    (dials, s.exit())
}

#[test]
fn reconnect_finite_budget_exhausts_with_exit_code_1() {
    let policy = ReconnectPolicy::from_config(Some(5), Some(3)).unwrap();
    let (dials, exit) = drive_supervisor(policy, |_| Some(Failure::Retryable), 100);
    assert_eq!(dials.iter().map(|d| d.0).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(exit, Some(Exit::Exhausted { attempts: 3 }));
    assert_eq!(exit.unwrap().exit_code(), 1);
    // Waits lie within the jitter window [4 s, 5 s].
    for w in dials.windows(2) {
        let gap = w[1].1 - w[0].1;
        assert!(
            gap >= Duration::from_secs(4) && gap <= Duration::from_secs(5),
            "{gap:?}"
        );
    }
}

#[test]
fn reconnect_default_budget_is_ten() {
    let policy = ReconnectPolicy::from_config(None, None).unwrap();
    let (dials, exit) = drive_supervisor(policy, |_| Some(Failure::Retryable), 1000);
    assert_eq!(dials.len(), 10);
    assert_eq!(exit, Some(Exit::Exhausted { attempts: 10 }));
}

#[test]
fn reconnect_unlimited_runs_until_shutdown_which_exits_0() {
    let policy = ReconnectPolicy::from_config(Some(1), Some(0)).unwrap();
    let (dials, exit) = drive_supervisor(policy, |_| Some(Failure::Retryable), 2000);
    assert!(
        dials.len() >= 500,
        "still dialing after {} attempts",
        dials.len()
    );
    assert_eq!(exit, None);
    let mut s = Supervisor::new(policy);
    let _ = s.poll_action();
    s.handle_failure(Instant::now(), Failure::Retryable, 0);
    s.handle_shutdown();
    assert_eq!(s.poll_action(), Some(Action::Exit(Exit::Shutdown)));
    assert_eq!(Exit::Shutdown.exit_code(), 0);
}

#[test]
fn reconnect_fatal_local_error_exits_1_immediately() {
    let policy = ReconnectPolicy::from_config(None, Some(0)).unwrap();
    let (dials, exit) = drive_supervisor(policy, |_| Some(Failure::Fatal), 100);
    assert_eq!(dials.len(), 1);
    assert_eq!(exit, Some(Exit::Fatal));
    assert_eq!(Exit::Fatal.exit_code(), 1);
}

#[test]
fn reconnect_budget_resets_after_a_ready_session() {
    let policy = ReconnectPolicy::from_config(Some(1), Some(3)).unwrap();
    // Attempts 1-2 fail, 3 reaches ready and later drops (a retryable failure of the same
    // attempt), then everything fails: the budget is the full 3 again after the ready session.
    let mut s = Supervisor::new(policy);
    let mut now = Instant::now();
    let mut attempts = Vec::new();
    let mut dial_no = 0;
    loop {
        match s.poll_action() {
            Some(Action::Dial { attempt }) => {
                dial_no += 1;
                attempts.push(attempt);
                if dial_no == 3 {
                    s.handle_ready();
                }
                s.handle_failure(now, Failure::Retryable, 7);
            }
            Some(Action::Exit(e)) => {
                assert_eq!(e, Exit::Exhausted { attempts: 3 });
                break;
            }
            None => {
                now = s.poll_timeout().unwrap();
                s.handle_timeout(now);
            }
        }
    }
    assert_eq!(attempts, [1, 2, 3, 1, 2, 3]);
}

#[test]
fn supervisor_node_and_edge_reconnect_end_to_end() {
    // The Edge is unreachable for the first two dials, then accepts; later it drops the
    // connection; the Node reconnects and becomes ready on a new generation.
    let mut h = Harness::new();
    let policy = ReconnectPolicy::from_config(Some(2), Some(5)).unwrap();
    let mut sup = Supervisor::new(policy);
    let mut dials = 0;
    let mut link = None;
    let mut generations = Vec::new();
    for _ in 0..200 {
        match sup.poll_action() {
            Some(Action::Dial { .. }) => {
                dials += 1;
                if dials <= 2 {
                    sup.handle_failure(h.now, Failure::Retryable, 0);
                    continue;
                }
                let i = h.connect("node-1", Some("node-1"), true);
                assert!(h.links[i].node.is_ready());
                sup.handle_ready();
                generations.push(h.edge.ready_generation("node-1").unwrap().1);
                link = Some(i);
                if generations.len() == 2 {
                    break;
                }
                // The Edge drops the connection.
                h.edge.close(h.links[i].conn, FenceCause::Local);
                h.settle();
            }
            Some(Action::Exit(e)) => panic!("unexpected exit {e:?}"),
            None => {}
        }
        if let Some(i) = link.take()
            && h.links[i].down
        {
            let reason = h.links[i].node_events.iter().rev().find_map(|e| match e {
                NodeEvent::Closed(r) => Some(r.clone()),
                _ => None,
            });
            assert_eq!(reason, Some(CloseReason::TransportClosed));
            assert!(reason.unwrap().is_retryable());
            sup.handle_failure(h.now, Failure::Retryable, 0);
        }
        if let Some(t) = sup.poll_timeout() {
            h.now = h.now.max(t);
            sup.handle_timeout(h.now);
        }
    }
    assert_eq!(dials, 4);
    assert_eq!(generations.len(), 2);
    assert!(generations[1] > generations[0]);
    let events = h.take_edge_events();
    let lifecycle: Vec<(bool, Generation)> = events
        .iter()
        .filter_map(|e| match e {
            RegistryEvent::NodeReady { generation, .. } => Some((true, *generation)),
            RegistryEvent::NodeFenced { generation, .. } => Some((false, *generation)),
            _ => None,
        })
        .collect();
    assert_eq!(
        lifecycle,
        [
            (true, generations[0]),
            (false, generations[0]),
            (true, generations[1])
        ]
    );
}

/// The Node session owns run-id admission, refusal framing and `health_observation_seq`
/// stamping: a run id is admitted once while in progress (again after its terminal), a refusal
/// is one terminal of the right kind, stall evidence and capabilities share one increasing
/// sequence, and nothing is admitted before ready.
#[test]
fn node_session_admits_run_ids_frames_refusals_and_stamps_evidence() {
    use iop_wire::node::{RunRefusal, StreamKind};
    use iop_wire::runtime::{
        Capability, ExecutionFailure, FailureEvidence, Fence, HealthEvidence, ProviderStatus,
        TunnelFrame, TunnelPayload,
    };
    let mut h = Harness::new();
    let unready = h.connect("node-2", Some("node-2"), false);
    assert_eq!(
        h.links[unready].node.admit_run("r"),
        Err(RunRefusal::NotReady)
    );
    let i = h.connect("node-1", Some("node-1"), true);
    let (_, generation) = h.edge.ready_generation("node-1").unwrap();
    let node = &mut h.links[i].node;
    assert_eq!(node.admit_run("r1"), Ok(()));
    assert_eq!(node.admit_run("r1"), Err(RunRefusal::DuplicateRunId));
    assert_eq!(node.active_runs(), 1);
    node.run_finished("r1");
    assert_eq!(node.admit_run("r1"), Ok(()));

    let now = h.now;
    let node = &mut h.links[i].node;
    node.refuse(now, 1, StreamKind::Run, "unknown adapter")
        .unwrap();
    node.refuse(now, 2, StreamKind::Tunnel, "adapter capacity exhausted")
        .unwrap();
    let evidence = || {
        FailureEvidence::Valid(ExecutionFailure {
            health: HealthEvidence::Unavailable,
            idle_duration: Duration::from_secs(1),
            run_id: "r1".into(),
            attempt_id: "a".into(),
            fence: Fence::Unconfirmed,
            adapter: "a".into(),
            target: "t".into(),
            health_observation_seq: None,
        })
    };
    let mut ev = RunEvent::new(RunEventKind::Error);
    ev.execution_failure = Some(evidence());
    node.send_stamped(
        now,
        RuntimeFrame::on_stream(3, RuntimeMessage::RunEvent(ev)),
    )
    .unwrap();
    let cap = Capability {
        adapter_key: "a".into(),
        target: "t".into(),
        provider_status: ProviderStatus::Available,
        health_observation_seq: 0,
        adapter: "demo".into(),
        instance_key: "a".into(),
    };
    node.send_capabilities(now, 9, vec![cap.clone(), cap])
        .unwrap();
    let tunnel_error = TunnelFrame {
        sequence: 4,
        payload: TunnelPayload::Error {
            error: "stalled".into(),
            execution_failure: Some(evidence()),
        },
        metadata: Default::default(),
    };
    node.send_stamped(
        now,
        RuntimeFrame::on_stream(4, RuntimeMessage::ProviderTunnelFrame(tunnel_error)),
    )
    .unwrap();
    h.settle();
    let frames: Vec<RuntimeFrame> = h
        .take_edge_events()
        .into_iter()
        .filter_map(|e| match e {
            RegistryEvent::Frame {
                frame,
                generation: g,
                ..
            } if g == generation => Some(frame),
            _ => None,
        })
        .collect();
    assert_eq!(frames.len(), 5, "{frames:?}");
    assert!(matches!(&frames[0].message, RuntimeMessage::RunEvent(e)
        if e.kind == RunEventKind::Error && e.error == "unknown adapter"));
    assert!(
        matches!(&frames[1].message, RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
        sequence: 1,
        payload: TunnelPayload::Error { error, execution_failure: None },
        ..
    }) if error == "adapter capacity exhausted")
    );
    let seq_of = |f: &RuntimeFrame| -> Vec<u64> {
        match &f.message {
            RuntimeMessage::RunEvent(e) => match &e.execution_failure {
                Some(FailureEvidence::Valid(x)) => x.health_observation_seq.into_iter().collect(),
                _ => vec![],
            },
            RuntimeMessage::NodeCommandResponse(r) => r
                .capabilities
                .iter()
                .map(|c| c.health_observation_seq)
                .collect(),
            RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                payload:
                    TunnelPayload::Error {
                        execution_failure: Some(FailureEvidence::Valid(x)),
                        ..
                    },
                ..
            }) => x.health_observation_seq.into_iter().collect(),
            _ => vec![],
        }
    };
    let seqs: Vec<u64> = frames[2..].iter().flat_map(seq_of).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4], "one increasing sequence");
}

/// Seed 000: `health_observation_seq` is connection-scoped. An unbound (not ready) session
/// stamps nothing; a ready one counts from one; a new connection of the same Node counts from
/// one again, however far the previous one got.
#[test]
fn health_observation_seq_restarts_at_one_per_connection_and_is_omitted_unbound() {
    let mut h = Harness::new();
    let unbound = h.connect("node-2", Some("node-2"), false);
    assert_eq!(h.links[unbound].node.next_health_observation_seq(), None);
    assert_eq!(h.links[unbound].node.next_health_observation_seq(), None);
    let i = h.connect("node-1", Some("node-1"), true);
    assert_eq!(h.links[i].node.next_health_observation_seq(), Some(1));
    assert_eq!(h.links[i].node.next_health_observation_seq(), Some(2));
    assert_eq!(h.links[i].node.next_health_observation_seq(), Some(3));
    // The Node reconnects (the new connection supersedes the old): its own sequence.
    let j = h.connect("node-1", Some("node-1"), true);
    assert!(h.edge.ready_generation("node-1").is_some());
    assert_eq!(h.links[j].node.next_health_observation_seq(), Some(1));
}
