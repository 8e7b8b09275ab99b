//! The two ends of one Control Plane ⇄ Edge connection (seed 001), as sans-io machines:
//! [`EdgeControlSession`] (the Edge dials) and [`ControlPlaneSession`] (the Control Plane
//! accepts).
//!
//! ```text
//!  Edge: new() ──EdgeHelloRequest──▶ Hello ──Accepted──▶ Connected ──▶ Closed
//!                                         └─Rejected / timeout──────────▲
//!  CP:   new() ── Hello(request) ──▶ Deciding ──accept()/reject()──▶ Connected ──▶ Closed
//! ```
//!
//! Both sides share one silence rule (`Liveness`, as on the runtime wire):
//! the session closes after three heartbeat intervals without receiving anything
//! ([`ControlCloseReason::Silent`]). The Edge, which dials, sends a `Ping` after an interval
//! without sending anything; the Control Plane answers pings and sends none of its own (the
//! wire has always been that way, and an Edge's traffic is what keeps a session). The hello
//! must complete within the handshake timeout.
//!
//! Rules the machines enforce (seed 001 and our choices where it is silent):
//!
//! - **Identity agreement**: the Control Plane refuses a hello whose `edge_id` is empty or is not
//!   the name of the peer's verified certificate, before its driver sees it; the refusal is the
//!   one answer, then the session closes.
//! - **Correlation**: every request carries a fresh correlation id; an answer is matched to a
//!   pending request of its own kind only (a status answer never completes a command), and an
//!   answer nobody waits for is dropped. When the session closes, every pending request fails
//!   in the same step ([`ControlSessionError::Closed`]).
//! - **Projection generations only move forward**: the Edge installs a projection (from the
//!   hello or a push) only when its generation is strictly higher than the one it holds, and
//!   answers a stale push with the generation it holds; the Control Plane never pushes a
//!   generation lower than or equal to one it already sent on the session.
//! - **A projection larger than a frame travels in parts** (added after the first release):
//!   the Edge's hello says it assembles parts and the largest frame it reads; the Control
//!   Plane cuts a projection that does not fit the smaller of that, its own limit and
//!   [`MAX_PROJECTION_PART_LEN`] into
//!   [`ControlMessage::PrincipalProjectionPart`]s followed by the hello answer or apply
//!   request that completes it ([`PrincipalProjection::into_parts`]). A push is cut and
//!   encoded once for every Edge that reads frames alike ([`SharedProjection`]) and leaves as
//!   [`ControlMessage::EncodedProjection`] frames: the same bytes on the wire, which the Edge
//!   decodes as those parts and apply request. So a driver that joins the two machines in
//!   memory passes the Control Plane's frames through the codec, as the model check does.
//!   The Edge installs all of it or nothing: parts must come in order and of one generation, the completing message
//!   must say how many came before it, the entries stay within [`MAX_PROJECTION_ENTRIES`] per
//!   list and [`MAX_ASSEMBLED_PROJECTION_BYTES`] held, or the session closes as a protocol
//!   violation. To an Edge that does not take parts (an older one), a projection too large for
//!   one frame is never sent: the hello is refused, or the session closes
//!   ([`ControlCloseReason::ProjectionTooLarge`]), with the sizes, so that the operator sees why
//!   rather than a connection that fails to write and reconnects for ever. While the Edge
//!   holds no projection or is disconnected it acquires no lease, so it fails closed.
//! - **A status answer fits what the Control Plane reads** (added after the first release):
//!   the hello answer names the largest frame the Control Plane reads (0 from an older one:
//!   the 8 MiB default); the Edge cuts every status answer to whole Nodes, the first in
//!   `node_id` order, within that, its own limit and the status bounds
//!   ([`EdgeStatusResponse::fit`]), and counts the rest in `omitted_nodes`. Sent whole, an
//!   Edge with tens of thousands of Nodes would have its session closed (by its own codec or
//!   the Control Plane's) at every status request. An older Control Plane ignores the count.
//!   A usage report beyond that frame is refused before anything is sent, with how many of
//!   its records fit ([`ControlSessionError::UsageReportTooLarge`]): records cannot be left
//!   out, so the sender sends fewer.
//! - **Leases against the projection**: the Edge sends lease requests only while connected; a
//!   lease answer is delivered only to the request it answers.
//! - **Usage records only where accepted** (added after the first release): the Control Plane
//!   opts in ([`ControlPlaneSession::accept_usage`]) and says so in its hello answer; the Edge
//!   sends [`EdgeUsageReport`]s only then ([`ControlSessionError::UsageNotAccepted`]
//!   otherwise), so an older Control Plane never sees one. An acknowledgement means stored;
//!   a report unanswered when the session closes fails with the others (send it again: the
//!   Control Plane stores records idempotently by request id).
//! - Anything out of place (a second hello, an Edge-bound message sent to the Control Plane,
//!   a request before the hello completed) closes the session as a protocol violation.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::control::{
    AcquireLeaseRequest, AcquireLeaseResponse, ControlFrame, ControlMessage, EdgeCommandEvent,
    EdgeCommandRequest, EdgeCommandResponse, EdgeHelloRequest, EdgeHelloResponse, EdgeNodeEvent,
    EdgeStatusResponse, EdgeUsageAck, EdgeUsageReport, EncodedProjection, MAX_PROJECTION_ENTRIES,
    PrincipalProjection, PrincipalProjectionApplyResponse, ProjectionTooLarge,
};
use crate::liveness::{HeartbeatConfig, Liveness};

/// Settings shared by both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlSessionConfig {
    /// How long the hello exchange may take.
    pub handshake_timeout: Duration,
    /// Heartbeat interval used until (Edge) or unless (Control Plane) one is agreed.
    pub heartbeat: Duration,
    /// The largest frame this end's codec reads and writes. The Edge announces it in its hello;
    /// the Control Plane cuts a projection to the smaller of the two.
    pub max_frame_len: usize,
}

impl Default for ControlSessionConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            heartbeat: Duration::from_secs(10),
            max_frame_len: crate::codec::DEFAULT_MAX_FRAME_LEN,
        }
    }
}

/// How a projection is sent to one Edge: in parts (it takes them) or whole, and the largest
/// frame (the smaller of the two ends' limits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CutKey {
    parts: bool,
    max_frame_len: usize,
}

