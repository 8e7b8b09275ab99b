//! The registry's identifiers, events, errors and settings.

use std::time::Duration;

#[cfg(doc)]
use super::Registry;
use iop_wire::liveness::HeartbeatConfig;
use iop_wire::runtime::{NodeConfigPayload, RecipientKey, RuntimeFrame};

/// Identifies one accepted transport connection. Never reused within a [`Registry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// A connection generation: a fresh one for every accepted registration of a Node id.
/// Internal to the Edge; never sent on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// The Edge's issuer-trust rule, the one place it is decided: a Node that pinned issuer key ids
/// at registration (`RegisterRequest.issuer_key_ids`) can verify leases signed with `key_id`
/// only if it pinned that id. A Node that pinned none (legacy) and an empty `key_id` (an older
/// Control Plane names none) are not checked. The registry refuses a registration by it, and
/// `EdgeCore` excludes a registered Node and checks each managed binding by it.
pub fn pins_trust(pins: &[String], key_id: &str) -> bool {
    key_id.is_empty() || pins.is_empty() || pins.iter().any(|p| p == key_id)
}

/// Stable reasons sent to Nodes in `RegisterResponse`/`NodeReadyResponse` and used when closing.
pub mod reason {
    /// The connection already owns a different Node id.
    pub const CONNECTION_OWNS_ANOTHER_NODE: &str = "connection already owns another node";
    /// The connection already registered this Node id.
    pub const ALREADY_REGISTERED: &str = "already registered on this connection";
    /// The Node id is not configured on this Edge.
    pub const NODE_NOT_CONFIGURED: &str = "node is not configured";
    /// The Node id differs from the peer's workload identity.
    pub const IDENTITY_MISMATCH: &str = "node id does not match the peer identity";
    /// A newer connection took over this Node id.
    pub const SUPERSEDED: &str = "superseded by a newer connection";
    /// Ready from a connection that holds no registration for that Node id.
    pub const NOT_REGISTERED: &str = "not registered on this connection";
    /// Managed mode: the Node does not trust the key the Control Plane signs leases with
    /// (the full reason names the key and the ones the Node trusts).
    pub const ISSUER_KEY_NOT_TRUSTED: &str = "issuer key not trusted";
}

/// Why a connection is being closed or a generation was fenced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FenceCause {
    /// The transport closed.
    Closed,
    /// Nothing was received within the idle timeout.
    HeartbeatTimeout,
    /// A newer connection registered the same Node id.
    Superseded,
    /// The peer broke the protocol.
    ProtocolViolation,
    /// A registration or ready request was refused.
    Rejected,
    /// The caller asked ([`Registry::close`]).
    Local,
    /// The connection did not register and report ready within the handshake timeout.
    HandshakeTimeout,
    /// The peer did not read what was sent to it (its outbound queue filled up).
    NotReading,
}

impl FenceCause {
    /// A stable lower-case name, for logs and bounded metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::HeartbeatTimeout => "heartbeat_timeout",
            Self::Superseded => "superseded",
            Self::ProtocolViolation => "protocol_violation",
            Self::Rejected => "rejected",
            Self::Local => "local",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::NotReading => "not_reading",
        }
    }
}

