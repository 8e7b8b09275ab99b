//! The Edge side of the runtime wire: every Node connection and the Node-ownership registry,
//! as one sans-io state machine.
//!
//! # Ownership and generations (seed 000, "register와 readiness", "disconnect/reconnect")
//!
//! - One accepted connection owns exactly one Node id. A second, different Node id on the same
//!   connection is rejected without touching the first binding or its generation.
//! - An accepted registration claims the Node id as **pending** under a fresh connection
//!   generation. Pending is not dispatch-ready: nothing but register/ready (and ping/pong) is
//!   accepted from the connection, and [`Registry::send`] refuses application frames.
//! - `NodeReadyRequest` from the current pending owner flips it to **ready** and emits
//!   [`RegistryEvent::NodeReady`] once (activate resources, pump waiters, `node.connected`).
//!   A duplicate ready from the same ready owner is answered `ready=true` with no second event.
//!   Ready from a stale, superseded or unbound connection is answered `ready=false` with a
//!   reason, and that connection is closed.
//! - A new connection registering an already-owned Node id supersedes the old one with a new
//!   generation; the old connection is closed.
//! - A connection must register and report ready within
//!   [`RegistryConfig::handshake_timeout`] of being accepted, or it is closed
//!   ([`FenceCause::HandshakeTimeout`]); answering pings does not keep it open.
//! - The end of the current **ready** owner's generation — its close, its heartbeat timeout,
//!   or its supersession — emits [`RegistryEvent::NodeFenced`] exactly once (release provider
//!   leases, mark resources offline, re-evaluate the queue). Callbacks from stale connections
//!   change nothing.
//!
//! Correctness transitions (fencing, lease release) are events the caller must handle
//! synchronously; they never depend on a droppable fan-out.
//!
//! # Driving it
//!
//! The driver accepts a TLS connection, learns the peer's workload name, and calls
//! [`Registry::accept`]. It then feeds frames ([`Registry::handle_frame`]), transport closes
//! ([`Registry::handle_close`]) and timer expiries ([`Registry::handle_timeout`]), and after each
//! call drains [`Registry::poll_transmit`] (frames to write to a connection) and
//! [`Registry::poll_event`] (including [`RegistryEvent::CloseConnection`]), then re-arms one
//! timer from [`Registry::poll_timeout`]. Time is always an argument.
//!
//! # Example: a Node and the Edge complete the handshake in memory
//!
//! ```
//! use std::time::Instant;
//! use bytes::BytesMut;
//! use iop_wire::codec::FrameCodec;
//! use iop_edge_core::registry::{Registry, RegistryConfig, RegistryEvent};
//! use iop_wire::node::{NodeEvent, NodeSession, NodeSessionConfig};
//! use iop_wire::runtime::{NodeConfigPayload, RegisterRequest, RuntimeFrame};
//!
//! let now = Instant::now();
//! let mut edge = Registry::new(RegistryConfig::default());
//! edge.set_node_config("node-1", Some(NodeConfigPayload::default()));
//! let conn = edge.accept(now, Some("node-1".to_owned()));
//!
//! let register = RegisterRequest { node_id: "node-1".into(), ..Default::default() };
//! let mut node = NodeSession::new(NodeSessionConfig::default(), register, now);
//! let codec = FrameCodec::new();
//!
//! // Move frames both ways through real bytes until both sides are quiet.
//! loop {
//!     let mut moved = false;
//!     while let Some(frame) = node.poll_transmit() {
//!         let mut buf = BytesMut::new();
//!         codec.encode(&frame, &mut buf).unwrap();
//!         let frame: RuntimeFrame = codec.decode(&mut buf).unwrap().unwrap();
//!         edge.handle_frame(now, conn, frame);
//!         moved = true;
//!     }
//!     while let Some((_, frame)) = edge.poll_transmit() {
//!         node.handle_frame(now, frame);
//!         moved = true;
//!     }
//!     while let Some(event) = node.poll_event() {
//!         if let NodeEvent::ApplyConfig { .. } = event {
//!             // Apply the config, start adapters, install handlers; then:
//!             node.config_applied(now).unwrap();
//!             moved = true;
//!         }
//!     }
//!     if !moved { break; }
//! }
//! assert!(node.is_ready());
//! assert!(edge.ready_generation("node-1").is_some());
//! assert!(std::iter::from_fn(|| edge.poll_event())
//!     .any(|e| matches!(e, RegistryEvent::NodeReady { .. })));
//! ```

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::time::Instant;

mod types;
pub use types::*;

