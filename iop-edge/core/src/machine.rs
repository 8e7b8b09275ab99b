//! [`EdgeCore`]: the Edge's protocol decisions as one sans-io machine.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::registry::{
    ConnId, FenceCause, Generation, Registry, RegistryEvent, SendError, pins_trust,
};
use iop_wire::runtime::{
    CancelRequest, FailureEvidence, HealthEvidence, NodeCommandKind, NodeCommandRequest,
    NodeCommandResponse, NodeConfigPayload, NodeConfigRefreshResponse, ProviderSnapshot,
    ProviderStatus, ProviderTunnelRequest, RecipientKey, RunEvent, RunEventKind, RunRequest,
    RuntimeFrame, RuntimeMessage,
};
use iop_wire::tunnel::{Delivery, TunnelError, TunnelSequencer, Violation};
use iop_wire::validate::ResponseStallTimeout;

use crate::pool::{Lease, LeaseId, Pool, PoolError, PoolEvent, ProviderKey, RequestId, Submitted};

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
}

/// An observer that counts nothing.
#[derive(Debug, Default)]
pub struct NoObserver;

impl Observer for NoObserver {}

/// One event of a provider tunnel, in order. Exactly one terminal ends the stream: the Node's
/// END or ERROR, an ordering violation, or the Node's disconnect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TunnelEvent {
    /// A frame that passed the ordering rules (`iop_wire::tunnel`).
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
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            max_stream_buffer: 4 * 1024 * 1024,
            slow_consumer_timeout: Duration::from_secs(30),
        }
    }
}

/// Where a stream's events go.
enum Sink<S: Sinks> {
    Run(S::Run),
    Tunnel(S::Tunnel),
}

impl<S: Sinks> Clone for Sink<S>
where
    S::Run: Clone,
    S::Tunnel: Clone,
{
    fn clone(&self) -> Self {
        match self {
            Self::Run(tx) => Self::Run(tx.clone()),
            Self::Tunnel(tx) => Self::Tunnel(tx.clone()),
        }
    }
}

impl<S: Sinks> Sink<S> {
    /// Delivers the Edge's own terminal for a stream whose generation was fenced.
    fn disconnected(&self) {
        match self {
            Self::Run(tx) => {
                let mut ev = RunEvent::new(RunEventKind::Error);
                ev.error = NODE_DISCONNECTED.into();
                let _ = tx.push(ev, 0);
            }
            Self::Tunnel(tx) => {
                let _ = tx.push(TunnelEvent::NodeDisconnected, 0);
            }
        }
    }

    /// Ends the stream for a reader that fell behind: its backlog is dropped and one terminal
    /// takes its place.
    fn slow_consumer(&self) {
        match self {
            Self::Run(tx) => {
                let mut ev = RunEvent::new(RunEventKind::Error);
                ev.error = SLOW_CONSUMER.into();
                tx.replace_with(ev);
            }
            Self::Tunnel(tx) => tx.replace_with(TunnelEvent::SlowConsumer),
        }
    }

    fn level(&self) -> Level {
        match self {
            Self::Run(tx) => tx.level(),
            Self::Tunnel(tx) => tx.level(),
        }
    }
}

struct Route<S: Sinks> {
    node_id: String,
    generation: Generation,
    run_id: String,
    sink: Sink<S>,
    /// The provider lease this stream holds (pool dispatch), released when the route ends.
    lease: Option<LeaseId>,
}

impl<S: Sinks> Clone for Route<S>
where
    S::Run: Clone,
    S::Tunnel: Clone,
{
    fn clone(&self) -> Self {
        Self {
            node_id: self.node_id.clone(),
            generation: self.generation,
            run_id: self.run_id.clone(),
            sink: self.sink.clone(),
            lease: self.lease,
        }
    }
}

impl<S: Sinks> std::fmt::Debug for Route<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("node_id", &self.node_id)
            .field("generation", &self.generation)
            .field("run_id", &self.run_id)
            .field(
                "sink",
                &match self.sink {
                    Sink::Run(_) => "run",
                    Sink::Tunnel(_) => "tunnel",
                },
            )
            .field("lease", &self.lease)
            .finish()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pending {
    Command,
    Refresh,
    Recovery,
}

impl Pending {
    fn failed(self, e: DispatchError) -> Answer {
        match self {
            Self::Command => Answer::Command(Err(e)),
            Self::Refresh => Answer::Refresh(Err(e)),
            Self::Recovery => Answer::Recovered(Err(e)),
        }
    }
}

/// Approximate memory of a run event in a stream buffer.
fn run_event_size(ev: &RunEvent) -> usize {
    64 + ev.delta.len()
        + ev.error.len()
        + ev.metadata
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
}

/// Approximate memory of a tunnel event in a stream buffer.
fn tunnel_event_size(ev: &TunnelEvent) -> usize {
    64 + match ev {
        TunnelEvent::Frame(Delivery::Body(b)) => b.len(),
        TunnelEvent::Frame(Delivery::Start { headers, .. }) => {
            headers.iter().map(|h| h.name.len() + h.value.len()).sum()
        }
        _ => 0,
    }
}

fn stall(timeout: Duration) -> ResponseStallTimeout {
    ResponseStallTimeout::from_duration(timeout).unwrap_or(ResponseStallTimeout::DEFAULT)
}

/// What the machine knows of one Node beyond the registry.
#[derive(Clone, Debug, Default)]
struct NodeEntry {
    /// Its current registration (none before the first, or once that generation is fenced).
    registration: Option<Registration>,
    /// Why it is refused or not selected; a refused registration stays until the Node is
    /// ready again.
    refusal: Option<NodeRefusal>,
    /// Why it will stop being selected (it does not pin the staged issuer key).
    warning: Option<String>,
}

