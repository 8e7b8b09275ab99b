//! The HTTP admin API (axum). Bind it to loopback (the binary's default is `127.0.0.1:7601`);
//! it has no authentication of its own beyond an optional bearer token.
//!
//! | method and path | body | answer |
//! |---|---|---|
//! | `POST /admin/v1/principals` | `{"id", "display_name"}` | `{"generation"}` |
//! | `POST /admin/v1/principals/{id}/enabled` | `{"enabled": bool}` | `{"generation"}` |
//! | `PUT /admin/v1/principals/{id}/limits` | `{"requests_per_minute", "tokens_per_minute", "concurrent", "budget_usd_per_day", "budget_usd_per_month", "models": {"<model>": {"requests_per_minute", "tokens_per_minute", "concurrent"}}}`, each optional (`{}` clears) | `{"generation"}` |
//! | `GET /admin/v1/principals/{id}/limits` | — | the same document (`{}`: not limited) |
//! | `POST /admin/v1/tokens` | `{"principal_id"}` | `{"token_id", "token", "generation"}` — the token is shown this once |
//! | `POST /admin/v1/tokens/{id}/revoke` | — | `{"generation"}` |
//! | `PUT /admin/v1/slots/{id}` | `{"profile", "header_name", "header_prefix", "credential"}` | `{"generation"}` (never echoes the credential) |
//! | `PUT /admin/v1/routes/{id}` | `{"principal_id", "model", "slot_id", "upstream_target", "selector"}` | `{"generation"}` |
//! | `GET /admin/v1/edges` | — | connected Edges |
//! | `GET /admin/v1/edges/{id}/status` | — | that Edge's Node view (asked over the Edge wire): `{"edge_id", "nodes", "omitted_nodes"}`; an Edge with more Nodes than one answer holds lists the first in `node_id` order and counts the rest in `omitted_nodes` |
//! | `GET /admin/v1/revisions?after=N` | — | the mutation log after generation N (at most 1000) |
//! | `GET /admin/v1/usage?since=YYYY-MM-DD` | — | `{"usage": [{"day", "principal_id", "model", "outcome", "requests", "input_tokens", "output_tokens", "cached_input_tokens", "cost_pico_usd"}]}`, the daily rollup ([`crate::usage`]; at most 10000 rows) |
//! | `GET /healthz` | — | `ok` |
//!
//! Errors: `{"error": "<stable text>"}` with 400 (invalid), 401 (admin token), 404, 409
//! (conflict or profile mismatch), 503 (store unavailable).

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde::Deserialize;
use serde_json::json;
use zeroize::Zeroizing;

use crate::admin::{Admin, AdminError};
use crate::server::ControlPlane;
use crate::store::StoreError;

#[derive(Clone)]
struct AppState {
    admin: Admin,
    cp: Option<ControlPlane>,
    token: Option<Arc<str>>,
}

/// The admin router. `admin_token`, when set, must be presented as `Authorization: Bearer …`.
pub fn router(admin: Admin, cp: Option<ControlPlane>, admin_token: Option<String>) -> Router {
    let state = AppState {
        admin,
        cp,
        token: admin_token.map(Arc::from),
    };
    Router::new()
        .route("/admin/v1/principals", post(create_principal))
        .route("/admin/v1/principals/{id}/enabled", post(principal_enabled))
        .route(
            "/admin/v1/principals/{id}/limits",
            put(put_principal_limits).get(get_principal_limits),
        )
        .route("/admin/v1/tokens", post(create_token))
        .route("/admin/v1/tokens/{id}/revoke", post(revoke_token))
        .route("/admin/v1/slots/{id}", put(put_slot))
        .route("/admin/v1/routes/{id}", put(put_route))
        .route("/admin/v1/edges", get(edges))
        .route("/admin/v1/edges/{id}/status", get(edge_status))
        .route("/admin/v1/revisions", get(revisions))
        .route("/admin/v1/usage", get(usage))
        .route("/healthz", get(|| async { "ok" }))
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024))
        .with_state(state)
}

