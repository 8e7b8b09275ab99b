//! `iop-cp`'s status page for operators, on the admin listener under `/status/`: principals
//! and their routes, tokens (ids, never the secret), credential slots (ids and rotations, never
//! the credential), connected Edges with the projection generation each acknowledged, the
//! issuer keys with a pending rotation, and the last mutations.
//!
//! | path | what |
//! |---|---|
//! | `GET /status/` | the page (`app.js` beside it; `page.css`, `common.js`, `favicon.svg` are [`bounded_http::admin::page_assets`]) |
//! | `GET /status/api/status` | the [`CpStatusView`] as JSON |
//! | `GET /status/api/events` | the same view as server-sent events: at once, then on each change (checked every 500 ms) |
//!
//! Behind [`bounded_http::admin::guard`]: the admin token as Bearer or as the Basic password,
//! `401` otherwise; a strict Content-Security-Policy; nothing secret in any response (the
//! store's snapshot carries no sealed bytes, and the view has no token digest). The binary
//! serves it only when an admin token is set (`--admin-token` / `IOP_CP_ADMIN_TOKEN`).
//!
//! A token's creation and a slot's last put (its creation or last rotation) are read from the
//! store's mutation log ([`crate::store::Store::last_revisions`]): their generation and the
//! time the applying process's clock gave them; a slot's revision counts its puts. One view
//! serves every request and event stream for [`VIEW_TTL`], so the store is read at most
//! about four times a second however many pages are open.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use bounded_http::admin::{AdminToken, asset};
use serde::Serialize;

use crate::admin::Admin;
use crate::server::ControlPlane;

/// Event streams served at once; more are refused with `503`.
pub const MAX_EVENT_STREAMS: usize = 32;
/// The most tokens (and slots) whose creation (last put) the view looks up.
pub const MAX_OBJECTS: u32 = 100_000;
/// How long one view serves every request and event stream.
pub const VIEW_TTL: std::time::Duration = std::time::Duration::from_millis(250);
/// Mutations listed.
pub const LAST_MUTATIONS: u64 = 20;

const PAGE: &str = include_str!("page.html");
const SCRIPT: &str = include_str!("app.js");

/// What the page shows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpStatusView {
    /// The projection generation of the store.
    pub generation: u64,
    /// Principals with their routes.
    pub principals: Vec<PrincipalView>,
    /// Tokens (revoked included).
    pub tokens: Vec<TokenView>,
    /// Credential slots.
    pub slots: Vec<SlotView>,
    /// Connected Edges.
    pub edges: Vec<EdgeView>,
    /// Lease issuer keys: the active one, and a staged one with its activation time.
    pub issuer_keys: Vec<IssuerKeyView>,
    /// The last mutations, newest first.
    pub mutations: Vec<MutationView>,
}

/// A principal and its routes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PrincipalView {
    /// Id.
    pub id: String,
    /// Display name.
    pub display_name: String,
    /// Enabled.
    pub enabled: bool,
    /// Whether it has rate limits or budgets.
    pub limited: bool,
    /// Its routes.
    pub routes: Vec<RouteView>,
}

/// A route.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteView {
    /// Id.
    pub id: String,
    /// The model the principal calls.
    pub model: String,
    /// The credential slot it uses.
    pub slot_id: String,
    /// The provider's model.
    pub upstream_target: String,
    /// Enabled.
    pub enabled: bool,
}

/// A token: its id, never the secret or its digest.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenView {
    /// Id.
    pub id: String,
    /// Owner.
    pub principal_id: String,
    /// Revoked.
    pub revoked: bool,
    /// The generation that created it.
    pub created_generation: Option<u64>,
    /// When it was created (Unix ms).
    pub created_at_ms: Option<i64>,
}

/// A credential slot: never the credential.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SlotView {
    /// Id.
    pub id: String,
    /// Protocol profile.
    pub profile: String,
    /// The header the credential goes in.
    pub header_name: String,
    /// The slot's revision: 1 when first put, one more at each rotation.
    pub revision: u64,
    /// The generation of its last put (creation or rotation).
    pub rotated_generation: Option<u64>,
    /// When it was last put (Unix ms).
    pub rotated_at_ms: Option<i64>,
    /// Enabled.
    pub enabled: bool,
}

/// A connected Edge.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EdgeView {
    /// Id.
    pub id: String,
    /// The projection generation it holds: its hello's, or the last push it acknowledged.
    pub projection_generation: u64,
}

/// A lease issuer key (its id and state, never the key).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IssuerKeyView {
    /// Key id.
    pub id: String,
    /// Active (signing now) or staged.
    pub active: bool,
    /// When a staged key becomes active (Unix ms; 0 for the active one).
    pub activates_at_unix_ms: i64,
}

/// One mutation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MutationView {
    /// Its generation.
    pub generation: u64,
    /// What it was (`create_token`, `put_slot`, …).
    pub kind: String,
    /// The object's id.
    pub object_id: String,
    /// When (Unix ms).
    pub at_ms: i64,
}

struct Shared {
    admin: Admin,
    cp: Option<ControlPlane>,
    streams: Arc<bounded_http::admin::EventStreams>,
    /// The last view and when it was taken (see [`VIEW_TTL`]); the lock is held while a view
    /// is taken, so concurrent readers wait for one read of the store instead of each making
    /// their own.
    cached: tokio::sync::Mutex<Option<(std::time::Instant, Arc<CpStatusView>)>>,
}

