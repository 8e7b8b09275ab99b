//! The OrbitMesh Edge Runtime protocol (seed `003`).
//!
//! **Status (issue #8, in progress).** Here:
//! - pure core: [`signing`] (the seven `X-OrbitMesh-*` headers, the signed payload, strict
//!   Ed25519 verification, the body digest, the timestamp window and the bounded
//!   [`signing::NonceStore`], with a published test vector) and [`versions`] (the desired-state
//!   version rules);
//! - [`server`]: register, heartbeat (with DNS reconciliation through [`dns::DnsProvider`]),
//!   desired state with 304, apply results, a loopback admin API; state in memory;
//! - [`agent`]: key generation into the state directory, register, heartbeat, pull, apply
//!   through [`agent::Applier`], report, persisted applied version, jittered backoff;
//! - [`dns`]: the provider trait, the in-memory default, an RFC 2136 client with TSIG (tested
//!   against a real BIND 9) and a Cloudflare-style REST client (`proxied=false`, idempotent);
//! - [`certs`]: CSR validation against the Node's endpoints and ACME DNS-01 issuance with
//!   `instant-acme` (tested against pebble resolving through that BIND 9), challenge TXT values
//!   removed afterwards.
//!
//! - [`store`]: the durable state behind the control plane — SQLite (a file, or in memory by
//!   default) or PostgreSQL for replicas, one contract suite; nonces live there too, so every
//!   replica refuses a replay.
//!
//! The binaries are `orbit-control-plane` and `orbit-agent` (crate `iop-bins`). It does not depend on the IOP crates.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod agent;
pub mod certs;
pub mod dns;
pub mod server;
pub mod signing;
pub mod store;
pub mod versions;
