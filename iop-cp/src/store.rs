//! The durable store: principals, IOP API token digests, credential slots (sealed at rest),
//! routes, the mutation log and the projection generation; and the usage records Edges send
//! (append-only, idempotent by request id, rolled up by day).
//!
//! One [`Store`] trait, two backends that pass one contract suite (`tests/store_contract.rs`):
//! [`SqliteStore`] (a file in the data directory; the default, nothing to start) and
//! [`PgStore`] (PostgreSQL, for several Control Plane replicas sharing state).
//!
//! Rules every backend keeps:
//! - Every durable mutation runs in one transaction that also bumps the projection generation
//!   by exactly one and appends one row to the mutation log (`revisions`): the generation is
//!   strictly increasing and names exactly one committed state.
//! - Tokens are stored only as SHA-256 verifier digests; slot credentials only sealed
//!   ([`crate::seal`]). Nothing here ever sees a raw token or provider credential.
//! - Re-putting a slot (rotation) or a route bumps its own revision.
//! - Lease issuer keys are sealed like slots; at most one is active and one staged
//!   ([`IssuerKey`]). Every replica of a shared store signs with the same active key.
//! - [`Store::snapshot`] and [`Store::lease_view`] are consistent reads of one generation.
//! - Errors are typed and carry no stored values; backend error text is logged at `debug`
//!   and replaced by a stable message.

use async_trait::async_trait;

mod pg;
mod sqlite;

pub use pg::PgStore;
pub use sqlite::SqliteStore;

/// Longest id accepted (principal, token, slot, route).
pub const MAX_ID_LEN: usize = 128;
/// Longest free-text field (display name, header prefix).
pub const MAX_TEXT_LEN: usize = 512;
/// Longest model, upstream target or selector (the wire's target limit).
pub const MAX_TARGET_LEN: usize = 256;

/// A principal: who a token authenticates as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Stable id.
    pub id: String,
    /// Human-readable name.
    pub display_name: String,
    /// Disabled principals authenticate nothing and get no lease.
    pub enabled: bool,
    /// Rate limits and spend budgets the Edges enforce ([`Mutation::SetPrincipalLimits`]);
    /// `None`: not limited.
    pub limits: Option<PrincipalLimits>,
}

pub use iop_wire::control::{MAX_MODEL_LIMITS, ModelLimits, PrincipalLimits};

/// Largest requests or tokens per minute a principal may be given: what an Edge sharing
/// limits through Redis computes exactly (`iop_edge::limits::shared::exact_in_lua`).
pub const MAX_RATE_PER_MINUTE: u64 = 150_000_000;

/// Largest spend budget, millionths of a US dollar (ten million dollars).
pub const MAX_BUDGET_MICRO_USD: u64 = 10_000_000 * 1_000_000;

/// Stored form of [`PrincipalLimits`] (a JSON text column) and the admin API's body: the
/// names of the Edge's `[auth.key_limits.<id>]`, budgets in US dollars.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsDoc {
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Tokens (input + output) per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight, per Edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrent: Option<u32>,
    /// Spend per UTC day, US dollars.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_usd_per_day: Option<f64>,
    /// Spend per UTC calendar month, US dollars.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_usd_per_month: Option<f64>,
    /// Per external model.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub models: std::collections::BTreeMap<String, ModelLimitsDoc>,
}

/// One model's entry in a [`LimitsDoc`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelLimitsDoc {
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight, per Edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrent: Option<u32>,
}

fn micro_usd(v: Option<f64>) -> Result<u64, StoreError> {
    match v {
        None => Ok(0),
        Some(usd) if usd.is_finite() && usd > 0.0 && usd * 1e6 <= MAX_BUDGET_MICRO_USD as f64 => {
            Ok((usd * 1e6).round() as u64)
        }
        Some(_) => Err(StoreError::Invalid("budget (US dollars, more than 0)")),
    }
}

fn usd(v: u64) -> Option<f64> {
    (v > 0).then(|| v as f64 / 1e6)
}

