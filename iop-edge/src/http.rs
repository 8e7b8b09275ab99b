//! The OpenAI-compatible HTTP surface (axum) over [`EdgeHandle::dispatch`].
//!
//! - `GET /v1/models`: the configured model groups.
//! - `POST /v1/responses` (Responses API), streaming and not: passthrough for OpenAI-compatible
//!   providers (operation `responses`), a `response` object or `response.*` SSE events for
//!   native providers (`input` text or message items, `instructions` as a system message).
//! - `POST /v1/chat/completions`, streaming (`"stream": true`, SSE) and not. The external model
//!   name selects a model group; the pool picks a provider; the request is built after
//!   selection:
//!   - OpenAI-compatible providers get a `ProviderTunnelRequest` (operation
//!     `chat_completions`, the body re-serialized with `"model"` set to the provider's target),
//!     and the provider's status, headers and body are passed through byte for byte;
//!   - native providers (Ollama, demo) get a normalized `RunRequest` (`{"messages", "options",
//!     "tools"}`), rendered as an OpenAI `chat.completion` JSON or `chat.completion.chunk` SSE;
//!     `openai_tool_calls` metadata becomes `message.tool_calls` / `delta.tool_calls`; under the
//!     text tool-call fallback mark (`openai_text_tool_fallback = "true"`) calls written as
//!     `<tool_call>{…}</tool_call>` in the content are recovered (see [`crate::tools`]). A streamed
//!     request that declared tools holds back content that could become such a tag until the
//!     run completes.
//! - Errors use OpenAI's shape `{"error": {"message", "type", "code"}}`: 400 bad request,
//!   401 unauthenticated, 404 unknown model, 429 queue full, 503 no provider within the wait,
//!   502 provider failure.
//! - A client that disconnects — before or during the response — drops the dispatch stream,
//!   which makes the Edge send `CancelRequest` to the Node (upstream aborted).
//! - `/healthz` (process up) and `/readyz` (at least one Node dispatch-ready).
//!
//! - `/metrics`: Prometheus text (see [`crate::metrics`]).
//!
//! - `POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic Messages API): passthrough
//!   for OpenAI-compatible providers (operations `messages`, `count_tokens`); for native
//!   providers a `message` object or message stream events, and a token estimate.
//!
//! Authentication is a hook ([`AuthHook`]); the managed mode (token digests from the Control
//! Plane's projection) plugs in there with the Control Plane issue.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use iop_wire::runtime::{
    Header, Operation, ProviderTunnelRequest, RunEvent, RunEventKind, RunRequest,
};
use iop_wire::tunnel::Delivery;
use iop_wire::validate::ResponseStallTimeout;
use serde_json::{Value, json};

use crate::metrics::Endpoint;
use crate::pool::ProviderKind;
use crate::transport::{
    DispatchError, Dispatched, EdgeHandle, PoolRequest, RunStream, TunnelEvent,
};

/// Largest request body accepted.
pub const MAX_REQUEST_BODY: usize = 8 * 1024 * 1024;

/// Decides whether a request's bearer token (if any) may use the API. The Control Plane's
/// managed mode plugs token-digest verification in here.
pub type AuthHook = Arc<dyn Fn(Option<&str>) -> bool + Send + Sync>;

