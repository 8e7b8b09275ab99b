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
//! | [`memory`] | the in-memory reference store with an injected clock (TTL in virtual time) |
//! | [`redis_store`] | the Redis store: one Lua script per check-and-write, `{activity}` hash tag, persistent monotonic ownership epoch |
//! | [`proto`] | the generated tonic/prost code of `proto/controlplane.proto` (committed; drift-checked) |
//! | [`grpc`] | the tonic service: DTO mapping, status codes, the worker identity check |
//! | [`tls`] | mTLS: client CA, the `spiffe://TD/ENV/worker/ID` identity, the handshaking acceptor |
//! | [`config`] | the `controlPlane` block (seed 004 §6) and its validation |
//! | [`server`] | bootstrap: limits, gRPC health and reflection, admin `/healthz` `/readyz` `/metrics`, bounded graceful stop |
//! | [`metrics`] | Prometheus counters and histograms with bounded labels |
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
pub mod config;
pub mod domain;
pub mod grpc;
pub mod memory;
pub mod metrics;
pub mod proto;
pub mod redis_store;
pub mod server;
pub mod tls;
