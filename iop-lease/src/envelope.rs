//! Issuing (sign + seal) and opening (verify + decrypt) leases.

use std::time::Duration;

use hpke::{Deserializable as _, OpModeR, OpModeS, Serializable as _};
use iop_wire::runtime::{CredentialLease, CredentialLeaseBinding, ManagedCredential};
use ring::rand::{SecureRandom as _, SystemRandom};

use crate::binding;
use crate::keys::{
    IssuerSigningKey, Kem, KeyError, RecipientPublicKey, RecipientSecretKey, TrustedIssuers,
};
use crate::replay::{ReplayError, ReplayGuard};
use crate::secret::{Credential, CredentialError, OpenedCredential};

type Kdf = hpke::kdf::HkdfSha256;
type Aead = hpke::aead::AesGcm128;

/// The envelope format this crate writes and accepts.
pub const LEASE_VERSION: u32 = 1;
/// Default longest lease lifetime.
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(60);
/// No configuration may allow leases longer than this (seconds, not hours).
pub const HARD_MAX_TTL: Duration = Duration::from_secs(300);
/// Default clock-skew allowance on each side of the validity window.
pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_secs(5);
/// No configuration may allow more skew than this.
pub const HARD_MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);

const SIG_TAG: &[u8] = b"iop-lease/signature/v1\0";
const INFO_TAG: &[u8] = b"iop-lease/hpke-info/v1\0";
const AAD_TAG: &[u8] = b"iop-lease/hpke-aad/v1\0";
/// HPKE `enc` for DHKEM(X25519): one public key.
const ENC_LEN: usize = 32;
/// AES-128-GCM tag.
const TAG_LEN: usize = 16;

/// Why a lease could not be issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IssueError {
    /// The requested TTL is zero or above the issuer's maximum.
    #[error("lease ttl outside the issuer's bounds")]
    TtlOutOfBounds,
    /// The configured maximum TTL is zero or above [`HARD_MAX_TTL`].
    #[error("issuer max ttl outside 1 ms..=300 s")]
    InvalidMaxTtl,
    /// The binding's recipient key id is not the recipient key's id.
    #[error("binding names another recipient key")]
    RecipientMismatch,
    /// The recipient public key or the signing key failed.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// HPKE sealing failed (e.g. a low-order recipient key).
    #[error("sealing failed")]
    Seal,
    /// Timestamp arithmetic overflowed.
    #[error("timestamp out of range")]
    Time,
}

