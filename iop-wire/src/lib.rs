//! The pure protocol core of the IOP mesh: the Edge ⇄ Node runtime wire (seed `000`) and the
//! Control Plane ⇄ Edge wire (seed `001`).
//!
//! This crate never touches a socket, a clock or an async runtime: time comes in as an
//! argument, bytes come in as slices, and every decision is a return value or a polled output.
//! The async crates (`iop-node`, `iop-edge`, `iop-cp`) plug these machines into tokio, TLS and
//! HTTP without making protocol decisions of their own.
//!
//! # Design overview
//!
//! | module | owns |
//! |---|---|
//! | [`runtime`], [`control`] | domain types for every message of `proto/runtime.proto` and `proto/control.proto`; validation happens in the conversion from protobuf ("parse, don't validate") |
//! | [`codec`] | 4-byte big-endian length prefix + one envelope, hard size limit checked from the header alone, "need more bytes" apart from "invalid"; a runtime frame's repeated fields counted against validation's bounds before prost builds them; optional tokio-util codec (feature `tokio-codec`) |
//! | [`node`] | the Node side of one connection (the Edge side is `iop_edge_core::registry`): register → apply config → ready; run-id admission, refusal framing, `health_observation_seq` stamping |
//! | [`control_session`] | both ends of one Control Plane ⇄ Edge connection (seed 001): hello and identity agreement, heartbeats and silence, correlation, projection generations that only move forward, a projection larger than a frame in parts (installed whole or not at all), lease request/answer matching |
//! | [`tunnel_order`] | provider tunnel frame ordering per stream (Edge side) and numbering (Node side) |
//! | [`reconnect`] | the supervisor policy: `interval_sec`, `max_attempts`, jitter, exit classes |
//! | [`health`] | the connection-scoped `health_observation_seq` |
//! | [`liveness`] | the heartbeat and silence rule both wires share |
//! | [`validate`] | shared field rules, including `response_stall_timeout_ms` |
//! | [`trace`] | W3C trace context: the `traceparent`/`tracestate` headers and their binary form on both wires (advisory: a malformed one is ignored) |
//! | [`text_tools`] | the text tool-call fallback contract: metadata keys, the `<tool_call>` text form, its splitter |
//!
//! The generated prost code lives in `src/gen/` (committed, private); the `iop-wire-codegen`
//! crate (`iop-wire/codegen/`) regenerates it with protox + prost-build and fails on drift.
//!
//! The machines follow quinn-proto's shape: `handle_*` for input, commands for the
//! application, and `#[must_use] poll_transmit` / `poll_event` / `poll_timeout` for output.
//! After any input, drain `poll_transmit`, then `poll_event`, then re-arm one timer from
//! `poll_timeout`.
//!
//! # Example: a Node session asks to register, through real bytes
//!
//! ```
//! use std::time::Instant;
//! use bytes::BytesMut;
//! use iop_wire::codec::FrameCodec;
//! use iop_wire::node::{NodeSession, NodeSessionConfig};
//! use iop_wire::runtime::{RegisterRequest, RuntimeFrame, RuntimeMessage};
//!
//! let now = Instant::now();
//! let register = RegisterRequest { node_id: "node-1".into(), ..Default::default() };
//! let mut node = NodeSession::new(NodeSessionConfig::default(), register, now);
//! let codec = FrameCodec::new();
//! let frame = node.poll_transmit().expect("the session opens with its registration");
//! let mut buf = BytesMut::new();
//! codec.encode(&frame, &mut buf).unwrap();
//! let read: RuntimeFrame = codec.decode(&mut buf).unwrap().unwrap();
//! assert!(matches!(read.message, RuntimeMessage::RegisterRequest(_)));
//! ```
//!
//! The Edge's side of the same handshake is `iop_edge_core::registry` (its docs run both sides
//! in memory).
//!
//!
//! # Choices where the seeds are silent
//!
//! - Framing: 4-byte big-endian length, default maximum 8 MiB ([`codec::DEFAULT_MAX_FRAME_LEN`]).
//! - Envelope ids: `stream_id` (non-zero, Edge-chosen, never reused on a connection) names a
//!   run/tunnel stream; `correlation_id` pairs commands, refreshes and pings with answers;
//!   `run_id` is the provider run id `CancelRequest` names.
//! - Heartbeat: both sides ping after `interval` without sending, and close after
//!   `3 × interval` without receiving (default interval 10 s; the Edge announces its interval
//!   in `RegisterResponse`).
//! - `response_stall_timeout_ms` "overflow" means above `i64::MAX / 10^6` ms (the largest value
//!   whose nanoseconds fit an `i64`).
//! - Tunnel ordering corner cases: BODY and END need a prior RESPONSE_START; ERROR and USAGE may
//!   come at any point; see [`tunnel_order`].
//! - `ExecutionFailure`'s allowlisted metadata is a fixed set of typed fields; invalid evidence
//!   does not invalidate the terminal carrying it ([`runtime::FailureEvidence`]).
//! - Identifiers: 1–128 bytes of `A-Z a-z 0-9 . _ - :`; Node ids without `:` (they are SPIFFE
//!   path segments); targets 1–256 bytes of visible ASCII. See [`validate`].
//! - Reconnect: the attempt budget resets when a session reaches ready; `interval_sec = 0` is
//!   allowed only with a finite budget; jitter takes up to 20 % off each wait.

//! # Added to the wire after its first release
//!
//! Each is optional, and an older peer keeps its old behaviour:
//!
//! - `trace` on `RunRequest` and `ProviderTunnelRequest`: W3C trace context ([`trace`]).
//! - Per-stream credit for tunnel bodies, negotiated because an older Node could not decode
//!   the new message: a Node that honours it says so in
//!   [`runtime::RegisterRequest::stream_credit`]; only then does the Edge open tunnels with a
//!   window ([`runtime::ProviderTunnelRequest::credit_window`], in credit bytes: a `BODY`
//!   frame costs its body length plus [`runtime::TUNNEL_FRAME_CREDIT`]) and give credit back
//!   with [`runtime::RuntimeMessage::StreamWindowUpdate`] on the tunnel's stream as its reader
//!   consumes the body. The Node never has more than the window outstanding and stops reading
//!   its provider meanwhile. Without it (older Edges or Nodes), the body flows as fast as the
//!   connection takes it and the Edge's per-stream byte bound ends a reader that falls
//!   behind. An update for a stream the Node no longer has is ignored (it may cross the
//!   terminal).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod proto;

pub mod backoff;
pub mod codec;
pub mod control;
pub mod control_session;
pub mod error;
pub mod health;
pub mod liveness;
pub mod node;
mod prescan;
pub mod reconnect;
pub mod runtime;
pub mod text_tools;
pub mod time;
pub mod trace;
pub mod tunnel_order;
pub mod validate;

pub use liveness::{DEFAULT_HEARTBEAT_INTERVAL, HeartbeatConfig};

/// Entry points for fuzz targets and benches: raw protobuf round trips that bypass the domain
/// types. Not part of the stable API.
#[doc(hidden)]
pub mod __private {
    use prost::Message as _;

    /// Decodes `bytes` as a runtime `Envelope` with prost only and re-encodes it (the
    /// benchmark baseline: what raw prost costs without domain conversion).
    pub fn prost_roundtrip_runtime(bytes: &[u8]) -> Option<Vec<u8>> {
        let env = crate::proto::runtime::Envelope::decode(bytes).ok()?;
        Some(env.encode_to_vec())
    }
}