impl LimitsDoc {
    /// The limits it names (checked by [`Mutation::validate`] when set).
    pub fn to_limits(&self) -> Result<PrincipalLimits, StoreError> {
        Ok(PrincipalLimits {
            requests_per_minute: self.requests_per_minute.unwrap_or(0),
            tokens_per_minute: self.tokens_per_minute.unwrap_or(0),
            concurrent: self.concurrent.unwrap_or(0),
            budget_per_day_micro_usd: micro_usd(self.budget_usd_per_day)?,
            budget_per_month_micro_usd: micro_usd(self.budget_usd_per_month)?,
            models: self
                .models
                .iter()
                .map(|(model, m)| ModelLimits {
                    model: model.clone(),
                    requests_per_minute: m.requests_per_minute.unwrap_or(0),
                    tokens_per_minute: m.tokens_per_minute.unwrap_or(0),
                    concurrent: m.concurrent.unwrap_or(0),
                })
                .collect(),
        })
    }

    /// The document naming `limits`.
    pub fn of(limits: &PrincipalLimits) -> Self {
        let nz = |v: u64| (v > 0).then_some(v);
        let nz32 = |v: u32| (v > 0).then_some(v);
        Self {
            requests_per_minute: nz(limits.requests_per_minute),
            tokens_per_minute: nz(limits.tokens_per_minute),
            concurrent: nz32(limits.concurrent),
            budget_usd_per_day: usd(limits.budget_per_day_micro_usd),
            budget_usd_per_month: usd(limits.budget_per_month_micro_usd),
            models: limits
                .models
                .iter()
                .map(|m| {
                    (
                        m.model.clone(),
                        ModelLimitsDoc {
                            requests_per_minute: nz(m.requests_per_minute),
                            tokens_per_minute: nz(m.tokens_per_minute),
                            concurrent: nz32(m.concurrent),
                        },
                    )
                })
                .collect(),
        }
    }
}

/// The stored text of `limits` (`None` stays NULL).
pub(crate) fn limits_text(limits: Option<&PrincipalLimits>) -> Option<String> {
    limits.map(|l| serde_json::to_string(&LimitsDoc::of(l)).unwrap_or_default())
}

/// `limits` read back from its stored text; text that does not parse (written by hand) is
/// logged and read as no limits rather than failing every read of the store.
pub(crate) fn limits_from_text(text: Option<String>) -> Option<PrincipalLimits> {
    let text = text?;
    match serde_json::from_str::<LimitsDoc>(&text).map(|d| d.to_limits()) {
        Ok(Ok(l)) => Some(l),
        _ => {
            tracing::warn!("a principal's stored limits do not parse; read as none");
            None
        }
    }
}

/// An IOP API token, as its verifier digest only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    /// Stable id (shown in listings; not secret).
    pub id: String,
    /// Owner.
    pub principal_id: String,
    /// SHA-256 of the raw token.
    pub digest: [u8; 32],
    /// Revoked tokens stay listed but leave the projection.
    pub revoked: bool,
}

/// A credential slot: one provider credential, sealed at rest.
#[derive(Clone, PartialEq, Eq)]
pub struct Slot {
    /// Stable id.
    pub id: String,
    /// Protocol profile the credential is for (e.g. `openai`).
    pub profile: String,
    /// Header the Node writes the credential into (e.g. `authorization`).
    pub header_name: String,
    /// Prefix before the secret in that header (e.g. `Bearer `).
    pub header_prefix: String,
    /// The sealed credential ([`crate::seal`]); opaque here.
    pub sealed: Vec<u8>,
    /// Bumped by every rotation.
    pub revision: u64,
    /// Disabled slots issue no lease.
    pub enabled: bool,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("id", &self.id)
            .field("profile", &self.profile)
            .field("header_name", &self.header_name)
            .field("revision", &self.revision)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

/// A route: principal + external model → slot, profile, upstream target, selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Stable id.
    pub id: String,
    /// The principal allowed to use it.
    pub principal_id: String,
    /// External model name the principal asks for.
    pub model: String,
    /// The credential slot.
    pub slot_id: String,
    /// Protocol profile (must equal the slot's).
    pub profile: String,
    /// The provider's own model/target.
    pub upstream_target: String,
    /// Provider selector (opaque to the store).
    pub selector: String,
    /// Bumped by every update.
    pub revision: u64,
    /// Disabled routes resolve nothing.
    pub enabled: bool,
}

