//! [`EdgeCore`]: the Edge's protocol machine, split by concern.
//!
//! - this module: the machine's state, its connection input (`accept`, `handle_frame`,
//!   `handle_close`, `handle_timeout`) and output (`poll_*`), and how registry events (ready,
//!   fence, refusal) are applied in the same step as the pool;
//! - `types`: what a driver sees (events, errors, stream sinks, settings);
//! - `streams`: routes and timers: opening runs and tunnels, admission through the pool,
//!   routing by transport identity, response-wait and slow-consumer timers, cancels;
//! - `correlation`: commands, config refreshes and recovery probes paired with their answers;
//! - `issuers`: the lease issuer keys, trust (one rule: `registry::pins_trust`) and warnings;
//! - `handoff`: the Edge terminal handoff of stalled runs and tunnels, and recovery results.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::registry::{
    ConnId, FenceCause, Generation, Registry, RegistryEvent, SendError, pins_trust,
};
use iop_wire::runtime::{
    CancelRequest, FailureEvidence, HealthEvidence, NodeCommandKind, NodeCommandRequest,
    NodeCommandResponse, NodeConfigPayload, ProviderSnapshot, ProviderStatus, RecipientKey,
    RunEvent, RunEventKind, RuntimeFrame, RuntimeMessage,
};
use iop_wire::tunnel_order::{Delivery, TunnelError, TunnelSequencer};
use iop_wire::validate::ResponseStallTimeout;

mod correlation;
mod handoff;
mod issuers;
mod streams;
mod types;

pub use types::*;

use crate::pool::{Lease, LeaseId, Pool, PoolError, PoolEvent, ProviderKey, Submitted};

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
    /// The tunnel was opened with a credit window: its reader's grants go to the Node.
    credit: bool,
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
            credit: self.credit,
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

/// What one buffered event really holds, counted against the stream's byte bound (the
/// `stream_buffer_bytes` of the Edge's config): its slot in the stream's queue, counted twice
/// (a growing `VecDeque` doubles, so up to half its slots are empty), plus every heap block it
/// owns, rounded up to 16 bytes and with 16 bytes of allocator header. A run stream of one-byte
/// deltas once cost 5–6× its bound when only the payload plus 64 bytes was counted.
pub(crate) fn run_event_size(ev: &RunEvent) -> usize {
    queue_slot::<RunEvent>()
        + heap(ev.delta.capacity())
        + heap(ev.error.capacity())
        + metadata_size(&ev.metadata)
}

/// [`run_event_size`] for a tunnel event. A body's bytes are counted by length: they are a
/// view of the frame that carried them.
pub(crate) fn tunnel_event_size(ev: &TunnelEvent) -> usize {
    queue_slot::<TunnelEvent>()
        + match ev {
            TunnelEvent::Frame(Delivery::Body(b)) => heap(b.len()),
            TunnelEvent::Frame(Delivery::Start { headers, .. }) => {
                heap(headers.capacity() * size_of::<iop_wire::runtime::Header>())
                    + headers
                        .iter()
                        .map(|h| heap(h.name.capacity()) + heap(h.value.len()))
                        .sum::<usize>()
            }
            TunnelEvent::Frame(Delivery::Error {
                error, metadata, ..
            }) => heap(error.capacity()) + metadata_size(metadata),
            _ => 0,
        }
}

/// A queue slot of `T` with its byte count, twice (see [`run_event_size`]).
const fn queue_slot<T>() -> usize {
    2 * size_of::<(T, usize)>()
}

/// A heap block of `capacity` bytes as the allocator holds it.
const fn heap(capacity: usize) -> usize {
    if capacity == 0 {
        0
    } else {
        capacity.next_multiple_of(16) + 16
    }
}

/// A `BTreeMap<String, String>`: each entry's two strings and its share of a B-tree node
/// (a node of up to 11 entries is about 560 bytes).
fn metadata_size(m: &BTreeMap<String, String>) -> usize {
    m.iter()
        .map(|(k, v)| 64 + heap(k.capacity()) + heap(v.capacity()))
        .sum()
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
    /// The software version it announced (diagnostic, bounded by the registry).
    version: String,
    /// It honours per-stream credit on tunnel bodies.
    stream_credit: bool,
}

