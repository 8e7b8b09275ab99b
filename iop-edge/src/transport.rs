//! The Edge side of the runtime wire over mTLS.
//!
//! ```text
//!  TLS accept ──▶ conn task (read/write frames) ──inputs──▶ registry task ──▶ RunStream / replies
//!                        ▲                                     │ owns iop_wire::edge::Registry,
//!                        └──────────── frames to write ────────┘ run routes, pending commands
//! ```
//!
//! - The TLS handshake requires a CA-signed client certificate with role `node`; the
//!   certificate's name is handed to the registry, which only lets that connection register as
//!   that Node id. No-cert, wrong-CA and wrong-role peers never reach the registry.
//! - The registry task is the only owner of protocol state. Correctness transitions — run
//!   routes ending when their generation is fenced, command replies failing — happen there, in
//!   the same step as the registry event; the [`Lifecycle`] broadcast is observation only and
//!   may lag or drop without affecting them.
//! - A run stream ends with exactly one terminal: the Node's, or a synthetic `ERROR`
//!   ("node disconnected") when the Node's generation is fenced first. Dropping the
//!   [`RunStream`] before its terminal sends `CancelRequest` for the run id.
//!
//! Routes are keyed by a stream id that is never reused, and checked against the transport
//! reception identity `(node_id, generation)` of the frame, never against anything the frame
//! claims.
//!
//! # Bounds (what a slow or hostile peer can cost)
//!
//! Every queue a peer can fill is bounded, and every phase it can stall has a timeout:
//!
//! - **Per stream** (a slow HTTP client): the events of a run or tunnel wait for their reader
//!   in a buffer whose unread bytes are counted (module `stream_buf`). Past
//!   [`TransportConfig::max_stream_buffer`] bytes, or after
//!   [`TransportConfig::slow_consumer_timeout`] with bytes unread and no read, the stream is
//!   ended for its reader (the backlog is freed and replaced by one terminal:
//!   [`TunnelEvent::SlowConsumer`], or a run `ERROR` "slow consumer") and `CancelRequest` goes
//!   to the Node, as for a disconnect. The registry task never waits for a reader, so the
//!   other streams of the same Node connection keep flowing. The wire has no window frames:
//!   none are needed for this.
//! - **Per connection**: frames to a Node wait in a queue of
//!   [`TransportConfig::outbound_frames`]; a Node that stops reading them (even only its
//!   pongs) fills it and is disconnected ([`FenceCause::NotReading`]).
//! - **Registry inputs**: a bounded queue; a connection task that cannot hand over a frame
//!   stops reading its socket (TCP pushes back on that Node alone). Stream-drop and
//!   admission-release notices travel apart, on a queue bounded by construction (at most one
//!   notice per stream or admission, and those are bounded by the pool).
//! - **Handshakes**: TLS within [`TransportConfig::handshake_timeout`]; register and ready
//!   within [`RegistryConfig::handshake_timeout`] (the registry closes the connection). A
//!   connection being closed gets 2 s to write what was queued before the close (a refusal's
//!   reason); a peer that does not read it is dropped then regardless.
//! - **Connections**: at most [`TransportConfig::max_unauthenticated`] connections in their
//!   TLS handshake, and [`TransportConfig::max_unauthenticated_per_ip`] per source address;
//!   more are closed at once. Accept errors (e.g. out of file descriptors) back off and are
//!   logged at most once per 10 s with a count.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use iop_wire::codec::{DEFAULT_MAX_FRAME_LEN, FrameCodec, TokioCodec};
use iop_wire::edge::{
    ConnId, FenceCause, Generation, Registry, RegistryConfig, RegistryEvent, SendError,
};
use iop_wire::identity::peer_identity;
use iop_wire::runtime::{
    CancelRequest, FailureEvidence, HealthEvidence, NodeCommandKind, NodeCommandRequest,
    NodeCommandResponse, NodeConfigPayload, NodeConfigRefreshResponse, ProviderSnapshot,
    ProviderStatus, ProviderTunnelRequest, RecipientKey, RunEvent, RunEventKind, RunRequest,
    RuntimeFrame, RuntimeMessage,
};
use iop_wire::tunnel::{Delivery, TunnelError, TunnelSequencer, Violation};
use iop_wire::validate::ResponseStallTimeout;

use crate::metrics::Metrics;
use crate::pool::{
    Lease, LeaseId, Pool, PoolConfig, PoolError, PoolEvent, ProviderKey, RequestId, Submitted,
};
use crate::stream_buf::{self, StreamRx, StreamTx};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

/// Reason text of the synthetic terminal sent when a run's Node generation is fenced.
pub const NODE_DISCONNECTED: &str = "node disconnected";

/// Transport settings.
#[derive(Clone)]
pub struct TransportConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Server TLS: the Edge identity and a client verifier requiring role `node` (build it with
    /// `iop_wire::identity::{client_cert_verifier, server_config}`).
    pub tls: Arc<rustls::ServerConfig>,
    /// Heartbeat and default-config settings of the registry.
    pub registry: RegistryConfig,
    /// Config payload per configured Node id.
    pub node_configs: Vec<(String, NodeConfigPayload)>,
    /// Largest frame accepted or sent.
    pub max_frame_len: usize,
    /// The provider pool behind [`EdgeHandle::dispatch`]; `None` disables pool dispatch.
    pub pool: Option<PoolConfig>,
    /// Counters shared with the HTTP surface.
    pub metrics: Arc<Metrics>,
    /// Limit on a Node connection's TLS handshake.
    pub handshake_timeout: Duration,
    /// Connections in their TLS handshake at once; more are closed at once.
    pub max_unauthenticated: usize,
    /// Of which from one source address.
    pub max_unauthenticated_per_ip: usize,
    /// Unread bytes one stream may hold before it is ended as a slow consumer.
    pub max_stream_buffer: usize,
    /// How long a stream may hold unread bytes without its reader reading before it is ended
    /// as a slow consumer.
    pub slow_consumer_timeout: Duration,
    /// Frames queued to one Node connection before it counts as not reading.
    pub outbound_frames: usize,
}

/// How long a connection being closed may take to write the frames queued before the close
/// (a refusal's reason) before its socket is dropped regardless.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Default [`TransportConfig::handshake_timeout`].
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`TransportConfig::max_unauthenticated`].
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = 256;
/// Default [`TransportConfig::max_unauthenticated_per_ip`].
pub const DEFAULT_MAX_UNAUTHENTICATED_PER_IP: usize = 32;
/// Default [`TransportConfig::max_stream_buffer`]: 4 MiB.
pub const DEFAULT_MAX_STREAM_BUFFER: usize = 4 * 1024 * 1024;
/// Default [`TransportConfig::slow_consumer_timeout`].
pub const DEFAULT_SLOW_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`TransportConfig::outbound_frames`].
pub const DEFAULT_OUTBOUND_FRAMES: usize = 1024;
/// Capacity of the registry task's input queue.
const INPUT_QUEUE: usize = 4096;
/// Reason of the terminal and the `CancelRequest` of a stream ended as a slow consumer.
pub const SLOW_CONSUMER: &str = "slow consumer";

