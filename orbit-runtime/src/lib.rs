//! The OrbitMesh Edge Runtime protocol (seed `003`).
//!
//! **Status: empty.** This crate is filled by issue #8. It will own Ed25519 request signing and
//! verification and the desired-state version rules (pure), the control plane HTTP server and
//! the runtime agent. It does not depend on the IOP crates.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
