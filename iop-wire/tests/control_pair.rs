//! The seed 001 session machines against each other in virtual time: `EdgeControlSession` and
//! `ControlPlaneSession` exchange encoded frames; no sockets, no sleeps. Each test names the
//! rule it checks.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;
use common::{binding, config, projection};

use std::time::{Duration, Instant};

use bytes::BytesMut;
use iop_wire::codec::FrameCodec;
use iop_wire::control::{
    AcquireLeaseRequest, AcquireLeaseResponse, ControlFrame, ControlMessage, EdgeCommandRequest,
    EdgeCommandResponse, EdgeHelloRequest, EdgeStatusResponse, EdgeUsageAck, EdgeUsageReport,
    PrincipalProjection, UsageRecord,
};
use iop_wire::control_session::{
    ControlCloseReason, ControlPlaneEvent, ControlPlaneSession, ControlSessionError,
    EdgeControlEvent, EdgeControlSession,
};

struct Pair {
    now: Instant,
    codec: FrameCodec,
    edge: EdgeControlSession,
    cp: ControlPlaneSession,
    edge_events: Vec<EdgeControlEvent>,
    cp_events: Vec<ControlPlaneEvent>,
    /// Frames from the Edge are lost (a half-dead link).
    edge_mute: bool,
}

fn command() -> EdgeCommandRequest {
    EdgeCommandRequest {
        command_id: "c1".into(),
        operation: "recover".into(),
        ..Default::default()
    }
}

fn command_response() -> EdgeCommandResponse {
    EdgeCommandResponse {
        command_id: "c1".into(),
        ok: true,
        ..Default::default()
    }
}

fn status() -> EdgeStatusResponse {
    EdgeStatusResponse {
        edge_id: "edge-1".into(),
        nodes: Vec::new(),
    }
}

impl Pair {
    fn new(edge_id: &str, cert_name: &str, managed: bool, held: u64) -> Self {
        let now = Instant::now();
        let hello = EdgeHelloRequest {
            edge_id: edge_id.into(),
            version: "test".into(),
            managed,
            metadata: Default::default(),
        };
        let mut p = Self {
            now,
            codec: FrameCodec::new(),
            edge: EdgeControlSession::new(config(), hello, held, now),
            cp: ControlPlaneSession::new(config(), Some(cert_name.into()), now),
            edge_events: Vec::new(),
            cp_events: Vec::new(),
            edge_mute: false,
        };
        p.settle();
        p
    }

    fn wire(&self, frame: &ControlFrame) -> ControlFrame {
        let mut buf = BytesMut::new();
        self.codec.encode(frame, &mut buf).unwrap();
        self.codec.decode(&mut buf).unwrap().unwrap()
    }

    fn settle(&mut self) {
        loop {
            let mut moved = false;
            while let Some(f) = self.edge.poll_transmit() {
                moved = true;
                if !self.edge_mute {
                    let f = self.wire(&f);
                    self.cp.handle_frame(self.now, f);
                }
            }
            while let Some(f) = self.cp.poll_transmit() {
                moved = true;
                let f = self.wire(&f);
                self.edge.handle_frame(self.now, f);
            }
            while let Some(e) = self.edge.poll_event() {
                moved = true;
                self.edge_events.push(e);
            }
            while let Some(e) = self.cp.poll_event() {
                moved = true;
                self.cp_events.push(e);
            }
            if !moved {
                break;
            }
        }
    }

    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            let next = [self.edge.poll_timeout(), self.cp.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            match next {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.edge.handle_timeout(self.now);
                    self.cp.handle_timeout(self.now);
                    self.settle();
                }
                _ => break,
            }
        }
        self.now = end;
    }

    /// Answers the hello as the Control Plane's driver would.
    fn accept(&mut self, p: Option<PrincipalProjection>) {
        assert!(matches!(
            self.cp_events.as_slice(),
            [ControlPlaneEvent::Hello(_)]
        ));
        self.cp_events.clear();
        self.cp.accept(self.now, p);
        self.settle();
    }
}

/// Identity agreement: a hello naming another Edge than the certificate is refused by the
/// machine itself (the driver never sees it) and both ends close.
#[test]
fn a_hello_that_disagrees_with_the_certificate_is_refused() {
    let p = Pair::new("edge-2", "edge-1", true, 0);
    assert!(matches!(
        p.cp_events.as_slice(),
        [ControlPlaneEvent::Closed(ControlCloseReason::Rejected(_))]
    ));
    assert!(matches!(
        p.edge_events.as_slice(),
        [EdgeControlEvent::Closed(ControlCloseReason::Rejected(r))] if r.contains("certificate")
    ));
    assert!(p.edge.poll_timeout().is_none() && p.cp.poll_timeout().is_none());
}

