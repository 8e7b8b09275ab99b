//! The control plane's durable store: deployment token digests, runtime registrations (public
//! keys only), liveness and reported addresses, endpoints, desired state versions, apply
//! results and the current applied version, certificate metadata, and the signed-request
//! nonces (so a replay is refused by every replica, not only the one that saw the request).
//!
//! One [`OrbitStore`] trait, two backends passing one contract suite
//! (`tests/store_contract.rs`): [`SqliteStore`] (a file, or in memory — the embedded default)
//! and [`PgStore`] (PostgreSQL, for several control plane replicas). Each method is one
//! transaction; `apply_results` records the results and advances `current_version` in the same
//! transaction ([`crate::versions::advance`]). Errors carry no stored values; backend text is
//! logged at `debug`.

use async_trait::async_trait;

use crate::versions::ApplyStatus;

mod pg;
mod sqlite;

pub use pg::PgStore;
pub use sqlite::SqliteStore;

/// A store failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The backend failed.
    #[error("store unavailable")]
    Unavailable,
}

/// A registration to bind or refresh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// The runtime's installation id (the key of the binding).
    pub installation_id: String,
    /// Its Ed25519 public key.
    pub public_key: [u8; 32],
    /// Its device fingerprint hash.
    pub device_fingerprint_hash: String,
    /// Reported address (kept when `None`).
    pub reported_address: Option<String>,
    /// Public address (kept when `None`).
    pub public_address: Option<String>,
}

/// A registered runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRow {
    /// Node id.
    pub node_id: String,
    /// Edge runtime id.
    pub edge_runtime_id: String,
    /// Installation id.
    pub installation_id: String,
    /// Public key.
    pub public_key: [u8; 32],
    /// Device fingerprint hash.
    pub device_fingerprint_hash: String,
    /// Last reported address.
    pub reported_address: Option<String>,
    /// Last public address.
    pub public_address: Option<String>,
    /// Last heartbeat (Unix seconds).
    pub last_heartbeat: Option<i64>,
    /// Current applied version.
    pub current_applied: u64,
    /// Endpoint names.
    pub endpoints: Vec<String>,
}

/// Certificate metadata (never key material).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertRow {
    /// Certificate id.
    pub id: String,
    /// Names.
    pub names: Vec<String>,
    /// Serial (hex).
    pub serial: String,
    /// notAfter (Unix seconds).
    pub not_after: i64,
}

/// The store.
#[async_trait]
pub trait OrbitStore: Send + Sync + 'static {
    /// Stores a deployment token digest usable `uses` times.
    async fn create_token(&self, digest: [u8; 32], uses: u32) -> Result<(), StoreError>;
    /// Uses a deployment token once; `false` when unknown or used up.
    async fn consume_token(&self, digest: [u8; 32]) -> Result<bool, StoreError>;
    /// Binds a new installation (allocating `node-N`) or refreshes an existing one's key,
    /// fingerprint and (when given) addresses. Returns the Node.
    async fn register(&self, r: &Registration) -> Result<NodeRow, StoreError>;
    /// A Node.
    async fn node(&self, node_id: &str) -> Result<Option<NodeRow>, StoreError>;
    /// Records a heartbeat at `at`; a given address replaces the last one (none keeps it).
    /// Returns whether the reported address changed, or `None` for an unknown Node.
    async fn heartbeat(
        &self,
        node_id: &str,
        at: i64,
        reported_address: Option<&str>,
        public_address: Option<&str>,
    ) -> Result<Option<bool>, StoreError>;
    /// Adds an endpoint name to a Node; `false` for an unknown Node.
    async fn add_endpoint(&self, node_id: &str, name: &str) -> Result<bool, StoreError>;
    /// Publishes a version (only above the latest); `false` when not newer or unknown Node.
    async fn publish(
        &self,
        node_id: &str,
        version: u64,
        configurations_json: &str,
    ) -> Result<bool, StoreError>;
    /// The latest published version and its configurations (JSON), if any.
    async fn latest(&self, node_id: &str) -> Result<Option<(u64, String)>, StoreError>;
    /// Records apply results for `version` and advances the current version when every
    /// configuration id in `configuration_ids` is applied. `None` for an unknown version.
    async fn apply_results(
        &self,
        node_id: &str,
        version: u64,
        configuration_ids: &[String],
        results: &[(String, ApplyStatus)],
    ) -> Result<Option<u64>, StoreError>;
    /// The configurations (JSON) of a version.
    async fn configurations(
        &self,
        node_id: &str,
        version: u64,
    ) -> Result<Option<String>, StoreError>;
    /// Adds certificate metadata.
    async fn add_certificate(&self, node_id: &str, cert: &CertRow) -> Result<(), StoreError>;
    /// A Node's certificate metadata.
    async fn certificates(&self, node_id: &str) -> Result<Vec<CertRow>, StoreError>;
    /// Records a nonce until `expires_at`; `false` if it is already recorded and live at `now`.
    /// An expired nonce is revived in place; expired rows are purged in bulk once every
    /// [`NONCE_PURGE_EVERY`] writes, not on every request.
    async fn record_nonce(
        &self,
        node_id: &str,
        nonce: &str,
        expires_at: i64,
        now: i64,
    ) -> Result<bool, StoreError>;

    /// A signed heartbeat's two writes as one step: records `nonce` as
    /// [`OrbitStore::record_nonce`] does and, only if it was fresh, the heartbeat as
    /// [`OrbitStore::heartbeat`] does. `Ok(None)` for an unknown Node; a replayed nonce writes
    /// nothing. The default runs the two in turn; the SQLite and PostgreSQL stores do both in
    /// one transaction (one trip to the store per heartbeat, as an unsigned one would take).
    async fn heartbeat_with_nonce(
        &self,
        heartbeat: &SignedHeartbeat<'_>,
    ) -> Result<Option<HeartbeatOutcome>, StoreError> {
        let h = heartbeat;
        if !self
            .record_nonce(h.node_id, h.nonce, h.nonce_expires_at, h.now)
            .await?
        {
            return Ok(Some(HeartbeatOutcome::Replayed));
        }
        Ok(self
            .heartbeat(h.node_id, h.at, h.reported_address, h.public_address)
            .await?
            .map(|changed| HeartbeatOutcome::Recorded { changed }))
    }
}

