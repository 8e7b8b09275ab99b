//! Signed, recipient-sealed credential leases for the IOP mesh.
//!
//! The Control Plane holds provider credentials. When the Edge has selected a provider for a
//! request, the Control Plane issues a short-lived **lease** that only the selected Node can
//! open, for exactly that dispatch. The Node opens it after adapter-capacity admission,
//! immediately before the provider call, injects the declared auth header in memory, and the
//! plaintext is zeroized (seeds `000` "managed credential delivery" and `001` "Managed principal
//! projection and credential lease").
//!
//! This crate is pure: no tokio, no I/O, no clock reads (time is an argument, Unix
//! milliseconds). It reads the OS random generator for lease ids, signature nonces and HPKE
//! ephemeral keys.
//!
//! # Design
//!
//! - **Binding** ([`binding`]): the exact dispatch scope (principal, slot, route, profile,
//!   upstream target, Node, recipient key, credential/route revisions, projection generation)
//!   has a canonical, injective byte encoding.
//! - **Sealing**: HPKE base mode, DHKEM(X25519, HKDF-SHA256) + HKDF-SHA256 + AES-128-GCM
//!   (RFC 9180). `info` = domain tag ‖ canonical binding, so a ciphertext cannot be moved to
//!   another binding; `aad` = domain tag ‖ version ‖ lease id ‖ issuer key id ‖ issued-at ‖
//!   not-after.
//! - **Signing**: ECDSA P-256 / SHA-256 (via *ring*, chosen by measurement: see
//!   `benches/README.md`) over a domain-separated encoding of version, lease id (128-bit
//!   random), issuer key id, binding, issued-at, not-after, `enc`, recipient public key and
//!   ciphertext. Signatures are fixed-size and low-S, so they have exactly one valid encoding.
//! - **Opening** ([`Recipient::open`]) checks, failing closed at the first failure, each with
//!   its own [`OpenError`]: format/version → signature against pinned issuer keys (several ids
//!   for rotation) → recipient key → exact binding → validity window (bounded TTL and clock
//!   skew) → replay ([`ReplayGuard`]) → decryption.
//! - **Plaintext** ([`Secret`]) is zeroized on drop and has no `Debug`/`Display`;
//!   [`OpenedCredential::inject`] consumes it and writes exactly the declared header.
//!
//! The envelope is [`iop_wire::runtime::ManagedCredential`] (lease + binding), which travels
//! in `RunRequest`/`ProviderTunnelRequest` and has a standalone byte form
//! ([`ManagedCredential::to_bytes`](iop_wire::runtime::ManagedCredential::to_bytes)).
//!
//! # Choices where the seeds are silent
//!
//! - Maximum TTL 60 s by default, never above 300 s ([`HARD_MAX_TTL`]); clock skew 5 s by
//!   default, never above 60 s. Valid iff `issued_at − skew ≤ now < not_after + skew`.
//! - AES-128-GCM rather than ChaCha20-Poly1305: both are in the `hpke` crate; AES-GCM is the
//!   suite of RFC 9180's first test vector and uses AES-NI here.
//! - Replay entries live until `not_after + skew`; a full guard refuses new leases.
//! - A lease may not write framing or hop-by-hop headers (`host`, `content-length`, …).
//!
//! # Example: issue → open → inject
//!
//! ```
//! use std::time::Duration;
//! use iop_lease::*;
//! use iop_wire::runtime::CredentialLeaseBinding;
//!
//! // Control Plane: its signing key. Node: its recipient key and the issuer keys it pins.
//! let issuer = Issuer::new(IssuerSigningKey::generate("issuer-2026-11")?, DEFAULT_MAX_TTL)?;
//! let node_key = RecipientSecretKey::generate("node-1-key-1")?;
//! let node_public = node_key.public_key(); // sent in RegisterRequest
//! let trusted: TrustedIssuers = [issuer.public_key()].into_iter().collect();
//! let recipient = Recipient::new(node_key, trusted, OpenPolicy::default());
//!
//! let binding = CredentialLeaseBinding {
//!     principal_id: "team-a".into(),
//!     slot_id: "openai-prod".into(),
//!     route_id: "route-7".into(),
//!     profile: "openai".into(),
//!     upstream_target: "gpt-4o-mini".into(),
//!     node_id: "node-1".into(),
//!     recipient_key_id: node_public.key_id().into(),
//!     credential_revision: 3,
//!     route_revision: 9,
//!     projection_generation: 42,
//! };
//! let now = 1_764_460_800_000; // Unix ms, from the caller's clock
//! let credential = Credential::new(HeaderSpec::bearer(), Secret::new(b"sk-live-example".to_vec()))?;
//! let envelope = issuer.issue(&binding, &node_public, &credential, now, Duration::from_secs(30))?;
//!
//! // Node, after admission, right before the provider call:
//! let mut replay = MemoryReplayGuard::default();
//! let opened = recipient.open(&envelope, &binding, now + 120, &mut replay)?;
//! let mut headers = http::HeaderMap::new();
//! opened.inject(&mut headers); // plaintext zeroized here
//! assert_eq!(headers["authorization"], "Bearer sk-live-example");
//!
//! // The same envelope never opens twice.
//! assert_eq!(recipient.open(&envelope, &binding, now + 130, &mut replay).unwrap_err(), OpenError::Replayed);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod binding;
mod envelope;
mod keys;
mod replay;
mod secret;

pub use envelope::{
    DEFAULT_CLOCK_SKEW, DEFAULT_MAX_TTL, HARD_MAX_CLOCK_SKEW, HARD_MAX_TTL, IssueError, Issuer,
    LEASE_VERSION, OpenError, OpenPolicy, Recipient, hpke_open_for_test_vectors,
};
pub use keys::{
    IssuerPublicKey, IssuerSigningKey, KeyError, RecipientPublicKey, RecipientSecretKey,
    TrustedIssuers, issuer_key_id,
};
pub use replay::{DEFAULT_REPLAY_CAPACITY, MemoryReplayGuard, ReplayError, ReplayGuard};
pub use secret::{
    Credential, CredentialError, HeaderSpec, MAX_PREFIX_LEN, MAX_SECRET_LEN, OpenedCredential,
    Secret,
};
