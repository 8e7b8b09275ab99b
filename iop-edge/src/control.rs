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
//!   backoff and jitter ([`BACKOFF_MIN`]..[`BACKOFF_MAX`]) after any failure.
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
use iop_wire::codec::{FrameCodec, TokioCodec};
use iop_wire::control::{
    AcquireLeaseRequest, AcquireLeaseResponse, ControlFrame, ControlMessage, EdgeCommandEvent,
    EdgeCommandRequest, EdgeCommandResponse, EdgeHelloRequest, EdgeHelloResponse,
    EdgeNodeConfigSummary, EdgeNodeEvent, EdgeNodeSnapshot, EdgeStatusResponse, NodeEventKind,
    PrincipalProjection, PrincipalProjectionApplyResponse, ProjectedRoute,
};
use iop_wire::runtime::{CredentialLease, CredentialLeaseBinding};
use ring::digest::{SHA256, digest};
use rustls_pki_types::ServerName;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_rustls::TlsConnector;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

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
    /// The Control Plane's `host:port`.
    pub address: String,
    /// Name to verify the Control Plane's certificate against.
    pub server_name: ServerName<'static>,
    /// TLS client config: in managed mode the Edge's workload certificate and a verifier of the
    /// Control Plane's role and name (`iop_wire::identity`).
    pub tls: Arc<rustls::ClientConfig>,
    /// This Edge's id (its certificate name in managed mode).
    pub edge_id: String,
    /// `credential_plane.enabled`.
    pub managed: bool,
    /// Largest frame accepted or sent.
    pub max_frame_len: usize,
}

impl std::fmt::Debug for ControlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlConfig")
            .field("address", &self.address)
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

/// The projection, indexed for request authentication and route resolution. Immutable: a
/// request keeps the `Arc` it authenticated with.
#[derive(Debug)]
pub struct ProjectionIndex {
    projection: PrincipalProjection,
    /// First 8 digest bytes → token entries (the full digest is compared in constant time).
    tokens: HashMap<[u8; 8], Vec<usize>>,
    routes: HashMap<(String, String), usize>,
    enabled: HashSet<String>,
}

impl ProjectionIndex {
    /// Indexes a projection.
    pub fn new(projection: PrincipalProjection) -> Self {
        let mut tokens: HashMap<[u8; 8], Vec<usize>> = HashMap::new();
        for (i, t) in projection.tokens.iter().enumerate() {
            let mut k = [0u8; 8];
            k.copy_from_slice(&t.sha256_digest[..8]);
            tokens.entry(k).or_default().push(i);
        }
        let routes = projection
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| ((r.principal_id.clone(), r.model.clone()), i))
            .collect();
        let enabled = projection
            .principals
            .iter()
            .filter(|p| p.enabled)
            .map(|p| p.principal_id.clone())
            .collect();
        Self {
            projection,
            tokens,
            routes,
            enabled,
        }
    }

    /// The projection generation.
    pub fn generation(&self) -> u64 {
        self.projection.generation
    }

    /// The principal a raw bearer token authenticates as: SHA-256 of the token, compared in
    /// constant time with the projected digests; disabled principals authenticate nothing.
    pub fn authenticate(&self, token: &str) -> Option<&str> {
        let d = digest(&SHA256, token.as_bytes());
        let d = d.as_ref();
        let mut k = [0u8; 8];
        k.copy_from_slice(&d[..8]);
        let found = self.tokens.get(&k)?.iter().find_map(|&i| {
            let t = &self.projection.tokens[i];
            bool::from(subtle::ConstantTimeEq::ct_eq(&t.sha256_digest[..], d))
                .then_some(t.principal_id.as_str())
        })?;
        self.enabled.contains(found).then_some(found)
    }

    /// The route of `principal_id` for the external `model`.
    pub fn route(&self, principal_id: &str, model: &str) -> Option<&ProjectedRoute> {
        self.routes
            .get(&(principal_id.to_owned(), model.to_owned()))
            .map(|&i| &self.projection.routes[i])
    }

    /// Whether `binding` is still valid under this projection: the token still authenticates
    /// the binding's principal, and its route resolves to the same slot, profile, target and
    /// revisions. The Edge checks this against the request's snapshot before acquiring a lease
    /// and against the current projection right before dispatch.
    pub fn admits(&self, token: &str, model: &str, binding: &CredentialLeaseBinding) -> bool {
        let Some(principal) = self.authenticate(token) else {
            return false;
        };
        if principal != binding.principal_id {
            return false;
        }
        self.route(principal, model).is_some_and(|r| {
            r.route_id == binding.route_id
                && r.slot_id == binding.slot_id
                && r.profile == binding.profile
                && r.upstream_target == binding.upstream_target
                && r.route_revision == binding.route_revision
                && r.credential_revision == binding.credential_revision
        })
    }
}

