//! The HTTP surface (axum): OpenAI Chat Completions, the OpenAI Responses API and the Anthropic
//! Messages API on every model, whatever its provider speaks.
//!
//! | route | dialect | module |
//! |---|---|---|
//! | `GET /v1/models` | OpenAI list, or Anthropic's when the request has `anthropic-version` | here |
//! | `POST /v1/chat/completions` | OpenAI chat | `chat.rs` |
//! | `POST /v1/responses` | OpenAI Responses | `responses.rs` |
//! | `POST /v1/messages`, `POST /v1/messages/count_tokens` | Anthropic | `anthropic.rs` |
//! | `/healthz`, `/readyz`, `/metrics` | — | here |
//!
//! # How a request is served
//!
//! Every route takes one path: parse the body (a JSON object with a `model`; errors in the
//! route's dialect, a body over [`MAX_REQUEST_BODY`] is 413) → authenticate (legacy mode: the
//! gateway [`ApiKeys`] when configured; managed mode: the Control Plane's projection) → resolve
//! the model group (404 naming the model; 400 `unsupported_operation` naming the model and the
//! operation when no provider of the group can serve the route, even translated — a 4xx, as
//! retrying cannot help) → admission through the
//! provider pool (`EdgeHandle::admit`) → build the request **in this task** for the selected
//! provider → (managed: bind and acquire a credential lease for exactly that Node) →
//! `EdgeHandle::send_admitted` → render.
//!
//! Managed mode has no refusal windows: a lease refused because this Edge's projection is
//! behind the store (`stale_generation`, another change was just made) waits for the newer
//! projection and is bound again, within `[control_plane] stale_binding_wait_ms` (1 s; the
//! rules are `iop_edge_core::binding`'s, driven per request by this crate's managed driver); the
//! request fails only when its own principal, token or route lost access (403; 401 once the
//! projection has it) or the change did not arrive in time (503 + `Retry-After: 1`).
//!
//! `/healthz` is liveness only. `/readyz` is 200 when a Node is dispatch-ready and, in managed
//! mode, the Edge holds a live Control Plane session and a projection; 503 with the reason
//! otherwise, so a load balancer stops sending traffic an Edge would refuse. It is also 503
//! (`draining`) from the moment the Edge starts draining ([`crate::Edge::draining`]), while
//! the Edge still serves what arrives and finishes what is in flight.
//!
//! What is built depends on the selected provider (`Plan`): each OpenAI-compatible adapter
//! instance declares the operations its upstream serves (its protocol profile, pushed to the
//! Node in its config; presets in [`crate::profile`]), so the Edge knows without guessing:
//!
//! - the route's own operation → **passthrough**: the client's body bytes with only `model`
//!   set to the provider's target (`iop_dialect::splice`; re-serialised from the parsed value
//!   only where a top-level name appears twice or escaped, so the upstream never reads another
//!   `model` or `stream` than the Edge did), and, to an Anthropic upstream, the client's
//!   `anthropic-beta` header (no other client header is forwarded); status, headers and body
//!   bytes come back untouched (an upstream error included);
//! - otherwise, over `chat_completions` (a Responses or Messages request) or `messages` (a chat
//!   or Responses request to an Anthropic-native upstream) → **translated** with `iop_dialect`:
//!   the request through chat form, the response (SSE incrementally, or JSON whole) back into
//!   the route's dialect, where it is rendered anyway, so no extra hop; an upstream error
//!   status keeps its status and message in the route's shape;
//! - native providers (Ollama, demo, your own adapters) → a normalized `RunRequest` whose
//!   events render in any dialect, tool calls included.
//!
//! A client that goes away drops the response stream, which cancels the upstream request
//! (`CancelRequest` to the Node), on every route and plan. A stream that fails after it
//! started (the Node's stall watchdog, a fence, a slow-consumer cut) ends with the route's
//! error event (chat's `data: {"error": …}`, Responses' `response.failed`, Messages'
//! `event: error`), passed through or translated; a JSON body that fails mid-way is cut short.
//!
//! Chat streams ask their upstream for usage (`stream_options.include_usage`) so the key's
//! limits are settled exactly; the usage-only chunk is taken out of a passthrough when the
//! client had not asked for it (`iop_dialect::sse::UsageChunkFilter`).
//!
//! # Errors
//!
//! In the route's dialect (see `iop_dialect::error`): OpenAI's `{"error": {…}}` on
//! `/v1/chat/completions`, `/v1/responses` and `/v1/models`; Anthropic's `{"type": "error",
//! "error": {…}}` on `/v1/messages*` (and on `/v1/models` for Anthropic clients). 400 invalid
//! body or an operation no provider of the model serves, 401 bad or missing key, 403 managed scope refused, 404 unknown model or path, 405
//! method, 413 body too large, 429 queue full, 502 provider failure,
//! 503 (Anthropic: 529 `overloaded_error`) no provider within the wait, the Control Plane
//! unreachable (managed), or a change still propagating (with `Retry-After`).

mod anthropic;
mod auth;
mod chat;
mod observe;
mod render;
mod responses;

use crate::pool::ContextSize;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::managed::Run;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use iop_dialect::{Dialect, Meta, TranslateError, Upstream};
use iop_edge_core::binding::Refusal;
use iop_wire::runtime::{
    AdapterSettings, ConcreteProtocolProfile, Header, Operation, ProviderTunnelRequest, RunRequest,
};
use iop_wire::validate::ResponseStallTimeout;
use serde_json::{Value, json};

pub use auth::{ApiKeys, ApiKeysError, valid_key_id};

use crate::metrics::Endpoint;
use crate::pool::ProviderKind;
use crate::transport::{Admission, Dispatched, EdgeHandle, PoolRequest};

/// Largest request body accepted (413 past it, in the route's dialect).
pub const MAX_REQUEST_BODY: usize = 8 * 1024 * 1024;

/// Default [`HttpConfig::body_timeout`].
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// HTTP surface settings.
#[derive(Clone)]
pub struct HttpConfig {
    /// External model names served (for `/v1/models`).
    pub models: Vec<String>,
    /// How long a request may wait in the pool queue.
    pub queue_wait: Duration,
    /// Legacy mode: the gateway API keys every request must present (`None` accepts every
    /// request: a local mesh on loopback). Not consulted in managed mode.
    pub api_keys: Option<Arc<ApiKeys>>,
    /// Legacy mode: the per-key rate limits ([`crate::limits`]), keyed by [`ApiKeys`] ids;
    /// `None` limits nothing. Share one `Arc` between routers: it holds the keys' state.
    pub limiter: Option<Arc<crate::limits::Limiter>>,
    /// Adapter instances (`(node_id, adapter)`) not asked for usage on chat streams
    /// (`stream_usage = false`): their upstreams refuse `stream_options`.
    pub no_stream_usage: std::collections::HashSet<(String, String)>,
    /// Adapter instances (`(node_id, adapter)`) the Node must not send a `traceparent` header
    /// to (`trace_propagation = false`).
    pub no_trace_propagation: std::collections::HashSet<(String, String)>,
    /// Legacy mode: where each keyed request's usage record goes ([`crate::usage`]); `None`
    /// records nothing.
    pub usage: Option<Arc<dyn crate::usage::UsageSink>>,
    /// Managed mode: the Control Plane connector whose projection authenticates requests and
    /// resolves routes, and whose session delivers credential leases ([`crate::control`]).
    pub control: Option<crate::control::ControlConnector>,
    /// The whole request body must arrive within this (408 otherwise, in the route's dialect):
    /// a client that drips its body cannot hold a connection for long.
    pub body_timeout: Duration,
    /// Where the Edge's spans go ([`iop_telemetry`]); off by default (a client's
    /// `traceparent` is then still passed on to the provider).
    pub telemetry: iop_telemetry::Telemetry,
}

