//! The IOP Edge's protocol machine, sans-io.
//!
//! [`EdgeCore`] makes every protocol decision of the Edge side of the runtime wire (seed 000)
//! and nothing else: no tokio, no clock (every method that can arm or fire a timer takes
//! `now`), no sockets. It has the shape of quinn-proto's `Endpoint`: `handle_*` methods feed it
//! what happened, [`EdgeCore::poll_transmit`] hands out the frames to write,
//! [`EdgeCore::poll_event`] what the driver must act on, and [`EdgeCore::poll_timeout`] /
//! [`EdgeCore::handle_timeout`] its timers. Cargo enforces the purity: this crate's normal
//! dependencies are `iop-wire` (without its tokio codec feature), `ring` and `subtle` (the
//! projection's token digests, compared in constant time), `thiserror` and `tracing`; the test
//! command fails if tokio ever appears among them.
//!
//! It owns:
//!
//! - the [`registry::Registry`] (the single authority for `node_id → current owner,
//!   generation, pending/ready`), fed by connection ([`EdgeCore::accept`],
//!   [`EdgeCore::handle_frame`], [`EdgeCore::handle_close`]);
//! - the provider [`pool`] and its queue ([`EdgeCore::admit`], [`EdgeCore::send_admitted`],
//!   [`EdgeCore::release`]): ready activates a generation's providers and pumps the queue, a
//!   fence releases its leases exactly once and takes its providers offline;
//! - stream routing: stream ids (never reused), routes checked against the frame's transport
//!   identity `(node_id, generation)` (never what the frame claims), tunnel ordering
//!   (`iop_wire::tunnel_order`), response-wait timers, the slow-consumer rule (a byte bound and a
//!   no-progress timeout per stream), `CancelRequest` when a caller goes away;
//! - command / config-refresh correlation ([`EdgeCore::command`], [`EdgeCore::refresh`]) and
//!   the CAPABILITIES recovery probe ([`EdgeCore::recover`]), answered as [`Event::Answered`];
//! - the Edge terminal handoff (stall evidence checked against the lease; only a fresh
//!   `unavailable` sets the runtime-unavailable overlay) and recovery matching;
//! - in managed mode (seed `001`), the principal [`projection`] index and the [`binding`] loop
//!   of each request (bind, lease, re-bind on a stale generation within a bounded wait,
//!   re-admission on a Node that does not trust the issuer key, the check right before
//!   dispatch), a machine of its own per request, driven by `now` like the rest;
//! - the [`ratelimit`] rule: GCRA per key for requests and tokens, token reservations
//!   reconciled to the provider's usage, the in-flight count ([`ratelimit::KeyState`]), and
//!   the borrowing a fleet of Edges does from one shared store ([`ratelimit::Gcra::borrow`],
//!   [`ratelimit::Credit`]), with the overshoot bound property-tested for one Edge and for
//!   several. `iop-edge`'s `limits` module drives it (in process, or through Redis).
//!
//! Streams deliver into caller-provided buffers ([`StreamSink`], chosen by the driver through
//! [`Sinks`]): a routed frame reaches its stream's buffer inside
//! [`EdgeCore::handle_frame`], with no task or channel in between, and the machine never
//! waits for a reader (it watches each push's [`Level`] instead).
//!
//! # Invariants (tested in `tests/pair.rs` against the real `iop_wire::node::NodeSession`)
//!
//! - At most one owner per Node id; a frame of a stale generation is never routed.
//! - Every stream gets exactly one terminal: the Node's, or the Edge's own (fence, wait
//!   timeout, ordering violation, slow consumer).
//! - A fence ends that generation's streams and fails its pending commands in the same step.
//! - Every provider lease is released exactly once (terminal, caller, fence).
//!
//! The same rules (plus "no waiter stranded while a ready Node has capacity" and "no handshake
//! lost") are checked over **every** interleaving of a small configuration in
//! `tests/model.rs` (stateright): the machine is `Clone` for that (sinks cloned with their own
//! `Clone`), and [`EdgeCore::state`] renders its whole state deterministically (ordered maps) to
//! fingerprint it.
//!
//! # Driving it
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Instant;
//! use iop_edge_core::{CoreConfig, EdgeCore, NoObserver, Sinks};
//! use iop_edge_core::registry::{Registry, RegistryConfig};
//! # use iop_edge_core::{Level, StreamSink, TunnelEvent};
//! # use iop_wire::runtime::RunEvent;
//! # #[derive(Debug)] struct Buf;
//! # impl<T> StreamSink<T> for Buf {
//! #     fn push(&self, _: T, _: usize) -> Option<Level> { Some(Level::default()) }
//! #     fn replace_with(&self, _: T) {}
//! #     fn level(&self) -> Level { Level::default() }
//! # }
//! struct MySinks;
//! impl Sinks for MySinks {
//!     type Run = Buf;
//!     type Tunnel = Buf;
//! }
//!
//! let mut core: EdgeCore<MySinks> = EdgeCore::new(
//!     Registry::new(RegistryConfig::default()),
//!     None,
//!     CoreConfig::default(),
//!     Arc::new(NoObserver),
//! );
//! let now = Instant::now();
//! let conn = core.accept(now, "node-1");
//! // ... core.handle_frame(now, conn, frame) for every frame read from the socket ...
//! while let Some((_conn, _frame)) = core.poll_transmit() { /* write it */ }
//! while let Some(_event) = core.poll_event() { /* act on it */ }
//! if let Some(at) = core.poll_timeout() { /* sleep until `at`, then */ core.handle_timeout(at); }
//! # let _ = conn;
//! ```
//!
//! `iop-edge`'s transport is the production driver: one mutex around the machine, locked by
//! the connection tasks (frames in), the callers (dispatch, commands, stream drops) and one
//! timer task, for the length of one call and its drain.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod binding;
mod machine;
pub mod pool;
pub mod projection;
pub mod ratelimit;
pub mod registry;

pub use machine::{
    Admit, Admitted, Answer, CoreConfig, CoreStatus, DEFAULT_STREAM_WINDOW, DispatchError,
    EdgeCore, Event, HealthNote, Issuers, Level, Lifecycle, MIN_STREAM_WINDOW, NODE_DISCONNECTED,
    NoObserver, NodeStatus, Observer, Open, Opened, OverlayNote, ProbeNote, SLOW_CONSUMER, Sinks,
    StreamSink, TunnelEvent,
};
