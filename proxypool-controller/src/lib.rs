//! The proxy-pool WorkerControlPlane gRPC controller (seed `004`).
//!
//! **Status: empty.** This crate is filled by issue #7. It will own the pure worker session
//! domain (ACK and runtime-report fences), the `ControlStore` trait with in-memory and Redis
//! implementations, and the tonic transport. It does not depend on the IOP crates.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
