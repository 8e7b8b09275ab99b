//! Managed credential delivery at the Node (seeds `000`/`001`, `credential_plane.enabled`).
//!
//! A managed Node announces its X25519 recipient key at registration and pins the Control
//! Plane's issuer keys. For every provider tunnel it then requires the lease + binding pair:
//! after adapter-capacity admission and immediately before the provider call it builds the
//! expected binding from the request's binding with its own identity put in (`node_id`,
//! `recipient_key_id`), the request's target (`upstream_target`) and the adapter instance's
//! protocol profile (`profile`), and opens the lease with [`iop_lease::Recipient::open`]
//! (signature, recipient, exact binding, validity, replay, decryption). The opened credential
//! goes to the adapter, which writes exactly the declared header into the upstream request;
//! the plaintext is zeroized when that header is written. A missing, invalid, expired,
//! replayed or scope-mismatched lease ends the tunnel with a stable `credential rejected: …`
//! error and no provider call. There is no fallback to another credential.

use std::sync::Mutex;

use iop_lease::{MemoryReplayGuard, OpenError, OpenedCredential, Recipient};
use iop_wire::runtime::ProviderTunnelRequest;

/// The Node's half of the credential plane: its recipient key, the pinned issuer keys and the
/// replay guard.
pub struct CredentialPlane {
    recipient: Recipient,
    replay: Mutex<MemoryReplayGuard>,
}

impl std::fmt::Debug for CredentialPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialPlane")
            .field("recipient_key_id", &self.recipient.public_key().key_id())
            .finish_non_exhaustive()
    }
}

/// Why a managed tunnel was refused before any provider call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CredentialRejected {
    /// The request carries no lease/binding pair.
    #[error("credential rejected: lease missing")]
    Missing,
    /// The lease failed to open (the step that failed).
    #[error("credential rejected: {0}")]
    Open(OpenError),
}

impl CredentialPlane {
    /// A plane opening leases with `recipient` (its issuer keys pinned inside).
    pub fn new(recipient: Recipient) -> Self {
        Self {
            recipient,
            replay: Mutex::new(MemoryReplayGuard::default()),
        }
    }

    /// The public key announced at registration.
    pub fn public_key(&self) -> iop_lease::RecipientPublicKey {
        self.recipient.public_key()
    }

    /// Opens the lease of `request` for this Node (`node_id`) and the adapter instance's
    /// protocol `profile`.
    pub(crate) fn open(
        &self,
        node_id: &str,
        profile: &str,
        request: &ProviderTunnelRequest,
        now_unix_ms: i64,
    ) -> Result<OpenedCredential, CredentialRejected> {
        let envelope = request
            .credential
            .as_ref()
            .ok_or(CredentialRejected::Missing)?;
        let mut expected = envelope.binding.clone();
        node_id.clone_into(&mut expected.node_id);
        self.recipient
            .public_key()
            .key_id()
            .clone_into(&mut expected.recipient_key_id);
        request.target.clone_into(&mut expected.upstream_target);
        profile.clone_into(&mut expected.profile);
        let mut replay = self
            .replay
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.recipient
            .open(envelope, &expected, now_unix_ms, &mut *replay)
            .map_err(CredentialRejected::Open)
    }
}