/// A Node's current registration, as the machine keeps it.
#[derive(Clone, Debug)]
struct Registration {
    generation: Generation,
    /// The lease recipient key it announced (managed mode).
    recipient: Option<RecipientKey>,
    /// The lease issuer key ids it pins (managed mode; empty: not checked).
    pins: Vec<String>,
}

/// Why a Node is refused or not selected: typed, so each rule clears only its own refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
enum NodeRefusal {
    /// The registry refused its registration (a configuration disagreement, or it does not
    /// pin the active issuer key): the registry's reason.
    Registration(String),
    /// Registered, but it does not pin the issuer key leases are signed with now
    /// ([`pins_trust`]): not selected until it registers again trusting it.
    IssuerUntrusted(String),
}

impl NodeRefusal {
    fn reason(&self) -> &str {
        match self {
            Self::Registration(r) | Self::IssuerUntrusted(r) => r,
        }
    }
}

/// The Edge's protocol machine (see the crate docs for what it owns and how to drive it).
pub struct EdgeCore<S: Sinks> {
    registry: Registry,
    routes: BTreeMap<u64, Route<S>>,
    /// Ordering state of every open tunnel stream (stream ids are unique across connections).
    tunnels: TunnelSequencer,
    /// Response-wait deadlines of tunnels that have not received a frame yet, by time and by
    /// stream (so the first frame clears its timer in O(log n)).
    wait_timers: BTreeSet<(Instant, u64)>,
    waiting: BTreeMap<u64, Instant>,
    pool: Option<Pool>,
    /// Last `health_observation_seq` seen per provider binding and generation.
    observed: BTreeMap<(ProviderKey, Generation), u64>,
    pending: BTreeMap<u64, (String, Generation, Pending)>,
    next_stream: u64,
    next_correlation: u64,
    /// What the machine knows of each Node beyond the registry, one entry per Node id (its
    /// current registration's recipient key and issuer pins, why it is refused, its warning):
    /// a fence drops the registration in one step, and an entry with nothing left is removed.
    nodes: BTreeMap<String, NodeEntry>,
    /// The key leases are signed with now and the staged one (from the projection).
    issuers: Issuers,
    config: CoreConfig,
    /// Streams holding unread bytes, by the time to look again, and the read count seen when
    /// the timer was armed.
    slow_timers: BTreeSet<(Instant, u64)>,
    slow: BTreeMap<u64, (Instant, u64)>,
    events: VecDeque<Event>,
    observer: Arc<dyn Observer>,
}

impl<S: Sinks> std::fmt::Debug for EdgeCore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeCore")
            .field("routes", &self.routes.len())
            .field("pending", &self.pending.len())
            .field("events", &self.events.len())
            .finish_non_exhaustive()
    }
}

/// A copy of the whole machine, for model checkers: the registry, pool, routes and timers are
/// copied, and each stream's sink is `Clone`d (so a copy shares its sinks only if their `Clone`
/// shares; the production driver never copies the machine).
impl<S: Sinks> Clone for EdgeCore<S>
where
    S::Run: Clone,
    S::Tunnel: Clone,
{
    fn clone(&self) -> Self {
        Self {
            registry: self.registry.clone(),
            routes: self.routes.clone(),
            tunnels: self.tunnels.clone(),
            wait_timers: self.wait_timers.clone(),
            waiting: self.waiting.clone(),
            pool: self.pool.clone(),
            observed: self.observed.clone(),
            pending: self.pending.clone(),
            next_stream: self.next_stream,
            next_correlation: self.next_correlation,
            nodes: self.nodes.clone(),
            issuers: self.issuers.clone(),
            config: self.config,
            slow_timers: self.slow_timers.clone(),
            slow: self.slow.clone(),
            events: self.events.clone(),
            observer: self.observer.clone(),
        }
    }
}

/// [`EdgeCore::state`]: every field but the sinks' contents and the observer. The fields are
/// taken by an exhaustive destructuring, so a field added to [`EdgeCore`] does not compile here
/// until it is printed (or said to be left out, as the observer is).
struct StateDebug<'a, S: Sinks>(&'a EdgeCore<S>);

impl<S: Sinks> std::fmt::Debug for StateDebug<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let EdgeCore {
            registry,
            routes,
            tunnels,
            wait_timers,
            waiting,
            pool,
            observed,
            pending,
            next_stream,
            next_correlation,
            nodes,
            issuers,
            config,
            slow_timers,
            slow,
            events,
            observer: _,
        } = self.0;
        f.debug_struct("EdgeCore")
            .field("registry", registry)
            .field("routes", routes)
            .field("tunnels", tunnels)
            .field("wait_timers", wait_timers)
            .field("waiting", waiting)
            .field("pool", pool)
            .field("observed", observed)
            .field("pending", pending)
            .field("next_stream", next_stream)
            .field("next_correlation", next_correlation)
            .field("nodes", nodes)
            .field("issuers", issuers)
            .field("config", config)
            .field("slow_timers", slow_timers)
            .field("slow", slow)
            .field("events", events)
            .finish()
    }
}

