//! The IOP Edge, as an embeddable library.
//!
//! **Status:** the Node transport ([`transport`]) is here: the mTLS listener, one I/O task per
//! Node connection, and one registry task that owns `iop_wire::edge::Registry` — the single
//! authority for `node_id → current owner, generation, pending/ready` — plus the routing of run
//! streams and commands. [`EdgeHandle`] is the embeddable API to dispatch runs, cancel them,
//! open provider tunnels (frames checked by `iop_wire::tunnel`), send commands and push config
//! refreshes to ready Nodes; a tunnel may carry a response-wait timeout, and a caller that goes
//! away (drops its stream) or times out makes the Edge send `CancelRequest`.
//!
//! [`pool`] is the provider pool and queue as a pure state machine: model groups of provider
//! candidates, provider leases keyed by `(node_id, provider_id)` and released exactly once
//! (terminal or fence), a bounded FIFO queue pumped on ready/release, the seed's snapshot
//! figures and the per-generation runtime-unavailable overlay. The transport's registry task
//! drives it in the same step as its own lifecycle (ready → activate and pump; fence → release
//! leases, go offline, re-evaluate), and [`EdgeHandle::dispatch`] dispatches through it.
//! Stall terminals go through the Edge terminal handoff (transport identity and the lease's
//! adapter/target; `provider_id`, `provider_health`, `recovery_handoff=confirmed` on validated
//! run and tunnel stalls; only a fresh `unavailable` sets the overlay), and [`EdgeHandle::recover`] runs
//! the CAPABILITIES recovery probe that may clear it.
//!
//! [`http`] is the OpenAI-compatible surface (`/v1/models`, `/v1/chat/completions`,
//! `/v1/responses`, `/v1/messages`, `/v1/messages/count_tokens`, `/metrics`, `/healthz`,
//! `/readyz`), with tool calls from native metadata or, under the seed's fallback mark, from
//! `<tool_call>` text (module `tools`). Still to come: the managed auth mode and the Control
//! Plane connector (issue #6).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod control;
pub mod http;
pub mod metrics;
pub mod pool;
mod tools;
pub mod transport;

pub use transport::{
    Admission, BuildRequest, DispatchError, Dispatched, EdgeHandle, Lifecycle, PoolRequest,
    RunStream, TransportConfig, TunnelEvent, TunnelStream, bind,
};