impl std::fmt::Debug for TransportConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportConfig")
            .field("listen", &self.listen)
            .field(
                "nodes",
                &self.node_configs.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl TransportConfig {
    /// A config with the default registry settings and frame limit.
    pub fn new(listen: SocketAddr, tls: Arc<rustls::ServerConfig>) -> Self {
        Self {
            listen,
            tls,
            registry: RegistryConfig::default(),
            node_configs: Vec::new(),
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            pool: None,
            metrics: Arc::default(),
            handshake_timeout: DEFAULT_TLS_HANDSHAKE_TIMEOUT,
            max_unauthenticated: DEFAULT_MAX_UNAUTHENTICATED,
            max_unauthenticated_per_ip: DEFAULT_MAX_UNAUTHENTICATED_PER_IP,
            max_stream_buffer: DEFAULT_MAX_STREAM_BUFFER,
            slow_consumer_timeout: DEFAULT_SLOW_CONSUMER_TIMEOUT,
            outbound_frames: DEFAULT_OUTBOUND_FRAMES,
        }
    }
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
    /// The transport task is gone (the Edge is shutting down).
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

/// A request to send once the pool has selected a provider. The builder gets the lease and
/// returns the request to send (seed 000: the final body is built after selection); the pool
/// fills in the adapter instance, the target and the winning candidate's stall timeout.
#[derive(Debug)]
pub enum PoolRequest {
    /// A normalized run (native providers).
    Run(RunRequest),
    /// A provider tunnel (OpenAI-compatible providers).
    Tunnel(ProviderTunnelRequest),
    /// Nothing to send to this provider (e.g. a question only some provider kinds can answer):
    /// the lease is released at once and the caller gets [`Dispatched::Nothing`].
    Nothing,
}

impl PoolRequest {
    fn run_id(&self) -> &str {
        match self {
            Self::Run(r) => &r.run_id,
            Self::Tunnel(t) => &t.run_id,
            Self::Nothing => "",
        }
    }
}

/// The stream of a pool dispatch.
#[derive(Debug)]
pub enum Dispatched {
    /// RunEvents.
    Run(RunStream),
    /// Tunnel frames.
    Tunnel(TunnelStream),
    /// The builder chose not to send anything to the selected provider.
    Nothing,
}

/// Builds the request once the provider is known.
pub type BuildRequest = Box<dyn FnOnce(&Lease) -> PoolRequest + Send>;

enum WaitingDispatch {
    /// One step: build and send as soon as the provider is selected.
    Build {
        build: BuildRequest,
        reply: oneshot::Sender<Result<Dispatched, DispatchError>>,
    },
    /// Two steps: hand the selection to the caller ([`EdgeHandle::admit`]).
    Admit {
        reply: oneshot::Sender<Result<Admission, DispatchError>>,
    },
}

impl WaitingDispatch {
    fn is_closed(&self) -> bool {
        match self {
            Self::Build { reply, .. } => reply.is_closed(),
            Self::Admit { reply } => reply.is_closed(),
        }
    }

    fn fail(self, e: DispatchError) {
        match self {
            Self::Build { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Self::Admit { reply } => {
                let _ = reply.send(Err(e));
            }
        }
    }
}

/// A provider selected and held for a request that still has asynchronous work to do before
/// it can be sent (managed mode: acquire a credential lease for exactly this Node). Send it
/// with [`EdgeHandle::send_admitted`]; dropping it releases the provider lease.
#[derive(Debug)]
pub struct Admission {
    lease: Lease,
    recipient: Option<RecipientKey>,
    notices: mpsc::WeakUnboundedSender<Notice>,
    armed: bool,
}

impl Admission {
    /// The selected provider, its Node generation, adapter instance and target.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The lease recipient key the selected Node announced on this generation's registration.
    pub fn recipient(&self) -> Option<&RecipientKey> {
        self.recipient.as_ref()
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.armed
            && let Some(notices) = self.notices.upgrade()
        {
            let _ = notices.send(Notice::ReleaseAdmission(self.lease.id));
        }
    }
}

fn stall(timeout: Duration) -> ResponseStallTimeout {
    ResponseStallTimeout::from_duration(timeout).unwrap_or(ResponseStallTimeout::DEFAULT)
}

/// The events of one dispatched run; ends after exactly one terminal event. Dropping it before
/// the terminal sends `CancelRequest` for the run id at once.
#[derive(Debug)]
pub struct RunStream {
    /// The generation the run was dispatched to.
    pub generation: Generation,
    events: StreamRx<RunEvent>,
    done: bool,
    on_drop: DropNotice,
}

/// Tells the registry task at once when a stream is dropped before its terminal, so that the
/// `CancelRequest` leaves now rather than when the Node's next frame finds no reader.
#[derive(Debug)]
struct DropNotice {
    stream_id: u64,
    notices: mpsc::WeakUnboundedSender<Notice>,
}

impl DropNotice {
    fn notify(&self) {
        if let Some(notices) = self.notices.upgrade() {
            let _ = notices.send(Notice::StreamDropped(self.stream_id));
        }
    }
}

impl Drop for RunStream {
    fn drop(&mut self) {
        if !self.done {
            self.on_drop.notify();
        }
    }
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        if !self.done {
            self.on_drop.notify();
        }
    }
}

impl RunStream {
    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<RunEvent> {
        if self.done {
            return None;
        }
        let ev = self.events.recv().await?;
        self.done = ev.kind.is_terminal();
        Some(ev)
    }
}

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

/// The ordered frames of one provider tunnel. Dropping it before the terminal sends
/// `CancelRequest` for the run id at once (the Node aborts the upstream request).
#[derive(Debug)]
pub struct TunnelStream {
    /// The generation the tunnel was opened on.
    pub generation: Generation,
    events: StreamRx<TunnelEvent>,
    done: bool,
    on_drop: DropNotice,
}

impl TunnelStream {
    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<TunnelEvent> {
        if self.done {
            return None;
        }
        let ev = self.events.recv().await?;
        self.done = ev.is_terminal();
        Some(ev)
    }
}

/// What the Edge tells a connection task: write this frame, or close after what is queued.
type Outbound = Option<RuntimeFrame>;

/// A connection's writing end, held by the registry task.
struct ConnOut {
    frames: mpsc::Sender<Outbound>,
    /// Ends the connection task at once (it may be stuck writing to a peer that does not read).
    kill: CancellationToken,
}

/// Notices from dropped streams and admissions. Apart from [`Input`] because they are sent
/// from `Drop` (no waiting possible) and bounded by construction: at most one per stream or
/// admission.
#[derive(Debug)]
enum Notice {
    /// A stream's reader was dropped before its terminal.
    StreamDropped(u64),
    /// An admission was dropped unsent.
    ReleaseAdmission(LeaseId),
}

enum Input {
    Accepted {
        peer: String,
        out: ConnOut,
        reply: oneshot::Sender<ConnId>,
    },
    Frame(ConnId, RuntimeFrame),
    Closed(ConnId),
    Tunnel {
        node_id: String,
        request: ProviderTunnelRequest,
        response_wait: Option<Duration>,
        reply: oneshot::Sender<Result<TunnelStream, DispatchError>>,
    },
    Run {
        node_id: String,
        request: RunRequest,
        reply: oneshot::Sender<Result<RunStream, DispatchError>>,
    },
    Cancel {
        node_id: String,
        run_id: String,
        reason: String,
    },
    Command {
        node_id: String,
        request: NodeCommandRequest,
        reply: oneshot::Sender<Result<NodeCommandResponse, DispatchError>>,
    },
    Refresh {
        node_id: String,
        config: NodeConfigPayload,
        reply: oneshot::Sender<Result<NodeConfigRefreshResponse, DispatchError>>,
    },
    Dispatch {
        model: String,
        long_context: bool,
        wait: Duration,
        build: BuildRequest,
        reply: oneshot::Sender<Result<Dispatched, DispatchError>>,
    },
    Snapshot {
        reply: oneshot::Sender<Vec<ProviderSnapshot>>,
    },
    PoolStats {
        reply: oneshot::Sender<(usize, u64)>,
    },
    Recover {
        node_id: String,
        reply: oneshot::Sender<Result<usize, DispatchError>>,
    },
    ReadyNodes {
        reply: oneshot::Sender<Vec<(String, Generation)>>,
    },
    Admit {
        model: String,
        long_context: bool,
        wait: Duration,
        reply: oneshot::Sender<Result<Admission, DispatchError>>,
    },
    SendAdmitted {
        lease: Lease,
        request: PoolRequest,
        reply: oneshot::Sender<Result<Dispatched, DispatchError>>,
    },
}

/// The embeddable API of a running transport. Cheap to clone.
#[derive(Clone, Debug)]
pub struct EdgeHandle {
    metrics: Arc<Metrics>,
    configured: Arc<Vec<(String, NodeConfigPayload)>>,
    pool_config: Option<Arc<PoolConfig>>,
    inputs: mpsc::Sender<Input>,
    /// Held only so that streams' weak handles stay valid while the Edge runs.
    _notices: mpsc::UnboundedSender<Notice>,
    lifecycle: broadcast::Sender<Lifecycle>,
    local_addr: SocketAddr,
}

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Input")
    }
}

