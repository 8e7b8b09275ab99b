//! Signed, recipient-sealed credential leases for the IOP mesh.
//!
//! **Status: empty.** This crate is filled by issue #3. It will own `CredentialLeaseBinding`'s
//! canonical encoding, the P-256-signed and HPKE-sealed lease envelope, the recipient's
//! fail-closed `open` (signature, recipient, binding, validity window, replay), the replay
//! guard, the zeroizing plaintext type and auth-header injection.
//!
//! The wire shapes it fills (`CredentialLease`, `CredentialLeaseBinding`) already exist in
//! [`iop-wire`](../iop_wire/index.html); this crate will stay pure (no tokio, no clock reads,
//! no I/O) like `iop-wire`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
