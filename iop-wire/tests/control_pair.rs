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
    PrincipalProjection, ProjectionTooLarge, UsageRecord,
};
use iop_wire::control_session::{
    ControlCloseReason, ControlPlaneEvent, ControlPlaneSession, ControlSessionError,
    EdgeControlEvent, EdgeControlSession,
};

struct Pair {
    now: Instant,
    /// What the Control Plane reads (fails on a larger frame from the Edge).
    to_cp: FrameCodec,
    /// What the Edge reads.
    to_edge: FrameCodec,
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
        omitted_nodes: 0,
    }
}

impl Pair {
    fn new(edge_id: &str, cert_name: &str, managed: bool, held: u64) -> Self {
        Self::with_frames(edge_id, cert_name, managed, held, config().max_frame_len)
    }

    /// Both ends (and the codec between them, which fails on a larger frame) limited to frames
    /// of `max_frame_len` bytes.
    fn with_frames(
        edge_id: &str,
        cert_name: &str,
        managed: bool,
        held: u64,
        max_frame_len: usize,
    ) -> Self {
        Self::with_limits(
            edge_id,
            cert_name,
            managed,
            held,
            max_frame_len,
            max_frame_len,
        )
    }

    /// The Edge reads and writes frames of at most `edge_frames` bytes, the Control Plane of
    /// `cp_frames`; the codec each way fails on a frame larger than its reader takes.
    fn with_limits(
        edge_id: &str,
        cert_name: &str,
        managed: bool,
        held: u64,
        edge_frames: usize,
        cp_frames: usize,
    ) -> Self {
        let config = |max_frame_len| iop_wire::control_session::ControlSessionConfig {
            max_frame_len,
            ..config()
        };
        let now = Instant::now();
        let hello = EdgeHelloRequest {
            edge_id: edge_id.into(),
            version: "test".into(),
            managed,
            metadata: Default::default(),
            ..EdgeHelloRequest::default()
        };
        let mut p = Self {
            now,
            to_cp: FrameCodec::with_max_frame_len(cp_frames),
            to_edge: FrameCodec::with_max_frame_len(edge_frames),
            edge: EdgeControlSession::new(config(edge_frames), hello, held, now),
            cp: ControlPlaneSession::new(config(cp_frames), Some(cert_name.into()), now),
            edge_events: Vec::new(),
            cp_events: Vec::new(),
            edge_mute: false,
        };
        p.settle();
        p
    }

    fn wire(codec: &FrameCodec, frame: &ControlFrame) -> ControlFrame {
        let mut buf = BytesMut::new();
        codec.encode(frame, &mut buf).unwrap();
        codec.decode(&mut buf).unwrap().unwrap()
    }