/// Projection generations only move forward: the hello's projection is installed when newer
/// than the one held across reconnects; a stale push is answered with the held generation and
/// changes nothing; the Control Plane never pushes backwards on a session.
#[test]
fn projection_generations_only_move_forward() {
    // Reconnect holding generation 5: the hello carries 5 (the same): nothing installed.
    let mut p = Pair::new("edge-1", "edge-1", true, 5);
    p.accept(Some(projection(5)));
    assert!(matches!(
        p.edge_events.as_slice(),
        [EdgeControlEvent::Connected { heartbeat }] if *heartbeat == Duration::from_secs(5)
    ));
    p.edge_events.clear();
    // A first session: the hello's projection comes before "connected".
    let mut first = Pair::new("edge-1", "edge-1", true, 0);
    first.accept(Some(projection(2)));
    assert!(matches!(
        first.edge_events.as_slice(),
        [EdgeControlEvent::Projection(x), EdgeControlEvent::Connected { .. }] if x.generation == 2
    ));
    // A push of 7 is installed and acknowledged.
    assert!(
        p.cp.push_projection(p.now, projection(7))
            .unwrap()
            .is_some()
    );
    p.settle();
    assert!(
        matches!(p.edge_events.as_slice(), [EdgeControlEvent::Projection(x)] if x.generation == 7)
    );
    assert!(matches!(
        p.cp_events.as_slice(),
        [ControlPlaneEvent::ProjectionAnswered { pushed: 7, answer }] if answer.accepted && answer.generation == 7
    ));
    assert_eq!(p.edge.projection_generation(), 7);
    // The CP will not push 6 or 7 again on this session.
    assert_eq!(p.cp.push_projection(p.now, projection(6)).unwrap(), None);
    assert_eq!(p.cp.push_projection(p.now, projection(7)).unwrap(), None);
    // An Edge that sees a stale push (a buggy or replayed CP frame) keeps what it holds.
    p.edge_events.clear();
    p.edge.handle_frame(
        p.now,
        ControlFrame::correlated(
            99,
            ControlMessage::PrincipalProjectionApplyRequest(projection(3)),
        ),
    );
    let answer = p.edge.poll_transmit().unwrap();
    assert!(matches!(
        answer.message,
        ControlMessage::PrincipalProjectionApplyResponse(r) if !r.accepted && r.generation == 7
    ));
    assert!(p.edge.poll_event().is_none());
    assert_eq!(p.edge.projection_generation(), 7);
}

/// A managed Edge refuses a hello accepted without a projection.
#[test]
fn a_managed_edge_needs_a_projection_in_the_hello() {
    let mut p = Pair::new("edge-1", "edge-1", true, 0);
    p.accept(None);
    assert!(matches!(
        p.edge_events.as_slice(),
        [EdgeControlEvent::Closed(
            ControlCloseReason::MissingProjection
        )]
    ));
}

/// Lease request/answer matching, and every pending request fails in the step that closes the
/// session.
#[test]
fn lease_answers_are_matched_and_pending_requests_fail_on_close() {
    let mut p = Pair::new("edge-1", "edge-1", true, 0);
    p.accept(Some(projection(1)));
    p.edge_events.clear();
    let req = AcquireLeaseRequest {
        binding: binding(1),
        recipient_public_key: [7; 32],
        trace: None,
    };
    let a = p.edge.acquire_lease(p.now, req.clone()).unwrap();
    let b = p.edge.acquire_lease(p.now, req).unwrap();
    p.settle();
    let ids: Vec<u64> = p
        .cp_events
        .drain(..)
        .filter_map(|e| match e {
            ControlPlaneEvent::LeaseRequested { id, .. } => Some(id),
            _ => None,
        })
        .collect();
    assert_eq!(ids, vec![a, b]);
    // Answer b only (and an answer to nothing, which is dropped).
    let refused = |r: &str| AcquireLeaseResponse::Refused { reason: r.into() };
    p.cp.respond_lease(p.now, b, refused("stale_generation"))
        .unwrap();
    p.cp.respond_lease(p.now, 12345, refused("nobody")).unwrap();
    p.settle();
    assert_eq!(
        p.edge_events,
        vec![EdgeControlEvent::LeaseAnswered {
            ticket: b,
            result: Ok(refused("stale_generation")),
        }]
    );
    p.edge_events.clear();
    // The link dies: `a` fails in the same step as the close.
    p.edge.handle_transport_closed();
    p.settle();
    assert_eq!(
        p.edge_events,
        vec![
            EdgeControlEvent::LeaseAnswered {
                ticket: a,
                result: Err(ControlSessionError::Closed),
            },
            EdgeControlEvent::Closed(ControlCloseReason::TransportClosed),
        ]
    );
    assert_eq!(
        p.edge.acquire_lease(
            p.now,
            AcquireLeaseRequest {
                binding: binding(1),
                recipient_public_key: [0; 32],
                trace: None,
            }
        ),
        Err(ControlSessionError::NotConnected)
    );
}