impl CutKey {
    /// `p` in the frames this key's Edge reads: whole, or in parts if it takes them.
    fn cut(self, p: PrincipalProjection) -> Result<Vec<PrincipalProjection>, ProjectionTooLarge> {
        if self.parts {
            // What the Edge would refuse to assemble is not sent: it would close the session,
            // reconnect and be sent the same again. (`max_frame_len` is at most
            // `MAX_PROJECTION_PART_LEN` already: `cut_key`.)
            let entries = p.principals.len().max(p.tokens.len()).max(p.routes.len());
            let held_bytes = p.held_bytes();
            if entries > MAX_PROJECTION_ENTRIES || held_bytes > MAX_ASSEMBLED_PROJECTION_BYTES {
                return Err(ProjectionTooLarge::Assembly {
                    entries,
                    held_bytes,
                });
            }
            return p.into_parts(self.max_frame_len.min(MAX_PROJECTION_PART_LEN));
        }
        let parts = p.into_parts(self.max_frame_len)?;
        if parts.len() > 1 {
            return Err(ProjectionTooLarge::Whole {
                len: parts.iter().map(PrincipalProjection::encoded_len).sum(),
                max_frame_len: self.max_frame_len,
            });
        }
        Ok(parts)
    }
}

/// Most ways of cutting one [`SharedProjection`] it keeps encoded beside the usual one (parts
/// of [`MAX_PROJECTION_PART_LEN`], what every Edge that takes parts and reads frames of 1 MiB
/// or more is sent). Edges name their own frame limits, so Edges with many different small
/// ones could otherwise make it hold as many encodings; beyond this many, a cut is encoded for
/// its session alone, as before sharing.
pub const MAX_SHARED_CUTS: usize = 4;

/// A projection the Control Plane pushes to many Edges
/// ([`ControlPlaneSession::push_shared`]): it is cut and encoded once per way Edges read it
/// (whole, or in parts of one length: in practice one way for all), and every session sends
/// the same bytes. Before, each session cloned the projection, built its protobuf form twice
/// and encoded it: about 1 µs per principal per Edge, 306 ms of CPU per change with 1000
/// principals and 400 Edges, 85 ms now (`cp_load` in `benches/README.md`).
///
/// Each way is encoded by the first session that needs it, while the others that need the
/// same one wait for it (and those that need another way do not). The encodings live as long
/// as the `SharedProjection`: the Control Plane's cache (`iop_cp::admin::Admin::
/// shared_projection`) keeps it until the next generation replaces it.
#[derive(Debug)]
pub struct SharedProjection {
    projection: Arc<PrincipalProjection>,
    cuts: Mutex<Vec<(CutKey, Arc<OnceLock<EncodedCut>>)>>,
}

/// The encoded parts of one cut (the last completes it), or why it cannot be sent.
type EncodedCut = Result<Arc<[Bytes]>, ProjectionTooLarge>;

impl SharedProjection {
    /// Shares `projection`.
    pub fn new(projection: Arc<PrincipalProjection>) -> Self {
        Self {
            projection,
            cuts: Mutex::new(Vec::new()),
        }
    }

    /// The projection.
    pub fn projection(&self) -> &Arc<PrincipalProjection> {
        &self.projection
    }

    /// Its generation.
    pub fn generation(&self) -> u64 {
        self.projection.generation
    }

    /// The parts for `key`'s Edges, encoded: from the cache, or made (and kept: the usual way
    /// always, others within [`MAX_SHARED_CUTS`]).
    fn encoded(&self, key: CutKey) -> EncodedCut {
        let usual = key.parts && key.max_frame_len == MAX_PROJECTION_PART_LEN;
        let slot = {
            let mut cuts = self
                .cuts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match cuts.iter().find(|(k, _)| *k == key) {
                Some((_, slot)) => Some(slot.clone()),
                None if usual || cuts.len() < MAX_SHARED_CUTS => {
                    let slot = Arc::new(OnceLock::new());
                    cuts.push((key, slot.clone()));
                    Some(slot)
                }
                None => None,
            }
        };
        // Encoded outside the list's lock: another way is encoded meanwhile by its own session.
        match slot {
            Some(slot) => slot.get_or_init(|| self.encode(key)).clone(),
            None => self.encode(key),
        }
    }

    fn encode(&self, key: CutKey) -> EncodedCut {
        key.cut(PrincipalProjection::clone(&self.projection))
            .map(|parts| {
                parts
                    .iter()
                    .map(PrincipalProjection::encode_bytes)
                    .collect()
            })
    }
}

/// The largest part the Control Plane cuts a projection into for an Edge that takes parts
/// (1 MiB), whatever the frame limits allow: each session's write buffer grows to the largest
/// frame it wrote and keeps that size, so with 8 MiB parts a Control Plane serving 400 Edges
/// would keep 3 GiB of buffers after one push of a large projection.
pub const MAX_PROJECTION_PART_LEN: usize = 1 << 20;

/// The most heap ([`PrincipalProjection::held_bytes`]) an Edge's session holds for a
/// projection it assembles from parts (512 MiB: about a million principals, each with a token
/// and a route of ordinary sizes). More closes the session as a protocol violation.
pub const MAX_ASSEMBLED_PROJECTION_BYTES: usize = 512 << 20;

/// Why a control session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ControlCloseReason {
    /// The Control Plane refused the hello (its reason).
    Rejected(String),
    /// A managed Edge's hello was accepted without a projection.
    MissingProjection,
    /// The hello did not complete in time.
    HandshakeTimeout,
    /// Nothing was received for three heartbeat intervals.
    Silent,
    /// The peer sent something out of place.
    ProtocolViolation(&'static str),
    /// The transport closed.
    TransportClosed,
    /// Closed by this side (shutdown, replaced).
    Local,
    /// The Control Plane could not send a projection to this Edge: too large for one frame, to
    /// an Edge that does not take parts, or an entry larger than a frame.
    ProjectionTooLarge(ProjectionTooLarge),
}

