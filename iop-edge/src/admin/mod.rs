//! The Edge's status page: live Nodes, providers, the queue, traffic and the Control Plane, in
//! the browser, for operators. Serve [`Edge::status_page`](crate::Edge::status_page) on an
//! admin listener (never the public API port): the `iop-edge` binary does so on
//! `[admin] listen` and logs its address at startup.
//!
//! | path | what |
//! |---|---|
//! | `GET /` | the page (HTML; its script is `app.js`, and `page.css`, `common.js` and `favicon.svg` are [`bounded_http::admin::page_assets`]) |
//! | `GET /api/status` | the [`StatusView`] as JSON |
//! | `GET /api/events` | the same view as server-sent events: one `status` event at once, then one each time it changes (checked every 500 ms), a comment every 15 s otherwise |
//!
//! # Safe by construction
//!
//! - **Authenticated** ([`bounded_http::admin::guard`], shared with `iop-cp`'s page): every
//!   path needs the admin token, as `Authorization: Bearer <token>` or as the password of HTTP
//!   Basic authentication (any user name; a browser asks for it once and sends it with the
//!   event stream too). The comparison takes the same time whatever the guess. A request
//!   without it gets `401` and no page.
//! - **Same origin, strict CSP**: `default-src 'none'`, the script and the style from the page's
//!   own origin only, no inline script or style, `connect-src 'self'`, `frame-ancestors
//!   'none'`, `form-action 'none'`; `X-Content-Type-Options: nosniff`, `Referrer-Policy:
//!   no-referrer`, `Cache-Control: no-store`. The page builds its tables with DOM text nodes,
//!   never HTML from data.
//! - **Nothing secret in it**: the view has ids, states, counts, figures and fixed reason
//!   words; no key, token, lease, credential or certificate (the tests search every response
//!   for the test's secrets). The page changes nothing: it has no action.
//! - **Bounded**: at most [`MAX_EVENT_STREAMS`] event streams at once (more get `503`); the
//!   Node history it keeps for Nodes that went away is capped at [`MAX_GONE_NODES`].
//!
//! The assets are compiled into the binary (`include_str!`); the page loads nothing from
//! anywhere else, so it works with no internet access.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bounded_http::admin::asset;
use serde::Serialize;

use crate::EdgeHandle;
use crate::control::{ControlConnector, SessionState};

/// Event streams served at once; more are refused with `503`.
pub const MAX_EVENT_STREAMS: usize = 32;
/// Nodes that went away kept on the page (as down, with since when); the oldest go first.
pub const MAX_GONE_NODES: usize = 1024;

const PAGE: &str = include_str!("page.html");
const SCRIPT: &str = include_str!("app.js");

pub use bounded_http::admin::AdminToken;

/// What the page shows, as of `now_ms`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StatusView {
    /// This Edge's version.
    pub version: &'static str,
    /// Nodes, configured or seen, by id.
    pub nodes: Vec<NodeView>,
    /// Every provider of the pool.
    pub providers: Vec<ProviderView>,
    /// The admission queue.
    pub queue: QueueView,
    /// Request counters since start (the page turns them into rates).
    pub traffic: TrafficView,
    /// The Control Plane session (`None`: legacy mode, no Control Plane).
    pub control: Option<ControlView>,
}

/// One Node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeView {
    /// Node id.
    pub id: String,
    /// `ready`, `down` (its connection ended), `pending` (configured, not connected),
    /// `refused` (its registration was refused) or `warned` (ready, with a warning).
    pub state: &'static str,
    /// Why, for `refused` and `warned` (the Edge's own words, no secret).
    pub reason: String,
    /// The generation of its current (or last) connection.
    pub generation: Option<u64>,
    /// Since when (Unix ms) it has been in this state, when the page saw it change.
    pub since_ms: Option<u64>,
    /// Leases held on its providers (runs and tunnels in flight).
    pub in_flight: u32,
}

/// One provider of the pool (the seed's snapshot figures).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProviderView {
    /// Provider id.
    pub id: String,
    /// Owning Node.
    pub node_id: String,
    /// Adapter instance.
    pub adapter: String,
    /// Target (the provider's model).
    pub target: String,
    /// `available` / `unavailable`.
    pub status: String,
    /// `healthy` / `unavailable` (the runtime-unavailable overlay) / `offline`.
    pub health: String,
    /// Effective capacity.
    pub capacity: u32,
    /// Leases held.
    pub in_flight: u32,
    /// Requests waiting that this provider could take.
    pub queued: u32,
    /// Long-context capacity, leases and waiting requests.
    pub long_capacity: u32,
    /// Long-context leases held.
    pub long_in_flight: u32,
    /// Long-context requests waiting.
    pub long_queued: u32,
    /// Configured enabled.
    pub enabled: bool,
}

