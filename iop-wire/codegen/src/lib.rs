//! Code generation for `iop-wire`: the test in `tests/drift.rs` regenerates
//! `iop-wire/src/gen/` from `iop-wire/proto/` with protox + prost-build (no system `protoc`)
//! and fails on any difference. It lives in its own crate so that it never needs `iop-wire`
//! itself to compile: after a `.proto` change, regenerate first, then use the new types.
//!
//! ```text
//! IOP_WIRE_REGENERATE=1 cargo test -p iop-wire-codegen
//! ```
#![forbid(unsafe_code)]
