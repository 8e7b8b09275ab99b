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
//! | `POST /api/nodes/{node}/probe` | asks a ready Node to probe its providers now (seed 000's CAPABILITIES recovery probe); `{"cleared": n}`, or `409` when the Node is not ready. The page's one action: it asks the operator to confirm, then sends [`bounded_http::admin::ACTION_HEADER`] |
//!
//! # What it shows
//!
//! - **Nodes**: state (ready, pending, refused or warned with the Edge's reason, down),
//!   generation, the version the Node announced, since when, when it was last heard from (its
//!   heartbeat or any frame), runs and tunnels in flight. Select one to see only its
//!   providers, and to ask it to probe them.
//! - **Providers**: health, and for the runtime-unavailable overlay its cause (the stall
//!   terminal's silence and the Node's probe) and since when; for an excluded provider, why
//!   its Node is not selected; the last recovery probe answer; capacity, in flight, queued,
//!   long context. Select one for its details.
//! - **Queue**: depth, the oldest wait, waits that ran out in the last minute.
//! - **Traffic**: requests and errors per second (the page derives rates from counters),
//!   errors by kind, slow readers cut, the gateway's overhead and time to first token p50/p99
//!   ([`crate::metrics::Metrics::traffic`]).
//! - **Keys** (when the Edge limits any): the [`MAX_KEY_ROWS`] keys or principals nearest a
//!   limit, with requests and tokens held against each per-minute limit, in flight, and day
//!   and month spend against their budgets ([`crate::limits::Limiter::usage`]).
//! - **Control Plane** (when configured): the session, managed or not, why the Edge is not
//!   ready, the projection generation, the issuer keys (active; staged with its activation
//!   time) and the Nodes warned that they do not trust the staged key.
//!
//! One view serves every request and event stream for [`VIEW_TTL`], so what the page costs
//! the Edge (one pass over its streams and limited keys under their locks) does not grow with
//! the pages open.
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
//!   for the test's secrets).
//! - **One action, confirmed**: asking a Node to probe its providers. It needs the admin
//!   token like every path, the operator's confirmation in the page, and
//!   [`bounded_http::admin::confirmed_action`]'s header, which a page of another origin
//!   cannot send (so a browser holding the credential cannot be made to act from elsewhere).
//! - **Bounded**: at most [`MAX_EVENT_STREAMS`] event streams at once (more get `503`); the
//!   Node history it keeps for Nodes that went away is capped at [`MAX_GONE_NODES`].
//!
//! The assets are compiled into the binary (`include_str!`); the page loads nothing from
//! anywhere else, so it works with no internet access.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bounded_http::admin::asset;
use serde::Serialize;

use crate::EdgeHandle;
use crate::control::{ControlConnector, SessionState};
use crate::limits::Limiter;

/// Event streams served at once; more are refused with `503`.
pub const MAX_EVENT_STREAMS: usize = 32;
/// Nodes that went away kept on the page (as down, with since when); the oldest go first.
pub const MAX_GONE_NODES: usize = 1024;
/// Keys shown, nearest their limits first.
pub const MAX_KEY_ROWS: usize = 50;
/// How long one view serves every request and event stream.
pub const VIEW_TTL: Duration = Duration::from_millis(250);

const PAGE: &str = include_str!("page.html");
const SCRIPT: &str = include_str!("app.js");

pub use bounded_http::admin::AdminToken;

/// What the page shows.
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
    /// Keys (or principals) nearest their limits; `None` when the Edge limits nothing.
    pub keys: Option<KeysView>,
    /// The Control Plane session (`None`: legacy mode, no Control Plane).
    pub control: Option<ControlView>,
}

/// One Node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeView {
    /// Node id.
    pub id: String,
    /// `ready`, `down` (its connection ended), `pending` (configured, not connected, or
    /// registered and not ready yet), `refused` (its registration was refused, or it is not
    /// selected) or `warned` (ready, with a warning).
    pub state: &'static str,
    /// Why, for `refused` and `warned` (the Edge's own words, no secret).
    pub reason: String,
    /// The generation of its current (or last) connection.
    pub generation: Option<u64>,
    /// The software version it announced (its own words, at most 64 bytes).
    pub version: Option<String>,
    /// Since when (Unix ms) it has been in this state, when the page saw it change.
    pub since_ms: Option<u64>,
    /// When (Unix ms) anything (a heartbeat or any frame) was last received from it.
    pub last_heard_ms: Option<u64>,
    /// Leases held on its providers.
    pub in_flight: u32,
    /// Runs in flight on it.
    pub runs: u32,
    /// Provider tunnels in flight on it.
    pub tunnels: u32,
}