/// Status and command correlation: an answer completes only a request of its own kind.
#[test]
fn status_and_command_answers_are_matched_by_kind() {
    let mut p = Pair::new("edge-1", "edge-1", false, 0);
    p.accept(None);
    p.edge_events.clear();
    let s = p.cp.status(p.now).unwrap();
    let c = p.cp.command(p.now, command()).unwrap();
    p.settle();
    assert!(matches!(
        p.edge_events.as_slice(),
        [EdgeControlEvent::StatusRequested { id }, EdgeControlEvent::CommandRequested { id: id2, .. }]
            if *id == s && *id2 == c
    ));
    // Crossed answers: nothing matches.
    p.edge.respond_status(p.now, c, status()).unwrap();
    p.edge
        .respond_command(p.now, s, command_response())
        .unwrap();
    p.settle();
    assert!(p.cp_events.is_empty(), "{:?}", p.cp_events);
    p.edge.respond_status(p.now, s, status()).unwrap();
    p.settle();
    assert!(matches!(
        p.cp_events.as_slice(),
        [ControlPlaneEvent::StatusAnswered { ticket, result: Ok(_) }] if *ticket == s
    ));
    p.cp_events.clear();
    // Progress of the pending command reaches it; progress naming anything else does not.
    let ev = iop_wire::control::EdgeCommandEvent {
        command_id: "c1".into(),
        phase: "accepted".into(),
        message: String::new(),
        metadata: Default::default(),
    };
    p.edge.command_event(p.now, c, ev.clone()).unwrap();
    p.edge.command_event(p.now, s, ev.clone()).unwrap();
    p.settle();
    assert_eq!(
        p.cp_events,
        vec![ControlPlaneEvent::CommandEvent {
            ticket: c,
            event: ev
        }]
    );
    p.cp_events.clear();
    // The command is still pending; the session closes: it fails, once.
    p.cp.close_local();
    assert!(matches!(
        p.cp.poll_event(),
        Some(ControlPlaneEvent::CommandAnswered { ticket, result: Err(ControlSessionError::Closed) }) if ticket == c
    ));
    assert!(matches!(
        p.cp.poll_event(),
        Some(ControlPlaneEvent::Closed(ControlCloseReason::Local))
    ));
    assert!(p.cp.poll_event().is_none());
}

/// One silence rule on both ends: pings keep an idle session alive for as long as both talk;
/// when the Edge's frames stop arriving, the Control Plane closes after three heartbeats, and
/// the hello must complete within the handshake timeout.
#[test]
fn heartbeats_keep_sessions_alive_and_silence_closes_them_in_virtual_time() {
    let mut p = Pair::new("edge-1", "edge-1", false, 0);
    p.accept(None);
    p.advance(Duration::from_secs(120));
    assert!(
        p.edge.is_connected() && p.cp.is_connected(),
        "idle but alive"
    );
    p.edge_mute = true;
    p.advance(Duration::from_secs(14));
    assert!(p.cp.is_connected(), "not before three heartbeats");
    p.advance(Duration::from_secs(2));
    assert!(
        p.cp_events
            .contains(&ControlPlaneEvent::Closed(ControlCloseReason::Silent))
    );

    // A hello nobody answers.
    let mut q = Pair::new("edge-1", "edge-1", false, 0);
    q.advance(Duration::from_millis(9_999));
    assert!(
        !q.edge_events
            .iter()
            .any(|e| matches!(e, EdgeControlEvent::Closed(_)))
    );
    q.advance(Duration::from_millis(2));
    assert!(q.edge_events.contains(&EdgeControlEvent::Closed(
        ControlCloseReason::HandshakeTimeout
    )));
    assert!(q.cp_events.contains(&ControlPlaneEvent::Closed(
        ControlCloseReason::HandshakeTimeout
    )));
}

