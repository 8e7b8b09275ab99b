//! The Edge's Control Plane connector (seed `001`) and, in managed mode, its projection cache
//! and lease client.
//!
//! The Edge dials out to the Control Plane over TLS TCP (the runtime wire's frame codec, not
//! gRPC), says hello, and then keeps one session:
//! - answers `EdgeStatusRequest` with its Edge-owned Node view: every configured Node (connected
//!   or not, `connected` meaning current dispatch-ready ownership) with its provider snapshots,
//!   plus any ready Node running on the default config — never an address, token or transport
//!   detail;
//! - runs `EdgeCommandRequest`s (operations below), reporting phase events then a response;
//! - relays `node.connected` / `node.disconnected` only after the transport's authoritative
//!   ready/fence transition ([`crate::Lifecycle`]; rejected duplicates and stale closes make
//!   none);
//! - pings every heartbeat interval the Control Plane gave; reconnects with capped exponential
//!   backoff and jitter ([`BACKOFF_MIN`]..[`BACKOFF_MAX`], `iop_wire::backoff`) after any
//!   failure.
//!
//! The protocol decisions (hello, silence, correlation, projection generations, lease answer
//! matching) are `iop_wire::control_session::EdgeControlSession`'s; this module is its driver:
//! one loop per session owns the machine, and callers ([`ControlConnector::acquire_lease`],
//! status and command work) hand it requests through a bounded queue.
//!
//! **Managed mode** (`credential_plane.enabled`): [`ControlConnector::start`] refuses a TLS
//! configuration without a client certificate; the accepted hello must carry a projection
//! (otherwise the session is dropped); `PrincipalProjectionApplyRequest` is accepted only for a
//! strictly higher generation and swapped in atomically ([`ProjectionIndex`]);
//! [`ControlConnector::acquire_lease`] sends `AcquireLeaseRequest` on this same authenticated
//! session. In legacy mode no projection is kept and no lease can be requested.
//!
//! Command operations: `ping` (answers `pong`), `recover_provider` (runs the CAPABILITIES
//! recovery probe on the Node named by `target_selector`; result `cleared`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use iop_wire::backoff::{Backoff, Retries};
use iop_wire::codec::{FrameCodec, TokioCodec};
use iop_wire::control::{
    AcquireLeaseRequest, AcquireLeaseResponse, ControlFrame, EdgeCommandEvent, EdgeCommandRequest,
    EdgeCommandResponse, EdgeHelloRequest, EdgeNodeConfigSummary, EdgeNodeEvent, EdgeNodeSnapshot,
    EdgeStatusResponse, NodeEventKind, PrincipalProjection,
};
use iop_wire::control_session::{
    ControlCloseReason, ControlSessionConfig, ControlSessionError, EdgeControlEvent,
    EdgeControlSession,
};
use iop_wire::runtime::{CredentialLease, CredentialLeaseBinding};
use rustls_pki_types::ServerName;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_rustls::TlsConnector;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

pub use iop_edge_core::binding::BindingConfig;
pub use iop_edge_core::projection::ProjectionIndex;

use crate::{EdgeHandle, Lifecycle};

/// First reconnect delay.
pub const BACKOFF_MIN: Duration = Duration::from_millis(200);
/// Largest reconnect delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Limit on TCP connect + TLS handshake + hello answer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a lease request waits for the Control Plane.
pub const LEASE_TIMEOUT: Duration = Duration::from_secs(10);
/// Heartbeat used when the Control Plane names none.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);

