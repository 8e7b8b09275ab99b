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
//!
//! # Keys the Node holds itself (legacy mode)
//!
//! Without the credential plane, a Node may hold an upstream key per adapter instance
//! ([`LocalKey`]: from its own environment or a private file, never from the Edge). When the
//! Edge's config builds the instance, the key is paired with the header the instance's
//! protocol profile declares (or the key's own override) as an [`UpstreamCredential`], which the
//! adapter writes into each provider request and health probe through the same
//! `iop_lease::HeaderSpec::inject` an opened lease uses. The key never travels to the Edge and
//! is never logged or counted; a Node with the credential plane enabled refuses local keys
//! (one source of truth).

use std::path::Path;
use std::sync::Arc;

use std::sync::Mutex;

use iop_lease::{
    CredentialError, HeaderSpec, MemoryReplayGuard, OpenError, OpenedCredential, Recipient, Secret,
};
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

    /// The ids of the issuer keys this Node trusts (announced at registration).
    pub fn issuer_key_ids(&self) -> Vec<String> {
        self.recipient
            .trusted_issuers()
            .ids()
            .map(str::to_owned)
            .collect()
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

// === Local keys ===

/// An upstream key the Node holds itself for one adapter instance (legacy mode).
#[derive(Clone)]
pub struct LocalKey {
    secret: Arc<Secret>,
    header: Option<HeaderSpec>,
}

impl std::fmt::Debug for LocalKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalKey")
            .field("header", &self.header.as_ref().map(HeaderSpec::name))
            .finish_non_exhaustive()
    }
}

/// Why a local key could not be loaded. Names the variable or file, never the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LocalKeyError {
    /// The environment variable is not set or empty.
    #[error("environment variable {0} is not set or empty")]
    MissingEnv(String),
    /// The key file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The key file can be read by other users.
    #[error("{path} is readable by other users (mode {mode:o}); chmod 600 {path}")]
    WorldReadable {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The key or the header declaration cannot go in an HTTP header.
    #[error("{0}")]
    Invalid(#[from] CredentialError),
}

impl LocalKey {
    /// A key from its bytes (1..=16 KiB of visible ASCII).
    pub fn new(secret: Vec<u8>) -> Result<Self, LocalKeyError> {
        Ok(Self {
            secret: Arc::new(Secret::for_header(secret)?),
            header: None,
        })
    }

    /// The key in environment variable `var` (surrounding whitespace trimmed).
    pub fn from_env(var: &str) -> Result<Self, LocalKeyError> {
        let value = std::env::var(var).unwrap_or_default();
        let value = value.trim();
        if value.is_empty() {
            return Err(LocalKeyError::MissingEnv(var.to_owned()));
        }
        Self::new(value.as_bytes().to_vec())
    }

    /// The key in `path` (surrounding whitespace trimmed). A file others can read is refused.
    pub fn from_file(path: &Path) -> Result<Self, LocalKeyError> {
        let shown = path.display().to_string();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let meta = std::fs::metadata(path).map_err(|source| LocalKeyError::Read {
                path: shown.clone(),
                source,
            })?;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o004 != 0 {
                return Err(LocalKeyError::WorldReadable { path: shown, mode });
            }
        }
        let bytes =
            zeroize::Zeroizing::new(std::fs::read(path).map_err(|source| LocalKeyError::Read {
                path: shown.clone(),
                source,
            })?);
        Self::new(bytes.trim_ascii().to_vec())
    }

    /// Writes the key into `header` with `prefix` instead of the profile's declared header.
    pub fn with_header(mut self, header: &str, prefix: &str) -> Result<Self, LocalKeyError> {
        self.header = Some(HeaderSpec::new(header, prefix)?);
        Ok(self)
    }

    /// The credential for an instance whose profile declares `(header, prefix)`.
    pub(crate) fn for_profile(&self, declared: (&str, &str)) -> Result<UpstreamCredential, String> {
        let header = match &self.header {
            Some(h) => h.clone(),
            None => HeaderSpec::new(declared.0, declared.1)
                .map_err(|e| format!("the profile's auth header: {e}"))?,
        };
        Ok(UpstreamCredential {
            secret: self.secret.clone(),
            header,
        })
    }
}

/// A Node-held key paired with the header it is written as, for one adapter instance.
#[derive(Clone)]
pub struct UpstreamCredential {
    secret: Arc<Secret>,
    header: HeaderSpec,
}

impl std::fmt::Debug for UpstreamCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamCredential")
            .field("header", self.header.name())
            .finish_non_exhaustive()
    }
}

impl UpstreamCredential {
    /// Writes the key into `headers` (its declared header, replacing a caller's value).
    pub fn inject(&self, headers: &mut http::HeaderMap) {
        self.header.inject(&self.secret, headers);
    }
}
