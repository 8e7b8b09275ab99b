//! The Edge side of the runtime wire over mTLS: the driver of [`iop_edge_core::EdgeCore`].
//!
//! ```text
//!  TLS accept ──▶ conn task ──frame──▶ ┌──────── Mutex<EdgeCore> ────────┐ ──push──▶ RunStream /
//!                  ▲  (reads: decode,  │ registry, pool, routes, timers, │          TunnelStream
//!                  │   lock, route)    │ correlation (sans-io)           │          (per-stream
//!                  └──── frames out ◀──┘ ◀── callers (dispatch, drop) ◀──┘           byte buffer)
//!                       (bounded queue)       timer task (poll_timeout)
//! ```
//!
//! All protocol decisions are the machine's (crate `iop-edge-core`: no tokio, no clock, tested
//! in virtual time against the real Node session). This module is glue: the TLS listener and
//! its caps, one I/O task per connection, one timer task, and the [`EdgeHandle`] API. The
//! machine sits behind one `std::sync::Mutex`, locked for the length of one call and the drain
//! of what it produced (frames to queue, events to answer), never across an `.await`, the way
//! quinn drives `quinn-proto`. So a frame of an established stream goes from the connection
//! task that read it straight into its stream's buffer, with no task or channel in between:
//! per streamed delta, one task reads the socket and one (the HTTP response body) reads the
//! buffer.
//!
//! - The TLS handshake requires a CA-signed client certificate with role `node`; the
//!   certificate's name is handed to the registry, which only lets that connection register as
//!   that Node id. No-cert, wrong-CA and wrong-role peers never reach the registry.
//! - Correctness transitions — streams ending when their generation is fenced, command replies
//!   failing — happen in the machine, in the same step as the registry event; the
//!   [`Lifecycle`] broadcast is observation only and may lag or drop without affecting them.
//! - A run stream ends with exactly one terminal: the Node's, or a synthetic `ERROR`
//!   ("node disconnected") when the Node's generation is fenced first. Dropping the
//!   [`RunStream`] (or [`TunnelStream`]) before its terminal sends `CancelRequest` at once.
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
//!   to the Node, as for a disconnect. Nothing ever waits for a reader, so the other streams of
//!   the same Node connection keep flowing.
//! - **Per tunnel, with credit** (Nodes that register with `stream_credit`): the tunnel is
//!   opened with a window of [`TransportConfig::stream_window`] credit bytes (a body's length
//!   plus [`iop_wire::runtime::TUNNEL_FRAME_CREDIT`] per frame), and [`TunnelStream::next`]
//!   gives the credit back (`StreamWindowUpdate`) as its reader consumes the body. The Node
//!   never sends more than the window ahead of the reader and stops reading its provider
//!   meanwhile, so a slow reader slows its own stream instead of filling the byte bound; one
//!   that stops reading is still ended by the slow-consumer timeout. The byte bound stays for
//!   Nodes that do not honour credit (older ones, or a hostile peer).
//! - **Per request**: a run or tunnel request whose frame would be longer than
//!   [`TransportConfig::max_frame_len`] (a body close to the HTTP limit, with the request's
//!   other fields) is refused before it is queued ([`DispatchError::TooLarge`], HTTP 413): the
//!   connection's writer could not send it, and failing there would end every stream of the
//!   Node. Nodes cut their deltas and bodies into frames of at most 64 KiB (1 MiB with credit)
//!   and replace a terminal too large for a frame by an `ERROR`.
//! - **Per connection**: frames to a Node wait in a queue of
//!   [`TransportConfig::outbound_frames`]; a Node that stops reading them (even only its
//!   pongs) fills it and is disconnected ([`FenceCause::NotReading`]); besides that queue the
//!   connection's writer holds at most [`iop_wire::codec::WRITE_BATCH`] bytes and one frame
//!   that the socket did not take yet. Frames from a Node are
//!   read one at a time by its own task, so a Node that sends faster than the Edge routes is
//!   pushed back by TCP, alone.
//! - **Handshakes**: TLS within [`TransportConfig::handshake_timeout`]; register and ready
//!   within [`RegistryConfig::handshake_timeout`] (the registry closes the connection). A
//!   connection being closed gets 2 s to write what was queued before the close (a refusal's
//!   reason); a peer that does not read it is dropped then regardless.
//! - **Connections**: at most [`TransportConfig::max_unauthenticated`] connections in their
//!   TLS handshake: while all are taken nothing more is accepted, and new connections wait in
//!   the kernel's listen backlog (no descriptor, no state; a restarted Edge's reconnect storm
//!   is served at the handshake rate instead of in retry waves). At most
//!   [`TransportConfig::max_unauthenticated_per_ip`] of them per source address; more are
//!   closed at once. Accept errors (e.g. out of file descriptors) back off and are logged at
//!   most once per 10 s with a count. This is `bounded_http::tls::TlsAccept`, the accept loop
//!   every mTLS listener of the workspace shares.

use crate::pool::ContextSize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use iop_edge_core::registry::{ConnId, FenceCause, Generation, Registry, RegistryConfig};
use iop_edge_core::{
    Admit, Admitted, Answer, CoreConfig, EdgeCore, Event, Observer, Open, Opened, Sinks, StreamSink,
};
use iop_wire::codec::{DEFAULT_MAX_FRAME_LEN, FrameCodec, TokioCodec};
use iop_wire::runtime::{
    NodeCommandRequest, NodeCommandResponse, NodeConfigPayload, NodeConfigRefreshResponse,
    ProviderSnapshot, ProviderTunnelRequest, RecipientKey, RunEvent, RunEventKind, RunRequest,
    RuntimeFrame, RuntimeMessage,
};
use iop_wire::tunnel_order::Delivery;
use workload_identity::peer_identity;

pub use iop_edge_core::{DispatchError, Lifecycle, NODE_DISCONNECTED, SLOW_CONSUMER, TunnelEvent};

use crate::metrics::Metrics;
use crate::pool::{Lease, Pool, PoolConfig, RequestId};
use crate::stream_buf::{self, StreamRx, StreamTx};
use bounded_http::tls::{Slot, TlsAccept, TlsLimits, TlsRefusal};
use tokio::net::TcpListener;
use tokio::sync::{Notify, broadcast, mpsc, oneshot};
use tokio_rustls::TlsAcceptor;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

