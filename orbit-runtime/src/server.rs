//! The control plane's Edge Runtime API (axum), seed `003`:
//!
//! | endpoint | auth | does |
//! |---|---|---|
//! | `POST /api/v1/edge-runtime/register` | `Authorization: Bearer <deployment token>` | binds or refreshes `installation_id` + `public_key` + `device_fingerprint_hash`; returns `node_id`, `edge_runtime_id`, `control_plane_url`, `heartbeat_interval_seconds` |
//! | `POST /api/v1/edge-runtime/heartbeat` | signed | records liveness; a present `reported_address` is persisted and reconciles the Node's endpoint DNS records; empty values keep the last address |
//! | `GET /api/v1/edge-runtime/desired-state` | signed, `X-OrbitMesh-Current-Version` | `304`, or `200 {version, configurations}` ([`crate::versions`]) |
//! | `POST /api/v1/edge-runtime/apply-result` | signed | `{version, results: [{configuration_id, status}]}`; advances `current_version` only when every configuration of the version is `applied` |
//!
//! and a loopback admin API: `POST /admin/v1/deployment-tokens {uses}` (the token is shown
//! once; only its SHA-256 is kept), `POST /admin/v1/nodes/{node_id}/endpoints {name}`,
//! `POST /admin/v1/nodes/{node_id}/desired-state {version, configurations}`,
//! `GET /admin/v1/nodes/{node_id}`.
//!
//! Deployment tokens authorise enrolment only; they are never a runtime identity, and there is
//! no `edge_secret`. The server keeps only public keys. Every refusal is `{"error": "<stable
//! code>"}` with `content-type: application/json` and echoes nothing from the request:
//!
//! | status | codes | when |
//! |---|---|---|
//! | `400` | `invalid_body`, `invalid_installation_id`, `invalid_device_fingerprint_hash`, `invalid_public_key`, `invalid_status`, `invalid_current_version`, `malformed_header`, `reported_address` / `public_address`, CSR codes | the request is malformed (a signature header present but malformed included) |
//! | `401` | `missing_header`, `unknown_identity`, `body_digest_mismatch`, `stale_timestamp`, `bad_signature`, `replayed_nonce`, `nonce_store_full`, `invalid_deployment_token` | authentication missing (no signature headers) or failed |
//! | `404` | `not_found`, `unknown_version`, `unknown_node` | no such path, version or Node |
//! | `405` | `method_not_allowed` | the path exists, not with this method |
//! | `409` | `version_not_newer_or_unknown_node` | admin publish of a version not above the latest |
//! | `413` | `body_too_large` | a body over [`MAX_BODY`] |
//! | `415` | `unsupported_media_type` | an admin request without `content-type: application/json` |
//! | `503` | `store_unavailable`, `issuance_failed`, `certificates_not_configured` | the store or the ACME issuer failed |
//!
//! Successes: `200` (JSON), `204` (admin writes), `304` (desired state unchanged). `GET /certificates` lists the Node's certificate metadata;
//! `POST /certificates/csr {csr}` validates the CSR against the Node's endpoints and issues
//! through ACME DNS-01 ([`crate::certs`]), answering with the chain. State is in an
//! [`OrbitStore`] (SQLite or PostgreSQL), including the nonces of signed requests.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::dns::DnsProvider;
use crate::signing::{self, Identity, VerifyError};
use crate::store::{CertRow, OrbitStore, Registration, SqliteStore, StoreError};
use crate::versions::{self, ApplyStatus, DesiredAnswer};

/// `X-OrbitMesh-Current-Version`.
pub const H_CURRENT_VERSION: &str = "x-orbitmesh-current-version";
/// Default heartbeat interval told to runtimes.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(15);
/// Largest request body.
pub const MAX_BODY: usize = 1024 * 1024;

/// One RuntimeConfiguration of a desired state version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeConfiguration {
    /// Configuration id (unique within the version).
    pub id: String,
    /// Adapter kind, e.g. `nginx`, `wireguard`.
    pub kind: String,
    /// Adapter-specific content (certificate material appears as local file paths).
    #[serde(default)]
    pub spec: Value,
}

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The URL runtimes should use (returned by register).
    pub control_plane_url: String,
    /// Heartbeat interval told to runtimes.
    pub heartbeat_interval: Duration,
    /// Signed-request timestamp window, seconds each way.
    pub window_secs: i64,
    /// Most nonces remembered.
    pub nonce_capacity: usize,
}

