//! The Edge wire server (seed `001`): Edges dial in over TLS TCP and speak
//! [`ControlFrame`]s with the same length-prefixed codec as the runtime wire.
//!
//! Per connection:
//! 1. TLS. In managed mode the peer must present a CA-signed workload certificate with
//!    `role=edge` (the caller's rustls config verifies the chain and role; this module refuses
//!    a connection without a verified identity anyway, so a misconfigured server fails closed).
//! 2. The first frame must be `EdgeHelloRequest` within [`HELLO_TIMEOUT`]: a non-empty
//!    `edge_id`; in managed mode `managed=true` and `edge_id` equal to the certificate's name;
//!    in legacy mode `managed=false`. A refusal is answered with a stable reason, then closed.
//! 3. Accepted: the hello answer carries the current projection (managed mode). A later
//!    connection of the same `edge_id` replaces the earlier one, which is closed.
//!    To an Edge whose hello says it takes parts (every Edge of this version), a projection
//!    larger than 1 MiB (about 5,000 principals with a token and a route each) goes in parts of
//!    at most that, or of the frame limit if smaller ([`ServerConfig::max_frame_len`], the
//!    limit the Edge's hello names), before the hello answer or apply request that completes
//!    it: each session's write buffer keeps the size of the largest frame it wrote. An older
//!    Edge gets it whole up to the frame limit (8 MiB by default, about 40,000 principals).
//!    Beyond that, or beyond what an Edge assembles from parts
//!    ([`ProjectionTooLarge::Assembly`](iop_wire::control::ProjectionTooLarge::Assembly)),
//!    the Edge is refused (hello) or disconnected (push) with the sizes in the log
//!    (`cp_edge_hello_refused`, `cp_projection_unsendable`), never sent what it cannot read.
//! 4. Then: every durable mutation pushes `PrincipalProjectionApplyRequest` (managed: one
//!    projection per generation, read from the store, built and encoded once for every Edge,
//!    [`Admin::shared_projection`](crate::admin::Admin::shared_projection)); the
//!    Edge's `AcquireLeaseRequest`s go to the [`LeaseService`] (managed only: in legacy mode
//!    they are refused and nothing is read from the store); status and command requests from
//!    [`ControlPlane`] are correlated with their answers; `EdgeNodeEvent`s are published on
//!    [`ControlPlane::events`]; pings are answered. Silence longer than three heartbeat
//!    intervals closes the connection.
//!
//! The protocol decisions (hello and identity agreement, silence, correlation by kind,
//! projection generations that only move forward, lease answers) are
//! `iop_wire::control_session::ControlPlaneSession`'s, tested against the Edge's machine in
//! virtual time (`iop-wire/tests/control_pair.rs`). Each connection is one driver loop that
//! owns its machine; [`ControlPlane`] handles and lease tasks hand it work through a bounded
//! queue. The loop decides only what needs the store or the mode: whether a consistent hello is
//! accepted (managed/legacy agreement, the certificate's role), the projection to send, the
//! lease answers.
//!
//! [`serve`] binds a TCP listener; [`serve_unbound`] serves connections its embedder accepts
//! (the deterministic simulation in `tests/tests/control_sim.rs` runs it on `turmoil`).
//!
//! The Control Plane never dials a Node or an Edge.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bounded_http::RateLimited;
use bounded_http::tls::{Slot, TlsAccept, TlsLimits};
use futures_util::{SinkExt as _, StreamExt as _};
use iop_wire::codec::{FrameCodec, TokioCodec};
use iop_wire::control::{
    AcquireLeaseResponse, ControlFrame, EdgeCommandEvent, EdgeCommandRequest, EdgeCommandResponse,
    EdgeHelloRequest, EdgeNodeEvent, EdgeStatusResponse, PrincipalProjection,
};
use iop_wire::control_session::{
    ControlCloseReason, ControlPlaneEvent, ControlPlaneSession, ControlSessionConfig,
};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_rustls::TlsAcceptor;
use tokio_util::codec::Framed;
use workload_identity::{peer_identity, role};

use crate::admin::Admin;
use crate::lease::LeaseService;

/// How long an Edge has to send its hello after the TLS handshake.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Default heartbeat interval told to Edges.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);
/// Default interval of the store generation poll.
pub const DEFAULT_STORE_POLL: Duration = Duration::from_millis(500);
/// How long a status or command request waits for the Edge's answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Frames queued to one Edge at most; an Edge that lets it fill (it does not read its
/// answers) is disconnected.
const OUTBOUND_FRAMES: usize = 1024;
/// Lease requests of one Edge served at once; more wait (its socket is not read meanwhile).
const CONCURRENT_LEASES: usize = 64;
/// Usage reports of one Edge being stored at once; more wait unread (the Edge keeps them).
const CONCURRENT_USAGE_WRITES: usize = 2;
/// Connections in their TLS handshake and hello at once; more are closed at once.
const MAX_HANDSHAKES: usize = 256;