impl HttpConfig {
    /// Settings with the defaults: no API keys, no Control Plane, [`DEFAULT_BODY_TIMEOUT`].
    pub fn new(models: Vec<String>, queue_wait: Duration) -> Self {
        Self {
            models,
            queue_wait,
            api_keys: None,
            limiter: None,
            usage: None,
            no_stream_usage: std::collections::HashSet::new(),
            no_trace_propagation: std::collections::HashSet::new(),
            control: None,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            telemetry: iop_telemetry::Telemetry::off(),
        }
    }
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("models", &self.models)
            .field("queue_wait", &self.queue_wait)
            .field("api_keys", &self.api_keys)
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
struct AppState {
    edge: EdgeHandle,
    config: Arc<HttpConfig>,
    catalog: Arc<Catalog>,
}

/// The whole HTTP surface as the standalone Edge serves it: [`api_router`] and
/// [`ops_router`] merged, with a fallback that answers unknown paths (404) and wrong methods
/// (405) in the path's dialect. To mount the API inside an application that has routes (and a
/// fallback) of its own, use [`api_router`] instead (`crate::Edge::api`).
pub fn router(edge: EdgeHandle, config: HttpConfig) -> Router {
    let state = app_state(edge, config);
    api_routes(&state)
        .merge(ops_routes(&state))
        .fallback(unknown_path)
        .method_not_allowed_fallback(method_not_allowed)
}

/// The model API alone: `/v1/models`, `/v1/chat/completions`, `/v1/responses`,
/// `/v1/messages` and `/v1/messages/count_tokens`, with the body limits and authentication of
/// `config`, and no fallback, so it merges into (or nests under a prefix of) an application
/// that has its own. A wrong method on one of these paths is 405 in the path's dialect.
pub fn api_router(edge: EdgeHandle, config: HttpConfig) -> Router {
    api_routes(&app_state(edge, config))
}

/// The operational routes alone: `/metrics` (Prometheus text), `/healthz` (liveness) and
/// `/readyz` (200 when a Node is dispatch-ready and, in managed mode, the Control Plane
/// session and projection are live; 503 with the reason otherwise, and `draining` once the
/// Edge drains). Put them where your
/// operators and load balancer expect them; they have no authentication of their own.
pub fn ops_router(edge: EdgeHandle, config: HttpConfig) -> Router {
    ops_routes(&app_state(edge, config))
}

fn app_state(edge: EdgeHandle, config: HttpConfig) -> AppState {
    let catalog = Arc::new(Catalog::new(&edge));
    AppState {
        edge,
        config: Arc::new(config),
        catalog,
    }
}

fn api_routes(state: &AppState) -> Router {
    let body_timeout = state.config.body_timeout;
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(move |req, next| {
            read_body(body_timeout, req, next)
        }))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY))
        .with_state(state.clone())
}

fn ops_routes(state: &AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state.clone())
}

/// Reads the whole request body before routing, within `timeout` and [`MAX_REQUEST_BODY`]:
/// 408 or 413 in the path's dialect otherwise.
async fn read_body(
    timeout: Duration,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use http_body_util::BodyExt as _;
    let (parts, body) = req.into_parts();
    let dialect = dialect_of_path(parts.uri.path());
    let read = async {
        let mut body = body;
        // A body that arrives in one piece (the common case) is kept as it came; only a body
        // in several pieces is copied into one buffer.
        let mut held: Option<Bytes> = None;
        let mut joined: Option<Vec<u8>> = None;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                return Err(StatusCode::BAD_REQUEST);
            };
            if let Ok(data) = frame.into_data() {
                let len = joined
                    .as_ref()
                    .map_or_else(|| held.as_ref().map_or(0, Bytes::len), Vec::len);
                if len + data.len() > MAX_REQUEST_BODY {
                    return Err(StatusCode::PAYLOAD_TOO_LARGE);
                }
                if let Some(j) = &mut joined {
                    j.extend_from_slice(&data);
                } else if let Some(h) = held.take() {
                    let mut j = Vec::with_capacity(h.len() + data.len());
                    j.extend_from_slice(&h);
                    j.extend_from_slice(&data);
                    joined = Some(j);
                } else {
                    held = Some(data);
                }
            }
        }
        Ok(joined.map_or_else(|| held.unwrap_or_default(), Bytes::from))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(bytes)) => {
            let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
            next.run(req).await
        }
        Ok(Err(StatusCode::PAYLOAD_TOO_LARGE)) => render::error(
            dialect,
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body exceeds {MAX_REQUEST_BODY} bytes"),
        ),
        Ok(Err(status)) => render::error(dialect, status, "request body could not be read"),
        Err(_) => render::error(
            dialect,
            StatusCode::REQUEST_TIMEOUT,
            &format!("request body not received within {} s", timeout.as_secs()),
        ),
    }
}

pub use bounded_http::ServeLimits;

/// Serves `router` on `listener` until `shutdown` completes (then finishes in-flight
/// requests), with `TCP_NODELAY` on every accepted connection and the default
/// [`ServeLimits`]: `bounded_http::serve`, the one hardened server every listener of the
/// workspace uses.
///
/// Use this rather than a bare `axum::serve`: a passthrough stream writes each provider chunk
/// as it arrives, and with Nagle's algorithm on, the second small write of a response waits for
/// the client's delayed ACK — measured here as +44 ms at p99 and 1.3k instead of 3.4k+ requests/s
/// (`benches/README.md`, `http_load`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    bounded_http::serve(listener, router, shutdown).await
}

/// [`serve`] with explicit connection limits (`bounded_http::serve_with`); `metrics` counts
/// refusals (`iop_edge_http_connections_refused_total`) and accept errors.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ServeLimits,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let events = metrics.map(|m| m as Arc<dyn bounded_http::ServeEvents>);
    bounded_http::serve_with(listener, router, limits, events, shutdown).await
}

fn dialect_of_path(path: &str) -> Dialect {
    if path.starts_with("/v1/messages") {
        Dialect::Messages
    } else {
        Dialect::Chat
    }
}

async fn unknown_path(uri: Uri) -> Response {
    render::error(
        dialect_of_path(uri.path()),
        StatusCode::NOT_FOUND,
        "unknown path",
    )
}

async fn method_not_allowed(uri: Uri) -> Response {
    render::error(
        dialect_of_path(uri.path()),
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed",
    )
}

// === Catalog ===

/// What each provider's upstream serves, from the configuration at bind time: the protocol
/// profile of every OpenAI-compatible adapter instance, and per model group the union of its
/// providers' operations.
#[derive(Debug, Default)]
struct Catalog {
    /// `node_id` → adapter instance → profile: looked up per request by the lease's borrowed
    /// strings, without building an owned key.
    profiles: HashMap<String, HashMap<String, Arc<ConcreteProtocolProfile>>>,
    models: HashMap<String, ModelCaps>,
}

#[derive(Debug, Default)]
struct ModelCaps {
    operations: BTreeSet<Operation>,
    native: bool,
    /// How many Nodes serve the group (a fallback needs another one).
    nodes: usize,
}

impl ModelCaps {
    /// Whether some provider of the group can serve `op`, passed through or translated.
    fn can_serve(&self, op: Operation) -> bool {
        let has = |o| self.operations.contains(&o);
        match op {
            Operation::CountTokens | Operation::Models => true,
            _ => {
                self.native
                    || has(op)
                    || has(Operation::ChatCompletions)
                    || (has(Operation::Messages) && op != Operation::Messages)
            }
        }
    }
}

impl Catalog {
    fn new(edge: &EdgeHandle) -> Self {
        let mut profiles = HashMap::new();
        for (node_id, payload) in edge.configured_nodes() {
            for a in &payload.adapters {
                if let AdapterSettings::OpenAiCompat(s) = &a.settings {
                    profiles
                        .entry(node_id.clone())
                        .or_insert_with(HashMap::new)
                        .insert(
                            a.instance_key().to_owned(),
                            Arc::new(s.protocol_profile.clone()),
                        );
                }
            }
        }
        let mut models: HashMap<String, ModelCaps> = HashMap::new();
        if let Some(pool) = edge.pool_config() {
            for (model, keys) in &pool.models {
                let caps = models.entry(model.clone()).or_default();
                caps.nodes = pool
                    .providers
                    .iter()
                    .filter(|p| keys.contains(&p.key))
                    .map(|p| p.key.node_id.as_str())
                    .collect::<BTreeSet<_>>()
                    .len();
                for spec in pool.providers.iter().filter(|p| keys.contains(&p.key)) {
                    match spec.kind {
                        ProviderKind::Native => caps.native = true,
                        ProviderKind::OpenAiCompat => {
                            match profiles
                                .get(&spec.key.node_id)
                                .and_then(|adapters| adapters.get(&spec.adapter))
                            {
                                Some(p) => caps.operations.extend(p.operation_paths.keys()),
                                // No profile known: the Node decides (passthrough only).
                                None => caps.operations.extend([
                                    Operation::ChatCompletions,
                                    Operation::Responses,
                                    Operation::Messages,
                                    Operation::CountTokens,
                                ]),
                            }
                        }
                    }
                }
            }
        }
        Self { profiles, models }
    }