impl ServerConfig {
    /// Defaults (15 s heartbeats, ±300 s window) for `control_plane_url`.
    pub fn new(control_plane_url: &str) -> Self {
        Self {
            control_plane_url: control_plane_url.to_owned(),
            heartbeat_interval: DEFAULT_HEARTBEAT,
            window_secs: signing::DEFAULT_WINDOW_SECS,
            nonce_capacity: signing::DEFAULT_NONCE_CAPACITY,
        }
    }
}

/// A clock in Unix seconds (tests move it by hand).
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The system clock.
pub fn system_clock() -> Clock {
    Arc::new(|| iop_wire::time::unix_secs(std::time::SystemTime::now()))
}

/// The server state, shared by the API and admin routers.
#[derive(Clone)]
pub struct ControlPlane {
    store: Arc<dyn OrbitStore>,
    dns: Arc<dyn DnsProvider>,
    config: Arc<ServerConfig>,
    clock: Clock,
    /// When false, signed endpoints skip verification: only with the `bench-unverified`
    /// feature, for the heartbeat bench's baseline.
    #[cfg(feature = "bench-unverified")]
    verify: bool,
    issuer: Option<Arc<crate::certs::AcmeIssuer>>,
    keys: Arc<KeyCache>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn fail(status: StatusCode, code: &str) -> Response {
    (status, axum::Json(json!({ "error": code }))).into_response()
}

/// The request body, or the refusal in the API's error shape: `413 {"error":
/// "body_too_large"}` over [`MAX_BODY`], `400 {"error": "invalid_body"}` when it could not be
/// read.
#[allow(clippy::result_large_err, reason = "the error is the response itself")]
fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, Response> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            fail(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
        } else {
            fail(StatusCode::BAD_REQUEST, "invalid_body")
        }
    })
}