/// The admission queue.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QueueView {
    /// Requests waiting for a provider.
    pub depth: usize,
    /// Provider leases held.
    pub leases: u64,
}

/// Request counters since start.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrafficView {
    /// Model API requests answered successfully.
    pub requests_ok: u64,
    /// Model API requests that failed (any error answer).
    pub requests_failed: u64,
    /// Streams ended because the client read slower than the provider wrote.
    pub slow_consumer_cuts: u64,
    /// HTTP connections refused over the connection cap.
    pub connections_refused: u64,
    /// The gateway's own overhead (the Edge's time minus the provider call's time at the
    /// Node), p50 and p99 in ms over the last 1024 model requests.
    pub overhead_ms: Option<(f64, f64)>,
    /// Time to first content, p50 and p99 in ms over the last 1024 model requests.
    pub ttft_ms: Option<(f64, f64)>,
}

/// The Control Plane session.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ControlView {
    /// `connecting`, `connected`, `rejected`, `missing_projection` or `failed`.
    pub state: &'static str,
    /// Managed mode (the projection decides who may call and with which credential).
    pub managed: bool,
    /// Why the Edge is not ready, if it is not.
    pub unready: Option<String>,
}

/// A Node's last seen lifecycle.
#[derive(Clone, Copy, Debug)]
struct Seen {
    generation: u64,
    up: bool,
    since_ms: u64,
}

/// Shared by the router's handlers.
struct Shared {
    edge: EdgeHandle,
    control: Option<ControlConnector>,
    log: NodeLog,
    streams: Arc<bounded_http::admin::EventStreams>,
}

/// When each Node last connected or went away, followed from the Edge's lifecycle events
/// (the Edge starts following at its own start, so the page knows since when a Node is up).
#[derive(Clone, Debug, Default)]
pub(crate) struct NodeLog(Arc<std::sync::Mutex<BTreeMap<String, Seen>>>);

impl NodeLog {
    /// Follows `edge`'s Node connections from now on (a task that ends with the Edge or when
    /// the log is dropped). Call it inside a tokio runtime.
    pub(crate) fn follow(edge: &EdgeHandle) -> Self {
        let log = Self::default();
        let mut events = edge.subscribe();
        let weak = Arc::downgrade(&log.0);
        tokio::spawn(async move {
            use iop_edge_core::Lifecycle;
            use tokio::sync::broadcast::error::RecvError;
            loop {
                let event = events.recv().await;
                let Some(map) = weak.upgrade() else { return };
                let log = Self(map);
                match event {
                    Ok(Lifecycle::Connected {
                        node_id,
                        generation,
                    }) => log.record(&node_id, generation.0, true),
                    Ok(Lifecycle::Disconnected {
                        node_id,
                        generation,
                    }) => log.record(&node_id, generation.0, false),
                    // Missed events: the ready set is still right; those times are lost.
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => return,
                }
            }
        });
        log
    }