/// The arguments of [`OrbitStore::heartbeat_with_nonce`].
#[derive(Clone, Copy, Debug)]
pub struct SignedHeartbeat<'a> {
    /// The Node.
    pub node_id: &'a str,
    /// The request's nonce, kept until `nonce_expires_at`.
    pub nonce: &'a str,
    /// When the nonce may be forgotten.
    pub nonce_expires_at: i64,
    /// Now (nonces expired before this may be revived).
    pub now: i64,
    /// The heartbeat's time.
    pub at: i64,
    /// A reported address (none keeps the last).
    pub reported_address: Option<&'a str>,
    /// A public address (none keeps the last).
    pub public_address: Option<&'a str>,
}

/// What [`OrbitStore::heartbeat_with_nonce`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeartbeatOutcome {
    /// The nonce was live already: nothing written.
    Replayed,
    /// Recorded; whether the reported address changed.
    Recorded {
        /// The reported address changed.
        changed: bool,
    },
}

/// Expired nonces are deleted in bulk once every this many `record_nonce` calls per store
/// handle, so the signed-request hot path does one write, not a scan and a write.
pub const NONCE_PURGE_EVERY: u64 = 1024;

/// Inserts a nonce, or revives it when the recorded one has expired (`?4` is now); a live
/// duplicate changes no row, which is how a replay is detected.
pub(crate) const RECORD_NONCE_SQLITE: &str = "INSERT INTO nonces (node_id, nonce, expires_at) \
     VALUES (?1, ?2, ?3) ON CONFLICT (node_id, nonce) DO UPDATE \
     SET expires_at = excluded.expires_at WHERE nonces.expires_at < ?4";

/// [`RECORD_NONCE_SQLITE`] for PostgreSQL.
pub(crate) const RECORD_NONCE_PG: &str = "INSERT INTO nonces (node_id, nonce, expires_at) \
     VALUES ($1, $2, $3) ON CONFLICT (node_id, nonce) DO UPDATE \
     SET expires_at = excluded.expires_at WHERE nonces.expires_at < $4";

/// Whether this `record_nonce` call should also purge expired nonces (the first, then every
/// [`NONCE_PURGE_EVERY`]th).
pub(crate) fn purge_due(writes: &std::sync::atomic::AtomicU64) -> bool {
    writes
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        .is_multiple_of(NONCE_PURGE_EVERY)
}

pub(crate) fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

pub(crate) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

pub(crate) fn status_str(s: ApplyStatus) -> &'static str {
    s.as_str()
}