    /// [`Catalog::profile`], shared (compared by value, cloned by reference count).
    fn profile_arc(&self, admission: &Admission) -> Option<Arc<ConcreteProtocolProfile>> {
        self.profile_of(admission).cloned()
    }

    fn profile(&self, admission: &Admission) -> Option<&ConcreteProtocolProfile> {
        self.profile_of(admission).map(AsRef::as_ref)
    }

    fn profile_of(&self, admission: &Admission) -> Option<&Arc<ConcreteProtocolProfile>> {
        let lease = admission.lease();
        self.profiles
            .get(&lease.key.node_id)
            .and_then(|adapters| adapters.get(&lease.adapter))
    }
}

/// What the Edge sends to the selected provider for a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// The client's body, `model` set to the target, on the route's own operation.
    Passthrough(Operation),
    /// A chat completions request; the chat response translated back.
    ViaChat,
    /// An Anthropic Messages request; its response translated back.
    ViaMessages,
    /// A normalized run (native provider).
    Native,
    /// Nothing this provider serves can answer the route.
    Unservable,
}

fn plan(op: Operation, kind: ProviderKind, profile: Option<&ConcreteProtocolProfile>) -> Plan {
    if kind == ProviderKind::Native {
        return Plan::Native;
    }
    let Some(p) = profile else {
        return Plan::Passthrough(op);
    };
    if p.serves(op) {
        Plan::Passthrough(op)
    } else if op != Operation::ChatCompletions && p.serves(Operation::ChatCompletions) {
        Plan::ViaChat
    } else if op != Operation::Messages && p.serves(Operation::Messages) {
        Plan::ViaMessages
    } else {
        Plan::Unservable
    }
}

/// 400 (not a 5xx: retrying cannot help, and SDKs retry 5xx), naming the model and operation.
fn unservable(dialect: Dialect, model: &str, op: Operation) -> Response {
    let shown: String = model.chars().take(128).collect();
    render::error_with_code(
        dialect,
        StatusCode::BAD_REQUEST,
        &format!(
            "model `{shown}` cannot serve `{}`: its provider declares neither that operation nor one it can be translated from",
            op.as_str()
        ),
        Some("unsupported_operation"),
    )
}

// === Requests ===

/// A parsed request body.
struct Parsed {
    /// The client's bytes (a passthrough forwards them, `iop_dialect::splice`).
    raw: Bytes,
    json: Value,
    model: String,
    stream: bool,
}

#[expect(
    clippy::result_large_err,
    reason = "the error is the response itself, returned at once"
)]
fn parse(dialect: Dialect, body: Result<Bytes, BytesRejection>) -> Result<Parsed, Response> {
    let body = body.map_err(|rejection| {
        let status = rejection.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!("request body exceeds {MAX_REQUEST_BODY} bytes")
        } else {
            "request body could not be read".to_owned()
        };
        render::error(dialect, status, &message)
    })?;
    let Ok(json @ Value::Object(_)) = serde_json::from_slice::<Value>(&body) else {
        return Err(render::error(
            dialect,
            StatusCode::BAD_REQUEST,
            "request body is not a JSON object",
        ));
    };
    let Some(model) = json["model"].as_str().map(str::to_owned) else {
        return Err(render::error(
            dialect,
            StatusCode::BAD_REQUEST,
            "`model` is required",
        ));
    };
    let stream = json["stream"].as_bool().unwrap_or(false);
    Ok(Parsed {
        raw: body,
        json,
        model,
        stream,
    })
}

/// `field` must be an array.
fn require_array(request: &Value, field: &'static str) -> Result<(), TranslateError> {
    if request[field].is_array() {
        Ok(())
    } else {
        Err(TranslateError::Invalid {
            field: field.into(),
            reason: "must be an array",
        })
    }
}

fn bad_request(dialect: Dialect, e: &TranslateError) -> Response {
    render::error(dialect, StatusCode::BAD_REQUEST, &e.to_string())
}

fn unix_now() -> u64 {
    u64::try_from(iop_wire::time::unix_secs(SystemTime::now())).unwrap_or(0)
}

static REQUESTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh request number (run ids `<prefix>-<n>`: letters, digits and `-` are valid on the
/// wire).
fn next_request() -> u64 {
    REQUESTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Whether the lease's adapter instance is in `set` (`(node_id, adapter)` pairs from the
/// configuration). Most configurations name none: then no owned key is built for the lookup.
fn instance_in(
    set: &std::collections::HashSet<(String, String)>,
    lease: &crate::pool::Lease,
) -> bool {
    !set.is_empty() && set.contains(&(lease.key.node_id.clone(), lease.adapter.clone()))
}

// === Authentication ===

/// Who is asking.
enum Caller {
    /// Legacy mode: the gateway key's id, or `None` when no keys are configured.
    Open(Option<Arc<str>>),
    /// Managed mode: the projection the request authenticated with.
    Managed {
        control: crate::control::ControlConnector,
        index: Arc<crate::control::ProjectionIndex>,
        principal: String,
        token: String,
    },
}

#[expect(
    clippy::result_large_err,
    reason = "the error is the response itself, returned at once"
)]
fn authenticate(
    state: &AppState,
    dialect: Dialect,
    headers: &HeaderMap,
    app_key: Option<&crate::limits::KeyId>,
) -> Result<Caller, Response> {
    let unauthorized = || {
        render::error_with_code(
            dialect,
            StatusCode::UNAUTHORIZED,
            "invalid api key",
            Some("invalid_api_key"),
        )
    };
    if let Some(control) = state.config.control.as_ref().filter(|c| c.managed()) {
        let Some(index) = control.projection() else {
            return Err(render::overloaded(dialect, "credential plane not ready"));
        };
        let token = auth::presented_key(headers).unwrap_or_default().to_owned();
        let Some(principal) = index.authenticate(&token).map(str::to_owned) else {
            return Err(unauthorized());
        };
        return Ok(Caller::Managed {
            control: control.clone(),
            index,
            principal,
            token,
        });
    }
    match &state.config.api_keys {
        // No gateway keys: the application authenticated the request, and may name who it is
        // for (its limits and usage records).
        None => Ok(Caller::Open(app_key.map(|k| Arc::clone(&k.0)))),
        Some(keys) => match auth::presented_key(headers).and_then(|k| keys.identify_shared(k)) {
            Some(id) => Ok(Caller::Open(Some(id))),
            None => Err(unauthorized()),
        },
    }
}

