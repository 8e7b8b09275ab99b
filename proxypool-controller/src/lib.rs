//! The proxy-pool WorkerControlPlane controller (seed `004`): Gateway Workers register, receive
//! an expiring, replaceable session, acknowledge published snapshots and report their complete
//! sparse runtime counters; Controller replicas share sessions, snapshot references and report
//! fences through Redis.
//!
//! **Scope.** This is the seed's first delivery unit: `RegisterWorker`, `AcknowledgeSnapshot`
//! and `ReportRuntime`. `WatchSnapshots` and `ReportOutcomes` keep their contract and answer
//! `UNIMPLEMENTED`; snapshot payloads, outcome de-duplication and revocation are not here. It
//! is not the complete worker control plane. It does not depend on the IOP crates.
//!
//! | module | owns |
//! |---|---|
//! | [`domain`] | validated commands, the session state machine's ACK and report rules, the [`domain::ControlStore`] port and the [`domain::Service`]; no tonic, Redis or tokio types |
//! | [`memory`] | the in-memory reference store with an injected clock (TTL in virtual time); its rules are [`memory::StoreState`]'s pure steps, which `tests/model.rs` explores exhaustively (stateright) and `tests/differential.rs` holds the Redis Lua scripts to, answer by answer |
//! | [`redis_store`] | the Redis store: one Lua script per check-and-write, `{activity}` hash tag, persistent monotonic ownership epoch |
//! | [`proto`] | the generated tonic/prost code of `proto/controlplane.proto` (committed; drift-checked) |
//! | [`grpc`] | the tonic service: DTO mapping, status codes, the worker identity check; [`grpc::report`] decodes `ReportRuntime` straight into canonical counters (no allocation per counter) and routes it beside the generated server |
//! | [`keepalive`] | keepalive enforcement, sans-io: scans the HTTP/2 frame headers a client sends and tells the connection to close when it pings faster than `controlPlane.minPingInterval` (gRPC-Go's strikes) |
//! | [`tls`] | mTLS: the `spiffe://TD/ENV/worker/ID` identity read after the handshake, over the workspace's bounded TLS accept loop (`bounded_http::tls`); the server's files are `workload_identity::HostTls`, re-read every `reloadInterval` |
//! | [`config`] | the `controlPlane` block (seed 004 §6) and its validation |
//! | [`server`] | bootstrap: limits, gRPC health and reflection, admin `/healthz` `/readyz` `/metrics`, bounded graceful stop |
//! | [`metrics`] | Prometheus counters and histograms with bounded labels |
//!
//! # Embedding it
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use proxypool_controller::config::File;
//! use proxypool_controller::server;
//!
//! let text = std::fs::read_to_string("controller.toml")?;
//! let config = File::parse(&text)?.validate()?; // errors name the seed 004 key
//! // Redis from `controlPlane.redis`; `server::start_with` takes any `domain::ControlStore`.
//! let running = server::start(&config, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! println!("gRPC on {}", running.grpc_addr);
//! running.wait().await?; // after the shutdown future, in-flight RPCs drained
//! # Ok(())
//! # }
//! ```
//!
//! # Choices where the seed is silent
//!
//! - `controlplane.proto` is written from the seed's field list: counters are
//!   `(proxy_id, in_flight, open_connections)` as `int64` so that negative values can be refused
//!   (seed: "counts non-negative"); the session id travels as 16 raw bytes; the checksum as 32.
//! - An ACK that does not match (older, newer, another checksum) answers `OK` with
//!   `require_full_snapshot = true` and writes nothing, like a mismatched report; a request whose
//!   `worker_id` differs from the mTLS identity is `PERMISSION_DENIED`.
//! - The report fence `(sequence, digest)` lives in the session hash, so it lives exactly as long
//!   as the session and is cleared with the runtime (ACK advance, negative ACK, re-enable);
//!   the report itself expires after `maxStaleAge`. The digest covers the canonical counters
//!   and the observation time.
//! - The configuration file is TOML (one format across our binaries) with the seed's key names
//!   (`controlPlane.sessionTTL`, …) and durations written `10s`, `500ms`, `2m`. We add
//!   `maxConcurrentStreams` (default 256) and `shutdownTimeout` (default 10 s).
//! - Limits: HTTP/2 keepalive pings every 30 s (10 s timeout), 20 pending-accept and 256
//!   local-error reset streams before GOAWAY, 16 KiB header lists, 30 s per RPC. Keepalive
//!   enforcement: tonic exposes no server-side minimum client ping interval, so [`keepalive`]
//!   scans each connection's incoming HTTP/2 frame headers and closes a connection whose client
//!   pings more often than `controlPlane.minPingInterval` (default 10 s) more than twice in a
//!   row (gRPC-Go's strikes; a new call clears them).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
pub mod config;
pub mod domain;
pub mod grpc;
pub mod keepalive;
pub mod memory;
pub mod metrics;
pub mod proto;
pub mod redis_store;
pub mod server;
pub mod tls;
