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
//!    connection of the same `edge_id` replaces the earlier one.
//! 4. Then: every durable mutation pushes `PrincipalProjectionApplyRequest` (managed); the
//!    Edge's `AcquireLeaseRequest`s go to the [`LeaseService`] (managed only: in legacy mode
//!    they are refused and nothing is read from the store); status and command requests from
//!    [`ControlPlane`] are correlated with their answers; `EdgeNodeEvent`s are published on
//!    [`ControlPlane::events`]; pings are answered. Silence longer than three heartbeat
//!    intervals closes the connection.
//!
//! The Control Plane never dials a Node or an Edge.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use iop_wire::codec::{FrameCodec, TokioCodec};
use iop_wire::control::{
    AcquireLeaseResponse, ControlFrame, ControlMessage, EdgeCommandEvent, EdgeCommandRequest,
    EdgeCommandResponse, EdgeHelloResponse, EdgeNodeEvent, EdgeStatusResponse,
};
use iop_wire::identity::{peer_identity, role};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_rustls::TlsAcceptor;
use tokio_util::codec::Framed;

use crate::admin::Admin;
use crate::lease::LeaseService;
use crate::projection;

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
    /// Largest frame accepted or sent.
    pub max_frame_len: usize,
    /// How often the store's generation is read, so that mutations made elsewhere (the CLI on
    /// the same SQLite file, another replica on PostgreSQL) are pushed to Edges too.
    pub store_poll: Duration,
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
    /// Projection generation the Edge last acknowledged (managed).
    pub projection_generation: u64,
}

enum Pending {
    Status(oneshot::Sender<EdgeStatusResponse>),
    Command {
        command_id: String,
        events: Vec<EdgeCommandEvent>,
        reply: oneshot::Sender<(EdgeCommandResponse, Vec<EdgeCommandEvent>)>,
    },
}

struct Conn {
    /// Distinguishes a replaced connection from its successor.
    serial: u64,
    out: mpsc::Sender<ControlFrame>,
    pending: Arc<Mutex<HashMap<u64, Pending>>>,
    acked_generation: Arc<Mutex<u64>>,
}

#[derive(Default)]
struct Shared {
    edges: HashMap<String, Conn>,
    next_serial: u64,
    next_correlation: u64,
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
                projection_generation: *lock(&c.acked_generation),
            })
            .collect();
        v.sort_by(|a, b| a.edge_id.cmp(&b.edge_id));
        v
    }

    /// `(edge_id, event)` for every `EdgeNodeEvent` relayed by any Edge.
    pub fn events(&self) -> broadcast::Receiver<(String, EdgeNodeEvent)> {
        self.events.subscribe()
    }

    fn request(
        &self,
        edge_id: &str,
        make: impl FnOnce(u64) -> (ControlFrame, Pending),
    ) -> Result<(), RequestError> {
        let mut shared = lock(&self.shared);
        shared.next_correlation += 1;
        let id = shared.next_correlation;
        let conn = shared
            .edges
            .get(edge_id)
            .ok_or(RequestError::NotConnected)?;
        let (frame, pending) = make(id);
        lock(&conn.pending).insert(id, pending);
        // Never waits: a full queue means the Edge is not reading (its session ends soon).
        conn.out
            .try_send(frame)
            .map_err(|_| RequestError::Disconnected)
    }

    /// Asks an Edge for its Node snapshot view.
    pub async fn status(&self, edge_id: &str) -> Result<EdgeStatusResponse, RequestError> {
        let (tx, rx) = oneshot::channel();
        self.request(edge_id, |id| {
            (
                ControlFrame::correlated(id, ControlMessage::EdgeStatusRequest),
                Pending::Status(tx),
            )
        })?;
        match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) => Err(RequestError::Disconnected),
            Err(_) => Err(RequestError::Timeout),
        }
    }

    /// Sends a command to an Edge; returns its response and the phase events it reported
    /// before the response.
    pub async fn command(
        &self,
        edge_id: &str,
        request: EdgeCommandRequest,
    ) -> Result<(EdgeCommandResponse, Vec<EdgeCommandEvent>), RequestError> {
        let (tx, rx) = oneshot::channel();
        let command_id = request.command_id.clone();
        self.request(edge_id, |id| {
            (
                ControlFrame::correlated(id, ControlMessage::EdgeCommandRequest(request)),
                Pending::Command {
                    command_id,
                    events: Vec::new(),
                    reply: tx,
                },
            )
        })?;
        match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) => Err(RequestError::Disconnected),
            Err(_) => Err(RequestError::Timeout),
        }
    }
}