/// One provider of the pool (the seed's snapshot figures).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProviderView {
    /// Provider id.
    pub id: String,
    /// Owning Node.
    pub node_id: String,
    /// The models (as clients name them) it serves.
    pub models: Vec<String>,
    /// Adapter instance.
    pub adapter: String,
    /// Target (the provider's model).
    pub target: String,
    /// `available` / `unavailable`.
    pub status: String,
    /// `healthy` / `unavailable` (the runtime-unavailable overlay, or its Node not selected) /
    /// `offline`.
    pub health: String,
    /// Why it is unavailable and since when (Unix ms), when the Edge knows.
    pub cause: Option<String>,
    /// Since when (Unix ms) the overlay has been set.
    pub unavailable_since_ms: Option<u64>,
    /// The last recovery probe answer for it.
    pub last_probe: Option<ProbeView>,
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

/// A recovery probe's answer for one provider.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProbeView {
    /// When it was applied (Unix ms).
    pub at_ms: u64,
    /// What the Node said (`available`, `unavailable`, `unknown`).
    pub status: &'static str,
    /// Whether it cleared the overlay (a stale answer clears nothing).
    pub cleared: bool,
    /// Whether it was fresher than what the Edge had seen.
    pub fresh: bool,
}

/// The admission queue.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QueueView {
    /// Requests waiting for a provider.
    pub depth: usize,
    /// How long the oldest waiting request has waited, ms.
    pub oldest_wait_ms: Option<u64>,
    /// Waits that ran out in the last minute.
    pub timeouts_last_minute: u64,
    /// Waits that ran out since start.
    pub timeouts: u64,
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
    /// Error answers by kind (`rate_limited`, `unavailable`, `provider_failed`, ...).
    pub errors: BTreeMap<&'static str, u64>,
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

/// Keys nearest their limits ([`crate::limits::Limiter::usage`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KeysView {
    /// At most [`MAX_KEY_ROWS`], nearest a limit first.
    pub rows: Vec<KeyRow>,
    /// Keys with limits in all.
    pub total: usize,
}