    fn settle(&mut self) {
        loop {
            let mut moved = false;
            while let Some(f) = self.edge.poll_transmit() {
                moved = true;
                if !self.edge_mute {
                    let f = Self::wire(&self.to_cp, &f);
                    self.cp.handle_frame(self.now, f);
                }
            }
            while let Some(f) = self.cp.poll_transmit() {
                moved = true;
                let f = Self::wire(&self.to_edge, &f);
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
        self.cp.accept(self.now, p).expect("fits");
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

/// A projection of `n` principals, each with a token and a route, naming issuer keys.
fn large_projection(generation: u64, n: usize) -> PrincipalProjection {
    use iop_wire::control::{ProjectedPrincipal, ProjectedRoute, ProjectedToken};
    PrincipalProjection {
        generation,
        principals: (0..n)
            .map(|i| ProjectedPrincipal {
                principal_id: format!("principal-{i}"),
                display_name: format!("Team number {i}"),
                enabled: i % 7 != 0,
                limits: None,
            })
            .collect(),
        tokens: (0..n)
            .map(|i| ProjectedToken {
                token_id: format!("token-{i}"),
                principal_id: format!("principal-{i}"),
                sha256_digest: [u8::try_from(i % 256).unwrap(); 32],
            })
            .collect(),
        routes: (0..n)
            .map(|i| ProjectedRoute {
                route_id: format!("route-{i}"),
                principal_id: format!("principal-{i}"),
                model: "gpt-4o-mini".into(),
                slot_id: format!("slot-{}", i % 10),
                profile: "openai".into(),
                upstream_target: "gpt-4o-mini-2024-07-18".into(),
                selector: String::new(),
                route_revision: 3,
                credential_revision: 4,
            })
            .collect(),
        issuer_key_id: "p256:0011223344556677".into(),
        staged_issuer_key_id: "p256:8899aabbccddeeff".into(),
        staged_issuer_activates_at_unix_ms: 1_780_000_000_000,
        parts_before: 0,
    }
}

const SMALL_FRAME: usize = 16 * 1024;

/// A projection larger than a frame goes in parts (every frame within the limit: the pair's
/// codec fails on a larger one) and the Edge installs it whole, from the hello and from a push.
#[test]
fn a_projection_larger_than_a_frame_is_sent_in_parts_and_installed_whole() {
    let first = large_projection(2, 400);
    let second = large_projection(3, 700);
    assert!(first.encoded_len() > 4 * SMALL_FRAME);
    let mut p = Pair::with_frames("edge-1", "edge-1", true, 0, SMALL_FRAME);
    p.accept(Some(first.clone()));
    match p.edge_events.as_slice() {
        [
            EdgeControlEvent::Projection(x),
            EdgeControlEvent::Connected { .. },
        ] => assert!(*x == first, "installed whole and equal"),
        other => panic!("{other:?}"),
    }
    p.edge_events.clear();
    assert!(
        p.cp.push_projection(p.now, second.clone())
            .unwrap()
            .is_some()
    );
    p.settle();
    assert!(matches!(p.edge_events.as_slice(), [EdgeControlEvent::Projection(x)] if *x == second));
    assert!(matches!(
        p.cp_events.as_slice(),
        [ControlPlaneEvent::ProjectionAnswered { pushed: 3, answer }] if answer.accepted && answer.generation == 3
    ));
    assert_eq!(p.edge.projection_generation(), 3);
    assert!(p.edge.is_connected() && p.cp.is_connected());
}

/// How a projection is cut: whole entries in order, the generation on every part, the index in
/// `parts_before`, the issuer fields on the last; every part within the frame with the
/// envelope around it; an entry larger than a frame is an error, not a frame that fails.
#[test]
fn a_projection_is_cut_into_frames_of_whole_entries() {
    let whole = large_projection(9, 500);
    assert_eq!(
        whole.clone().into_parts(1 << 20).unwrap(),
        vec![whole.clone()]
    );
    let parts = whole.clone().into_parts(SMALL_FRAME).unwrap();
    assert!(parts.len() > 4, "{}", parts.len());
    let codec = FrameCodec::with_max_frame_len(SMALL_FRAME);
    let mut joined = PrincipalProjection::default();
    for (i, part) in parts.iter().enumerate() {
        assert_eq!(part.generation, 9);
        assert_eq!(part.parts_before as usize, i);
        let last = i == parts.len() - 1;
        assert_eq!(part.issuer_key_id.is_empty(), !last);
        let frame = if last {
            ControlMessage::PrincipalProjectionApplyRequest(part.clone())
        } else {
            ControlMessage::PrincipalProjectionPart(part.clone())
        };
        let mut buf = BytesMut::new();
        codec
            .encode(&ControlFrame::correlated(u64::MAX, frame), &mut buf)
            .expect("each part fits a frame");
        joined.principals.extend(part.principals.iter().cloned());
        joined.tokens.extend(part.tokens.iter().cloned());
        joined.routes.extend(part.routes.iter().cloned());
    }
    assert_eq!(joined.principals, whole.principals);
    assert_eq!(joined.tokens, whole.tokens);
    assert_eq!(joined.routes, whole.routes);
    let mut one_large = whole;
    one_large.principals[3].display_name = "x".repeat(4000);
    let Err(err) = one_large.into_parts(4096) else {
        panic!("an entry larger than a frame")
    };
    assert!(
        matches!(err, ProjectionTooLarge::Entry { len, max_frame_len: 4096 } if len > 4000),
        "{err:?}"
    );
}

/// The hello of a managed Edge older than projection parts (it says nothing of them), handled.
fn older_hello(cp: &mut ControlPlaneSession, now: Instant) {
    cp.handle_frame(
        now,
        ControlFrame::correlated(
            1,
            ControlMessage::EdgeHelloRequest(EdgeHelloRequest {
                edge_id: "edge-1".into(),
                managed: true,
                ..Default::default()
            }),
        ),
    );
    assert!(matches!(cp.poll_event(), Some(ControlPlaneEvent::Hello(_))));
}

/// An Edge that does not take parts (an older one: its hello does not say so) is never sent a
/// projection larger than a frame: its hello is refused with a reason that says why, and a
/// push that grew too large closes the session with the sizes.
#[test]
fn an_edge_that_does_not_take_parts_is_refused_not_sent_a_frame_it_cannot_read() {
    let now = Instant::now();
    let small = iop_wire::control_session::ControlSessionConfig {
        max_frame_len: SMALL_FRAME,
        ..config()
    };
    let mut cp = ControlPlaneSession::new(small, Some("edge-1".into()), now);
    older_hello(&mut cp, now);
    let err = cp.accept(now, Some(large_projection(2, 400))).unwrap_err();
    assert!(
        matches!(err, ProjectionTooLarge::Whole { len, max_frame_len: SMALL_FRAME } if len > SMALL_FRAME),
        "{err:?}"
    );
    match cp.poll_transmit().map(|f| f.message) {
        Some(ControlMessage::EdgeHelloResponse(
            iop_wire::control::EdgeHelloResponse::Rejected { reason },
        )) => assert!(reason.contains("does not take it in parts"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(cp.poll_transmit().is_none(), "no part was sent");
    assert!(matches!(
        cp.poll_event(),
        Some(ControlPlaneEvent::Closed(ControlCloseReason::Rejected(_)))
    ));
    // Accepted with a small projection; then one too large to push.
    let mut cp = ControlPlaneSession::new(small, Some("edge-1".into()), now);
    older_hello(&mut cp, now);
    cp.accept(now, Some(large_projection(2, 10))).unwrap();
    assert!(cp.poll_transmit().is_some());
    assert!(matches!(
        cp.push_projection(now, large_projection(3, 400)),
        Err(ControlSessionError::ProjectionTooLarge(
            ProjectionTooLarge::Whole { .. }
        ))
    ));
    assert!(cp.poll_transmit().is_none(), "nothing of it was sent");
    assert!(matches!(
        cp.poll_event(),
        Some(ControlPlaneEvent::Closed(
            ControlCloseReason::ProjectionTooLarge(ProjectionTooLarge::Whole {
                max_frame_len: SMALL_FRAME,
                ..
            })
        ))
    ));
    // The Edge's own limit counts too: one that reads frames of 16 KiB is cut for 16 KiB by a
    // Control Plane allowed 8 MiB.
    let mut p = Pair::with_limits(
        "edge-1",
        "edge-1",
        true,
        0,
        SMALL_FRAME,
        config().max_frame_len,
    );
    let large = large_projection(2, 400);
    p.accept(Some(large.clone()));
    assert!(matches!(p.edge_events.first(), Some(EdgeControlEvent::Projection(x)) if *x == large));
}

/// The Edge installs the parts of one projection, in order, with the message that completes
/// them, or closes: nothing of an incomplete or mixed projection is ever installed.
#[test]
fn the_edge_installs_a_whole_projection_or_nothing() {
    let parts = large_projection(5, 300).into_parts(SMALL_FRAME).unwrap();
    assert!(parts.len() >= 3);
    let last = parts.len() - 1;
    let part =
        |i: usize| ControlFrame::new(ControlMessage::PrincipalProjectionPart(parts[i].clone()));
    let apply = |p: PrincipalProjection| {
        ControlFrame::correlated(7, ControlMessage::PrincipalProjectionApplyRequest(p))
    };
    // A connected managed Edge holding generation 1.
    let connected = || {
        let mut p = Pair::new("edge-1", "edge-1", true, 0);
        p.accept(Some(projection(1)));
        p.edge_events.clear();
        p
    };
    let closes_with = |p: &mut Pair, rule: &str| {
        let mut events = Vec::new();
        while let Some(e) = p.edge.poll_event() {
            events.push(e);
        }
        assert!(
            matches!(events.as_slice(), [EdgeControlEvent::Closed(ControlCloseReason::ProtocolViolation(r))] if *r == rule),
            "{events:?}"
        );
        assert_eq!(p.edge.projection_generation(), 1, "nothing installed");
    };
    // In order: installed whole.
    let mut p = connected();
    for i in 0..last {
        p.edge.handle_frame(p.now, part(i));
    }
    p.edge.handle_frame(p.now, apply(parts[last].clone()));
    assert!(
        matches!(p.edge.poll_event(), Some(EdgeControlEvent::Projection(x)) if x == large_projection(5, 300))
    );
    // A part out of order.
    let mut p = connected();
    p.edge.handle_frame(p.now, part(1));
    closes_with(&mut p, "projection part out of order");
    let mut p = connected();
    p.edge.handle_frame(p.now, part(0));
    p.edge.handle_frame(p.now, part(2));
    closes_with(&mut p, "projection part out of order");
    // A part of another generation.
    let mut p = connected();
    p.edge.handle_frame(p.now, part(0));
    let mut other = parts[1].clone();
    other.generation = 6;
    p.edge.handle_frame(
        p.now,
        ControlFrame::new(ControlMessage::PrincipalProjectionPart(other)),
    );
    closes_with(&mut p, "projection part out of order");
    // Completed with a part missing, or claiming another count.
    let mut p = connected();
    for i in 0..last - 1 {
        p.edge.handle_frame(p.now, part(i));
    }
    p.edge.handle_frame(p.now, apply(parts[last].clone()));
    closes_with(&mut p, "projection completed without its parts");
    // Completed by a projection of another generation.
    let mut p = connected();
    for i in 0..last {
        p.edge.handle_frame(p.now, part(i));
    }
    let mut other = parts[last].clone();
    other.generation = 6;
    p.edge.handle_frame(p.now, apply(other));
    closes_with(&mut p, "projection completed without its parts");
    // A whole projection while parts are pending.
    let mut p = connected();
    p.edge.handle_frame(p.now, part(0));
    p.edge.handle_frame(p.now, apply(projection(6)));
    closes_with(
        &mut p,
        "a whole projection while parts of another are pending",
    );
    // The hello's projection completes parts the same way.
    let mut p = Pair::new("edge-1", "edge-1", true, 0);
    assert!(matches!(
        p.cp_events.as_slice(),
        [ControlPlaneEvent::Hello(_)]
    ));
    p.edge.handle_frame(p.now, part(0));
    p.edge.handle_frame(
        p.now,
        ControlFrame::correlated(
            1,
            ControlMessage::EdgeHelloResponse(iop_wire::control::EdgeHelloResponse::Accepted {
                projection: Some(parts[last].clone()),
                heartbeat_interval_ms: None,
                accepts_usage: false,
                max_frame_len: 0,
            }),
        ),
    );
    let events: Vec<_> = std::iter::from_fn(|| p.edge.poll_event()).collect();
    assert!(
        matches!(
            events.as_slice(),
            [EdgeControlEvent::Closed(
                ControlCloseReason::ProtocolViolation("projection completed without its parts")
            )]
        ),
        "{events:?}"
    );
    // A legacy Edge takes no parts at all.
    let mut p = Pair::new("edge-1", "edge-1", false, 0);
    p.accept(None);
    p.edge_events.clear();
    p.edge.handle_frame(p.now, part(0));
    assert!(matches!(
        p.edge.poll_event(),
        Some(EdgeControlEvent::Closed(
            ControlCloseReason::ProtocolViolation(_)
        ))
    ));
}

/// The entries the Edge assembles stay within one projection's bound
/// (`MAX_PROJECTION_ENTRIES` per list), however many parts bring them.
#[test]
fn parts_cannot_bring_more_entries_than_one_projection_holds() {
    use iop_wire::control::{MAX_PROJECTION_ENTRIES, ProjectedToken};
    let token = ProjectedToken {
        token_id: "t".into(),
        principal_id: "p".into(),
        sha256_digest: [0; 32],
    };
    let mut p = Pair::new("edge-1", "edge-1", true, 0);
    p.accept(Some(projection(1)));
    p.edge_events.clear();
    let mut full = projection(2);
    full.tokens = vec![token.clone(); MAX_PROJECTION_ENTRIES];
    p.edge.handle_frame(
        p.now,
        ControlFrame::new(ControlMessage::PrincipalProjectionPart(full)),
    );
    assert!(p.edge.poll_event().is_none(), "a full part is taken");
    let mut more = projection(2);
    more.parts_before = 1;
    more.tokens = vec![token];
    p.edge.handle_frame(
        p.now,
        ControlFrame::new(ControlMessage::PrincipalProjectionPart(more)),
    );
    assert!(matches!(
        p.edge.poll_event(),
        Some(EdgeControlEvent::Closed(
            ControlCloseReason::ProtocolViolation(
                "projection parts exceed the entries of one projection"
            )
        ))
    ));
}

/// With the default 8 MiB frames on both ends, a projection of a few MiB still goes in parts of
/// at most `MAX_PROJECTION_PART_LEN` (1 MiB) to an Edge that takes parts: a Control Plane's
/// buffers per Edge stay that size. An Edge that does not take parts gets it whole.
#[test]
fn parts_are_at_most_a_mebibyte_whatever_the_frame_limit() {
    use iop_wire::control_session::MAX_PROJECTION_PART_LEN;
    let large = large_projection(2, 12_000);
    assert!(large.encoded_len() > 2 * MAX_PROJECTION_PART_LEN);
    let mut p = Pair::new("edge-1", "edge-1", true, 0);
    p.cp_events.clear();
    p.cp.accept(p.now, Some(large.clone())).unwrap();
    let codec = FrameCodec::new();
    let mut frames = 0;
    while let Some(f) = p.cp.poll_transmit() {
        let mut buf = BytesMut::new();
        codec.encode(&f, &mut buf).unwrap();
        assert!(buf.len() <= MAX_PROJECTION_PART_LEN + 4, "{}", buf.len());
        frames += 1;
        p.edge.handle_frame(p.now, f);
    }
    assert!(frames >= 3, "{frames}");
    assert!(matches!(p.edge.poll_event(), Some(EdgeControlEvent::Projection(x)) if x == large));
    // An Edge that does not take parts: whole, in one frame of its limit.
    let now = Instant::now();
    let mut cp = ControlPlaneSession::new(config(), Some("edge-1".into()), now);
    older_hello(&mut cp, now);
    cp.accept(now, Some(large.clone())).unwrap();
    assert!(matches!(
        cp.poll_transmit().map(|f| f.message),
        Some(ControlMessage::EdgeHelloResponse(iop_wire::control::EdgeHelloResponse::Accepted {
            projection: Some(x),
            ..
        })) if x == large
    ));
    assert!(cp.poll_transmit().is_none());
}

/// A hello that brings its projection in many parts is bounded per part, not as a whole: parts
/// that each arrive within the handshake timeout keep the hello alive well past it (a large
/// projection over a slow link), and one timeout of silence between two parts ends it.
#[test]
fn a_hello_in_parts_is_bounded_per_part_not_as_a_whole() {
    let timeout = config().handshake_timeout;
    let parts_of = |p: &mut Pair| {
        p.cp_events.clear();
        p.cp.accept(p.now, Some(large_projection(2, 400))).unwrap();
        let frames: Vec<_> = std::iter::from_fn(|| p.cp.poll_transmit()).collect();
        assert!(frames.len() > 4, "{}", frames.len());
        frames
    };
    let mut p = Pair::with_frames("edge-1", "edge-1", true, 0, SMALL_FRAME);
    let start = p.now;
    for f in parts_of(&mut p) {
        p.now += timeout * 2 / 3;
        p.edge.handle_timeout(p.now);
        let f = Pair::wire(&p.to_edge, &f);
        p.edge.handle_frame(p.now, f);
    }
    assert!(p.now - start > 2 * timeout);
    p.settle();
    assert!(
        matches!(
            p.edge_events.as_slice(),
            [EdgeControlEvent::Projection(x), EdgeControlEvent::Connected { .. }] if x.generation == 2
        ),
        "{:?}",
        p.edge_events
    );

    let mut p = Pair::with_frames("edge-1", "edge-1", true, 0, SMALL_FRAME);
    let first = parts_of(&mut p).swap_remove(0);
    let first = Pair::wire(&p.to_edge, &first);
    p.edge.handle_frame(p.now, first);
    p.now += timeout;
    p.edge.handle_timeout(p.now);
    p.settle();
    assert!(
        matches!(
            p.edge_events.as_slice(),
            [EdgeControlEvent::Closed(
                ControlCloseReason::HandshakeTimeout
            )]
        ),
        "{:?}",
        p.edge_events
    );
}

/// A part with no entries is refused (parts of nothing would cost nothing to hold and never
/// end); the Control Plane never cuts one.
#[test]
fn an_empty_projection_part_closes_the_session() {
    let mut p = Pair::with_frames("edge-1", "edge-1", true, 0, SMALL_FRAME);
    let part = PrincipalProjection {
        generation: 2,
        ..PrincipalProjection::default()
    };
    let part = Pair::wire(
        &p.to_edge,
        &ControlFrame::new(ControlMessage::PrincipalProjectionPart(part)),
    );
    p.edge.handle_frame(p.now, part);
    p.settle();
    assert!(
        matches!(
            p.edge_events.as_slice(),
            [EdgeControlEvent::Closed(ControlCloseReason::ProtocolViolation(r))] if r.contains("empty")
        ),
        "{:?}",
        p.edge_events
    );
}

/// A projection with more entries than an Edge assembles is not sent in parts that the Edge
/// would refuse (closing, reconnecting and being sent the same again): the hello is refused with
/// a reason, and the error names the sizes.
#[test]
fn a_projection_beyond_what_an_edge_assembles_is_refused_not_sent() {
    use iop_wire::control::{MAX_PROJECTION_ENTRIES, ProjectedToken};
    let mut p = Pair::new("edge-1", "edge-1", true, 0);
    p.cp_events.clear();
    let too_many = PrincipalProjection {
        generation: 2,
        tokens: (0..=MAX_PROJECTION_ENTRIES)
            .map(|i| ProjectedToken {
                token_id: i.to_string(),
                principal_id: "p".into(),
                sha256_digest: [0; 32],
            })
            .collect(),
        ..PrincipalProjection::default()
    };
    let err = p.cp.accept(p.now, Some(too_many)).unwrap_err();
    assert!(
        matches!(err, ProjectionTooLarge::Assembly { entries, .. } if entries == MAX_PROJECTION_ENTRIES + 1),
        "{err:?}"
    );
    match p.cp.poll_transmit().map(|f| f.message) {
        Some(ControlMessage::EdgeHelloResponse(
            iop_wire::control::EdgeHelloResponse::Rejected { reason },
        )) => assert!(reason.contains("larger than an edge assembles"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(p.cp.poll_transmit().is_none(), "no part was sent");
}

/// `count` Nodes named `node-00000`…, given in reverse order, each with `providers` provider
/// snapshots and `adapters` adapters.
fn many_nodes(
    count: usize,
    providers: usize,
    adapters: usize,
) -> Vec<iop_wire::control::EdgeNodeSnapshot> {
    (0..count)
        .rev()
        .map(|i| {
            let node_id = format!("node-{i:05}");
            iop_wire::control::EdgeNodeSnapshot {
                provider_snapshots: (0..providers)
                    .map(|k| iop_wire::runtime::ProviderSnapshot {
                        provider_id: format!("provider-{k}"),
                        node_id: node_id.clone(),
                        adapter: "openai-a".into(),
                        target: "gpt-4o-mini".into(),
                        category: "api".into(),
                        status: "available".into(),
                        health: "healthy".into(),
                        capacity: 4,
                        enabled: true,
                        ..Default::default()
                    })
                    .collect(),
                config: iop_wire::control::EdgeNodeConfigSummary {
                    revision: 3,
                    adapters: vec![("openai-a".into(), "openai_compat".into()); adapters],
                },
                node_id,
                connected: true,
                ..Default::default()
            }
        })
        .collect()
}

/// Asks the Edge for its status, answers with `nodes`, and returns what the Control Plane
/// received (through the codec each way, which fails on a frame its reader does not take) and
/// what `respond_status` said it left out.
fn status_through(
    p: &mut Pair,
    nodes: Vec<iop_wire::control::EdgeNodeSnapshot>,
) -> (EdgeStatusResponse, u32) {
    p.edge_events.clear();
    p.cp_events.clear();
    let ticket = p.cp.status(p.now).unwrap();
    p.settle();
    let [EdgeControlEvent::StatusRequested { id }] = p.edge_events.as_slice() else {
        panic!("{:?}", p.edge_events)
    };
    let status = EdgeStatusResponse {
        edge_id: "edge-1".into(),
        nodes,
        omitted_nodes: 0,
    };
    let omitted = p.edge.respond_status(p.now, *id, status).unwrap();
    p.settle();
    let [
        ControlPlaneEvent::StatusAnswered {
            ticket: t,
            result: Ok(answer),
        },
    ] = p.cp_events.as_slice()
    else {
        panic!("{:?}", p.cp_events)
    };
    assert_eq!(*t, ticket);
    assert!(p.edge.is_connected());
    (answer.clone(), omitted)
}

/// An Edge with more Nodes than one frame of the Control Plane's holds answers with the first
/// Nodes in `node_id` order, whole, as many as fit, and counts the rest in `omitted_nodes`:
/// the session stays up, where the whole answer would fail the Control Plane's codec and end
/// the session on every status request. The Edge's own limit is 8 MiB; the Control Plane's,
/// told in its hello answer, is 64 KiB.
#[test]
fn a_status_larger_than_the_control_planes_frame_is_cut_to_whole_nodes() {
    const CP_FRAME: usize = 64 * 1024;
    const NODES: usize = 3000;
    let mut p = Pair::with_limits("edge-1", "edge-1", false, 0, 8 << 20, CP_FRAME);
    p.accept(None);
    let (answer, omitted) = status_through(&mut p, many_nodes(NODES, 1, 1));
    let listed = answer.nodes.len();
    assert!(
        listed > 100 && omitted > 0,
        "{listed} listed, {omitted} left out"
    );
    assert_eq!(answer.omitted_nodes, omitted);
    assert_eq!(listed + omitted as usize, NODES);
    let mut all = many_nodes(NODES, 1, 1);
    all.reverse();
    assert_eq!(answer.nodes, all[..listed]);
    // As many as fit: one Node more would not have (beyond the frame's room for the rest).
    let frame_len = |nodes: &[iop_wire::control::EdgeNodeSnapshot]| {
        let mut buf = BytesMut::new();
        let frame = ControlFrame::correlated(
            u64::MAX,
            ControlMessage::EdgeStatusResponse(EdgeStatusResponse {
                edge_id: "edge-1".into(),
                nodes: nodes.to_vec(),
                omitted_nodes: u32::MAX,
            }),
        );
        FrameCodec::with_max_frame_len(usize::MAX)
            .encode(&frame, &mut buf)
            .unwrap();
        buf.len()
    };
    assert!(frame_len(&all[..listed]) <= CP_FRAME);
    assert!(frame_len(&all[..=listed]) > CP_FRAME - 256);
    // The session goes on: the next answer is cut the same way.
    let (again, _) = status_through(&mut p, many_nodes(NODES, 1, 1));
    assert_eq!(again, answer);
    assert!(
        !p.cp_events
            .iter()
            .any(|e| matches!(e, ControlPlaneEvent::Closed(_)))
    );
}

/// Within the frame, the answer keeps to the status bounds the Control Plane checks (Nodes,
/// provider snapshots and adapters over all Nodes), leaving out whole Nodes from the end; a
/// status within them is sent as it is.
#[test]
fn a_status_keeps_to_the_status_bounds() {
    use iop_wire::control::{MAX_STATUS_ADAPTERS, MAX_STATUS_NODES, MAX_STATUS_PROVIDERS};
    let mut p = Pair::with_frames("edge-1", "edge-1", false, 0, 64 << 20);
    p.accept(None);

    let (answer, omitted) = status_through(&mut p, many_nodes(3, 1, 1));
    assert_eq!(
        (answer.nodes.len(), omitted, answer.omitted_nodes),
        (3, 0, 0)
    );

    let (answer, omitted) = status_through(&mut p, many_nodes(MAX_STATUS_NODES + 3, 0, 0));
    assert_eq!((answer.nodes.len(), omitted), (MAX_STATUS_NODES, 3));
    assert_eq!(
        answer.nodes.last().unwrap().node_id,
        format!("node-{:05}", MAX_STATUS_NODES - 1)
    );

    let (answer, omitted) = status_through(&mut p, many_nodes(3, MAX_STATUS_PROVIDERS / 2, 0));
    assert_eq!((answer.nodes.len(), omitted), (2, 1));
    assert_eq!(answer.nodes[1].node_id, "node-00001");

    let (answer, omitted) = status_through(&mut p, many_nodes(3, 0, MAX_STATUS_ADAPTERS / 2));
    assert_eq!(
        (answer.nodes.len(), omitted, answer.omitted_nodes),
        (2, 1, 1)
    );
}

/// A usage report larger than the frame the Control Plane reads is refused by the Edge's own
/// session, with how many of its records fit, and nothing is sent; the records that fit go in
/// one frame the Control Plane reads (the codec between them fails on a larger one).
#[test]
fn a_usage_report_beyond_the_control_planes_frame_is_refused_with_what_fits() {
    const CP_FRAME: usize = 4096;
    let mut p = Pair::with_limits("edge-1", "edge-1", false, 0, 8 << 20, CP_FRAME);
    p.cp.accept_usage();
    p.accept(None);
    p.cp_events.clear();
    let report = usage_report(512);
    let Err(ControlSessionError::UsageReportTooLarge {
        records: 512,
        fit,
        max_frame_len: CP_FRAME,
    }) = p.edge.report_usage(p.now, report.clone())
    else {
        panic!("a report of 512 records fits 4 KiB")
    };
    assert!(p.edge.poll_transmit().is_none());
    assert!(fit > 10 && fit < 512, "{fit}");
    // The first `fit` records go in one frame (the codec to the Control Plane fails on a
    // larger one), and with one more the frame would be within its envelope's 32 bytes of the
    // limit or beyond: as many as fit.
    let frame_len = |n: usize| {
        let frame = ControlFrame::correlated(
            u64::MAX,
            ControlMessage::EdgeUsageReport(EdgeUsageReport {
                records: report.records[..n].to_vec(),
            }),
        );
        let mut buf = BytesMut::new();
        FrameCodec::with_max_frame_len(usize::MAX)
            .encode(&frame, &mut buf)
            .unwrap();
        buf.len() - 4
    };
    assert!(frame_len(fit) <= CP_FRAME);
    assert!(frame_len(fit + 1) > CP_FRAME - 32, "{}", frame_len(fit + 1));
    let first = EdgeUsageReport {
        records: report.records[..fit].to_vec(),
    };
    let a = p.edge.report_usage(p.now, first).unwrap();
    p.settle();
    assert!(matches!(
        p.cp_events.as_slice(),
        [ControlPlaneEvent::UsageReported { id, report }] if *id == a && report.records.len() == fit
    ));
    let one_more = EdgeUsageReport {
        records: report.records[..=fit].to_vec(),
    };
    assert!(matches!(
        p.edge.report_usage(p.now, one_more),
        Err(ControlSessionError::UsageReportTooLarge { .. })
    ));
    assert!(p.edge.is_connected());
}

/// A projection pushed to many Edges is encoded once and sent as the same bytes a push of
/// the projection itself would be: two sessions pushing one `SharedProjection` send frames
/// whose projection bytes are the very same allocation, and every frame encodes to exactly
/// the bytes of the `PrincipalProjectionPart`s and `PrincipalProjectionApplyRequest` cut from
/// the projection. Both ends read 16 KiB frames, so the projection goes in parts. A session
/// whose Edge reads other frames gets its own cut, also exact, beyond the cache's bound too.
#[test]
fn a_shared_projection_is_encoded_once_and_sent_as_the_same_bytes() {
    use iop_wire::control_session::{MAX_SHARED_CUTS, SharedProjection};
    use std::sync::Arc;
    let large = large_projection(7, 300);
    let shared = SharedProjection::new(Arc::new(large.clone()));
    let bytes_of = |frame: &ControlFrame| {
        let mut buf = BytesMut::new();
        FrameCodec::with_max_frame_len(usize::MAX)
            .encode(frame, &mut buf)
            .unwrap();
        buf
    };
    // What a session sends for `frames`-byte frames, and the frames cut the plain way.
    let push = |frames: usize| {
        let mut p = Pair::with_frames("edge-1", "edge-1", true, 0, frames);
        p.accept(Some(projection(1)));
        let id = p.cp.push_shared(p.now, &shared).unwrap().unwrap();
        let sent: Vec<ControlFrame> = std::iter::from_fn(|| p.cp.poll_transmit()).collect();
        let mut parts = large
            .clone()
            .into_parts(frames.min(iop_wire::control_session::MAX_PROJECTION_PART_LEN))
            .unwrap();
        let last = parts.pop().unwrap();
        let mut plain: Vec<ControlFrame> = parts
            .into_iter()
            .map(|part| ControlFrame::new(ControlMessage::PrincipalProjectionPart(part)))
            .collect();
        plain.push(ControlFrame::correlated(
            id,
            ControlMessage::PrincipalProjectionApplyRequest(last),
        ));
        (sent, plain)
    };
    let (a, plain) = push(SMALL_FRAME);
    assert!(a.len() >= 3, "{} frames", a.len());
    assert_eq!(a.len(), plain.len());
    for (i, (sent, plain)) in a.iter().zip(&plain).enumerate() {
        assert!(matches!(sent.message, ControlMessage::EncodedProjection(_)));
        assert!(bytes_of(sent) == bytes_of(plain), "frame {i} differs");
        let mut buf = bytes_of(sent);
        let decoded: ControlFrame = FrameCodec::default().decode(&mut buf).unwrap().unwrap();
        assert_eq!(&decoded, plain);
    }
    let (b, _) = push(SMALL_FRAME);
    let projection_bytes = |frames: &[ControlFrame]| -> Vec<*const u8> {
        frames
            .iter()
            .map(|f| match &f.message {
                ControlMessage::EncodedProjection(e) => e.bytes().as_ptr(),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    assert_eq!(projection_bytes(&a), projection_bytes(&b), "encoded once");
    // Other frame limits: a cut each, exact, within the cache's bound and beyond it.
    for k in 1..=MAX_SHARED_CUTS + 2 {
        let (sent, plain) = push(SMALL_FRAME + 1024 * k);
        assert_eq!(sent.len(), plain.len());
        for (i, (sent, plain)) in sent.iter().zip(&plain).enumerate() {
            assert!(bytes_of(sent) == bytes_of(plain), "{k}: frame {i} differs");
        }
    }
    let (c, _) = push(SMALL_FRAME);
    assert_eq!(projection_bytes(&a), projection_bytes(&c), "still cached");
    // Every Edge that reads frames of 1 MiB or more is sent parts of 1 MiB: one cut for all
    // of them, kept although the other ways filled the cache.
    let (d, plain) = push(2 << 20);
    let (e, _) = push(8 << 20);
    assert!(bytes_of(&d[0]) == bytes_of(&plain[0]));
    assert_eq!(
        projection_bytes(&d),
        projection_bytes(&e),
        "one cut for 1 MiB and more"
    );
}
