//! The Node side of one runtime-wire connection, as a sans-io state machine.
//!
//! ```text
//!  new() ──RegisterRequest──▶ Registering ──RegisterResponse(accepted)──▶ Configuring
//!                                 │ rejected                                 │ NodeEvent::ApplyConfig
//!                                 ▼                                          │ caller applies config,
//!                              Closed                                        │ starts adapters, installs
//!                                 ▲                                          ▼ handlers: config_applied()
//!                                 │ ready=false / timeout / violation   AwaitingReady ──NodeReadyRequest──▶
//!                                 └──────────────────────────────────── NodeReadyResponse(ready) ──▶ Ready
//! ```
//!
//! Nothing is dispatched before the ready ack: until [`NodeEvent::Ready`] the session accepts
//! only `RegisterResponse`, `NodeReadyResponse`, `Ping` and `Pong`, and [`NodeSession::send`]
//! refuses application frames. A `ready=false` answer closes the session with its reason.
//!
//! # Driving it
//!
//! Like quinn-proto's `Connection`, the session never reads a clock or touches a socket:
//!
//! 1. feed every received frame to [`NodeSession::handle_frame`], and call
//!    [`NodeSession::handle_timeout`] when the instant from [`NodeSession::poll_timeout`] passes;
//! 2. after each call, drain [`NodeSession::poll_transmit`] into the socket, then
//!    [`NodeSession::poll_event`] until both return `None`;
//! 3. re-arm one timer from [`NodeSession::poll_timeout`].
//!
//! When [`NodeEvent::Closed`] comes out, close the socket; the reason's
//! [`CloseReason::is_retryable`] tells the supervisor what to do next.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use crate::health::HealthObservationSeq;
use crate::liveness::{HeartbeatConfig, Liveness};
use crate::runtime::{
    Capability, FailureEvidence, NodeCommandResponse, NodeConfigPayload, NodeReadyRequest,
    NodeReadyResponse, RegisterRequest, RegisterResponse, RunEvent, RunEventKind, RuntimeFrame,
    RuntimeMessage, TunnelFrame, TunnelPayload,
};
use crate::validate::{MAX_TEXT_LEN, floor_char_boundary};

/// Node session settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeSessionConfig {
    /// Heartbeat used until the Edge names one in `RegisterResponse`.
    pub heartbeat: HeartbeatConfig,
    /// How long registration plus readiness may take before the session gives up.
    pub handshake_timeout: Duration,
    /// This Node's frame limit, taken to be the Edge's too (the wire does not say the Edge's;
    /// both default to [`DEFAULT_MAX_FRAME_LEN`](crate::codec::DEFAULT_MAX_FRAME_LEN)). A run's
    /// start or terminal larger than this is replaced before it is queued
    /// ([`NodeSession::send`]).
    pub max_frame_len: usize,
}

impl Default for NodeSessionConfig {
    fn default() -> Self {
        Self {
            heartbeat: HeartbeatConfig::default(),
            handshake_timeout: Duration::from_secs(30),
            max_frame_len: crate::codec::DEFAULT_MAX_FRAME_LEN,
        }
    }
}

/// Where the handshake stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// `RegisterRequest` sent; waiting for the answer.
    Registering,
    /// Registration accepted; the caller is applying the config.
    Configuring,
    /// `NodeReadyRequest` sent; waiting for the ack.
    AwaitingReady,
    /// Dispatch-ready.
    Ready,
    /// Closed; see the [`NodeEvent::Closed`] reason.
    Closed,
}