    fn record(&self, node_id: &str, generation: u64, up: bool) {
        let Ok(mut seen) = self.0.lock() else {
            return;
        };
        seen.insert(
            node_id.to_owned(),
            Seen {
                generation,
                up,
                since_ms: unix_ms(SystemTime::now()),
            },
        );
        if seen.len() > MAX_GONE_NODES {
            let oldest = seen
                .iter()
                .filter(|(_, s)| !s.up)
                .min_by_key(|(_, s)| s.since_ms)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                seen.remove(&k);
            }
        }
    }

    fn snapshot(&self) -> BTreeMap<String, Seen> {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

fn ms_pair((a, b): (Duration, Duration)) -> (f64, f64) {
    (a.as_secs_f64() * 1e3, b.as_secs_f64() * 1e3)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Shared {
    fn view(&self) -> StatusView {
        let edge = &self.edge;
        let snapshots = edge.snapshot();
        let ready: BTreeMap<String, u64> = edge
            .ready_nodes()
            .into_iter()
            .map(|(n, g)| (n, g.0))
            .collect();
        let seen = self.log.snapshot();
        let mut ids: Vec<String> = edge
            .configured_nodes()
            .iter()
            .map(|(id, _)| id.clone())
            .chain(ready.keys().cloned())
            .chain(seen.keys().cloned())
            .collect();
        ids.sort();
        ids.dedup();
        let nodes = ids
            .into_iter()
            .map(|id| {
                let s = seen.get(&id).copied();
                let refused = edge.refused(&id).filter(|r| !r.is_empty());
                let warning = edge.warning(&id).filter(|w| !w.is_empty());
                let (state, reason) = match (ready.get(&id), &refused, &warning, s) {
                    (Some(_), _, Some(w), _) => ("warned", w.clone()),
                    (Some(_), _, None, _) => ("ready", String::new()),
                    (None, Some(r), _, _) => ("refused", r.clone()),
                    (None, None, _, Some(s)) if !s.up => ("down", String::new()),
                    _ => ("pending", String::new()),
                };
                let in_flight = snapshots
                    .iter()
                    .filter(|p| p.node_id == id)
                    .map(|p| p.in_flight + p.long_in_flight)
                    .sum();
                NodeView {
                    generation: ready.get(&id).copied().or(s.map(|s| s.generation)),
                    since_ms: s.map(|s| s.since_ms),
                    id,
                    state,
                    reason,
                    in_flight,
                }
            })
            .collect();
        let providers = snapshots
            .into_iter()
            .map(|p| ProviderView {
                id: p.provider_id,
                node_id: p.node_id,
                adapter: p.adapter,
                target: p.target,
                status: p.status,
                health: p.health,
                capacity: p.capacity,
                in_flight: p.in_flight,
                queued: p.queued,
                long_capacity: p.long_context_capacity,
                long_in_flight: p.long_in_flight,
                long_queued: p.long_queued,
                enabled: p.enabled,
            })
            .collect();
        let (depth, leases) = edge.pool_stats();
        let t = edge.metrics().traffic();
        StatusView {
            version: env!("CARGO_PKG_VERSION"),
            nodes,
            providers,
            queue: QueueView { depth, leases },
            traffic: TrafficView {
                requests_ok: t.requests_ok,
                requests_failed: t.requests_failed,
                slow_consumer_cuts: t.slow_consumer_cuts,
                connections_refused: t.connections_refused,
                overhead_ms: t.overhead.map(ms_pair),
                ttft_ms: t.ttft.map(ms_pair),
            },
            control: self.control.as_ref().map(|c| ControlView {
                state: match &*c.state().borrow() {
                    SessionState::Connecting => "connecting",
                    SessionState::Connected => "connected",
                    SessionState::Rejected(_) => "rejected",
                    SessionState::MissingProjection => "missing_projection",
                    SessionState::Failed(_) => "failed",
                },
                managed: c.managed(),
                unready: c.unready_reason(),
            }),
        }
    }
}

/// The page's router (see the module docs); `control` is the Edge's Control Plane connector,
/// if it has one. It follows Node connections from now on (a task: call it inside a tokio
/// runtime); [`Edge::status_page`](crate::Edge::status_page) knows them since the Edge's
/// start.
pub fn router(edge: EdgeHandle, control: Option<ControlConnector>, token: AdminToken) -> Router {
    let log = NodeLog::follow(&edge);
    router_with(edge, control, token, log)
}

/// [`router`] with the Node log the Edge has kept since its start.
pub(crate) fn router_with(
    edge: EdgeHandle,
    control: Option<ControlConnector>,
    token: AdminToken,
    log: NodeLog,
) -> Router {
    let shared = Arc::new(Shared {
        edge,
        control,
        log,
        streams: bounded_http::admin::EventStreams::new(MAX_EVENT_STREAMS),
    });
    let page = Router::new()
        .route("/", get(page))
        .route("/app.js", get(script))
        .route("/api/status", get(status))
        .route("/api/events", get(events_stream))
        .with_state(shared)
        .merge(bounded_http::admin::page_assets());
    bounded_http::admin::guard(page, token, "iop-edge status")
}

async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

async fn status(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(shared.view()).into_response()
}

async fn events_stream(State(shared): State<Arc<Shared>>) -> Response {
    let streams = shared.streams.clone();
    bounded_http::admin::status_events(&streams, move || {
        let shared = shared.clone();
        async move { Some(shared.view()) }
    })
}