/// Connector settings.
#[derive(Clone)]
pub struct ControlConfig {
    /// The Control Plane's `host:port`, or several: replicas sharing one store. The connector
    /// dials them in order, starting from the one it last had a session with, so it fails
    /// over to the next when one is down (each gets [`CONNECT_TIMEOUT`] divided among them, at
    /// least 2 s). One `server_name` and one certificate name verify them all.
    pub addresses: Vec<String>,
    /// Name to verify the Control Plane's certificate against.
    pub server_name: ServerName<'static>,
    /// TLS client config: in managed mode the Edge's workload certificate and a verifier of the
    /// Control Plane's role and name (`workload_identity`).
    pub tls: Arc<rustls::ClientConfig>,
    /// This Edge's id (its certificate name in managed mode).
    pub edge_id: String,
    /// `credential_plane.enabled`.
    pub managed: bool,
    /// Largest frame accepted or sent. The hello names it, and the Control Plane cuts a
    /// projection that does not fit into parts, which the session assembles and installs
    /// whole ([`iop_wire::control_session`]).
    pub max_frame_len: usize,
    /// How to reach an address: `None` dials TCP. A custom dialer carries the connection over
    /// another transport (`turmoil`'s simulated network in `tests/tests/control_sim.rs`); TLS
    /// and everything above it stay the connector's.
    pub dialer: Option<Dialer>,
    /// Seeds the reconnect jitter (a splitmix64 sequence) instead of the OS random source, so
    /// a simulation replays exactly; `None` in production.
    pub jitter_seed: Option<u64>,
    /// Managed mode: the binding loop's settings (how long a request whose binding went stale
    /// waits for a newer projection or a live session; `iop_edge_core::binding`).
    pub binding: BindingConfig,
}

impl ControlConfig {
    /// A connector to the Control Plane(s) at `addresses` over `tls`, verified as
    /// `server_name`, for Edge `edge_id`; managed mode (`managed`) and everything else take
    /// their defaults (the default frame limit, TCP, random jitter, the default binding
    /// settings). Change a field with struct update syntax:
    /// `ControlConfig { managed: true, ..ControlConfig::new(..) }`.
    pub fn new(
        addresses: Vec<String>,
        server_name: ServerName<'static>,
        tls: Arc<rustls::ClientConfig>,
        edge_id: impl Into<String>,
    ) -> Self {
        Self {
            addresses,
            server_name,
            tls,
            edge_id: edge_id.into(),
            managed: false,
            max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
            dialer: None,
            jitter_seed: None,
            binding: BindingConfig::default(),
        }
    }
}

/// A byte stream to a Control Plane, as a [`Dialer`] returns it.
pub trait ControlStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> ControlStream for T {}

/// Opens a byte stream to one Control Plane address (see [`ControlConfig::dialer`]).
pub type Dialer = Arc<
    dyn Fn(
            String,
        ) -> std::pin::Pin<
            Box<dyn Future<Output = std::io::Result<Box<dyn ControlStream>>> + Send>,
        > + Send
        + Sync,
>;

impl std::fmt::Debug for ControlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlConfig")
            .field("addresses", &self.addresses)
            .field("edge_id", &self.edge_id)
            .field("managed", &self.managed)
            .finish_non_exhaustive()
    }
}

/// A connector that cannot start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ControlConfigError {
    /// Managed mode needs mutual TLS: the client config has no certificate.
    #[error(
        "credential_plane.enabled requires mTLS to the control plane: configure the edge's client certificate"
    )]
    ManagedWithoutClientCertificate,
    /// `edge_id` is empty.
    #[error("edge_id is required")]
    MissingEdgeId,
    /// `addresses` is empty.
    #[error("a control plane address is required")]
    NoAddress,
}

/// Why a lease was not obtained.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// Legacy mode: no lease traffic.
    #[error("credential plane disabled")]
    Disabled,
    /// No Control Plane session right now.
    #[error("control plane not connected")]
    NotConnected,
    /// The Control Plane refused (stable reason from it).
    #[error("lease refused: {0}")]
    Refused(String),
    /// No answer in time, or the session ended first.
    #[error("control plane did not answer")]
    NoAnswer,
}

/// Why the last session ended or could not start (for operators and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionState {
    /// Not connected: before the first session, or (re)connecting after one ended.
    Connecting,
    /// Hello accepted.
    Connected,
    /// The Control Plane refused the hello with this reason.
    Rejected(String),
    /// Managed mode: the accepted hello carried no projection.
    MissingProjection,
    /// TCP, TLS or framing failed.
    Failed(String),
}

/// Frames queued to the Control Plane at most; a peer that lets it fill (it does not read its
/// answers) loses the session.
const OUTBOUND_FRAMES: usize = 1024;
/// Status and command requests served at once; more wait (the session is not read meanwhile).
const CONCURRENT_REQUESTS: usize = 16;