/// The key's rate limits for one request ([`crate::limits`]): a hold (empty when nothing
/// limits the key), or 429 in the route's dialect with `retry-after` and the quota headers
/// (503 + `retry-after: 1` when shared limits fail closed and their store is unavailable).
/// `chat` gives the request's chat form, for the input estimate; it is called only when a
/// token limit applies.
async fn limit(
    state: &AppState,
    dialect: Dialect,
    caller: &Caller,
    group: &str,
    request: &Value,
    chat: impl FnOnce() -> Result<Value, TranslateError>,
) -> Result<crate::limits::Hold, Response> {
    let (limiter, sink) = (state.config.limiter.as_ref(), state.config.usage.as_ref());
    if limiter.is_none() && sink.is_none() {
        return Ok(crate::limits::Hold::default());
    }
    let key = match caller {
        Caller::Open(Some(key)) => &**key,
        // Managed: the principal is the key; its limits come with the projection it
        // authenticated under.
        Caller::Managed {
            index, principal, ..
        } => {
            if let Some(l) = limiter {
                l.follow(index.projection());
            }
            principal.as_str()
        }
        Caller::Open(None) => return Ok(crate::limits::Hold::default()),
    };
    let output_default = limiter.map_or(crate::limits::DEFAULT_OUTPUT_ESTIMATE, |l| {
        l.config().output_estimate
    });
    let limits = limiter.map(|l| l.limits_of(key));
    let budget = limits.as_ref().map(|l| l.budget).unwrap_or_default();
    let price = limiter.and_then(|l| l.budgets().price(group));
    let (input, output) = if sink.is_some()
        || !budget.is_none()
        || limits.as_ref().is_some_and(|l| l.limits_tokens(group))
    {
        let chat = chat().map_err(|e| bad_request(dialect, &e))?;
        (
            iop_dialect::request::estimate_tokens(&chat),
            crate::limits::output_cap(request, output_default),
        )
    } else {
        (0, 0)
    };
    let metered = |hold: crate::limits::Hold| match sink {
        Some(s) => hold.with_meter(
            crate::usage::Meter::new(Arc::clone(s), key, group, input, output).with_price(price),
        ),
        None => hold,
    };
    let Some(limiter) = limiter else {
        return Ok(metered(crate::limits::Hold::default()));
    };
    // The spend budget first: a request it refuses takes nothing from the rate limits.
    let budget_hold = match limiter
        .budgets()
        .reserve(key, &budget, group, input, output)
        .await
    {
        Ok(h) => h,
        Err(refusal) => {
            if let Some(s) = sink {
                crate::usage::Meter::refused(s, key, group);
            }
            return Err(budget_refused(dialect, refusal));
        }
    };
    let refused = match limiter
        .admit(key, group, input.saturating_add(output))
        .await
    {
        Ok(hold) => return Ok(metered(hold.with_budget(budget_hold))),
        Err(crate::limits::LimitError::Refused(r)) => {
            if let Some(s) = sink {
                crate::usage::Meter::refused(s, key, group);
            }
            r
        }
        Err(_) => {
            let mut r = render::overloaded(dialect, "rate limit store unavailable");
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(1));
            return Err(r);
        }
    };
    let mut r = render::error_with_code(
        dialect,
        StatusCode::TOO_MANY_REQUESTS,
        &refused.message(),
        Some("rate_limit_exceeded"),
    );
    let h = r.headers_mut();
    refused.quota.write_headers(dialect, SystemTime::now(), h);
    if let Some(secs) = refused.retry_after_secs() {
        h.insert(header::RETRY_AFTER, header::HeaderValue::from(secs));
        let ms = refused.retry_after.map_or(secs.saturating_mul(1000), |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
        });
        h.insert("retry-after-ms", header::HeaderValue::from(ms));
    }
    Err(r)
}

/// A request its key's spend budget refused: for good (`x-should-retry: false`, which both
/// official SDKs honour; OpenAI's `insufficient_quota`), or until reservations in flight
/// settle (`retry-after: 1`).
fn budget_refused(dialect: Dialect, refusal: crate::limits::budget::BudgetRefusal) -> Response {
    use crate::limits::budget::BudgetRefusal;
    match refusal {
        BudgetRefusal::Exhausted { period } => {
            let message = format!(
                "this key's spend budget for the {period} is used up (or too small for this request's estimate)"
            );
            let body = match dialect {
                Dialect::Messages => iop_dialect::error::body(dialect, 429, &message, None),
                _ => {
                    json!({ "error": { "message": message, "type": "insufficient_quota", "param": null, "code": "insufficient_quota" } })
                }
            };
            let mut r = render::json_response(StatusCode::TOO_MANY_REQUESTS, &body);
            r.headers_mut()
                .insert("x-should-retry", header::HeaderValue::from_static("false"));
            r
        }
        BudgetRefusal::Held => {
            let mut r = render::error_with_code(
                dialect,
                StatusCode::TOO_MANY_REQUESTS,
                "this key's spend budget is held by requests in flight",
                Some("rate_limit_exceeded"),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(1));
            r
        }
        BudgetRefusal::Unavailable => {
            let mut r = render::overloaded(dialect, "budget store unavailable");
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(1));
            r
        }
    }
}

/// `response` with the quota headers of `hold` (none for an unlimited key).
fn with_quota(mut response: Response, dialect: Dialect, quota: &crate::limits::Quota) -> Response {
    if *quota != crate::limits::Quota::default() {
        quota.write_headers(dialect, SystemTime::now(), response.headers_mut());
    }
    response
}

/// The pool model group a request for `model` goes to: the model itself, or in managed mode
/// the principal's route for it.
#[expect(
    clippy::result_large_err,
    reason = "the error is the response itself, returned at once"
)]
fn model_group(
    state: &AppState,
    dialect: Dialect,
    caller: &Caller,
    model: &str,
) -> Result<String, Response> {
    let group = match caller {
        Caller::Open(_) => model.to_owned(),
        Caller::Managed {
            index, principal, ..
        } => match index.route(principal, model) {
            Some(r) => r.model.clone(),
            None => return Err(render::not_found_model(dialect, model)),
        },
    };
    if !state.catalog.models.contains_key(&group) {
        return Err(render::not_found_model(dialect, model));
    }
    Ok(group)
}

// === Dispatch ===

/// Admission through the pool for `group`.
async fn admit(
    state: &AppState,
    dialect: Dialect,
    group: &str,
    model: &str,
) -> Result<Admission, Response> {
    state
        .edge
        .admit(group, ContextSize::Standard, state.config.queue_wait)
        .await
        .map_err(|e| render::dispatch_error(dialect, e, model))
}