/// Why a lease could not be opened. Checked in this order; each variant is one step.
/// None carries key, ciphertext or plaintext material.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// 1. The envelope version is not [`LEASE_VERSION`].
    #[error("unsupported lease version")]
    UnsupportedVersion,
    /// 1. A field has the wrong length for this version.
    #[error("malformed lease field `{0}`")]
    Malformed(&'static str),
    /// 2. The issuer key id is not trusted.
    #[error("unknown issuer key")]
    UnknownIssuer,
    /// 2. The signature does not verify (or is not low-S).
    #[error("bad lease signature")]
    BadSignature,
    /// 3. The lease is sealed to another recipient key.
    #[error("lease is sealed to another recipient")]
    WrongRecipient,
    /// 4. The lease's binding differs from the expected one in this field.
    #[error("lease binding mismatch on `{0}`")]
    BindingMismatch(&'static str),
    /// 5. `not_after - issued_at` exceeds the recipient's maximum TTL (or is negative).
    #[error("lease ttl too long")]
    TtlTooLong,
    /// 5. `now < issued_at - skew`.
    #[error("lease not yet valid")]
    NotYetValid,
    /// 5. `now >= not_after + skew`.
    #[error("lease expired")]
    Expired,
    /// 6. The lease id was already used.
    #[error("lease replayed")]
    Replayed,
    /// 6. The replay guard cannot record more leases (fail closed).
    #[error("replay guard full")]
    ReplayGuardFull,
    /// 6. The replay guard's store failed (fail closed).
    #[error("replay guard unavailable")]
    ReplayGuardUnavailable,
    /// 7. HPKE decapsulation or decryption failed.
    #[error("lease decryption failed")]
    DecryptFailed,
    /// 7. The decrypted plaintext is not a valid credential.
    #[error("lease plaintext invalid: {0}")]
    BadPlaintext(CredentialError),
}

impl From<ReplayError> for OpenError {
    fn from(e: ReplayError) -> Self {
        match e {
            ReplayError::Replayed => Self::Replayed,
            ReplayError::Full => Self::ReplayGuardFull,
            ReplayError::Unavailable => Self::ReplayGuardUnavailable,
        }
    }
}

fn put_len_prefixed(out: &mut Vec<u8>, field: &[u8]) {
    // Every field is bounded by iop-wire's validation (≤ 64 KiB).
    out.extend_from_slice(&u32::try_from(field.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(field);
}

/// The bytes the issuer signs.
fn signed_bytes(lease: &CredentialLease, binding_bytes: &[u8]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(SIG_TAG.len() + 200 + binding_bytes.len() + lease.ciphertext.len());
    out.extend_from_slice(SIG_TAG);
    out.extend_from_slice(&lease.version.to_be_bytes());
    out.extend_from_slice(&lease.lease_id);
    put_len_prefixed(&mut out, lease.issuer_key_id.as_bytes());
    put_len_prefixed(&mut out, binding_bytes);
    out.extend_from_slice(&lease.issued_at_unix_ms.to_be_bytes());
    out.extend_from_slice(&lease.not_after_unix_ms.to_be_bytes());
    put_len_prefixed(&mut out, &lease.enc);
    put_len_prefixed(&mut out, &lease.recipient_public_key);
    put_len_prefixed(&mut out, &lease.ciphertext);
    out
}

fn hpke_info(binding_bytes: &[u8]) -> Vec<u8> {
    [INFO_TAG, binding_bytes].concat()
}

fn hpke_aad(
    version: u32,
    lease_id: &[u8; 16],
    issuer_key_id: &str,
    issued_at: i64,
    not_after: i64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(AAD_TAG.len() + 48 + issuer_key_id.len());
    out.extend_from_slice(AAD_TAG);
    out.extend_from_slice(&version.to_be_bytes());
    out.extend_from_slice(lease_id);
    put_len_prefixed(&mut out, issuer_key_id.as_bytes());
    out.extend_from_slice(&issued_at.to_be_bytes());
    out.extend_from_slice(&not_after.to_be_bytes());
    out
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

// === impl Issuer ===

/// Issues leases: the Control Plane side.
#[derive(Debug)]
pub struct Issuer {
    key: IssuerSigningKey,
    max_ttl: Duration,
}

impl Issuer {
    /// An issuer signing with `key`, allowing TTLs up to `max_ttl` (≤ [`HARD_MAX_TTL`]).
    pub fn new(key: IssuerSigningKey, max_ttl: Duration) -> Result<Self, IssueError> {
        if max_ttl.is_zero() || max_ttl > HARD_MAX_TTL {
            return Err(IssueError::InvalidMaxTtl);
        }
        Ok(Self { key, max_ttl })
    }

    /// The signing key's id.
    pub fn key_id(&self) -> &str {
        self.key.key_id()
    }

    /// The public key Nodes pin to verify this issuer's leases.
    pub fn public_key(&self) -> crate::keys::IssuerPublicKey {
        self.key.public_key()
    }

    /// Seals `credential` to `recipient` for exactly `binding`, valid from `now_unix_ms` for
    /// `ttl`, and signs the result.
    pub fn issue(
        &self,
        binding: &CredentialLeaseBinding,
        recipient: &RecipientPublicKey,
        credential: &Credential,
        now_unix_ms: i64,
        ttl: Duration,
    ) -> Result<ManagedCredential, IssueError> {
        if ttl.is_zero() || ttl > self.max_ttl {
            return Err(IssueError::TtlOutOfBounds);
        }
        if binding.recipient_key_id != recipient.key_id() {
            return Err(IssueError::RecipientMismatch);
        }
        let not_after = now_unix_ms
            .checked_add(millis(ttl))
            .ok_or(IssueError::Time)?;
        let mut lease_id = [0u8; 16];
        SystemRandom::new()
            .fill(&mut lease_id)
            .map_err(|_| KeyError::Rng)?;

        let binding_bytes = binding::encode(binding);
        let aad = hpke_aad(
            LEASE_VERSION,
            &lease_id,
            self.key.key_id(),
            now_unix_ms,
            not_after,
        );
        let plaintext = credential.encode();
        let (enc, ciphertext) = hpke::single_shot_seal::<Aead, Kdf, Kem>(
            &OpModeS::Base,
            &recipient.hpke_public()?,
            &hpke_info(&binding_bytes),
            &plaintext,
            &aad,
        )
        .map_err(|_| IssueError::Seal)?;

        let mut lease = CredentialLease {
            version: LEASE_VERSION,
            lease_id,
            issuer_key_id: self.key.key_id().to_owned(),
            issued_at_unix_ms: now_unix_ms,
            not_after_unix_ms: not_after,
            enc: bytes::Bytes::copy_from_slice(&enc.to_bytes()),
            recipient_public_key: bytes::Bytes::copy_from_slice(recipient.as_bytes()),
            ciphertext: bytes::Bytes::from(ciphertext),
            signature: bytes::Bytes::new(),
        };
        self.sign(&mut lease, &binding_bytes)?;
        Ok(ManagedCredential {
            lease,
            binding: binding.clone(),
        })
    }

    /// Test support: re-signs an envelope after a test mutated it, so that the checks after
    /// the signature can be reached. An issuer can sign anything it likes anyway; this adds no
    /// capability.
    #[doc(hidden)]
    pub fn resign(&self, envelope: &mut ManagedCredential) -> Result<(), IssueError> {
        let binding_bytes = binding::encode(&envelope.binding);
        self.sign(&mut envelope.lease, &binding_bytes)
    }

    /// (Re)computes `lease.signature` over its fields and `binding_bytes`.
    fn sign(&self, lease: &mut CredentialLease, binding_bytes: &[u8]) -> Result<(), IssueError> {
        let sig = self.key.sign(&signed_bytes(lease, binding_bytes))?;
        lease.signature = bytes::Bytes::copy_from_slice(&sig);
        Ok(())
    }
}

// === impl Recipient ===

/// What a recipient accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenPolicy {
    /// Longest `not_after - issued_at` accepted (≤ [`HARD_MAX_TTL`]).
    pub max_ttl: Duration,
    /// Allowance on each side of the validity window (≤ [`HARD_MAX_CLOCK_SKEW`]).
    pub clock_skew: Duration,
}

impl Default for OpenPolicy {
    fn default() -> Self {
        Self {
            max_ttl: DEFAULT_MAX_TTL,
            clock_skew: DEFAULT_CLOCK_SKEW,
        }
    }
}

/// Opens leases: the Node side.
#[derive(Debug)]
pub struct Recipient {
    key: RecipientSecretKey,
    issuers: TrustedIssuers,
    max_ttl_ms: i64,
    skew_ms: i64,
}

impl Recipient {
    /// A recipient with its secret key, the issuer keys it trusts and its policy. The policy's
    /// bounds are clamped to [`HARD_MAX_TTL`] and [`HARD_MAX_CLOCK_SKEW`].
    pub fn new(key: RecipientSecretKey, issuers: TrustedIssuers, policy: OpenPolicy) -> Self {
        Self {
            key,
            issuers,
            max_ttl_ms: millis(policy.max_ttl.min(HARD_MAX_TTL)),
            skew_ms: millis(policy.clock_skew.min(HARD_MAX_CLOCK_SKEW)),
        }
    }

    /// The public key to register with the Edge.
    pub fn public_key(&self) -> RecipientPublicKey {
        self.key.public_key()
    }

    /// The issuer keys this recipient trusts.
    pub fn trusted_issuers(&self) -> &TrustedIssuers {
        &self.issuers
    }

    /// Replaces the trusted issuer keys (rotation).
    pub fn set_trusted_issuers(&mut self, issuers: TrustedIssuers) {
        self.issuers = issuers;
    }

    /// Verifies and opens `envelope` for the dispatch described by `expected`.
    ///
    /// Call it after adapter-capacity admission, immediately before the provider call. Build
    /// `expected` from the request's binding with this Node's own identity (`node_id`,
    /// `recipient_key_id`) and the request's target (`upstream_target`) put in, so that a lease
    /// for another Node, key or target is refused.
    ///
    /// Checks, failing closed at the first that fails: format/version → issuer signature →
    /// recipient key → exact binding → validity window (TTL bound, then `issued_at - skew <=
    /// now < not_after + skew`) → replay → decryption.
    pub fn open(
        &self,
        envelope: &ManagedCredential,
        expected: &CredentialLeaseBinding,
        now_unix_ms: i64,
        replay: &mut dyn ReplayGuard,
    ) -> Result<OpenedCredential, OpenError> {
        let lease = &envelope.lease;
        // 1. Format.
        if lease.version != LEASE_VERSION {
            return Err(OpenError::UnsupportedVersion);
        }
        let signature: &[u8; 64] = lease
            .signature
            .as_ref()
            .try_into()
            .map_err(|_| OpenError::Malformed("signature"))?;
        if lease.enc.len() != ENC_LEN {
            return Err(OpenError::Malformed("enc"));
        }
        if lease.recipient_public_key.len() != 32 {
            return Err(OpenError::Malformed("recipient_public_key"));
        }
        if lease.ciphertext.len() < TAG_LEN {
            return Err(OpenError::Malformed("ciphertext"));
        }
        // 2. Signature, over the envelope's own binding.
        let issuer = self
            .issuers
            .get(&lease.issuer_key_id)
            .ok_or(OpenError::UnknownIssuer)?;
        let binding_bytes = binding::encode(&envelope.binding);
        if !issuer.verify(&signed_bytes(lease, &binding_bytes), signature) {
            return Err(OpenError::BadSignature);
        }
        // 3. Recipient.
        if lease.recipient_public_key[..] != self.key.public_key().as_bytes()[..] {
            return Err(OpenError::WrongRecipient);
        }
        // 4. Scope.
        if let Some(field) = binding::first_difference(&envelope.binding, expected) {
            return Err(OpenError::BindingMismatch(field));
        }
        // 5. Validity window.
        let (issued_at, not_after) = (lease.issued_at_unix_ms, lease.not_after_unix_ms);
        let ttl = not_after
            .checked_sub(issued_at)
            .ok_or(OpenError::TtlTooLong)?;
        if !(0..=self.max_ttl_ms).contains(&ttl) {
            return Err(OpenError::TtlTooLong);
        }
        if now_unix_ms < issued_at.saturating_sub(self.skew_ms) {
            return Err(OpenError::NotYetValid);
        }
        let expires_at = not_after.saturating_add(self.skew_ms);
        if now_unix_ms >= expires_at {
            return Err(OpenError::Expired);
        }
        // 6. Replay: the entry lives exactly as long as the lease could pass step 5.
        replay.check_and_record(lease.lease_id, expires_at, now_unix_ms)?;
        // 7. Decrypt.
        let enc = <Kem as hpke::Kem>::EncappedKey::from_bytes(&lease.enc)
            .map_err(|_| OpenError::DecryptFailed)?;
        let aad = hpke_aad(
            lease.version,
            &lease.lease_id,
            &lease.issuer_key_id,
            issued_at,
            not_after,
        );
        let plaintext = zeroize::Zeroizing::new(
            hpke::single_shot_open::<Aead, Kdf, Kem>(
                &OpModeR::Base,
                self.key.hpke_secret(),
                &enc,
                &hpke_info(&binding_bytes),
                &lease.ciphertext,
                &aad,
            )
            .map_err(|_| OpenError::DecryptFailed)?,
        );
        let credential = Credential::decode(&plaintext).map_err(OpenError::BadPlaintext)?;
        Ok(OpenedCredential {
            credential,
            lease_id: lease.lease_id,
        })
    }
}

/// HPKE base-mode open with this crate's suite, for the RFC 9180 known-answer test.
#[doc(hidden)]
pub fn hpke_open_for_test_vectors(
    secret: &RecipientSecretKey,
    enc: &[u8],
    info: &[u8],
    aad: &[u8],
    ciphertext: &[u8],
) -> Option<Vec<u8>> {
    let enc = <Kem as hpke::Kem>::EncappedKey::from_bytes(enc).ok()?;
    hpke::single_shot_open::<Aead, Kdf, Kem>(
        &OpModeR::Base,
        secret.hpke_secret(),
        &enc,
        info,
        ciphertext,
        aad,
    )
    .ok()
}
