//! The IOP Edge, as an embeddable library.
//!
//! The embedding API is [`Edge`] (below). Underneath, the Node transport ([`transport`])
//! drives [`iop_edge_core::EdgeCore`], the pure machine
//! that makes every protocol decision: the `iop_edge_core::registry::Registry` (the single authority
//! for `node_id → current owner, generation, pending/ready`), the provider [`pool`], stream
//! routing, timers and command correlation. The transport is glue: the mTLS listener and its
//! caps, one I/O task per Node connection, one timer task, and the machine behind one mutex
//! (locked per call, never across an `.await`), so a Node's frame is routed by the task that
//! read it straight into its stream's buffer. [`EdgeHandle`] is the embeddable API to dispatch
//! runs, cancel them, open provider tunnels (frames checked by `iop_wire::tunnel_order`), send
//! commands and push config refreshes to ready Nodes; a tunnel may carry a response-wait
//! timeout, and a caller that goes away (drops its stream) or times out makes the Edge send
//! `CancelRequest`. [`start_unbound`] starts it without a listener and
//! [`EdgeHandle::serve_connection`] serves a Node connection accepted elsewhere under the same
//! caps and handshake (another listener type, or `turmoil`'s simulated network in
//! `tests/tests/mesh_sim.rs`).
//!
//! [`pool`] (re-exported from `iop-edge-core`) is the provider pool and queue as a pure state
//! machine: model groups of provider candidates, provider leases keyed by
//! `(node_id, provider_id)` and released exactly once (terminal or fence), a bounded FIFO queue
//! pumped on ready/release, the seed's snapshot figures and the per-generation
//! runtime-unavailable overlay. The machine drives it in the same step as its own lifecycle
//! (ready → activate and pump; fence → release leases, go offline, re-evaluate). Every request
//! takes one path: [`EdgeHandle::admit`] selects and holds a provider, the caller builds the
//! request for it in its own task (and, in managed mode, acquires a credential lease for
//! exactly that Node), then [`EdgeHandle::send_admitted`] sends it ([`EdgeHandle::dispatch`] is
//! the two in a row).
//! Stall terminals go through the Edge terminal handoff (transport identity and the lease's
//! adapter/target; `provider_id`, `provider_health`, `recovery_handoff=confirmed` on validated
//! run and tunnel stalls; only a fresh `unavailable` sets the overlay), and [`EdgeHandle::recover`] runs
//! the CAPABILITIES recovery probe that may clear it.
//!
//! [`http`] is the HTTP surface: OpenAI chat completions, the OpenAI Responses API and the
//! Anthropic Messages API (`/v1/models`, `/v1/chat/completions`, `/v1/responses`,
//! `/v1/messages`, `/v1/messages/count_tokens`, plus `/metrics`, `/healthz`, `/readyz`) on every
//! model, whatever its provider speaks: each OpenAI-compatible adapter declares the operations
//! its upstream serves ([`profile`]: presets `chat_only`, `openai`, `anthropic`), and a route
//! the selected provider lacks is translated with `iop_dialect` where the response is rendered
//! anyway. Errors come in the route's dialect; gateway API keys ([`http::ApiKeys`]) guard it in
//! legacy mode. Tool calls come from native metadata or, under the seed's fallback mark, from
//! `<tool_call>` text (module `tools`). Serve it with [`http::serve`] (it sets `TCP_NODELAY`).
//!
//! Everything a peer drives is bounded ([`transport`] and [`http::serve_with`] say how): handshakes
//! and registration have deadlines and connection caps, frames to and from a Node wait in
//! bounded queues, and a client that reads a response slower than the provider writes it holds
//! at most [`TransportConfig::max_stream_buffer`] bytes for at most
//! [`TransportConfig::slow_consumer_timeout`] before its stream is ended and the run cancelled.
//!
//! [`limits`] enforces per-key rate limits (requests, tokens, in flight; in process or shared
//! by several Edges through Redis) between authentication and admission, and [`usage`] writes
//! one usage record per keyed request (a local SQLite file); both ride on the response stream
//! ([`StreamWatch`]) to settle to the provider's reported usage.
//!
//! Tracing ([`iop_telemetry`], off by default; `[telemetry]`, the `OTEL_*` variables or
//! [`http::HttpConfig::telemetry`]): each model request is a server span continuing the
//! client's `traceparent`, with a `queue` span, one `dispatch` span per attempt (the context
//! the Node's spans hang from, sent on the run or tunnel request) and, in managed mode, a
//! `lease acquire` span whose context goes to the Control Plane. A tunnel request whose Node is
//! lost before it answered is sent once more to another candidate that takes the same request
//! (a second `dispatch` span, reason `fallback`). The GenAI histograms and the gateway's own
//! overhead (the Edge's time minus the provider call's time the Node reports on the terminal)
//! are on `/metrics` ([`metrics`]).
//!
//! [`admin`] is the status page for operators ([`Edge::status_page`], on its own listener:
//! `[admin]` in the file): live Nodes, providers, the queue, traffic with the gateway's own
//! overhead and time to first token, and the Control Plane session, pushed over server-sent
//! events, token-authenticated, with a strict Content-Security-Policy.
//!
//! [`config`] reads the Edge's TOML file (the `iop-edge` binary's format) into a
//! [`TransportConfig`], an [`http::HttpConfig`], an optional [`control::ControlConfig`] and the
//! hot-reloadable TLS material (`workload_identity::WorkloadTls`).
//!
//! # Embedding: [`Edge`]
//!
//! [`Edge::start`] composes everything above from an [`config::EdgeConfig`] (a TOML file, or
//! TOML text with TLS material in code: [`config::EdgeConfigFile::build_with_tls`]) and starts
//! what the config asks for (the Control Plane connector, certificate reload). The HTTP
//! surface is yours to place: [`Edge::api`] (the `/v1` routes, no fallback) merges or nests
//! into your axum app, [`Edge::ops`] gives `/metrics`, `/healthz`, `/readyz`, and
//! [`Edge::serve`] serves any router with the configured connection limits. The repository's
//! `examples/edge_in_axum.rs` is a complete program.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use iop_edge::Edge;
//! use iop_edge::config::EdgeConfigFile;
//!
//! let config = EdgeConfigFile::load("edge.toml".as_ref())?.build()?;
//! let listen = config.http_listen;
//! let edge = Edge::start(config).await?;
//! let app = axum::Router::new()
//!     .route("/", axum::routing::get(|| async { "my app" }))
//!     .nest("/llm", edge.api())
//!     .merge(edge.ops());
//! let listener = tokio::net::TcpListener::bind(listen).await?;
//! edge.serve(listener, app, std::future::pending()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! In code, [`builder::EdgeBuilder`] writes the same configuration as one typed tree (Nodes,
//! their adapters, and the models each adapter serves), each name once; its
//! [`builder::EdgeTls`] takes files (reloaded), PEM bytes or a `WorkloadTls`.
//!
//! [`control`] is the Control Plane connector (seed `001`): it dials out, says hello, answers
//! status and commands, relays Node lifecycle events and reconnects; in managed mode
//! (`credential_plane.enabled`) it keeps the principal projection and acquires credential
//! leases, and [`http`] authenticates requests against that projection, resolves the route,
//! admits through the pool, and runs the binding machine of [`binding`] (bind a lease to exactly
//! the selected Node, re-bind on a stale generation, re-admit on an untrusted Node, check before
//! dispatch) for each request: this crate only awaits what that machine asks for.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod builder;
pub mod config;
pub mod control;
mod edge;
pub mod http;
pub mod limits;
mod managed;
pub mod metrics;
pub use iop_edge_core::{binding, pool, projection, ratelimit, registry};
pub mod profile;
mod stream_buf;
mod tools;
pub mod transport;
pub mod usage;

pub use edge::{Edge, StartError};
pub use transport::{
    Admission, DispatchError, Dispatched, EdgeHandle, Lifecycle, PoolRequest, RunStream, StreamEnd,
    StreamWatch, TransportConfig, TunnelEvent, TunnelStream, bind, start_unbound,
};