/// A lease issuer signing key, sealed at rest with the master key (AAD `issuer:` + id).
///
/// A store holds at most two: the **active** key (leases are signed with it; the projection
/// names it) and at most one **staged** key (published ahead of time so Nodes can pin it;
/// [`Mutation::ActivateIssuerKey`] makes it the active one and deletes the old one).
#[derive(Clone, PartialEq, Eq)]
pub struct IssuerKey {
    /// The key id (`iop_lease::issuer_key_id`, derived from the key).
    pub id: String,
    /// The sealed PKCS#8 PEM ([`crate::seal`]); empty in a [`Snapshot`].
    pub sealed: Vec<u8>,
    /// Whether leases are signed with it now.
    pub active: bool,
    /// A staged key: when the Control Plane activates it (Unix ms). The active key: when it
    /// was installed or activated.
    pub activates_at_unix_ms: i64,
}

impl std::fmt::Debug for IssuerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuerKey")
            .field("id", &self.id)
            .field("active", &self.active)
            .field("activates_at_unix_ms", &self.activates_at_unix_ms)
            .finish_non_exhaustive()
    }
}

/// One durable mutation. Each is applied in its own transaction with a generation bump.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Creates a principal (enabled).
    CreatePrincipal {
        /// Id.
        id: String,
        /// Display name.
        display_name: String,
    },
    /// Enables or disables a principal.
    SetPrincipalEnabled {
        /// Id.
        id: String,
        /// New state.
        enabled: bool,
    },
    /// Sets a principal's rate limits and spend budgets (`None` clears them).
    SetPrincipalLimits {
        /// Id.
        id: String,
        /// The limits; every value zero means "not limited".
        limits: Option<PrincipalLimits>,
    },
    /// Adds a token digest for a principal.
    CreateToken {
        /// Token id.
        id: String,
        /// Owner.
        principal_id: String,
        /// SHA-256 of the raw token.
        digest: [u8; 32],
    },
    /// Revokes a token.
    RevokeToken {
        /// Token id.
        id: String,
    },
    /// Creates a slot (revision 1) or rotates it (revision + 1, new sealed credential).
    PutSlot {
        /// Slot id.
        id: String,
        /// Profile.
        profile: String,
        /// Header name.
        header_name: String,
        /// Header prefix.
        header_prefix: String,
        /// Sealed credential.
        sealed: Vec<u8>,
    },
    /// Enables or disables a slot.
    SetSlotEnabled {
        /// Id.
        id: String,
        /// New state.
        enabled: bool,
    },
    /// Creates a route (revision 1) or updates it (revision + 1).
    PutRoute {
        /// Route id.
        id: String,
        /// Principal.
        principal_id: String,
        /// External model.
        model: String,
        /// Slot.
        slot_id: String,
        /// Upstream target.
        upstream_target: String,
        /// Selector.
        selector: String,
    },
    /// Enables or disables a route.
    SetRouteEnabled {
        /// Id.
        id: String,
        /// New state.
        enabled: bool,
    },
    /// Installs the first lease issuer key, active at once. [`StoreError::Conflict`] when
    /// the store already has an active key (another replica installed its own first).
    InstallIssuerKey {
        /// Key id (derived from the key).
        id: String,
        /// Sealed PKCS#8 PEM.
        sealed: Vec<u8>,
    },
    /// Stages the next lease issuer key, to be activated at `activates_at_unix_ms` (positive).
    /// [`StoreError::Conflict`] when the id exists or a key is already staged,
    /// [`StoreError::NotFound`] without an active key.
    StageIssuerKey {
        /// Key id (derived from the key).
        id: String,
        /// Sealed PKCS#8 PEM.
        sealed: Vec<u8>,
        /// When a Control Plane activates it.
        activates_at_unix_ms: i64,
    },
    /// Makes the staged key `id` the active one and deletes the previously active key.
    /// [`StoreError::NotFound`] when `id` is not the staged key (e.g. another replica
    /// activated it first).
    ActivateIssuerKey {
        /// The staged key's id.
        id: String,
    },
}