/// The current session's request queue (the session loop owns the machine).
struct Link {
    requests: mpsc::Sender<Request>,
    /// The Control Plane takes usage records on this session.
    accepts_usage: bool,
}

/// Where a usage report's answer goes.
type UsageAnswer = oneshot::Sender<Result<iop_wire::control::EdgeUsageAck, UsageReportError>>;

/// What callers and spawned work hand to the session loop.
enum Request {
    Lease(AcquireLeaseRequest, oneshot::Sender<AcquireLeaseResponse>),
    Usage(iop_wire::control::EdgeUsageReport, UsageAnswer),
    Ping(oneshot::Sender<()>),
    Status(u64, EdgeStatusResponse),
    CommandEvent(u64, EdgeCommandEvent),
    Command(u64, EdgeCommandResponse),
}

struct Shared {
    config: ControlConfig,
    edge: EdgeHandle,
    projection: RwLock<Option<Arc<ProjectionIndex>>>,
    link: Mutex<Option<Link>>,
    state: watch::Sender<SessionState>,
    /// The generation of the installed projection (0 before the first), for callers that wait
    /// for a newer one.
    generation: watch::Sender<u64>,
    /// Index into `addresses` of the last one that gave a session (dialled first).
    preferred: std::sync::atomic::AtomicUsize,
    /// Set when the connector task has ended (its session closed cleanly after `shutdown`).
    stopped: watch::Sender<bool>,
}