/// An admin request's JSON body, or the refusal in the API's error shape (`413
/// body_too_large`, `415 unsupported_media_type` without `content-type: application/json`,
/// `400 invalid_body` otherwise).
#[allow(clippy::result_large_err, reason = "the error is the response itself")]
fn json_body<T>(b: Result<axum::Json<T>, JsonRejection>) -> Result<T, Response> {
    b.map(|axum::Json(b)| b)
        .map_err(|rejection| match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => fail(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => {
                fail(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
            }
            _ => fail(StatusCode::BAD_REQUEST, "invalid_body"),
        })
}

async fn not_found() -> Response {
    fail(StatusCode::NOT_FOUND, "not_found")
}

async fn method_not_allowed() -> Response {
    fail(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
}

fn verify_failure(e: VerifyError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::UNAUTHORIZED);
    fail(status, e.code())
}

fn digest(token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn unavailable(_: StoreError) -> Response {
    fail(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
}

/// An optional address: absent or empty means "no value" (never clears the last one).
#[allow(clippy::result_large_err, reason = "the error is the response itself")]
fn address(key: &'static str, v: Option<&str>) -> Result<Option<IpAddr>, Response> {
    match v {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| fail(StatusCode::BAD_REQUEST, key)),
    }
}

impl ControlPlane {
    /// A control plane over `store`, writing endpoint records through `dns`.
    pub fn new(
        config: ServerConfig,
        store: Arc<dyn OrbitStore>,
        dns: Arc<dyn DnsProvider>,
        clock: Clock,
    ) -> Self {
        Self {
            store,
            dns,
            config: Arc::new(config),
            clock,
            #[cfg(feature = "bench-unverified")]
            verify: true,
            issuer: None,
            keys: Arc::default(),
        }
    }

    /// A control plane over an in-memory SQLite store (the embedded default; nothing survives
    /// a restart).
    pub fn in_memory(
        config: ServerConfig,
        dns: Arc<dyn DnsProvider>,
        clock: Clock,
    ) -> Result<Self, StoreError> {
        Ok(Self::new(
            config,
            Arc::new(SqliteStore::in_memory()?),
            dns,
            clock,
        ))
    }

    /// Issues Node certificates through `issuer` (ACME DNS-01).
    pub fn with_acme(mut self, issuer: Arc<crate::certs::AcmeIssuer>) -> Self {
        self.issuer = Some(issuer);
        self
    }

    /// The same state without signature verification: the heartbeat bench's baseline, and
    /// nothing else. It exists only with the non-default `bench-unverified` feature (which only
    /// `iop-benches` enables); no binary or library build has it.
    #[cfg(feature = "bench-unverified")]
    pub fn without_verification_for_bench(&self) -> Self {
        Self {
            verify: false,
            ..self.clone()
        }
    }

    /// Creates a deployment token usable `uses` times; the raw token is returned once and only
    /// its SHA-256 is stored.
    pub async fn create_deployment_token(&self, uses: u32) -> Result<String, StoreError> {
        let mut raw = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut raw)
            .map_err(|_| StoreError::Unavailable)?;
        let token = format!(
            "omdt_{}",
            raw.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        self.store.create_token(digest(&token), uses).await?;
        Ok(token)
    }

    /// Assigns an endpoint name (DNS record) to a Node; `false` for an unknown Node.
    pub async fn add_endpoint(&self, node_id: &str, name: &str) -> Result<bool, StoreError> {
        self.store.add_endpoint(node_id, name).await
    }

    /// Publishes a desired state version for a Node (versions only go up).
    pub async fn publish(
        &self,
        node_id: &str,
        version: u64,
        configurations: &[RuntimeConfiguration],
    ) -> Result<bool, StoreError> {
        let json = serde_json::to_string(configurations).map_err(|_| StoreError::Unavailable)?;
        self.store.publish(node_id, version, &json).await
    }

    /// A Node's record.
    pub async fn node(&self, node_id: &str) -> Result<Option<crate::store::NodeRow>, StoreError> {
        self.store.node(node_id).await
    }

    /// The runtime API router.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/api/v1/edge-runtime/register", post(register))
            .route("/api/v1/edge-runtime/heartbeat", post(heartbeat))
            .route("/api/v1/edge-runtime/desired-state", get(desired_state))
            .route("/api/v1/edge-runtime/apply-result", post(apply_result))
            .route("/api/v1/edge-runtime/certificates", get(certificates))
            .route(
                "/api/v1/edge-runtime/certificates/csr",
                post(certificate_csr),
            )
            .route("/healthz", get(|| async { "ok" }))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(self.clone())
    }

    /// The admin router (bind it to loopback).
    pub fn admin_router(&self) -> Router {
        Router::new()
            .route("/admin/v1/deployment-tokens", post(admin_token))
            .route("/admin/v1/nodes/{node_id}/endpoints", post(admin_endpoint))
            .route(
                "/admin/v1/nodes/{node_id}/desired-state",
                post(admin_publish),
            )
            .route("/admin/v1/nodes/{node_id}", get(admin_node))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(self.clone())
    }

    /// Verifies a signed request (the nonce recorded in the shared store); returns the Node.
    async fn authenticate(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<crate::store::NodeRow, Response> {
        let v = self.verify(method, uri, headers, body).await?;
        let Some(nonce) = &v.nonce else {
            return Ok(v.node);
        };
        // Only an authentic request consumes its nonce; every replica sees it.
        let fresh = self
            .store
            .record_nonce(&v.node.node_id, &nonce.nonce, nonce.expires_at, nonce.now)
            .await
            .map_err(unavailable)?;
        if !fresh {
            return Err(refused(VerifyError::Replayed));
        }
        Ok(v.node)
    }

    /// Verifies a signed request's headers, identity, body digest, window and signature; the
    /// nonce is the caller's to record ([`ControlPlane::authenticate`], or the heartbeat's one
    /// store step).
    async fn verify(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Verified, Response> {
        let parsed = signing::parse_headers(|name| headers.get(name).map(|v| v.as_bytes()))
            .map_err(verify_failure)?;
        let node = self
            .store
            .node(&parsed.identity.node_id)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| verify_failure(VerifyError::UnknownIdentity))?;
        #[cfg(feature = "bench-unverified")]
        if !self.verify {
            return Ok(Verified { node, nonce: None });
        }
        let expected = Identity {
            node_id: node.node_id.clone(),
            edge_runtime_id: node.edge_runtime_id.clone(),
            installation_id: node.installation_id.clone(),
        };
        let key = self
            .keys
            .get(&node.public_key)
            .ok_or_else(|| verify_failure(VerifyError::UnknownIdentity))?;
        let target = uri.path_and_query().map_or("/", |p| p.as_str());
        let now = (self.clock)();
        signing::verify_signature(
            &parsed,
            &expected,
            &key,
            method.as_str(),
            target,
            body,
            now,
            self.config.window_secs,
        )
        .map_err(refused)?;
        let nonce = PendingNonce {
            expires_at: parsed.timestamp.saturating_add(self.config.window_secs),
            nonce: parsed.nonce,
            now,
        };
        Ok(Verified {
            node,
            nonce: Some(nonce),
        })
    }
}

fn refused(e: VerifyError) -> Response {
    tracing::info!(target: "orbit_runtime", event = "orbit_signature_refused", code = e.code(), "signed request refused");
    verify_failure(e)
}

/// A verified request: its Node, and the nonce it must consume (none without verification).
struct Verified {
    node: crate::store::NodeRow,
    nonce: Option<PendingNonce>,
}

struct PendingNonce {
    nonce: String,
    expires_at: i64,
    now: i64,
}

/// Parsed public keys by their bytes. Decompressing an Ed25519 point (and the weak-key check)
/// is a good part of a verification; a Node's key is the same on every request. Bounded: at
/// [`MAX_CACHED_KEYS`] the cache starts over. Content-addressed, so a re-registration with a
/// new key simply misses.
#[derive(Default)]
struct KeyCache(std::sync::Mutex<std::collections::HashMap<Vec<u8>, ed25519_dalek::VerifyingKey>>);

/// Most public keys kept parsed.
const MAX_CACHED_KEYS: usize = 65_536;

impl KeyCache {
    fn get(&self, raw: &[u8]) -> Option<ed25519_dalek::VerifyingKey> {
        let mut keys = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(k) = keys.get(raw) {
            return Some(*k);
        }
        let key = signing::parse_public_key(raw)?;
        if keys.len() >= MAX_CACHED_KEYS {
            keys.clear();
        }
        keys.insert(raw.to_vec(), key);
        Some(key)
    }
}

#[derive(Deserialize)]
struct RegisterBody {
    installation_id: String,
    public_key: String,
    device_fingerprint_hash: String,
    #[serde(default)]
    reported_address: Option<String>,
    #[serde(default)]
    public_address: Option<String>,
}

fn valid_id(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 128
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

async fn register(
    State(cp): State<ControlPlane>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    let Ok(b) = serde_json::from_slice::<RegisterBody>(&body) else {
        return fail(StatusCode::BAD_REQUEST, "invalid_body");
    };
    if !valid_id(&b.installation_id) {
        return fail(StatusCode::BAD_REQUEST, "invalid_installation_id");
    }
    if b.device_fingerprint_hash.len() > 128 {
        return fail(StatusCode::BAD_REQUEST, "invalid_device_fingerprint_hash");
    }
    let Some(key) = base64::engine::general_purpose::STANDARD
        .decode(&b.public_key)
        .ok()
        .and_then(|raw| signing::parse_public_key(&raw))
    else {
        return fail(StatusCode::BAD_REQUEST, "invalid_public_key");
    };
    let reported = match address("invalid_reported_address", b.reported_address.as_deref()) {
        Ok(a) => a,
        Err(r) => return r,
    };
    let public = match address("invalid_public_address", b.public_address.as_deref()) {
        Ok(a) => a,
        Err(r) => return r,
    };
    match cp.store.consume_token(digest(token)).await {
        Ok(true) => {}
        Ok(false) => return fail(StatusCode::UNAUTHORIZED, "invalid_deployment_token"),
        Err(e) => return unavailable(e),
    }
    let registration = Registration {
        installation_id: b.installation_id,
        public_key: key.to_bytes(),
        device_fingerprint_hash: b.device_fingerprint_hash,
        reported_address: reported.map(|a| a.to_string()),
        public_address: public.map(|a| a.to_string()),
    };
    let node = match cp.store.register(&registration).await {
        Ok(n) => n,
        Err(e) => return unavailable(e),
    };
    tracing::info!(target: "orbit_runtime", event = "orbit_register", node_id = %node.node_id, "runtime registered");
    axum::Json(json!({
        "node_id": node.node_id,
        "edge_runtime_id": node.edge_runtime_id,
        "control_plane_url": cp.config.control_plane_url,
        "heartbeat_interval_seconds": cp.config.heartbeat_interval.as_secs(),
    }))
    .into_response()
}

#[derive(Deserialize, Default)]
struct HeartbeatBody {
    #[serde(default)]
    reported_address: Option<String>,
    #[serde(default)]
    public_address: Option<String>,
}

async fn heartbeat(
    State(cp): State<ControlPlane>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let verified = match cp.verify(&method, &uri, &headers, &body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let node = &verified.node;
    let b: HeartbeatBody = if body.is_empty() {
        HeartbeatBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(_) => return fail(StatusCode::BAD_REQUEST, "invalid_body"),
        }
    };
    let reported = match address("invalid_reported_address", b.reported_address.as_deref()) {
        Ok(a) => a,
        Err(r) => return r,
    };
    let public = match address("invalid_public_address", b.public_address.as_deref()) {
        Ok(a) => a,
        Err(r) => return r,
    };
    // Empty values never clear the last known address. The nonce and the heartbeat are one
    // store step: a replay writes nothing.
    let (reported_text, public_text) = (
        reported.map(|a| a.to_string()),
        public.map(|a| a.to_string()),
    );
    let outcome = match &verified.nonce {
        Some(n) => {
            cp.store
                .heartbeat_with_nonce(&crate::store::SignedHeartbeat {
                    node_id: &node.node_id,
                    nonce: &n.nonce,
                    nonce_expires_at: n.expires_at,
                    now: n.now,
                    at: (cp.clock)(),
                    reported_address: reported_text.as_deref(),
                    public_address: public_text.as_deref(),
                })
                .await
        }
        None => cp
            .store
            .heartbeat(
                &node.node_id,
                (cp.clock)(),
                reported_text.as_deref(),
                public_text.as_deref(),
            )
            .await
            .map(|c| c.map(|changed| crate::store::HeartbeatOutcome::Recorded { changed })),
    };
    let changed = match outcome {
        Ok(Some(crate::store::HeartbeatOutcome::Recorded { changed })) => changed,
        Ok(Some(crate::store::HeartbeatOutcome::Replayed)) => {
            return refused(VerifyError::Replayed);
        }
        Ok(None) => return fail(StatusCode::UNAUTHORIZED, "unknown_identity"),
        Err(e) => return unavailable(e),
    };
    // A present address reconciles the endpoint records (the providers are idempotent), so a
    // record lost or edited on the DNS side is repaired by the next heartbeat.
    if changed {
        tracing::info!(target: "orbit_runtime", event = "orbit_reported_address_changed", node_id = %node.node_id, "reported address changed");
    }
    if let Some(addr) = reported {
        for name in &node.endpoints {
            if cp.dns.upsert_address(name, addr).await.is_err() {
                tracing::warn!(target: "orbit_runtime", event = "orbit_dns_failed", "endpoint record update failed");
            }
        }
    }
    axum::Json(json!({ "heartbeat_interval_seconds": cp.config.heartbeat_interval.as_secs() }))
        .into_response()
}

async fn desired_state(
    State(cp): State<ControlPlane>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let node = match cp.authenticate(&method, &uri, &headers, &body).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let header_current = match headers.get(H_CURRENT_VERSION) {
        None => None,
        Some(v) => match v.to_str().ok().and_then(|s| s.parse::<u64>().ok()) {
            Some(n) => Some(n),
            None => return fail(StatusCode::BAD_REQUEST, "invalid_current_version"),
        },
    };
    let latest = match cp.store.latest(&node.node_id).await {
        Ok(l) => l,
        Err(e) => return unavailable(e),
    };
    match versions::desired_answer(
        latest.as_ref().map(|(v, _)| *v),
        node.current_applied,
        header_current,
    ) {
        DesiredAnswer::NotModified => StatusCode::NOT_MODIFIED.into_response(),
        DesiredAnswer::Version(v) => {
            let json = match latest {
                Some((lv, json)) if lv == v => json,
                _ => match cp.store.configurations(&node.node_id, v).await {
                    Ok(Some(json)) => json,
                    Ok(None) => "[]".to_owned(),
                    Err(e) => return unavailable(e),
                },
            };
            let configurations: Value =
                serde_json::from_str(&json).unwrap_or(Value::Array(Vec::new()));
            axum::Json(json!({ "version": v, "configurations": configurations })).into_response()
        }
    }
}

#[derive(Deserialize)]
struct ApplyResultBody {
    version: u64,
    results: Vec<ApplyResultEntry>,
}

#[derive(Deserialize)]
struct ApplyResultEntry {
    configuration_id: String,
    status: String,
}

async fn apply_result(
    State(cp): State<ControlPlane>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let node = match cp.authenticate(&method, &uri, &headers, &body).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let Ok(b) = serde_json::from_slice::<ApplyResultBody>(&body) else {
        return fail(StatusCode::BAD_REQUEST, "invalid_body");
    };
    let mut parsed = Vec::with_capacity(b.results.len());
    for r in b.results {
        let Some(status) = ApplyStatus::parse(&r.status) else {
            return fail(StatusCode::BAD_REQUEST, "invalid_status");
        };
        parsed.push((r.configuration_id, status));
    }
    let ids: Vec<String> = match cp.store.configurations(&node.node_id, b.version).await {
        Ok(Some(json)) => serde_json::from_str::<Vec<RuntimeConfiguration>>(&json)
            .map(|c| c.into_iter().map(|c| c.id).collect())
            .unwrap_or_default(),
        Ok(None) => return fail(StatusCode::NOT_FOUND, "unknown_version"),
        Err(e) => return unavailable(e),
    };
    let current = match cp
        .store
        .apply_results(&node.node_id, b.version, &ids, &parsed)
        .await
    {
        Ok(Some(c)) => c,
        Ok(None) => return fail(StatusCode::NOT_FOUND, "unknown_version"),
        Err(e) => return unavailable(e),
    };
    tracing::info!(target: "orbit_runtime", event = "orbit_apply_result", node_id = %node.node_id, version = b.version, current, "apply result recorded");
    axum::Json(json!({ "current_version": current })).into_response()
}

#[derive(Deserialize)]
struct TokenBody {
    #[serde(default = "one")]
    uses: u32,
}

fn one() -> u32 {
    1
}

async fn admin_token(
    State(cp): State<ControlPlane>,
    b: Result<axum::Json<TokenBody>, JsonRejection>,
) -> Response {
    let b = match json_body(b) {
        Ok(b) => b,
        Err(r) => return r,
    };
    match cp.create_deployment_token(b.uses.max(1)).await {
        Ok(token) => axum::Json(json!({ "token": token, "uses": b.uses.max(1) })).into_response(),
        Err(e) => unavailable(e),
    }
}

#[derive(Deserialize)]
struct EndpointBody {
    name: String,
}

async fn admin_endpoint(
    State(cp): State<ControlPlane>,
    Path(node_id): Path<String>,
    b: Result<axum::Json<EndpointBody>, JsonRejection>,
) -> Response {
    let b = match json_body(b) {
        Ok(b) => b,
        Err(r) => return r,
    };
    match cp.add_endpoint(&node_id, &b.name).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => fail(StatusCode::NOT_FOUND, "unknown_node"),
        Err(e) => unavailable(e),
    }
}

#[derive(Deserialize)]
struct PublishBody {
    version: u64,
    configurations: Vec<RuntimeConfiguration>,
}

async fn admin_publish(
    State(cp): State<ControlPlane>,
    Path(node_id): Path<String>,
    b: Result<axum::Json<PublishBody>, JsonRejection>,
) -> Response {
    let b = match json_body(b) {
        Ok(b) => b,
        Err(r) => return r,
    };
    match cp.publish(&node_id, b.version, &b.configurations).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => fail(StatusCode::CONFLICT, "version_not_newer_or_unknown_node"),
        Err(e) => unavailable(e),
    }
}

async fn admin_node(State(cp): State<ControlPlane>, Path(node_id): Path<String>) -> Response {
    match cp.node(&node_id).await {
        Ok(Some(n)) => axum::Json(json!({
            "node_id": n.node_id,
            "current_version": n.current_applied,
            "reported_address": n.reported_address,
            "last_heartbeat": n.last_heartbeat,
            "endpoints": n.endpoints,
        }))
        .into_response(),
        Ok(None) => fail(StatusCode::NOT_FOUND, "unknown_node"),
        Err(e) => unavailable(e),
    }
}

async fn certificates(
    State(cp): State<ControlPlane>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let node = match cp.authenticate(&method, &uri, &headers, &body).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let list: Vec<Value> = match cp.store.certificates(&node.node_id).await {
        Ok(v) => v
            .iter()
            .map(|c| json!({ "certificate_id": c.id, "names": c.names, "serial": c.serial, "not_after": c.not_after }))
            .collect(),
        Err(e) => return unavailable(e),
    };
    axum::Json(json!({ "certificates": list })).into_response()
}

#[derive(Deserialize)]
struct CsrBody {
    csr: String,
}

/// Serial (hex) and notAfter (Unix seconds) of the first certificate of a PEM chain.
fn leaf_metadata(chain_pem: &str) -> Option<(String, i64)> {
    let b64: String = chain_pem
        .split("-----BEGIN CERTIFICATE-----")
        .nth(1)?
        .split("-----END CERTIFICATE-----")
        .next()?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let der = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
    Some((
        cert.raw_serial_as_string(),
        cert.validity().not_after.timestamp(),
    ))
}

async fn certificate_csr(
    State(cp): State<ControlPlane>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let node = match cp.authenticate(&method, &uri, &headers, &body).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let Some(issuer) = cp.issuer.clone() else {
        return fail(
            StatusCode::SERVICE_UNAVAILABLE,
            "certificates_not_configured",
        );
    };
    let Ok(b) = serde_json::from_slice::<CsrBody>(&body) else {
        return fail(StatusCode::BAD_REQUEST, "invalid_body");
    };
    let checked = crate::certs::csr_der(b.csr.as_bytes())
        .and_then(|der| crate::certs::validate_csr(&der, &node.endpoints).map(|n| (der, n)));
    let (der, names) = match checked {
        Ok(v) => v,
        Err(e) => {
            let code = match e {
                crate::certs::CsrError::Parse => "csr_parse",
                crate::certs::CsrError::Signature => "csr_signature",
                crate::certs::CsrError::NoNames => "csr_no_names",
                crate::certs::CsrError::ForeignName => "csr_foreign_name",
                crate::certs::CsrError::Key => "csr_key",
            };
            return fail(StatusCode::BAD_REQUEST, code);
        }
    };
    let chain = match issuer.issue(&names, &der).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(target: "orbit_runtime", event = "orbit_acme_failed", error = %e, "certificate issuance failed");
            return fail(StatusCode::SERVICE_UNAVAILABLE, "issuance_failed");
        }
    };
    let (serial, not_after) = leaf_metadata(&chain).unwrap_or_default();
    let mut raw = [0u8; 8];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut raw);
    let id = format!(
        "cert-{}",
        raw.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let row = CertRow {
        id: id.clone(),
        names: names.clone(),
        serial: serial.clone(),
        not_after,
    };
    if let Err(e) = cp.store.add_certificate(&node.node_id, &row).await {
        return unavailable(e);
    }
    tracing::info!(target: "orbit_runtime", event = "orbit_certificate_issued", node_id = %node.node_id, "certificate issued");
    axum::Json(json!({
        "certificate_id": id,
        "names": names,
        "serial": serial,
        "not_after": not_after,
        "chain_pem": chain,
    }))
    .into_response()
}