impl Mutation {
    /// The log kind and object id of this mutation.
    pub fn describe(&self) -> (&'static str, &str) {
        match self {
            Self::CreatePrincipal { id, .. } => ("create_principal", id),
            Self::SetPrincipalEnabled { id, .. } => ("set_principal_enabled", id),
            Self::SetPrincipalLimits { id, .. } => ("set_principal_limits", id),
            Self::CreateToken { id, .. } => ("create_token", id),
            Self::RevokeToken { id } => ("revoke_token", id),
            Self::PutSlot { id, .. } => ("put_slot", id),
            Self::SetSlotEnabled { id, .. } => ("set_slot_enabled", id),
            Self::PutRoute { id, .. } => ("put_route", id),
            Self::SetRouteEnabled { id, .. } => ("set_route_enabled", id),
            Self::InstallIssuerKey { id, .. } => ("install_issuer_key", id),
            Self::StageIssuerKey { id, .. } => ("stage_issuer_key", id),
            Self::ActivateIssuerKey { id } => ("activate_issuer_key", id),
        }
    }

    /// Field checks shared by every backend (bounds, non-empty ids, header syntax).
    pub fn validate(&self) -> Result<(), StoreError> {
        fn id(v: &str, what: &'static str) -> Result<(), StoreError> {
            if v.is_empty()
                || v.len() > MAX_ID_LEN
                || !v
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
            {
                return Err(StoreError::Invalid(what));
            }
            Ok(())
        }
        // The wire's target rule (`iop_wire` validation): ASCII graphic, at most 256 bytes.
        fn target(v: &str, what: &'static str, required: bool) -> Result<(), StoreError> {
            if (required && v.is_empty())
                || v.len() > MAX_TARGET_LEN
                || !v.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(StoreError::Invalid(what));
            }
            Ok(())
        }
        fn text(v: &str, what: &'static str) -> Result<(), StoreError> {
            if v.len() > MAX_TEXT_LEN || v.chars().any(char::is_control) {
                return Err(StoreError::Invalid(what));
            }
            Ok(())
        }
        match self {
            Self::CreatePrincipal {
                id: i,
                display_name,
            } => {
                id(i, "principal id")?;
                text(display_name, "display name")
            }
            Self::SetPrincipalEnabled { id: i, .. } => id(i, "principal id"),
            Self::SetPrincipalLimits { id: i, limits } => {
                id(i, "principal id")?;
                let Some(l) = limits else { return Ok(()) };
                let rates = std::iter::once((l.requests_per_minute, l.tokens_per_minute)).chain(
                    l.models
                        .iter()
                        .map(|m| (m.requests_per_minute, m.tokens_per_minute)),
                );
                for (r, t) in rates {
                    if r > MAX_RATE_PER_MINUTE || t > MAX_RATE_PER_MINUTE {
                        return Err(StoreError::Invalid("limit (at most 150000000 per minute)"));
                    }
                }
                if l.budget_per_day_micro_usd > MAX_BUDGET_MICRO_USD
                    || l.budget_per_month_micro_usd > MAX_BUDGET_MICRO_USD
                {
                    return Err(StoreError::Invalid("budget (at most 10000000 US dollars)"));
                }
                if l.models.len() > MAX_MODEL_LIMITS {
                    return Err(StoreError::Invalid("limits (too many models)"));
                }
                let mut seen = std::collections::BTreeSet::new();
                for m in &l.models {
                    target(&m.model, "model", true)?;
                    if !seen.insert(m.model.as_str()) {
                        return Err(StoreError::Invalid("limits (a model named twice)"));
                    }
                }
                Ok(())
            }
            Self::CreateToken {
                id: i,
                principal_id,
                ..
            } => {
                id(i, "token id")?;
                id(principal_id, "principal id")
            }
            Self::RevokeToken { id: i } => id(i, "token id"),
            Self::PutSlot {
                id: i,
                profile,
                header_name,
                header_prefix,
                sealed,
            } => {
                id(i, "slot id")?;
                id(profile, "profile")?;
                let header_ok = !header_name.is_empty()
                    && header_name.len() <= 64
                    && header_name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
                if !header_ok {
                    return Err(StoreError::Invalid("header name"));
                }
                text(header_prefix, "header prefix")?;
                if sealed.is_empty() || sealed.len() > 64 * 1024 {
                    return Err(StoreError::Invalid("sealed credential"));
                }
                Ok(())
            }
            Self::SetSlotEnabled { id: i, .. } => id(i, "slot id"),
            Self::PutRoute {
                id: i,
                principal_id,
                model,
                slot_id,
                upstream_target,
                selector,
            } => {
                id(i, "route id")?;
                id(principal_id, "principal id")?;
                id(slot_id, "slot id")?;
                target(model, "model", true)?;
                target(upstream_target, "upstream target", true)?;
                target(selector, "selector", false)
            }
            Self::SetRouteEnabled { id: i, .. } => id(i, "route id"),
            Self::InstallIssuerKey { id: i, sealed }
            | Self::StageIssuerKey { id: i, sealed, .. } => {
                id(i, "issuer key id")?;
                if sealed.is_empty() || sealed.len() > 64 * 1024 {
                    return Err(StoreError::Invalid("sealed issuer key"));
                }
                // The wire names a staged key only with a positive activation time.
                if let Self::StageIssuerKey {
                    activates_at_unix_ms,
                    ..
                } = self
                    && *activates_at_unix_ms <= 0
                {
                    return Err(StoreError::Invalid("issuer key activation time"));
                }
                Ok(())
            }
            Self::ActivateIssuerKey { id: i } => id(i, "issuer key id"),
        }
    }
}