/// Frames queued to the Control Plane at most; a peer that lets it fill (it does not read its
/// answers) loses the session.
const OUTBOUND_FRAMES: usize = 1024;
/// Status and command requests served at once; more wait (the session is not read meanwhile).
const CONCURRENT_REQUESTS: usize = 16;

struct Link {
    out: mpsc::Sender<ControlFrame>,
    pending: Arc<Mutex<HashMap<u64, Waiter>>>,
}

/// A request on the session waiting for its correlated answer.
enum Waiter {
    Lease(oneshot::Sender<AcquireLeaseResponse>),
    Pong(oneshot::Sender<()>),
}

struct Shared {
    config: ControlConfig,
    edge: EdgeHandle,
    projection: RwLock<Option<Arc<ProjectionIndex>>>,
    link: Mutex<Option<Link>>,
    next_correlation: Mutex<u64>,
    state: watch::Sender<SessionState>,
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
        if config.managed && !config.tls.client_auth_cert_resolver.has_certs() {
            return Err(ControlConfigError::ManagedWithoutClientCertificate);
        }
        let shared = Arc::new(Shared {
            config,
            edge,
            projection: RwLock::new(None),
            link: Mutex::new(None),
            next_correlation: Mutex::new(0),
            state: watch::channel(SessionState::Connecting).0,
        });
        tokio::spawn(run(shared.clone(), shutdown));
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

    /// Session state changes (connected, refused and why, failures).
    pub fn state(&self) -> watch::Receiver<SessionState> {
        self.shared.state.subscribe()
    }

    /// Asks the Control Plane for a lease for exactly `binding`, sealed to
    /// `recipient_public_key`, on the current authenticated session.
    pub async fn acquire_lease(
        &self,
        binding: CredentialLeaseBinding,
        recipient_public_key: [u8; 32],
    ) -> Result<CredentialLease, LeaseError> {
        if !self.shared.config.managed {
            return Err(LeaseError::Disabled);
        }
        let (tx, rx) = oneshot::channel();
        {
            let link = lock(&self.shared.link);
            let link = link.as_ref().ok_or(LeaseError::NotConnected)?;
            let id = {
                let mut n = lock(&self.shared.next_correlation);
                *n += 1;
                *n
            };
            lock(&link.pending).insert(id, Waiter::Lease(tx));
            let request = AcquireLeaseRequest {
                binding,
                recipient_public_key,
            };
            // Our own request: never waits, the session's queue is far from full unless the
            // Control Plane stopped reading (then the session ends and this fails closed).
            link.out
                .try_send(ControlFrame::correlated(
                    id,
                    ControlMessage::AcquireLeaseRequest(request),
                ))
                .map_err(|_| LeaseError::NotConnected)?;
        }
        match tokio::time::timeout(LEASE_TIMEOUT, rx).await {
            Ok(Ok(AcquireLeaseResponse::Granted(lease))) => Ok(lease),
            Ok(Ok(AcquireLeaseResponse::Refused { reason })) => Err(LeaseError::Refused(reason)),
            _ => Err(LeaseError::NoAnswer),
        }
    }
}

impl ControlConnector {
    /// One ping/pong round trip on the current session (the baseline of the lease round trip
    /// in `benches/`). `None` without a session or answer within [`LEASE_TIMEOUT`].
    pub async fn ping(&self) -> Option<Duration> {
        let (tx, rx) = oneshot::channel();
        let started = std::time::Instant::now();
        {
            let link = lock(&self.shared.link);
            let link = link.as_ref()?;
            let id = {
                let mut n = lock(&self.shared.next_correlation);
                *n += 1;
                *n
            };
            lock(&link.pending).insert(id, Waiter::Pong(tx));
            link.out
                .try_send(ControlFrame::correlated(id, ControlMessage::Ping))
                .ok()?;
        }
        tokio::time::timeout(LEASE_TIMEOUT, rx).await.ok()?.ok()?;
        Some(started.elapsed())
    }
}

fn jitter(d: Duration) -> Duration {
    let mut b = [0u8; 2];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    // 50–100 % of the delay.
    let frac = 0.5 + f64::from(u16::from_le_bytes(b)) / f64::from(u16::MAX) / 2.0;
    d.mul_f64(frac)
}