/// Transport settings.
#[derive(Clone)]
pub struct TransportConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Server TLS: the Edge identity and a client verifier requiring role `node` (build it with
    /// `workload_identity::{client_cert_verifier, server_config}`).
    pub tls: Arc<rustls::ServerConfig>,
    /// Heartbeat and default-config settings of the registry.
    pub registry: RegistryConfig,
    /// Config payload per configured Node id.
    pub node_configs: Vec<(String, NodeConfigPayload)>,
    /// Largest frame accepted or sent.
    pub max_frame_len: usize,
    /// The provider pool behind [`EdgeHandle::admit`]; `None` disables pool dispatch.
    pub pool: Option<PoolConfig>,
    /// Counters shared with the HTTP surface.
    pub metrics: Arc<Metrics>,
    /// Limit on a Node connection's TLS handshake.
    pub handshake_timeout: Duration,
    /// Connections in their TLS handshake at once; more wait in the listen backlog (not
    /// accepted until a handshake ends).
    pub max_unauthenticated: usize,
    /// Of which from one source address.
    pub max_unauthenticated_per_ip: usize,
    /// The memory one stream's unread events may hold before it is ended as a slow consumer:
    /// each event counted as what it really holds (its queue slot and heap blocks, not only its
    /// payload), so a stream of one-byte deltas is bounded like one of large bodies.
    pub max_stream_buffer: usize,
    /// How long a stream may hold unread bytes without its reader reading before it is ended
    /// as a slow consumer.
    pub slow_consumer_timeout: Duration,
    /// Frames queued to one Node connection before it counts as not reading.
    pub outbound_frames: usize,
    /// The credit window of a tunnel's body on Nodes that support it (`0`: off; at most half
    /// of [`TransportConfig::max_stream_buffer`] is used). With it, a slow reader slows its
    /// own stream down to its pace instead of being ended when the byte bound fills; a reader
    /// that stops is still ended after [`TransportConfig::slow_consumer_timeout`].
    pub stream_window: usize,
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
            stream_window: iop_edge_core::DEFAULT_STREAM_WINDOW,
        }
    }
}

/// A request to send on an admitted provider: the pool fills in the adapter instance, the
/// target and the winning candidate's stall timeout (seed 000: the final request is built
/// after selection, by the caller, in its own task).
#[derive(Clone, Debug)]
pub enum PoolRequest {
    /// A normalized run (native providers).
    Run(RunRequest),
    /// A provider tunnel (OpenAI-compatible providers).
    Tunnel(ProviderTunnelRequest),
}

/// The stream of a pool dispatch.
#[derive(Debug)]
pub enum Dispatched {
    /// RunEvents.
    Run(RunStream),
    /// Tunnel frames.
    Tunnel(TunnelStream),
}

/// A provider selected and held for one request, to send with [`EdgeHandle::send_admitted`]
/// (after any asynchronous work, e.g. acquiring a credential lease for exactly this Node).
/// Dropping it unsent releases the provider lease.
#[derive(Debug)]
pub struct Admission {
    admitted: Admitted,
    shared: Weak<Shared>,
    armed: bool,
    response_wait: Option<Duration>,
    /// Whether the request waited in the pool's queue for it.
    queued: bool,
}

impl Admission {
    /// Whether the request waited in the pool's queue (no candidate had capacity at once).
    pub fn queued(&self) -> bool {
        self.queued
    }

    /// The selected provider, its Node generation, adapter instance and target.
    pub fn lease(&self) -> &Lease {
        &self.admitted.lease
    }

    /// The lease recipient key the selected Node announced on this generation's registration.
    pub fn recipient(&self) -> Option<&RecipientKey> {
        self.admitted.recipient.as_ref()
    }

    /// A tunnel sent on this admission ends with [`TunnelEvent::WaitTimeout`] (and the Edge
    /// cancels it on the Node) if no frame of the response arrives within `wait`: the pool
    /// path's response wait, as [`EdgeHandle::tunnel_with_wait`] is the direct path's. Runs
    /// are bounded by their own `timeout` instead.
    #[must_use]
    pub fn with_response_wait(mut self, wait: Duration) -> Self {
        self.response_wait = Some(wait);
        self
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.armed
            && let Some(shared) = self.shared.upgrade()
        {
            let id = self.admitted.lease.id;
            shared.with(|core, now| core.release(now, id));
        }
    }
}

/// Ends a stream in the machine when its reader is dropped before the terminal, so that the
/// `CancelRequest` leaves now rather than when the Node's next frame finds no reader.
#[derive(Debug)]
struct DropNotice {
    stream_id: u64,
    shared: Weak<Shared>,
}

impl DropNotice {
    fn notify(&self) {
        if let Some(shared) = self.shared.upgrade() {
            let id = self.stream_id;
            shared.with(|core, now| core.end_stream(now, id, "caller_disconnected"));
        }
    }

    /// Gives `bytes` of the stream's credit back to its Node.
    fn grant(&self, bytes: u64) {
        if let Some(shared) = self.shared.upgrade() {
            let id = self.stream_id;
            shared.with(|core, now| core.grant(now, id, bytes));
        }
    }
}

/// Something that rides on one response stream ([`RunStream::watch`],
/// [`TunnelStream::watch`]) and sees the provider's usage as the caller reads it; it is dropped
/// with the stream, so its `Drop` marks the end of the request (the rate limiter's
/// `crate::limits::Hold` is one). A stream dropped before its terminal drops its watch first
/// and only then tells the Node to cancel: the request is accounted for before the provider's
/// connection closes.
pub trait StreamWatch: Send + Sync + 'static {
    /// The provider reported its usage (a run's terminal, a tunnel's usage frame).
    fn usage(&mut self, usage: &iop_wire::runtime::Usage);

    /// A tunnel's response started with this HTTP status.
    fn status(&mut self, status: u16) {
        let _ = status;
    }

    /// The stream ended with its terminal (a stream dropped before one never calls this).
    fn end(&mut self, end: StreamEnd) {
        let _ = end;
    }

    /// The first piece of the answer's content arrived (a tunnel's first body bytes, a run's
    /// first delta): time to first byte. Called once.
    fn first_data(&mut self) {}

    /// The terminal said how long the provider call took at the Node, in microseconds
    /// ([`iop_wire::runtime::METADATA_PROVIDER_US`]; older Nodes do not say).
    fn provider_time(&mut self, us: u64) {
        let _ = us;
    }

    /// Something happened to the stream that a trace should show: `response_stalled` (the
    /// Node's stall terminal), `node_disconnected` (the Node's generation was fenced),
    /// `slow_consumer_cut`, `wait_timeout`, `ordering_violation`, `cancelled` (the Node
    /// cancelled the run) or `client_cancelled` (the reader went away before the terminal).
    fn event(&mut self, name: &'static str) {
        let _ = name;
    }
}

