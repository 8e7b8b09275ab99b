//! The OrbitMesh Edge Runtime protocol (seed `003`).
//!
//! **Status (issue #8, in progress):** the pure core is here — [`signing`] (the seven
//! `X-OrbitMesh-*` headers, the signed payload, strict Ed25519 verification, the body digest,
//! the timestamp window and the bounded [`signing::NonceStore`], with a published test vector)
//! and [`versions`] (the desired-state version rules). The control plane HTTP server (register,
//! heartbeat, DNS providers, certificates with ACME DNS-01, desired state, apply results, store)
//! and the agent are not written yet. It does not depend on the IOP crates.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod dns;
pub mod signing;
pub mod versions;