/// Server settings.
#[derive(Clone)]
pub struct ServerConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// TLS: in managed mode a config that requires and verifies Edge client certificates.
    pub tls: Arc<rustls::ServerConfig>,
    /// `credential_plane.enabled`.
    pub managed: bool,
    /// Heartbeat interval told to Edges.
    pub heartbeat: Duration,
    /// Largest frame accepted or sent. A projection larger than a frame is sent in parts.
    pub max_frame_len: usize,
    /// How often the store's generation is read at the latest, so that mutations made
    /// elsewhere (the CLI on the same SQLite file, another replica on PostgreSQL) are pushed
    /// to Edges too.
    pub store_poll: Duration,
    /// Whether to notice such mutations at once ([`crate::store::Store::wait_change`]: SQLite
    /// `data_version`, PostgreSQL `LISTEN/NOTIFY`) rather than only every `store_poll`. On by
    /// default; off only to hold a stale projection on purpose (tests).
    pub store_watch: bool,
    /// The wall clock: when a lease's validity starts, when a staged issuer key is due. The
    /// system clock; a simulation passes its own ([`UnixClock::new`]).
    pub clock: UnixClock,
    /// Where the Control Plane's spans go ([`iop_telemetry`]): each lease request is a
    /// `lease issue` span, a child of the Edge's `lease acquire` span when the request carried
    /// its trace. Off by default.
    pub telemetry: iop_telemetry::Telemetry,
}

/// A wall clock in Unix milliseconds.
#[derive(Clone)]
pub struct UnixClock(Arc<dyn Fn() -> i64 + Send + Sync>);

impl UnixClock {
    /// The system clock.
    pub fn system() -> Self {
        Self(Arc::new(crate::store::unix_ms))
    }

    /// A clock read from `now` (a simulation's).
    pub fn new(now: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        Self(Arc::new(now))
    }

    /// Now, in Unix milliseconds.
    pub fn now_ms(&self) -> i64 {
        (self.0)()
    }
}

impl Default for UnixClock {
    fn default() -> Self {
        Self::system()
    }
}

impl std::fmt::Debug for UnixClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UnixClock({})", self.now_ms())
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("listen", &self.listen)
            .field("managed", &self.managed)
            .field("heartbeat", &self.heartbeat)
            .finish_non_exhaustive()
    }
}

impl ServerConfig {
    /// Defaults for everything but address, TLS and mode.
    pub fn new(listen: SocketAddr, tls: Arc<rustls::ServerConfig>, managed: bool) -> Self {
        Self {
            listen,
            tls,
            managed,
            heartbeat: DEFAULT_HEARTBEAT,
            max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
            store_poll: DEFAULT_STORE_POLL,
            clock: UnixClock::system(),
            store_watch: true,
            telemetry: iop_telemetry::Telemetry::off(),
        }
    }
}

/// Failures of [`ControlPlane`] requests to an Edge.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// No Edge with that id is connected.
    #[error("edge not connected")]
    NotConnected,
    /// The Edge disconnected before answering.
    #[error("edge disconnected")]
    Disconnected,
    /// No answer within [`REQUEST_TIMEOUT`].
    #[error("edge did not answer in time")]
    Timeout,
}

/// A connected Edge, as the live view shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgeInfo {
    /// Edge id (the certificate name in managed mode).
    pub edge_id: String,
    /// Projection generation the Edge holds (managed): its hello's, or the last push it
    /// acknowledged.
    pub projection_generation: u64,
}

/// What [`ControlPlane`] handles and lease tasks hand to a connection's driver loop.
enum Request {
    Status(oneshot::Sender<Result<EdgeStatusResponse, RequestError>>),
    Command(EdgeCommandRequest, CommandReply),
    /// The answer to the lease request `id`, computed by a spawned task.
    Lease(u64, AcquireLeaseResponse),
    /// The usage report `id` is stored.
    Usage(u64, iop_wire::control::EdgeUsageAck),
    /// A newer connection of the same Edge took over: close this one.
    Replaced,
}

type CommandReply =
    oneshot::Sender<Result<(EdgeCommandResponse, Vec<EdgeCommandEvent>), RequestError>>;