/// What the status view keeps of a provider's health besides the pool's overlay flag: why and
/// since when the overlay was set, and the last recovery probe answer. One per configured
/// provider at most (keys come from leases and bindings).
#[derive(Clone, Debug, Default)]
struct HealthLog {
    /// The overlay's generation, when it was set, the silence that set it, and the fence.
    overlay: Option<(Generation, Instant, Duration, iop_wire::runtime::Fence)>,
    /// When the last probe answer was applied, its status, freshness and whether it cleared.
    probe: Option<(Instant, &'static str, bool, bool)>,
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
    /// Why each overlay was set and the last probe answers, for the status view.
    health: BTreeMap<ProviderKey, HealthLog>,
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
    /// Streams holding unread bytes, by the time to look again; per stream that time, the read
    /// count seen at the last look, and since when no read was seen.
    slow_timers: BTreeSet<(Instant, u64)>,
    slow: BTreeMap<u64, (Instant, u64, Instant)>,
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
            health: self.health.clone(),
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

/// [`EdgeCore::state`]: every field but the sinks' contents, the observer and the status
/// view's health log. The fields are
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
            // What the status view shows of overlays and probes: observation only (no rule
            // reads it), and its times would split otherwise equal states.
            health: _,
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
    /// The machine's whole state in `Debug` form (every field but what its sinks hold, the
    /// observer, and the overlay causes and probe answers kept for [`EdgeCore::status`]). Its maps are ordered, so equal states print equally whatever history built
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
            health: BTreeMap::new(),
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

    /// The streams being routed.
    pub fn stream_count(&self) -> usize {
        self.routes.len()
    }

    /// Everything an operator's status view shows, taken in one step at `now` (see
    /// [`CoreStatus`]).
    pub fn status(&self, now: Instant) -> CoreStatus {
        let providers = self.snapshot();
        let health = providers
            .iter()
            .map(|p| {
                let key = ProviderKey {
                    node_id: p.node_id.clone(),
                    provider_id: p.provider_id.clone(),
                };
                let Some(log) = self.health.get(&key) else {
                    return HealthNote::default();
                };
                let current = self.registry.ready_generation(&p.node_id).map(|(_, g)| g);
                let overlay = log
                    .overlay
                    .filter(|(g, ..)| Some(*g) == current && p.health == "unavailable")
                    .map(|(_, since, idle, fence)| OverlayNote {
                        age: now.saturating_duration_since(since),
                        idle,
                        fence,
                    });
                let last_probe = log
                    .probe
                    .map(|(at, provider_status, fresh, cleared)| ProbeNote {
                        age: now.saturating_duration_since(at),
                        provider_status,
                        fresh,
                        cleared,
                    });
                HealthNote {
                    overlay,
                    last_probe,
                }
            })
            .collect();
        let mut streams: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
        for route in self.routes.values() {
            let e = streams.entry(route.node_id.as_str()).or_default();
            match route.sink {
                Sink::Run(_) => e.0 += 1,
                Sink::Tunnel(_) => e.1 += 1,
            }
        }
        let nodes = self
            .nodes
            .iter()
            .map(|(id, entry)| {
                let ready = self.registry.ready_generation(id).map(|(_, g)| g);
                let pending = self.registry.pending_generation(id).map(|(_, g)| g);
                let (runs, tunnels) = streams.get(id.as_str()).copied().unwrap_or_default();
                NodeStatus {
                    node_id: id.clone(),
                    generation: ready.or(pending),
                    ready: ready.is_some(),
                    version: entry.registration.as_ref().map(|r| r.version.clone()),
                    last_heard: self
                        .registry
                        .last_heard(id)
                        .map(|at| now.saturating_duration_since(at)),
                    runs,
                    tunnels,
                    refused: entry.refusal.as_ref().map(|r| r.reason().to_owned()),
                    warning: entry.warning.clone(),
                }
            })
            .collect();
        let (queue_depth, leases) = self.pool_stats();
        CoreStatus {
            providers,
            health,
            nodes,
            queue_depth,
            oldest_wait: self
                .pool
                .as_ref()
                .and_then(Pool::oldest_wait_since)
                .map(|at| now.saturating_duration_since(at)),
            leases,
            issuers: self.issuers.clone(),
        }
    }

    /// The lease issuer keys Nodes are held to ([`EdgeCore::set_issuers`]).
    pub fn issuers(&self) -> &Issuers {
        &self.issuers
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
                        self.observer.wait_timeout();
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

    fn registry_event(&mut self, now: Instant, event: RegistryEvent) {
        match event {
            RegistryEvent::Registered {
                node_id,
                generation,
                recipient,
                issuer_key_ids,
                version,
                stream_credit,
                ..
            } => {
                self.nodes.entry(node_id).or_default().registration = Some(Registration {
                    generation,
                    recipient,
                    pins: issuer_key_ids,
                    version,
                    stream_credit,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The credit a Node spends per frame covers what the Edge counts for it beyond the body,
    /// so a window bounds the byte count however the body is split.
    #[test]
    fn a_body_frame_costs_no_more_than_its_credit() {
        for len in [0, 1, 15, 16, 17, 100, 4096, 16 * 1024 + 3, 1 << 20] {
            let ev = TunnelEvent::Frame(Delivery::Body(bytes::Bytes::from(vec![0u8; len])));
            assert!(
                tunnel_event_size(&ev) as u64
                    <= len as u64 + iop_wire::runtime::TUNNEL_FRAME_CREDIT,
                "{len}: {}",
                tunnel_event_size(&ev)
            );
        }
    }
}