/// One key's use of its limits.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KeyRow {
    /// Key or principal id (the id, never the secret).
    pub id: String,
    /// Requests this minute: used, limit.
    pub requests: Option<(u64, u64)>,
    /// Tokens this minute: used, limit.
    pub tokens: Option<(u64, u64)>,
    /// Requests in flight.
    pub in_flight: u32,
    /// The most in flight at once.
    pub concurrent: Option<u32>,
    /// This UTC day's spend and budget, US dollars.
    pub budget_day_usd: Option<(f64, f64)>,
    /// This UTC month's spend and budget, US dollars.
    pub budget_month_usd: Option<(f64, f64)>,
    /// The largest share of any limit used (1 = at the limit).
    pub share: f64,
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
    /// The generation of the projection installed (none before the first).
    pub projection_generation: Option<u64>,
    /// The lease issuer key leases are signed with now (its id).
    pub issuer_active: Option<String>,
    /// The staged issuer key (its id) and when it becomes the active one (Unix ms).
    pub issuer_staged: Option<(String, i64)>,
    /// Nodes that do not trust the staged key (they will stop being selected at the switch).
    pub warned_nodes: Vec<String>,
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
    limiter: Option<Arc<Limiter>>,
    log: NodeLog,
    streams: Arc<bounded_http::admin::EventStreams>,
    /// The last view and when it was taken: every stream and request within [`VIEW_TTL`]
    /// shares it, so the cost of the view (a pass over the streams and the limited keys under
    /// their locks) does not grow with the pages open.
    cached: std::sync::Mutex<Option<(Instant, Arc<StatusView>)>>,
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
    /// The view, at most [`VIEW_TTL`] old.
    fn view(&self) -> Arc<StatusView> {
        let mut cached = self
            .cached
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((at, view)) = cached.as_ref()
            && at.elapsed() < VIEW_TTL
        {
            return Arc::clone(view);
        }
        let view = Arc::new(self.take_view());
        *cached = Some((Instant::now(), Arc::clone(&view)));
        view
    }

    fn take_view(&self) -> StatusView {
        let edge = &self.edge;
        let now = SystemTime::now();
        let at = |age: Duration| unix_ms(now.checked_sub(age).unwrap_or(now));
        let core = edge.status();
        let seen = self.log.snapshot();
        let known: BTreeMap<&str, &iop_edge_core::NodeStatus> =
            core.nodes.iter().map(|n| (n.node_id.as_str(), n)).collect();
        let mut ids: Vec<String> = edge
            .configured_nodes()
            .iter()
            .map(|(id, _)| id.clone())
            .chain(core.nodes.iter().map(|n| n.node_id.clone()))
            .chain(seen.keys().cloned())
            .collect();
        ids.sort();
        ids.dedup();
        let nodes = ids
            .into_iter()
            .map(|id| {
                let s = seen.get(&id).copied();
                let n = known.get(id.as_str()).copied();
                let ready = n.is_some_and(|n| n.ready);
                let refused = n.and_then(|n| n.refused.clone()).filter(|r| !r.is_empty());
                let warning = n.and_then(|n| n.warning.clone()).filter(|w| !w.is_empty());
                let (state, reason) = match (ready, refused, warning, s) {
                    (true, _, Some(w), _) => ("warned", w),
                    (true, _, None, _) => ("ready", String::new()),
                    (false, Some(r), _, _) => ("refused", r),
                    (false, None, _, Some(s))
                        if !s.up && n.is_none_or(|n| n.generation.is_none()) =>
                    {
                        ("down", String::new())
                    }
                    _ => ("pending", String::new()),
                };
                let in_flight = core
                    .providers
                    .iter()
                    .filter(|p| p.node_id == id)
                    .map(|p| p.in_flight + p.long_in_flight)
                    .sum();
                NodeView {
                    generation: n
                        .and_then(|n| n.generation)
                        .map(|g| g.0)
                        .or(s.map(|s| s.generation)),
                    version: n.and_then(|n| n.version.clone()),
                    since_ms: s.map(|s| s.since_ms),
                    last_heard_ms: n.and_then(|n| n.last_heard).map(at),
                    runs: n.map_or(0, |n| n.runs),
                    tunnels: n.map_or(0, |n| n.tunnels),
                    id,
                    state,
                    reason,
                    in_flight,
                }
            })
            .collect();
        let mut models: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
        for (model, keys) in edge.pool_config().map_or(&[][..], |c| &c.models[..]) {
            for k in keys {
                models
                    .entry((k.node_id.as_str(), k.provider_id.as_str()))
                    .or_default()
                    .push(model.clone());
            }
        }
        let providers = core
            .providers
            .into_iter()
            .zip(core.health)
            .map(|(p, h)| {
                let node = known.get(p.node_id.as_str());
                let cause = match (&h.overlay, p.health.as_str()) {
                    (Some(o), _) => Some(format!(
                        "stalled: no output for {} s; the Node's probe says the provider is unavailable{}",
                        o.idle.as_secs(),
                        if o.fence == iop_wire::runtime::Fence::Unconfirmed {
                            " (the stalled call had not returned)"
                        } else {
                            ""
                        }
                    )),
                    (None, "unavailable") => node
                        .and_then(|n| n.refused.clone())
                        .map(|r| format!("Node not selected: {r}")),
                    (None, "offline") => Some("its Node is not connected".to_owned()),
                    _ => None,
                };
                ProviderView {
                    models: models
                        .get(&(p.node_id.as_str(), p.provider_id.as_str()))
                        .cloned()
                        .unwrap_or_default(),
                    cause,
                    unavailable_since_ms: h.overlay.map(|o| at(o.age)),
                    last_probe: h.last_probe.map(|pr| ProbeView {
                        at_ms: at(pr.age),
                        status: pr.provider_status,
                        cleared: pr.cleared,
                        fresh: pr.fresh,
                    }),
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
                }
            })
            .collect();
        let t = edge.metrics().traffic();
        let keys = self.limiter.as_ref().map(|l| {
            let usage = l.usage(MAX_KEY_ROWS);
            #[allow(clippy::cast_precision_loss, reason = "dollars for display")]
            let usd = |(spent, limit): (u64, u64)| (spent as f64 / 1e12, limit as f64 / 1e12);
            KeysView {
                rows: usage
                    .keys
                    .into_iter()
                    .map(|k| KeyRow {
                        share: k.share(),
                        requests: k.requests,
                        tokens: k.tokens,
                        in_flight: k.in_flight,
                        concurrent: k.concurrent,
                        budget_day_usd: k.budget_day.map(usd),
                        budget_month_usd: k.budget_month.map(usd),
                        id: k.key,
                    })
                    .collect(),
                total: usage.total,
            }
        });
        StatusView {
            version: env!("CARGO_PKG_VERSION"),
            nodes,
            providers,
            queue: QueueView {
                depth: core.queue_depth,
                oldest_wait_ms: core
                    .oldest_wait
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                timeouts_last_minute: t.wait_timeouts_last_minute,
                timeouts: t.wait_timeouts,
                leases: core.leases,
            },
            traffic: TrafficView {
                requests_ok: t.requests_ok,
                requests_failed: t.requests_failed,
                errors: t.errors.iter().copied().collect(),
                slow_consumer_cuts: t.slow_consumer_cuts,
                connections_refused: t.connections_refused,
                overhead_ms: t.overhead.map(ms_pair),
                ttft_ms: t.ttft.map(ms_pair),
            },
            keys,
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
                projection_generation: c.projection().map(|p| p.generation()),
                issuer_active: core.issuers.active.clone(),
                issuer_staged: core.issuers.staged.clone(),
                warned_nodes: core
                    .nodes
                    .iter()
                    .filter(|n| n.warning.is_some())
                    .map(|n| n.node_id.clone())
                    .collect(),
            }),
        }
    }
}