/// Out-of-place messages are protocol violations: a request before the hello completed, a
/// second hello.
#[test]
fn out_of_place_messages_close_the_session() {
    let now = Instant::now();
    let mut cp = ControlPlaneSession::new(config(), Some("edge-1".into()), now);
    cp.handle_frame(
        now,
        ControlFrame::correlated(
            3,
            ControlMessage::AcquireLeaseRequest(AcquireLeaseRequest {
                binding: binding(1),
                recipient_public_key: [0; 32],
                trace: None,
            }),
        ),
    );
    assert!(matches!(
        cp.poll_event(),
        Some(ControlPlaneEvent::Closed(
            ControlCloseReason::ProtocolViolation(_)
        ))
    ));
    let mut p = Pair::new("edge-1", "edge-1", false, 0);
    p.accept(None);
    p.cp.handle_frame(
        p.now,
        ControlFrame::correlated(
            9,
            ControlMessage::EdgeHelloRequest(EdgeHelloRequest {
                edge_id: "edge-1".into(),
                ..Default::default()
            }),
        ),
    );
    p.settle();
    assert!(matches!(
        p.cp_events.last(),
        Some(ControlPlaneEvent::Closed(
            ControlCloseReason::ProtocolViolation(_)
        ))
    ));
}

fn usage_report(n: usize) -> EdgeUsageReport {
    EdgeUsageReport {
        records: (0..n)
            .map(|i| UsageRecord {
                request_id: format!("req-a-{i}"),
                principal_id: "p-1".into(),
                model: "m".into(),
                outcome: "completed".into(),
                ..UsageRecord::default()
            })
            .collect(),
    }
}

/// Usage records go only to a Control Plane that said it takes them; its acknowledgement
/// reaches the report it answers, and a report pending at the close fails with the others.
#[test]
fn usage_reports_only_where_accepted_and_acked_or_failed() {
    // A Control Plane that did not opt in (as an older one): the Edge does not send.
    let mut p = Pair::new("edge-1", "edge-1", false, 0);
    p.accept(None);
    assert!(!p.edge.accepts_usage());
    assert_eq!(
        p.edge.report_usage(p.now, usage_report(1)),
        Err(ControlSessionError::UsageNotAccepted)
    );
    // An Edge that sends one anyway breaks the protocol.
    let mut rogue = Pair::new("edge-1", "edge-1", false, 0);
    rogue.accept(None);
    rogue.cp.handle_frame(
        rogue.now,
        ControlFrame::correlated(9, ControlMessage::EdgeUsageReport(usage_report(1))),
    );
    rogue.settle();
    assert!(rogue.cp_events.iter().any(|e| matches!(
        e,
        ControlPlaneEvent::Closed(ControlCloseReason::ProtocolViolation(_))
    )));

    let mut p = Pair::new("edge-1", "edge-1", false, 0);
    p.cp.accept_usage();
    p.accept(None);
    assert!(p.edge.accepts_usage());
    p.edge_events.clear();
    let a = p.edge.report_usage(p.now, usage_report(2)).unwrap();
    let b = p.edge.report_usage(p.now, usage_report(1)).unwrap();
    p.settle();
    let reports: Vec<(u64, usize)> = p
        .cp_events
        .drain(..)
        .filter_map(|e| match e {
            ControlPlaneEvent::UsageReported { id, report } => Some((id, report.records.len())),
            _ => None,
        })
        .collect();
    assert_eq!(reports, vec![(a, 2), (b, 1)]);
    let ack = EdgeUsageAck {
        stored: 2,
        duplicates: 0,
    };
    p.cp.respond_usage(p.now, a, ack).unwrap();
    // An acknowledgement of nothing is dropped.
    p.cp.respond_usage(p.now, 4242, ack).unwrap();
    p.settle();
    assert_eq!(
        p.edge_events,
        vec![EdgeControlEvent::UsageAcked {
            ticket: a,
            result: Ok(ack),
        }]
    );
    p.edge_events.clear();
    p.edge.handle_transport_closed();
    p.settle();
    assert_eq!(
        p.edge_events,
        vec![
            EdgeControlEvent::UsageAcked {
                ticket: b,
                result: Err(ControlSessionError::Closed),
            },
            EdgeControlEvent::Closed(ControlCloseReason::TransportClosed),
        ]
    );
    assert!(!p.edge.accepts_usage());
}