/// The running connector. Cheap to clone.
#[derive(Clone)]
pub struct ControlConnector {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ControlConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlConnector")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ControlConnector {
    /// Validates `config` and starts the connector task (it runs until `shutdown`).
    pub fn start(
        edge: EdgeHandle,
        config: ControlConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, ControlConfigError> {
        if config.edge_id.is_empty() {
            return Err(ControlConfigError::MissingEdgeId);
        }
        if config.addresses.is_empty() {
            return Err(ControlConfigError::NoAddress);
        }
        if config.managed && !config.tls.client_auth_cert_resolver.has_certs() {
            return Err(ControlConfigError::ManagedWithoutClientCertificate);
        }
        let shared = Arc::new(Shared {
            config,
            edge,
            projection: RwLock::new(None),
            link: Mutex::new(None),
            state: watch::channel(SessionState::Connecting).0,
            generation: watch::channel(0).0,
            preferred: std::sync::atomic::AtomicUsize::new(0),
            stopped: watch::channel(false).0,
        });
        let task = shared.clone();
        tokio::spawn(async move {
            run(task.clone(), shutdown).await;
            task.stopped.send_replace(true);
        });
        Ok(Self { shared })
    }

    /// Whether this connector runs the credential plane.
    pub fn managed(&self) -> bool {
        self.shared.config.managed
    }

    /// The current projection (managed mode, after the first accepted hello).
    pub fn projection(&self) -> Option<Arc<ProjectionIndex>> {
        self.shared
            .projection
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Resolves once the connector has stopped after its `shutdown` token was cancelled, its
    /// session closed with TLS close_notify. A process awaits it before exiting, so the Control
    /// Plane sees a clean close.
    pub async fn stopped(&self) {
        let mut rx = self.shared.stopped.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// The binding loop's settings ([`ControlConfig::binding`]).
    pub fn binding_config(&self) -> BindingConfig {
        self.shared.config.binding
    }

    /// Session state changes (connected, refused and why, failures).
    pub fn state(&self) -> watch::Receiver<SessionState> {
        self.shared.state.subscribe()
    }

    /// Waits at most `limit` for a projection newer than `generation` and returns it; `None`
    /// when none arrived in time. A request whose binding the Control Plane found stale waits
    /// here for the projection that made it stale (see `iop_edge::http`, managed mode).
    pub async fn projection_after(
        &self,
        generation: u64,
        limit: Duration,
    ) -> Option<Arc<ProjectionIndex>> {
        let mut rx = self.shared.generation.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|g| *g > generation))
            .await
            .ok()?
            .ok()?;
        self.projection().filter(|p| p.generation() > generation)
    }

    /// Waits at most `limit` for a live session (at once when there is one); whether there is
    /// one. A request whose lease found no session (the Control Plane replica it used just
    /// went away) waits here while the connector fails over.
    pub async fn connected_within(&self, limit: Duration) -> bool {
        let mut rx = self.shared.state.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|s| *s == SessionState::Connected))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Managed mode: why this Edge cannot serve managed requests right now (no live Control
    /// Plane session, or no projection yet); `None` when it can, and always in legacy mode
    /// (requests there do not depend on the Control Plane). `/readyz` answers 503 with this.
    pub fn unready_reason(&self) -> Option<String> {
        if !self.shared.config.managed {
            return None;
        }
        match &*self.shared.state.borrow() {
            SessionState::Connected => {}
            SessionState::Connecting => return Some("control plane not connected".into()),
            SessionState::Rejected(r) => {
                return Some(format!("control plane refused this edge: {r}"));
            }
            SessionState::MissingProjection => {
                return Some("control plane sent no projection".into());
            }
            SessionState::Failed(why) => {
                return Some(format!("control plane unreachable ({why})"));
            }
        }
        if self.projection().is_none() {
            return Some("no principal projection yet".into());
        }
        None
    }

    /// Asks the Control Plane for a lease for exactly `binding`, sealed to
    /// `recipient_public_key`, on the current authenticated session.
    pub async fn acquire_lease(
        &self,
        binding: CredentialLeaseBinding,
        recipient_public_key: [u8; 32],
    ) -> Result<CredentialLease, LeaseError> {
        self.acquire_lease_traced(binding, recipient_public_key, None)
            .await
    }

    /// As [`ControlConnector::acquire_lease`], carrying the caller's lease span context to the
    /// Control Plane (its span of the acquisition joins the same trace).
    pub async fn acquire_lease_traced(
        &self,
        binding: CredentialLeaseBinding,
        recipient_public_key: [u8; 32],
        trace: Option<iop_wire::trace::TraceContext>,
    ) -> Result<CredentialLease, LeaseError> {
        if !self.shared.config.managed {
            return Err(LeaseError::Disabled);
        }
        let (tx, rx) = oneshot::channel();
        let request = AcquireLeaseRequest {
            binding,
            recipient_public_key,
            trace,
        };
        // Never waits: the session's queue is far from full unless the session is stuck (then
        // this fails closed).
        self.send(Request::Lease(request, tx))
            .ok_or(LeaseError::NotConnected)?;
        match tokio::time::timeout(LEASE_TIMEOUT, rx).await {
            Ok(Ok(AcquireLeaseResponse::Granted(lease))) => Ok(lease),
            Ok(Ok(AcquireLeaseResponse::Refused { reason })) => Err(LeaseError::Refused(reason)),
            _ => Err(LeaseError::NoAnswer),
        }
    }
}

/// Why [`ControlConnector::report_usage`] did not get its records stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UsageReportError {
    /// No session, or one whose Control Plane does not take usage records.
    #[error("no control plane session that takes usage records")]
    NotAccepted,
    /// The session ended, or no acknowledgement within [`USAGE_TIMEOUT`]: the records may or
    /// may not be stored; send them again (they are stored once by request id).
    #[error("no acknowledgement from the control plane")]
    NoAnswer,
    /// The report is larger than the frame the Control Plane reads; nothing was sent. Send its
    /// first `fit` records (0: the first record alone does not fit).
    #[error("usage report larger than the control plane's frame; its first {fit} records fit")]
    TooLarge {
        /// How many of the report's first records fit one frame.
        fit: usize,
    },
}

/// How long [`ControlConnector::report_usage`] waits for the acknowledgement.
pub const USAGE_TIMEOUT: Duration = Duration::from_secs(30);

impl ControlConnector {
    /// Whether the current session's Control Plane takes usage records (its hello answer said
    /// so; older Control Planes do not).
    pub fn accepts_usage(&self) -> bool {
        lock(&self.shared.link)
            .as_ref()
            .is_some_and(|l| l.accepts_usage)
    }