impl EdgeHandle {
    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The Nodes configured at bind time with their config payloads (the status view lists
    /// them whether connected or not).
    pub fn configured_nodes(&self) -> &[(String, NodeConfigPayload)] {
        &self.configured
    }

    /// The provider pool's configuration at bind time (model groups and their providers).
    pub fn pool_config(&self) -> Option<&PoolConfig> {
        self.pool_config.as_deref()
    }

    /// Lifecycle transitions from now on (observation only; a slow subscriber may lag).
    pub fn subscribe(&self) -> broadcast::Receiver<Lifecycle> {
        self.lifecycle.subscribe()
    }

    /// Dispatches a normalized run to the current ready generation of `node_id`.
    pub async fn run(
        &self,
        node_id: &str,
        request: RunRequest,
    ) -> Result<RunStream, DispatchError> {
        self.ask(|reply| Input::Run {
            node_id: node_id.to_owned(),
            request,
            reply,
        })
        .await?
    }

    /// Opens a provider tunnel on the current ready generation of `node_id`.
    pub async fn tunnel(
        &self,
        node_id: &str,
        request: ProviderTunnelRequest,
    ) -> Result<TunnelStream, DispatchError> {
        self.tunnel_with_wait(node_id, request, None).await
    }

    /// As [`EdgeHandle::tunnel`], but if no frame of the response arrives within
    /// `response_wait`, the Edge cancels the run on the Node and ends the stream with
    /// [`TunnelEvent::WaitTimeout`].
    pub async fn tunnel_with_wait(
        &self,
        node_id: &str,
        request: ProviderTunnelRequest,
        response_wait: Option<Duration>,
    ) -> Result<TunnelStream, DispatchError> {
        self.ask(|reply| Input::Tunnel {
            node_id: node_id.to_owned(),
            request,
            response_wait,
            reply,
        })
        .await?
    }

    /// Dispatches through the provider pool: selects a live candidate of `model` with capacity
    /// (or waits up to `wait` in the bounded queue), builds the request for it and sends it.
    /// The provider lease is released exactly once when the stream ends (terminal, caller drop,
    /// or the Node's fence).
    pub async fn dispatch(
        &self,
        model: &str,
        long_context: bool,
        wait: Duration,
        build: BuildRequest,
    ) -> Result<Dispatched, DispatchError> {
        self.ask(|reply| Input::Dispatch {
            model: model.to_owned(),
            long_context,
            wait,
            build,
            reply,
        })
        .await?
    }

    /// The first half of a two-step dispatch: admission through the pool exactly as
    /// [`EdgeHandle::dispatch`] (queue, wait, errors), but the selected provider is handed back
    /// instead of being sent a request. The provider lease is held until the [`Admission`] is
    /// sent with [`EdgeHandle::send_admitted`] or dropped.
    pub async fn admit(
        &self,
        model: &str,
        long_context: bool,
        wait: Duration,
    ) -> Result<Admission, DispatchError> {
        self.ask(|reply| Input::Admit {
            model: model.to_owned(),
            long_context,
            wait,
            reply,
        })
        .await?
    }

    /// Sends `request` on an admitted provider. Fails with [`DispatchError::Disconnected`] when
    /// the Node's generation ended meanwhile (its leases were released with the fence).
    pub async fn send_admitted(
        &self,
        mut admission: Admission,
        request: PoolRequest,
    ) -> Result<Dispatched, DispatchError> {
        admission.armed = false;
        let lease = admission.lease.clone();
        self.ask(|reply| Input::SendAdmitted {
            lease,
            request,
            reply,
        })
        .await?
    }

    /// CAPABILITIES recovery probe of `node_id`: the Node probes its exact targets; each
    /// runtime-unavailable overlay of the Node's current generation is cleared only by a
    /// higher-sequence `available` answer naming exactly one provider binding. Returns how many
    /// overlays were cleared; anything else in the answer changes nothing.
    pub async fn recover(&self, node_id: &str) -> Result<usize, DispatchError> {
        self.ask(|reply| Input::Recover {
            node_id: node_id.to_owned(),
            reply,
        })
        .await?
    }

    /// The Edge's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// `(queue depth, leases held)` of the pool (zeros without a pool).
    pub async fn pool_stats(&self) -> Result<(usize, u64), DispatchError> {
        self.ask(|reply| Input::PoolStats { reply }).await
    }

    /// The pool's provider snapshots (empty without a pool).
    pub async fn snapshot(&self) -> Result<Vec<ProviderSnapshot>, DispatchError> {
        self.ask(|reply| Input::Snapshot { reply }).await
    }

    /// Asks `node_id` to cancel `run_id` (its terminal then arrives on the run's stream).
    pub async fn cancel(
        &self,
        node_id: &str,
        run_id: &str,
        reason: &str,
    ) -> Result<(), DispatchError> {
        self.send(Input::Cancel {
            node_id: node_id.to_owned(),
            run_id: run_id.to_owned(),
            reason: reason.to_owned(),
        })
        .await
    }

    /// Sends a command to a ready Node and waits for its answer.
    pub async fn command(
        &self,
        node_id: &str,
        request: NodeCommandRequest,
    ) -> Result<NodeCommandResponse, DispatchError> {
        self.ask(|reply| Input::Command {
            node_id: node_id.to_owned(),
            request,
            reply,
        })
        .await?
    }

    /// Pushes a config refresh to a ready Node and waits for its outcome.
    pub async fn refresh(
        &self,
        node_id: &str,
        config: NodeConfigPayload,
    ) -> Result<NodeConfigRefreshResponse, DispatchError> {
        self.ask(|reply| Input::Refresh {
            node_id: node_id.to_owned(),
            config,
            reply,
        })
        .await?
    }

    /// The dispatch-ready Nodes and their generations.
    pub async fn ready_nodes(&self) -> Result<Vec<(String, Generation)>, DispatchError> {
        self.ask(|reply| Input::ReadyNodes { reply }).await
    }

    /// Sends a request to the registry task and waits for its reply.
    async fn ask<T>(
        &self,
        input: impl FnOnce(oneshot::Sender<T>) -> Input,
    ) -> Result<T, DispatchError> {
        let (reply, rx) = oneshot::channel();
        self.send(input(reply)).await?;
        rx.await.map_err(|_| DispatchError::Stopped)
    }

    /// Hands `input` to the registry task, waiting while its queue is full.
    async fn send(&self, input: Input) -> Result<(), DispatchError> {
        self.inputs
            .send(input)
            .await
            .map_err(|_| DispatchError::Stopped)
    }
}

/// Binds the listener and starts the transport: an accept task (returned; abort it to stop
/// accepting), one task per connection, and the registry task, which runs while any
/// [`EdgeHandle`] or connection is alive.
pub async fn bind(
    config: TransportConfig,
) -> std::io::Result<(EdgeHandle, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(config.listen).await?;
    let local_addr = listener.local_addr()?;
    let (inputs, input_rx) = mpsc::channel(INPUT_QUEUE);
    let (notices, notice_rx) = mpsc::unbounded_channel();
    let (lifecycle, _) = broadcast::channel(1024);
    let handle = EdgeHandle {
        metrics: config.metrics.clone(),
        configured: Arc::new(config.node_configs.clone()),
        pool_config: config.pool.clone().map(Arc::new),
        inputs: inputs.clone(),
        _notices: notices.clone(),
        lifecycle: lifecycle.clone(),
        local_addr,
    };
    let mut registry = Registry::new(config.registry.clone());
    for (node_id, payload) in &config.node_configs {
        registry.set_node_config(node_id, Some(payload.clone()));
    }
    let limits = Arc::new(Handshakes::new(&config));
    let accept_inputs = inputs.downgrade();
    let accept = tokio::spawn(accept_loop(listener, limits, accept_inputs));
    tokio::spawn(registry_task(
        Setup {
            registry,
            pool: config.pool.clone().map(Pool::new),
            metrics: config.metrics.clone(),
            lifecycle,
            notices: notices.downgrade(),
            max_stream_buffer: config.max_stream_buffer,
            slow_consumer_timeout: config.slow_consumer_timeout,
        },
        input_rx,
        notice_rx,
    ));
    Ok((handle, accept))
}

/// The TLS handshake phase of Node connections: its acceptor, timeout and connection caps.
struct Handshakes {
    acceptor: TlsAcceptor,
    codec: FrameCodec,
    timeout: Duration,
    permits: Arc<tokio::sync::Semaphore>,
    per_ip_max: usize,
    per_ip: std::sync::Mutex<HashMap<std::net::IpAddr, usize>>,
    outbound_frames: usize,
    metrics: Arc<Metrics>,
    refusals: std::sync::Mutex<crate::ratelog::RateLimited>,
}

impl Handshakes {
    fn new(config: &TransportConfig) -> Self {
        Self {
            acceptor: TlsAcceptor::from(config.tls.clone()),
            codec: FrameCodec::with_max_frame_len(config.max_frame_len),
            timeout: config.handshake_timeout,
            permits: Arc::new(tokio::sync::Semaphore::new(config.max_unauthenticated)),
            per_ip_max: config.max_unauthenticated_per_ip,
            per_ip: std::sync::Mutex::new(HashMap::new()),
            outbound_frames: config.outbound_frames.max(1),
            metrics: config.metrics.clone(),
            refusals: std::sync::Mutex::new(crate::ratelog::RateLimited::new(Duration::from_secs(
                10,
            ))),
        }
    }