/// Why a request could not be sent or was not answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ControlSessionError {
    /// The session is not connected (hello pending or closed).
    #[error("control session not connected")]
    NotConnected,
    /// The session closed before the answer.
    #[error("control session closed")]
    Closed,
    /// The Control Plane did not say it accepts usage records on this session.
    #[error("the control plane does not accept usage records")]
    UsageNotAccepted,
    /// A usage report larger than the frame the Control Plane reads (or this end writes):
    /// nothing was sent; send its first `fit` records
    /// ([`EdgeUsageReport::records_that_fit`]). `fit` is 0 when the first record alone does
    /// not fit.
    #[error(
        "a usage report of {records} records does not fit a frame of {max_frame_len} bytes; \
         its first {fit} do"
    )]
    UsageReportTooLarge {
        /// Records in the report.
        records: usize,
        /// How many of its first records fit.
        fit: usize,
        /// The frame limit.
        max_frame_len: usize,
    },
    /// The projection cannot be sent to this Edge; the session closed
    /// ([`ControlCloseReason::ProjectionTooLarge`]).
    #[error(transparent)]
    ProjectionTooLarge(#[from] ProjectionTooLarge),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Hello,
    Connected,
    Closed,
}

/// What both ends share: the liveness and handshake timers, correlation ids and the frames to
/// write.
#[derive(Clone, Debug)]
struct Link {
    liveness: Liveness,
    handshake_timeout: Duration,
    handshake_deadline: Option<Instant>,
    next_correlation: u64,
    transmits: VecDeque<ControlFrame>,
}

impl Link {
    fn new(config: &ControlSessionConfig, now: Instant, first_correlation: u64) -> Self {
        Self {
            liveness: Liveness::new(HeartbeatConfig::from_interval(config.heartbeat), now),
            handshake_timeout: config.handshake_timeout,
            handshake_deadline: now.checked_add(config.handshake_timeout),
            next_correlation: first_correlation,
            transmits: VecDeque::new(),
        }
    }

    /// The next deadline; `pings`: whether this end sends pings (the Edge, once connected).
    fn poll_timeout(&self, pings: bool) -> Instant {
        let mut t = self.liveness.idle_deadline();
        if pings {
            t = t.min(self.liveness.ping_at());
        }
        self.handshake_deadline.map_or(t, |d| t.min(d))
    }

    /// Why the session must close at `now`, if it must: the hello is late, or the peer silent.
    fn expired(&self, now: Instant, in_hello: bool) -> Option<ControlCloseReason> {
        if in_hello && self.handshake_deadline.is_some_and(|d| now >= d) {
            Some(ControlCloseReason::HandshakeTimeout)
        } else if now >= self.liveness.idle_deadline() {
            Some(ControlCloseReason::Silent)
        } else {
            None
        }
    }

    /// The hello is under way (a part of the projection it brings arrived): the handshake
    /// deadline starts again, so that a projection of many parts is bounded per part, not as a
    /// whole (its size is bounded by the assembly's bounds).
    fn handshake_progress(&mut self, now: Instant) {
        if self.handshake_deadline.is_some() {
            self.handshake_deadline = now.checked_add(self.handshake_timeout);
        }
    }

    /// The hello completed: the agreed heartbeat from now on, no handshake deadline.
    fn connected(&mut self, heartbeat: Duration, now: Instant) {
        self.liveness = Liveness::new(HeartbeatConfig::from_interval(heartbeat), now);
        self.handshake_deadline = None;
    }

    fn correlation_id(&mut self) -> u64 {
        let id = self.next_correlation;
        self.next_correlation += 1;
        id
    }

    fn transmit(&mut self, now: Instant, frame: ControlFrame) {
        self.liveness.on_sent(now);
        self.transmits.push_back(frame);
    }
}

// === Edge side ===

/// What the Edge's session tells its driver.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EdgeControlEvent {
    /// The hello was accepted; the session is connected with this heartbeat. Comes after the
    /// hello's [`EdgeControlEvent::Projection`], if it brought a newer one.
    Connected {
        /// The agreed heartbeat interval.
        heartbeat: Duration,
    },
    /// Install this projection: strictly newer than the one held (from the hello or a push;
    /// a push was already answered).
    Projection(PrincipalProjection),
    /// The Control Plane asks for the Edge's status: answer with
    /// [`EdgeControlSession::respond_status`].
    StatusRequested {
        /// The request to answer.
        id: u64,
    },
    /// The Control Plane sends a command: answer with [`EdgeControlSession::respond_command`].
    CommandRequested {
        /// The request to answer.
        id: u64,
        /// The command.
        request: EdgeCommandRequest,
    },
    /// The answer to [`EdgeControlSession::acquire_lease`].
    LeaseAnswered {
        /// The ticket `acquire_lease` returned.
        ticket: u64,
        /// The answer, or the session's end.
        result: Result<AcquireLeaseResponse, ControlSessionError>,
    },
    /// The answer to [`EdgeControlSession::ping`].
    Pong {
        /// The ticket `ping` returned.
        ticket: u64,
    },
    /// The answer to [`EdgeControlSession::report_usage`]: `Ok` only once the Control Plane
    /// stored every record of the report.
    UsageAcked {
        /// The ticket `report_usage` returned.
        ticket: u64,
        /// The acknowledgement, or the session's end (then send the records again).
        result: Result<EdgeUsageAck, ControlSessionError>,
    },
    /// The session is over; close the socket. Emitted exactly once.
    Closed(ControlCloseReason),
}

/// The Edge end of a control connection. `Clone` copies the whole machine (model checkers:
/// `iop-cp/tests/control_model.rs`); its sets are ordered, so equal states print equally.
#[derive(Clone, Debug)]
pub struct EdgeControlSession {
    phase: Phase,
    managed: bool,
    hello_id: u64,
    default_heartbeat: Duration,
    /// The generation of the projection the Edge holds (0: none), across sessions.
    held_generation: u64,
    link: Link,
    leases: BTreeSet<u64>,
    pings: BTreeSet<u64>,
    usage: BTreeSet<u64>,
    /// The hello answer said the Control Plane stores usage records.
    accepts_usage: bool,
    /// The parts of a projection received so far (the hello said this Edge takes parts).
    assembling: Option<Assembling>,
    /// The largest frame this Edge writes and the Control Plane reads: the smaller of this
    /// end's limit and the one the hello answer named. Status answers are fitted to it, usage
    /// reports refused beyond it.
    peer_frame_len: usize,
    events: VecDeque<EdgeControlEvent>,
}

