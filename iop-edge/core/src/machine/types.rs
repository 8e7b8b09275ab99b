//! What a driver of [`EdgeCore`](super::EdgeCore) sees: its events, errors, stream sinks and
//! settings.

use std::time::Duration;

use iop_wire::runtime::{
    NodeCommandResponse, NodeConfigRefreshResponse, ProviderTunnelRequest, RecipientKey, RunEvent,
    RunRequest,
};
use iop_wire::tunnel_order::{Delivery, Violation};

#[cfg(doc)]
use super::EdgeCore;
use crate::pool::{Lease, RequestId};
use crate::registry::{ConnId, FenceCause, Generation};

/// Reason text of the synthetic terminal sent when a run's Node generation is fenced.
pub const NODE_DISCONNECTED: &str = "node disconnected";

/// Reason text of the terminal that ends a stream whose reader fell behind.
pub const SLOW_CONSUMER: &str = "slow consumer";

/// What a push into a stream's buffer left behind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Level {
    /// Unread bytes after the push.
    pub bytes: usize,
    /// Reads so far (progress).
    pub reads: u64,
}

/// The writing end of one stream's buffer, as the machine sees it. The machine pushes a
/// stream's events into it as soon as they are routed (it never waits for a reader) and
/// watches the level to end a stream whose reader falls behind.
pub trait StreamSink<T> {
    /// Queues `item`, counted as `size` bytes. `None` when the reader is gone.
    fn push(&self, item: T, size: usize) -> Option<Level>;
    /// Drops everything unread and queues `terminal` alone.
    fn replace_with(&self, terminal: T);
    /// The current level.
    fn level(&self) -> Level;
}

/// The stream buffer types a driver uses.
pub trait Sinks {
    /// Where a run's events go.
    type Run: StreamSink<RunEvent>;
    /// Where a tunnel's events go.
    type Tunnel: StreamSink<TunnelEvent>;
}

/// Counters the machine reports to (the driver's metrics). Every method defaults to nothing.
pub trait Observer: Send + Sync {
    /// A stream was ended because its reader fell behind.
    fn slow_consumer(&self) {}
    /// A stall terminal's evidence was (or was not) confirmed against its lease.
    fn recovery_eligibility(&self, _confirmed: bool) {}
    /// Confirmed stall evidence, by provider health.
    fn health_evidence(&self, _provider_health: &str) {}
    /// A recovery probe answer cleared (or did not clear) an overlay.
    fn recovery_result(&self, _cleared: bool) {}
    /// A runtime-unavailable overlay was set (`true`) or cleared.
    fn health_transition(&self, _to_unavailable: bool) {}
    /// A queued request's wait for a provider ran out.
    fn wait_timeout(&self) {}
}

/// An observer that counts nothing.
#[derive(Debug, Default)]
pub struct NoObserver;

impl Observer for NoObserver {}

/// One event of a provider tunnel, in order. Exactly one terminal ends the stream: the Node's
/// END or ERROR, an ordering violation, or the Node's disconnect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TunnelEvent {
    /// A frame that passed the ordering rules (`iop_wire::tunnel_order`).
    Frame(Delivery),
    /// The Node broke the ordering rules; the Edge sent `CancelRequest`. Terminal.
    Violation(Violation),
    /// The Node's generation was fenced before its terminal. Terminal.
    NodeDisconnected,
    /// No response started within the caller's wait timeout; the Edge sent `CancelRequest`.
    /// Terminal.
    WaitTimeout,
    /// The reader fell behind past the stream's byte bound or slow-consumer timeout; its
    /// backlog was dropped and the Edge sent `CancelRequest`. Terminal.
    SlowConsumer,
}

impl TunnelEvent {
    /// Whether this event ends the stream.
    pub fn is_terminal(&self) -> bool {
        match self {
            Self::Frame(d) => d.is_terminal(),
            Self::Violation(_)
            | Self::NodeDisconnected
            | Self::WaitTimeout
            | Self::SlowConsumer => true,
        }
    }
}

/// The lease issuer keys a managed Edge holds Nodes to ([`EdgeCore::set_issuers`]), from the
/// Control Plane's projection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Issuers {
    /// The key leases are signed with now.
    pub active: Option<String>,
    /// The staged key and when it becomes the active one (Unix ms).
    pub staged: Option<(String, i64)>,
}