/// A status or command request waiting for its answer, by the session's ticket.
enum Waiter {
    Status(oneshot::Sender<Result<EdgeStatusResponse, RequestError>>),
    Command {
        command_id: String,
        events: Vec<EdgeCommandEvent>,
        reply: CommandReply,
    },
}

/// Phase events kept per pending command at most.
const COMMAND_EVENTS: usize = 256;

struct Conn {
    /// Distinguishes a replaced connection from its successor.
    serial: u64,
    requests: mpsc::Sender<Request>,
    acked_generation: Arc<AtomicU64>,
}

#[derive(Default)]
struct Shared {
    edges: HashMap<String, Conn>,
    next_serial: u64,
}

/// The running server's handle: the live Edge view, status and commands, Node events.
#[derive(Clone)]
pub struct ControlPlane {
    shared: Arc<Mutex<Shared>>,
    stop: tokio_util::sync::CancellationToken,
    events: broadcast::Sender<(String, EdgeNodeEvent)>,
    local_addr: SocketAddr,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ControlPlane {
    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting and closes every Edge connection (Edges reconnect elsewhere or later).
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Connected Edges, sorted by id.
    pub fn edges(&self) -> Vec<EdgeInfo> {
        let shared = lock(&self.shared);
        let mut v: Vec<_> = shared
            .edges
            .iter()
            .map(|(id, c)| EdgeInfo {
                edge_id: id.clone(),
                projection_generation: c.acked_generation.load(Ordering::Relaxed),
            })
            .collect();
        v.sort_by(|a, b| a.edge_id.cmp(&b.edge_id));
        v
    }

    /// `(edge_id, event)` for every `EdgeNodeEvent` relayed by any Edge.
    pub fn events(&self) -> broadcast::Receiver<(String, EdgeNodeEvent)> {
        self.events.subscribe()
    }

    /// Hands `request` to the driver of `edge_id`'s connection. Never waits: a full queue
    /// means the connection is stuck (it ends soon), and the request fails at once.
    fn send(&self, edge_id: &str, request: Request) -> Result<(), RequestError> {
        let shared = lock(&self.shared);
        let conn = shared
            .edges
            .get(edge_id)
            .ok_or(RequestError::NotConnected)?;
        conn.requests
            .try_send(request)
            .map_err(|_| RequestError::Disconnected)
    }

    /// Asks an Edge for its Node snapshot view.
    pub async fn status(&self, edge_id: &str) -> Result<EdgeStatusResponse, RequestError> {
        let (tx, rx) = oneshot::channel();
        self.send(edge_id, Request::Status(tx))?;
        answer(rx).await
    }

    /// Sends a command to an Edge; returns its response and the phase events it reported
    /// before the response.
    pub async fn command(
        &self,
        edge_id: &str,
        request: EdgeCommandRequest,
    ) -> Result<(EdgeCommandResponse, Vec<EdgeCommandEvent>), RequestError> {
        let (tx, rx) = oneshot::channel();
        self.send(edge_id, Request::Command(request, tx))?;
        answer(rx).await
    }
}

/// Waits for a driver's answer: [`RequestError::Timeout`] after [`REQUEST_TIMEOUT`],
/// [`RequestError::Disconnected`] when the connection ended without one.
async fn answer<T>(rx: oneshot::Receiver<Result<T, RequestError>>) -> Result<T, RequestError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(RequestError::Disconnected),
        Err(_) => Err(RequestError::Timeout),
    }
}

/// Binds the listener and serves Edges until the returned task is aborted.
pub async fn serve(
    config: ServerConfig,
    admin: Admin,
    leases: Option<Arc<LeaseService>>,
) -> std::io::Result<(ControlPlane, tokio::task::JoinHandle<()>)> {
    check_config(&config, leases.as_ref())?;
    let listener = TcpListener::bind(config.listen).await?;
    let local_addr = listener.local_addr()?;
    let unbound = start(config, admin, leases, local_addr);
    let cp = unbound.control_plane().clone();
    let task = tokio::spawn(async move {
        let accept = unbound.acceptor.accept.clone();
        let stop = unbound.acceptor.cp.stop.clone();
        let acceptor = unbound.acceptor.clone();
        accept
            .run(listener, stop.cancelled_owned(), move |tls, _peer, slot| {
                acceptor.clone().connection(tls, slot)
            })
            .await;
        drop(unbound);
    });
    Ok((cp, task))
}