/// A projection being assembled from parts on the Edge.
#[derive(Clone, Debug)]
struct Assembling {
    projection: PrincipalProjection,
    parts: u32,
    held: usize,
}

impl Assembling {
    /// Adds `part`'s entries, within the bounds.
    fn absorb(&mut self, part: PrincipalProjection) -> Result<(), &'static str> {
        let p = &mut self.projection;
        if p.principals.len() + part.principals.len() > MAX_PROJECTION_ENTRIES
            || p.tokens.len() + part.tokens.len() > MAX_PROJECTION_ENTRIES
            || p.routes.len() + part.routes.len() > MAX_PROJECTION_ENTRIES
        {
            return Err("projection parts exceed the entries of one projection");
        }
        self.held += part.held_bytes();
        if self.held > MAX_ASSEMBLED_PROJECTION_BYTES {
            return Err("projection parts exceed the memory bound");
        }
        p.principals.extend(part.principals);
        p.tokens.extend(part.tokens);
        p.routes.extend(part.routes);
        Ok(())
    }
}

impl EdgeControlSession {
    /// A session on a fresh connection: queues `hello`. `held_generation` is the projection
    /// the Edge already holds (0 for none): a reconnect never installs an older one.
    ///
    /// The session fills in what it implements: a managed Edge's hello says it takes a
    /// projection in parts, and every hello names `config.max_frame_len`.
    pub fn new(
        config: ControlSessionConfig,
        mut hello: EdgeHelloRequest,
        held_generation: u64,
        now: Instant,
    ) -> Self {
        hello.projection_parts = hello.managed;
        hello.max_frame_len = u32::try_from(config.max_frame_len).unwrap_or(u32::MAX);
        let mut s = Self {
            phase: Phase::Hello,
            managed: hello.managed,
            hello_id: 1,
            default_heartbeat: config.heartbeat,
            held_generation,
            link: Link::new(&config, now, 2),
            leases: BTreeSet::new(),
            pings: BTreeSet::new(),
            usage: BTreeSet::new(),
            accepts_usage: false,
            assembling: None,
            peer_frame_len: config.max_frame_len,
            events: VecDeque::new(),
        };
        s.link.transmit(
            now,
            ControlFrame::correlated(1, ControlMessage::EdgeHelloRequest(hello)),
        );
        s
    }

    /// Whether the hello completed and the session is open.
    pub fn is_connected(&self) -> bool {
        self.phase == Phase::Connected
    }

    /// The generation of the projection installed (0: none).
    pub fn projection_generation(&self) -> u64 {
        self.held_generation
    }

    /// Whether the Control Plane said it stores usage records ([`Self::report_usage`]).
    pub fn accepts_usage(&self) -> bool {
        self.phase == Phase::Connected && self.accepts_usage
    }

    /// Handles one frame from the Control Plane.
    pub fn handle_frame(&mut self, now: Instant, frame: ControlFrame) {
        if self.phase == Phase::Closed {
            return;
        }
        self.link.liveness.on_received(now);
        let id = frame.correlation_id;
        match (self.phase, frame.message) {
            (_, ControlMessage::Ping) => {
                self.link
                    .transmit(now, ControlFrame::correlated(id, ControlMessage::Pong));
            }
            (Phase::Hello, ControlMessage::EdgeHelloResponse(answer)) if id == self.hello_id => {
                self.hello_answer(now, answer);
            }
            (Phase::Connected, ControlMessage::Pong) => {
                if self.pings.remove(&id) {
                    self.events.push_back(EdgeControlEvent::Pong { ticket: id });
                }
            }
            (Phase::Connected, ControlMessage::EdgeStatusRequest) => {
                self.events
                    .push_back(EdgeControlEvent::StatusRequested { id });
            }
            (Phase::Connected, ControlMessage::EdgeCommandRequest(request)) => {
                self.events
                    .push_back(EdgeControlEvent::CommandRequested { id, request });
            }
            (_, ControlMessage::PrincipalProjectionPart(p)) if self.managed => {
                match self.take_part(p) {
                    Ok(()) if self.phase == Phase::Hello => self.link.handshake_progress(now),
                    Ok(()) => {}
                    Err(rule) => self.close(ControlCloseReason::ProtocolViolation(rule)),
                }
            }
            (Phase::Connected, ControlMessage::PrincipalProjectionApplyRequest(p)) => {
                let p = match self.complete(p) {
                    Ok(p) => p,
                    Err(rule) => return self.close(ControlCloseReason::ProtocolViolation(rule)),
                };
                let answer = self.offer_projection(p);
                self.link.transmit(
                    now,
                    ControlFrame::correlated(
                        id,
                        ControlMessage::PrincipalProjectionApplyResponse(answer),
                    ),
                );
            }
            (Phase::Connected, ControlMessage::AcquireLeaseResponse(r)) => {
                if self.leases.remove(&id) {
                    self.events.push_back(EdgeControlEvent::LeaseAnswered {
                        ticket: id,
                        result: Ok(r),
                    });
                }
            }
            (Phase::Connected, ControlMessage::EdgeUsageAck(ack)) => {
                if self.usage.remove(&id) {
                    self.events.push_back(EdgeControlEvent::UsageAcked {
                        ticket: id,
                        result: Ok(ack),
                    });
                }
            }
            _ => self.close(ControlCloseReason::ProtocolViolation(
                "unexpected message from the control plane",
            )),
        }
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Closed {
            return;
        }
        if let Some(reason) = self.link.expired(now, self.phase == Phase::Hello) {
            return self.close(reason);
        }
        if self.phase == Phase::Connected && now >= self.link.liveness.ping_at() {
            let id = self.link.correlation_id();
            self.link
                .transmit(now, ControlFrame::correlated(id, ControlMessage::Ping));
        }
    }