/// The event name of a terminal that is not the provider's normal end, for
/// [`StreamWatch::event`].
fn tunnel_event_name(ev: &TunnelEvent) -> Option<&'static str> {
    match ev {
        TunnelEvent::Frame(Delivery::Error {
            execution_failure: Some(_),
            ..
        }) => Some("response_stalled"),
        TunnelEvent::NodeDisconnected => Some("node_disconnected"),
        TunnelEvent::SlowConsumer => Some("slow_consumer_cut"),
        TunnelEvent::WaitTimeout => Some("wait_timeout"),
        TunnelEvent::Violation(_) => Some("ordering_violation"),
        _ => None,
    }
}

/// The Node's provider time on a terminal's metadata, if it sent one.
fn provider_us(metadata: &std::collections::BTreeMap<String, String>) -> Option<u64> {
    metadata
        .get(iop_wire::runtime::METADATA_PROVIDER_US)?
        .parse()
        .ok()
}

/// How a stream ended, for a [`StreamWatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamEnd {
    /// The provider's normal end (a run's `Complete`, a tunnel's end frame).
    Completed,
    /// A failure: the provider's error, or the Edge's own terminal (stall, fence, slow
    /// consumer, wait timeout, ordering violation).
    Failed,
    /// The Node cancelled the run.
    Cancelled,
}

/// The watch a stream carries, if any, and whether it saw content yet.
struct Watch(Option<Box<dyn StreamWatch>>, bool);

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Watch(Some)"
        } else {
            "Watch(None)"
        })
    }
}

/// The events of one dispatched run; ends after exactly one terminal event. Dropping it before
/// the terminal sends `CancelRequest` for the run id at once.
#[derive(Debug)]
pub struct RunStream {
    /// The generation the run was dispatched to.
    pub generation: Generation,
    events: StreamRx<RunEvent>,
    /// The first event, read by [`RunStream::unanswered`].
    peeked: Option<RunEvent>,
    done: bool,
    on_drop: DropNotice,
    watch: Watch,
}

/// A stream dropped before its terminal: the watch hears of it and is dropped (the rate
/// limiter's hold settles, the usage record is written) **before** the Node is told to cancel,
/// so by the time the provider's connection closes the request is accounted for.
fn cancel_after_watch(watch: &mut Watch, on_drop: &DropNotice) {
    if let Some(mut w) = watch.0.take() {
        w.event("client_cancelled");
        drop(w);
    }
    on_drop.notify();
}

impl Drop for RunStream {
    fn drop(&mut self) {
        if !self.done {
            cancel_after_watch(&mut self.watch, &self.on_drop);
        }
    }
}

impl RunStream {
    /// Waits for the first event and tells whether the Node refused the run for capacity
    /// ([`iop_wire::runtime::REFUSED_CAPACITY_EXHAUSTED`]: nothing reached the provider, so
    /// it may be sent again); the stream has then ended. Otherwise (`None`) the event stays
    /// first in line for [`RunStream::next`].
    pub async fn unanswered(&mut self) -> Option<Unanswered> {
        if self.done || self.peeked.is_some() {
            return None;
        }
        let ev = self.events.recv().await?;
        if ev.kind == RunEventKind::Error
            && ev.execution_failure.is_none()
            && ev.error == iop_wire::runtime::REFUSED_CAPACITY_EXHAUSTED
        {
            self.done = true;
            if let Some(w) = self.watch.0.as_mut() {
                w.event("capacity_refused");
            }
            return Some(Unanswered::CapacityRefused);
        }
        self.peeked = Some(ev);
        None
    }

    /// The next event; `None` after the terminal.
    pub async fn next(&mut self) -> Option<RunEvent> {
        if self.done {
            return None;
        }
        let ev = match self.peeked.take() {
            Some(ev) => ev,
            None => self.events.recv().await?,
        };
        self.done = ev.kind.is_terminal();
        if let Some(w) = self.watch.0.as_mut() {
            if ev.kind == RunEventKind::Delta && !self.watch.1 {
                self.watch.1 = true;
                w.first_data();
            }
            if let Some(u) = ev.usage.as_ref() {
                w.usage(u);
            }
            if ev.kind.is_terminal()
                && let Some(us) = provider_us(&ev.metadata)
            {
                w.provider_time(us);
            }
            match ev.kind {
                RunEventKind::Complete => w.end(StreamEnd::Completed),
                RunEventKind::Error => {
                    if ev.execution_failure.is_some() {
                        w.event("response_stalled");
                    } else if ev.error == NODE_DISCONNECTED {
                        w.event("node_disconnected");
                    } else if ev.error == SLOW_CONSUMER {
                        w.event("slow_consumer_cut");
                    }
                    w.end(StreamEnd::Failed);
                }
                RunEventKind::Cancelled => {
                    w.event("cancelled");
                    w.end(StreamEnd::Cancelled);
                }
                _ => {}
            }
        }
        Some(ev)
    }

    /// Attaches `watch`: it sees the run's usage and is dropped with the stream.
    pub fn watch(&mut self, watch: Box<dyn StreamWatch>) {
        self.watch = Watch(Some(watch), false);
    }
}

/// The ordered frames of one provider tunnel. Dropping it before the terminal sends
/// `CancelRequest` for the run id at once (the Node aborts the upstream request).
#[derive(Debug)]
pub struct TunnelStream {
    /// The generation the tunnel was opened on.
    pub generation: Generation,
    events: StreamRx<TunnelEvent>,
    /// The first event, read by [`TunnelStream::lost_before_start`].
    peeked: Option<TunnelEvent>,
    done: bool,
    on_drop: DropNotice,
    watch: Watch,
    /// The tunnel's credit window (`0`: none) and the credit bytes read since the last grant.
    credit: (u64, u64),
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        if !self.done {
            cancel_after_watch(&mut self.watch, &self.on_drop);
        }
    }
}

impl TunnelStream {
    fn new(opened: Opened, events: StreamRx<TunnelEvent>, on_drop: DropNotice) -> Self {
        Self {
            generation: opened.generation,
            events,
            peeked: None,
            done: false,
            on_drop,
            watch: Watch(None, false),
            credit: (opened.credit_window, 0),
        }
    }