    /// Sends usage records on the current session and waits until the Control Plane has
    /// stored them ([`crate::usage::ship`] drives this from the Edge's spool).
    pub async fn report_usage(
        &self,
        report: iop_wire::control::EdgeUsageReport,
    ) -> Result<iop_wire::control::EdgeUsageAck, UsageReportError> {
        if !self.accepts_usage() {
            return Err(UsageReportError::NotAccepted);
        }
        let (tx, rx) = oneshot::channel();
        self.send(Request::Usage(report, tx))
            .ok_or(UsageReportError::NotAccepted)?;
        match tokio::time::timeout(USAGE_TIMEOUT, rx).await {
            Ok(Ok(answer)) => answer,
            _ => Err(UsageReportError::NoAnswer),
        }
    }
}

impl ControlConnector {
    /// One ping/pong round trip on the current session (the baseline of the lease round trip
    /// in `benches/`). `None` without a session or answer within [`LEASE_TIMEOUT`].
    pub async fn ping(&self) -> Option<Duration> {
        let (tx, rx) = oneshot::channel();
        let started = std::time::Instant::now();
        self.send(Request::Ping(tx))?;
        tokio::time::timeout(LEASE_TIMEOUT, rx).await.ok()?.ok()?;
        Some(started.elapsed())
    }

    /// Hands `request` to the current session, if there is one with room.
    fn send(&self, request: Request) -> Option<()> {
        let link = lock(&self.shared.link);
        link.as_ref()?.requests.try_send(request).ok()
    }
}

/// A uniform random value for the backoff's jitter: from the OS, or the next of a seeded
/// splitmix64 sequence ([`ControlConfig::jitter_seed`]).
fn random_u32(seeded: &mut Option<iop_wire::backoff::SplitMix64>) -> u32 {
    if let Some(rng) = seeded {
        return rng.next_u32();
    }
    let mut b = [0u8; 4];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    u32::from_le_bytes(b)
}

/// Reconnect waits: [`BACKOFF_MIN`] doubling to [`BACKOFF_MAX`], each drawn from 50–100 % of
/// the delay (`iop_wire::backoff`, the policy every retry loop of the workspace uses).
fn reconnect_policy() -> Backoff {
    Backoff::exponential(BACKOFF_MIN, BACKOFF_MAX)
        .with_jitter(0.5)
        .unwrap_or(Backoff::exponential(BACKOFF_MIN, BACKOFF_MAX))
}