    /// Counts a refused or failed handshake; logs one line per 10 s at most.
    fn refused(&self, reason: crate::metrics::Refusal, peer: SocketAddr, detail: &str) {
        self.metrics.node_connection_refused(reason);
        let mut log = self
            .refusals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(suppressed) = log.hit() {
            tracing::info!(
                %peer,
                reason = reason.as_str(),
                detail,
                suppressed,
                "node connection refused (counted in iop_edge_node_connections_refused_total)"
            );
        }
    }

    /// Takes a slot for a connection from `ip`, or `None` (cap reached).
    fn admit(
        self: &Arc<Self>,
        ip: std::net::IpAddr,
    ) -> Result<HandshakeSlot, crate::metrics::Refusal> {
        let permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| crate::metrics::Refusal::Capacity)?;
        let mut per_ip = self
            .per_ip
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = per_ip.entry(ip).or_insert(0);
        if *n >= self.per_ip_max {
            return Err(crate::metrics::Refusal::PerIp);
        }
        *n += 1;
        Ok(HandshakeSlot {
            limits: self.clone(),
            ip,
            _permit: permit,
        })
    }
}

/// A connection's place among the handshakes in progress; freed on drop.
struct HandshakeSlot {
    limits: Arc<Handshakes>,
    ip: std::net::IpAddr,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut per_ip = self
            .limits
            .per_ip
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                per_ip.remove(&self.ip);
            }
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    limits: Arc<Handshakes>,
    inputs: mpsc::WeakSender<Input>,
) {
    let mut errors = crate::ratelog::RateLimited::new(Duration::from_secs(10));
    loop {
        let (tcp, peer_addr) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning, log rarely.
                limits.metrics.accept_error();
                if let Some(suppressed) = errors.hit() {
                    tracing::warn!(error = %e, suppressed, "node listener: accept failed; backing off");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(inputs) = inputs.upgrade() else {
            return;
        };
        let slot = match limits.admit(peer_addr.ip()) {
            Ok(slot) => slot,
            Err(reason) => {
                // Closed at once: a flood of silent connections costs no handshake state and
                // cannot take the file descriptors the HTTP API needs.
                drop(tcp);
                limits.refused(reason, peer_addr, "connection cap reached");
                continue;
            }
        };
        let limits = limits.clone();
        tokio::spawn(async move {
            if tcp.set_nodelay(true).is_err() {
                return;
            }
            let tls = match tokio::time::timeout(limits.timeout, limits.acceptor.accept(tcp)).await
            {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    let detail = e.to_string();
                    limits.refused(crate::metrics::Refusal::HandshakeFailed, peer_addr, &detail);
                    return;
                }
                Err(_) => {
                    limits.refused(
                        crate::metrics::Refusal::HandshakeTimeout,
                        peer_addr,
                        "tls handshake timed out",
                    );
                    return;
                }
            };
            // Authenticated: registration has its own deadline (the registry's).
            drop(slot);
            let Ok(peer) = peer_identity(tls.get_ref().1) else {
                return;
            };
            connection(
                tls,
                peer.name().to_owned(),
                limits.codec,
                limits.outbound_frames,
                inputs,
            )
            .await;
        });
    }
}

/// One connection's I/O: frames in to the registry task, frames out from it.
async fn connection<S>(
    stream: S,
    peer: String,
    codec: FrameCodec,
    outbound_frames: usize,
    inputs: mpsc::Sender<Input>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (frames, mut out_rx) = mpsc::channel::<Outbound>(outbound_frames);
    let kill = CancellationToken::new();
    let out = ConnOut {
        frames,
        kill: kill.clone(),
    };
    let (reply, conn) = oneshot::channel();
    if inputs
        .send(Input::Accepted {
            peer: peer.clone(),
            out,
            reply,
        })
        .await
        .is_err()
    {
        return;
    }
    let Ok(conn) = conn.await else { return };
    let mut framed = Framed::new(stream, TokioCodec::<RuntimeFrame>::new(codec));
    let io = async {
        loop {
            tokio::select! {
                out = out_rx.recv() => match out {
                    Some(Some(frame)) => {
                        if framed.feed(frame).await.is_err() {
                            break;
                        }
                        // Write everything already queued before flushing once.
                        let mut closed = false;
                        while let Ok(more) = out_rx.try_recv() {
                            match more {
                                Some(frame) => {
                                    if framed.feed(frame).await.is_err() {
                                        closed = true;
                                        break;
                                    }
                                }
                                None => {
                                    closed = true;
                                    break;
                                }
                            }
                        }
                        if framed.flush().await.is_err() || closed {
                            break;
                        }
                    }
                    _ => break,
                },
                frame = framed.next() => match frame {
                    Some(Ok(frame)) => {
                        // Waits while the registry's queue is full: this Node's socket is not
                        // read meanwhile, and TCP pushes back on it alone.
                        if inputs.send(Input::Frame(conn, frame)).await.is_err() {
                            break;
                        }
                    }
                    Some(Err(e)) if is_eof(&e) => {
                        tracing::debug!(node = %peer, "node closed the connection without close_notify");
                        break;
                    }
                    Some(Err(e)) => {
                        tracing::info!(node = %peer, error = %e, "invalid frame from node; closing");
                        break;
                    }
                    None => break,
                },
            }
        }
        let _ = framed.close().await;
    };
    tokio::select! {
        () = io => {}
        // The registry gave up on this peer (e.g. it does not read): drop the socket now,
        // even mid-write.
        () = kill.cancelled() => {}
    }
    let _ = inputs.send(Input::Closed(conn)).await;
}