fn fail(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(json!({ "error": message }))).into_response()
}

fn admin_error(e: &AdminError) -> Response {
    let status = match e {
        AdminError::Store(StoreError::Invalid(_))
        | AdminError::CredentialLength
        | AdminError::Header(_) => StatusCode::BAD_REQUEST,
        AdminError::Store(StoreError::NotFound(_)) => StatusCode::NOT_FOUND,
        AdminError::Store(StoreError::Conflict(_) | StoreError::ProfileMismatch) => {
            StatusCode::CONFLICT
        }
        AdminError::Store(StoreError::Unavailable)
        | AdminError::Seal(_)
        | AdminError::IssuerKey(_)
        | AdminError::KeyGeneration => StatusCode::SERVICE_UNAVAILABLE,
    };
    fail(status, &e.to_string())
}

fn generation(r: Result<u64, AdminError>) -> Response {
    match r {
        Ok(g) => axum::Json(json!({ "generation": g })).into_response(),
        Err(e) => admin_error(&e),
    }
}

#[expect(clippy::result_large_err, reason = "the error is the response itself")]
fn check(state: &AppState, headers: &HeaderMap) -> Result<(), Response> {
    let Some(expected) = &state.token else {
        return Ok(());
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme is case-insensitive (RFC 9110 §11.1): `bearer x` is `Bearer x`.
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start())
        .unwrap_or_default();
    if bool::from(subtle::ConstantTimeEq::ct_eq(
        presented.as_bytes(),
        expected.as_bytes(),
    )) {
        Ok(())
    } else {
        Err(fail(StatusCode::UNAUTHORIZED, "admin token required"))
    }
}

#[derive(Deserialize)]
struct NewPrincipal {
    id: String,
    #[serde(default)]
    display_name: String,
}

async fn create_principal(
    State(s): State<AppState>,
    headers: HeaderMap,
    axum::Json(b): axum::Json<NewPrincipal>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    generation(s.admin.create_principal(&b.id, &b.display_name).await)
}

#[derive(Deserialize)]
struct Enabled {
    enabled: bool,
}

async fn principal_enabled(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    axum::Json(b): axum::Json<Enabled>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    generation(
        s.admin
            .apply(crate::store::Mutation::SetPrincipalEnabled {
                id,
                enabled: b.enabled,
            })
            .await,
    )
}

async fn put_principal_limits(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    axum::Json(b): axum::Json<crate::store::LimitsDoc>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    generation(s.admin.set_principal_limits(&id, &b).await)
}

async fn get_principal_limits(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    match s.admin.store().snapshot().await {
        Ok(snap) => match snap.principals.into_iter().find(|p| p.id == id) {
            Some(p) => axum::Json(
                p.limits
                    .as_ref()
                    .map(crate::store::LimitsDoc::of)
                    .unwrap_or_default(),
            )
            .into_response(),
            None => admin_error(&AdminError::Store(StoreError::NotFound("principal"))),
        },
        Err(e) => admin_error(&AdminError::Store(e)),
    }
}

#[derive(Deserialize)]
struct NewToken {
    principal_id: String,
}

async fn create_token(
    State(s): State<AppState>,
    headers: HeaderMap,
    axum::Json(b): axum::Json<NewToken>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    match s.admin.create_token(&b.principal_id).await {
        Ok(t) => axum::Json(json!({
            "token_id": t.token_id,
            "token": t.token.as_str(),
            "generation": t.generation,
        }))
        .into_response(),
        Err(e) => admin_error(&e),
    }
}

async fn revoke_token(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    generation(s.admin.revoke_token(&id).await)
}

#[derive(Deserialize)]
struct PutSlot {
    profile: String,
    #[serde(default = "authorization")]
    header_name: String,
    #[serde(default = "bearer")]
    header_prefix: String,
    credential: String,
}