async fn run(shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut retries = Retries::new(reconnect_policy());
    let mut seeded = shared.config.jitter_seed.map(iop_wire::backoff::SplitMix64);
    loop {
        // The session watches `shutdown` itself, to close its TLS stream cleanly.
        let result = session(&shared, &shutdown).await;
        if shutdown.is_cancelled() {
            *lock(&shared.link) = None;
            return;
        }
        // The state first, then the link: a caller that still sees `Connected` finds at worst a
        // link whose session is gone (its request fails at once), never `Connected` with no link.
        match result {
            Ok(()) => {
                // A session that was accepted, then ended.
                retries.reset();
                shared.state.send_replace(SessionState::Connecting);
            }
            Err(state) => {
                tracing::warn!(target: "iop_edge", event = "edge_control_session_failed", state = ?state, "control plane session failed");
                shared.state.send_replace(state);
            }
        }
        *lock(&shared.link) = None;
        let wait = retries.next_delay(random_u32(&mut seeded));
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

type Io = Framed<tokio_rustls::client::TlsStream<Box<dyn ControlStream>>, TokioCodec<ControlFrame>>;

/// TCP and TLS to the Control Plane (the hello is the session machine's).
async fn connect(shared: &Shared) -> Result<Io, SessionState> {
    let c = &shared.config;
    let n = c.addresses.len();
    let each = (CONNECT_TIMEOUT / u32::try_from(n.max(1)).unwrap_or(1)).max(Duration::from_secs(2));
    let start = shared.preferred.load(std::sync::atomic::Ordering::Relaxed);
    let mut last = SessionState::Failed("no control plane address".into());
    for k in 0..n {
        let i = (start + k) % n;
        match tokio::time::timeout(each, connect_one(c, &c.addresses[i])).await {
            Ok(Ok(io)) => {
                shared
                    .preferred
                    .store(i, std::sync::atomic::Ordering::Relaxed);
                return Ok(io);
            }
            Ok(Err(e)) => last = e,
            Err(_) => last = SessionState::Failed("timeout".into()),
        }
        if n > 1 {
            tracing::info!(target: "iop_edge", event = "edge_control_failover", address = %c.addresses[i], state = ?last, "control plane address unavailable; trying the next");
        }
    }
    Err(last)
}

async fn connect_one(c: &ControlConfig, address: &str) -> Result<Io, SessionState> {
    let failed = |what: &str| SessionState::Failed(what.to_owned());
    let tcp: Box<dyn ControlStream> = match &c.dialer {
        Some(dial) => dial(address.to_owned())
            .await
            .map_err(|_| failed("connect"))?,
        None => {
            let tcp = tokio::net::TcpStream::connect(address)
                .await
                .map_err(|_| failed("connect"))?;
            let _ = tcp.set_nodelay(true);
            Box::new(tcp)
        }
    };
    let tls = TlsConnector::from(c.tls.clone())
        .connect(c.server_name.clone(), tcp)
        .await
        .map_err(|_| failed("tls handshake"))?;
    let codec = FrameCodec::with_max_frame_len(c.max_frame_len);
    Ok(Framed::new(tls, TokioCodec::<ControlFrame>::new(codec)))
}

/// Installs a projection the session machine accepted (strictly higher generation).
fn install_projection(shared: &Shared, p: PrincipalProjection) {
    let generation = p.generation;
    // Nodes that do not trust the key leases are signed with are refused at registration and
    // no longer selected; those that do not trust the staged key are warned about.
    shared.edge.set_issuers(iop_edge_core::Issuers {
        active: Some(p.issuer_key_id.clone()).filter(|k| !k.is_empty()),
        staged: Some(p.staged_issuer_key_id.clone())
            .filter(|k| !k.is_empty())
            .map(|k| (k, p.staged_issuer_activates_at_unix_ms)),
    });
    *shared
        .projection
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) =
        Some(Arc::new(ProjectionIndex::new(p)));
    shared.generation.send_replace(generation);
    tracing::info!(target: "iop_edge", event = "edge_projection_applied", generation, "projection applied");
}

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// One session: the driver of `iop_wire::control_session::EdgeControlSession`. `Ok` when it
/// ended after being accepted.
async fn session(shared: &Arc<Shared>, shutdown: &CancellationToken) -> Result<(), SessionState> {
    let mut lifecycle = shared.edge.subscribe();
    let mut io = tokio::select! {
        () = shutdown.cancelled() => return Ok(()),
        r = connect(shared) => r?,
    };
    let held = shared
        .projection
        .read()
        .ok()
        .and_then(|g| g.as_ref().map(|i| i.generation()))
        .unwrap_or(0);
    let hello = EdgeHelloRequest {
        edge_id: shared.config.edge_id.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        managed: shared.config.managed,
        metadata: Default::default(),
        // Filled in by the session: it assembles parts, and reads frames up to the limit below.
        projection_parts: true,
        max_frame_len: 0,
    };
    let config = ControlSessionConfig {
        handshake_timeout: CONNECT_TIMEOUT,
        heartbeat: DEFAULT_HEARTBEAT,
        max_frame_len: shared.config.max_frame_len,
    };
    let mut s = EdgeControlSession::new(config, hello, held, now());
    let (req_tx, mut req_rx) = mpsc::channel::<Request>(OUTBOUND_FRAMES);
    let requests = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_REQUESTS));
    let mut leases: HashMap<u64, oneshot::Sender<AcquireLeaseResponse>> = HashMap::new();
    let mut pongs: HashMap<u64, oneshot::Sender<()>> = HashMap::new();
    let mut usage_acks: HashMap<u64, UsageAnswer> = HashMap::new();
    let mut connected = false;
    let mut silence = DEFAULT_HEARTBEAT * 3;
    loop {
        while let Some(frame) = s.poll_transmit() {
            // A peer that does not take our frames within the silence limit is not reading.
            if !matches!(
                tokio::time::timeout(silence, io.send(frame)).await,
                Ok(Ok(()))
            ) {
                tracing::info!("control plane not reading; ending the session");
                s.handle_transport_closed();
                break;
            }
        }
        while let Some(event) = s.poll_event() {
            match event {
                EdgeControlEvent::Connected { heartbeat } => {
                    connected = true;
                    silence = heartbeat * 3;
                    *lock(&shared.link) = Some(Link {
                        requests: req_tx.clone(),
                        accepts_usage: s.accepts_usage(),
                    });
                    shared.state.send_replace(SessionState::Connected);
                    tracing::info!(target: "iop_edge", event = "edge_control_connected", managed = shared.config.managed, "control plane session accepted");
                }
                EdgeControlEvent::Projection(p) => install_projection(shared, p),
                EdgeControlEvent::StatusRequested { id } => {
                    // A slot first: a flood of requests is read no faster than it is served.
                    let permit = requests.clone().acquire_owned().await.ok();
                    let (shared, out) = (shared.clone(), req_tx.clone());
                    tokio::spawn(async move {
                        let status = status(&shared).await;
                        let _ = out.try_send(Request::Status(id, status));
                        drop(permit);
                    });
                }
                EdgeControlEvent::CommandRequested { id, request } => {
                    let permit = requests.clone().acquire_owned().await.ok();
                    let (shared, out) = (shared.clone(), req_tx.clone());
                    tokio::spawn(async move {
                        command(&shared, id, request, &out).await;
                        drop(permit);
                    });
                }
                EdgeControlEvent::LeaseAnswered { ticket, result } => {
                    if let (Some(tx), Ok(answer)) = (leases.remove(&ticket), result) {
                        let _ = tx.send(answer);
                    }
                }
                EdgeControlEvent::Pong { ticket } => {
                    if let Some(tx) = pongs.remove(&ticket) {
                        let _ = tx.send(());
                    }
                }
                EdgeControlEvent::UsageAcked { ticket, result } => {
                    // A failure drops the sender: the caller sends the records again.
                    if let (Some(tx), Ok(ack)) = (usage_acks.remove(&ticket), result) {
                        let _ = tx.send(Ok(ack));
                    }
                }
                EdgeControlEvent::Closed(reason) => {
                    return match reason {
                        ControlCloseReason::Rejected(r) => Err(SessionState::Rejected(r)),
                        ControlCloseReason::MissingProjection => {
                            Err(SessionState::MissingProjection)
                        }
                        _ if connected => Ok(()),
                        ControlCloseReason::HandshakeTimeout => {
                            Err(SessionState::Failed("timeout".into()))
                        }
                        _ => Err(SessionState::Failed("no hello answer".into())),
                    };
                }
                _ => {}
            }
        }
        let deadline = s.poll_timeout().map(tokio::time::Instant::from_std);
        tokio::select! {
            () = shutdown.cancelled() => {
                // A clean stop: TLS close_notify, so the Control Plane logs a close, not an
                // error. Bounded: a peer that reads nothing does not hold the shutdown.
                let _ = tokio::time::timeout(Duration::from_secs(1), io.close()).await;
                return Ok(());
            }
            frame = io.next() => match frame {
                Some(Ok(frame)) => s.handle_frame(now(), frame),
                _ => s.handle_transport_closed(),
            },
            Some(request) = req_rx.recv() => {
                let at = now();
                match request {
                    Request::Lease(r, tx) => {
                        if let Ok(ticket) = s.acquire_lease(at, r) {
                            leases.insert(ticket, tx);
                        }
                    }
                    Request::Ping(tx) => {
                        if let Ok(ticket) = s.ping(at) {
                            pongs.insert(ticket, tx);
                        }
                    }
                    Request::Usage(report, tx) => match s.report_usage(at, report) {
                        Ok(ticket) => {
                            usage_acks.insert(ticket, tx);
                        }
                        Err(ControlSessionError::UsageReportTooLarge { fit, .. }) => {
                            let _ = tx.send(Err(UsageReportError::TooLarge { fit }));
                        }
                        Err(_) => {}
                    }
                    Request::Status(id, st) => {
                        let nodes = st.nodes.len();
                        if let Ok(omitted @ 1..) = s.respond_status(at, id, st) {
                            tracing::warn!(
                                target: "iop_edge",
                                event = "edge_status_cut",
                                listed = nodes - omitted as usize,
                                omitted,
                                "status answer left Nodes out to fit the status bounds and the control plane's frame limit"
                            );
                        }
                    }
                    Request::CommandEvent(id, ev) => {
                        let _ = s.command_event(at, id, ev);
                    }
                    Request::Command(id, resp) => {
                        let _ = s.respond_command(at, id, resp);
                    }
                }
            }
            event = lifecycle.recv(), if connected => {
                let (kind, node_id) = match event {
                    Ok(Lifecycle::Connected { node_id, .. }) => (NodeEventKind::Connected, node_id),
                    Ok(Lifecycle::Disconnected { node_id, .. }) => (NodeEventKind::Disconnected, node_id),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "node events lagged; some were not relayed");
                        continue;
                    }
                    Err(_) => continue,
                };
                let ev = EdgeNodeEvent {
                    kind,
                    node_id,
                    edge_id: shared.config.edge_id.clone(),
                    occurred_at_unix_ms: iop_wire::time::unix_ms(std::time::SystemTime::now()),
                    metadata: Default::default(),
                };
                let _ = s.node_event(now(), ev);
            }
            () = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => s.handle_timeout(now()),
        }
    }
}