/// A peer that closed its socket without TLS `close_notify` (a killed process, a reset):
/// an ordinary disconnect, not an invalid frame.
fn is_eof(e: &iop_wire::codec::CodecError) -> bool {
    use std::io::ErrorKind;
    matches!(
        e,
        iop_wire::codec::CodecError::Io(io) if matches!(
            io.kind(),
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
        )
    )
}

struct Route {
    node_id: String,
    generation: Generation,
    run_id: String,
    sink: Sink,
    /// The provider lease this stream holds (pool dispatch), released when the route ends.
    lease: Option<LeaseId>,
}

/// Where a stream's events go.
enum Sink {
    Run(StreamTx<RunEvent>),
    Tunnel(StreamTx<TunnelEvent>),
}

impl Sink {
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

    fn level(&self) -> stream_buf::Level {
        match self {
            Self::Run(tx) => tx.level(),
            Self::Tunnel(tx) => tx.level(),
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

enum Pending {
    Command(oneshot::Sender<Result<NodeCommandResponse, DispatchError>>),
    Refresh(oneshot::Sender<Result<NodeConfigRefreshResponse, DispatchError>>),
    /// A CAPABILITIES probe whose answer may clear runtime-unavailable overlays.
    Recovery(oneshot::Sender<Result<usize, DispatchError>>),
}

impl Pending {
    fn fail(self, e: DispatchError) {
        match self {
            Self::Command(r) => {
                let _ = r.send(Err(e));
            }
            Self::Refresh(r) => {
                let _ = r.send(Err(e));
            }
            Self::Recovery(r) => {
                let _ = r.send(Err(e));
            }
        }
    }
}

struct State {
    registry: Registry,
    outs: HashMap<ConnId, ConnOut>,
    routes: HashMap<u64, Route>,
    /// Ordering state of every open tunnel stream (stream ids are unique across connections).
    tunnels: TunnelSequencer,
    /// Response-wait deadlines of tunnels that have not received a frame yet, by time and by
    /// stream (so the first frame clears its timer in O(log n)).
    wait_timers: BTreeSet<(Instant, u64)>,
    waiting: HashMap<u64, Instant>,
    pool: Option<Pool>,
    waiting_dispatch: HashMap<RequestId, WaitingDispatch>,
    /// Last `health_observation_seq` seen per provider binding and generation.
    observed: HashMap<(ProviderKey, Generation), u64>,
    metrics: Arc<Metrics>,
    pending: HashMap<u64, (String, Generation, Pending)>,
    next_stream: u64,
    next_correlation: u64,
    lifecycle: broadcast::Sender<Lifecycle>,
    /// Where streams and admissions report their drop, weakly.
    notices: mpsc::WeakUnboundedSender<Notice>,
    /// The lease recipient key of each Node's current registration (managed mode).
    recipients: HashMap<String, (Generation, Option<RecipientKey>)>,
    max_stream_buffer: usize,
    slow_consumer_timeout: Duration,
    /// Streams holding unread bytes, by the time to look again, and the read count seen when
    /// the timer was armed.
    slow_timers: BTreeSet<(Instant, u64)>,
    slow: HashMap<u64, (Instant, u64)>,
}

/// What the registry task starts with.
struct Setup {
    registry: Registry,
    pool: Option<Pool>,
    metrics: Arc<Metrics>,
    lifecycle: broadcast::Sender<Lifecycle>,
    notices: mpsc::WeakUnboundedSender<Notice>,
    max_stream_buffer: usize,
    slow_consumer_timeout: Duration,
}

fn now() -> std::time::Instant {
    Instant::now().into_std()
}

async fn registry_task(
    setup: Setup,
    mut input_rx: mpsc::Receiver<Input>,
    mut notice_rx: mpsc::UnboundedReceiver<Notice>,
) {
    let Setup {
        registry,
        pool,
        metrics,
        lifecycle,
        notices,
        max_stream_buffer,
        slow_consumer_timeout,
    } = setup;
    let mut st = State {
        notices,
        recipients: HashMap::new(),
        max_stream_buffer,
        slow_consumer_timeout,
        slow_timers: BTreeSet::new(),
        slow: HashMap::new(),
        registry,
        outs: HashMap::new(),
        routes: HashMap::new(),
        tunnels: TunnelSequencer::with_max_streams(usize::MAX),
        wait_timers: BTreeSet::new(),
        waiting: HashMap::new(),
        pool,
        waiting_dispatch: HashMap::new(),
        observed: HashMap::new(),
        metrics,
        pending: HashMap::new(),
        next_stream: 1,
        next_correlation: 1,
        lifecycle,
    };
    loop {
        let registry_deadline = st.registry.poll_timeout().map(Instant::from_std);
        let wait_deadline = st.wait_timers.first().map(|(at, _)| *at);
        let pool_deadline = st
            .pool
            .as_ref()
            .and_then(Pool::poll_timeout)
            .map(Instant::from_std);
        let slow_deadline = st.slow_timers.first().map(|(at, _)| *at);
        let deadline = [
            registry_deadline,
            wait_deadline,
            pool_deadline,
            slow_deadline,
        ]
        .into_iter()
        .flatten()
        .min();
        tokio::select! {
            input = input_rx.recv() => match input {
                Some(input) => st.handle(input),
                None => return,
            },
            Some(notice) = notice_rx.recv() => st.notice(notice),
            () = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {
                st.registry.handle_timeout(now());
                st.expire_waits();
                st.expire_slow();
                if let Some(pool) = st.pool.as_mut() {
                    pool.handle_timeout(now());
                }
            }
        }
        st.drain();
    }
}

impl State {
    fn drop_notice(&self, stream_id: u64) -> DropNotice {
        DropNotice {
            stream_id,
            notices: self.notices.clone(),
        }
    }

    fn notice(&mut self, notice: Notice) {
        match notice {
            Notice::StreamDropped(stream_id) => {
                self.end_stream(stream_id, "caller_disconnected");
            }
            Notice::ReleaseAdmission(id) => {
                if let Some(pool) = self.pool.as_mut() {
                    pool.release(id);
                }
            }
        }
    }

    /// Ends a stream for its caller and asks the Node to stop the provider work.
    fn end_stream(&mut self, stream_id: u64, reason: &str) {
        if let Some(route) = self.take_route(stream_id) {
            let cancel = RuntimeMessage::CancelRequest(CancelRequest {
                run_id: route.run_id,
                reason: reason.into(),
            });
            let _ = self.registry.send(
                now(),
                &route.node_id,
                route.generation,
                RuntimeFrame::new(cancel),
            );
        }
    }

    /// After an event was queued on `stream_id` leaving `level`: over the byte bound the stream
    /// ends now; with bytes unread, the slow-consumer timer runs.
    fn watch_level(&mut self, stream_id: u64, level: stream_buf::Level) {
        if level.bytes > self.max_stream_buffer {
            self.slow_consumer(stream_id);
        } else if level.bytes > 0 && !self.slow.contains_key(&stream_id) {
            let at = Instant::now() + self.slow_consumer_timeout;
            self.slow.insert(stream_id, (at, level.reads));
            self.slow_timers.insert((at, stream_id));
        }
    }

    fn slow_consumer(&mut self, stream_id: u64) {
        if let Some(route) = self.routes.get(&stream_id) {
            route.sink.slow_consumer();
            self.metrics.slow_consumer();
            tracing::info!(
                node_id = %route.node_id,
                run_id = %route.run_id,
                "stream ended: its reader fell behind (slow consumer); cancelling upstream"
            );
            self.end_stream(stream_id, "slow_consumer");
        }
    }

    /// Looks again at streams that held unread bytes: caught up (timer off), progressing (timer
    /// re-armed) or stuck past the timeout (ended).
    fn expire_slow(&mut self) {
        let now = Instant::now();
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
                let at = now + self.slow_consumer_timeout;
                self.slow.insert(stream_id, (at, level.reads));
                self.slow_timers.insert((at, stream_id));
            } else {
                self.slow_consumer(stream_id);
            }
        }
    }

    fn handle(&mut self, input: Input) {
        match input {
            Input::Accepted { peer, out, reply } => {
                let conn = self.registry.accept(now(), Some(peer));
                self.outs.insert(conn, out);
                let _ = reply.send(conn);
            }
            Input::Frame(conn, frame) => self.registry.handle_frame(now(), conn, frame),
            Input::Closed(conn) => {
                self.registry.handle_close(conn);
                self.outs.remove(&conn);
            }
            Input::Run {
                node_id,
                request,
                reply,
            } => {
                let run_id = request.run_id.clone();
                let (tx, rx) = stream_buf::channel();
                let opened = self.open_stream(node_id, run_id, Sink::Run(tx), |stream_id| {
                    RuntimeFrame::on_stream(stream_id, RuntimeMessage::RunRequest(request))
                });
                match opened {
                    Ok((stream_id, generation)) => {
                        let stream = RunStream {
                            generation,
                            events: rx,
                            done: false,
                            on_drop: self.drop_notice(stream_id),
                        };
                        if reply.send(Ok(stream)).is_err() {
                            self.end_stream(stream_id, "caller_disconnected");
                        }
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Input::Tunnel {
                node_id,
                request,
                response_wait,
                reply,
            } => {
                let run_id = request.run_id.clone();
                let (tx, rx) = stream_buf::channel();
                let opened = self.open_stream(node_id, run_id, Sink::Tunnel(tx), |stream_id| {
                    RuntimeFrame::on_stream(
                        stream_id,
                        RuntimeMessage::ProviderTunnelRequest(request),
                    )
                });
                match opened {
                    Ok((stream_id, generation)) => {
                        if let Some(wait) = response_wait {
                            let at = Instant::now() + wait;
                            self.wait_timers.insert((at, stream_id));
                            self.waiting.insert(stream_id, at);
                        }
                        let stream = TunnelStream {
                            generation,
                            events: rx,
                            done: false,
                            on_drop: self.drop_notice(stream_id),
                        };
                        if reply.send(Ok(stream)).is_err() {
                            self.end_stream(stream_id, "caller_disconnected");
                        }
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Input::Cancel {
                node_id,
                run_id,
                reason,
            } => {
                if let Some((_, generation)) = self.registry.ready_generation(&node_id) {
                    let cancel = RuntimeMessage::CancelRequest(CancelRequest { run_id, reason });
                    let _ =
                        self.registry
                            .send(now(), &node_id, generation, RuntimeFrame::new(cancel));
                }
            }
            Input::Command {
                node_id,
                request,
                reply,
            } => {
                self.correlated(
                    node_id,
                    RuntimeMessage::NodeCommandRequest(request),
                    Pending::Command(reply),
                );
            }
            Input::Refresh {
                node_id,
                config,
                reply,
            } => {
                self.correlated(
                    node_id,
                    RuntimeMessage::NodeConfigRefreshRequest(config),
                    Pending::Refresh(reply),
                );
            }
            Input::Dispatch {
                model,
                long_context,
                wait,
                build,
                reply,
            } => {
                let waiting = WaitingDispatch::Build { build, reply };
                self.submit(&model, long_context, wait, waiting);
            }
            Input::Admit {
                model,
                long_context,
                wait,
                reply,
            } => {
                self.submit(&model, long_context, wait, WaitingDispatch::Admit { reply });
            }
            Input::SendAdmitted {
                lease,
                request,
                reply,
            } => {
                // Still held? A fence of its generation released it (exactly once) meanwhile.
                let held = self
                    .pool
                    .as_ref()
                    .and_then(|p| p.lease(lease.id))
                    .is_some_and(|l| *l == lease);
                if held {
                    self.send_on(lease, request, reply);
                } else {
                    let _ = reply.send(Err(DispatchError::Disconnected));
                }
            }
            Input::PoolStats { reply } => {
                let stats = self
                    .pool
                    .as_ref()
                    .map_or((0, 0), |p| (p.queue_len(), p.lease_count() as u64));
                let _ = reply.send(stats);
            }
            Input::Recover { node_id, reply } => {
                let probe = NodeCommandRequest {
                    kind: NodeCommandKind::Capabilities,
                    adapter: String::new(),
                    target: String::new(),
                };
                self.correlated(
                    node_id,
                    RuntimeMessage::NodeCommandRequest(probe),
                    Pending::Recovery(reply),
                );
            }
            Input::Snapshot { reply } => {
                let _ = reply.send(self.pool.as_ref().map(Pool::snapshot).unwrap_or_default());
            }
            Input::ReadyNodes { reply } => {
                let _ = reply.send(self.registry.ready_nodes());
            }
        }
    }

    /// Edge terminal handoff (seed 000). A stall terminal arrived on `generation` for the stream
    /// holding `lease`: when its typed evidence is valid and names the lease's own adapter and
    /// target on the lease's generation, it is a validated current bound stall — the metadata
    /// (of the run's ERROR event or the tunnel's ERROR delivery) gets `provider_id`, `provider_health` and `recovery_handoff=confirmed`, and
    /// only a *fresh* (higher `health_observation_seq`) `unavailable` observation sets the
    /// runtime-unavailable overlay. Rejected or mismatched evidence changes nothing; the lease
    /// is released by the terminal either way. Never adds `recovery_eligible`.
    fn handoff(
        &mut self,
        lease: Option<LeaseId>,
        generation: Generation,
        evidence: &FailureEvidence,
        metadata: Option<&mut BTreeMap<String, String>>,
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
            self.metrics.recovery_eligibility(false);
            return;
        }
        self.metrics.recovery_eligibility(true);
        self.metrics.health_evidence(f.health.provider_health());
        if let Some(metadata) = metadata {
            metadata.insert("provider_id".into(), lease.key.provider_id.clone());
            metadata.insert("provider_health".into(), f.health.provider_health().into());
            metadata.insert("recovery_handoff".into(), "confirmed".into());
        }
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
                self.metrics.health_transition(true);
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
    fn recover(
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
            self.metrics.recovery_result(ok);
            if ok {
                self.metrics.health_transition(false);
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
    fn take_route(&mut self, stream_id: u64) -> Option<Route> {
        let route = self.routes.remove(&stream_id)?;
        if let Some((at, _)) = self.slow.remove(&stream_id) {
            self.slow_timers.remove(&(at, stream_id));
        }
        self.tunnels.close(stream_id);
        if let (Some(lease), Some(pool)) = (route.lease, self.pool.as_mut()) {
            pool.release(lease);
        }
        Some(route)
    }

    /// Dispatches pool grants and fails timed-out waiters. Returns whether there were any.
    fn pump_pool(&mut self) -> bool {
        let mut any = false;
        loop {
            let Some(event) = self.pool.as_mut().and_then(Pool::poll_event) else {
                return any;
            };
            any = true;
            match event {
                PoolEvent::Granted { request, lease } => {
                    if let Some(waiting) = self.waiting_dispatch.remove(&request) {
                        self.dispatch_on(lease, waiting);
                    } else if let Some(pool) = self.pool.as_mut() {
                        pool.release(lease.id);
                    }
                }
                PoolEvent::WaitTimedOut { request } => {
                    if let Some(waiting) = self.waiting_dispatch.remove(&request) {
                        waiting.fail(DispatchError::WaitTimeout);
                    }
                }
            }
        }
    }

    fn submit(
        &mut self,
        model: &str,
        long_context: bool,
        wait: Duration,
        waiting: WaitingDispatch,
    ) {
        let Some(pool) = self.pool.as_mut() else {
            return waiting.fail(DispatchError::UnknownModel);
        };
        match pool.submit(now(), model, long_context, wait) {
            Ok(Submitted::Granted(lease)) => self.dispatch_on(lease, waiting),
            Ok(Submitted::Queued(id)) => {
                self.waiting_dispatch.insert(id, waiting);
            }
            Err(e) => waiting.fail(match e {
                PoolError::QueueFull => DispatchError::QueueFull,
                _ => DispatchError::UnknownModel,
            }),
        }
    }

    /// A granted dispatch: builds and sends it, or hands the admission to its caller.
    fn dispatch_on(&mut self, lease: Lease, waiting: WaitingDispatch) {
        if waiting.is_closed() {
            // The caller went away while queued.
            if let Some(pool) = self.pool.as_mut() {
                pool.release(lease.id);
            }
            return;
        }
        match waiting {
            WaitingDispatch::Build { build, reply } => {
                let built = build(&lease);
                self.send_on(lease, built, reply);
            }
            WaitingDispatch::Admit { reply } => {
                let recipient = self
                    .recipients
                    .get(&lease.key.node_id)
                    .filter(|(g, _)| *g == lease.generation)
                    .and_then(|(_, k)| k.clone());
                let id = lease.id;
                let admission = Admission {
                    lease,
                    recipient,
                    notices: self.notices.clone(),
                    armed: true,
                };
                if let Err(Ok(mut admission)) = reply.send(Ok(admission)) {
                    admission.armed = false;
                    if let Some(pool) = self.pool.as_mut() {
                        pool.release(id);
                    }
                }
            }
        }
    }

    /// Sends a built request on a held lease and hands the stream to the caller.
    fn send_on(
        &mut self,
        lease: Lease,
        built: PoolRequest,
        reply: oneshot::Sender<Result<Dispatched, DispatchError>>,
    ) {
        let release = |st: &mut Self, id| {
            if let Some(pool) = st.pool.as_mut() {
                pool.release(id);
            }
        };
        let node_id = lease.key.node_id.clone();
        let run_id = built.run_id().to_owned();
        let (result, stream_id) = match built {
            PoolRequest::Nothing => (Ok(Dispatched::Nothing), None),
            PoolRequest::Run(mut req) => {
                req.adapter.clone_from(&lease.adapter);
                req.target.clone_from(&lease.target);
                req.response_stall_timeout = stall(lease.response_stall_timeout);
                let (tx, rx) = stream_buf::channel();
                match self.open_stream(node_id, run_id, Sink::Run(tx), |id| {
                    RuntimeFrame::on_stream(id, RuntimeMessage::RunRequest(req))
                }) {
                    Ok((id, generation)) => (
                        Ok(Dispatched::Run(RunStream {
                            generation,
                            events: rx,
                            done: false,
                            on_drop: self.drop_notice(id),
                        })),
                        Some(id),
                    ),
                    Err(e) => (Err(e), None),
                }
            }
            PoolRequest::Tunnel(mut req) => {
                req.adapter.clone_from(&lease.adapter);
                req.target.clone_from(&lease.target);
                req.response_stall_timeout = stall(lease.response_stall_timeout);
                let (tx, rx) = stream_buf::channel();
                match self.open_stream(node_id, run_id, Sink::Tunnel(tx), |id| {
                    RuntimeFrame::on_stream(id, RuntimeMessage::ProviderTunnelRequest(req))
                }) {
                    Ok((id, generation)) => (
                        Ok(Dispatched::Tunnel(TunnelStream {
                            generation,
                            events: rx,
                            done: false,
                            on_drop: self.drop_notice(id),
                        })),
                        Some(id),
                    ),
                    Err(e) => (Err(e), None),
                }
            }
        };
        match stream_id {
            Some(id) => {
                if let Some(route) = self.routes.get_mut(&id) {
                    route.lease = Some(lease.id);
                }
                if reply.send(result).is_err() {
                    self.end_stream(id, "caller_disconnected");
                }
            }
            None => {
                release(self, lease.id);
                let _ = reply.send(result);
            }
        }
    }

    /// Ends tunnels whose response did not start in time, and cancels them on the Node.
    fn expire_waits(&mut self) {
        let now = Instant::now();
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
                self.end_stream(stream_id, "caller_disconnected");
            }
        }
    }

    /// Sends a stream's opening frame to the ready generation of `node_id` and routes its
    /// answers to `sink`.
    fn open_stream(
        &mut self,
        node_id: String,
        run_id: String,
        sink: Sink,
        frame: impl FnOnce(u64) -> RuntimeFrame,
    ) -> Result<(u64, Generation), DispatchError> {
        let (_, generation) = self
            .registry
            .ready_generation(&node_id)
            .ok_or(DispatchError::NotReady)?;
        let stream_id = self.next_stream;
        self.next_stream += 1;
        if matches!(sink, Sink::Tunnel(_)) && self.tunnels.open(stream_id).is_err() {
            return Err(DispatchError::NotReady);
        }
        if let Err(e) = self
            .registry
            .send(now(), &node_id, generation, frame(stream_id))
        {
            self.tunnels.close(stream_id);
            return Err(match e {
                SendError::Invalid(_) => DispatchError::InvalidRequest,
                _ => DispatchError::NotReady,
            });
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
        Ok((stream_id, generation))
    }

    fn correlated(&mut self, node_id: String, message: RuntimeMessage, pending: Pending) {
        let fail = |p: Pending, e| p.fail(e);
        let Some((_, generation)) = self.registry.ready_generation(&node_id) else {
            return fail(pending, DispatchError::NotReady);
        };
        let id = self.next_correlation;
        self.next_correlation += 1;
        if self
            .registry
            .send(
                now(),
                &node_id,
                generation,
                RuntimeFrame::correlated(id, message),
            )
            .is_err()
        {
            return fail(pending, DispatchError::NotReady);
        }
        self.pending.insert(id, (node_id, generation, pending));
    }

    fn drain(&mut self) {
        loop {
            let mut progressed = false;
            while let Some((conn, frame)) = self.registry.poll_transmit() {
                progressed = true;
                let Some(out) = self.outs.get(&conn) else {
                    continue;
                };
                if let Err(mpsc::error::TrySendError::Full(_)) = out.frames.try_send(Some(frame)) {
                    // The peer does not read what we send it (even pongs): let it go.
                    tracing::info!(?conn, "node connection not reading its frames; closing");
                    out.kill.cancel();
                    self.registry.close(conn, FenceCause::NotReading);
                }
            }
            while let Some(event) = self.registry.poll_event() {
                progressed = true;
                self.registry_event(event);
            }
            // Pool grants open streams, which queue transmits: go round again.
            progressed |= self.pump_pool();
            if !progressed {
                return;
            }
        }
    }

    fn registry_event(&mut self, event: RegistryEvent) {
        match event {
            RegistryEvent::Registered {
                node_id,
                generation,
                recipient,
                ..
            } => {
                self.recipients.insert(node_id, (generation, recipient));
            }
            RegistryEvent::NodeReady {
                node_id,
                generation,
                ..
            } => {
                // Activate the generation's resources (and pump waiters) before observers hear.
                if let Some(pool) = self.pool.as_mut() {
                    pool.node_ready(&node_id, generation);
                }
                let _ = self.lifecycle.send(Lifecycle::Connected {
                    node_id,
                    generation,
                });
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
                if self
                    .recipients
                    .get(&node_id)
                    .is_some_and(|(g, _)| *g == generation)
                {
                    self.recipients.remove(&node_id);
                }
                self.fence(&node_id, generation);
                let _ = self.lifecycle.send(Lifecycle::Disconnected {
                    node_id,
                    generation,
                });
            }
            RegistryEvent::Frame {
                node_id,
                generation,
                frame,
                ..
            } => {
                self.route(&node_id, generation, frame);
            }
            RegistryEvent::CloseConnection { conn, cause } => {
                if let Some(out) = self.outs.remove(&conn) {
                    tracing::info!(?conn, cause = cause.as_str(), "closing node connection");
                    // After the frames already queued (a refusal's reason), unless the queue is
                    // full: then at once. A peer that does not read them cannot hold the
                    // socket open: the writer would wait on it forever, so the close is forced
                    // after CLOSE_GRACE.
                    if out.frames.try_send(None).is_err() {
                        out.kill.cancel();
                    } else {
                        let kill = out.kill;
                        tokio::spawn(async move {
                            tokio::time::sleep(CLOSE_GRACE).await;
                            kill.cancel();
                        });
                    }
                }
            }
            _ => {}
        }
    }

    /// Ends every run and command of a fenced generation, in the same step as the fence.
    fn fence(&mut self, node_id: &str, generation: Generation) {
        let dead: Vec<u64> = self
            .routes
            .iter()
            .filter(|(_, r)| r.node_id == node_id && r.generation == generation)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            if let Some(route) = self.take_route(id) {
                route.sink.disconnected();
            }
        }
        let dead: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, (n, g, _))| n == node_id && *g == generation)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            if let Some((_, _, pending)) = self.pending.remove(&id) {
                pending.fail(DispatchError::Disconnected);
            }
        }
    }

    fn route(&mut self, node_id: &str, generation: Generation, frame: RuntimeFrame) {
        match frame.message {
            RuntimeMessage::RunEvent(ev) => {
                let Some(route) = self.routes.get(&frame.stream_id) else {
                    return;
                };
                // Transport identity, not payload identity, decides where a frame belongs.
                if route.node_id != node_id || route.generation != generation {
                    return;
                }
                let Sink::Run(_) = &route.sink else { return };
                let lease = route.lease;
                let mut ev = ev;
                if ev.kind == RunEventKind::Error
                    && let Some(evidence) = ev.execution_failure.clone()
                {
                    self.handoff(lease, generation, &evidence, Some(&mut ev.metadata));
                }
                let Some(Route {
                    sink: Sink::Run(tx),
                    ..
                }) = self.routes.get(&frame.stream_id)
                else {
                    return;
                };
                let terminal = ev.kind.is_terminal();
                let size = run_event_size(&ev);
                let delivered = tx.push(ev, size);
                if terminal {
                    self.take_route(frame.stream_id);
                } else {
                    match delivered {
                        Some(level) => self.watch_level(frame.stream_id, level),
                        None => self.end_stream(frame.stream_id, "caller_disconnected"),
                    }
                }
            }
            RuntimeMessage::ProviderTunnelFrame(tf) => {
                let stream_id = frame.stream_id;
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
                    self.handoff(lease, generation, &evidence, Some(metadata));
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
                    None => self.end_stream(stream_id, "caller_disconnected"),
                    Some(_) if violation => self.end_stream(stream_id, "protocol_violation"),
                    Some(_) if terminal => {
                        self.take_route(stream_id);
                    }
                    Some(level) => self.watch_level(stream_id, level),
                }
            }
            RuntimeMessage::NodeCommandResponse(resp) => {
                match self.take_pending(frame.correlation_id, node_id, generation) {
                    Some((_, _, Pending::Command(reply))) => {
                        let _ = reply.send(Ok(resp));
                    }
                    Some((_, _, Pending::Recovery(reply))) => {
                        let cleared = self.recover(node_id, generation, &resp);
                        let _ = reply.send(Ok(cleared));
                    }
                    _ => {}
                }
            }
            RuntimeMessage::NodeConfigRefreshResponse(resp) => {
                if let Some((_, _, Pending::Refresh(reply))) =
                    self.take_pending(frame.correlation_id, node_id, generation)
                {
                    let _ = reply.send(Ok(resp));
                }
            }
            _ => {}
        }
    }

    fn take_pending(
        &mut self,
        id: u64,
        node_id: &str,
        generation: Generation,
    ) -> Option<(String, Generation, Pending)> {
        let matches = self
            .pending
            .get(&id)
            .is_some_and(|(n, g, _)| n == node_id && *g == generation);
        if matches {
            self.pending.remove(&id)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    /// A peer that floods pings and then neither reads nor writes leaves the connection's
    /// writer blocked on it. The registry's register timeout must still drop the socket (after
    /// `CLOSE_GRACE`), not wait behind the queued pongs forever. Virtual time.
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_reads_nothing_is_dropped_after_the_register_timeout() {
        let (inputs, input_rx) = mpsc::channel(INPUT_QUEUE);
        let (notices, notice_rx) = mpsc::unbounded_channel();
        let (lifecycle, _) = broadcast::channel(16);
        let registry = Registry::new(RegistryConfig {
            handshake_timeout: Duration::from_secs(10),
            ..RegistryConfig::default()
        });
        tokio::spawn(registry_task(
            Setup {
                registry,
                pool: None,
                metrics: Arc::new(Metrics::default()),
                lifecycle,
                notices: notices.downgrade(),
                max_stream_buffer: DEFAULT_MAX_STREAM_BUFFER,
                slow_consumer_timeout: DEFAULT_SLOW_CONSUMER_TIMEOUT,
            },
            input_rx,
            notice_rx,
        ));
        // A small pipe: a few pongs fill it, and the Edge's writer waits on the peer.
        let (edge_side, mut peer) = tokio::io::duplex(256);
        let codec = FrameCodec::new();
        let task = tokio::spawn(connection(edge_side, "node-1".into(), codec, 1024, inputs));
        let mut ping = bytes::BytesMut::new();
        codec
            .encode(&RuntimeFrame::new(RuntimeMessage::Ping), &mut ping)
            .unwrap();
        let start = Instant::now();
        // Pings until the Edge stops taking them (its writer is stuck, so is its reader).
        while tokio::time::timeout(Duration::from_millis(100), peer.write_all(&ping))
            .await
            .is_ok()
        {}
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "the pipe never filled"
        );
        // Then nothing at all: the 10 s register timeout, plus the close grace.
        tokio::time::timeout(
            Duration::from_secs(10) + CLOSE_GRACE + Duration::from_secs(1),
            task,
        )
        .await
        .expect("the connection was not dropped")
        .unwrap();
        drop(notices);
    }
}