/// Everything the projection is built from, at one generation. Slots carry no sealed bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The projection generation of this state.
    pub generation: u64,
    /// All principals.
    pub principals: Vec<Principal>,
    /// All tokens (revoked included).
    pub tokens: Vec<Token>,
    /// All slots, `sealed` emptied.
    pub slots: Vec<Slot>,
    /// All routes.
    pub routes: Vec<Route>,
    /// The lease issuer keys (active first, then the staged one), `sealed` emptied.
    pub issuer_keys: Vec<IssuerKey>,
}

impl Snapshot {
    /// The active issuer key, if one is installed.
    pub fn active_issuer(&self) -> Option<&IssuerKey> {
        self.issuer_keys.iter().find(|k| k.active)
    }

    /// The staged issuer key, if any.
    pub fn staged_issuer(&self) -> Option<&IssuerKey> {
        self.issuer_keys.iter().find(|k| !k.active)
    }
}

/// What the lease service re-reads before decrypting, at one generation.
#[derive(Clone, Debug)]
pub struct LeaseView {
    /// Current generation.
    pub generation: u64,
    /// The route, if it exists.
    pub route: Option<Route>,
    /// The slot (with its sealed credential), if it exists.
    pub slot: Option<Slot>,
    /// The route's principal, if it exists.
    pub principal: Option<Principal>,
    /// The active issuer key (with its sealed PEM), if one is installed.
    pub issuer: Option<IssuerKey>,
}

/// One row of the mutation log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revision {
    /// The generation this mutation produced.
    pub generation: u64,
    /// Mutation kind ([`Mutation::describe`]).
    pub kind: String,
    /// The mutated object's id.
    pub object_id: String,
    /// When it was applied (Unix ms, the applying process's clock).
    pub at_unix_ms: i64,
}

/// Store failures. None carries stored values or backend text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A field failed validation.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// The named object does not exist.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The object already exists, or a unique value (token digest, principal + model) is
    /// taken.
    #[error("{0} already exists")]
    Conflict(&'static str),
    /// The route's profile differs from its slot's.
    #[error("route profile does not match the slot's profile")]
    ProfileMismatch,
    /// The backend failed (I/O, connection, constraint not otherwise mapped).
    #[error("store unavailable")]
    Unavailable,
}

pub use iop_wire::control::UsageRecord;

/// What [`Store::record_usage`] did with a report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsageStored {
    /// Records stored now.
    pub stored: u32,
    /// Records already stored (a replay): nothing was added for them.
    pub duplicates: u32,
}

/// One row of the daily usage rollup: a UTC day, a principal, a model and an outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DailyUsage {
    /// `YYYY-MM-DD` (UTC).
    pub day: String,
    /// The principal.
    pub principal_id: String,
    /// The external model.
    pub model: String,
    /// `completed`, `failed`, `cancelled`, `refused`.
    pub outcome: String,
    /// Requests.
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens read from the provider's cache.
    pub cached_input_tokens: u64,
    /// Cost at the Edges' prices, pico-dollars.
    pub cost_pico_usd: u64,
}

