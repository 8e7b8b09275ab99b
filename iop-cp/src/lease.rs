//! The lease service (seeds `000`/`001`): after the Edge authenticated a request, resolved its
//! route and admitted it to a provider, it asks for a lease with the exact binding. The service
//! re-reads durable state, checks every binding field against it, and only then decrypts the
//! slot and issues a signed lease sealed to the selected Node's X25519 key.
//!
//! Checks, in order, each a distinct [`LeaseRefusal`] (fail closed, no plaintext anywhere):
//! generation → route exists/enabled → principal (same as the route's, exists, enabled) →
//! slot (same as the route's, exists, enabled) → profile → upstream target → route revision →
//! credential revision → recipient key → decrypt → issue.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use iop_lease::{Credential, DEFAULT_MAX_TTL, HeaderSpec, Issuer, RecipientPublicKey, Secret};
use iop_wire::control::AcquireLeaseRequest;
use iop_wire::runtime::CredentialLease;

use crate::seal::MasterKey;
use crate::store::{IssuerKey, Store};

/// Default lease lifetime.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// Why a lease was refused. The `as_str` form is what the Edge receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseRefusal {
    /// The binding's projection generation is not the store's current one.
    #[error("stale projection generation")]
    StaleGeneration,
    /// The route does not exist or is disabled.
    #[error("route unavailable")]
    RouteUnavailable,
    /// The binding's principal is not the route's, or is disabled or gone.
    #[error("principal mismatch")]
    PrincipalMismatch,
    /// The binding's slot is not the route's, or is disabled or gone.
    #[error("slot unavailable")]
    SlotUnavailable,
    /// Profile or upstream target differ from the route.
    #[error("scope mismatch")]
    ScopeMismatch,
    /// The route or credential revision moved on.
    #[error("stale revision")]
    StaleRevision,
    /// The recipient key does not match the binding, or cannot be sealed to (low order).
    #[error("recipient mismatch")]
    RecipientMismatch,
    /// The store, the master key or the issuer failed.
    #[error("lease service unavailable")]
    Unavailable,
}

impl LeaseRefusal {
    /// The stable reason string sent on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StaleGeneration => "stale_generation",
            Self::RouteUnavailable => "route_unavailable",
            Self::PrincipalMismatch => "principal_mismatch",
            Self::SlotUnavailable => "slot_unavailable",
            Self::ScopeMismatch => "scope_mismatch",
            Self::StaleRevision => "stale_revision",
            Self::RecipientMismatch => "recipient_mismatch",
            Self::Unavailable => "unavailable",
        }
    }
}

/// Issues leases, signed with the store's active issuer key
/// ([`crate::admin::Admin::ensure_issuer_key`] installs the first one).
pub struct LeaseService {
    store: Arc<dyn Store>,
    key: Arc<MasterKey>,
    /// The active key, opened once per key id (a rotation replaces it at the next lease).
    issuer: Mutex<Option<Arc<Issuer>>>,
    ttl: Duration,
}

impl std::fmt::Debug for LeaseService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseService")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl LeaseService {
    /// A service issuing leases valid for `ttl`, with the key the store names active at the
    /// request's projection generation.
    pub fn new(store: Arc<dyn Store>, key: Arc<MasterKey>, ttl: Duration) -> Self {
        Self {
            store,
            key,
            issuer: Mutex::new(None),
            ttl,
        }
    }

    /// The issuer for the stored active key `k` (opened and cached on first use).
    fn issuer(&self, k: &IssuerKey) -> Result<Arc<Issuer>, LeaseRefusal> {
        let mut cached = self
            .issuer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(i) = cached.as_ref().filter(|i| i.key_id() == k.id) {
            return Ok(i.clone());
        }
        let key = crate::admin::open_issuer(&self.key, k).map_err(|e| {
            tracing::warn!(target: "iop_cp", error = %e, "lease issuer key unusable");
            LeaseRefusal::Unavailable
        })?;
        let issuer =
            Arc::new(Issuer::new(key, DEFAULT_MAX_TTL).map_err(|_| LeaseRefusal::Unavailable)?);
        *cached = Some(issuer.clone());
        Ok(issuer)
    }

    /// Checks `request` against durable state and issues its lease.
    pub async fn acquire(
        &self,
        request: &AcquireLeaseRequest,
        now_unix_ms: i64,
    ) -> Result<CredentialLease, LeaseRefusal> {
        let b = &request.binding;
        let view = self
            .store
            .lease_view(&b.route_id, &b.slot_id)
            .await
            .map_err(|_| LeaseRefusal::Unavailable)?;
        if view.generation != b.projection_generation {
            return Err(LeaseRefusal::StaleGeneration);
        }
        // The key the projection of this generation named (one consistent read).
        let issuer = self.issuer(view.issuer.as_ref().ok_or(LeaseRefusal::Unavailable)?)?;
        let route = view
            .route
            .filter(|r| r.enabled)
            .ok_or(LeaseRefusal::RouteUnavailable)?;
        if route.principal_id != b.principal_id
            || !view
                .principal
                .as_ref()
                .is_some_and(|p| p.enabled && p.id == b.principal_id)
        {
            return Err(LeaseRefusal::PrincipalMismatch);
        }
        if route.slot_id != b.slot_id {
            return Err(LeaseRefusal::SlotUnavailable);
        }
        let slot = view
            .slot
            .filter(|s| s.enabled)
            .ok_or(LeaseRefusal::SlotUnavailable)?;
        if route.profile != b.profile
            || slot.profile != b.profile
            || route.upstream_target != b.upstream_target
        {
            return Err(LeaseRefusal::ScopeMismatch);
        }
        if route.revision != b.route_revision || slot.revision != b.credential_revision {
            return Err(LeaseRefusal::StaleRevision);
        }
        let recipient =
            RecipientPublicKey::from_raw(&b.recipient_key_id, &request.recipient_public_key)
                .map_err(|_| LeaseRefusal::RecipientMismatch)?;
        let plaintext = self
            .key
            .open(&slot.id, &slot.sealed)
            .map_err(|_| LeaseRefusal::Unavailable)?;
        let header = HeaderSpec::new(&slot.header_name, &slot.header_prefix)
            .map_err(|_| LeaseRefusal::Unavailable)?;
        let credential = Credential::new(header, Secret::new(plaintext.to_vec()))
            .map_err(|_| LeaseRefusal::Unavailable)?;
        drop(plaintext);
        let envelope = issuer
            .issue(b, &recipient, &credential, now_unix_ms, self.ttl)
            .map_err(|e| match e {
                // A low-order or otherwise unusable recipient key fails the HPKE seal.
                iop_lease::IssueError::Seal | iop_lease::IssueError::RecipientMismatch => {
                    LeaseRefusal::RecipientMismatch
                }
                _ => LeaseRefusal::Unavailable,
            })?;
        Ok(envelope.lease)
    }
}