fn authorization() -> String {
    "authorization".into()
}

fn bearer() -> String {
    "Bearer ".into()
}

async fn put_slot(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    axum::Json(b): axum::Json<PutSlot>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    let credential = Zeroizing::new(b.credential);
    generation(
        s.admin
            .put_slot(
                &id,
                &b.profile,
                &b.header_name,
                &b.header_prefix,
                credential.as_bytes(),
            )
            .await,
    )
}

#[derive(Deserialize)]
struct PutRoute {
    principal_id: String,
    model: String,
    slot_id: String,
    upstream_target: String,
    #[serde(default)]
    selector: String,
}

async fn put_route(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    axum::Json(b): axum::Json<PutRoute>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    generation(
        s.admin
            .put_route(
                &id,
                &b.principal_id,
                &b.model,
                &b.slot_id,
                &b.upstream_target,
                &b.selector,
            )
            .await,
    )
}

async fn edges(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    let edges: Vec<_> = s
        .cp
        .as_ref()
        .map(ControlPlane::edges)
        .unwrap_or_default()
        .into_iter()
        .map(|e| json!({ "edge_id": e.edge_id, "projection_generation": e.projection_generation }))
        .collect();
    axum::Json(json!({ "edges": edges })).into_response()
}

async fn edge_status(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    let Some(cp) = &s.cp else {
        return fail(StatusCode::NOT_FOUND, "edge not connected");
    };
    match cp.status(&id).await {
        Ok(status) => {
            let nodes: Vec<_> = status
                .nodes
                .iter()
                .map(|n| {
                    let providers: Vec<_> = n
                        .provider_snapshots
                        .iter()
                        .map(|p| {
                            json!({
                                "provider_id": p.provider_id, "adapter": p.adapter,
                                "target": p.target, "category": p.category,
                                "status": p.status, "health": p.health,
                                "capacity": p.capacity, "in_flight": p.in_flight,
                                "queued": p.queued,
                            })
                        })
                        .collect();
                    json!({
                        "node_id": n.node_id,
                        "connected": n.connected,
                        "config_revision": n.config.revision,
                        "adapters": n.config.adapters,
                        "providers": providers,
                        "refused": n.refused,
                        "warning": n.warning,
                    })
                })
                .collect();
            axum::Json(json!({
                "edge_id": status.edge_id,
                "nodes": nodes,
                // Nodes the Edge left out to fit one answer (they sort after the last listed).
                "omitted_nodes": status.omitted_nodes,
            }))
            .into_response()
        }
        Err(e) => fail(StatusCode::NOT_FOUND, &e.to_string()),
    }
}

async fn revisions(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    let after = q.get("after").and_then(|v| v.parse().ok()).unwrap_or(0);
    match s.admin.store().revisions(after, 1000).await {
        Ok(rs) => {
            let rows: Vec<_> = rs
                .into_iter()
                .map(|r| json!({ "generation": r.generation, "kind": r.kind, "object_id": r.object_id }))
                .collect();
            axum::Json(json!({ "revisions": rows })).into_response()
        }
        Err(e) => admin_error(&AdminError::Store(e)),
    }
}

/// Most rollup rows one `GET /admin/v1/usage` answers.
pub const MAX_USAGE_ROWS: u32 = 10_000;

async fn usage(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = check(&s, &headers) {
        return r;
    }
    let since = q.get("since").map(String::as_str);
    if since.is_some_and(|d| !crate::store::is_day(d)) {
        return fail(StatusCode::BAD_REQUEST, "since must be YYYY-MM-DD");
    }
    match s.admin.store().usage_daily(since, MAX_USAGE_ROWS).await {
        Ok(rows) => axum::Json(json!({ "usage": rows })).into_response(),
        Err(e) => admin_error(&AdminError::Store(e)),
    }
}