/// The UTC day (`YYYY-MM-DD`) of a Unix time in milliseconds.
pub fn day_of(unix_ms: i64) -> String {
    // Howard Hinnant's civil_from_days.
    let z = unix_ms.div_euclid(86_400_000) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Whether `day` reads `YYYY-MM-DD` (digits and dashes; a filter, not a calendar check).
pub fn is_day(day: &str) -> bool {
    day.len() == 10
        && day.bytes().enumerate().all(|(i, b)| {
            if i == 4 || i == 7 {
                b == b'-'
            } else {
                b.is_ascii_digit()
            }
        })
}

/// The durable store. Both backends pass `tests/store_contract.rs` unchanged.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Applies one mutation atomically with a generation bump; returns the new generation.
    async fn apply(&self, mutation: Mutation) -> Result<u64, StoreError>;
    /// The current generation: 1 for a new, empty store (the wire's projection generations
    /// start at 1), then one more per mutation.
    async fn generation(&self) -> Result<u64, StoreError>;
    /// A consistent read of everything but sealed credentials.
    async fn snapshot(&self) -> Result<Snapshot, StoreError>;
    /// A consistent read of one route, one slot (with its sealed credential) and the route's
    /// principal, with the generation they belong to.
    async fn lease_view(&self, route_id: &str, slot_id: &str) -> Result<LeaseView, StoreError>;
    /// The issuer keys with their sealed PEMs (active first, then the staged one).
    async fn issuer_keys(&self) -> Result<Vec<IssuerKey>, StoreError>;
    /// The mutation log after `after_generation`, oldest first, at most `limit` rows.
    async fn revisions(
        &self,
        after_generation: u64,
        limit: u32,
    ) -> Result<Vec<Revision>, StoreError>;
    /// The latest revision of each object that mutations of `kind` touched (when each token
    /// was created, each slot last put), at most `limit` objects, by object id. The backends
    /// answer from an index on `(kind, object_id, generation)`; this default pages through
    /// [`Store::revisions`] (for wrappers).
    async fn last_revisions(&self, kind: &str, limit: u32) -> Result<Vec<Revision>, StoreError> {
        let mut last: std::collections::BTreeMap<String, Revision> =
            std::collections::BTreeMap::new();
        let mut after = 0;
        loop {
            let page = self.revisions(after, 1000).await?;
            let Some(end) = page.last().map(|r| r.generation) else {
                break;
            };
            for r in page.into_iter().filter(|r| r.kind == kind) {
                last.insert(r.object_id.clone(), r);
            }
            after = end;
        }
        Ok(last
            .into_values()
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .collect())
    }
    /// Stores usage records sent by Edge `edge_id`, in one transaction: each record once
    /// (by request id; a replay counts as a duplicate and changes nothing), added to the
    /// daily rollup ([`Store::usage_daily`]) when stored. Not a mutation: the projection
    /// generation does not move.
    async fn record_usage(
        &self,
        edge_id: &str,
        records: &[UsageRecord],
    ) -> Result<UsageStored, StoreError>;
    /// The daily rollup from UTC day `since` (`YYYY-MM-DD`; `None`: all), by day, principal,
    /// model and outcome, at most `limit` rows.
    async fn usage_daily(
        &self,
        since: Option<&str>,
        limit: u32,
    ) -> Result<Vec<DailyUsage>, StoreError>;
    /// Deletes the raw usage records older than `before_unix_ms` (the rollup stays); how many.
    async fn prune_usage(&self, before_unix_ms: i64) -> Result<u64, StoreError>;
    /// Returns when the store may have been changed by another process or replica (the CLI,
    /// a second `iop-cp serve`), or after `limit` at the latest; the server then reads the
    /// generation. Spurious returns are harmless. The default just waits `limit` (a plain
    /// poll); SQLite watches `PRAGMA data_version`, PostgreSQL `LISTEN`s for the `NOTIFY`
    /// every mutation sends.
    async fn wait_change(&self, limit: std::time::Duration) {
        tokio::time::sleep(limit).await;
    }
}

/// Now, in Unix milliseconds (revision timestamps, lease windows).
pub(crate) fn unix_ms() -> i64 {
    iop_wire::time::unix_ms(std::time::SystemTime::now())
}

pub(crate) fn digest_array(v: &[u8]) -> Result<[u8; 32], StoreError> {
    v.try_into().map_err(|_| StoreError::Unavailable)
}

pub(crate) fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

pub(crate) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