/// A Control Plane serving Edge connections its embedder accepts itself (another transport,
/// or `turmoil`'s simulated network in `tests/tests/control_sim.rs`): the store poller and
/// issuer-key activation run as with [`serve`]; each accepted byte stream goes to
/// [`UnboundControlPlane::serve_connection`]. Dropping it stops the poller.
pub fn serve_unbound(
    config: ServerConfig,
    admin: Admin,
    leases: Option<Arc<LeaseService>>,
) -> std::io::Result<UnboundControlPlane> {
    check_config(&config, leases.as_ref())?;
    let listen = config.listen;
    Ok(start(config, admin, leases, listen))
}

fn check_config(config: &ServerConfig, leases: Option<&Arc<LeaseService>>) -> std::io::Result<()> {
    if config.managed && leases.is_none() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "managed mode needs a lease service",
        ));
    }
    Ok(())
}

/// See [`serve_unbound`].
pub struct UnboundControlPlane {
    acceptor: Acceptor,
    _poller: AbortOnDrop,
}

impl std::fmt::Debug for UnboundControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnboundControlPlane")
            .field("cp", &self.acceptor.cp)
            .finish_non_exhaustive()
    }
}

impl UnboundControlPlane {
    /// The handle for status, commands and node events.
    pub fn control_plane(&self) -> &ControlPlane {
        &self.acceptor.cp
    }

    /// Serves one accepted connection (TLS handshake, hello, session) on a task of its own,
    /// under the same handshake cap and timeouts as [`serve`]'s listener.
    pub fn serve_connection<S>(&self, stream: S, peer: SocketAddr)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        self.acceptor.accept(stream, peer);
    }
}

/// What every accepted connection needs: the bounded accept loop shared with every mTLS
/// listener of the workspace (`bounded_http::tls`: at most [`MAX_HANDSHAKES`] connections
/// between accept and their hello, the TLS handshake within [`HELLO_TIMEOUT`], refusals logged
/// at most once per 10 s) and the session's dependencies.
#[derive(Clone)]
struct Acceptor {
    accept: Arc<TlsAccept>,
    cp: ControlPlane,
    admin: Admin,
    leases: Option<Arc<LeaseService>>,
    config: ServerConfig,
}

impl Acceptor {
    fn accept<S>(&self, stream: S, peer: SocketAddr)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let a = self.clone();
        self.accept
            .try_serve(stream, peer, move |tls, _peer, slot| {
                a.connection(tls, slot)
            });
    }

    /// An accepted TLS connection: its identity read, then the session (which frees `slot`
    /// once the hello is accepted).
    async fn connection<S>(self, tls: tokio_rustls::server::TlsStream<S>, slot: Slot)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let identity = peer_identity(tls.get_ref().1).ok();
        connection(
            tls,
            identity,
            self.cp,
            self.admin,
            self.leases,
            self.config,
            slot,
        )
        .await;
    }
}