/// Sends a request built for `admission`; in managed mode binds it to the selected Node first
/// (the binding loop of `iop_edge_core::binding`, driven by `crate::managed`).
///
/// An issuer key rotation can land between admission and binding: the projection the request
/// binds under names a key the admitted Node does not pin (the Edge stops selecting such Nodes
/// when the projection arrives, but this request was admitted before). The machine then asks
/// for a re-admission: the admission is given back and the request admitted once more (the
/// Node is no longer a candidate); the new provider must take the request as built (same kind,
/// target and protocol profile), or the answer is 503 + `Retry-After`.
#[allow(clippy::too_many_arguments, reason = "one request's whole context")]
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` keeps its arguments twice"
)]
fn send<'a>(
    state: &'a AppState,
    dialect: Dialect,
    caller: &'a Caller,
    group: &'a str,
    model: &'a str,
    mut admission: Admission,
    mut request: PoolRequest,
    attempt: &'a mut iop_telemetry::Span,
) -> impl Future<Output = Result<Dispatched, Response>> + 'a {
    // An `async` block, not an `async fn`: an `async fn` keeps its arguments' room after it
    // moved them into its body (rust-lang/rust#62958), and this future is part of every
    // request's handler future, which axum and hyper move by value (see `measured`).
    async move {
        // Assigned back, not bound anew: a new binding would take room of its own in this
        // future.
        if let Caller::Managed { .. } = caller {
            // Boxed: the binding loop's state is large and only managed requests need it.
            (admission, request) = Box::pin(bind(
                state, dialect, caller, group, model, admission, request, attempt,
            ))
            .await?;
        }
        let lease = admission.lease();
        let mut trace = attempt.context().map(Box::new);
        if let Some(t) = trace.as_mut() {
            t.to_provider = !instance_in(&state.config.no_trace_propagation, lease);
        }
        match &mut request {
            PoolRequest::Run(r) => r.trace = trace,
            PoolRequest::Tunnel(t) => t.trace = trace,
        }
        state
            .edge
            .send_admitted(admission, request)
            .await
            .map_err(|e| {
                attempt.fail("dispatch_failed");
                render::dispatch_error(dialect, e, model)
            })
    }
}

/// Binds a managed request to the admitted Node ([`send`]'s managed half).
#[allow(clippy::too_many_arguments, reason = "one request's whole context")]
async fn bind(
    state: &AppState,
    dialect: Dialect,
    caller: &Caller,
    group: &str,
    model: &str,
    admission: Admission,
    request: PoolRequest,
    attempt: &mut iop_telemetry::Span,
) -> Result<(Admission, PoolRequest), Response> {
    let Caller::Managed {
        control,
        index,
        principal,
        token,
    } = caller
    else {
        return Ok((admission, request));
    };
    let shape = |a: &Admission| {
        let l = a.lease();
        (l.kind, l.target.clone(), state.catalog.profile(a).cloned())
    };
    let mut binder = crate::managed::Binder::new(
        control,
        &state.edge,
        index.clone(),
        principal,
        token,
        model,
        admission,
    )
    .traced(&state.config.telemetry, attempt);
    loop {
        // Boxed: the lease round trip's state is large.
        match Box::pin(binder.run()).await {
            Run::Bound(bound) => {
                for _ in 0..binder.rebinds {
                    attempt.event("rebind", Vec::new());
                }
                let (admission, binding, lease) = *bound;
                let request = match request {
                    PoolRequest::Tunnel(mut req) => {
                        req.credential = Some(Box::new(iop_wire::runtime::ManagedCredential {
                            lease,
                            binding,
                        }));
                        PoolRequest::Tunnel(req)
                    }
                    other => other,
                };
                return Ok((admission, request));
            }
            Run::Readmit(old) => {
                let before = shape(&old);
                drop(old);
                attempt.event("readmit", Vec::new());
                let new = admit(state, dialect, group, model).await?;
                let same = shape(&new) == before;
                binder.readmitted(new, same);
            }
            Run::Refused(refusal) => return Err(refused(dialect, model, &refusal)),
        }
    }
}

/// Most dispatch attempts of one request: the first, and one fallback to another candidate
/// when the first Node's connection ended before it sent anything.
const MAX_ATTEMPTS: u32 = 2;

/// What to call a dispatch attempt span.
fn attempt_span(
    state: &AppState,
    server: Option<&iop_telemetry::Span>,
    number: u32,
    reason: &'static str,
    lease: &crate::pool::Lease,
) -> iop_telemetry::Span {
    let t = &state.config.telemetry;
    let Some(server) = server else {
        return iop_telemetry::Span::none();
    };
    if !t.is_on() {
        return t.child(
            server,
            "dispatch",
            iop_telemetry::SpanKind::Client,
            Vec::new(),
        );
    }
    t.child(
        server,
        "dispatch",
        iop_telemetry::SpanKind::Client,
        iop_telemetry::attributes([
            iop_telemetry::attr::operation("chat"),
            iop_telemetry::attr::attempt(number),
            iop_telemetry::attr::attempt_reason(reason),
            iop_telemetry::attr::node_id(lease.key.node_id.clone()),
            iop_telemetry::attr::adapter(lease.adapter.clone()),
            iop_telemetry::attr::response_model(lease.target.clone()),
        ]),
    )
}

/// The first pause before a request a Node refused for capacity is sent again; it doubles up
/// to [`CAPACITY_PAUSE_MAX`], each drawn from 50–100 % of it (`iop_wire::backoff`, the
/// workspace's one retry policy).
const CAPACITY_PAUSE_MIN: Duration = Duration::from_millis(10);
/// The longest pause between capacity refusals.
const CAPACITY_PAUSE_MAX: Duration = Duration::from_millis(400);

/// Sends a tunnel request, and sends it again when the Node never took it:
///
/// - **its connection ended before it sent anything** (the Node died or was fenced with the
///   request in flight): the request is admitted once more and sent to the new candidate, if
///   that provider takes the request as built (same kind, target and protocol profile); the
///   provider behind the lost Node may have received the first request. At most
///   [`MAX_ATTEMPTS`] in all.
/// - **it refused for capacity** ([`iop_wire::runtime::REFUSED_CAPACITY_EXHAUSTED`]: a Node
///   serving several Edges is full while this Edge's own leases say it is not; nothing reached
///   the provider): after a pause (10 ms doubling to 400 ms, jittered) the request is admitted
///   again, to whichever candidate has room, as often as fits in the pool's queue wait (then
///   503, as a wait that ran out).
///
/// Each attempt is its own span.
#[allow(clippy::too_many_arguments, reason = "one request's whole context")]
fn dispatch_tunnel<'a>(
    state: &'a AppState,
    dialect: Dialect,
    caller: &'a Caller,
    group: &'a str,
    model: &'a str,
    mut admission: Admission,
    request: PoolRequest,
    server: Option<&'a iop_telemetry::Span>,
) -> impl Future<Output = Result<(crate::transport::TunnelStream, iop_telemetry::Span), Response>> + 'a
{
    use crate::transport::Unanswered;
    // An `async` block for the reason given at `send`.
    async move {
        let shape = |a: &Admission| {
            let l = a.lease();
            (l.kind, l.target.clone(), state.catalog.profile_arc(a))
        };
        let mut number = 1;
        let mut reason = "first";
        // A fallback after a lost connection needs another Node serving the group.
        let fallbacks = if state.catalog.models.get(group).is_some_and(|c| c.nodes > 1) {
            MAX_ATTEMPTS - 1
        } else {
            0
        };
        let mut lost = 0;
        let deadline = tokio::time::Instant::now() + state.config.queue_wait;
        let mut pauses = capacity_pauses();
        loop {
            let mut attempt = attempt_span(state, server, number, reason, admission.lease());
            // Kept for a second attempt: a refusal for capacity can come whatever the group.
            let this = request.clone();
            let before = (shape(&admission), admission.lease().key.node_id.clone());
            let mut s = match send(
                state,
                dialect,
                caller,
                group,
                model,
                admission,
                this,
                &mut attempt,
            )
            .await?
            {
                Dispatched::Tunnel(s) => s,
                Dispatched::Run(_) => {
                    return Err(render::error(
                        dialect,
                        StatusCode::BAD_GATEWAY,
                        render::PROVIDER_FAILED,
                    ));
                }
            };
            let Some(why) = s.unanswered().await else {
                return Ok((s, attempt));
            };
            let (before, before_node) = before;
            let trace_id = server
                .and_then(iop_telemetry::Span::trace_id)
                .unwrap_or_default();
            match why {
                Unanswered::NodeDisconnected => {
                    attempt.event("node_disconnected", Vec::new());
                    attempt.fail("node_disconnected");
                    if lost >= fallbacks {
                        return Err(render::error(
                            dialect,
                            StatusCode::BAD_GATEWAY,
                            render::PROVIDER_FAILED,
                        ));
                    }
                    lost += 1;
                    tracing::warn!(
                        node_id = %before_node,
                        %trace_id,
                        "the Node's connection ended before it answered; sending the request to another candidate"
                    );
                    reason = "fallback";
                }
                _ => {
                    attempt.event("capacity_refused", Vec::new());
                    attempt.fail("capacity_refused");
                    capacity_pause(&mut pauses, deadline, &before_node, dialect, model).await?;
                    reason = "capacity";
                }
            }
            drop(attempt);
            drop(s);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let next = state
                .edge
                .admit(
                    group,
                    ContextSize::Standard,
                    left.max(Duration::from_millis(1)),
                )
                .await
                .map_err(|e| render::dispatch_error(dialect, e, model))?;
            if shape(&next) != before {
                return Err(render::error(
                    dialect,
                    StatusCode::BAD_GATEWAY,
                    render::PROVIDER_FAILED,
                ));
            }
            admission = next;
            number += 1;
        }
    }
}

/// Sends a normalized run, and sends it again when the Node refused it for capacity, as
/// [`dispatch_tunnel`] does (after a jittered pause, within the pool's queue wait, then 503).
#[allow(clippy::too_many_arguments, reason = "one request's whole context")]
async fn dispatch_run(
    state: &AppState,
    dialect: Dialect,
    caller: &Caller,
    group: &str,
    model: &str,
    mut admission: Admission,
    request: PoolRequest,
    server: Option<&iop_telemetry::Span>,
) -> Result<(crate::transport::RunStream, iop_telemetry::Span), Response> {
    let deadline = tokio::time::Instant::now() + state.config.queue_wait;
    let mut pauses = capacity_pauses();
    let mut number = 1;
    let mut reason = "first";
    loop {
        let mut attempt = attempt_span(state, server, number, reason, admission.lease());
        let node = admission.lease().key.node_id.clone();
        let mut s = match send(
            state,
            dialect,
            caller,
            group,
            model,
            admission,
            request.clone(),
            &mut attempt,
        )
        .await?
        {
            Dispatched::Run(s) => s,
            Dispatched::Tunnel(_) => {
                return Err(render::error(
                    dialect,
                    StatusCode::BAD_GATEWAY,
                    render::PROVIDER_FAILED,
                ));
            }
        };
        if s.unanswered().await.is_none() {
            return Ok((s, attempt));
        }
        attempt.event("capacity_refused", Vec::new());
        attempt.fail("capacity_refused");
        capacity_pause(&mut pauses, deadline, &node, dialect, model).await?;
        drop((attempt, s));
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        admission = state
            .edge
            .admit(
                group,
                ContextSize::Standard,
                left.max(Duration::from_millis(1)),
            )
            .await
            .map_err(|e| render::dispatch_error(dialect, e, model))?;
        number += 1;
        reason = "capacity";
    }
}

/// The pauses between capacity refusals ([`CAPACITY_PAUSE_MIN`] doubling to
/// [`CAPACITY_PAUSE_MAX`], each drawn from 50–100 % of it).
fn capacity_pauses() -> iop_wire::backoff::Retries {
    let policy = || iop_wire::backoff::Backoff::exponential(CAPACITY_PAUSE_MIN, CAPACITY_PAUSE_MAX);
    iop_wire::backoff::Retries::new(policy().with_jitter(0.5).unwrap_or_else(|_| policy()))
}

/// Sleeps the next pause after Node `node` refused for capacity, or answers 503 (a wait that
/// ran out) when it would end past `deadline`.
async fn capacity_pause(
    pauses: &mut iop_wire::backoff::Retries,
    deadline: tokio::time::Instant,
    node: &str,
    dialect: Dialect,
    model: &str,
) -> Result<(), Response> {
    let mut random = [0u8; 4];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random);
    let wait = pauses.next_delay(u32::from_le_bytes(random));
    if tokio::time::Instant::now() + wait >= deadline {
        tracing::info!(node_id = %node, "the Node refused for capacity until the queue wait ran out");
        return Err(render::dispatch_error(
            dialect,
            crate::DispatchError::WaitTimeout,
            model,
        ));
    }
    tracing::debug!(node_id = %node, "the Node refused for capacity; sending the request again after a pause");
    tokio::time::sleep(wait).await;
    Ok(())
}

/// A managed request's refusal in the route's dialect (503s with `Retry-After` where the
/// machine says so).
fn refused(dialect: Dialect, model: &str, refusal: &Refusal) -> Response {
    let status = StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut r = match refusal {
        Refusal::UnknownModel => return render::not_found_model(dialect, model),
        _ if status == StatusCode::SERVICE_UNAVAILABLE => {
            render::overloaded(dialect, &refusal.message())
        }
        _ => render::error(dialect, status, &refusal.message()),
    };
    if let Some(secs) = refusal.retry_after() {
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(secs));
    }
    r
}

/// A tunnel request for `operation` with `body` (the pool fills in adapter, target and the
/// stall timeout).
fn tunnel(run_id: String, operation: Operation, body: &Value, stream: bool) -> PoolRequest {
    tunnel_bytes(run_id, operation, Bytes::from(body.to_string()), stream)
}

/// [`tunnel`] with the body already in bytes.
fn tunnel_bytes(run_id: String, operation: Operation, body: Bytes, stream: bool) -> PoolRequest {
    PoolRequest::Tunnel(ProviderTunnelRequest {
        run_id,
        adapter: String::new(),
        target: String::new(),
        method: "POST".into(),
        path: String::new(),
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body,
        stream,
        operation: Some(operation),
        ..Default::default()
    })
}

/// On a passthrough to an Anthropic upstream, the client's `anthropic-beta` header (the
/// features it opts into, e.g. Claude Code's) goes along; nothing else of the client's does.
fn forward_anthropic_beta(headers: &HeaderMap, request: &mut PoolRequest) {
    if let PoolRequest::Tunnel(t) = request
        && let Some(v) = headers.get("anthropic-beta")
        && v.len() <= 4096
    {
        t.headers.push(Header {
            name: "anthropic-beta".into(),
            value: Bytes::copy_from_slice(v.as_bytes()),
        });
    }
}

fn native_run(run_id: String, input: &Value) -> PoolRequest {
    PoolRequest::Run(RunRequest {
        run_id,
        adapter: String::new(),
        target: String::new(),
        input: Bytes::from(input.to_string()),
        metadata: std::collections::BTreeMap::new(),
        response_stall_timeout: ResponseStallTimeout::DEFAULT,
        timeout: None,
        long_context: false,
        credential: None,
        trace: None,
    })
}

fn with_model(mut body: Value, target: &str) -> Value {
    body["model"] = Value::String(target.to_owned());
    body
}

/// What differs between the three chat-like routes.
struct Route {
    dialect: Dialect,
    operation: Operation,
    /// Run id prefix on the wire (`chatcmpl`, `resp`, `msg`).
    run_prefix: &'static str,
    /// The client-visible id for request `n`.
    id: fn(u64) -> String,
    /// Checks the request has what every plan needs (400 otherwise).
    check: fn(&Value) -> Result<(), TranslateError>,
    /// The request in chat form (the route's own translation to it).
    to_chat: fn(&Value) -> Result<Value, TranslateError>,
    /// The native run input from the request and its chat form.
    native_input: fn(&Value, &Value) -> Value,
    /// The client side of the response for this request.
    client: fn(&Value, Meta, bool) -> render::ClientSide,
}

/// A route's endpoint label and its server span's name (`{method} {route}`).
fn route_names(operation: Operation) -> (Endpoint, &'static str, &'static str) {
    match operation {
        Operation::Responses => (Endpoint::Responses, "POST /v1/responses", "/v1/responses"),
        Operation::Messages => (Endpoint::Messages, "POST /v1/messages", "/v1/messages"),
        _ => (
            Endpoint::ChatCompletions,
            "POST /v1/chat/completions",
            "/v1/chat/completions",
        ),
    }
}

/// Serves one chat-like request: see the module docs for the path it takes. Its server span
/// continues the client's `traceparent`; it ends here on an early answer, or with the
/// response stream (it rides on it in [`observe::Observed`]).
async fn serve_route(
    state: &AppState,
    route: &Route,
    headers: &HeaderMap,
    app_key: Option<&crate::limits::KeyId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = std::time::Instant::now();
    let (_, span_name, http_route) = route_names(route.operation);
    let client = observe::client_context(headers);
    let telemetry = &state.config.telemetry;
    let server = if telemetry.is_on() {
        telemetry.span(
            span_name,
            iop_telemetry::SpanKind::Server,
            client.as_ref(),
            iop_telemetry::attributes([
                iop_telemetry::attr::http_method("POST"),
                iop_telemetry::attr::http_route(http_route),
                iop_telemetry::attr::operation("chat"),
            ]),
        )
    } else {
        telemetry.span(
            span_name,
            iop_telemetry::SpanKind::Server,
            client.as_ref(),
            Vec::new(),
        )
    };
    let mut server = Some(server);
    let response = serve_traced(state, route, headers, app_key, body, started, &mut server).await;
    if let Some(mut span) = server {
        let status = response.status().as_u16();
        span.set(iop_telemetry::attr::http_status(status));
        if status >= 400 {
            span.fail(observe::status_error(status));
        }
    }
    response
}

/// [`serve_route`] under its server span (`server` is taken when the response streams).
async fn serve_traced(
    state: &AppState,
    route: &Route,
    headers: &HeaderMap,
    app_key: Option<&crate::limits::KeyId>,
    body: Result<Bytes, BytesRejection>,
    started: std::time::Instant,
    server: &mut Option<iop_telemetry::Span>,
) -> Response {
    let dialect = route.dialect;
    // The request's parts are moved into `serve_admitted`'s future, built in this block: a
    // local that lived on to the `.await` would keep its room in this future after the move.
    let (admitted, quota) = {
        let parsed = match parse(dialect, body) {
            Ok(p) => p,
            Err(r) => return r,
        };
        if let Some(s) = server.as_mut()
            && s.is_recording()
        {
            s.set(iop_telemetry::attr::request_model(observe::model_attr(
                &parsed.model,
            )));
        }
        let caller = match authenticate(state, dialect, headers, app_key) {
            Ok(c) => c,
            Err(r) => return r,
        };
        if let Err(e) = (route.check)(&parsed.json) {
            return bad_request(dialect, &e);
        }
        let group = match model_group(state, dialect, &caller, &parsed.model) {
            Ok(g) => g,
            Err(r) => return r,
        };
        if !state
            .catalog
            .models
            .get(&group)
            .is_some_and(|caps| caps.can_serve(route.operation))
        {
            return unservable(dialect, &parsed.model, route.operation);
        }
        let hold = match limit(state, dialect, &caller, &group, &parsed.json, || {
            (route.to_chat)(&parsed.json)
        })
        .await
        {
            // Boxed before it is held across the dispatch (744 bytes of every handler's future
            // otherwise); a hold with something in it rides on the stream in this box.
            Ok(h) => Box::new(h),
            Err(r) => return r,
        };
        let quota = *hold.quota();
        (
            serve_admitted(
                state, route, headers, parsed, caller, group, hold, started, server,
            ),
            quota,
        )
    };
    with_quota(admitted.await, dialect, &quota)
}

/// The rest of [`serve_route`], once the key's limits admitted the request: the hold rides
/// on the response stream (or is given back when nothing was sent), inside the
/// [`observe::Observed`] watch that finishes the spans and the metrics.
#[allow(clippy::too_many_arguments, reason = "one request's whole context")]
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` keeps its arguments twice"
)]
fn serve_admitted<'a>(
    state: &'a AppState,
    route: &'a Route,
    headers: &'a HeaderMap,
    mut parsed: Parsed,
    caller: Caller,
    group: String,
    mut hold: Box<crate::limits::Hold>,
    started: std::time::Instant,
    server: &'a mut Option<iop_telemetry::Span>,
) -> impl Future<Output = Response> + 'a {
    // An `async` block for the reason given at `send`.
    async move {
        let dialect = route.dialect;
        let waiting = server
            .as_ref()
            .is_some_and(iop_telemetry::Span::is_recording)
            .then(SystemTime::now);
        let admission = match admit(state, dialect, &group, &parsed.model).await {
            Ok(a) => a,
            Err(r) => return r,
        };
        // The wait for a provider, as a span of its own only when there was one.
        if admission.queued()
            && let (Some(s), Some(waiting)) = (server.as_ref(), waiting)
        {
            drop(state.config.telemetry.span_at(
                "queue",
                iop_telemetry::SpanKind::Internal,
                s.context().as_ref(),
                Vec::new(),
                Some(waiting),
            ));
        }
        let lease = admission.lease();
        hold.provider(&lease.key);
        let plan = plan(
            route.operation,
            lease.kind,
            state.catalog.profile(&admission),
        );
        let target = lease.target.clone();
        let n = next_request();
        let run_id = format!("{}-{n}", route.run_prefix);
        let mut strip_usage = false;
        let asks_usage = !instance_in(&state.config.no_stream_usage, lease);
        let request = match plan {
            Plan::Unservable => return unservable(dialect, &parsed.model, route.operation),
            Plan::Passthrough(op) => {
                let ask = op == Operation::ChatCompletions && parsed.stream && asks_usage;
                // The client's own bytes with `model` spliced in; re-serialised only where the
                // splice declines (a name twice or escaped, a `stream_options` to merge into).
                let raw = std::mem::take(&mut parsed.raw);
                let spliced = iop_dialect::splice::passthrough(&raw, &parsed.json, &target, ask)
                    .unwrap_or_else(|| {
                        // The body is not needed again on a passthrough: move it, not copy it.
                        let json = std::mem::take(&mut parsed.json);
                        iop_dialect::splice::reserialised(json, &target, ask)
                    });
                strip_usage = spliced.asked_usage;
                // Nothing reads the tree again on a passthrough: it is freed here, not held
                // while the request waits for the provider's answer.
                parsed.json = Value::Null;
                let mut request = tunnel_bytes(run_id, op, spliced.body, parsed.stream);
                if dialect == Dialect::Messages {
                    forward_anthropic_beta(headers, &mut request);
                }
                request
            }
            Plan::ViaChat | Plan::ViaMessages | Plan::Native => {
                let chat = match (route.to_chat)(&parsed.json) {
                    Ok(c) => c,
                    Err(e) => return bad_request(dialect, &e),
                };
                match plan {
                    Plan::ViaChat => {
                        let mut body = with_model(chat, &target);
                        if parsed.stream && asks_usage {
                            // The translator reads the usage chunk; the client never sees it.
                            iop_dialect::splice::ask_for_usage(&mut body);
                        }
                        tunnel(run_id, Operation::ChatCompletions, &body, parsed.stream)
                    }
                    Plan::ViaMessages => match iop_dialect::request::chat_to_messages(&chat) {
                        Ok(m) => tunnel(
                            run_id,
                            Operation::Messages,
                            &with_model(m, &target),
                            parsed.stream,
                        ),
                        Err(e) => return bad_request(dialect, &e),
                    },
                    _ => {
                        // Boxed: a normalized run's state is large and only the native
                        // providers need it.
                        let native = Native {
                            caller: &caller,
                            group: &group,
                            parsed: &parsed,
                            chat,
                            run_id,
                            n,
                            started,
                        };
                        return Box::pin(serve_native(
                            state, route, native, admission, hold, server,
                        ))
                        .await;
                    }
                }
            }
        };
        let dispatched = match dispatch_tunnel(
            state,
            dialect,
            &caller,
            &group,
            &parsed.model,
            admission,
            request,
            server.as_ref(),
        )
        .await
        {
            Ok((mut s, attempt)) => {
                s.watch(observed(
                    state, route, &group, started, hold, server, attempt,
                ));
                s
            }
            Err(r) => return r,
        };
        let upstream = match plan {
            Plan::ViaChat => Upstream::Chat,
            Plan::ViaMessages => Upstream::Messages,
            _ => {
                let strip = strip_usage.then(iop_dialect::sse::UsageChunkFilter::default);
                return render::passthrough_with(dialect, dispatched, strip).await;
            }
        };
        let meta = Meta {
            id: (route.id)(n),
            model: parsed.model.clone(),
            created: unix_now(),
        };
        let client = (route.client)(&parsed.json, meta, parsed.stream);
        render::translated(upstream, dispatched, client).await
    }
}