/// What the session tells its driver.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
#[expect(
    clippy::large_enum_variant,
    reason = "events are moved once through a queue; boxing would allocate per frame"
)]
pub enum NodeEvent {
    /// Apply this configuration, start adapters and install handlers, then call
    /// [`NodeSession::config_applied`] (or [`NodeSession::config_failed`]).
    ApplyConfig {
        /// The Node identity the Edge confirmed.
        node_id: String,
        /// The configuration.
        config: NodeConfigPayload,
    },
    /// The Edge acknowledged ready: dispatch may flow.
    Ready,
    /// An application frame from the Edge (run, tunnel, cancel, command, config refresh).
    /// Only ever emitted after [`NodeEvent::Ready`].
    Frame(RuntimeFrame),
    /// A run's start or terminal that the Edge could not take was replaced by an `ERROR` of
    /// the same stream ([`NodeSession::send`]); for the driver's log.
    AnswerReplaced {
        /// The stream whose frame was replaced.
        stream_id: u64,
        /// Why, as the `ERROR` the Edge receives says it.
        reason: String,
    },
    /// The session is over; close the socket. Emitted exactly once.
    Closed(CloseReason),
}

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// The Edge refused the registration.
    RegistrationRejected {
        /// The Edge's reason.
        reason: String,
    },
    /// The Edge answered ready with `ready=false` (stale, superseded or rejected).
    NotReady {
        /// The Edge's reason.
        reason: String,
    },
    /// The caller could not apply the config.
    ConfigFailed {
        /// Stable reason.
        reason: String,
    },
    /// Register + ready did not finish within the handshake timeout.
    HandshakeTimeout,
    /// Nothing was received within the idle timeout.
    HeartbeatTimeout,
    /// The Edge sent something the protocol does not allow here.
    ProtocolViolation(&'static str),
    /// The transport closed underneath.
    TransportClosed,
    /// The caller closed the session (local shutdown).
    Local,
}

impl CloseReason {
    /// Whether reconnecting may help. Only a local close is not retryable: local config and
    /// credential errors happen before a session exists and are classified by the supervisor.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Self::Local)
    }
}

/// A call the session's current state does not allow (API misuse by the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NodeSessionError {
    /// An application frame was sent before the ready ack (or after close).
    #[error("session is not dispatch-ready")]
    NotReady,
    /// `config_applied`/`config_failed` outside the configuring state.
    #[error("no configuration is being applied")]
    NotConfiguring,
    /// The frame is one the Node never sends (an Edge → Node message or a handshake message).
    #[error("this message is not sent by a Node")]
    WrongDirection,
}

/// The Node side of one connection.
///
/// `Clone` copies the whole machine (model checkers explore from copies).
#[derive(Clone, Debug)]
pub struct NodeSession {
    state: NodeState,
    node_id: String,
    liveness: Liveness,
    handshake_deadline: Option<Instant>,
    next_correlation: u64,
    health_seq: HealthObservationSeq,
    max_frame_len: usize,
    /// Run ids of the runs and tunnels in progress on this connection.
    active: BTreeSet<String>,
    transmits: VecDeque<RuntimeFrame>,
    events: VecDeque<NodeEvent>,
}

/// What kind of stream a Node-side refusal ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// A normalized run (`RunRequest` → `RunEvent`s).
    Run,
    /// A provider tunnel (`ProviderTunnelRequest` → tunnel frames).
    Tunnel,
}

/// Why [`NodeSession::admit_run`] refused a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RunRefusal {
    /// The session is not dispatch-ready.
    #[error("session not ready")]
    NotReady,
    /// A run with this id is in progress on the connection.
    #[error("duplicate run id")]
    DuplicateRunId,
}

impl NodeSession {
    /// Starts a session on a freshly connected transport: queues `register`.
    pub fn new(config: NodeSessionConfig, register: RegisterRequest, now: Instant) -> Self {
        let node_id = register.node_id.clone();
        let mut session = Self {
            state: NodeState::Registering,
            node_id,
            liveness: Liveness::new(config.heartbeat, now),
            handshake_deadline: now.checked_add(config.handshake_timeout),
            next_correlation: 1,
            health_seq: HealthObservationSeq::new(),
            max_frame_len: config.max_frame_len,
            active: BTreeSet::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        };
        session.transmit(
            now,
            RuntimeFrame::new(RuntimeMessage::RegisterRequest(register)),
        );
        session
    }

    // === getters ===

    /// The handshake state.
    pub fn state(&self) -> NodeState {
        self.state
    }

    /// The Node id this session registers as.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Whether application frames may flow.
    pub fn is_ready(&self) -> bool {
        self.state == NodeState::Ready
    }

    // === input ===

