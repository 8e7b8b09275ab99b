//! Admin operations: what the control-plane CLI and the loopback HTTP admin API call.
//!
//! Every operation is one durable [`Mutation`] (one generation bump), after which subscribers
//! ([`Admin::subscribe`]) see the new generation and the Edge wire pushes the new projection.
//! Tokens are generated here, returned once in [`NewToken`] and stored only as SHA-256
//! digests; slot credentials are sealed with the master key before they reach the store.

use std::sync::Arc;

use ring::digest::{SHA256, digest};
use ring::rand::{SecureRandom as _, SystemRandom};
use tokio::sync::watch;
use zeroize::Zeroizing;

use crate::seal::{MasterKey, SealError};
use crate::store::{Mutation, Store, StoreError};

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
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("generation", &*self.generation.borrow())
            .finish_non_exhaustive()
    }
}

impl Admin {
    /// An admin surface; `initial_generation` is the store's generation now.
    pub fn new(store: Arc<dyn Store>, key: Arc<MasterKey>, initial_generation: u64) -> Self {
        Self {
            store,
            key,
            generation: Arc::new(watch::channel(initial_generation).0),
        }
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
}