/// The Edge-owned Node view.
async fn status(shared: &Shared) -> EdgeStatusResponse {
    let edge = &shared.edge;
    // Grouped once: with thousands of Nodes, a scan of every snapshot per Node is quadratic.
    let mut snapshots: HashMap<String, Vec<iop_wire::runtime::ProviderSnapshot>> = HashMap::new();
    for s in edge.snapshot() {
        snapshots.entry(s.node_id.clone()).or_default().push(s);
    }
    let ready: HashSet<String> = edge.ready_nodes().into_iter().map(|(n, _)| n).collect();
    let mut nodes: Vec<EdgeNodeSnapshot> = edge
        .configured_nodes()
        .iter()
        .map(|(node_id, payload)| EdgeNodeSnapshot {
            node_id: node_id.clone(),
            connected: ready.contains(node_id),
            config: EdgeNodeConfigSummary {
                revision: payload.revision,
                adapters: payload
                    .adapters
                    .iter()
                    .map(|a| (a.name.clone(), a.adapter_type.clone()))
                    .collect(),
            },
            provider_snapshots: snapshots.remove(node_id).unwrap_or_default(),
            refused: edge.refused(node_id).unwrap_or_default(),
            warning: edge.warning(node_id).unwrap_or_default(),
        })
        .collect();
    let configured: HashSet<&str> = nodes.iter().map(|n| n.node_id.as_str()).collect();
    let unconfigured: Vec<&String> = (ready.iter())
        .filter(|id| !configured.contains(id.as_str()))
        .collect();
    for node_id in unconfigured {
        nodes.push(EdgeNodeSnapshot {
            node_id: node_id.clone(),
            connected: true,
            config: EdgeNodeConfigSummary::default(),
            provider_snapshots: Vec::new(),
            refused: String::new(),
            warning: String::new(),
        });
    }
    // In `node_id` order once the session fits it (`EdgeStatusResponse::fit` sorts).
    EdgeStatusResponse {
        edge_id: shared.config.edge_id.clone(),
        nodes,
        omitted_nodes: 0,
    }
}

async fn command(shared: &Shared, id: u64, req: EdgeCommandRequest, out: &mpsc::Sender<Request>) {
    let event = |phase: &str, message: &str| {
        let ev = EdgeCommandEvent {
            command_id: req.command_id.clone(),
            phase: phase.to_owned(),
            message: message.to_owned(),
            metadata: Default::default(),
        };
        let _ = out.try_send(Request::CommandEvent(id, ev));
    };
    let mut response = EdgeCommandResponse {
        command_id: req.command_id.clone(),
        ..Default::default()
    };
    match req.operation.as_str() {
        "ping" => {
            event("accepted", "");
            response.ok = true;
            response.result.insert("reply".into(), "pong".into());
        }
        "recover_provider" => {
            event("accepted", "");
            event("probing", "capabilities probe sent to the node");
            match shared.edge.recover(&req.target_selector).await {
                Ok(cleared) => {
                    response.ok = true;
                    response
                        .result
                        .insert("cleared".into(), cleared.to_string());
                }
                Err(e) => response.error = e.to_string(),
            }
        }
        _ => response.error = "unknown operation".into(),
    }
    event(if response.ok { "completed" } else { "failed" }, "");
    let _ = out.try_send(Request::Command(id, response));
}