/// What [`serve_native`] takes of [`serve_admitted`]'s request.
struct Native<'a> {
    caller: &'a Caller,
    group: &'a str,
    parsed: &'a Parsed,
    chat: Value,
    run_id: String,
    n: u64,
    started: std::time::Instant,
}

/// [`serve_admitted`] for a provider without the client's protocol: the request as a
/// normalized run, its events rendered in the client's dialect.
async fn serve_native(
    state: &AppState,
    route: &Route,
    native: Native<'_>,
    admission: Admission,
    hold: Box<crate::limits::Hold>,
    server: &mut Option<iop_telemetry::Span>,
) -> Response {
    let Native {
        caller,
        group,
        parsed,
        chat,
        run_id,
        n,
        started,
    } = native;
    let dialect = route.dialect;
    let tools = crate::tools::declared(&chat);
    let input = (route.native_input)(&parsed.json, &chat);
    let run = native_run(run_id, &input);
    let meta = Meta {
        id: (route.id)(n),
        model: parsed.model.clone(),
        created: unix_now(),
    };
    let client = (route.client)(&parsed.json, meta, parsed.stream);
    match dispatch_run(
        state,
        dialect,
        caller,
        group,
        &parsed.model,
        admission,
        run,
        server.as_ref(),
    )
    .await
    {
        Ok((mut s, attempt)) => {
            s.watch(observed(
                state, route, group, started, hold, server, attempt,
            ));
            let events = render::NativeEvents::new(tools, parsed.stream);
            render::native(s, events, client).await
        }
        Err(r) => r,
    }
}