/// Binds the listener and serves Edges until the returned task is aborted.
pub async fn serve(
    config: ServerConfig,
    admin: Admin,
    leases: Option<Arc<LeaseService>>,
) -> std::io::Result<(ControlPlane, tokio::task::JoinHandle<()>)> {
    if config.managed && leases.is_none() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "managed mode needs a lease service",
        ));
    }
    let listener = TcpListener::bind(config.listen).await?;
    let local_addr = listener.local_addr()?;
    let cp = ControlPlane {
        shared: Arc::default(),
        stop: tokio_util::sync::CancellationToken::new(),
        events: broadcast::channel(1024).0,
        local_addr,
    };
    let acceptor = TlsAcceptor::from(config.tls.clone());
    let task_cp = cp.clone();
    let poll_admin = admin.clone();
    let poll_every = config.store_poll;
    let poller = tokio::spawn(async move {
        let mut tick = tokio::time::interval(poll_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match poll_admin.store().generation().await {
                Ok(g) => poll_admin.observe(g),
                Err(e) => tracing::warn!(error = %e, "store generation poll failed"),
            }
        }
    });
    let task = tokio::spawn(async move {
        let _poller = AbortOnDrop(poller);
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let mut log = RateLimited::default();
        let refusals = Arc::new(Mutex::new(RateLimited::default()));
        loop {
            let accepted = tokio::select! {
                () = task_cp.stop.cancelled() => return,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    if log.hit() {
                        tracing::warn!(error = %e, "control plane accept failed; backing off");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(slot) = handshakes.clone().try_acquire_owned() else {
                drop(tcp);
                if log.hit() {
                    tracing::warn!(%peer, "too many edge handshakes in progress; closing new connections");
                }
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, cp, admin, leases, config, refusals) = (
                acceptor.clone(),
                task_cp.clone(),
                admin.clone(),
                leases.clone(),
                config.clone(),
                refusals.clone(),
            );
            tokio::spawn(async move {
                let tls = match tokio::time::timeout(HELLO_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        if lock(&refusals).hit() {
                            tracing::info!(%peer, error = %e, "edge TLS handshake refused (logged at most once per 10 s)");
                        }
                        return;
                    }
                    Err(_) => return,
                };
                let identity = peer_identity(tls.get_ref().1).ok();
                connection(tls, identity, cp, admin, leases, config, slot).await;
            });
        }
    });
    Ok((cp, task))
}

/// At most one log line per 10 s for a repeated failure.
#[derive(Default)]
struct RateLimited(Option<std::time::Instant>);

