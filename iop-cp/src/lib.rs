//! The IOP Control Plane, as an embeddable library.
//!
//! **Status: empty.** This crate is filled by issue #6. It will own the Edge wire server
//! (`control.proto` over the `iop_wire` frame codec, mTLS), the live Edge view, the durable
//! store (SQLite by default, PostgreSQL for replicas), the principal projection and the lease
//! service.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