/// HTTP surface settings.
#[derive(Clone)]
pub struct HttpConfig {
    /// External model names served (for `/v1/models`).
    pub models: Vec<String>,
    /// How long a request may wait in the pool queue.
    pub queue_wait: Duration,
    /// Bearer-token check; `None` accepts every request (local mesh). Not consulted in
    /// managed mode, where the projection authenticates.
    pub auth: Option<AuthHook>,
    /// Managed mode: the Control Plane connector whose projection authenticates requests and
    /// resolves routes, and whose session delivers credential leases ([`crate::control`]).
    pub control: Option<crate::control::ControlConnector>,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("models", &self.models)
            .field("queue_wait", &self.queue_wait)
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
struct AppState {
    edge: EdgeHandle,
    config: Arc<HttpConfig>,
}

/// The axum router of the OpenAI-compatible surface.
pub fn router(edge: EdgeHandle, config: HttpConfig) -> Router {
    let state = AppState {
        edge,
        config: Arc::new(config),
    };
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY))
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` completes (then finishes in-flight
/// requests), with `TCP_NODELAY` on every accepted connection.
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
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection failed");
        }
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({ "error": { "message": message, "type": kind, "code": status.as_u16() } });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn dispatch_error(e: DispatchError) -> Response {
    match e {
        DispatchError::UnknownModel => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model not found",
        ),
        DispatchError::QueueFull => error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "too many queued requests",
        ),
        DispatchError::WaitTimeout | DispatchError::NotReady | DispatchError::Disconnected => {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "no provider available",
            )
        }
        DispatchError::InvalidRequest => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid request",
        ),
        DispatchError::Stopped => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "edge is shutting down",
        ),
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

fn managed(state: &AppState) -> Option<&crate::control::ControlConnector> {
    state.config.control.as_ref().filter(|c| c.managed())
}

fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    if managed(state).is_some() {
        return true; // the managed path authenticates against the projection
    }
    let Some(hook) = &state.config.auth else {
        return true;
    };
    hook(bearer(headers))
}

/// Managed mode: authenticate against the current projection.
#[expect(
    clippy::result_large_err,
    reason = "the error is the response itself, returned at once"
)]
fn authenticate(
    control: &crate::control::ControlConnector,
    headers: &HeaderMap,
) -> Result<(Arc<crate::control::ProjectionIndex>, String, String), Response> {
    let Some(index) = control.projection() else {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "credential plane not ready",
        ));
    };
    let token = bearer(headers).unwrap_or_default().to_owned();
    let Some(principal) = index.authenticate(&token).map(str::to_owned) else {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid api key",
        ));
    };
    Ok((index, principal, token))
}

/// Dispatches a request: through the pool directly, or in managed mode after authentication,
/// route resolution, pool admission, a lease for exactly the selected Node and two binding
/// checks (request snapshot before acquisition, current projection before dispatch).
async fn dispatch_for(
    state: &AppState,
    headers: &HeaderMap,
    model: &str,
    build: crate::transport::BuildRequest,
) -> Result<Dispatched, Response> {
    let Some(control) = managed(state) else {
        return pool_dispatch(state, model, build).await;
    };
    let (index, principal, token) = authenticate(control, headers)?;
    let Some(route) = index.route(&principal, model).cloned() else {
        return Err(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model not found",
        ));
    };
    let admission = state
        .edge
        .admit(&route.model, false, state.config.queue_wait)
        .await
        .map_err(dispatch_error)?;
    let lease = admission.lease().clone();
    let refuse = |msg: &str| error(StatusCode::BAD_GATEWAY, "server_error", msg);
    if lease.kind != ProviderKind::OpenAiCompat || lease.target != route.upstream_target {
        // A bound route is served only by its own upstream target; no fallback.
        return Err(refuse("no provider serves this route's upstream target"));
    }
    let Some(recipient) = admission.recipient().cloned() else {
        return Err(refuse("selected node has no credential recipient key"));
    };
    let binding = iop_wire::runtime::CredentialLeaseBinding {
        principal_id: principal,
        slot_id: route.slot_id.clone(),
        route_id: route.route_id.clone(),
        profile: route.profile.clone(),
        upstream_target: route.upstream_target.clone(),
        node_id: lease.key.node_id.clone(),
        recipient_key_id: recipient.key_id.clone(),
        credential_revision: route.credential_revision,
        route_revision: route.route_revision,
        projection_generation: index.generation(),
    };
    let forbidden = |msg: &str| error(StatusCode::FORBIDDEN, "permission_error", msg);
    if !index.admits(&token, model, &binding) {
        return Err(forbidden("request scope changed"));
    }
    let credential = match control
        .acquire_lease(binding.clone(), recipient.public_key)
        .await
    {
        Ok(lease) => lease,
        Err(crate::control::LeaseError::Refused(reason)) => {
            return Err(forbidden(&format!("credential lease refused: {reason}")));
        }
        Err(_) => {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "control plane unavailable",
            ));
        }
    };
    // Immediately before dispatch: the current projection must still admit the binding
    // (a token revoked or a slot rotated meanwhile fails closed).
    if !control
        .projection()
        .is_some_and(|current| current.admits(&token, model, &binding))
    {
        return Err(forbidden("credentials changed; request refused"));
    }
    let request = match build(&lease) {
        PoolRequest::Tunnel(mut req) => {
            req.credential = Some(iop_wire::runtime::ManagedCredential {
                lease: credential,
                binding,
            });
            PoolRequest::Tunnel(req)
        }
        other => other,
    };
    state
        .edge
        .send_admitted(admission, request)
        .await
        .map_err(dispatch_error)
}

async fn metrics(State(state): State<AppState>) -> Response {
    let (queue, in_flight) = state.edge.pool_stats().await.unwrap_or((0, 0));
    let text = state.edge.metrics().render(queue, in_flight);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.edge.ready_nodes().await {
        Ok(nodes) if !nodes.is_empty() => "ready".into_response(),
        _ => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no node is ready",
        ),
    }
}

async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if !authorized(&state, &headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid api key",
        );
    }
    let names: Vec<String> = match managed(&state) {
        // Managed: the models the caller's principal has routes for.
        Some(control) => match authenticate(control, &headers) {
            Ok((index, principal, _)) => state
                .config
                .models
                .iter()
                .filter(|m| index.route(&principal, m).is_some())
                .cloned()
                .collect(),
            Err(r) => return r,
        },
        None => state.config.models.clone(),
    };
    let data: Vec<Value> = names
        .iter()
        .map(|m| json!({ "id": m, "object": "model", "created": 0, "owned_by": "iop" }))
        .collect();
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

static REQUESTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A fresh run id `<prefix>-<n>` (valid on the wire: letters, digits, `-`).
fn next_id(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        REQUESTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// Dispatches through the pool, mapping refusals to their OpenAI-shaped error response.
async fn pool_dispatch(
    state: &AppState,
    model: &str,
    build: crate::transport::BuildRequest,
) -> Result<Dispatched, Response> {
    state
        .edge
        .dispatch(model, false, state.config.queue_wait, build)
        .await
        .map_err(dispatch_error)
}

/// A parsed request body, authenticated: `(json, model, stream)`, or the error response.
#[expect(
    clippy::result_large_err,
    reason = "the error is the response itself, returned at once"
)]
fn parse(
    state: &AppState,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(Value, String, bool), Response> {
    if !authorized(state, headers) {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid api key",
        ));
    }
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "request body is not JSON",
        ));
    };
    let Some(model) = request["model"].as_str().map(str::to_owned) else {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`model` is required",
        ));
    };
    let stream = request["stream"].as_bool().unwrap_or(false);
    Ok((request, model, stream))
}

/// The builder of a pool dispatch: the provider's own operation for OpenAI-compatible
/// providers (the body re-serialized with the served target), or `native_input` as a normalized
/// run for native ones.
fn build(
    request: Value,
    run_id: String,
    stream: bool,
    operation: Operation,
    path: &'static str,
    native_input: Value,
) -> crate::transport::BuildRequest {
    Box::new(move |lease| match lease.kind {
        ProviderKind::OpenAiCompat => {
            // The final body is built now that the served target is known.
            let mut upstream = request;
            upstream["model"] = Value::String(lease.target.clone());
            PoolRequest::Tunnel(ProviderTunnelRequest {
                run_id,
                adapter: String::new(),
                target: String::new(),
                method: "POST".into(),
                path: path.into(),
                headers: vec![Header {
                    name: "content-type".into(),
                    value: Bytes::from_static(b"application/json"),
                }],
                body: Bytes::from(upstream.to_string()),
                stream,
                timeout: None,
                metadata: BTreeMap::new(),
                session_id: String::new(),
                long_context: false,
                operation: Some(operation),
                response_stall_timeout: ResponseStallTimeout::DEFAULT,
                credential: None,
            })
        }
        ProviderKind::Native if native_input.is_null() => PoolRequest::Nothing,
        ProviderKind::Native => PoolRequest::Run(RunRequest {
            run_id,
            adapter: String::new(),
            target: String::new(),
            input: Bytes::from(native_input.to_string()),
            metadata: BTreeMap::new(),
            response_stall_timeout: ResponseStallTimeout::DEFAULT,
            timeout: None,
            long_context: false,
            credential: None,
        }),
    })
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let started = std::time::Instant::now();
    let response = chat_completions_inner(&state, headers, body).await;
    let ok = response.status().is_success();
    state
        .edge
        .metrics()
        .request(Endpoint::ChatCompletions, ok, started.elapsed());
    response
}

async fn chat_completions_inner(state: &AppState, headers: HeaderMap, body: Bytes) -> Response {
    let (request, model, stream) = match parse(state, &headers, &body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    if !request["messages"].is_array() {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`messages` must be an array",
        );
    }
    let run_id = next_id("chatcmpl");
    let tools = crate::tools::declared(&request);
    let mut input = json!({ "messages": request["messages"].clone() });
    for key in ["tools", "options"] {
        if !request[key].is_null() {
            input[key] = request[key].clone();
        }
    }
    let build = build(
        request,
        run_id.clone(),
        stream,
        Operation::ChatCompletions,
        "/chat/completions",
        input,
    );
    let dispatched = match dispatch_for(state, &headers, &model, build).await {
        Ok(d) => d,
        Err(r) => return r,
    };
    match dispatched {
        Dispatched::Tunnel(s) => passthrough(s).await,
        Dispatched::Run(s) if stream => sse(s, run_id, model, tools),
        Dispatched::Run(s) => completion(s, run_id, model, &tools).await,
        Dispatched::Nothing => error(StatusCode::BAD_GATEWAY, "server_error", "no request built"),
    }
}

/// Responses API input (`input` as text or message items, optional `instructions`) as
/// normalized chat messages.
fn responses_messages(request: &Value) -> Option<Value> {
    let mut messages = Vec::new();
    if let Some(instructions) = request["instructions"].as_str() {
        messages.push(json!({ "role": "system", "content": instructions }));
    }
    match &request["input"] {
        Value::String(text) => messages.push(json!({ "role": "user", "content": text })),
        Value::Array(items) => {
            for item in items {
                let role = item["role"].as_str().unwrap_or("user");
                let content = match &item["content"] {
                    Value::String(t) => t.clone(),
                    Value::Array(parts) => parts
                        .iter()
                        .filter_map(|p| p["text"].as_str())
                        .collect::<Vec<_>>()
                        .join(""),
                    _ => return None,
                };
                messages.push(json!({ "role": role, "content": content }));
            }
        }
        _ => return None,
    }
    Some(Value::Array(messages))
}

async fn responses(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let started = std::time::Instant::now();
    let response = responses_inner(&state, headers, body).await;
    let ok = response.status().is_success();
    state
        .edge
        .metrics()
        .request(Endpoint::Responses, ok, started.elapsed());
    response
}

async fn responses_inner(state: &AppState, headers: HeaderMap, body: Bytes) -> Response {
    let (request, model, stream) = match parse(state, &headers, &body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let Some(messages) = responses_messages(&request) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`input` must be text or message items",
        );
    };
    let run_id = next_id("resp");
    let build = build(
        request,
        run_id.clone(),
        stream,
        Operation::Responses,
        "/responses",
        json!({ "messages": messages }),
    );
    let dispatched = match dispatch_for(state, &headers, &model, build).await {
        Ok(d) => d,
        Err(r) => return r,
    };
    match dispatched {
        Dispatched::Tunnel(s) => passthrough(s).await,
        Dispatched::Run(s) if stream => responses_sse(s, run_id, model),
        Dispatched::Run(s) => response_object(s, run_id, model).await,
        Dispatched::Nothing => error(StatusCode::BAD_GATEWAY, "server_error", "no request built"),
    }
}

fn response_json(
    id: &str,
    model: &str,
    text: &str,
    usage: Option<iop_wire::runtime::Usage>,
    status: &str,
) -> Value {
    json!({
        "id": id,
        "object": "response",
        "created_at": unix_now(),
        "status": status,
        "model": model,
        "output": [{
            "type": "message",
            "id": format!("msg-{id}"),
            "status": status,
            "role": "assistant",
            "content": [{ "type": "output_text", "text": text, "annotations": [] }],
        }],
        "usage": usage.map_or(Value::Null, |u| json!({
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
        })),
    })
}

/// A non-streamed normalized run, rendered as a Responses API `response` object.
async fn response_object(mut s: RunStream, id: String, model: String) -> Response {
    let mut text = String::new();
    while let Some(ev) = s.next().await {
        match ev.kind {
            RunEventKind::Delta => text.push_str(&ev.delta),
            RunEventKind::Complete => {
                return axum::Json(response_json(&id, &model, &text, ev.usage, "completed"))
                    .into_response();
            }
            RunEventKind::Error | RunEventKind::Cancelled => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    "provider request failed",
                );
            }
            RunEventKind::Start => {}
        }
    }
    error(
        StatusCode::BAD_GATEWAY,
        "server_error",
        "provider request failed",
    )
}

/// A streamed normalized run as Responses API events (`response.created`,
/// `response.output_text.delta`…, `response.completed`).
fn responses_sse(s: RunStream, id: String, model: String) -> Response {
    let events = futures_util::stream::unfold(
        (s, String::new(), 0u64, false),
        move |(mut s, mut text, seq, done)| {
            let (id, model) = (id.clone(), model.clone());
            async move {
                if done {
                    return None;
                }
                let event = |kind: &str, data: Value| {
                    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
                };
                let ev = s.next().await?;
                let out = match ev.kind {
                    RunEventKind::Start => event(
                        "response.created",
                        json!({ "type": "response.created", "sequence_number": seq, "response": response_json(&id, &model, "", None, "in_progress") }),
                    ),
                    RunEventKind::Delta => {
                        text.push_str(&ev.delta);
                        event(
                            "response.output_text.delta",
                            json!({ "type": "response.output_text.delta", "sequence_number": seq, "item_id": format!("msg-{id}"), "output_index": 0, "content_index": 0, "delta": ev.delta }),
                        )
                    }
                    RunEventKind::Complete => {
                        let r = response_json(&id, &model, &text, ev.usage, "completed");
                        let out = event(
                            "response.completed",
                            json!({ "type": "response.completed", "sequence_number": seq, "response": r }),
                        );
                        return Some((Ok::<_, Infallible>(out), (s, text, seq + 1, true)));
                    }
                    RunEventKind::Error | RunEventKind::Cancelled => {
                        let r = response_json(&id, &model, &text, None, "failed");
                        let out = event(
                            "response.failed",
                            json!({ "type": "response.failed", "sequence_number": seq, "response": r }),
                        );
                        return Some((Ok(out), (s, text, seq + 1, true)));
                    }
                };
                Some((Ok(out), (s, text, seq + 1, false)))
            }
        },
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "response failed",
            )
        })
}

/// Passes a tunnelled provider response through: status, headers, body bytes.
async fn passthrough(mut s: crate::transport::TunnelStream) -> Response {
    let (status, headers) = loop {
        match s.next().await {
            Some(TunnelEvent::Frame(Delivery::Start { status, headers })) => {
                break (status, headers);
            }
            Some(TunnelEvent::Frame(Delivery::Usage(_))) => {}
            Some(TunnelEvent::Frame(Delivery::Error { .. })) | None => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    "provider request failed",
                );
            }
            Some(_) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    "provider request failed",
                );
            }
        }
    };
    let body = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            match s.next().await? {
                TunnelEvent::Frame(Delivery::Body(b)) => {
                    return Some((Ok::<_, std::io::Error>(b), s));
                }
                TunnelEvent::Frame(Delivery::Usage(_)) => {}
                TunnelEvent::Frame(Delivery::End) => return None,
                // A failure after the status was sent: cut the body short so the client sees it.
                _ => return Some((Err(std::io::Error::other("provider stream failed")), s)),
            }
        }
    });
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    for h in headers {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(&h.value),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    response
}

fn usage_json(ev: &RunEvent) -> Value {
    ev.usage.map_or(Value::Null, |u| {
        json!({ "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens })
    })
}

/// A non-streamed normalized run, rendered as an OpenAI `chat.completion`.
async fn completion(
    mut s: RunStream,
    id: String,
    model: String,
    tools: &std::collections::BTreeSet<String>,
) -> Response {
    let mut text = String::new();
    while let Some(ev) = s.next().await {
        match ev.kind {
            RunEventKind::Delta => text.push_str(&ev.delta),
            RunEventKind::Complete => {
                let mut message = json!({ "role": "assistant", "content": text });
                let mut finish = "stop";
                if let Some((rest, calls)) = crate::tools::finish(&ev, &text, tools) {
                    message["content"] = if rest.is_empty() {
                        Value::Null
                    } else {
                        Value::String(rest)
                    };
                    message["tool_calls"] = calls;
                    finish = "tool_calls";
                }
                let body = json!({
                    "id": id,
                    "object": "chat.completion",
                    "created": unix_now(),
                    "model": model,
                    "choices": [{ "index": 0, "message": message, "finish_reason": finish }],
                    "usage": usage_json(&ev),
                });
                return axum::Json(body).into_response();
            }
            RunEventKind::Error | RunEventKind::Cancelled => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    "server_error",
                    "provider request failed",
                );
            }
            RunEventKind::Start => {}
        }
    }
    error(
        StatusCode::BAD_GATEWAY,
        "server_error",
        "provider request failed",
    )
}

/// A streamed normalized run, rendered as OpenAI `chat.completion.chunk` SSE events.
/// When the request declared tools, content that could be a text tool call is held back until
/// `Complete` (see [`crate::tools::HoldBack`]).
fn sse(
    s: RunStream,
    id: String,
    model: String,
    tools: std::collections::BTreeSet<String>,
) -> Response {
    let created = unix_now();
    let chunk = move |delta: Value, finish: Value, usage: Value| {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        });
        if !usage.is_null() {
            c["usage"] = usage;
        }
        Bytes::from(format!("data: {c}\n\n"))
    };
    let hold = !tools.is_empty();
    let tools = Arc::new(tools);
    let start = (s, false, crate::tools::HoldBack::default());
    let events = futures_util::stream::unfold(start, move |(mut s, done, mut held)| {
        let chunk = chunk.clone();
        let tools = tools.clone();
        async move {
            if done {
                return None;
            }
            let ev = s.next().await?;
            let out = match ev.kind {
                RunEventKind::Start => chunk(
                    json!({ "role": "assistant", "content": "" }),
                    Value::Null,
                    Value::Null,
                ),
                RunEventKind::Delta if hold => {
                    let now = held.push(&ev.delta);
                    if now.is_empty() {
                        Bytes::new()
                    } else {
                        chunk(json!({ "content": now }), Value::Null, Value::Null)
                    }
                }
                RunEventKind::Delta => {
                    chunk(json!({ "content": ev.delta }), Value::Null, Value::Null)
                }
                RunEventKind::Complete => {
                    let pending = held.take();
                    let mut last = Vec::new();
                    let (delta, finish) = match crate::tools::finish(&ev, &pending, &tools) {
                        Some((rest, calls)) => {
                            if !rest.is_empty() {
                                let c = chunk(json!({ "content": rest }), Value::Null, Value::Null);
                                last.extend_from_slice(&c);
                            }
                            let calls = crate::tools::as_deltas(calls);
                            (json!({ "tool_calls": calls }), "tool_calls")
                        }
                        None => {
                            if !pending.is_empty() {
                                let c =
                                    chunk(json!({ "content": pending }), Value::Null, Value::Null);
                                last.extend_from_slice(&c);
                            }
                            (json!({}), "stop")
                        }
                    };
                    last.extend_from_slice(&chunk(delta, json!(finish), usage_json(&ev)));
                    last.extend_from_slice(b"data: [DONE]\n\n");
                    return Some((Ok::<_, Infallible>(Bytes::from(last)), (s, true, held)));
                }
                RunEventKind::Error | RunEventKind::Cancelled => {
                    let e = json!({ "error": { "message": "provider request failed", "type": "server_error" } });
                    return Some((Ok(Bytes::from(format!("data: {e}\n\n"))), (s, true, held)));
                }
            };
            Some((Ok(out), (s, false, held)))
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "response failed",
            )
        })
}

/// Anthropic-style `messages` (with an optional top-level `system`) as normalized chat messages.
fn anthropic_messages(request: &Value) -> Option<Value> {
    let mut out = Vec::new();
    match &request["system"] {
        Value::String(s) => out.push(json!({ "role": "system", "content": s })),
        Value::Array(parts) => {
            let text: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
            out.push(json!({ "role": "system", "content": text }));
        }
        _ => {}
    }
    for m in request["messages"].as_array()? {
        let content = match &m["content"] {
            Value::String(t) => t.clone(),
            Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
            _ => return None,
        };
        out.push(json!({ "role": m["role"].as_str().unwrap_or("user"), "content": content }));
    }
    Some(Value::Array(out))
}

/// `POST /v1/messages` (Anthropic Messages API): passthrough for OpenAI-compatible providers
/// whose profile has the `messages` operation; a `message` object or the message stream events
/// for native providers.
async fn messages(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let (request, model, stream) = match parse(&state, &headers, &body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let Some(messages) = anthropic_messages(&request) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`messages` must be an array",
        );
    };
    let run_id = next_id("msg");
    let build = build(
        request,
        run_id.clone(),
        stream,
        Operation::Messages,
        "/messages",
        json!({ "messages": messages }),
    );
    let dispatched = match dispatch_for(&state, &headers, &model, build).await {
        Ok(d) => d,
        Err(r) => return r,
    };
    match dispatched {
        Dispatched::Tunnel(s) => passthrough(s).await,
        Dispatched::Nothing => error(StatusCode::BAD_GATEWAY, "server_error", "no request built"),
        Dispatched::Run(s) if stream => anthropic_sse(s, run_id, model),
        Dispatched::Run(mut s) => {
            let mut text = String::new();
            while let Some(ev) = s.next().await {
                match ev.kind {
                    RunEventKind::Delta => text.push_str(&ev.delta),
                    RunEventKind::Complete => {
                        let usage = ev.usage.unwrap_or_default();
                        return axum::Json(json!({
                            "id": run_id,
                            "type": "message",
                            "role": "assistant",
                            "model": model,
                            "content": [{ "type": "text", "text": text }],
                            "stop_reason": "end_turn",
                            "stop_sequence": null,
                            "usage": { "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens },
                        }))
                        .into_response();
                    }
                    RunEventKind::Error | RunEventKind::Cancelled => break,
                    RunEventKind::Start => {}
                }
            }
            error(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "provider request failed",
            )
        }
    }
}

/// A streamed normalized run as Anthropic message stream events.
fn anthropic_sse(s: RunStream, id: String, model: String) -> Response {
    let event = |kind: &str, data: Value| Bytes::from(format!("event: {kind}\ndata: {data}\n\n"));
    let events = futures_util::stream::unfold((s, false), move |(mut s, done)| {
        let (id, model) = (id.clone(), model.clone());
        async move {
            if done {
                return None;
            }
            let ev = s.next().await?;
            let out = match ev.kind {
                RunEventKind::Start => {
                    let mut b = event("message_start", json!({ "type": "message_start", "message": {
                        "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                        "stop_reason": null, "usage": { "input_tokens": 0, "output_tokens": 0 } } })).to_vec();
                    b.extend_from_slice(&event("content_block_start", json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } })));
                    Bytes::from(b)
                }
                RunEventKind::Delta => event(
                    "content_block_delta",
                    json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": ev.delta } }),
                ),
                RunEventKind::Complete => {
                    let usage = ev.usage.unwrap_or_default();
                    let mut b = event(
                        "content_block_stop",
                        json!({ "type": "content_block_stop", "index": 0 }),
                    )
                    .to_vec();
                    b.extend_from_slice(&event(
                        "message_delta",
                        json!({ "type": "message_delta",
                        "delta": { "stop_reason": "end_turn", "stop_sequence": null },
                        "usage": { "output_tokens": usage.completion_tokens } }),
                    ));
                    b.extend_from_slice(&event("message_stop", json!({ "type": "message_stop" })));
                    return Some((Ok::<_, Infallible>(Bytes::from(b)), (s, true)));
                }
                RunEventKind::Error | RunEventKind::Cancelled => {
                    let e = json!({ "type": "error", "error": { "type": "api_error", "message": "provider request failed" } });
                    return Some((Ok(event("error", e)), (s, true)));
                }
            };
            Some((Ok(out), (s, false)))
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "response failed",
            )
        })
}

/// `POST /v1/messages/count_tokens`: passthrough for OpenAI-compatible providers with the
/// `count_tokens` operation. Native providers have no tokenizer on the wire, so the Edge answers
/// with an estimate (whitespace-separated words), marked by an `estimated` field.
async fn count_tokens(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let (request, model, _) = match parse(&state, &headers, &body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let Some(messages) = anthropic_messages(&request) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`messages` must be an array",
        );
    };
    let estimate: usize = messages
        .as_array()
        .map(|ms| {
            ms.iter()
                .filter_map(|m| m["content"].as_str())
                .map(|c| c.split_whitespace().count())
                .sum()
        })
        .unwrap_or(0);
    // Only OpenAI-compatible providers are asked; for a native one nothing is sent.
    let build = build(
        request,
        next_id("count"),
        false,
        Operation::CountTokens,
        "/messages/count_tokens",
        Value::Null,
    );
    match dispatch_for(&state, &headers, &model, build).await {
        Ok(Dispatched::Tunnel(s)) => passthrough(s).await,
        Ok(Dispatched::Run(_) | Dispatched::Nothing) => {
            axum::Json(json!({ "input_tokens": estimate, "estimated": true })).into_response()
        }
        Err(r) => r,
    }
}