impl RateLimited {
    fn hit(&mut self) -> bool {
        let now = std::time::Instant::now();
        let due = self
            .0
            .is_none_or(|last| now.duration_since(last) >= Duration::from_secs(10));
        if due {
            self.0 = Some(now);
        }
        due
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
    identity: Option<&iop_wire::identity::WorkloadId>,
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

async fn connection<S>(
    stream: S,
    identity: Option<iop_wire::identity::WorkloadId>,
    cp: ControlPlane,
    admin: Admin,
    leases: Option<Arc<LeaseService>>,
    config: ServerConfig,
    handshake_slot: tokio::sync::OwnedSemaphorePermit,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let codec = FrameCodec::with_max_frame_len(config.max_frame_len);
    let mut framed = Framed::new(stream, TokioCodec::<ControlFrame>::new(codec));
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, framed.next()).await {
        Ok(Some(Ok(ControlFrame {
            message: ControlMessage::EdgeHelloRequest(h),
            correlation_id,
        }))) => (h, correlation_id),
        _ => return,
    };
    let (hello, correlation) = hello;
    if let Err(reason) = check_hello(&config, identity.as_ref(), &hello.edge_id, hello.managed) {
        tracing::info!(target: "iop_cp", event = "cp_edge_hello_refused", reason, "edge hello refused");
        let refuse = EdgeHelloResponse::Rejected {
            reason: reason.to_owned(),
        };
        let _ = framed
            .send(ControlFrame::correlated(
                correlation,
                ControlMessage::EdgeHelloResponse(refuse),
            ))
            .await;
        return;
    }
    let mut generations = admin.subscribe();
    let projection = if config.managed {
        match admin.store().snapshot().await {
            Ok(s) => Some(projection::build(&s)),
            Err(_) => {
                let refuse = EdgeHelloResponse::Rejected {
                    reason: "store unavailable".into(),
                };
                let _ = framed
                    .send(ControlFrame::correlated(
                        correlation,
                        ControlMessage::EdgeHelloResponse(refuse),
                    ))
                    .await;
                return;
            }
        }
    } else {
        None
    };
    let mut sent_generation = projection.as_ref().map_or(0, |p| p.generation);
    generations.mark_unchanged();
    let accepted = EdgeHelloResponse::Accepted {
        projection,
        heartbeat_interval_ms: u32::try_from(config.heartbeat.as_millis()).ok(),
    };
    if framed
        .send(ControlFrame::correlated(
            correlation,
            ControlMessage::EdgeHelloResponse(accepted),
        ))
        .await
        .is_err()
    {
        return;
    }

    // Hello accepted: no longer a handshake in progress.
    drop(handshake_slot);
    let edge_id = hello.edge_id.clone();
    let (out_tx, mut out_rx) = mpsc::channel::<ControlFrame>(OUTBOUND_FRAMES);
    let lease_slots = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_LEASES));
    let pending: Arc<Mutex<HashMap<u64, Pending>>> = Arc::default();
    let acked = Arc::new(Mutex::new(0u64));
    let serial = {
        let mut shared = lock(&cp.shared);
        shared.next_serial += 1;
        let serial = shared.next_serial;
        let conn = Conn {
            serial,
            out: out_tx.clone(),
            pending: pending.clone(),
            acked_generation: acked.clone(),
        };
        if shared.edges.insert(edge_id.clone(), conn).is_some() {
            tracing::info!(target: "iop_cp", event = "cp_edge_replaced", edge_id = %edge_id, "edge reconnected; previous connection replaced");
        }
        serial
    };
    tracing::info!(target: "iop_cp", event = "cp_edge_connected", edge_id = %edge_id, managed = config.managed, "edge connected");

    let idle = config.heartbeat * 3;
    let mut generations_open = config.managed;
    loop {
        tokio::select! {
            () = cp.stop.cancelled() => break,
            frame = tokio::time::timeout(idle, framed.next()) => {
                let frame = match frame {
                    Ok(Some(Ok(f))) => f,
                    Ok(Some(Err(iop_wire::codec::CodecError::Io(e)))) => {
                        // A killed process or a socket closed without TLS close_notify.
                        tracing::info!(edge_id = %edge_id, error = %e, "edge connection closed");
                        break;
                    }
                    Ok(Some(Err(e))) => {
                        tracing::info!(edge_id = %edge_id, error = %e, "edge sent an invalid frame");
                        break;
                    }
                    Ok(None) => break,
                    Err(_) => {
                        tracing::info!(edge_id = %edge_id, "edge silent for three heartbeats");
                        break;
                    }
                };
                // A lease request waits for a slot first: an Edge's flood of them is read no
                // faster than the store serves it.
                let permit = match &frame.message {
                    ControlMessage::AcquireLeaseRequest(_) => {
                        lease_slots.clone().acquire_owned().await.ok()
                    }
                    _ => None,
                };
                if !inbound(frame, &edge_id, &cp, &pending, &acked, leases.as_ref(), &out_tx, permit) {
                    tracing::info!(edge_id = %edge_id, "closing the edge connection (protocol violation, or it does not read its answers)");
                    break;
                }
            }
            Some(frame) = out_rx.recv() => {
                if !matches!(tokio::time::timeout(idle, framed.send(frame)).await, Ok(Ok(()))) {
                    tracing::info!(edge_id = %edge_id, "edge not reading; closing");
                    break;
                }
            }
            changed = generations.changed(), if generations_open => {
                if changed.is_err() {
                    generations_open = false;
                    continue;
                }
                let latest = *generations.borrow_and_update();
                if latest <= sent_generation {
                    continue;
                }
                match admin.store().snapshot().await {
                    Ok(s) => {
                        let p = projection::build(&s);
                        sent_generation = p.generation;
                        let frame = ControlFrame::new(ControlMessage::PrincipalProjectionApplyRequest(p));
                        if !matches!(tokio::time::timeout(idle, framed.send(frame)).await, Ok(Ok(()))) {
                            break;
                        }
                    }
                    Err(e) => tracing::warn!(edge_id = %edge_id, error = %e, "projection snapshot failed"),
                }
            }
        }
    }
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

