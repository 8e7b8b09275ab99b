//! Admin operations: what the control-plane CLI and the loopback HTTP admin API call.
//!
//! Every operation is one durable [`Mutation`] (one generation bump), after which subscribers
//! ([`Admin::subscribe`]) see the new generation and the Edge wire pushes the new projection.
//! Tokens are generated here, returned once in [`NewToken`] and stored only as SHA-256
//! digests; slot credentials are sealed with the master key before they reach the store.

use std::sync::Arc;

use iop_wire::control::PrincipalProjection;
use iop_wire::control_session::SharedProjection;
use ring::digest::{SHA256, digest};
use ring::rand::{SecureRandom as _, SystemRandom};
use tokio::sync::watch;
use zeroize::Zeroizing;

use crate::seal::{MasterKey, SealError};
use crate::store::{IssuerKey, Mutation, Store, StoreError};

/// Prefix of every IOP API token (`iop_` + 64 hex digits of 256 random bits).
pub const TOKEN_PREFIX: &str = "iop_";

/// Admin failures.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// The store refused or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Sealing the credential failed.
    #[error(transparent)]
    Seal(#[from] SealError),
    /// The credential is empty or longer than `iop_lease::MAX_SECRET_LEN`.
    #[error("credential must be 1..={} bytes", iop_lease::MAX_SECRET_LEN)]
    CredentialLength,
    /// The header name or prefix cannot carry a credential.
    #[error("header cannot carry a credential: {0}")]
    Header(iop_lease::CredentialError),
    /// A stored issuer key does not open with this master key or does not parse (a replica
    /// started with another replica's store but not its `master.key`).
    #[error("issuer key {0} cannot be opened with this master key")]
    IssuerKey(String),
    /// Generating an issuer key failed.
    #[error("issuer key generation failed")]
    KeyGeneration,
}

/// A token just created: the raw value is shown once and never stored.
pub struct NewToken {
    /// Token id (not secret).
    pub token_id: String,
    /// The raw token. Give it to the client; it cannot be recovered later.
    pub token: Zeroizing<String>,
    /// Generation after the mutation.
    pub generation: u64,
}

impl std::fmt::Debug for NewToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewToken")
            .field("token_id", &self.token_id)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// SHA-256 verifier digest of a raw token (what the store and the projection hold).