    /// The next event; `None` after the terminal.
    ///
    /// Reading a body gives its credit back to the Node (on a tunnel opened with a window):
    /// once half the window was read, one `StreamWindowUpdate` returns it, so the Node sends
    /// the body as fast as this reader reads it and never more than the window ahead.
    pub async fn next(&mut self) -> Option<TunnelEvent> {
        if self.done {
            return None;
        }
        let ev = match self.peeked.take() {
            Some(ev) => ev,
            None => self.events.recv().await?,
        };
        self.done = ev.is_terminal();
        if let (TunnelEvent::Frame(Delivery::Body(b)), (window @ 1.., read)) =
            (&ev, &mut self.credit)
        {
            *read += b.len() as u64 + iop_wire::runtime::TUNNEL_FRAME_CREDIT;
            if *read >= *window / 2 {
                self.on_drop.grant(std::mem::take(read));
            }
        }
        if let (Some(w), Some(name)) = (self.watch.0.as_mut(), tunnel_event_name(&ev)) {
            w.event(name);
        }
        if let (
            Some(w),
            TunnelEvent::Frame(Delivery::End { metadata } | Delivery::Error { metadata, .. }),
        ) = (self.watch.0.as_mut(), &ev)
            && let Some(us) = provider_us(metadata)
        {
            w.provider_time(us);
        }
        match (self.watch.0.as_mut(), &ev) {
            (Some(w), TunnelEvent::Frame(Delivery::Body(b))) if !self.watch.1 && !b.is_empty() => {
                self.watch.1 = true;
                w.first_data();
            }
            (Some(w), TunnelEvent::Frame(Delivery::Usage(u))) => w.usage(u),
            (Some(w), TunnelEvent::Frame(Delivery::Start { status, .. })) => w.status(*status),
            (Some(w), TunnelEvent::Frame(Delivery::End { .. })) => w.end(StreamEnd::Completed),
            (Some(w), e) if e.is_terminal() => w.end(StreamEnd::Failed),
            _ => {}
        }
        Some(ev)
    }

    /// Attaches `watch`: it sees the tunnel's usage frames and is dropped with the stream.
    pub fn watch(&mut self, watch: Box<dyn StreamWatch>) {
        self.watch = Watch(Some(watch), false);
    }

    /// Takes the watch back off (to move it to another attempt's stream).
    pub fn unwatch(&mut self) -> Option<Box<dyn StreamWatch>> {
        self.watch.0.take()
    }

    /// Waits for the first event and tells whether the Node's connection ended before it sent
    /// anything (the stream then ended: nothing of the answer exists, so the request may go to
    /// another candidate). Otherwise the event stays first in line for [`TunnelStream::next`].
    /// [`TunnelStream::unanswered`] also tells a capacity refusal.
    pub async fn lost_before_start(&mut self) -> bool {
        self.unanswered().await.is_some()
    }

    /// Waits for the first event and tells whether the Node never took the request: its
    /// connection ended first, or it refused for capacity
    /// ([`iop_wire::runtime::REFUSED_CAPACITY_EXHAUSTED`]: its gate was full, as it can be when
    /// it serves several Edges). The stream has then ended and nothing reached the provider,
    /// so the request may be sent again. Otherwise (`None`) the event stays first in line for
    /// [`TunnelStream::next`].
    pub async fn unanswered(&mut self) -> Option<Unanswered> {
        if self.done || self.peeked.is_some() {
            return None;
        }
        let (why, event) = match self.events.recv().await? {
            TunnelEvent::NodeDisconnected => (Unanswered::NodeDisconnected, "node_disconnected"),
            TunnelEvent::Frame(Delivery::Error {
                error,
                execution_failure: None,
                ..
            }) if error == iop_wire::runtime::REFUSED_CAPACITY_EXHAUSTED => {
                (Unanswered::CapacityRefused, "capacity_refused")
            }
            ev => {
                self.peeked = Some(ev);
                return None;
            }
        };
        self.done = true;
        if let Some(w) = self.watch.0.as_mut() {
            w.event(event);
        }
        Some(why)
    }
}

/// Why a Node never took a tunnel request ([`TunnelStream::unanswered`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unanswered {
    /// Its connection ended before it sent anything.
    NodeDisconnected,
    /// It refused: the adapter's capacity gate was full.
    CapacityRefused,
}

/// The stream buffers of this driver.
#[derive(Debug)]
struct Buffers;

impl Sinks for Buffers {
    type Run = StreamTx<RunEvent>;
    type Tunnel = StreamTx<TunnelEvent>;
}

impl<T> StreamSink<T> for StreamTx<T> {
    fn push(&self, item: T, size: usize) -> Option<iop_edge_core::Level> {
        Self::push(self, item, size)
    }

    fn replace_with(&self, terminal: T) {
        Self::replace_with(self, terminal);
    }

    fn level(&self) -> iop_edge_core::Level {
        Self::level(self)
    }
}

impl Observer for Metrics {
    fn slow_consumer(&self) {
        self.count_slow_consumer();
    }

    fn recovery_eligibility(&self, confirmed: bool) {
        self.count_recovery_eligibility(confirmed);
    }

    fn health_evidence(&self, provider_health: &str) {
        self.count_health_evidence(provider_health);
    }

    fn recovery_result(&self, cleared: bool) {
        self.count_recovery_result(cleared);
    }

    fn health_transition(&self, to_unavailable: bool) {
        self.count_health_transition(to_unavailable);
    }

    fn wait_timeout(&self) {
        self.count_wait_timeout();
    }
}

/// What the Edge tells a connection task: write this frame, or close after what is queued.
///
/// Boxed: tokio's bounded channel allocates its slots in blocks of 32 when the channel is made,
/// and a `RuntimeFrame` is 288 bytes (664 before the managed credential was boxed), so an
/// unboxed queue cost every connection 9 KiB (then 21 KiB, a third of the Edge's memory per
/// idle Node) before it sent anything. One small allocation per frame sent is the price.
type Outbound = Option<Box<RuntimeFrame>>;

/// A connection's writing end.
struct ConnOut {
    frames: mpsc::Sender<Outbound>,
    /// Ends the connection task at once (it may be stuck writing to a peer that does not read).
    kill: CancellationToken,
}

/// A caller waiting for a correlated answer.
enum Reply {
    Command(oneshot::Sender<Result<NodeCommandResponse, DispatchError>>),
    Refresh(oneshot::Sender<Result<NodeConfigRefreshResponse, DispatchError>>),
    Recovered(oneshot::Sender<Result<usize, DispatchError>>),
}

/// The machine and what the driver keeps beside it, under one lock.
struct Inner {
    core: EdgeCore<Buffers>,
    outs: HashMap<ConnId, ConnOut>,
    /// Callers waiting in the pool's queue.
    admits: HashMap<RequestId, oneshot::Sender<Result<Admission, DispatchError>>>,
    /// Callers waiting for a correlated answer, by ticket.
    replies: HashMap<u64, Reply>,
    /// The deadline the timer task sleeps until.
    timer_at: Option<std::time::Instant>,
}

struct Shared {
    inner: Mutex<Inner>,
    /// Wakes the timer task when a timer earlier than the one it sleeps on was armed.
    timer: Arc<Notify>,
    lifecycle: broadcast::Sender<Lifecycle>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shared")
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The timer task holds only a weak reference: let it see that it is done.
        self.timer.notify_one();
    }
}