/// The handle, the store poller (it also activates a staged issuer key when its time comes)
/// and the acceptor.
fn start(
    config: ServerConfig,
    admin: Admin,
    leases: Option<Arc<LeaseService>>,
    local_addr: SocketAddr,
) -> UnboundControlPlane {
    let cp = ControlPlane {
        shared: Arc::default(),
        stop: tokio_util::sync::CancellationToken::new(),
        events: broadcast::channel(1024).0,
        local_addr,
    };
    let poll_admin = admin.clone();
    let poll_every = config.store_poll;
    let watch = config.store_watch;
    let rotates = config.managed;
    let clock = config.clock.clone();
    let poller = tokio::spawn(async move {
        let mut activation_log = RateLimited::new(Duration::from_secs(10));
        loop {
            // A staged issuer key is activated at its time by whichever replica gets there
            // first (the others' attempt finds no staged key and changes nothing).
            let mut wait = poll_every;
            if rotates {
                wait =
                    wait.min(activate_due_issuer(&poll_admin, &clock, &mut activation_log).await);
            }
            // Returns at once when another process or replica committed (SQLite
            // `data_version`, PostgreSQL `NOTIFY`); `poll_every` is the safety net.
            if watch {
                poll_admin.store().wait_change(wait).await;
            } else {
                tokio::time::sleep(wait).await;
            }
            match poll_admin.store().generation().await {
                Ok(g) => poll_admin.observe(g),
                Err(e) => tracing::warn!(error = %e, "store generation poll failed"),
            }
        }
    });
    UnboundControlPlane {
        acceptor: Acceptor {
            accept: TlsAccept::new(
                TlsAcceptor::from(config.tls.clone()),
                TlsLimits {
                    max_handshakes: MAX_HANDSHAKES,
                    max_handshakes_per_ip: usize::MAX,
                    handshake_timeout: HELLO_TIMEOUT,
                },
                None,
                "edge",
            ),
            cp,
            admin,
            leases,
            config,
        },
        _poller: AbortOnDrop(poller),
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why a hello is refused (the reason string is what the Edge receives).
fn check_hello(
    config: &ServerConfig,
    identity: Option<&workload_identity::WorkloadId>,
    edge_id: &str,
    managed: bool,
) -> Result<(), &'static str> {
    if edge_id.is_empty() {
        return Err("edge_id is required");
    }
    if config.managed {
        let Some(id) = identity else {
            return Err("managed mode requires an authenticated edge certificate");
        };
        if id.role() != role::EDGE {
            return Err("certificate role is not edge");
        }
        if id.name() != edge_id {
            return Err("hello edge_id does not match the certificate");
        }
        if !managed {
            return Err("control plane is in managed mode; edge is not");
        }
    } else if managed {
        return Err("credential plane is disabled at the control plane");
    }
    Ok(())
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// One Edge connection: the driver of `iop_wire::control_session::ControlPlaneSession`. The
/// machine decides the protocol (hello and identity agreement, silence, correlation, projection
/// generations); this loop reads and writes frames, asks the store, runs lease requests and
/// keeps the live Edge view.
async fn connection<S>(
    stream: S,
    identity: Option<workload_identity::WorkloadId>,
    cp: ControlPlane,
    admin: Admin,
    leases: Option<Arc<LeaseService>>,
    config: ServerConfig,
    handshake_slot: Slot,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let codec = FrameCodec::with_max_frame_len(config.max_frame_len);
    let mut framed = Framed::new(stream, TokioCodec::<ControlFrame>::new(codec));
    let session = ControlSessionConfig {
        handshake_timeout: HELLO_TIMEOUT,
        heartbeat: config.heartbeat,
        max_frame_len: config.max_frame_len,
    };
    // In managed mode the machine refuses a hello naming another Edge than the certificate;
    // a legacy Control Plane does not hold the Edge to its certificate's name.
    let peer = identity
        .as_ref()
        .filter(|_| config.managed)
        .map(|id| id.name().to_owned());
    let mut s = ControlPlaneSession::new(session, peer, now());
    let (req_tx, mut req_rx) = mpsc::channel::<Request>(OUTBOUND_FRAMES);
    let lease_slots = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_LEASES));
    let usage_slots = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_USAGE_WRITES));
    let acked = Arc::new(AtomicU64::new(0));
    let mut generations = admin.subscribe();
    let mut handshake_slot = Some(handshake_slot);
    let mut waiters: HashMap<u64, Waiter> = HashMap::new();
    // (edge_id, serial) once the hello is accepted.
    let mut registered: Option<(String, u64)> = None;
    let mut writable = true;
    let idle = config.heartbeat * 3;
    let reason = 'session: loop {
        // Events first (deciding one may queue frames), then the frames; until both are empty.
        let mut progressed = true;
        while progressed {
            progressed = false;
            while let Some(event) = s.poll_event() {
                progressed = true;
                match event {
                    ControlPlaneEvent::Hello(hello) => {
                        // Before the hello's snapshot: a mutation while it is read is pushed.
                        generations.mark_unchanged();
                        if let Some((id, generation)) =
                            hello_accepted(&mut s, &hello, identity.as_ref(), &config, &admin).await
                        {
                            drop(handshake_slot.take());
                            // The Edge installs the hello's projection before anything else (or
                            // holds a newer one), and a session that goes on has it: it counts
                            // as acknowledged, as a push's answer does.
                            acked.fetch_max(generation, Ordering::Relaxed);
                            registered = Some((id.clone(), register(&cp, &id, &req_tx, &acked)));
                            tracing::info!(target: "iop_cp", event = "cp_edge_connected", edge_id = %id, managed = config.managed, "edge connected");
                        }
                    }
                    ControlPlaneEvent::NodeEvent(ev) => {
                        let edge_id = registered.as_ref().map_or("", |(id, _)| id.as_str());
                        tracing::info!(target: "iop_cp", event = "cp_edge_node_event", edge_id, kind = ev.kind.as_str(), node_id = %ev.node_id, "node lifecycle event");
                        let _ = cp.events.send((edge_id.to_owned(), ev));
                    }
                    ControlPlaneEvent::CommandEvent { ticket, event } => {
                        if let Some(Waiter::Command {
                            command_id, events, ..
                        }) = waiters.get_mut(&ticket)
                            && *command_id == event.command_id
                            && events.len() < COMMAND_EVENTS
                        {
                            events.push(event);
                        }
                    }
                    ControlPlaneEvent::StatusAnswered { ticket, result } => {
                        if let Some(Waiter::Status(tx)) = waiters.remove(&ticket) {
                            let _ = tx.send(result.map_err(|_| RequestError::Disconnected));
                        }
                    }
                    ControlPlaneEvent::CommandAnswered { ticket, result } => {
                        if let Some(Waiter::Command { events, reply, .. }) = waiters.remove(&ticket)
                        {
                            let _ = reply.send(
                                result
                                    .map(|r| (r, events))
                                    .map_err(|_| RequestError::Disconnected),
                            );
                        }
                    }
                    ControlPlaneEvent::ProjectionAnswered { pushed, answer } => {
                        if answer.accepted {
                            acked.fetch_max(answer.generation, Ordering::Relaxed);
                        } else {
                            let edge_id = registered.as_ref().map_or("", |(id, _)| id.as_str());
                            tracing::info!(target: "iop_cp", event = "cp_projection_refused", edge_id, generation = pushed, held = answer.generation, reason = %answer.reason, "edge refused a projection");
                        }
                    }
                    ControlPlaneEvent::LeaseRequested { id, request } => {
                        let Some(leases) = leases.clone() else {
                            // Legacy mode: no lease traffic; nothing is read from the store.
                            let refuse = AcquireLeaseResponse::Refused {
                                reason: "credential_plane_disabled".into(),
                            };
                            let _ = s.respond_lease(now(), id, refuse);
                            continue;
                        };
                        // A slot first: an Edge's flood of lease requests is read no faster than
                        // the store serves it (nothing is read while this waits).
                        let permit = lease_slots.clone().acquire_owned().await.ok();
                        let out = req_tx.clone();
                        let edge_id = registered
                            .as_ref()
                            .map_or(String::new(), |(id, _)| id.clone());
                        let clock = config.clock.clone();
                        let mut span = if config.telemetry.is_on() {
                            config.telemetry.span(
                                "lease issue",
                                iop_telemetry::SpanKind::Server,
                                request.trace.as_ref(),
                                vec![
                                    iop_telemetry::KeyValue::new("iop.edge.id", edge_id.clone()),
                                    iop_telemetry::attr::node_id(request.binding.node_id.clone()),
                                    iop_telemetry::attr::principal(
                                        request.binding.principal_id.clone(),
                                    ),
                                ],
                            )
                        } else {
                            iop_telemetry::Span::none()
                        };
                        tokio::spawn(async move {
                            let answer = match leases.acquire(&request, clock.now_ms()).await {
                                Ok(lease) => AcquireLeaseResponse::Granted(lease),
                                Err(refusal) => {
                                    span.fail("lease_refused");
                                    tracing::info!(target: "iop_cp", event = "cp_lease_refused", edge_id = %edge_id, reason = refusal.as_str(), "lease refused");
                                    AcquireLeaseResponse::Refused {
                                        reason: refusal.as_str().to_owned(),
                                    }
                                }
                            };
                            // Never waits (the loop may be waiting for this task's slot).
                            let _ = out.try_send(Request::Lease(id, answer));
                            drop(span);
                            drop(permit);
                        });
                    }
                    ControlPlaneEvent::UsageReported { id, report } => {
                        // Stored, then acknowledged; a failure is not answered, so the Edge
                        // sends the records again (they are stored once by request id).
                        let permit = usage_slots.clone().acquire_owned().await.ok();
                        let out = req_tx.clone();
                        let store = admin.store().clone();
                        let edge_id = registered
                            .as_ref()
                            .map_or(String::new(), |(id, _)| id.clone());
                        tokio::spawn(async move {
                            match store.record_usage(&edge_id, &report.records).await {
                                Ok(done) => {
                                    tracing::debug!(target: "iop_cp", event = "cp_usage_stored", edge_id = %edge_id, stored = done.stored, duplicates = done.duplicates, "usage records stored");
                                    let _ = out.try_send(Request::Usage(
                                        id,
                                        iop_wire::control::EdgeUsageAck {
                                            stored: done.stored,
                                            duplicates: done.duplicates,
                                        },
                                    ));
                                }
                                Err(e) => {
                                    tracing::warn!(target: "iop_cp", event = "cp_usage_store_failed", edge_id = %edge_id, records = report.records.len(), error = %e, "usage records not stored; the edge will send them again");
                                }
                            }
                            drop(permit);
                        });
                    }
                    ControlPlaneEvent::Closed(reason) => break 'session reason,
                    _ => {}
                }
            }
            while let Some(frame) = s.poll_transmit() {
                progressed = true;
                // An Edge that does not take our frames within the silence limit is not reading.
                match tokio::time::timeout(idle, framed.send(frame)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e @ iop_wire::codec::CodecError::Frame(_))) => {
                        // The session cuts what could be too large (projections); this is a bug
                        // if it happens, and says what rather than look like a slow Edge.
                        let edge_id = registered.as_ref().map_or("", |(id, _)| id.as_str());
                        tracing::warn!(target: "iop_cp", event = "cp_frame_unsendable", edge_id, error = %e, "a frame to the edge could not be encoded; closing");
                        writable = false;
                        s.handle_transport_closed();
                        break;
                    }
                    _ => {
                        writable = false;
                        s.handle_transport_closed();
                        break;
                    }
                }
            }
        }
        let deadline = s.poll_timeout().map(tokio::time::Instant::from_std);
        tokio::select! {
            () = cp.stop.cancelled() => s.close_local(),
            frame = framed.next() => match frame {
                Some(Ok(frame)) => s.handle_frame(now(), frame),
                Some(Err(iop_wire::codec::CodecError::Io(e))) => {
                    // A killed process, or a socket closed without TLS close_notify.
                    tracing::info!(error = %e, "edge connection closed");
                    writable = false;
                    s.handle_transport_closed();
                }
                Some(Err(e)) => {
                    tracing::info!(error = %e, "edge sent an invalid frame; closing");
                    s.handle_transport_closed();
                }
                None => {
                    writable = false;
                    s.handle_transport_closed();
                }
            },
            Some(request) = req_rx.recv() => {
                let at = now();
                match request {
                    Request::Status(tx) => match s.status(at) {
                        Ok(ticket) => {
                            waiters.insert(ticket, Waiter::Status(tx));
                        }
                        Err(_) => {
                            let _ = tx.send(Err(RequestError::Disconnected));
                        }
                    },
                    Request::Command(request, reply) => {
                        let command_id = request.command_id.clone();
                        match s.command(at, request) {
                            Ok(ticket) => {
                                waiters.insert(ticket, Waiter::Command { command_id, events: Vec::new(), reply });
                            }
                            Err(_) => {
                                let _ = reply.send(Err(RequestError::Disconnected));
                            }
                        }
                    }
                    Request::Lease(id, answer) => {
                        let _ = s.respond_lease(at, id, answer);
                    }
                    Request::Usage(id, ack) => {
                        let _ = s.respond_usage(at, id, ack);
                    }
                    Request::Replaced => s.close_local(),
                }
            }
            changed = generations.changed(), if config.managed && s.is_connected() => {
                let latest = changed.map(|()| *generations.borrow_and_update()).unwrap_or(0);
                if latest > s.pushed_generation() {
                    // Shared: every Edge's session asks for this one projection at once.
                    match admin.shared_projection(latest).await {
                        Ok(p) => {
                            let _ = s.push_shared(now(), &p);
                        }
                        Err(e) => tracing::warn!(error = %e, "projection snapshot failed"),
                    }
                }
            }
            () = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => s.handle_timeout(now()),
        }
    };

    // What the machine queued in its closing step (a refusal's answer) goes out, then a clean
    // TLS close, each briefly: the Edge may be gone.
    if writable {
        let flush = async {
            while let Some(frame) = s.poll_transmit() {
                framed.send(frame).await?;
            }
            framed.close().await
        };
        let _ = tokio::time::timeout(CLOSE_GRACE, flush).await;
    }
    let edge_id = registered.as_ref().map_or("", |(id, _)| id.as_str());
    match &reason {
        ControlCloseReason::Silent => {
            tracing::info!(edge_id, "edge silent for three heartbeats; closed");
        }
        ControlCloseReason::HandshakeTimeout => {
            tracing::info!("edge sent no hello in time; closed");
        }
        ControlCloseReason::ProtocolViolation(what) => {
            tracing::info!(
                edge_id,
                what,
                "closing the edge connection (protocol violation)"
            );
        }
        ControlCloseReason::ProjectionTooLarge(e) => {
            tracing::warn!(target: "iop_cp", event = "cp_projection_unsendable", edge_id, error = %e, "closing the edge connection: the new principal projection cannot be sent to it (the error says why)");
        }
        _ => {}
    }
    if let Some((edge_id, serial)) = registered {
        let mut shared = lock(&cp.shared);
        if shared
            .edges
            .get(&edge_id)
            .is_some_and(|c| c.serial == serial)
        {
            shared.edges.remove(&edge_id);
            tracing::info!(target: "iop_cp", event = "cp_edge_disconnected", edge_id = %edge_id, "edge disconnected");
        }
    }
}

