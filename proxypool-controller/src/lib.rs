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
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod domain;
pub mod memory;
pub mod redis_store;