/// The watch on a dispatched stream that finishes the request's spans and metrics, around the
/// limits' `hold` when it holds anything (it rides on the stream, marked sent).
fn observed(
    state: &AppState,
    route: &Route,
    group: &str,
    started: std::time::Instant,
    mut hold: Box<crate::limits::Hold>,
    server: &mut Option<iop_telemetry::Span>,
    attempt: iop_telemetry::Span,
) -> Box<observe::Observed> {
    let inner: Option<Box<dyn crate::transport::StreamWatch>> = if hold.is_empty() {
        None
    } else {
        hold.sent();
        Some(hold)
    };
    Box::new(observe::Observed::new(
        inner,
        state.edge.metrics().clone(),
        route_names(route.operation).0,
        group.to_owned(),
        started,
        server.take().unwrap_or_else(iop_telemetry::Span::none),
        attempt,
    ))
}

/// A chat-like route's handler: [`serve_route`] under [`measured`]. An `async` block, not an
/// `async fn` handler, for the reason given at [`send`].
#[expect(
    clippy::manual_async_fn,
    reason = "an `async fn` keeps its arguments twice"
)]
fn handle(
    state: AppState,
    endpoint: Endpoint,
    route: &'static Route,
    headers: HeaderMap,
    app_key: Option<axum::Extension<crate::limits::KeyId>>,
    body: Result<Bytes, BytesRejection>,
) -> impl Future<Output = Response> {
    async move {
        measured(
            &state,
            endpoint,
            serve_route(&state, route, &headers, app_key.as_deref(), body),
        )
        .await
    }
}