    /// Asks for a credential lease; its answer comes as [`EdgeControlEvent::LeaseAnswered`].
    pub fn acquire_lease(
        &mut self,
        now: Instant,
        request: AcquireLeaseRequest,
    ) -> Result<u64, ControlSessionError> {
        self.connected()?;
        let id = self.link.correlation_id();
        self.leases.insert(id);
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::AcquireLeaseRequest(request)),
        );
        Ok(id)
    }

    /// Sends usage records to a Control Plane that accepts them; the answer comes as
    /// [`EdgeControlEvent::UsageAcked`]. Until it is `Ok`, the records are not stored. A
    /// report larger than the Control Plane's frame is refused with how many of its records
    /// fit ([`ControlSessionError::UsageReportTooLarge`]), and nothing is sent.
    pub fn report_usage(
        &mut self,
        now: Instant,
        report: EdgeUsageReport,
    ) -> Result<u64, ControlSessionError> {
        self.connected()?;
        if !self.accepts_usage {
            return Err(ControlSessionError::UsageNotAccepted);
        }
        let fit = report.records_that_fit(self.peer_frame_len);
        if fit < report.records.len() {
            return Err(ControlSessionError::UsageReportTooLarge {
                records: report.records.len(),
                fit,
                max_frame_len: self.peer_frame_len,
            });
        }
        let id = self.link.correlation_id();
        self.usage.insert(id);
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeUsageReport(report)),
        );
        Ok(id)
    }

    /// Sends a ping; its answer comes as [`EdgeControlEvent::Pong`].
    pub fn ping(&mut self, now: Instant) -> Result<u64, ControlSessionError> {
        self.connected()?;
        let id = self.link.correlation_id();
        self.pings.insert(id);
        self.link
            .transmit(now, ControlFrame::correlated(id, ControlMessage::Ping));
        Ok(id)
    }

    /// Answers [`EdgeControlEvent::StatusRequested`], fitted to the status bounds and to the
    /// smaller of this end's frame limit and the Control Plane's ([`EdgeStatusResponse::fit`]:
    /// Nodes beyond are left out and counted in `omitted_nodes`). Returns how many Nodes were
    /// left out, for the driver to log: the status then shows only part of the Edge.
    pub fn respond_status(
        &mut self,
        now: Instant,
        id: u64,
        mut status: EdgeStatusResponse,
    ) -> Result<u32, ControlSessionError> {
        self.connected()?;
        let omitted = status.fit(self.peer_frame_len);
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeStatusResponse(status)),
        );
        Ok(omitted)
    }

    /// Answers [`EdgeControlEvent::CommandRequested`].
    pub fn respond_command(
        &mut self,
        now: Instant,
        id: u64,
        response: EdgeCommandResponse,
    ) -> Result<(), ControlSessionError> {
        self.connected()?;
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeCommandResponse(response)),
        );
        Ok(())
    }

    /// Relays a Node lifecycle event.
    pub fn node_event(
        &mut self,
        now: Instant,
        event: EdgeNodeEvent,
    ) -> Result<(), ControlSessionError> {
        self.connected()?;
        self.link
            .transmit(now, ControlFrame::new(ControlMessage::EdgeNodeEvent(event)));
        Ok(())
    }

    /// Reports progress of the command [`EdgeControlEvent::CommandRequested`] named `id`.
    pub fn command_event(
        &mut self,
        now: Instant,
        id: u64,
        event: EdgeCommandEvent,
    ) -> Result<(), ControlSessionError> {
        self.connected()?;
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeCommandEvent(event)),
        );
        Ok(())
    }

    /// The transport is gone.
    pub fn handle_transport_closed(&mut self) {
        self.close(ControlCloseReason::TransportClosed);
    }

    /// Closes the session from this side.
    pub fn close_local(&mut self) {
        self.close(ControlCloseReason::Local);
    }

    /// The next frame to write.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<ControlFrame> {
        self.link.transmits.pop_front()
    }

    /// The next event for the driver.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<EdgeControlEvent> {
        self.events.pop_front()
    }

    /// When [`EdgeControlSession::handle_timeout`] must next be called; `None` once closed.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.phase != Phase::Closed)
            .then(|| self.link.poll_timeout(self.phase == Phase::Connected))
    }

    fn hello_answer(&mut self, now: Instant, answer: EdgeHelloResponse) {
        match answer {
            EdgeHelloResponse::Rejected { reason } => {
                self.close(ControlCloseReason::Rejected(reason));
            }
            EdgeHelloResponse::Accepted {
                projection,
                heartbeat_interval_ms,
                accepts_usage,
                max_frame_len,
            } => {
                self.accepts_usage = accepts_usage;
                let peer = match max_frame_len {
                    0 => crate::codec::DEFAULT_MAX_FRAME_LEN,
                    n => n as usize,
                };
                self.peer_frame_len = self.peer_frame_len.min(peer);
                if self.managed && projection.is_none() {
                    return self.close(ControlCloseReason::MissingProjection);
                }
                let projection = match projection
                    .filter(|_| self.managed)
                    .map(|p| self.complete(p))
                {
                    Some(Err(rule)) => {
                        return self.close(ControlCloseReason::ProtocolViolation(rule));
                    }
                    Some(Ok(p)) => Some(p),
                    None => None,
                };
                let heartbeat = heartbeat_interval_ms
                    .filter(|ms| *ms > 0)
                    .map_or(self.default_heartbeat, |ms| {
                        Duration::from_millis(u64::from(ms))
                    });
                self.link.connected(heartbeat, now);
                self.phase = Phase::Connected;
                // The hello's projection first: by the time the driver reports connected, the
                // projection it brought is installed.
                if let Some(p) = projection
                    && self.managed
                {
                    let _ = self.offer_projection(p);
                }
                self.events
                    .push_back(EdgeControlEvent::Connected { heartbeat });
            }
        }
    }

    /// Adds a part of a projection: in order, of one generation, within the bounds.
    fn take_part(&mut self, part: PrincipalProjection) -> Result<(), &'static str> {
        // A Control Plane cuts parts of at least one entry; an empty one would cost nothing to
        // hold, so that a stream of them would never end.
        if part.principals.is_empty() && part.tokens.is_empty() && part.routes.is_empty() {
            return Err("an empty projection part");
        }
        match &mut self.assembling {
            None if part.parts_before == 0 => {
                let mut a = Assembling {
                    projection: PrincipalProjection {
                        generation: part.generation,
                        ..PrincipalProjection::default()
                    },
                    parts: 0,
                    held: 0,
                };
                a.absorb(part)?;
                a.parts = 1;
                self.assembling = Some(a);
                Ok(())
            }
            Some(a)
                if a.projection.generation == part.generation && a.parts == part.parts_before =>
            {
                a.absorb(part)?;
                // At most 3 × MAX_PROJECTION_ENTRIES parts fit the entry bound.
                a.parts = a.parts.saturating_add(1);
                Ok(())
            }
            _ => Err("projection part out of order"),
        }
    }

    /// The whole projection `last` completes: itself when whole, or the parts before it with
    /// its entries and issuer fields.
    fn complete(&mut self, last: PrincipalProjection) -> Result<PrincipalProjection, &'static str> {
        if last.parts_before == 0 {
            return match self.assembling {
                None => Ok(last),
                Some(_) => Err("a whole projection while parts of another are pending"),
            };
        }
        match self.assembling.take() {
            Some(mut a)
                if a.projection.generation == last.generation && a.parts == last.parts_before =>
            {
                let mut last = last;
                let p = &mut a.projection;
                p.issuer_key_id = std::mem::take(&mut last.issuer_key_id);
                p.staged_issuer_key_id = std::mem::take(&mut last.staged_issuer_key_id);
                p.staged_issuer_activates_at_unix_ms = last.staged_issuer_activates_at_unix_ms;
                a.absorb(last)?;
                Ok(a.projection)
            }
            _ => Err("projection completed without its parts"),
        }
    }

    /// Installs `p` if strictly newer than what is held; the answer to give a push.
    fn offer_projection(&mut self, p: PrincipalProjection) -> PrincipalProjectionApplyResponse {
        if !self.managed {
            return PrincipalProjectionApplyResponse {
                accepted: false,
                generation: 0,
                reason: "credential plane disabled".into(),
            };
        }
        if p.generation <= self.held_generation {
            return PrincipalProjectionApplyResponse {
                accepted: false,
                generation: self.held_generation,
                reason: "stale generation".into(),
            };
        }
        self.held_generation = p.generation;
        let generation = p.generation;
        self.events.push_back(EdgeControlEvent::Projection(p));
        PrincipalProjectionApplyResponse {
            accepted: true,
            generation,
            reason: String::new(),
        }
    }

    fn connected(&self) -> Result<(), ControlSessionError> {
        match self.phase {
            Phase::Connected => Ok(()),
            _ => Err(ControlSessionError::NotConnected),
        }
    }

    fn close(&mut self, reason: ControlCloseReason) {
        if self.phase == Phase::Closed {
            return;
        }
        self.phase = Phase::Closed;
        // Ordered: the tickets fail in the order they were issued.
        let tickets = std::mem::take(&mut self.leases);
        for ticket in tickets {
            self.events.push_back(EdgeControlEvent::LeaseAnswered {
                ticket,
                result: Err(ControlSessionError::Closed),
            });
        }
        self.pings.clear();
        for ticket in std::mem::take(&mut self.usage) {
            self.events.push_back(EdgeControlEvent::UsageAcked {
                ticket,
                result: Err(ControlSessionError::Closed),
            });
        }
        self.events.push_back(EdgeControlEvent::Closed(reason));
    }
}