/// Activates the staged issuer key when its time has come; how long until it is due (at most
/// an hour) otherwise, or until the next attempt after a failure (1 s; failures are logged at
/// most once per 10 s).
async fn activate_due_issuer(admin: &Admin, clock: &UnixClock, log: &mut RateLimited) -> Duration {
    const IDLE: Duration = Duration::from_secs(3600);
    const RETRY: Duration = Duration::from_secs(1);
    let staged = match admin.store().issuer_keys().await {
        Ok(keys) => keys.into_iter().find(|k| !k.active),
        Err(e) => {
            if let Some(suppressed) = log.hit() {
                tracing::warn!(error = %e, suppressed, "issuer key read failed");
            }
            return RETRY;
        }
    };
    let Some(staged) = staged else {
        return IDLE;
    };
    let due_in = staged.activates_at_unix_ms - clock.now_ms();
    if due_in > 0 {
        // Woken a little late rather than early (a millisecond early would spin).
        return Duration::from_millis(u64::try_from(due_in).unwrap_or(0) + 1).min(IDLE);
    }
    match admin.activate_issuer_key(&staged.id).await {
        Ok(generation) => {
            tracing::info!(target: "iop_cp", event = "cp_issuer_key_activated", key_id = %staged.id, generation, "staged issuer key activated: leases are signed with it from now on");
        }
        Err(crate::admin::AdminError::Store(crate::store::StoreError::NotFound(_))) => {}
        Err(e) => {
            if let Some(suppressed) = log.hit() {
                tracing::warn!(error = %e, suppressed, key_id = %staged.id, "issuer key activation failed; retrying");
            }
            return RETRY;
        }
    }
    Duration::ZERO
}