/// What the registry tells its driver.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum RegistryEvent {
    /// A registration was accepted: `node_id` is claimed as *pending* on `conn`. Not
    /// dispatch-ready; no connected availability or event follows from this.
    Registered {
        /// The connection.
        conn: ConnId,
        /// The Node.
        node_id: String,
        /// The new generation.
        generation: Generation,
        /// The lease recipient key the Node announced in this registration (managed mode):
        /// learned over the authenticated connection, valid for this generation only.
        recipient: Option<RecipientKey>,
        /// The lease issuer key ids the Node pins (empty: not announced, not checked).
        issuer_key_ids: Vec<String>,
        /// The Node's software version, as it announced it (diagnostic; the peer's words, at
        /// most [`crate::registry::MAX_VERSION_LEN`] bytes).
        version: String,
        /// The Node honours per-stream credit on tunnel bodies
        /// ([`iop_wire::runtime::RegisterRequest::stream_credit`]).
        stream_credit: bool,
    },
    /// First ready transition of the current owner: activate the generation's provider
    /// resources, pump stranded waiters, publish `node.connected`.
    NodeReady {
        /// The connection.
        conn: ConnId,
        /// The Node.
        node_id: String,
        /// The generation now dispatch-ready.
        generation: Generation,
    },
    /// The ready generation ended: release its provider leases exactly once, mark its resources
    /// offline/excluded, re-evaluate the queue against live candidates, publish
    /// `node.disconnected`. Emitted exactly once per ready generation.
    NodeFenced {
        /// The Node.
        node_id: String,
        /// The generation that ended.
        generation: Generation,
        /// Why.
        cause: FenceCause,
    },
    /// An application frame from a ready owner, tagged with the transport reception identity
    /// (never the payload's claims).
    Frame {
        /// The connection it arrived on.
        conn: ConnId,
        /// The Node that connection owns.
        node_id: String,
        /// The generation it owns.
        generation: Generation,
        /// The frame.
        frame: RuntimeFrame,
    },
    /// Close this connection's socket (after writing any frames already polled for it).
    CloseConnection {
        /// The connection.
        conn: ConnId,
        /// Why.
        cause: FenceCause,
    },
    /// A registration was refused for a reason the operator must act on (the Node's
    /// configuration disagrees with the Edge's or the Control Plane's); the same reason went
    /// to the Node.
    RegisterRefused {
        /// The Node id the registration named.
        node_id: String,
        /// What disagrees.
        reason: String,
    },
}

/// Why [`Registry::send`] refused a frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The Node has no dispatch-ready owner, or the generation is no longer current.
    #[error("node generation is not dispatch-ready")]
    NotReady,
    /// The frame is not an Edge → Node application message.
    #[error("this message is not sent by the Edge after ready")]
    WrongDirection,
    /// The frame would not pass the Node's validation (e.g. an id with forbidden characters).
    /// Sending it would make the Node close the whole session, so it is refused here.
    #[error("invalid message: {0}")]
    Invalid(iop_wire::error::InvalidMessage),
    /// The frame's envelope is longer than [`RegistryConfig::max_frame_len`]: the connection's
    /// writer could not send it (and a Node would refuse it), so it is refused here, alone.
    #[error("frame of {len} bytes exceeds the wire's limit of {max}")]
    TooLarge {
        /// The envelope's encoded length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// How long an accepted connection has to register and report ready by default.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Registry settings.
#[derive(Clone, Debug)]
pub struct RegistryConfig {
    /// Heartbeat for every connection; its interval is announced to Nodes.
    pub heartbeat: HeartbeatConfig,
    /// Config for Node ids not configured explicitly. `None` rejects unknown Node ids.
    pub default_node_config: Option<NodeConfigPayload>,
    /// A connection that is not the dispatch-ready owner of a Node id this long after it was
    /// accepted is closed ([`FenceCause::HandshakeTimeout`]): pings alone do not keep an
    /// unregistered connection open. `Duration::MAX` disables it.
    pub handshake_timeout: Duration,
    /// The largest frame envelope [`Registry::send`] sends
    /// ([`iop_wire::codec::DEFAULT_MAX_FRAME_LEN`] by default; the Edge's transport uses the
    /// smaller of this and its codec's limit). A request over it (a client's body close to the
    /// HTTP limit, with the request's other fields) is refused with [`SendError::TooLarge`]
    /// before it reaches the connection.
    ///
    /// [`Registry::send`]: crate::registry::Registry::send
    pub max_frame_len: usize,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            heartbeat: HeartbeatConfig::default(),
            default_node_config: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
        }
    }
}