/// Records the outcome and duration of a handler in the Edge's metrics. A combinator, not an
/// `async fn`: an `async fn` would hold the handler's future twice (as its argument and as the
/// future it awaits), and the handler futures are kilobytes that axum moves into a box per
/// request.
///
/// The chat-like handlers' futures are 3,472 bytes (9,880 before issue #33's sixteenth stop;
/// test `a_chat_requests_future_stays_small`): each is held in a box for as long as its
/// request waits for the provider's answer (`proc_load waiting`: 26.7 KiB of Edge memory per
/// waiting request, against 34.0; 24.3 with a passthrough's JSON tree freed before the wait),
/// and moved about a dozen times on its way there.
///
/// Tried and not kept (issue #33, `benches/README.md`): building the work here in a box
/// allocated first (`Box::write(Box::new_uninit(), work())`, the work passed as a closure),
/// so that axum moves 464 bytes instead of 9,880 three times. It took a quarter of the Edge's
/// instructions per request (callgrind, 143.6k to 106.7k), but the Edge's CPU per request in
/// the closed loop at 16 clients came out higher than without it in nine interleaved pairs of
/// nine, and no timing improved.
fn measured<'a>(
    state: &'a AppState,
    endpoint: Endpoint,
    response: impl Future<Output = Response> + 'a,
) -> impl Future<Output = Response> + 'a {
    use futures_util::FutureExt as _;
    let started = std::time::Instant::now();
    response.map(move |response| {
        state
            .edge
            .metrics()
            .answered(endpoint, response.status().as_u16(), started.elapsed());
        response
    })
}

// === Models, health, metrics ===

async fn models(
    State(state): State<AppState>,
    headers: HeaderMap,
    app_key: Option<axum::Extension<crate::limits::KeyId>>,
) -> Response {
    let anthropic = headers.contains_key("anthropic-version");
    let dialect = if anthropic {
        Dialect::Messages
    } else {
        Dialect::Chat
    };
    measured(&state, Endpoint::Models, async {
        let names: Vec<String> = match authenticate(&state, dialect, &headers, app_key.as_deref()) {
            Err(r) => return r,
            // Managed: the models the caller's principal has routes for.
            Ok(Caller::Managed {
                index, principal, ..
            }) => state
                .config
                .models
                .iter()
                .filter(|m| index.route(&principal, m).is_some())
                .cloned()
                .collect(),
            Ok(Caller::Open(_)) => state.config.models.clone(),
        };
        let body = if anthropic {
            let data: Vec<Value> = names
                .iter()
                .map(|m| json!({ "type": "model", "id": m, "display_name": m, "created_at": "1970-01-01T00:00:00Z" }))
                .collect();
            json!({ "data": data, "has_more": false, "first_id": names.first(), "last_id": names.last() })
        } else {
            let data: Vec<Value> = names
                .iter()
                .map(|m| json!({ "id": m, "object": "model", "created": 0, "owned_by": "iop" }))
                .collect();
            json!({ "object": "list", "data": data })
        };
        render::json_response(StatusCode::OK, &body)
    })
    .await
}

async fn metrics(State(state): State<AppState>) -> Response {
    let (queue, in_flight) = state.edge.pool_stats();
    state
        .edge
        .metrics()
        .telemetry(state.config.telemetry.stats());
    let mut text = state.edge.metrics().render(queue, in_flight);
    if let Some(limiter) = &state.config.limiter {
        limiter.encode_metrics(&mut text);
    }
    if let Some(usage) = &state.config.usage {
        usage.encode_metrics(&mut text);
    }
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
}

async fn readyz(State(state): State<AppState>) -> Response {
    // Draining: the load balancer must stop sending here while the streams in flight end.
    if state.edge.is_draining() {
        return render::error(Dialect::Chat, StatusCode::SERVICE_UNAVAILABLE, "draining");
    }
    // Managed mode: no Control Plane session or no projection means every managed request
    // would be refused, so the Edge is not ready (a load balancer sends traffic elsewhere).
    if let Some(why) = state
        .config
        .control
        .as_ref()
        .and_then(|c| c.unready_reason())
    {
        return render::error(Dialect::Chat, StatusCode::SERVICE_UNAVAILABLE, &why);
    }
    if state.edge.ready_nodes().is_empty() {
        render::error(
            Dialect::Chat,
            StatusCode::SERVICE_UNAVAILABLE,
            "no node is ready",
        )
    } else {
        "ready".into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// axum and hyper move a handler's future by value about a dozen times per request
    /// before and while it runs (`memcpy` was a third of the Edge's instructions per request
    /// with the 9,880-byte futures of issue #33's fourteenth stop). The rare paths (a managed
    /// binding, a normalized run) are boxed, the hold is boxed, and the hot path's functions are
    /// `async` blocks, not `async fn`s, so their arguments are not kept twice.
    #[test]
    fn a_chat_requests_future_stays_small() {
        type Key = Option<axum::Extension<crate::limits::KeyId>>;
        type Body = Result<Bytes, BytesRejection>;
        fn future_size<F: Future>(_: fn(State<AppState>, HeaderMap, Key, Body) -> F) -> usize {
            size_of::<F>()
        }
        for (route, size) in [
            ("chat", future_size(chat::chat_completions)),
            ("messages", future_size(anthropic::messages)),
            ("responses", future_size(responses::responses)),
        ] {
            eprintln!("{route}: {size} bytes");
            assert!(size <= 4096, "the {route} handler's future is {size} bytes");
        }
    }

    fn profile(ops: &[Operation]) -> ConcreteProtocolProfile {
        ConcreteProtocolProfile {
            operation_paths: ops
                .iter()
                .map(|o| (*o, format!("/{}", o.as_str())))
                .collect(),
            ..ConcreteProtocolProfile::default()
        }
    }

    #[test]
    fn the_plan_prefers_passthrough_then_chat_then_messages() {
        use Operation::*;
        let chat_only = profile(&[Models, ChatCompletions]);
        let openai = profile(&[Models, ChatCompletions, Responses]);
        let anthropic = profile(&[Models, Messages, CountTokens]);
        let compat = ProviderKind::OpenAiCompat;
        assert_eq!(
            plan(ChatCompletions, compat, Some(&chat_only)),
            Plan::Passthrough(ChatCompletions)
        );
        assert_eq!(plan(Responses, compat, Some(&chat_only)), Plan::ViaChat);
        assert_eq!(plan(Messages, compat, Some(&chat_only)), Plan::ViaChat);
        assert_eq!(
            plan(Responses, compat, Some(&openai)),
            Plan::Passthrough(Responses)
        );
        assert_eq!(plan(Messages, compat, Some(&openai)), Plan::ViaChat);
        assert_eq!(
            plan(ChatCompletions, compat, Some(&anthropic)),
            Plan::ViaMessages
        );
        assert_eq!(plan(Responses, compat, Some(&anthropic)), Plan::ViaMessages);
        assert_eq!(
            plan(Messages, compat, Some(&anthropic)),
            Plan::Passthrough(Messages)
        );
        assert_eq!(
            plan(ChatCompletions, compat, Some(&profile(&[Models]))),
            Plan::Unservable
        );
        assert_eq!(plan(Messages, ProviderKind::Native, None), Plan::Native);
        let caps = ModelCaps {
            operations: [Models].into_iter().collect(),
            native: false,
            nodes: 1,
        };
        assert!(!caps.can_serve(ChatCompletions) && caps.can_serve(CountTokens));
        let caps = ModelCaps {
            operations: [Messages].into_iter().collect(),
            native: false,
            nodes: 1,
        };
        assert!(caps.can_serve(ChatCompletions) && caps.can_serve(Responses));
    }
}