/// Handles one frame from an Edge; `false` closes the connection (protocol violation, or an
/// Edge that does not read its answers). `permit` is a lease request's slot.
#[expect(
    clippy::too_many_arguments,
    reason = "the connection's parts, passed from its one loop"
)]
fn inbound(
    frame: ControlFrame,
    edge_id: &str,
    cp: &ControlPlane,
    pending: &Mutex<HashMap<u64, Pending>>,
    acked: &Mutex<u64>,
    leases: Option<&Arc<LeaseService>>,
    out: &mpsc::Sender<ControlFrame>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> bool {
    let id = frame.correlation_id;
    match frame.message {
        ControlMessage::EdgeStatusResponse(r) => {
            if let Some(Pending::Status(tx)) = lock(pending).remove(&id) {
                let _ = tx.send(r);
            }
        }
        ControlMessage::EdgeCommandEvent(ev) => {
            let mut pending = lock(pending);
            if let Some(Pending::Command {
                command_id, events, ..
            }) = pending.get_mut(&id)
                && *command_id == ev.command_id
                && events.len() < 256
            {
                events.push(ev);
            }
        }
        ControlMessage::EdgeCommandResponse(r) => {
            if let Some(Pending::Command { events, reply, .. }) = lock(pending).remove(&id) {
                let _ = reply.send((r, events));
            }
        }
        ControlMessage::EdgeNodeEvent(ev) => {
            tracing::info!(target: "iop_cp", event = "cp_edge_node_event", edge_id, kind = ev.kind.as_str(), node_id = %ev.node_id, "node lifecycle event");
            let _ = cp.events.send((edge_id.to_owned(), ev));
        }
        ControlMessage::PrincipalProjectionApplyResponse(r) => {
            if r.accepted {
                let mut g = lock(acked);
                *g = (*g).max(r.generation);
            } else {
                tracing::info!(target: "iop_cp", event = "cp_projection_refused", edge_id, generation = r.generation, reason = %r.reason, "edge refused a projection");
            }
        }
        ControlMessage::AcquireLeaseRequest(req) => {
            let Some(leases) = leases.cloned() else {
                // Legacy mode: no lease traffic; nothing is read from the store.
                let refuse = AcquireLeaseResponse::Refused {
                    reason: "credential_plane_disabled".into(),
                };
                return out
                    .try_send(ControlFrame::correlated(
                        id,
                        ControlMessage::AcquireLeaseResponse(refuse),
                    ))
                    .is_ok();
            };
            let out = out.clone();
            let edge_id = edge_id.to_owned();
            tokio::spawn(async move {
                let now = crate::store::unix_ms();
                let answer = match leases.acquire(&req, now).await {
                    Ok(lease) => AcquireLeaseResponse::Granted(lease),
                    Err(refusal) => {
                        tracing::info!(target: "iop_cp", event = "cp_lease_refused", edge_id = %edge_id, reason = refusal.as_str(), "lease refused");
                        AcquireLeaseResponse::Refused {
                            reason: refusal.as_str().to_owned(),
                        }
                    }
                };
                let _ = out.try_send(ControlFrame::correlated(
                    id,
                    ControlMessage::AcquireLeaseResponse(answer),
                ));
                drop(permit);
            });
        }
        ControlMessage::Ping => {
            return out
                .try_send(ControlFrame::correlated(id, ControlMessage::Pong))
                .is_ok();
        }
        ControlMessage::Pong => {}
        _ => return false,
    }
    true
}