/// How long the closing step may spend writing its last frames and the TLS close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Decides a hello the machine found consistent: the mode and certificate checks, then (managed)
/// the current projection from the store. `Some((edge_id, the projection's generation, 0
/// without one))` when accepted.
async fn hello_accepted(
    s: &mut ControlPlaneSession,
    hello: &EdgeHelloRequest,
    identity: Option<&workload_identity::WorkloadId>,
    config: &ServerConfig,
    admin: &Admin,
) -> Option<(String, u64)> {
    if let Err(reason) = check_hello(config, identity, &hello.edge_id, hello.managed) {
        tracing::info!(target: "iop_cp", event = "cp_edge_hello_refused", reason, "edge hello refused");
        s.reject(now(), reason);
        return None;
    }
    let projection = if config.managed {
        // The store's own generation, not the one this process last noticed: a hello gets the
        // newest state, as a fresh read would give (a reconnect storm still reads it once).
        let current = admin.store().generation().await;
        match async { admin.projection(current?).await }.await {
            Ok(p) => Some(PrincipalProjection::clone(&p)),
            Err(_) => {
                s.reject(now(), "store unavailable");
                return None;
            }
        }
    } else {
        None
    };
    // Managed Edges send their principals' usage records (issue #29).
    if config.managed {
        s.accept_usage();
    }
    let generation = projection.as_ref().map_or(0, |p| p.generation);
    if let Err(e) = s.accept(now(), projection) {
        tracing::warn!(target: "iop_cp", event = "cp_edge_hello_refused", edge_id = %hello.edge_id, error = %e, "edge hello refused: the principal projection cannot be sent to it (the error says why)");
        return None;
    }
    Some((hello.edge_id.clone(), generation))
}

/// Makes this connection the one of `edge_id` in the live view (a later connection of the same
/// Edge replaces an earlier one); its serial.
fn register(
    cp: &ControlPlane,
    edge_id: &str,
    requests: &mpsc::Sender<Request>,
    acked: &Arc<AtomicU64>,
) -> u64 {
    let mut shared = lock(&cp.shared);
    shared.next_serial += 1;
    let serial = shared.next_serial;
    let conn = Conn {
        serial,
        requests: requests.clone(),
        acked_generation: acked.clone(),
    };
    if let Some(old) = shared.edges.insert(edge_id.to_owned(), conn) {
        // The old connection's session ends now rather than at its silence limit. A full
        // queue means it is stuck and ends by itself.
        let _ = old.requests.try_send(Request::Replaced);
        tracing::info!(target: "iop_cp", event = "cp_edge_replaced", edge_id = %edge_id, "edge reconnected; previous connection replaced");
    }
    serial
}
