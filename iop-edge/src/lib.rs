//! The IOP Edge, as an embeddable library.
//!
//! **Status: empty.** This crate is filled by issues #4 and #5. It will own the tokio driver
//! around `iop_wire::edge::Registry` (mTLS accept loop, one connection task per Node), the
//! provider pool and queue with provider leases, snapshots and health overlays, dispatch, the
//! OpenAI-compatible HTTP surface and the Control Plane connector.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