impl Shared {
    async fn view(&self) -> Result<Arc<CpStatusView>, crate::store::StoreError> {
        let mut cached = self.cached.lock().await;
        if let Some((at, view)) = cached.as_ref()
            && at.elapsed() < VIEW_TTL
        {
            return Ok(Arc::clone(view));
        }
        let view = Arc::new(self.take_view().await?);
        *cached = Some((std::time::Instant::now(), Arc::clone(&view)));
        Ok(view)
    }

    async fn take_view(&self) -> Result<CpStatusView, crate::store::StoreError> {
        let store = self.admin.store();
        let snap = store.snapshot().await?;
        let generation = snap.generation;
        let window = store
            .revisions(generation.saturating_sub(LAST_MUTATIONS), 1000)
            .await?;
        let last_of = |revisions: Vec<crate::store::Revision>| -> BTreeMap<String, (u64, i64)> {
            revisions
                .into_iter()
                .map(|r| (r.object_id, (r.generation, r.at_unix_ms)))
                .collect()
        };
        let created = last_of(store.last_revisions("create_token", MAX_OBJECTS).await?);
        let put = last_of(store.last_revisions("put_slot", MAX_OBJECTS).await?);
        let mut routes: BTreeMap<&str, Vec<RouteView>> = BTreeMap::new();
        for r in &snap.routes {
            routes
                .entry(r.principal_id.as_str())
                .or_default()
                .push(RouteView {
                    id: r.id.clone(),
                    model: r.model.clone(),
                    slot_id: r.slot_id.clone(),
                    upstream_target: r.upstream_target.clone(),
                    enabled: r.enabled,
                });
        }
        let principals = snap
            .principals
            .iter()
            .map(|p| PrincipalView {
                id: p.id.clone(),
                display_name: p.display_name.clone(),
                enabled: p.enabled,
                limited: p.limits.is_some(),
                routes: routes.remove(p.id.as_str()).unwrap_or_default(),
            })
            .collect();
        let tokens = snap
            .tokens
            .iter()
            .map(|t| TokenView {
                id: t.id.clone(),
                principal_id: t.principal_id.clone(),
                revoked: t.revoked,
                created_generation: created.get(t.id.as_str()).map(|c| c.0),
                created_at_ms: created.get(t.id.as_str()).map(|c| c.1),
            })
            .collect();
        let slots = snap
            .slots
            .iter()
            .map(|s| SlotView {
                id: s.id.clone(),
                profile: s.profile.clone(),
                header_name: s.header_name.clone(),
                revision: s.revision,
                rotated_generation: put.get(s.id.as_str()).map(|p| p.0),
                rotated_at_ms: put.get(s.id.as_str()).map(|p| p.1),
                enabled: s.enabled,
            })
            .collect();
        let edges = self
            .cp
            .as_ref()
            .map(ControlPlane::edges)
            .unwrap_or_default()
            .into_iter()
            .map(|e| EdgeView {
                id: e.edge_id,
                projection_generation: e.projection_generation,
            })
            .collect();
        let issuer_keys = snap
            .issuer_keys
            .iter()
            .map(|k| IssuerKeyView {
                id: k.id.clone(),
                active: k.active,
                activates_at_unix_ms: k.activates_at_unix_ms,
            })
            .collect();
        let mutations = window
            .iter()
            .rev()
            .take(usize::try_from(LAST_MUTATIONS).unwrap_or(usize::MAX))
            .map(|r| MutationView {
                generation: r.generation,
                kind: r.kind.clone(),
                object_id: r.object_id.clone(),
                at_ms: r.at_unix_ms,
            })
            .collect();
        Ok(CpStatusView {
            generation,
            principals,
            tokens,
            slots,
            edges,
            issuer_keys,
            mutations,
        })
    }
}

/// The page's router, its paths under `/status/` (merge it into the admin router).
pub fn router(admin: Admin, cp: Option<ControlPlane>, token: AdminToken) -> Router {
    let shared = Arc::new(Shared {
        admin,
        cp,
        streams: bounded_http::admin::EventStreams::new(MAX_EVENT_STREAMS),
        cached: tokio::sync::Mutex::new(None),
    });
    let page = Router::new()
        .route("/status", get(|| async { Redirect::permanent("/status/") }))
        .route("/status/", get(page))
        .route("/status/app.js", get(script))
        .route("/status/api/status", get(status))
        .route("/status/api/events", get(events_stream))
        .with_state(shared)
        .nest("/status", bounded_http::admin::page_assets());
    bounded_http::admin::guard(page, token, "iop-cp status")
}

async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

async fn status(State(shared): State<Arc<Shared>>) -> Response {
    match shared.view().await {
        Ok(v) => axum::Json(v).into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the store is unavailable\n",
        )
            .into_response(),
    }
}

async fn events_stream(State(shared): State<Arc<Shared>>) -> Response {
    let streams = shared.streams.clone();
    bounded_http::admin::status_events(&streams, move || {
        let shared = shared.clone();
        async move { shared.view().await.ok() }
    })
}