/// Why a dispatch was refused or failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// The Node has no dispatch-ready generation.
    #[error("node is not dispatch-ready")]
    NotReady,
    /// The Node's generation was fenced before it answered.
    #[error("node disconnected")]
    Disconnected,
    /// The transport is gone (the Edge is shutting down).
    #[error("edge transport stopped")]
    Stopped,
    /// No model group has this name (404).
    #[error("model not found")]
    UnknownModel,
    /// The dispatch queue is full (429).
    #[error("queue is full")]
    QueueFull,
    /// No provider had capacity within the wait (503).
    #[error("no provider available within the wait")]
    WaitTimeout,
    /// The request has a field the Node would refuse (400); nothing was sent, the Node's session
    /// is untouched.
    #[error("invalid request")]
    InvalidRequest,
    /// The request does not fit in one frame of the Edge–Node wire (413); nothing was sent, the
    /// Node's session is untouched.
    #[error("request of {len} bytes exceeds the Edge–Node wire's frame limit of {max}")]
    TooLarge {
        /// The request frame's encoded length.
        len: usize,
        /// The limit ([`crate::registry::RegistryConfig::max_frame_len`]).
        max: usize,
    },
}

/// A Node lifecycle transition, after the registry made it authoritative. Observation only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    /// First ready transition of a generation (`node.connected`).
    Connected {
        /// Node.
        node_id: String,
        /// Generation.
        generation: Generation,
    },
    /// The ready generation was fenced (`node.disconnected`).
    Disconnected {
        /// Node.
        node_id: String,
        /// Generation.
        generation: Generation,
    },
}

/// A provider selected by the pool and held for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    /// The provider lease: Node generation, adapter instance, target, stall timeout.
    pub lease: Lease,
    /// The lease recipient key the Node announced on this generation's registration.
    pub recipient: Option<RecipientKey>,
}

/// The outcome of [`EdgeCore::admit`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// A provider had capacity.
    Granted(Admitted),
    /// Waiting in the queue: an [`Event::Admitted`] with this id follows (grant or timeout).
    Queued(RequestId),
}

/// A stream to open: its first frame and where its events go.
#[derive(Debug)]
pub enum Open<S: Sinks> {
    /// A normalized run.
    Run {
        /// The request (on a pool lease, adapter, target and stall timeout are filled in).
        request: RunRequest,
        /// Where its events go.
        sink: S::Run,
    },
    /// A provider tunnel.
    Tunnel {
        /// The request (on a pool lease, adapter, target and stall timeout are filled in).
        request: ProviderTunnelRequest,
        /// Where its events go.
        sink: S::Tunnel,
        /// End the stream with [`TunnelEvent::WaitTimeout`] (and cancel it on the Node) if no
        /// frame of the response arrives within this time.
        response_wait: Option<Duration>,
    },
}

/// A stream the machine routes: its id (never reused) and the generation it went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened {
    /// Stream id.
    pub stream_id: u64,
    /// The Node generation the stream belongs to.
    pub generation: Generation,
    /// The tunnel's credit window (`0`: none). Its reader gives credit back with
    /// [`EdgeCore::grant`] as it consumes the body.
    pub credit_window: u64,
}

/// The answer to a correlated request ([`EdgeCore::command`], [`EdgeCore::refresh`],
/// [`EdgeCore::recover`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A command's response.
    Command(Result<NodeCommandResponse, DispatchError>),
    /// A config refresh's outcome.
    Refresh(Result<NodeConfigRefreshResponse, DispatchError>),
    /// A recovery probe: how many overlays it cleared.
    Recovered(Result<usize, DispatchError>),
}

/// What the machine tells its driver (drain with [`EdgeCore::poll_event`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A lifecycle transition (observation only).
    Lifecycle(Lifecycle),
    /// Close this connection after the frames already handed out for it.
    CloseConnection {
        /// The connection.
        conn: ConnId,
        /// Why.
        cause: FenceCause,
    },
    /// A queued admission was granted, or its wait ran out. A driver whose caller went away
    /// releases a granted lease with [`EdgeCore::release`].
    Admitted {
        /// The queued request ([`Admit::Queued`]).
        request: RequestId,
        /// The grant or the error.
        result: Result<Admitted, DispatchError>,
    },
    /// A correlated request was answered, or failed (its generation was fenced).
    Answered {
        /// The ticket [`EdgeCore::command`] (or `refresh`, `recover`) returned.
        ticket: u64,
        /// The answer.
        answer: Answer,
    },
}