/// The machine's clock: tokio's (so that tests in paused time drive it too).
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One call into the machine, then the drain of what it produced, under the lock.
    fn with<R>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut EdgeCore<Buffers>, std::time::Instant) -> R,
    ) -> R {
        let mut inner = self.lock();
        let now = now();
        let r = f(&mut inner.core, now);
        self.drain(&mut inner, now);
        r
    }

    /// Hands out the machine's frames and acts on its events until it has none, then re-arms
    /// the timer task if the earliest deadline moved up.
    fn drain(self: &Arc<Self>, inner: &mut Inner, now: std::time::Instant) {
        loop {
            let mut progressed = false;
            while let Some((conn, frame)) = inner.core.poll_transmit() {
                progressed = true;
                let Some(out) = inner.outs.get(&conn) else {
                    continue;
                };
                if let Err(mpsc::error::TrySendError::Full(_)) =
                    out.frames.try_send(Some(Box::new(frame)))
                {
                    // The peer does not read what we send it (even pongs): let it go.
                    tracing::info!(?conn, "node connection not reading its frames; closing");
                    out.kill.cancel();
                    inner.core.close(now, conn, FenceCause::NotReading);
                }
            }
            while let Some(event) = inner.core.poll_event() {
                progressed = true;
                self.event(inner, now, event);
            }
            if !progressed {
                break;
            }
        }
        let next = inner.core.poll_timeout();
        if next.is_some_and(|at| inner.timer_at.is_none_or(|armed| at < armed)) {
            inner.timer_at = next;
            self.timer.notify_one();
        }
    }

    fn event(self: &Arc<Self>, inner: &mut Inner, now: std::time::Instant, event: Event) {
        match event {
            Event::Lifecycle(lifecycle) => {
                let _ = self.lifecycle.send(lifecycle);
            }
            Event::CloseConnection { conn, cause } => {
                self.metrics.node_connection_closed(cause);
                if let Some(out) = inner.outs.remove(&conn) {
                    tracing::info!(?conn, cause = cause.as_str(), "closing node connection");
                    // After the frames already queued (a refusal's reason), unless the queue is
                    // full: then at once. A peer that does not read them cannot hold the
                    // socket open: the writer would wait on it forever, so the close is forced
                    // after CLOSE_GRACE.
                    match tokio::runtime::Handle::try_current() {
                        Ok(rt) if out.frames.try_send(None).is_ok() => {
                            let kill = out.kill;
                            rt.spawn(async move {
                                tokio::time::sleep(CLOSE_GRACE).await;
                                kill.cancel();
                            });
                        }
                        _ => out.kill.cancel(),
                    }
                }
            }
            Event::Admitted { request, result } => {
                let waiter = inner.admits.remove(&request);
                match (result, waiter) {
                    (Ok(admitted), Some(waiter)) => {
                        let admission = Admission {
                            admitted,
                            shared: Arc::downgrade(self),
                            armed: true,
                            response_wait: None,
                            queued: true,
                        };
                        if let Err(Ok(mut admission)) = waiter.send(Ok(admission)) {
                            // The caller went away while queued (we hold the lock: release
                            // here, not in the admission's drop).
                            admission.armed = false;
                            inner.core.release(now, admission.admitted.lease.id);
                        }
                    }
                    (Ok(admitted), None) => inner.core.release(now, admitted.lease.id),
                    (Err(e), Some(waiter)) => {
                        let _ = waiter.send(Err(e));
                    }
                    (Err(_), None) => {}
                }
            }
            Event::Answered { ticket, answer } => match (inner.replies.remove(&ticket), answer) {
                (Some(Reply::Command(tx)), Answer::Command(r)) => {
                    let _ = tx.send(r);
                }
                (Some(Reply::Refresh(tx)), Answer::Refresh(r)) => {
                    let _ = tx.send(r);
                }
                (Some(Reply::Recovered(tx)), Answer::Recovered(r)) => {
                    let _ = tx.send(r);
                }
                _ => {}
            },
        }
    }
}

/// Sleeps until the machine's earliest deadline (or until woken because an earlier one was
/// armed) and runs its timers. Ends when the Edge is dropped.
async fn timer_task(shared: Weak<Shared>, wake: Arc<Notify>) {
    loop {
        let deadline = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let mut inner = shared.lock();
            inner.timer_at = inner.core.poll_timeout();
            inner.timer_at
        };
        tokio::select! {
            () = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
                    None => std::future::pending().await,
                }
            } => {
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                shared.with(EdgeCore::handle_timeout);
            }
            () = wake.notified() => {}
        }
    }
}

/// The embeddable API of a running transport. Cheap to clone.
#[derive(Clone, Debug)]
pub struct EdgeHandle {
    metrics: Arc<Metrics>,
    configured: Arc<Vec<(String, NodeConfigPayload)>>,
    pool_config: Option<Arc<PoolConfig>>,
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    limits: Arc<Handshakes>,
    /// Set when the Edge starts draining ([`EdgeHandle::drain`]).
    draining: Arc<std::sync::atomic::AtomicBool>,
}