/// The page's router (see the module docs); `control` is the Edge's Control Plane connector,
/// if it has one. It follows Node connections from now on (a task: call it inside a tokio
/// runtime); [`Edge::status_page`](crate::Edge::status_page) knows them since the Edge's
/// start.
pub fn router(
    edge: EdgeHandle,
    control: Option<ControlConnector>,
    limiter: Option<Arc<Limiter>>,
    token: AdminToken,
) -> Router {
    let log = NodeLog::follow(&edge);
    router_with(edge, control, limiter, token, log)
}

/// [`router`] with the Node log the Edge has kept since its start.
pub(crate) fn router_with(
    edge: EdgeHandle,
    control: Option<ControlConnector>,
    limiter: Option<Arc<Limiter>>,
    token: AdminToken,
    log: NodeLog,
) -> Router {
    let shared = Arc::new(Shared {
        edge,
        control,
        limiter,
        log,
        streams: bounded_http::admin::EventStreams::new(MAX_EVENT_STREAMS),
        cached: std::sync::Mutex::new(None),
    });
    let page = Router::new()
        .route("/", get(page))
        .route("/app.js", get(script))
        .route("/api/status", get(status))
        .route("/api/events", get(events_stream))
        .route("/api/nodes/{node}/probe", axum::routing::post(probe))
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

/// Asks a ready Node to probe its providers now (the CAPABILITIES recovery probe of seed
/// 000: an overlay clears only on a fresher `available` answer). The page asks the operator
/// first; [`bounded_http::admin::confirmed_action`] holds the request to that.
async fn probe(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(node): axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
) -> Response {
    if let Err(refused) = bounded_http::admin::confirmed_action(&headers) {
        return refused;
    }
    let result = shared.edge.recover(&node).await;
    // The next view shows the answer.
    *shared
        .cached
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    match result {
        Ok(cleared) => axum::Json(serde_json::json!({ "cleared": cleared })).into_response(),
        Err(e) => (
            axum::http::StatusCode::CONFLICT,
            axum::Json(serde_json::json!({ "error": e.to_string() })),
        )
            .into_response(),
    }
}

async fn events_stream(State(shared): State<Arc<Shared>>) -> Response {
    let streams = shared.streams.clone();
    bounded_http::admin::status_events(&streams, move || {
        let shared = shared.clone();
        async move { Some(shared.view()) }
    })
}
