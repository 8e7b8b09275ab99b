//! The OrbitMesh Edge Runtime protocol (seed `003`): a control plane that Nodes register with
//! and pull desired state from, and the agent that runs on each Node.
//!
//! - pure core: [`signing`] (the seven `X-OrbitMesh-*` headers, the signed payload, strict
//!   Ed25519 verification, the body digest, the timestamp window and the bounded
//!   [`signing::NonceStore`], with a published test vector) and [`versions`] (the desired-state
//!   version rules);
//! - [`server`]: the control plane ([`server::ControlPlane`]) — register, heartbeat (with DNS
//!   reconciliation through [`dns::DnsProvider`]), desired state with 304, apply results,
//!   certificates, and a loopback admin API; its state lives in a [`store`];
//! - [`store`]: the durable state behind the control plane — SQLite (a file, or in memory by
//!   default) or PostgreSQL for replicas, one contract suite; nonces live there too, so every
//!   replica refuses a replay;
//! - [`agent`]: key generation into the state directory, register, heartbeat, pull, apply
//!   through [`agent::Applier`], report, persisted applied version, jittered backoff;
//! - [`dns`]: the provider trait, the in-memory default, an RFC 2136 client with TSIG (tested
//!   against a real BIND 9) and a Cloudflare-style REST client (`proxied=false`, idempotent);
//! - [`certs`]: CSR validation against the Node's endpoints and ACME DNS-01 issuance with
//!   `instant-acme` (tested against pebble resolving through that BIND 9), challenge TXT values
//!   removed afterwards.
//!
//! The binaries are `orbit-control-plane` and `orbit-agent` (crate `iop-bins`). It does not
//! depend on the IOP crates.
//!
//! # Embedding the control plane
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use orbit_runtime::dns::MemoryDns;
//! use orbit_runtime::server::{ControlPlane, ServerConfig, system_clock};
//!
//! // In-memory SQLite and DNS: nothing survives a restart (use `ControlPlane::new` with a
//! // `store::SqliteStore::open(path)` or `store::PgStore` and a real `dns` provider).
//! let cp = ControlPlane::in_memory(
//!     ServerConfig::new("https://cp.example.net"),
//!     Arc::new(MemoryDns::default()),
//!     system_clock(),
//! )?;
//! let token = cp.create_deployment_token(1).await?; // hand to one agent, once
//! # let _ = token;
//! let api = tokio::net::TcpListener::bind("0.0.0.0:8443").await?;
//! let admin = tokio::net::TcpListener::bind("127.0.0.1:8444").await?;
//! tokio::try_join!(
//!     axum::serve(api, cp.router()).into_future(),
//!     axum::serve(admin, cp.admin_router()).into_future(),
//! )?;
//! # Ok(())
//! # }
//! ```
//!
//! The `orbit-control-plane` binary serves the same routers with a connection cap and
//! header/idle timeouts (`bounded_http::serve_with`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod agent;
pub mod certs;
pub mod dns;
pub mod server;
pub mod signing;
pub mod store;
pub mod versions;