pub fn token_digest(token: &str) -> [u8; 32] {
    let d = digest(&SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn random<const N: usize>() -> Result<Zeroizing<[u8; N]>, SealError> {
    let mut b = Zeroizing::new([0u8; N]);
    SystemRandom::new()
        .fill(b.as_mut())
        .map_err(|_| SealError::Rng)?;
    Ok(b)
}

/// The admin surface over a store and the master key.
#[derive(Clone)]
pub struct Admin {
    store: Arc<dyn Store>,
    key: Arc<MasterKey>,
    generation: Arc<watch::Sender<u64>>,
    /// The newest projection built, shared by every caller of [`Admin::projection`].
    projection: Arc<tokio::sync::Mutex<Option<CachedProjection>>>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("generation", &*self.generation.borrow())
            .finish_non_exhaustive()
    }
}

/// The latest projection built, and its encodings once a session pushed it.
#[derive(Debug)]
struct CachedProjection {
    projection: Arc<PrincipalProjection>,
    shared: Option<Arc<SharedProjection>>,
}

impl Admin {
    /// An admin surface; `initial_generation` is the store's generation now.
    pub fn new(store: Arc<dyn Store>, key: Arc<MasterKey>, initial_generation: u64) -> Self {
        Self {
            store,
            key,
            generation: Arc::new(watch::channel(initial_generation).0),
            projection: Arc::default(),
        }
    }

    /// The projection of the store at generation `at_least` or newer: one store read and one
    /// build per generation, shared by every caller. After a mutation every connected Edge's
    /// session asks for the same projection at once; each reading the whole store for itself
    /// cost the Control Plane one snapshot per Edge (`cp_load` in `benches/README.md`: 11 ms
    /// of CPU per Edge per mutation with 1000 principals). Callers wait for a read under way
    /// rather than start their own. A generation names one state of the store (every mutation
    /// adds exactly one), so a projection cached at a generation is that state's.
    pub async fn projection(&self, at_least: u64) -> Result<Arc<PrincipalProjection>, StoreError> {
        let mut cached = self.projection.lock().await;
        if let Some(c) = cached
            .as_ref()
            .filter(|c| c.projection.generation >= at_least)
        {
            return Ok(c.projection.clone());
        }
        let built = Arc::new(crate::projection::build(&self.store.snapshot().await?));
        if cached
            .as_ref()
            .is_none_or(|c| c.projection.generation < built.generation)
        {
            *cached = Some(CachedProjection {
                projection: built.clone(),
                shared: None,
            });
        }
        Ok(built)
    }

    /// [`Admin::projection`] as the Edge sessions push it: also encoded once (per way Edges
    /// read it) for all the sessions pushing it at the time
    /// ([`iop_wire::control_session::SharedProjection`]). The encodings stay cached with the
    /// projection until the next generation replaces both: about the projection's encoded
    /// size again (145 KiB for 1000 principals), once per way Edges read it (in practice
    /// one). Keeping them only while sessions push them was tried: the sessions that asked
    /// after the first ones had finished encoded it again, and a change cost twice the CPU
    /// (`cp_load`, `benches/README.md`).
    pub async fn shared_projection(
        &self,
        at_least: u64,
    ) -> Result<Arc<SharedProjection>, StoreError> {
        let projection = self.projection(at_least).await?;
        let mut cached = self.projection.lock().await;
        let Some(c) = cached
            .as_mut()
            .filter(|c| Arc::ptr_eq(&c.projection, &projection))
        else {
            // Not the cached one (a newer one was cached meanwhile): shared by no one else.
            return Ok(Arc::new(SharedProjection::new(projection)));
        };
        Ok(c.shared
            .get_or_insert_with(|| Arc::new(SharedProjection::new(projection)))
            .clone())
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The master key.
    pub fn master_key(&self) -> &Arc<MasterKey> {
        &self.key
    }

    /// Generation changes made through this surface (or reported by [`Admin::observe`]).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Records a generation seen in the store (e.g. another replica's mutation, found by
    /// polling); wakes subscribers when it is higher than the last one.
    pub fn observe(&self, generation: u64) {
        self.generation.send_if_modified(|g| {
            if generation > *g {
                *g = generation;
                true
            } else {
                false
            }
        });
    }

    /// Applies one mutation and wakes subscribers.
    pub async fn apply(&self, mutation: Mutation) -> Result<u64, AdminError> {
        let (kind, id) = mutation.describe();
        let (kind, id) = (kind, id.to_owned());
        let generation = self.store.apply(mutation).await?;
        tracing::info!(target: "iop_cp", event = "cp_mutation", kind, object_id = %id, generation, "durable mutation");
        self.observe(generation);
        Ok(generation)
    }

    /// Creates an enabled principal.
    pub async fn create_principal(&self, id: &str, display_name: &str) -> Result<u64, AdminError> {
        self.apply(Mutation::CreatePrincipal {
            id: id.to_owned(),
            display_name: display_name.to_owned(),
        })
        .await
    }

    /// Sets the rate limits and spend budgets of principal `id` (a document with nothing set
    /// clears them); every Edge enforces them from the next projection.
    pub async fn set_principal_limits(
        &self,
        id: &str,
        limits: &crate::store::LimitsDoc,
    ) -> Result<u64, AdminError> {
        let limits = limits.to_limits()?;
        self.apply(Mutation::SetPrincipalLimits {
            id: id.to_owned(),
            limits: (limits != crate::store::PrincipalLimits::default()).then_some(limits),
        })
        .await
    }

    /// Creates a token for `principal_id`; the raw token is in the answer only.
    pub async fn create_token(&self, principal_id: &str) -> Result<NewToken, AdminError> {
        let id_bytes = random::<8>()?;
        let token_id = format!("tok_{}", hex(id_bytes.as_ref()));
        let raw = random::<32>()?;
        let token = Zeroizing::new(format!("{TOKEN_PREFIX}{}", hex(raw.as_ref())));
        let generation = self
            .apply(Mutation::CreateToken {
                id: token_id.clone(),
                principal_id: principal_id.to_owned(),
                digest: token_digest(&token),
            })
            .await?;
        Ok(NewToken {
            token_id,
            token,
            generation,
        })
    }

    /// Revokes a token.
    pub async fn revoke_token(&self, token_id: &str) -> Result<u64, AdminError> {
        self.apply(Mutation::RevokeToken {
            id: token_id.to_owned(),
        })
        .await
    }

    /// Creates or rotates a credential slot: `credential` is sealed before it is stored. The
    /// Node writes `header_prefix + credential` into `header_name`.
    pub async fn put_slot(
        &self,
        id: &str,
        profile: &str,
        header_name: &str,
        header_prefix: &str,
        credential: &[u8],
    ) -> Result<u64, AdminError> {
        if credential.is_empty() || credential.len() > iop_lease::MAX_SECRET_LEN {
            return Err(AdminError::CredentialLength);
        }
        // The same check the lease service makes before issuing: refuse now what could never
        // be delivered.
        iop_lease::HeaderSpec::new(header_name, header_prefix).map_err(AdminError::Header)?;
        let sealed = self.key.seal(id, credential)?;
        self.apply(Mutation::PutSlot {
            id: id.to_owned(),
            profile: profile.to_owned(),
            header_name: header_name.to_owned(),
            header_prefix: header_prefix.to_owned(),
            sealed,
        })
        .await
    }

    /// Creates or updates a route.
    pub async fn put_route(
        &self,
        id: &str,
        principal_id: &str,
        model: &str,
        slot_id: &str,
        upstream_target: &str,
        selector: &str,
    ) -> Result<u64, AdminError> {
        self.apply(Mutation::PutRoute {
            id: id.to_owned(),
            principal_id: principal_id.to_owned(),
            model: model.to_owned(),
            slot_id: slot_id.to_owned(),
            upstream_target: upstream_target.to_owned(),
            selector: selector.to_owned(),
        })
        .await
    }

    // === lease issuer keys ===

    /// The stored issuer keys (active first, then the staged one) with their public halves.
    pub async fn issuer_keys(
        &self,
    ) -> Result<Vec<(IssuerKey, iop_lease::IssuerPublicKey)>, AdminError> {
        self.store
            .issuer_keys()
            .await?
            .into_iter()
            .map(|k| {
                let key = self.open_issuer(&k)?;
                let mut meta = k;
                meta.sealed.clear();
                Ok((meta, key.public_key()))
            })
            .collect()
    }

    /// The active issuer key; when the store has none yet, `candidate` is installed (a key
    /// from an older data directory's `issuer.pem`, or a new one). With replicas racing, the
    /// first install wins and every replica returns that key.
    pub async fn ensure_issuer_key(
        &self,
        candidate: impl FnOnce() -> Result<iop_lease::IssuerSigningKey, AdminError>,
    ) -> Result<iop_lease::IssuerSigningKey, AdminError> {
        if let Some(active) = self.active_issuer().await? {
            return Ok(active);
        }
        // Re-derived: the stored id is always the key's digest, whatever `candidate` was named.
        let key = iop_lease::IssuerSigningKey::from_pem_derived(&candidate()?.to_pem())
            .map_err(|_| AdminError::KeyGeneration)?;
        let sealed = self
            .key
            .seal_issuer(key.key_id(), key.to_pem().as_bytes())?;
        match self
            .apply(Mutation::InstallIssuerKey {
                id: key.key_id().to_owned(),
                sealed,
            })
            .await
        {
            Ok(_) => Ok(key),
            Err(AdminError::Store(StoreError::Conflict(_))) => self
                .active_issuer()
                .await?
                .ok_or(AdminError::Store(StoreError::Unavailable)),
            Err(e) => Err(e),
        }
    }

    /// Stages a new issuer key (id derived from the key), to be activated at
    /// `activates_at_unix_ms` by a running `iop-cp serve` (any replica). Until then leases
    /// are signed with the active key and the projection names the staged one, so Edges can
    /// report the Nodes that do not trust it yet. Returns the key's public half and the
    /// generation.
    pub async fn stage_issuer_key(
        &self,
        activates_at_unix_ms: i64,
    ) -> Result<(iop_lease::IssuerPublicKey, u64), AdminError> {
        let key = iop_lease::IssuerSigningKey::generate_derived()
            .map_err(|_| AdminError::KeyGeneration)?;
        let sealed = self
            .key
            .seal_issuer(key.key_id(), key.to_pem().as_bytes())?;
        let generation = self
            .apply(Mutation::StageIssuerKey {
                id: key.key_id().to_owned(),
                sealed,
                activates_at_unix_ms,
            })
            .await?;
        Ok((key.public_key(), generation))
    }

    /// Activates the staged key `id` now (the old key is deleted: leases it signed stay valid
    /// at the Nodes that pin it until they expire).
    pub async fn activate_issuer_key(&self, id: &str) -> Result<u64, AdminError> {
        self.apply(Mutation::ActivateIssuerKey { id: id.to_owned() })
            .await
    }

    async fn active_issuer(&self) -> Result<Option<iop_lease::IssuerSigningKey>, AdminError> {
        let keys = self.store.issuer_keys().await?;
        keys.iter()
            .find(|k| k.active)
            .map(|k| self.open_issuer(k))
            .transpose()
    }

    fn open_issuer(&self, k: &IssuerKey) -> Result<iop_lease::IssuerSigningKey, AdminError> {
        open_issuer(&self.key, k)
    }
}

/// Opens a stored issuer key and checks that its id is the one derived from it.
pub(crate) fn open_issuer(
    master: &MasterKey,
    k: &IssuerKey,
) -> Result<iop_lease::IssuerSigningKey, AdminError> {
    let bad = || AdminError::IssuerKey(k.id.clone());
    let pem = master.open_issuer(&k.id, &k.sealed).map_err(|_| bad())?;
    let pem = std::str::from_utf8(&pem).map_err(|_| bad())?;
    let key = iop_lease::IssuerSigningKey::from_pem_derived(pem).map_err(|_| bad())?;
    if key.key_id() != k.id {
        return Err(bad());
    }
    Ok(key)
}