impl<S: Sinks> EdgeCore<S> {
    /// The machine's whole state in `Debug` form (every field but what its sinks hold and the
    /// observer). Its maps are ordered, so equal states print equally whatever history built
    /// them (up to the layout of the registry's timer heap): the model checker
    /// (`tests/model.rs`) fingerprints states with it. Long; not for logs.
    pub fn state(&self) -> impl std::fmt::Debug + '_ {
        StateDebug(self)
    }

    /// A machine around `registry` (with its Node configs set) and an optional provider pool.
    pub fn new(
        registry: Registry,
        pool: Option<Pool>,
        config: CoreConfig,
        observer: Arc<dyn Observer>,
    ) -> Self {
        Self {
            registry,
            routes: BTreeMap::new(),
            tunnels: TunnelSequencer::with_max_streams(usize::MAX),
            wait_timers: BTreeSet::new(),
            waiting: BTreeMap::new(),
            pool,
            observed: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_stream: 1,
            next_correlation: 1,
            nodes: BTreeMap::new(),
            issuers: Issuers::default(),
            config,
            slow_timers: BTreeSet::new(),
            slow: BTreeMap::new(),
            events: VecDeque::new(),
            observer,
        }
    }

    // === Connections ===

    /// A new authenticated connection from the Node named `peer` by its certificate.
    pub fn accept(&mut self, now: Instant, peer: &str) -> ConnId {
        self.registry.accept(now, Some(peer.to_owned()))
    }

    /// A frame read from `conn`. Frames of established streams are routed to their sink in
    /// this call.
    pub fn handle_frame(&mut self, now: Instant, conn: ConnId, frame: RuntimeFrame) {
        self.registry.handle_frame(now, conn, frame);
        self.settle(now);
    }

    /// `conn` is gone (read end, error or kill).
    pub fn handle_close(&mut self, now: Instant, conn: ConnId) {
        self.registry.handle_close(conn);
        self.settle(now);
    }

    /// Closes `conn` for `cause` (e.g. the driver found it does not read its frames).
    pub fn close(&mut self, now: Instant, conn: ConnId, cause: FenceCause) {
        self.registry.close(conn, cause);
        self.settle(now);
    }

    /// The next frame to write, and its connection.
    pub fn poll_transmit(&mut self) -> Option<(ConnId, RuntimeFrame)> {
        self.registry.poll_transmit()
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The earliest deadline of any timer (registration, liveness, response waits, the queue,
    /// slow consumers).
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.registry.poll_timeout(),
            self.wait_timers.first().map(|(at, _)| *at),
            self.pool.as_ref().and_then(Pool::poll_timeout),
            self.slow_timers.first().map(|(at, _)| *at),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.registry.handle_timeout(now);
        self.expire_waits(now);
        self.expire_slow(now);
        if let Some(pool) = self.pool.as_mut() {
            pool.handle_timeout(now);
        }
        self.settle(now);
    }

    // === Streams ===

    /// Opens a stream on the current ready generation of `node_id` (no pool).
    pub fn open(
        &mut self,
        now: Instant,
        node_id: &str,
        open: Open<S>,
    ) -> Result<Opened, DispatchError> {
        let opened = self.open_stream(now, node_id.to_owned(), open);
        self.settle(now);
        opened
    }

    /// Admission through the pool: a live candidate of `model` with capacity, or a place in the
    /// bounded queue for up to `wait`.
    pub fn admit(
        &mut self,
        now: Instant,
        model: &str,
        long_context: bool,
        wait: Duration,
    ) -> Result<Admit, DispatchError> {
        let Some(pool) = self.pool.as_mut() else {
            return Err(DispatchError::UnknownModel);
        };
        let result = match pool.submit(now, model, long_context, wait) {
            Ok(Submitted::Granted(lease)) => Ok(Admit::Granted(self.admitted(lease))),
            Ok(Submitted::Queued(id)) => Ok(Admit::Queued(id)),
            Err(PoolError::QueueFull) => Err(DispatchError::QueueFull),
            Err(_) => Err(DispatchError::UnknownModel),
        };
        self.settle(now);
        result
    }

    /// Sends a request on an admitted provider: adapter, target and stall timeout come from the
    /// lease, which the stream holds until its terminal (or its generation's fence). Fails with
    /// [`DispatchError::Disconnected`] when the lease is no longer held (its generation was
    /// fenced meanwhile, releasing it); any other failure releases it.
    pub fn send_admitted(
        &mut self,
        now: Instant,
        lease: &Lease,
        open: Open<S>,
    ) -> Result<Opened, DispatchError> {
        let held = self
            .pool
            .as_ref()
            .and_then(|p| p.lease(lease.id))
            .is_some_and(|l| l == lease);
        if !held {
            return Err(DispatchError::Disconnected);
        }
        let open = match open {
            Open::Run { mut request, sink } => {
                request.adapter.clone_from(&lease.adapter);
                request.target.clone_from(&lease.target);
                request.response_stall_timeout = stall(lease.response_stall_timeout);
                Open::Run { request, sink }
            }
            Open::Tunnel {
                mut request,
                sink,
                response_wait,
            } => {
                request.adapter.clone_from(&lease.adapter);
                request.target.clone_from(&lease.target);
                request.response_stall_timeout = stall(lease.response_stall_timeout);
                Open::Tunnel {
                    request,
                    sink,
                    response_wait,
                }
            }
        };
        let opened = self.open_stream(now, lease.key.node_id.clone(), open);
        match &opened {
            Ok(o) => {
                if let Some(route) = self.routes.get_mut(&o.stream_id) {
                    route.lease = Some(lease.id);
                }
            }
            Err(_) => self.release(now, lease.id),
        }
        self.settle(now);
        opened
    }

    /// Releases a provider lease not sent on (an admission dropped). A no-op if it was already
    /// released.
    pub fn release(&mut self, now: Instant, lease: LeaseId) {
        if let Some(pool) = self.pool.as_mut() {
            pool.release(lease);
        }
        self.settle(now);
    }

    /// Ends a stream for its caller (it went away before the terminal) and asks the Node to stop
    /// the provider work.
    pub fn end_stream(&mut self, now: Instant, stream_id: u64, reason: &str) {
        self.end_route(now, stream_id, reason);
        self.settle(now);
    }

    /// Asks `node_id` to cancel `run_id` (its terminal then arrives on the run's stream).
    pub fn cancel(&mut self, now: Instant, node_id: &str, run_id: &str, reason: &str) {
        if let Some((_, generation)) = self.registry.ready_generation(node_id) {
            let cancel = RuntimeMessage::CancelRequest(CancelRequest {
                run_id: run_id.to_owned(),
                reason: reason.to_owned(),
            });
            let _ = self
                .registry
                .send(now, node_id, generation, RuntimeFrame::new(cancel));
        }
        self.settle(now);
    }

    // === Correlated requests ===

    /// Sends a command to a ready Node; its answer comes as [`Event::Answered`] with the
    /// returned ticket.
    pub fn command(
        &mut self,
        now: Instant,
        node_id: &str,
        request: NodeCommandRequest,
    ) -> Result<u64, DispatchError> {
        self.correlated(
            now,
            node_id,
            RuntimeMessage::NodeCommandRequest(request),
            Pending::Command,
        )
    }

    /// Pushes a config refresh to a ready Node; its outcome comes as [`Event::Answered`].
    pub fn refresh(
        &mut self,
        now: Instant,
        node_id: &str,
        config: NodeConfigPayload,
    ) -> Result<u64, DispatchError> {
        self.correlated(
            now,
            node_id,
            RuntimeMessage::NodeConfigRefreshRequest(config),
            Pending::Refresh,
        )
    }

    /// CAPABILITIES recovery probe of `node_id`: each runtime-unavailable overlay of the Node's
    /// current generation is cleared only by a higher-sequence `available` answer naming exactly
    /// one provider binding. The count of cleared overlays comes as [`Event::Answered`].
    pub fn recover(&mut self, now: Instant, node_id: &str) -> Result<u64, DispatchError> {
        let probe = NodeCommandRequest {
            kind: NodeCommandKind::Capabilities,
            adapter: String::new(),
            target: String::new(),
        };
        self.correlated(
            now,
            node_id,
            RuntimeMessage::NodeCommandRequest(probe),
            Pending::Recovery,
        )
    }

    // === Views ===

    /// `(queue depth, leases held)` of the pool (zeros without a pool).
    pub fn pool_stats(&self) -> (usize, u64) {
        self.pool
            .as_ref()
            .map_or((0, 0), |p| (p.queue_len(), p.lease_count() as u64))
    }

    /// The pool's provider snapshots (empty without a pool).
    pub fn snapshot(&self) -> Vec<ProviderSnapshot> {
        self.pool.as_ref().map(Pool::snapshot).unwrap_or_default()
    }

    /// The dispatch-ready Nodes and their generations.
    pub fn ready_nodes(&self) -> Vec<(String, Generation)> {
        self.registry.ready_nodes()
    }

    /// Managed mode: the lease issuer keys the Control Plane names in its projection. A Node
    /// registering without trusting the active key is refused
    /// ([`crate::registry::Registry::set_required_issuer`]); a registered Node that does not
    /// trust it (the key was just rotated) is no longer selected, its running work finishing
    /// ([`Pool::set_node_excluded`]), until it registers again trusting it; a Node that does
    /// not trust the staged key gets a warning (log and status) before the switch. Nodes
    /// that announce no key ids (legacy) are not checked.
    pub fn set_issuers(&mut self, now: Instant, issuers: Issuers) {
        self.registry.set_required_issuer(issuers.active.clone());
        if self.issuers == issuers {
            return;
        }
        self.issuers = issuers;
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, e)| e.registration.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        for node_id in nodes {
            self.check_issuers(&node_id);
        }
        // Taking a Node back in may have granted waiters.
        self.settle(now);
    }

    /// Why Node `node_id`'s last registration was refused for a configuration disagreement,
    /// if it was and it has not been ready since, or why it is not selected now.
    pub fn refused(&self, node_id: &str) -> Option<&str> {
        self.nodes
            .get(node_id)?
            .refusal
            .as_ref()
            .map(NodeRefusal::reason)
    }

    /// Whether Node `node_id`'s registration of `generation` pins issuer key `key_id` (true when
    /// it announced no ids, `key_id` is empty, or that generation is gone: its dispatch fails
    /// on its own).
    pub fn trusts(&self, node_id: &str, generation: Generation, key_id: &str) -> bool {
        self.registration(node_id)
            .is_none_or(|r| r.generation != generation || pins_trust(&r.pins, key_id))
    }

    /// What will stop Node `node_id` being selected (it does not trust the staged issuer key).
    pub fn warning(&self, node_id: &str) -> Option<&str> {
        self.nodes.get(node_id)?.warning.as_deref()
    }

    /// Node `node_id`'s current registration, if it has one.
    fn registration(&self, node_id: &str) -> Option<&Registration> {
        self.nodes.get(node_id)?.registration.as_ref()
    }

    /// Why registered Node `node_id` must not be selected (it does not pin the active key).
    fn untrusted(&self, node_id: &str) -> Option<String> {
        let pins = &self.registration(node_id)?.pins;
        self.issuers
            .active
            .as_ref()
            .filter(|a| !pins_trust(pins, a))
            .map(|a| {
                format!(
                    "{}: the control plane signs leases with {a} now; this node trusts {}; pin the key `iop-cp issuer-key` prints and restart the node",
                    crate::registry::reason::ISSUER_KEY_NOT_TRUSTED,
                    pins.join(", ")
                )
            })
    }

    /// Applies the issuer rules of [`EdgeCore::set_issuers`] to one registered Node.
    fn check_issuers(&mut self, node_id: &str) {
        let Some(pins) = self
            .registration(node_id)
            .map(|r| &r.pins)
            .filter(|p| !p.is_empty())
        else {
            return;
        };
        let warning = self
            .issuers
            .staged
            .as_ref()
            .filter(|(s, _)| !pins_trust(pins, s))
            .map(|(s, at)| {
                format!(
                    "does not trust the staged issuer key {s}, which the control plane signs with from {at} (Unix ms); it will not be selected then: pin the key `iop-cp issuer-key --staged` prints"
                )
            });
        let untrusted = self.untrusted(node_id);
        let excluded = untrusted.is_some();
        let changed = self
            .pool
            .as_mut()
            .is_some_and(|p| p.set_node_excluded(node_id, excluded));
        let entry = self.nodes.entry(node_id.to_owned()).or_default();
        match untrusted {
            Some(reason) => {
                let refusal = NodeRefusal::IssuerUntrusted(reason);
                if changed || entry.refusal.as_ref() != Some(&refusal) {
                    tracing::warn!(target: "iop_edge", event = "edge_node_issuer_untrusted", %node_id, reason = %refusal.reason(), "node not selected: it cannot verify the key leases are signed with");
                }
                entry.refusal = Some(refusal);
            }
            None => {
                if matches!(entry.refusal, Some(NodeRefusal::IssuerUntrusted(_))) {
                    entry.refusal = None;
                }
            }
        }
        if let Some(w) = &warning
            && entry.warning.as_ref() != Some(w)
        {
            tracing::warn!(target: "iop_edge", event = "edge_node_issuer_staged_untrusted", %node_id, warning = %w, "node does not trust the staged lease issuer key");
        }
        entry.warning = warning;
    }

    /// The streams being routed.
    pub fn stream_count(&self) -> usize {
        self.routes.len()
    }

    /// The registry (read only).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The pool (read only).
    pub fn pool(&self) -> Option<&Pool> {
        self.pool.as_ref()
    }

    // === Internals ===

    fn admitted(&self, lease: Lease) -> Admitted {
        let recipient = self
            .registration(&lease.key.node_id)
            .filter(|r| r.generation == lease.generation)
            .and_then(|r| r.recipient.clone());
        Admitted { lease, recipient }
    }

    /// Applies what the registry and the pool decided, until neither has anything more.
    fn settle(&mut self, now: Instant) {
        loop {
            let mut progressed = false;
            while let Some(event) = self.registry.poll_event() {
                progressed = true;
                self.registry_event(now, event);
            }
            while let Some(event) = self.pool.as_mut().and_then(Pool::poll_event) {
                progressed = true;
                match event {
                    PoolEvent::Granted { request, lease } => {
                        let admitted = self.admitted(lease);
                        self.events.push_back(Event::Admitted {
                            request,
                            result: Ok(admitted),
                        });
                    }
                    PoolEvent::WaitTimedOut { request } => {
                        self.events.push_back(Event::Admitted {
                            request,
                            result: Err(DispatchError::WaitTimeout),
                        });
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    /// Ends a route for its caller and cancels the run on the Node.
    fn end_route(&mut self, now: Instant, stream_id: u64, reason: &str) {
        if let Some(route) = self.take_route(stream_id) {
            let cancel = RuntimeMessage::CancelRequest(CancelRequest {
                run_id: route.run_id,
                reason: reason.into(),
            });
            let _ = self.registry.send(
                now,
                &route.node_id,
                route.generation,
                RuntimeFrame::new(cancel),
            );
        }
    }

    /// After an event was queued on `stream_id` leaving `level`: over the byte bound the stream
    /// ends now; with bytes unread, the slow-consumer timer runs.
    fn watch_level(&mut self, now: Instant, stream_id: u64, level: Level) {
        if level.bytes > self.config.max_stream_buffer {
            self.slow_consumer(now, stream_id);
        } else if level.bytes > 0 && !self.slow.contains_key(&stream_id) {
            let at = now + self.config.slow_consumer_timeout;
            self.slow.insert(stream_id, (at, level.reads));
            self.slow_timers.insert((at, stream_id));
        }
    }

    fn slow_consumer(&mut self, now: Instant, stream_id: u64) {
        if let Some(route) = self.routes.get(&stream_id) {
            route.sink.slow_consumer();
            self.observer.slow_consumer();
            tracing::info!(
                node_id = %route.node_id,
                run_id = %route.run_id,
                "stream ended: its reader fell behind (slow consumer); cancelling upstream"
            );
            self.end_route(now, stream_id, "slow_consumer");
        }
    }

    /// Looks again at streams that held unread bytes: caught up (timer off), progressing (timer
    /// re-armed) or stuck past the timeout (ended).
    fn expire_slow(&mut self, now: Instant) {
        while let Some(&(at, stream_id)) = self.slow_timers.first() {
            if at > now {
                break;
            }
            self.slow_timers.pop_first();
            let Some((_, reads_then)) = self.slow.remove(&stream_id) else {
                continue;
            };
            let Some(level) = self.routes.get(&stream_id).map(|r| r.sink.level()) else {
                continue;
            };
            if level.bytes == 0 {
                continue;
            }
            if level.reads > reads_then {
                let at = now + self.config.slow_consumer_timeout;
                self.slow.insert(stream_id, (at, level.reads));
                self.slow_timers.insert((at, stream_id));
            } else {
                self.slow_consumer(now, stream_id);
            }
        }
    }

    /// Edge terminal handoff (seed 000). A stall terminal arrived on `generation` for the stream
    /// holding `lease`: when its typed evidence is valid and names the lease's own adapter and
    /// target on the lease's generation, it is a validated current bound stall — the metadata
    /// (of the run's ERROR event or the tunnel's ERROR delivery) gets `provider_id`,
    /// `provider_health` and `recovery_handoff=confirmed`, and only a *fresh* (higher
    /// `health_observation_seq`) `unavailable` observation sets the runtime-unavailable overlay.
    /// Rejected or mismatched evidence changes nothing; the lease is released by the terminal
    /// either way. Never adds `recovery_eligible`.
    fn handoff(
        &mut self,
        lease: Option<LeaseId>,
        generation: Generation,
        evidence: &FailureEvidence,
        metadata: &mut BTreeMap<String, String>,
    ) {
        let (Some(pool), Some(lease), FailureEvidence::Valid(f)) =
            (self.pool.as_mut(), lease, evidence)
        else {
            return;
        };
        let Some(lease) = pool.lease(lease).cloned() else {
            return;
        };
        if lease.generation != generation || f.adapter != lease.adapter || f.target != lease.target
        {
            self.observer.recovery_eligibility(false);
            return;
        }
        self.observer.recovery_eligibility(true);
        self.observer.health_evidence(f.health.provider_health());
        metadata.insert("provider_id".into(), lease.key.provider_id.clone());
        metadata.insert("provider_health".into(), f.health.provider_health().into());
        metadata.insert("recovery_handoff".into(), "confirmed".into());
        let last = self
            .observed
            .entry((lease.key.clone(), generation))
            .or_insert(0);
        let fresh = f.health_observation_seq.is_some_and(|seq| seq > *last);
        if fresh {
            *last = f.health_observation_seq.unwrap_or(*last);
            if f.health == HealthEvidence::Unavailable
                && pool.set_unavailable(&lease.key, generation)
            {
                self.observer.health_transition(true);
            }
        }
        tracing::info!(
            target: "iop_edge",
            event = "edge_provider_health_observation",
            provider_health = f.health.provider_health(),
            fresh,
            "stall terminal handed off"
        );
    }

    /// Applies a CAPABILITIES answer from `(node_id, generation)` to the overlays: each entry
    /// clears at most one overlay, only when `available`, fresher than anything seen for that
    /// binding, and matching exactly one provider of the Node.
    fn apply_recovery(
        &mut self,
        node_id: &str,
        generation: Generation,
        resp: &NodeCommandResponse,
    ) -> usize {
        let Some(pool) = self.pool.as_mut() else {
            return 0;
        };
        if !resp.ok {
            return 0;
        }
        let mut cleared = 0;
        for cap in &resp.capabilities {
            let matches: Vec<ProviderKey> = pool
                .bindings(node_id)
                .into_iter()
                .filter(|(_, adapter, target)| *adapter == cap.adapter_key && *target == cap.target)
                .map(|(key, _, _)| key)
                .collect();
            let [key] = matches.as_slice() else { continue }; // none or ambiguous
            let last = self.observed.entry((key.clone(), generation)).or_insert(0);
            if cap.health_observation_seq <= *last {
                continue; // stale
            }
            *last = cap.health_observation_seq;
            let ok = cap.provider_status == ProviderStatus::Available
                && pool.clear_unavailable(key, generation);
            self.observer.recovery_result(ok);
            if ok {
                self.observer.health_transition(false);
                cleared += 1;
            }
            tracing::info!(
                target: "iop_edge",
                event = "edge_liveness_recovery_observation",
                provider_status = cap.provider_status.as_str(),
                cleared = ok,
                "recovery probe answer applied"
            );
        }
        cleared
    }

    /// Ends a route: forgets it, closes its tunnel ordering state and releases its provider
    /// lease (a no-op if a fence already released it).
    fn take_route(&mut self, stream_id: u64) -> Option<Route<S>> {
        let route = self.routes.remove(&stream_id)?;
        if let Some((at, _)) = self.slow.remove(&stream_id) {
            self.slow_timers.remove(&(at, stream_id));
        }
        if let Some(at) = self.waiting.remove(&stream_id) {
            self.wait_timers.remove(&(at, stream_id));
        }
        self.tunnels.close(stream_id);
        if let (Some(lease), Some(pool)) = (route.lease, self.pool.as_mut()) {
            pool.release(lease);
        }
        Some(route)
    }

    /// Ends tunnels whose response did not start in time, and cancels them on the Node.
    fn expire_waits(&mut self, now: Instant) {
        while let Some(&(at, stream_id)) = self.wait_timers.first() {
            if at > now {
                break;
            }
            self.wait_timers.pop_first();
            self.waiting.remove(&stream_id);
            if let Some(Route {
                sink: Sink::Tunnel(tx),
                ..
            }) = self.routes.get(&stream_id)
            {
                let _ = tx.push(TunnelEvent::WaitTimeout, 0);
                self.end_route(now, stream_id, "caller_disconnected");
            }
        }
    }

    /// Sends a stream's opening frame to the ready generation of `node_id` and routes its
    /// answers to its sink.
    fn open_stream(
        &mut self,
        now: Instant,
        node_id: String,
        open: Open<S>,
    ) -> Result<Opened, DispatchError> {
        let (_, generation) = self
            .registry
            .ready_generation(&node_id)
            .ok_or(DispatchError::NotReady)?;
        let stream_id = self.next_stream;
        self.next_stream += 1;
        let (run_id, sink, frame, response_wait) = match open {
            Open::Run { request, sink } => (
                request.run_id.clone(),
                Sink::Run(sink),
                RuntimeFrame::on_stream(stream_id, RuntimeMessage::RunRequest(request)),
                None,
            ),
            Open::Tunnel {
                request,
                sink,
                response_wait,
            } => {
                if self.tunnels.open(stream_id).is_err() {
                    return Err(DispatchError::NotReady);
                }
                (
                    request.run_id.clone(),
                    Sink::Tunnel(sink),
                    RuntimeFrame::on_stream(
                        stream_id,
                        RuntimeMessage::ProviderTunnelRequest(request),
                    ),
                    response_wait,
                )
            }
        };
        if let Err(e) = self.registry.send(now, &node_id, generation, frame) {
            self.tunnels.close(stream_id);
            return Err(match e {
                SendError::Invalid(_) => DispatchError::InvalidRequest,
                _ => DispatchError::NotReady,
            });
        }
        if let Some(wait) = response_wait {
            let at = now + wait;
            self.wait_timers.insert((at, stream_id));
            self.waiting.insert(stream_id, at);
        }
        self.routes.insert(
            stream_id,
            Route {
                node_id,
                generation,
                run_id,
                sink,
                lease: None,
            },
        );
        Ok(Opened {
            stream_id,
            generation,
        })
    }

    fn correlated(
        &mut self,
        now: Instant,
        node_id: &str,
        message: RuntimeMessage,
        pending: Pending,
    ) -> Result<u64, DispatchError> {
        let (_, generation) = self
            .registry
            .ready_generation(node_id)
            .ok_or(DispatchError::NotReady)?;
        let id = self.next_correlation;
        self.next_correlation += 1;
        self.registry
            .send(
                now,
                node_id,
                generation,
                RuntimeFrame::correlated(id, message),
            )
            .map_err(|_| DispatchError::NotReady)?;
        self.pending
            .insert(id, (node_id.to_owned(), generation, pending));
        self.settle(now);
        Ok(id)
    }

    fn registry_event(&mut self, now: Instant, event: RegistryEvent) {
        match event {
            RegistryEvent::Registered {
                node_id,
                generation,
                recipient,
                issuer_key_ids,
                ..
            } => {
                self.nodes.entry(node_id).or_default().registration = Some(Registration {
                    generation,
                    recipient,
                    pins: issuer_key_ids,
                });
            }
            RegistryEvent::NodeReady {
                node_id,
                generation,
                ..
            } => {
                if let Some(e) = self.nodes.get_mut(&node_id) {
                    e.refusal = None;
                }
                // The active key may have changed since the registration was checked: decide
                // the exclusion in the same step as the activation, before any waiter is
                // pumped to this Node.
                let excluded = self.untrusted(&node_id).is_some();
                // Activate the generation's resources (and pump waiters) before observers hear.
                if let Some(pool) = self.pool.as_mut() {
                    pool.node_ready_excluded(&node_id, generation, excluded);
                }
                self.check_issuers(&node_id);
                self.events
                    .push_back(Event::Lifecycle(Lifecycle::Connected {
                        node_id,
                        generation,
                    }));
            }
            RegistryEvent::NodeFenced {
                node_id,
                generation,
                cause,
            } => {
                tracing::info!(%node_id, ?generation, ?cause, "node generation fenced");
                // Release the generation's leases exactly once, mark its providers offline and
                // re-evaluate the queue; then end its streams (their lease release is a no-op).
                if let Some(pool) = self.pool.as_mut() {
                    pool.node_fenced(&node_id, generation);
                }
                if let Some(e) = self.nodes.get_mut(&node_id)
                    && e.registration
                        .as_ref()
                        .is_some_and(|r| r.generation == generation)
                {
                    e.registration = None;
                    e.warning = None;
                    if e.refusal.is_none() {
                        self.nodes.remove(&node_id);
                    }
                }
                self.fence(&node_id, generation);
                self.events
                    .push_back(Event::Lifecycle(Lifecycle::Disconnected {
                        node_id,
                        generation,
                    }));
            }
            RegistryEvent::Frame {
                node_id,
                generation,
                frame,
                ..
            } => {
                self.route(now, &node_id, generation, frame);
            }
            RegistryEvent::CloseConnection { conn, cause } => {
                self.events
                    .push_back(Event::CloseConnection { conn, cause });
            }
            RegistryEvent::RegisterRefused { node_id, reason } => {
                let refusal = NodeRefusal::Registration(reason);
                let entry = self.nodes.entry(node_id.clone()).or_default();
                if entry.refusal.as_ref() != Some(&refusal) {
                    tracing::warn!(target: "iop_edge", event = "edge_node_refused", %node_id, reason = %refusal.reason(), "node registration refused; it is not selected until its configuration is fixed");
                }
                entry.refusal = Some(refusal);
            }
        }
    }

    /// Ends every stream and command of a fenced generation, in the same step as the fence.
    fn fence(&mut self, node_id: &str, generation: Generation) {
        let mut dead: Vec<u64> = self
            .routes
            .iter()
            .filter(|(_, r)| r.node_id == node_id && r.generation == generation)
            .map(|(id, _)| *id)
            .collect();
        dead.sort_unstable();
        for id in dead {
            if let Some(route) = self.take_route(id) {
                route.sink.disconnected();
            }
        }
        let mut dead: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, (n, g, _))| n == node_id && *g == generation)
            .map(|(id, _)| *id)
            .collect();
        dead.sort_unstable();
        for ticket in dead {
            if let Some((_, _, pending)) = self.pending.remove(&ticket) {
                self.events.push_back(Event::Answered {
                    ticket,
                    answer: pending.failed(DispatchError::Disconnected),
                });
            }
        }
    }

    fn route(&mut self, now: Instant, node_id: &str, generation: Generation, frame: RuntimeFrame) {
        let stream_id = frame.stream_id;
        match frame.message {
            RuntimeMessage::RunEvent(mut ev) => {
                let Some(route) = self.routes.get(&stream_id) else {
                    return;
                };
                // Transport identity, not payload identity, decides where a frame belongs.
                if route.node_id != node_id || route.generation != generation {
                    return;
                }
                let Sink::Run(_) = &route.sink else { return };
                let lease = route.lease;
                if ev.kind == RunEventKind::Error
                    && let Some(evidence) = ev.execution_failure.clone()
                {
                    self.handoff(lease, generation, &evidence, &mut ev.metadata);
                }
                let Some(Route {
                    sink: Sink::Run(tx),
                    ..
                }) = self.routes.get(&stream_id)
                else {
                    return;
                };
                let terminal = ev.kind.is_terminal();
                let size = run_event_size(&ev);
                let delivered = tx.push(ev, size);
                if terminal {
                    self.take_route(stream_id);
                } else {
                    match delivered {
                        Some(level) => self.watch_level(now, stream_id, level),
                        None => self.end_route(now, stream_id, "caller_disconnected"),
                    }
                }
            }
            RuntimeMessage::ProviderTunnelFrame(tf) => {
                let Some(route) = self.routes.get(&stream_id) else {
                    return;
                };
                if route.node_id != node_id || route.generation != generation {
                    return;
                }
                let Sink::Tunnel(_) = &route.sink else {
                    return;
                };
                // The response has started arriving: its wait timer is done.
                if let Some(at) = self.waiting.remove(&stream_id) {
                    self.wait_timers.remove(&(at, stream_id));
                }
                let lease = route.lease;
                let mut event = match self.tunnels.handle_frame(stream_id, tf) {
                    Ok(delivery) => TunnelEvent::Frame(delivery),
                    Err(TunnelError::Violation(v)) => TunnelEvent::Violation(v),
                    Err(_) => return,
                };
                if let TunnelEvent::Frame(Delivery::Error {
                    execution_failure: Some(evidence),
                    metadata,
                    ..
                }) = &mut event
                {
                    let evidence = evidence.clone();
                    self.handoff(lease, generation, &evidence, metadata);
                }
                let Some(Route {
                    sink: Sink::Tunnel(tx),
                    ..
                }) = self.routes.get(&stream_id)
                else {
                    return;
                };
                let terminal = event.is_terminal();
                let violation = matches!(event, TunnelEvent::Violation(_));
                let size = tunnel_event_size(&event);
                let delivered = tx.push(event, size);
                match delivered {
                    // Stop the provider work: the stream is over for the caller.
                    None => self.end_route(now, stream_id, "caller_disconnected"),
                    Some(_) if violation => self.end_route(now, stream_id, "protocol_violation"),
                    Some(_) if terminal => {
                        self.take_route(stream_id);
                    }
                    Some(level) => self.watch_level(now, stream_id, level),
                }
            }
            RuntimeMessage::NodeCommandResponse(resp) => {
                let ticket = frame.correlation_id;
                match self.take_pending(ticket, node_id, generation, |p| p != Pending::Refresh) {
                    Some(Pending::Command) => self.events.push_back(Event::Answered {
                        ticket,
                        answer: Answer::Command(Ok(resp)),
                    }),
                    Some(Pending::Recovery) => {
                        let cleared = self.apply_recovery(node_id, generation, &resp);
                        self.events.push_back(Event::Answered {
                            ticket,
                            answer: Answer::Recovered(Ok(cleared)),
                        });
                    }
                    Some(Pending::Refresh) | None => {}
                }
            }
            RuntimeMessage::NodeConfigRefreshResponse(resp) => {
                let ticket = frame.correlation_id;
                if self
                    .take_pending(ticket, node_id, generation, |p| p == Pending::Refresh)
                    .is_some()
                {
                    self.events.push_back(Event::Answered {
                        ticket,
                        answer: Answer::Refresh(Ok(resp)),
                    });
                }
            }
            _ => {}
        }
    }

    /// Takes the pending request `id` if the frame came from the generation it was sent to and
    /// answers its kind; anything else is not its answer (it stays, until its answer or fence).
    fn take_pending(
        &mut self,
        id: u64,
        node_id: &str,
        generation: Generation,
        answers: impl Fn(Pending) -> bool,
    ) -> Option<Pending> {
        let matches = self
            .pending
            .get(&id)
            .is_some_and(|(n, g, p)| n == node_id && *g == generation && answers(*p));
        if matches {
            self.pending.remove(&id).map(|(_, _, p)| p)
        } else {
            None
        }
    }
}

impl<S: Sinks> crate::binding::NodeTrust for EdgeCore<S> {
    fn trusts(&self, node_id: &str, generation: Generation, issuer_key_id: &str) -> bool {
        Self::trusts(self, node_id, generation, issuer_key_id)
    }
}