/// Settings of the machine.
#[derive(Clone, Copy, Debug)]
pub struct CoreConfig {
    /// Unread bytes a stream may hold before it is ended as a slow consumer.
    pub max_stream_buffer: usize,
    /// How long a stream may hold unread bytes with no read before it is ended.
    pub slow_consumer_timeout: Duration,
    /// The credit window of a tunnel's body, in credit bytes
    /// ([`iop_wire::runtime::ProviderTunnelRequest::credit_window`]), for Nodes that registered
    /// with `stream_credit`; `0` turns credit off. Never more than half of
    /// `max_stream_buffer` is used, so that a window's frames and the stream's other events
    /// fit under the byte bound together.
    pub stream_window: usize,
}

/// Default [`CoreConfig::stream_window`]: 1 MiB.
pub const DEFAULT_STREAM_WINDOW: usize = 1024 * 1024;

/// The smallest credit window the Edge opens a tunnel with (sixteen frames' charge).
pub const MIN_STREAM_WINDOW: usize = 8192;

impl CoreConfig {
    /// The window a tunnel is opened with: [`CoreConfig::stream_window`], at most half the
    /// byte bound.
    /// Below [`MIN_STREAM_WINDOW`] credit is off: a byte bound that small leaves no room for
    /// it.
    pub fn effective_stream_window(&self) -> u64 {
        let window = self.stream_window.min(self.max_stream_buffer / 2);
        if window < MIN_STREAM_WINDOW {
            0
        } else {
            window as u64
        }
    }
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            max_stream_buffer: 4 * 1024 * 1024,
            slow_consumer_timeout: Duration::from_secs(30),
            stream_window: DEFAULT_STREAM_WINDOW,
        }
    }
}

/// Everything the machine knows for an operator's status view, in one step
/// ([`EdgeCore::status`]); times are ages at the `now` it was taken at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CoreStatus {
    /// The pool's provider snapshots, in configuration order (empty without a pool).
    pub providers: Vec<iop_wire::runtime::ProviderSnapshot>,
    /// What the status page adds to each provider's snapshot, same order.
    pub health: Vec<HealthNote>,
    /// Every Node the machine knows of (registered, ready, or refused), by id.
    pub nodes: Vec<NodeStatus>,
    /// Requests waiting for a provider.
    pub queue_depth: usize,
    /// How long the oldest waiting request has waited.
    pub oldest_wait: Option<Duration>,
    /// Provider leases held.
    pub leases: u64,
    /// The lease issuer keys Nodes are held to (managed mode).
    pub issuers: Issuers,
}

/// One Node, as [`CoreStatus`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeStatus {
    /// Node id.
    pub node_id: String,
    /// Its current generation (pending or ready), if it has one.
    pub generation: Option<Generation>,
    /// Whether that generation is dispatch-ready.
    pub ready: bool,
    /// The software version it announced when it registered (the peer's words, cut at
    /// [`crate::registry::MAX_VERSION_LEN`] bytes).
    pub version: Option<String>,
    /// How long since anything (a heartbeat or any frame) was received on its connection.
    pub last_heard: Option<Duration>,
    /// Runs in flight on it.
    pub runs: u32,
    /// Provider tunnels in flight on it.
    pub tunnels: u32,
    /// Why it is refused or not selected ([`EdgeCore::refused`]).
    pub refused: Option<String>,
    /// What will stop it being selected ([`EdgeCore::warning`]).
    pub warning: Option<String>,
}

/// A provider's health beyond the pool's snapshot: why its runtime-unavailable overlay is set
/// and since when, and the last recovery probe's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HealthNote {
    /// The overlay of the provider's current generation, while it is set.
    pub overlay: Option<OverlayNote>,
    /// The last recovery probe answer that named this provider, in any generation.
    pub last_probe: Option<ProbeNote>,
}

/// Why a runtime-unavailable overlay was set: a stall terminal whose exact-target probe said
/// `unavailable` (seed 000's validated current bound stall).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OverlayNote {
    /// How long it has been set.
    pub age: Duration,
    /// How long the provider had been silent when the Node's watchdog fired.
    pub idle: Duration,
    /// Whether the stalled call returned within the close grace.
    pub fence: iop_wire::runtime::Fence,
}

/// A recovery probe's answer for one provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProbeNote {
    /// How long ago it was applied.
    pub age: Duration,
    /// What the Node said of the provider (`available`, `unavailable`, ...).
    pub provider_status: &'static str,
    /// Whether it was fresher than anything seen before for the binding (a stale answer
    /// changes nothing).
    pub fresh: bool,
    /// Whether it cleared the overlay.
    pub cleared: bool,
}