use iop_wire::liveness::Liveness;
use iop_wire::runtime::{
    NodeConfigPayload, NodeReadyRequest, NodeReadyResponse, RegisterRequest, RegisterResponse,
    RuntimeFrame, RuntimeMessage,
};

/// The longest Node version kept from a registration ([`RegistryEvent::Registered`]); a longer
/// one is cut at a character boundary (the wire allows far longer text, and the Edge keeps it
/// for every Node for as long as it is registered).
pub const MAX_VERSION_LEN: usize = 64;

/// `s` cut to at most `max` bytes, at a character boundary.
fn truncated(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.shrink_to_fit();
    }
    s
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Pending,
    Ready,
}

#[derive(Clone, Debug)]
struct Owner {
    conn: ConnId,
    generation: Generation,
    phase: Phase,
}

#[derive(Clone, Debug)]
enum Binding {
    /// No registration yet.
    Unbound,
    /// Registered `node_id` under `generation`; current only while the owner table agrees.
    Bound {
        node_id: String,
        generation: Generation,
    },
}

#[derive(Clone, Debug)]
struct Conn {
    peer_name: Option<String>,
    binding: Binding,
    liveness: Liveness,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum TimerKind {
    Ping,
    Idle,
    Handshake,
}

/// The Edge's connections and Node ownership. See the module docs.
///
/// `Clone` copies the whole machine (model checkers explore from copies), and its maps are
/// ordered, so its `Debug` form is the same for the same state whatever history built it (up
/// to the layout of the timer heap).
#[derive(Clone, Debug)]
pub struct Registry {
    config: RegistryConfig,
    node_configs: BTreeMap<String, NodeConfigPayload>,
    conns: BTreeMap<ConnId, Conn>,
    owners: BTreeMap<String, Owner>,
    next_conn: u64,
    next_generation: u64,
    next_correlation: u64,
    /// Managed mode: the lease issuer key id a registering Node must trust, when known.
    required_issuer: Option<String>,
    /// One entry per (connection, timer kind); re-pushed lazily when it fires early.
    timers: BinaryHeap<Reverse<(Instant, ConnId, TimerKind)>>,
    transmits: VecDeque<(ConnId, RuntimeFrame)>,
    events: VecDeque<RegistryEvent>,
}

impl Registry {
    /// An empty registry.
    pub fn new(config: RegistryConfig) -> Self {
        Self {
            config,
            node_configs: BTreeMap::new(),
            conns: BTreeMap::new(),
            owners: BTreeMap::new(),
            next_conn: 1,
            next_generation: 1,
            next_correlation: 1,
            required_issuer: None,
            timers: BinaryHeap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    // === configuration ===

    /// Managed mode: from now on a registration naming issuer key ids must include `key_id`
    /// (the key the Control Plane signs leases with), or it is refused with
    /// [`reason::ISSUER_KEY_NOT_TRUSTED`] and a [`RegistryEvent::RegisterRefused`]: a Node that
    /// could open none of its leases is never made ready, so it is never selected. A
    /// registration naming no ids (an older Node, legacy mode) is not checked. Nodes already
    /// registered are not fenced here (their in-flight leases were signed with a key they
    /// trust); the Edge stops selecting them (`iop_edge_core::EdgeCore::set_issuers`).
    pub fn set_required_issuer(&mut self, key_id: Option<String>) {
        self.required_issuer = key_id.filter(|k| !k.is_empty());
    }

    /// The issuer key id registrations must trust, if any.
    pub fn required_issuer(&self) -> Option<&str> {
        self.required_issuer.as_deref()
    }

    /// Sets (or with `None` removes) the config payload a Node id receives on registration.
    /// Takes effect at the next registration; live sessions get a config refresh from the
    /// caller.
    pub fn set_node_config(&mut self, node_id: &str, config: Option<NodeConfigPayload>) {
        match config {
            Some(c) => self.node_configs.insert(node_id.to_owned(), c),
            None => self.node_configs.remove(node_id),
        };
    }

    // === getters ===

    /// The current dispatch-ready generation of `node_id`, if any.
    pub fn ready_generation(&self, node_id: &str) -> Option<(ConnId, Generation)> {
        self.owners
            .get(node_id)
            .filter(|o| o.phase == Phase::Ready)
            .map(|o| (o.conn, o.generation))
    }

    /// The current pending generation of `node_id`, if any.
    pub fn pending_generation(&self, node_id: &str) -> Option<(ConnId, Generation)> {
        self.owners
            .get(node_id)
            .filter(|o| o.phase == Phase::Pending)
            .map(|o| (o.conn, o.generation))
    }

    /// Whether `(node_id, generation)` is the current dispatch-ready owner.
    pub fn is_current_ready(&self, node_id: &str, generation: Generation) -> bool {
        self.ready_generation(node_id)
            .is_some_and(|(_, g)| g == generation)
    }

    /// Every dispatch-ready Node and its generation, sorted by Node id.
    pub fn ready_nodes(&self) -> Vec<(String, Generation)> {
        let mut out: Vec<_> = self
            .owners
            .iter()
            .filter(|(_, o)| o.phase == Phase::Ready)
            .map(|(n, o)| (n.clone(), o.generation))
            .collect();
        out.sort();
        out
    }

    /// When something was last received on `node_id`'s current connection (pending or
    /// ready): its last heartbeat, or any later frame.
    pub fn last_heard(&self, node_id: &str) -> Option<Instant> {
        let owner = self.owners.get(node_id)?;
        self.conns
            .get(&owner.conn)
            .map(|c| c.liveness.last_received())
    }

    /// Number of open connections.
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    // === input ===

    /// Registers a newly accepted, authenticated connection. `peer_name` is the name from the
    /// peer's workload identity; when present, registration must use it as the Node id.
    pub fn accept(&mut self, now: Instant, peer_name: Option<String>) -> ConnId {
        let id = ConnId(self.next_conn);
        self.next_conn += 1;
        let liveness = Liveness::new(self.config.heartbeat, now);
        self.timers
            .push(Reverse((liveness.ping_at(), id, TimerKind::Ping)));
        self.timers
            .push(Reverse((liveness.idle_deadline(), id, TimerKind::Idle)));
        if let Some(at) = now.checked_add(self.config.handshake_timeout) {
            self.timers.push(Reverse((at, id, TimerKind::Handshake)));
        }
        self.conns.insert(
            id,
            Conn {
                peer_name,
                binding: Binding::Unbound,
                liveness,
            },
        );
        id
    }

    /// Handles one frame received on `conn`. Frames for unknown (closed) connections are ignored.
    pub fn handle_frame(&mut self, now: Instant, conn: ConnId, frame: RuntimeFrame) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.liveness.on_received(now);
        match frame.message {
            RuntimeMessage::Ping => {
                let pong = RuntimeFrame::correlated(frame.correlation_id, RuntimeMessage::Pong);
                self.transmit(now, conn, pong);
            }
            RuntimeMessage::Pong => {}
            RuntimeMessage::RegisterRequest(req) => self.handle_register(now, conn, req),
            RuntimeMessage::NodeReadyRequest(req) => self.handle_ready(now, conn, req),
            message @ (RuntimeMessage::RunEvent(_)
            | RuntimeMessage::ProviderTunnelFrame(_)
            | RuntimeMessage::NodeCommandResponse(_)
            | RuntimeMessage::NodeConfigRefreshResponse(_)) => {
                match self.current_owner_of(conn) {
                    Some((node_id, generation, Phase::Ready)) => {
                        let frame = RuntimeFrame { message, ..frame };
                        self.events.push_back(RegistryEvent::Frame {
                            conn,
                            node_id,
                            generation,
                            frame,
                        });
                    }
                    // Nothing but register/ready is accepted before ready; stale connections
                    // are closed without touching live state.
                    _ => self.close(conn, FenceCause::ProtocolViolation),
                }
            }
            _ => self.close(conn, FenceCause::ProtocolViolation),
        }
    }

    /// The transport of `conn` closed. Fences the generation if `conn` was the ready owner;
    /// a stale or unknown connection changes nothing.
    pub fn handle_close(&mut self, conn: ConnId) {
        self.drop_conn(conn, FenceCause::Closed);
    }

    /// Handles timer expiry: pings idle-sending connections and closes silent ones.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&Reverse((at, conn, kind))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            let Some(c) = self.conns.get(&conn) else {
                continue; // closed connection: its timer entries just fall away
            };
            match kind {
                TimerKind::Handshake => {
                    let ready = matches!(self.current_owner_of(conn), Some((_, _, Phase::Ready)));
                    if !ready {
                        self.close(conn, FenceCause::HandshakeTimeout);
                    }
                }
                TimerKind::Idle if c.liveness.idle_expired(now) => {
                    self.close(conn, FenceCause::HeartbeatTimeout);
                }
                TimerKind::Idle => {
                    let at = c.liveness.idle_deadline();
                    self.timers.push(Reverse((at, conn, kind)));
                }
                TimerKind::Ping => {
                    if c.liveness.ping_due(now) {
                        let id = self.correlation_id();
                        self.transmit(
                            now,
                            conn,
                            RuntimeFrame::correlated(id, RuntimeMessage::Ping),
                        );
                    }
                    if let Some(c) = self.conns.get(&conn) {
                        self.timers
                            .push(Reverse((c.liveness.ping_at(), conn, kind)));
                    }
                }
            }
        }
    }

    // === commands ===

    /// Queues an Edge → Node application frame (run, tunnel, cancel, command, config refresh)
    /// for the current dispatch-ready owner of `node_id`, checking that `generation` is still
    /// current. Returns the connection it will be written to.
    pub fn send(
        &mut self,
        now: Instant,
        node_id: &str,
        generation: Generation,
        frame: RuntimeFrame,
    ) -> Result<ConnId, SendError> {
        if !matches!(
            frame.message,
            RuntimeMessage::RunRequest(_)
                | RuntimeMessage::ProviderTunnelRequest(_)
                | RuntimeMessage::CancelRequest(_)
                | RuntimeMessage::NodeCommandRequest(_)
                | RuntimeMessage::NodeConfigRefreshRequest(_)
                | RuntimeMessage::StreamWindowUpdate(_)
        ) {
            return Err(SendError::WrongDirection);
        }
        let (conn, current) = self.ready_generation(node_id).ok_or(SendError::NotReady)?;
        if current != generation {
            return Err(SendError::NotReady);
        }
        // Validate exactly as the Node will (one encode + decode per request, not per frame of
        // a stream): a bad field in one request must not cost the Node its session. A window
        // update (a stream id and a number) cannot be invalid.
        let frame = if matches!(frame.message, RuntimeMessage::StreamWindowUpdate(_)) {
            frame
        } else {
            // Moved into its protobuf form and back, not cloned: what is queued is the frame
            // the Node will decode.
            let (frame, len) = frame.into_validated().map_err(SendError::Invalid)?;
            if len > self.config.max_frame_len {
                return Err(SendError::TooLarge {
                    len,
                    max: self.config.max_frame_len,
                });
            }
            frame
        };
        self.transmit(now, conn, frame);
        Ok(conn)
    }

    /// Closes `conn` locally (e.g. Edge shutdown or an operator action).
    pub fn close(&mut self, conn: ConnId, cause: FenceCause) {
        if self.drop_conn(conn, cause) {
            self.events
                .push_back(RegistryEvent::CloseConnection { conn, cause });
        }
    }

    // === output ===

    /// The next frame to write, and the connection to write it to.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<(ConnId, RuntimeFrame)> {
        self.transmits.pop_front()
    }

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<RegistryEvent> {
        self.events.pop_front()
    }

    /// When [`Registry::handle_timeout`] must next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _, _))| *at)
    }

    // === internals ===

    fn handle_register(&mut self, now: Instant, conn: ConnId, req: RegisterRequest) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        match &c.binding {
            Binding::Bound { node_id, .. } => {
                // The first binding and generation stay exactly as they are.
                let reason = if *node_id == req.node_id {
                    reason::ALREADY_REGISTERED
                } else {
                    reason::CONNECTION_OWNS_ANOTHER_NODE
                };
                self.transmit(now, conn, rejected_register(reason));
                return;
            }
            Binding::Unbound => {}
        }
        if c.peer_name
            .as_deref()
            .is_some_and(|peer| peer != req.node_id)
        {
            self.transmit(now, conn, rejected_register(reason::IDENTITY_MISMATCH));
            self.close(conn, FenceCause::Rejected);
            return;
        }
        let Some(config) = self
            .node_configs
            .get(&req.node_id)
            .or(self.config.default_node_config.as_ref())
            .cloned()
        else {
            self.transmit(now, conn, rejected_register(reason::NODE_NOT_CONFIGURED));
            self.close(conn, FenceCause::Rejected);
            return;
        };
        if let Some(required) = &self.required_issuer
            && !pins_trust(&req.issuer_key_ids, required)
        {
            let why = format!(
                "{}: the control plane signs leases with {required}; this node trusts {}; pin the key `iop-cp issuer-key` prints",
                reason::ISSUER_KEY_NOT_TRUSTED,
                req.issuer_key_ids.join(", ")
            );
            self.transmit(now, conn, rejected_register(&why));
            self.close(conn, FenceCause::Rejected);
            self.events.push_back(RegistryEvent::RegisterRefused {
                node_id: req.node_id,
                reason: why,
            });
            return;
        }

        let generation = Generation(self.next_generation);
        self.next_generation += 1;
        let node_id = req.node_id;
        let recipient = req.recipient;
        let issuer_key_ids = req.issuer_key_ids;
        let stream_credit = req.stream_credit;
        let version = truncated(req.version, MAX_VERSION_LEN);
        let previous = self.owners.insert(
            node_id.clone(),
            Owner {
                conn,
                generation,
                phase: Phase::Pending,
            },
        );
        if let Some(c) = self.conns.get_mut(&conn) {
            c.binding = Binding::Bound {
                node_id: node_id.clone(),
                generation,
            };
        }
        if let Some(old) = previous {
            if old.phase == Phase::Ready {
                self.events.push_back(RegistryEvent::NodeFenced {
                    node_id: node_id.clone(),
                    generation: old.generation,
                    cause: FenceCause::Superseded,
                });
            }
            // The old connection is now stale: tell it why, then close it. Its binding still
            // names the old generation, so anything it sends later changes nothing.
            let not_ready = NodeReadyResponse::NotReady {
                reason: reason::SUPERSEDED.to_owned(),
            };
            self.transmit(
                now,
                old.conn,
                RuntimeFrame::new(RuntimeMessage::NodeReadyResponse(not_ready)),
            );
            self.close(old.conn, FenceCause::Superseded);
        }
        self.events.push_back(RegistryEvent::Registered {
            conn,
            node_id: node_id.clone(),
            generation,
            recipient,
            issuer_key_ids,
            version,
            stream_credit,
        });
        let accepted = RegisterResponse::Accepted {
            node_id,
            config,
            heartbeat_interval: Some(self.config.heartbeat.interval),
        };
        self.transmit(
            now,
            conn,
            RuntimeFrame::new(RuntimeMessage::RegisterResponse(accepted)),
        );
    }

    fn handle_ready(&mut self, now: Instant, conn: ConnId, req: NodeReadyRequest) {
        let owner = self.current_owner_of(conn);
        match owner {
            Some((node_id, generation, phase)) if node_id == req.node_id => {
                if phase == Phase::Pending {
                    if let Some(o) = self.owners.get_mut(&node_id) {
                        o.phase = Phase::Ready;
                    }
                    self.events.push_back(RegistryEvent::NodeReady {
                        conn,
                        node_id,
                        generation,
                    });
                }
                // First transition and duplicate ready from the same ready owner: both true.
                let ready =
                    RuntimeFrame::new(RuntimeMessage::NodeReadyResponse(NodeReadyResponse::Ready));
                self.transmit(now, conn, ready);
            }
            _ => {
                let superseded = matches!(
                    self.conns.get(&conn).map(|c| &c.binding),
                    Some(Binding::Bound { node_id, .. }) if *node_id == req.node_id
                );
                let reason = if superseded {
                    reason::SUPERSEDED
                } else {
                    reason::NOT_REGISTERED
                };
                let not_ready = NodeReadyResponse::NotReady {
                    reason: reason.to_owned(),
                };
                self.transmit(
                    now,
                    conn,
                    RuntimeFrame::new(RuntimeMessage::NodeReadyResponse(not_ready)),
                );
                self.close(conn, FenceCause::Rejected);
            }
        }
    }

    /// `(node_id, generation, phase)` if `conn` is the current owner of its bound Node id.
    fn current_owner_of(&self, conn: ConnId) -> Option<(String, Generation, Phase)> {
        let Binding::Bound {
            node_id,
            generation,
        } = &self.conns.get(&conn)?.binding
        else {
            return None;
        };
        let owner = self.owners.get(node_id)?;
        (owner.conn == conn && owner.generation == *generation)
            .then(|| (node_id.clone(), *generation, owner.phase))
    }

    /// Forgets `conn`; fences its generation if it was the current ready owner. Returns
    /// whether the connection was known.
    fn drop_conn(&mut self, conn: ConnId, cause: FenceCause) -> bool {
        let owner = self.current_owner_of(conn);
        let Some(_) = self.conns.remove(&conn) else {
            return false;
        };
        if let Some((node_id, generation, phase)) = owner {
            self.owners.remove(&node_id);
            if phase == Phase::Ready {
                self.events.push_back(RegistryEvent::NodeFenced {
                    node_id,
                    generation,
                    cause,
                });
            }
        }
        true
    }

    fn transmit(&mut self, now: Instant, conn: ConnId, frame: RuntimeFrame) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.liveness.on_sent(now);
            self.transmits.push_back((conn, frame));
        }
    }

    fn correlation_id(&mut self) -> u64 {
        let id = self.next_correlation;
        self.next_correlation = self.next_correlation.wrapping_add(1).max(1);
        id
    }
}

fn rejected_register(reason: &str) -> RuntimeFrame {
    RuntimeFrame::new(RuntimeMessage::RegisterResponse(
        RegisterResponse::Rejected {
            reason: reason.to_owned(),
        },
    ))
}