    /// Handles one frame received from the Edge.
    pub fn handle_frame(&mut self, now: Instant, frame: RuntimeFrame) {
        if self.state == NodeState::Closed {
            return;
        }
        self.liveness.on_received(now);
        match (self.state, frame.message) {
            (_, RuntimeMessage::Ping) => {
                self.transmit(
                    now,
                    RuntimeFrame::correlated(frame.correlation_id, RuntimeMessage::Pong),
                );
            }
            (_, RuntimeMessage::Pong) => {}
            (NodeState::Registering, RuntimeMessage::RegisterResponse(resp)) => match resp {
                RegisterResponse::Accepted {
                    node_id,
                    config,
                    heartbeat_interval,
                } => {
                    if node_id != self.node_id {
                        self.close(CloseReason::ProtocolViolation(
                            "register response names another node",
                        ));
                        return;
                    }
                    if let Some(interval) = heartbeat_interval {
                        self.liveness
                            .set_config(HeartbeatConfig::from_interval(interval));
                    }
                    self.state = NodeState::Configuring;
                    self.events
                        .push_back(NodeEvent::ApplyConfig { node_id, config });
                }
                RegisterResponse::Rejected { reason } => {
                    self.close(CloseReason::RegistrationRejected { reason });
                }
            },
            (
                NodeState::AwaitingReady,
                RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready),
            ) => {
                self.state = NodeState::Ready;
                self.handshake_deadline = None;
                self.events.push_back(NodeEvent::Ready);
            }
            // The ack of a duplicate ready: nothing changes.
            (NodeState::Ready, RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready)) => {}
            // Stale, superseded or rejected, in whatever state the Edge noticed it.
            (_, RuntimeMessage::NodeReadyResponse(NodeReadyResponse::NotReady { reason })) => {
                self.close(CloseReason::NotReady { reason });
            }
            (
                NodeState::Ready,
                message @ (RuntimeMessage::RunRequest(_)
                | RuntimeMessage::ProviderTunnelRequest(_)
                | RuntimeMessage::CancelRequest(_)
                | RuntimeMessage::NodeCommandRequest(_)
                | RuntimeMessage::NodeConfigRefreshRequest(_)
                | RuntimeMessage::StreamWindowUpdate(_)),
            ) => {
                self.events
                    .push_back(NodeEvent::Frame(RuntimeFrame { message, ..frame }));
            }
            (NodeState::Ready, _) => {
                self.close(CloseReason::ProtocolViolation(
                    "unexpected message on a ready session",
                ));
            }
            _ => self.close(CloseReason::ProtocolViolation(
                "message before the ready ack",
            )),
        }
    }

    /// Handles the expiry of the instant returned by [`NodeSession::poll_timeout`].
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == NodeState::Closed {
            return;
        }
        if self.handshake_deadline.is_some_and(|d| now >= d) {
            self.close(CloseReason::HandshakeTimeout);
            return;
        }
        if self.liveness.idle_expired(now) {
            self.close(CloseReason::HeartbeatTimeout);
            return;
        }
        if self.liveness.ping_due(now) {
            let id = self.correlation_id();
            self.transmit(now, RuntimeFrame::correlated(id, RuntimeMessage::Ping));
        }
    }

    /// The transport closed underneath the session.
    pub fn handle_transport_closed(&mut self) {
        self.close(CloseReason::TransportClosed);
    }

    /// The bytes from the Edge did not decode as a valid frame (see
    /// [`FrameError`](crate::error::FrameError)): the session cannot continue.
    pub fn handle_invalid_frame(&mut self) {
        self.close(CloseReason::ProtocolViolation("invalid frame"));
    }

    // === commands ===

    /// The caller applied the config, started adapters and installed handlers: send ready.
    pub fn config_applied(&mut self, now: Instant) -> Result<(), NodeSessionError> {
        if self.state != NodeState::Configuring {
            return Err(NodeSessionError::NotConfiguring);
        }
        self.state = NodeState::AwaitingReady;
        let ready = NodeReadyRequest {
            node_id: self.node_id.clone(),
        };
        self.transmit(
            now,
            RuntimeFrame::new(RuntimeMessage::NodeReadyRequest(ready)),
        );
        Ok(())
    }

    /// The caller could not apply the config: close the session.
    pub fn config_failed(&mut self, reason: impl Into<String>) -> Result<(), NodeSessionError> {
        if self.state != NodeState::Configuring {
            return Err(NodeSessionError::NotConfiguring);
        }
        self.close(CloseReason::ConfigFailed {
            reason: reason.into(),
        });
        Ok(())
    }

    /// Queues an application frame (run event, tunnel frame, command or refresh response).
    ///
    /// A run's start or terminal (a `RunEvent` other than a delta; a tunnel's `RESPONSE_START`
    /// or `ERROR`) is made to fit what the Edge takes first, since one it could not take would
    /// end every run of the connection: one larger than
    /// [`NodeSessionConfig::max_frame_len`] (a provider's tool call of megabytes in the
    /// `COMPLETE` metadata, a tunnel's response headers) fails the writer, and one the Edge's
    /// validation refuses (an error text over [`MAX_TEXT_LEN`], a header name it forbids) is a
    /// protocol violation. An error text is cut to [`MAX_TEXT_LEN`] on a character boundary;
    /// anything else the wire would not carry is replaced by an `ERROR` of the same stream (and
    /// tunnel sequence) that says why, with a [`NodeEvent::AnswerReplaced`]. Deltas and tunnel
    /// bodies are not measured (once or twice per run, never per delta or body): the caller
    /// cuts them to size.
    pub fn send(&mut self, now: Instant, frame: RuntimeFrame) -> Result<(), NodeSessionError> {
        self.queue(now, frame, false)
    }

    fn queue(
        &mut self,
        now: Instant,
        frame: RuntimeFrame,
        stamp: bool,
    ) -> Result<(), NodeSessionError> {
        if self.state != NodeState::Ready {
            return Err(NodeSessionError::NotReady);
        }
        let mut frame = frame;
        if stamp {
            // Before the fit, which measures the frame as it goes out (a replaced frame then
            // leaves a gap in the numbers, which only ever compare as fresher or not).
            self.stamp(&mut frame);
        }
        let frame = match frame.message {
            RuntimeMessage::RunEvent(_) | RuntimeMessage::ProviderTunnelFrame(_) => {
                let (frame, replaced) = fit(frame, self.max_frame_len);
                if let Some(reason) = replaced {
                    self.events.push_back(NodeEvent::AnswerReplaced {
                        stream_id: frame.stream_id,
                        reason,
                    });
                }
                frame
            }
            RuntimeMessage::NodeCommandResponse(_)
            | RuntimeMessage::NodeConfigRefreshResponse(_) => frame,
            _ => return Err(NodeSessionError::WrongDirection),
        };
        self.transmit(now, frame);
        Ok(())
    }

    /// Admits a run or tunnel by its run id: refused when the session is not ready or the id is
    /// in progress on this connection (the one `CancelRequest` names must be unambiguous).
    /// Call [`NodeSession::run_finished`] after its terminal.
    pub fn admit_run(&mut self, run_id: &str) -> Result<(), RunRefusal> {
        if self.state != NodeState::Ready {
            return Err(RunRefusal::NotReady);
        }
        if !self.active.insert(run_id.to_owned()) {
            return Err(RunRefusal::DuplicateRunId);
        }
        Ok(())
    }

    /// A run admitted by [`NodeSession::admit_run`] sent its terminal (or was dropped).
    pub fn run_finished(&mut self, run_id: &str) {
        self.active.remove(run_id);
    }

    /// Runs in progress.
    pub fn active_runs(&self) -> usize {
        self.active.len()
    }

    /// Ends `stream_id` at once with a terminal carrying `reason` (a refused run or tunnel: its
    /// `ERROR` event, or a first-and-last tunnel `ERROR` frame with sequence 1).
    pub fn refuse(
        &mut self,
        now: Instant,
        stream_id: u64,
        kind: StreamKind,
        reason: &str,
    ) -> Result<(), NodeSessionError> {
        let message = match kind {
            StreamKind::Run => {
                let mut ev = RunEvent::new(RunEventKind::Error);
                ev.error = reason.to_owned();
                RuntimeMessage::RunEvent(ev)
            }
            StreamKind::Tunnel => RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                sequence: 1,
                payload: TunnelPayload::Error {
                    error: reason.to_owned(),
                    execution_failure: None,
                },
                metadata: BTreeMap::new(),
            }),
        };
        self.send(now, RuntimeFrame::on_stream(stream_id, message))
    }

    /// Sends a frame that may carry stall evidence (a run's `ERROR` event, a tunnel's `ERROR`
    /// frame), stamping valid evidence with the next connection-scoped
    /// `health_observation_seq` first (left empty on an unbound session), then made to fit as
    /// by [`NodeSession::send`].
    pub fn send_stamped(
        &mut self,
        now: Instant,
        frame: RuntimeFrame,
    ) -> Result<(), NodeSessionError> {
        self.queue(now, frame, true)
    }

    fn stamp(&mut self, frame: &mut RuntimeFrame) {
        let failure = match &mut frame.message {
            RuntimeMessage::RunEvent(ev) => ev.execution_failure.as_mut(),
            RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                payload:
                    TunnelPayload::Error {
                        execution_failure, ..
                    },
                ..
            }) => execution_failure.as_mut(),
            _ => None,
        };
        if let Some(FailureEvidence::Valid(f)) = failure {
            f.health_observation_seq = self.next_health_observation_seq();
        }
    }

    /// Answers a CAPABILITIES command: each entry gets the next `health_observation_seq`, in
    /// order.
    pub fn send_capabilities(
        &mut self,
        now: Instant,
        correlation_id: u64,
        mut capabilities: Vec<Capability>,
    ) -> Result<(), NodeSessionError> {
        for cap in &mut capabilities {
            cap.health_observation_seq = self.next_health_observation_seq().unwrap_or(1);
        }
        let resp = NodeCommandResponse {
            ok: true,
            capabilities,
            ..NodeCommandResponse::default()
        };
        self.send(
            now,
            RuntimeFrame::correlated(correlation_id, RuntimeMessage::NodeCommandResponse(resp)),
        )
    }

    /// Closes the session locally (shutdown).
    pub fn close_local(&mut self) {
        self.close(CloseReason::Local);
    }

    /// The next connection-scoped `health_observation_seq` (1, 2, 3, … shared by normalized and
    /// tunnel observations), or `None` on an unbound (not ready) session, which omits it.
    pub fn next_health_observation_seq(&mut self) -> Option<u64> {
        (self.state == NodeState::Ready).then(|| self.health_seq.next_seq())
    }

    // === output ===

    /// The next frame to write to the socket.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<RuntimeFrame> {
        self.transmits.pop_front()
    }

    /// The next event for the driver.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<NodeEvent> {
        self.events.pop_front()
    }

    /// When [`NodeSession::handle_timeout`] must next be called; `None` once closed.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state == NodeState::Closed {
            return None;
        }
        let mut t = self.liveness.ping_at().min(self.liveness.idle_deadline());
        if let Some(d) = self.handshake_deadline {
            t = t.min(d);
        }
        Some(t)
    }

    // === internals ===

    fn transmit(&mut self, now: Instant, frame: RuntimeFrame) {
        self.liveness.on_sent(now);
        self.transmits.push_back(frame);
    }

    fn correlation_id(&mut self) -> u64 {
        let id = self.next_correlation;
        self.next_correlation = self.next_correlation.wrapping_add(1).max(1);
        id
    }

    fn close(&mut self, reason: CloseReason) {
        if self.state == NodeState::Closed {
            return;
        }
        self.state = NodeState::Closed;
        self.handshake_deadline = None;
        self.active.clear();
        self.transmits.clear();
        self.events.push_back(NodeEvent::Closed(reason));
    }
}