impl EdgeHandle {
    /// Starts draining: `/readyz` answers `503 draining` from now on, so a load balancer
    /// stops sending new requests; everything else goes on (requests still arriving are
    /// served). [`crate::Edge::serve`]'s shutdown then stops accepting and finishes the
    /// streams in flight, within [`bounded_http::ServeLimits::drain_timeout`].
    pub fn drain(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether [`EdgeHandle::drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Serves a Node connection accepted elsewhere ([`start_unbound`]), exactly as the
    /// Edge's own listener does: it waits for a handshake slot, applies the per-address cap,
    /// the TLS handshake and its timeout, then runs the session (spawned; this returns once
    /// the connection has its slot or was refused).
    pub async fn serve_connection<S>(&self, stream: S, peer: SocketAddr)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let handler = self.limits.handler(Arc::downgrade(&self.shared));
        self.limits.accept.serve(stream, peer, handler).await;
    }

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
        self.shared.lifecycle.subscribe()
    }

    fn drop_notice(&self, stream_id: u64) -> DropNotice {
        DropNotice {
            stream_id,
            shared: Arc::downgrade(&self.shared),
        }
    }

    /// Dispatches a normalized run to the current ready generation of `node_id`.
    pub async fn run(
        &self,
        node_id: &str,
        request: RunRequest,
    ) -> Result<RunStream, DispatchError> {
        let (sink, events) = stream_buf::channel();
        let opened = self
            .shared
            .with(|core, now| core.open(now, node_id, Open::Run { request, sink }))?;
        Ok(RunStream {
            generation: opened.generation,
            events,
            peeked: None,
            done: false,
            on_drop: self.drop_notice(opened.stream_id),
            watch: Watch(None, false),
        })
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
        let (sink, events) = stream_buf::channel();
        let opened = self.shared.with(|core, now| {
            core.open(
                now,
                node_id,
                Open::Tunnel {
                    request,
                    sink,
                    response_wait,
                },
            )
        })?;
        Ok(TunnelStream::new(
            opened,
            events,
            self.drop_notice(opened.stream_id),
        ))
    }

    /// Dispatches through the provider pool: [`EdgeHandle::admit`], then
    /// [`EdgeHandle::send_admitted`]. The provider lease is released exactly once when the
    /// stream ends (terminal, caller drop, or the Node's fence).
    pub async fn dispatch(
        &self,
        model: &str,
        context: ContextSize,
        wait: Duration,
        request: PoolRequest,
    ) -> Result<Dispatched, DispatchError> {
        let admission = self.admit(model, context, wait).await?;
        self.send_admitted(admission, request).await
    }

    /// Admission through the pool: selects a live candidate of `model` with capacity, or waits
    /// up to `wait` in the bounded queue. The provider lease is held until the [`Admission`] is
    /// sent with [`EdgeHandle::send_admitted`] or dropped.
    pub async fn admit(
        &self,
        model: &str,
        context: ContextSize,
        wait: Duration,
    ) -> Result<Admission, DispatchError> {
        let queued = {
            let mut inner = self.shared.lock();
            let now = now();
            let result = inner.core.admit(now, model, context, wait);
            let queued = match result {
                Ok(Admit::Granted(admitted)) => Ok(Err(admitted)),
                Ok(Admit::Queued(request)) => {
                    let (tx, rx) = oneshot::channel();
                    inner.admits.insert(request, tx);
                    Ok(Ok(rx))
                }
                Err(e) => Err(e),
            };
            self.shared.drain(&mut inner, now);
            queued
        };
        match queued? {
            Err(admitted) => Ok(Admission {
                admitted,
                shared: Arc::downgrade(&self.shared),
                armed: true,
                response_wait: None,
                queued: false,
            }),
            Ok(rx) => rx.await.map_err(|_| DispatchError::Stopped)?,
        }
    }

    /// Sends `request` on an admitted provider. Fails with [`DispatchError::Disconnected`] when
    /// the Node's generation ended meanwhile (its leases were released with the fence).
    pub async fn send_admitted(
        &self,
        mut admission: Admission,
        request: PoolRequest,
    ) -> Result<Dispatched, DispatchError> {
        admission.armed = false;
        let response_wait = admission.response_wait;
        let lease = &admission.admitted.lease;
        match request {
            PoolRequest::Run(request) => {
                let (sink, events) = stream_buf::channel();
                let opened = self.shared.with(|core, now| {
                    core.send_admitted(now, lease, Open::Run { request, sink })
                })?;
                Ok(Dispatched::Run(RunStream {
                    generation: opened.generation,
                    events,
                    peeked: None,
                    done: false,
                    on_drop: self.drop_notice(opened.stream_id),
                    watch: Watch(None, false),
                }))
            }
            PoolRequest::Tunnel(request) => {
                let (sink, events) = stream_buf::channel();
                let opened = self.shared.with(|core, now| {
                    core.send_admitted(
                        now,
                        lease,
                        Open::Tunnel {
                            request,
                            sink,
                            response_wait,
                        },
                    )
                })?;
                Ok(Dispatched::Tunnel(TunnelStream::new(
                    opened,
                    events,
                    self.drop_notice(opened.stream_id),
                )))
            }
        }
    }

    /// CAPABILITIES recovery probe of `node_id`: the Node probes its exact targets; each
    /// runtime-unavailable overlay of the Node's current generation is cleared only by a
    /// higher-sequence `available` answer naming exactly one provider binding. Returns how many
    /// overlays were cleared; anything else in the answer changes nothing.
    pub async fn recover(&self, node_id: &str) -> Result<usize, DispatchError> {
        let (tx, rx) = oneshot::channel();
        self.correlated(Reply::Recovered(tx), |core, now| core.recover(now, node_id))?;
        rx.await.map_err(|_| DispatchError::Stopped)?
    }

    /// The Edge's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// `(queue depth, leases held)` of the pool (zeros without a pool).
    pub fn pool_stats(&self) -> (usize, u64) {
        self.shared.lock().core.pool_stats()
    }

    /// The pool's provider snapshots (empty without a pool).
    pub fn snapshot(&self) -> Vec<ProviderSnapshot> {
        self.shared.lock().core.snapshot()
    }

    /// Asks `node_id` to cancel `run_id` (its terminal then arrives on the run's stream); a
    /// Node that is not ready, or a run it does not have, makes this a no-op.
    pub fn cancel(&self, node_id: &str, run_id: &str, reason: &str) {
        self.shared
            .with(|core, now| core.cancel(now, node_id, run_id, reason));
    }

    /// Sends a command to a ready Node and waits for its answer.
    pub async fn command(
        &self,
        node_id: &str,
        request: NodeCommandRequest,
    ) -> Result<NodeCommandResponse, DispatchError> {
        let (tx, rx) = oneshot::channel();
        self.correlated(Reply::Command(tx), |core, now| {
            core.command(now, node_id, request)
        })?;
        rx.await.map_err(|_| DispatchError::Stopped)?
    }

    /// Pushes a config refresh to a ready Node and waits for its outcome.
    pub async fn refresh(
        &self,
        node_id: &str,
        config: NodeConfigPayload,
    ) -> Result<NodeConfigRefreshResponse, DispatchError> {
        let (tx, rx) = oneshot::channel();
        self.correlated(Reply::Refresh(tx), |core, now| {
            core.refresh(now, node_id, config)
        })?;
        rx.await.map_err(|_| DispatchError::Stopped)?
    }

    /// Everything the status page shows of the machine (Nodes, providers with their overlay
    /// causes and probe answers, the queue, the issuer keys), taken in one locked step.
    pub fn status(&self) -> iop_edge_core::CoreStatus {
        self.shared.lock().core.status(now())
    }

    /// The dispatch-ready Nodes and their generations.
    pub fn ready_nodes(&self) -> Vec<(String, Generation)> {
        self.shared.lock().core.ready_nodes()
    }

    /// Managed mode: the lease issuer keys (the control connector sets them from each
    /// projection). A Node that does not trust the active key is refused at registration, or
    /// no longer selected once registered; one that does not trust the staged key gets a
    /// warning (see `iop_edge_core::EdgeCore::set_issuers`).
    pub fn set_issuers(&self, issuers: iop_edge_core::Issuers) {
        self.shared.with(|core, now| core.set_issuers(now, issuers));
    }

    /// Whether Node `node_id`'s registration of `generation` pins lease issuer key `key_id`
    /// (see `iop_edge_core::EdgeCore::trusts`).
    pub fn node_trusts(&self, node_id: &str, generation: Generation, key_id: &str) -> bool {
        self.shared.lock().core.trusts(node_id, generation, key_id)
    }

    /// What will stop Node `node_id` being selected (it does not trust the staged issuer
    /// key), for the status view.
    pub fn warning(&self, node_id: &str) -> Option<String> {
        self.shared.lock().core.warning(node_id).map(str::to_owned)
    }

    /// Why Node `node_id`'s last registration was refused for a configuration disagreement
    /// (shown in the Control Plane's status view), if it was and it has not been ready since.
    pub fn refused(&self, node_id: &str) -> Option<String> {
        self.shared.lock().core.refused(node_id).map(str::to_owned)
    }

    /// Sends a correlated request and registers `reply` for its ticket, in one locked step (so
    /// an answer cannot arrive before its waiter is known).
    fn correlated(
        &self,
        reply: Reply,
        send: impl FnOnce(&mut EdgeCore<Buffers>, std::time::Instant) -> Result<u64, DispatchError>,
    ) -> Result<(), DispatchError> {
        let mut inner = self.shared.lock();
        let now = now();
        let sent = send(&mut inner.core, now);
        if let Ok(ticket) = sent {
            inner.replies.insert(ticket, reply);
        }
        self.shared.drain(&mut inner, now);
        sent.map(drop)
    }
}

/// The Node listener's backlog: connections beyond the handshake cap wait here (the kernel
/// caps it at `net.core.somaxconn`, 4096 on current Linux), so a whole fleet reconnecting at
/// once is queued rather than dropped into SYN retransmits.
const LISTEN_BACKLOG: u32 = 4096;

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted Edge rebinds while old connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Binds the listener and starts the transport: an accept task (returned; abort it to stop
/// accepting), one task per connection, and the timer task. The machine lives while any
/// [`EdgeHandle`] or connection does.
pub async fn bind(
    config: TransportConfig,
) -> std::io::Result<(EdgeHandle, tokio::task::JoinHandle<()>)> {
    let listener = listen(config.listen)?;
    let local_addr = listener.local_addr()?;
    let handle = start_unbound(TransportConfig {
        listen: local_addr,
        ..config
    });
    let handler = handle.limits.handler(Arc::downgrade(&handle.shared));
    let accept = tokio::spawn(handle.limits.accept.clone().run(
        listener,
        std::future::pending(),
        move |tls, peer, slot| handler.clone()(tls, peer, slot),
    ));
    Ok((handle, accept))
}

/// Starts the transport without a listener: Node connections accepted elsewhere (another kind
/// of listener, socket activation, a simulated network) are handed to
/// [`EdgeHandle::serve_connection`]. [`EdgeHandle::local_addr`] is `config.listen`.
pub fn start_unbound(config: TransportConfig) -> EdgeHandle {
    let local_addr = config.listen;
    let mut registry_config = config.registry.clone();
    // What the registry lets through, this connection's writer must be able to encode.
    registry_config.max_frame_len = registry_config.max_frame_len.min(config.max_frame_len);
    let mut registry = Registry::new(registry_config);
    for (node_id, payload) in &config.node_configs {
        registry.set_node_config(node_id, Some(payload.clone()));
    }
    let shared = start(
        registry,
        config.pool.clone().map(Pool::new),
        CoreConfig {
            max_stream_buffer: config.max_stream_buffer,
            slow_consumer_timeout: config.slow_consumer_timeout,
            stream_window: config.stream_window,
        },
        config.metrics.clone(),
    );
    EdgeHandle {
        metrics: config.metrics.clone(),
        configured: Arc::new(config.node_configs.clone()),
        pool_config: config.pool.clone().map(Arc::new),
        shared,
        local_addr,
        limits: Arc::new(Handshakes::new(&config)),
        draining: Arc::default(),
    }
}

/// The machine, its lock and its timer task.
fn start(
    registry: Registry,
    pool: Option<Pool>,
    core_config: CoreConfig,
    metrics: Arc<Metrics>,
) -> Arc<Shared> {
    let core = EdgeCore::new(registry, pool, core_config, metrics.clone());
    let (lifecycle, _) = broadcast::channel(1024);
    let wake = Arc::new(Notify::new());
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner {
            core,
            outs: HashMap::new(),
            admits: HashMap::new(),
            replies: HashMap::new(),
            timer_at: None,
        }),
        timer: wake.clone(),
        lifecycle,
        metrics,
    });
    tokio::spawn(timer_task(Arc::downgrade(&shared), wake));
    shared
}

/// The Node listener: the workspace's one bounded TLS accept loop (`bounded_http::tls`) with
/// the Edge's limits, and what every authenticated connection needs.
#[derive(Debug)]
struct Handshakes {
    accept: Arc<TlsAccept>,
    codec: FrameCodec,
    outbound_frames: usize,
}

/// Node-listener refusals and accept errors into the Edge's metrics.
struct NodeListenerEvents(Arc<Metrics>);

impl bounded_http::tls::TlsEvents for NodeListenerEvents {
    fn accept_error(&self) {
        self.0.accept_error();
    }

    fn refused(&self, reason: TlsRefusal) {
        use crate::metrics::Refusal;
        self.0.node_connection_refused(match reason {
            TlsRefusal::PerIp => Refusal::PerIp,
            TlsRefusal::HandshakeTimeout => Refusal::HandshakeTimeout,
            TlsRefusal::HandshakeFailed => Refusal::HandshakeFailed,
            _ => Refusal::Capacity,
        });
    }
}

impl Handshakes {
    fn new(config: &TransportConfig) -> Self {
        let limits = TlsLimits {
            max_handshakes: config.max_unauthenticated,
            max_handshakes_per_ip: config.max_unauthenticated_per_ip,
            handshake_timeout: config.handshake_timeout,
        };
        Self {
            accept: TlsAccept::new(
                TlsAcceptor::from(config.tls.clone()),
                limits,
                Some(Arc::new(NodeListenerEvents(config.metrics.clone()))),
                "node",
            ),
            codec: FrameCodec::with_max_frame_len(config.max_frame_len),
            outbound_frames: config.outbound_frames.max(1),
        }
    }

    /// What runs on an authenticated connection: the slot is freed (registration has its own
    /// deadline, the registry's), the peer's identity read, and the session spawned as a task
    /// of its own.
    ///
    /// Its own task, not the rest of the handshake's: a task's allocation is its largest
    /// state, and the handshake's (rustls mid-handshake, the timeout) would stay allocated
    /// beside every idle Node's session for as long as it is connected. The TLS stream is
    /// boxed for the same reason: an `async fn`'s arguments keep their own room in its future
    /// after they are moved (rust-lang/rust#62958), so a 1.2 KiB stream passed by value was
    /// held twice.
    fn handler<S>(
        &self,
        shared: Weak<Shared>,
    ) -> impl FnOnce(tokio_rustls::server::TlsStream<S>, SocketAddr, Slot) -> std::future::Ready<()>
    + Clone
    + Send
    + Sync
    + 'static
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (codec, outbound_frames) = (self.codec, self.outbound_frames);
        move |tls, _peer, slot| {
            drop(slot);
            if let Some(shared) = shared.upgrade()
                && let Ok(peer) = peer_identity(tls.get_ref().1)
            {
                let peer = peer.name().to_owned();
                tokio::spawn(connection(
                    Box::new(tls),
                    peer,
                    codec,
                    outbound_frames,
                    shared,
                ));
            }
            std::future::ready(())
        }
    }
}

/// The read buffer a connection starts with (and its write buffer). It grows (doubling) to the
/// largest frame the peer sends; most Nodes mostly send heartbeats, and tokio-util's default of
/// 8 KiB, grown on a full TLS read, was about 14 KiB of every idle Node's footprint at the Edge.
/// Frames are still written in batches of up to a TLS record (`iop_wire::codec::framed`).
const READ_BUFFER: usize = 1024;

/// One connection's I/O: frames in to the machine (routed in this task), frames out from it.
/// The stream comes boxed: see [`Handshakes::handler`].
async fn connection<S>(
    stream: Box<S>,
    peer: String,
    codec: FrameCodec,
    outbound_frames: usize,
    shared: Arc<Shared>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (frames, mut out_rx) = mpsc::channel::<Outbound>(outbound_frames);
    let kill = CancellationToken::new();
    let conn = {
        let mut inner = shared.lock();
        let now = now();
        let conn = inner.core.accept(now, &peer);
        inner.outs.insert(
            conn,
            ConnOut {
                frames,
                kill: kill.clone(),
            },
        );
        shared.drain(&mut inner, now);
        conn
    };
    let mut framed = iop_wire::codec::framed::<_, RuntimeFrame>(stream, codec, READ_BUFFER);
    let io = async {
        loop {
            tokio::select! {
                out = out_rx.recv() => match out {
                    Some(Some(frame)) => {
                        if feed(&mut framed, frame).await.is_err() {
                            break;
                        }
                        // Write everything already queued before flushing once.
                        let mut closed = false;
                        while let Ok(more) = out_rx.try_recv() {
                            match more {
                                Some(frame) => {
                                    if feed(&mut framed, frame).await.is_err() {
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
                        let liveness = matches!(
                            frame.message,
                            RuntimeMessage::Ping | RuntimeMessage::Pong
                        );
                        // Routed in this task: an established stream's frame goes straight to
                        // its buffer. This socket is not read meanwhile; TCP pushes back on
                        // this Node alone.
                        shared.with(|core, now| core.handle_frame(now, conn, frame));
                        if liveness {
                            iop_wire::codec::release_buffers(&mut framed, READ_BUFFER);
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
        // The machine gave up on this peer (e.g. it does not read): drop the socket now,
        // even mid-write.
        () = kill.cancelled() => {}
    }
    let mut inner = shared.lock();
    let now = now();
    inner.outs.remove(&conn);
    inner.core.handle_close(now, conn);
    shared.drain(&mut inner, now);
}

/// Queues `frame` for writing: [`SinkExt::feed`] without holding the frame itself in the
/// future, so the connection's task (one per Node, alive while it is connected) stays small.
async fn feed<S>(
    framed: &mut Framed<S, TokioCodec<RuntimeFrame>>,
    frame: Box<RuntimeFrame>,
) -> Result<(), iop_wire::codec::CodecError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::Sink as _;
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *framed).poll_ready(cx)).await?;
    let sent = std::pin::Pin::new(framed).start_send(*frame);
    if let Err(iop_wire::codec::CodecError::Frame(e)) = &sent {
        // Requests over the limit are refused before they are queued (`RegistryConfig::
        // max_frame_len`); what remains is the Edge's own handshake answer (a Node config too
        // large for the wire), which the Node could not act on: the connection closes.
        tracing::error!(error = %e, "a frame to the Node could not be written; closing");
    }
    sent
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

#[cfg(test)]
mod tests {
    use super::*;
    use iop_wire::runtime::RuntimeMessage;
    use tokio::io::AsyncWriteExt as _;

    /// One task per connected Node lives as long as it is connected: its future is what
    /// every idle Node costs the Edge beside its buffers and TLS state. The stream is boxed
    /// (an `async fn`'s arguments keep their room after they are moved) and frames are not
    /// held across a write: 744 bytes in a debug build, against 3456 before.
    #[test]
    fn a_connections_future_stays_small() {
        fn future_size<A, F: Future>(
            _: fn(A, String, FrameCodec, usize, Arc<Shared>) -> F,
        ) -> usize {
            size_of::<F>()
        }
        type Tls = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
        let size = future_size(connection::<Tls>);
        assert!(size <= 900, "a connection's future is {size} bytes");
    }

    /// A peer that floods pings and then neither reads nor writes leaves the connection's
    /// writer blocked on it. The registry's register timeout must still drop the socket (after
    /// `CLOSE_GRACE`), not wait behind the queued pongs forever. Virtual time.
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_reads_nothing_is_dropped_after_the_register_timeout() {
        let registry = Registry::new(RegistryConfig {
            handshake_timeout: Duration::from_secs(10),
            ..RegistryConfig::default()
        });
        let shared = start(
            registry,
            None,
            CoreConfig::default(),
            Arc::new(Metrics::default()),
        );
        // A small pipe: a few pongs fill it, and the Edge's writer waits on the peer.
        let (edge_side, mut peer) = tokio::io::duplex(256);
        let codec = FrameCodec::new();
        let task = tokio::spawn(connection(
            Box::new(edge_side),
            "node-1".into(),
            codec,
            1024,
            shared.clone(),
        ));
        let mut ping = bytes::BytesMut::new();
        codec
            .encode(&RuntimeFrame::new(RuntimeMessage::Ping), &mut ping)
            .unwrap();
        let start = tokio::time::Instant::now();
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
        drop(shared);
    }
}