// === Control Plane side ===

/// What the Control Plane's session tells its driver.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ControlPlaneEvent {
    /// A hello whose identity agrees with the certificate: decide with
    /// [`ControlPlaneSession::accept`] or [`ControlPlaneSession::reject`].
    Hello(EdgeHelloRequest),
    /// A Node lifecycle event relayed by the Edge.
    NodeEvent(EdgeNodeEvent),
    /// Progress of the command sent as `ticket`.
    CommandEvent {
        /// The ticket [`ControlPlaneSession::command`] returned.
        ticket: u64,
        /// The event.
        event: EdgeCommandEvent,
    },
    /// A lease request: answer with [`ControlPlaneSession::respond_lease`].
    LeaseRequested {
        /// The request to answer.
        id: u64,
        /// The request.
        request: AcquireLeaseRequest,
    },
    /// Usage records (only on a session [accepting them](ControlPlaneSession::accept_usage)):
    /// store them idempotently, then answer with [`ControlPlaneSession::respond_usage`].
    UsageReported {
        /// The report to answer.
        id: u64,
        /// The records.
        report: EdgeUsageReport,
    },
    /// The answer to [`ControlPlaneSession::status`].
    StatusAnswered {
        /// The ticket `status` returned.
        ticket: u64,
        /// The answer, or the session's end.
        result: Result<EdgeStatusResponse, ControlSessionError>,
    },
    /// The answer to [`ControlPlaneSession::command`].
    CommandAnswered {
        /// The ticket `command` returned.
        ticket: u64,
        /// The answer, or the session's end.
        result: Result<EdgeCommandResponse, ControlSessionError>,
    },
    /// The Edge answered a projection push.
    ProjectionAnswered {
        /// The generation pushed.
        pushed: u64,
        /// The Edge's answer.
        answer: PrincipalProjectionApplyResponse,
    },
    /// The session is over; close the socket. Emitted exactly once.
    Closed(ControlCloseReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waiting {
    Status,
    Command,
    Projection(u64),
}

/// The Control Plane end of one Edge connection.
#[derive(Clone, Debug)]
pub struct ControlPlaneSession {
    phase: Phase,
    /// The name of the peer's verified certificate (`None`: no identity to agree with).
    peer: Option<String>,
    hello_id: Option<u64>,
    heartbeat: Duration,
    link: Link,
    /// The highest projection generation sent on this session (hello included).
    pushed_generation: u64,
    waiting: BTreeMap<u64, Waiting>,
    /// Usage records are taken on this session ([`Self::accept_usage`]).
    accepts_usage: bool,
    /// This end's frame limit.
    max_frame_len: usize,
    /// What the hello said: the Edge takes a projection in parts, and the largest frame it
    /// reads (0: not said).
    edge_takes_parts: bool,
    edge_max_frame_len: u32,
    events: VecDeque<ControlPlaneEvent>,
}

impl ControlPlaneSession {
    /// A session on an accepted connection whose certificate names `peer`. `config.heartbeat`
    /// is the interval told to the Edge.
    pub fn new(config: ControlSessionConfig, peer: Option<String>, now: Instant) -> Self {
        Self {
            phase: Phase::Hello,
            peer,
            hello_id: None,
            heartbeat: config.heartbeat,
            link: Link::new(&config, now, 1),
            pushed_generation: 0,
            waiting: BTreeMap::new(),
            accepts_usage: false,
            max_frame_len: config.max_frame_len,
            edge_takes_parts: false,
            edge_max_frame_len: 0,
            events: VecDeque::new(),
        }
    }

    /// Whether the hello was accepted and the session is open.
    pub fn is_connected(&self) -> bool {
        self.phase == Phase::Connected
    }

    /// The highest projection generation sent on this session (the hello's included; 0: none).
    pub fn pushed_generation(&self) -> u64 {
        self.pushed_generation
    }

    /// Handles one frame from the Edge.
    pub fn handle_frame(&mut self, now: Instant, frame: ControlFrame) {
        if self.phase == Phase::Closed {
            return;
        }
        self.link.liveness.on_received(now);
        let id = frame.correlation_id;
        match (self.phase, frame.message) {
            (_, ControlMessage::Ping) => {
                self.link
                    .transmit(now, ControlFrame::correlated(id, ControlMessage::Pong));
            }
            (Phase::Hello, ControlMessage::EdgeHelloRequest(hello)) if self.hello_id.is_none() => {
                self.hello_id = Some(id);
                self.edge_takes_parts = hello.projection_parts;
                self.edge_max_frame_len = hello.max_frame_len;
                if hello.edge_id.is_empty() {
                    self.reject(now, "edge_id is required");
                } else if self.peer.as_deref().is_some_and(|p| p != hello.edge_id) {
                    self.reject(now, "hello edge_id does not match the certificate");
                } else {
                    self.events.push_back(ControlPlaneEvent::Hello(hello));
                }
            }
            (Phase::Connected, ControlMessage::Pong) => {}
            (Phase::Connected, ControlMessage::EdgeNodeEvent(ev)) => {
                self.events.push_back(ControlPlaneEvent::NodeEvent(ev));
            }
            (Phase::Connected, ControlMessage::EdgeCommandEvent(event)) => {
                if self.waiting.get(&id) == Some(&Waiting::Command) {
                    self.events
                        .push_back(ControlPlaneEvent::CommandEvent { ticket: id, event });
                }
            }
            (Phase::Connected, ControlMessage::AcquireLeaseRequest(request)) => {
                self.events
                    .push_back(ControlPlaneEvent::LeaseRequested { id, request });
            }
            (Phase::Connected, ControlMessage::EdgeUsageReport(report)) if self.accepts_usage => {
                self.events
                    .push_back(ControlPlaneEvent::UsageReported { id, report });
            }
            (Phase::Connected, ControlMessage::EdgeStatusResponse(r)) => {
                if self.take(id, Waiting::Status) {
                    self.events.push_back(ControlPlaneEvent::StatusAnswered {
                        ticket: id,
                        result: Ok(r),
                    });
                }
            }
            (Phase::Connected, ControlMessage::EdgeCommandResponse(r)) => {
                if self.take(id, Waiting::Command) {
                    self.events.push_back(ControlPlaneEvent::CommandAnswered {
                        ticket: id,
                        result: Ok(r),
                    });
                }
            }
            (Phase::Connected, ControlMessage::PrincipalProjectionApplyResponse(answer)) => {
                if let Some(Waiting::Projection(pushed)) = self.waiting.get(&id).copied() {
                    self.waiting.remove(&id);
                    self.events
                        .push_back(ControlPlaneEvent::ProjectionAnswered { pushed, answer });
                }
            }
            _ => self.close(ControlCloseReason::ProtocolViolation(
                "unexpected message from the edge",
            )),
        }
    }

    /// Accepts the hello, with the current projection for a managed Edge: in parts when it does
    /// not fit one frame and the Edge takes parts.
    ///
    /// # Errors
    ///
    /// The projection cannot be sent to this Edge ([`ProjectionTooLarge`]); the hello is
    /// refused instead, with a reason that says so.
    pub fn accept(
        &mut self,
        now: Instant,
        projection: Option<PrincipalProjection>,
    ) -> Result<(), ProjectionTooLarge> {
        let Some(id) = self.hello_id.filter(|_| self.phase == Phase::Hello) else {
            return Ok(());
        };
        let projection = match projection.map(|p| self.cut_key().cut(p)).transpose() {
            Ok(parts) => parts.map(|mut parts| {
                let last = parts.pop();
                for part in parts {
                    self.link.transmit(
                        now,
                        ControlFrame::new(ControlMessage::PrincipalProjectionPart(part)),
                    );
                }
                last
            }),
            Err(e) => {
                let reason = match e {
                    ProjectionTooLarge::Entry { .. } => {
                        "a principal projection entry is larger than a frame"
                    }
                    ProjectionTooLarge::Assembly { .. } => {
                        "the principal projection is larger than an edge assembles"
                    }
                    _ => {
                        "the principal projection is larger than a frame and this edge does not take it in parts"
                    }
                };
                self.reject(now, reason);
                return Err(e);
            }
        };
        let projection = projection.flatten();
        if let Some(p) = &projection {
            self.pushed_generation = p.generation;
        }
        let answer = EdgeHelloResponse::Accepted {
            projection,
            heartbeat_interval_ms: u32::try_from(self.heartbeat.as_millis()).ok(),
            accepts_usage: self.accepts_usage,
            max_frame_len: u32::try_from(self.max_frame_len).unwrap_or(u32::MAX),
        };
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeHelloResponse(answer)),
        );
        self.link.connected(self.heartbeat, now);
        self.phase = Phase::Connected;
        Ok(())
    }

    /// How this Edge is sent a projection: whether in parts, and the frame limit.
    fn cut_key(&self) -> CutKey {
        let edge = match self.edge_max_frame_len {
            0 => crate::codec::DEFAULT_MAX_FRAME_LEN,
            n => n as usize,
        };
        let max_frame_len = self.max_frame_len.min(edge);
        CutKey {
            parts: self.edge_takes_parts,
            // Edges reading 2, 4 or 8 MiB frames are cut alike: one key for them all.
            max_frame_len: if self.edge_takes_parts {
                max_frame_len.min(MAX_PROJECTION_PART_LEN)
            } else {
                max_frame_len
            },
        }
    }

    /// Refuses the hello with a stable reason; the session closes after the answer.
    pub fn reject(&mut self, now: Instant, reason: &str) {
        let Some(id) = self.hello_id.filter(|_| self.phase == Phase::Hello) else {
            return;
        };
        let answer = EdgeHelloResponse::Rejected {
            reason: reason.to_owned(),
        };
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeHelloResponse(answer)),
        );
        self.phase = Phase::Closed;
        self.events
            .push_back(ControlPlaneEvent::Closed(ControlCloseReason::Rejected(
                reason.to_owned(),
            )));
    }

    /// Pushes a projection, in parts when it does not fit one frame and the Edge takes parts.
    /// Generations only move forward: one not higher than the last sent on this session is not
    /// sent (`Ok(None)`).
    ///
    /// # Errors
    ///
    /// [`ControlSessionError::ProjectionTooLarge`] when it cannot be sent to this Edge: the
    /// session closes ([`ControlCloseReason::ProjectionTooLarge`]) rather than leave the Edge
    /// on an older projection (one that may still hold a revoked token).
    pub fn push_projection(
        &mut self,
        now: Instant,
        projection: PrincipalProjection,
    ) -> Result<Option<u64>, ControlSessionError> {
        self.push_shared(now, &SharedProjection::new(Arc::new(projection)))
    }

    /// [`ControlPlaneSession::push_projection`] of a projection that many sessions push: it is
    /// cut and encoded once for every Edge that reads the same frames, not once per Edge.
    ///
    /// # Errors
    ///
    /// As [`ControlPlaneSession::push_projection`].
    pub fn push_shared(
        &mut self,
        now: Instant,
        projection: &SharedProjection,
    ) -> Result<Option<u64>, ControlSessionError> {
        self.connected()?;
        let generation = projection.generation();
        if generation <= self.pushed_generation {
            return Ok(None);
        }
        let parts = match projection.encoded(self.cut_key()) {
            Ok(parts) => parts,
            Err(e) => {
                self.close(ControlCloseReason::ProjectionTooLarge(e));
                return Err(e.into());
            }
        };
        let Some((last, before)) = parts.split_last() else {
            return Ok(None);
        };
        for part in before {
            self.link.transmit(
                now,
                ControlFrame::new(ControlMessage::EncodedProjection(EncodedProjection::new(
                    false,
                    part.clone(),
                ))),
            );
        }
        self.pushed_generation = generation;
        let id = self.link.correlation_id();
        self.waiting.insert(id, Waiting::Projection(generation));
        self.link.transmit(
            now,
            ControlFrame::correlated(
                id,
                ControlMessage::EncodedProjection(EncodedProjection::new(true, last.clone())),
            ),
        );
        Ok(Some(id))
    }

    /// Asks for the Edge's status; the answer comes as [`ControlPlaneEvent::StatusAnswered`].
    pub fn status(&mut self, now: Instant) -> Result<u64, ControlSessionError> {
        self.connected()?;
        let id = self.link.correlation_id();
        self.waiting.insert(id, Waiting::Status);
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeStatusRequest),
        );
        Ok(id)
    }

    /// Sends a command; the answer comes as [`ControlPlaneEvent::CommandAnswered`].
    pub fn command(
        &mut self,
        now: Instant,
        request: EdgeCommandRequest,
    ) -> Result<u64, ControlSessionError> {
        self.connected()?;
        let id = self.link.correlation_id();
        self.waiting.insert(id, Waiting::Command);
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeCommandRequest(request)),
        );
        Ok(id)
    }

    /// Takes usage records on this session: the hello answer says so, and
    /// [`ControlPlaneEvent::UsageReported`] comes for each report (without it, a report is a
    /// protocol violation). Call before [`Self::accept`].
    pub fn accept_usage(&mut self) {
        self.accepts_usage = true;
    }

    /// Answers [`ControlPlaneEvent::UsageReported`], once its records are stored.
    pub fn respond_usage(
        &mut self,
        now: Instant,
        id: u64,
        ack: EdgeUsageAck,
    ) -> Result<(), ControlSessionError> {
        self.connected()?;
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::EdgeUsageAck(ack)),
        );
        Ok(())
    }

    /// Answers [`ControlPlaneEvent::LeaseRequested`].
    pub fn respond_lease(
        &mut self,
        now: Instant,
        id: u64,
        response: AcquireLeaseResponse,
    ) -> Result<(), ControlSessionError> {
        self.connected()?;
        self.link.transmit(
            now,
            ControlFrame::correlated(id, ControlMessage::AcquireLeaseResponse(response)),
        );
        Ok(())
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Closed {
            return;
        }
        if let Some(reason) = self.link.expired(now, self.phase == Phase::Hello) {
            self.close(reason);
        }
    }

    /// The transport is gone.
    pub fn handle_transport_closed(&mut self) {
        self.close(ControlCloseReason::TransportClosed);
    }

    /// Closes the session from this side (shutdown, or a newer connection of the same Edge).
    pub fn close_local(&mut self) {
        self.close(ControlCloseReason::Local);
    }

    /// The next frame to write.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<ControlFrame> {
        self.link.transmits.pop_front()
    }

    /// The next event for the driver.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ControlPlaneEvent> {
        self.events.pop_front()
    }

    /// When [`ControlPlaneSession::handle_timeout`] must next be called; `None` once closed.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.phase != Phase::Closed).then(|| self.link.poll_timeout(false))
    }

    fn take(&mut self, id: u64, kind: Waiting) -> bool {
        if self.waiting.get(&id) == Some(&kind) {
            self.waiting.remove(&id);
            true
        } else {
            false
        }
    }

    fn connected(&self) -> Result<(), ControlSessionError> {
        match self.phase {
            Phase::Connected => Ok(()),
            _ => Err(ControlSessionError::NotConnected),
        }
    }

    fn close(&mut self, reason: ControlCloseReason) {
        if self.phase == Phase::Closed {
            return;
        }
        self.phase = Phase::Closed;
        let waiting = std::mem::take(&mut self.waiting);
        for (ticket, kind) in waiting {
            match kind {
                Waiting::Status => self.events.push_back(ControlPlaneEvent::StatusAnswered {
                    ticket,
                    result: Err(ControlSessionError::Closed),
                }),
                Waiting::Command => self.events.push_back(ControlPlaneEvent::CommandAnswered {
                    ticket,
                    result: Err(ControlSessionError::Closed),
                }),
                Waiting::Projection(_) => {}
            }
        }
        self.events.push_back(ControlPlaneEvent::Closed(reason));
    }
}