/// `frame` as the Edge takes it (see [`NodeSession::send`]), and why it was replaced if it was.
fn fit(mut frame: RuntimeFrame, max_frame_len: usize) -> (RuntimeFrame, Option<String>) {
    let error_text = match &mut frame.message {
        RuntimeMessage::RunEvent(ev) if ev.kind == RunEventKind::Delta => return (frame, None),
        RuntimeMessage::RunEvent(ev) => Some(&mut ev.error),
        RuntimeMessage::ProviderTunnelFrame(tf) => match &mut tf.payload {
            TunnelPayload::Body(_) | TunnelPayload::Usage(_) | TunnelPayload::End => {
                return (frame, None);
            }
            TunnelPayload::Error { error, .. } => Some(error),
            TunnelPayload::ResponseStart { .. } => None,
        },
        _ => return (frame, None),
    };
    if let Some(text) = error_text {
        text.truncate(floor_char_boundary(text, MAX_TEXT_LEN));
    }
    let reason = match frame.validated_len() {
        Ok(len) if len <= max_frame_len => return (frame, None),
        Ok(len) => format!(
            "the provider's answer is too large for the Edge-Node wire \
             ({len} bytes, at most {max_frame_len})"
        ),
        Err(e) => format!("the provider's answer is not valid on the Edge-Node wire: {e}"),
    };
    let message = match frame.message {
        RuntimeMessage::ProviderTunnelFrame(tf) => {
            RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                sequence: tf.sequence,
                payload: TunnelPayload::Error {
                    error: reason.clone(),
                    execution_failure: None,
                },
                metadata: BTreeMap::new(),
            })
        }
        _ => {
            let mut ev = RunEvent::new(RunEventKind::Error);
            ev.error = reason.clone();
            RuntimeMessage::RunEvent(ev)
        }
    };
    (RuntimeFrame { message, ..frame }, Some(reason))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    /// A terminal over the frame limit becomes an `ERROR` of the same stream that fits; one
    /// under it, and any delta, pass unchanged.
    #[test]
    fn a_terminal_too_large_for_one_frame_becomes_an_error_that_fits() {
        let max = 64 * 1024;
        let mut complete = RunEvent::new(RunEventKind::Complete);
        complete
            .metadata
            .insert("openai_tool_calls".into(), "x".repeat(max));
        let frame = RuntimeFrame::on_stream(7, RuntimeMessage::RunEvent(complete));
        let (fitted, why) = fit(frame.clone(), max);
        assert!(why.is_some_and(|w| w.contains("too large")));
        assert_eq!(fitted.stream_id, 7);
        let RuntimeMessage::RunEvent(ev) = &fitted.message else {
            panic!("a run event")
        };
        assert_eq!(ev.kind, RunEventKind::Error);
        assert!(ev.error.contains("too large"), "{}", ev.error);
        assert!(fitted.encoded_len() <= max);
        assert_eq!(
            fit(frame.clone(), 2 * max),
            (frame.clone(), None),
            "under the limit: unchanged"
        );
        let mut delta = RunEvent::new(RunEventKind::Delta);
        delta.delta = "y".repeat(max);
        let delta = RuntimeFrame::on_stream(7, RuntimeMessage::RunEvent(delta));
        assert_eq!(
            fit(delta.clone(), max),
            (delta, None),
            "deltas are cut before, not here"
        );
        let error = RuntimeFrame::on_stream(
            9,
            RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                sequence: 3,
                payload: TunnelPayload::Error {
                    error: format!("a{}", "é".repeat(max)),
                    execution_failure: None,
                },
                metadata: Default::default(),
            }),
        );
        let (fitted, why) = fit(error, max);
        assert_eq!(why, None, "cut, not replaced");
        let RuntimeMessage::ProviderTunnelFrame(tf) = &fitted.message else {
            panic!("a tunnel frame")
        };
        assert_eq!((fitted.stream_id, tf.sequence), (9, 3));
        assert!(
            matches!(&tf.payload, TunnelPayload::Error { error, .. } if error.len() == MAX_TEXT_LEN - 1),
            "a long error text is cut to what the Edge accepts (on a character), not replaced"
        );
        assert!(fitted.validate().is_ok());
        // A header name the Edge's validation refuses: replaced by an error that says so.
        let start = RuntimeFrame::on_stream(
            9,
            RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                sequence: 1,
                payload: TunnelPayload::ResponseStart {
                    status: 200,
                    headers: vec![crate::runtime::Header {
                        name: "bad name".into(),
                        value: "v".into(),
                    }],
                },
                metadata: Default::default(),
            }),
        );
        let (fitted, why) = fit(start, max);
        assert!(why.is_some());
        let RuntimeMessage::ProviderTunnelFrame(tf) = &fitted.message else {
            panic!("a tunnel frame")
        };
        assert!(
            matches!(&tf.payload, TunnelPayload::Error { error, .. } if error.contains("not valid")),
            "{tf:?}"
        );
        assert!(fitted.validate().is_ok());
    }
}