async fn run(shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut backoff = BACKOFF_MIN;
    loop {
        let result = tokio::select! {
            () = shutdown.cancelled() => return,
            r = session(&shared) => r,
        };
        *lock(&shared.link) = None;
        match result {
            Ok(()) => {
                // A session that was accepted, then ended.
                backoff = BACKOFF_MIN;
                shared.state.send_replace(SessionState::Connecting);
            }
            Err(state) => {
                tracing::warn!(target: "iop_edge", event = "edge_control_session_failed", state = ?state, "control plane session failed");
                shared.state.send_replace(state);
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(jitter(backoff)) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

type Io = Framed<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, TokioCodec<ControlFrame>>;

async fn connect(
    shared: &Shared,
) -> Result<(Io, Option<PrincipalProjection>, Duration), SessionState> {
    let c = &shared.config;
    let failed = |what: &str| SessionState::Failed(what.to_owned());
    let tcp = tokio::net::TcpStream::connect(&c.address)
        .await
        .map_err(|_| failed("connect"))?;
    let _ = tcp.set_nodelay(true);
    let tls = TlsConnector::from(c.tls.clone())
        .connect(c.server_name.clone(), tcp)
        .await
        .map_err(|_| failed("tls handshake"))?;
    let codec = FrameCodec::with_max_frame_len(c.max_frame_len);
    let mut io = Framed::new(tls, TokioCodec::<ControlFrame>::new(codec));
    let hello = EdgeHelloRequest {
        edge_id: c.edge_id.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        managed: c.managed,
        metadata: Default::default(),
    };
    io.send(ControlFrame::correlated(
        1,
        ControlMessage::EdgeHelloRequest(hello),
    ))
    .await
    .map_err(|_| failed("send hello"))?;
    let Some(Ok(ControlFrame {
        message: ControlMessage::EdgeHelloResponse(answer),
        ..
    })) = io.next().await
    else {
        return Err(failed("no hello answer"));
    };
    match answer {
        EdgeHelloResponse::Rejected { reason } => Err(SessionState::Rejected(reason)),
        EdgeHelloResponse::Accepted {
            projection,
            heartbeat_interval_ms,
        } => {
            if c.managed && projection.is_none() {
                return Err(SessionState::MissingProjection);
            }
            let heartbeat = heartbeat_interval_ms
                .map_or(DEFAULT_HEARTBEAT, |ms| Duration::from_millis(u64::from(ms)));
            Ok((io, projection.filter(|_| c.managed), heartbeat))
        }
    }
}

/// Applies a projection if its generation is strictly higher; returns the answer.
fn apply_projection(shared: &Shared, p: PrincipalProjection) -> PrincipalProjectionApplyResponse {
    let mut slot = shared
        .projection
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let held = slot.as_ref().map_or(0, |i| i.generation());
    if !shared.config.managed {
        return PrincipalProjectionApplyResponse {
            accepted: false,
            generation: 0,
            reason: "credential plane disabled".into(),
        };
    }
    if p.generation <= held {
        return PrincipalProjectionApplyResponse {
            accepted: false,
            generation: held,
            reason: "stale generation".into(),
        };
    }
    let generation = p.generation;
    *slot = Some(Arc::new(ProjectionIndex::new(p)));
    tracing::info!(target: "iop_edge", event = "edge_projection_applied", generation, "projection applied");
    PrincipalProjectionApplyResponse {
        accepted: true,
        generation,
        reason: String::new(),
    }
}

/// One accepted session; `Ok` when it ended after being accepted.
async fn session(shared: &Arc<Shared>) -> Result<(), SessionState> {
    let mut lifecycle = shared.edge.subscribe();
    let (mut io, projection, heartbeat) =
        match tokio::time::timeout(CONNECT_TIMEOUT, connect(shared)).await {
            Ok(r) => r?,
            Err(_) => return Err(SessionState::Failed("timeout".into())),
        };
    if let Some(p) = projection {
        // The hello's projection: newer than what we hold, or the same one after a reconnect.
        let held = shared
            .projection
            .read()
            .ok()
            .and_then(|g| g.as_ref().map(|i| i.generation()));
        if held.is_none_or(|h| p.generation > h) {
            apply_projection(shared, p);
        }
    }
    let (out_tx, mut out_rx) = mpsc::channel::<ControlFrame>(OUTBOUND_FRAMES);
    let requests = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_REQUESTS));
    let pending: Arc<Mutex<HashMap<u64, Waiter>>> = Arc::default();
    *lock(&shared.link) = Some(Link {
        out: out_tx.clone(),
        pending: pending.clone(),
    });
    shared.state.send_replace(SessionState::Connected);
    tracing::info!(target: "iop_edge", event = "edge_control_connected", managed = shared.config.managed, "control plane session accepted");
    let mut ping = tokio::time::interval(heartbeat);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let silence = heartbeat * 3;
    let mut last_heard = tokio::time::Instant::now();
    loop {
        tokio::select! {
            frame = io.next() => {
                let Some(Ok(frame)) = frame else { return Ok(()) };
                last_heard = tokio::time::Instant::now();
                // Requests that spawn work wait for a slot first: a flood is read no faster
                // than it is served.
                let permit = match &frame.message {
                    ControlMessage::EdgeStatusRequest | ControlMessage::EdgeCommandRequest(_) => {
                        requests.clone().acquire_owned().await.ok()
                    }
                    _ => None,
                };
                if !inbound(shared, frame, &out_tx, &pending, permit) {
                    return Ok(());
                }
            }
            Some(frame) = out_rx.recv() => {
                if !matches!(write(&mut io, frame, silence).await, Ok(Ok(()))) {
                    tracing::info!("control plane not reading; ending the session");
                    return Ok(());
                }
            }
            event = lifecycle.recv() => {
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
                    occurred_at_unix_ms: unix_ms(),
                    metadata: Default::default(),
                };
                let frame = ControlFrame::new(ControlMessage::EdgeNodeEvent(ev));
                if !matches!(write(&mut io, frame, silence).await, Ok(Ok(()))) {
                    return Ok(());
                }
            }
            _ = ping.tick() => {
                if last_heard.elapsed() > silence {
                    tracing::info!("control plane silent for three heartbeats");
                    return Ok(());
                }
                if !matches!(write(&mut io, ControlFrame::new(ControlMessage::Ping), silence).await, Ok(Ok(()))) {
                    return Ok(());
                }
            }
        }
    }
}

/// Writes one frame, or fails if the peer does not take it within `limit` (it is not reading).
async fn write(
    io: &mut Io,
    frame: ControlFrame,
    limit: Duration,
) -> Result<Result<(), iop_wire::codec::CodecError>, tokio::time::error::Elapsed> {
    tokio::time::timeout(limit, io.send(frame)).await
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// One frame from the Control Plane; `false` ends the session (a protocol violation, or a
/// peer that does not read its answers: the session's queue is full). `permit` is the slot
/// of a status or command request.
fn inbound(
    shared: &Arc<Shared>,
    frame: ControlFrame,
    out: &mpsc::Sender<ControlFrame>,
    pending: &Mutex<HashMap<u64, Waiter>>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> bool {
    let id = frame.correlation_id;
    match frame.message {
        ControlMessage::EdgeStatusRequest => {
            let (shared, out) = (shared.clone(), out.clone());
            tokio::spawn(async move {
                let status = status(&shared).await;
                let _ = out.try_send(ControlFrame::correlated(
                    id,
                    ControlMessage::EdgeStatusResponse(status),
                ));
                drop(permit);
            });
        }
        ControlMessage::EdgeCommandRequest(req) => {
            let (shared, out) = (shared.clone(), out.clone());
            tokio::spawn(async move {
                command(&shared, id, req, &out).await;
                drop(permit);
            });
        }
        ControlMessage::PrincipalProjectionApplyRequest(p) => {
            let answer = apply_projection(shared, p);
            return out
                .try_send(ControlFrame::correlated(
                    id,
                    ControlMessage::PrincipalProjectionApplyResponse(answer),
                ))
                .is_ok();
        }
        ControlMessage::AcquireLeaseResponse(r) => {
            if let Some(Waiter::Lease(tx)) = lock(pending).remove(&id) {
                let _ = tx.send(r);
            }
        }
        ControlMessage::Ping => {
            return out
                .try_send(ControlFrame::correlated(id, ControlMessage::Pong))
                .is_ok();
        }
        ControlMessage::Pong => {
            if let Some(Waiter::Pong(tx)) = lock(pending).remove(&id) {
                let _ = tx.send(());
            }
        }
        _ => return false,
    }
    true
}

/// The Edge-owned Node view.
async fn status(shared: &Shared) -> EdgeStatusResponse {
    let edge = &shared.edge;
    let snapshots = edge.snapshot().await.unwrap_or_default();
    let ready: HashSet<String> = edge
        .ready_nodes()
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
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
            provider_snapshots: snapshots
                .iter()
                .filter(|s| s.node_id == *node_id)
                .cloned()
                .collect(),
        })
        .collect();
    for node_id in &ready {
        if !nodes.iter().any(|n| n.node_id == *node_id) {
            nodes.push(EdgeNodeSnapshot {
                node_id: node_id.clone(),
                connected: true,
                config: EdgeNodeConfigSummary::default(),
                provider_snapshots: Vec::new(),
            });
        }
    }
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    EdgeStatusResponse {
        edge_id: shared.config.edge_id.clone(),
        nodes,
    }
}

async fn command(
    shared: &Shared,
    id: u64,
    req: EdgeCommandRequest,
    out: &mpsc::Sender<ControlFrame>,
) {
    let event = |phase: &str, message: &str| {
        let ev = EdgeCommandEvent {
            command_id: req.command_id.clone(),
            phase: phase.to_owned(),
            message: message.to_owned(),
            metadata: Default::default(),
        };
        let _ = out.try_send(ControlFrame::correlated(
            id,
            ControlMessage::EdgeCommandEvent(ev),
        ));
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
    let _ = out.try_send(ControlFrame::correlated(
        id,
        ControlMessage::EdgeCommandResponse(response),
    ));
}
