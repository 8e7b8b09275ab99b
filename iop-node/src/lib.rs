//! The IOP Node, as an embeddable library.
//!
//! A Node dials out to its Edge over mutually authenticated TLS, registers, applies the
//! adapter configuration the Edge sends, reports ready, and then executes normalized runs
//! (`RunRequest` → `RunEvent` stream) on its adapter instances (seed `000`).
//!
//! # Design
//!
//! - [`run_node`] is the supervisor ([`run_node_with`] the same over connections the caller
//!   dials: another transport, or `turmoil`'s simulated network in `tests/tests/mesh_sim.rs`;
//!   [`run_node_dialing`] for a Node of several Edges): one task per Edge doing the initial
//!   dial and every reconnect under
//!   one `iop_wire::reconnect` policy. Startup does not need the Edge to be reachable. It ends
//!   with an [`Exit`]: `Shutdown` (exit code 0) when the caller's token is cancelled,
//!   `Exhausted` (1) when a finite budget runs out, `Fatal` (1) for local errors.
//! - Each connection is driven by one loop around `iop_wire::node::NodeSession` (the protocol
//!   decisions live there): nothing is dispatched before the Edge's ready ack, and a
//!   session-lifetime cancellation token cancels every active run on disconnect.
//! - [`Adapter`] is the trait embedders implement; [`AdapterRegistry`] builds instances by type
//!   from the Edge's `NodeConfigPayload` (`AdapterConfig.name` is the instance identity; empty
//!   means the legacy single instance). The built-in `demo` adapter needs no network.
//! - A per-instance [`CapacityGate`] admits runs and tunnels alike (one gate per adapter
//!   instance, defense in depth behind the Edge's leases).
//! - A config refresh (`NodeConfigRefreshRequest`) is `Applied` or `Failed`, never
//!   `RestartRequired`: the Node rebuilds every adapter instance from the payload on the live
//!   session (executions in flight keep the instance they started on until they end), and the
//!   payload's only other field, `runtime.concurrency`, is legacy metadata the Node does not
//!   use. What could need a restart (the Node's identity, TLS material, its credential plane
//!   keys) comes from the Node's own configuration, never from the Edge's payload. The wire
//!   still carries `RestartRequired` for other Node implementations, and the Edge relays it.
//! - The driver, not the adapter, sends `START` and exactly one terminal (`COMPLETE`, `ERROR`,
//!   `CANCELLED`); a hard deadline, a `CancelRequest` and a disconnect each end the run with
//!   their own outcome, and the adapter's future is dropped (aborting its upstream I/O).
//!
//! - The built-in `openai_compat` adapter serves provider raw tunnels to whatever upstream its
//!   protocol profile describes (an OpenAI-compatible server, or Anthropic with its fixed
//!   headers): status, headers and body bytes (SSE byte for byte) as numbered
//!   `ProviderTunnelFrame`s, usage as a separate observation; the driver sends the single
//!   END/ERROR terminal. Which dialect to speak is the Edge's decision, not the Node's. On a
//!   stream, the usage goes as soon as the stream's own end has arrived (`data: [DONE]`,
//!   `message_stop`, `response.completed`), ahead of the bytes that carry that end: a client
//!   may hang up there, before the provider ends its response. Figures seen earlier wait (they
//!   can be partial: Anthropic's `message_start`), so a client that leaves mid-stream keeps its
//!   whole token reservation. A JSON body's usage, or a stream's without such an end, follows
//!   the body. Seed 000 allows USAGE anywhere before the terminal. The reading is
//!   `iop_dialect::usage::UsageScanner` (pure, bounded, fuzzed by `fuzz/` `usage_scan`).
//!
//! - Tracing ([`NodeOptions::telemetry`], off by default): each run or tunnel is an `execute`
//!   span, a child of the Edge's dispatch attempt (its context comes on the request), and the
//!   provider call a child of that; the adapter sends the provider call's context upstream as
//!   `traceparent` ([`trace_headers`]; the Edge's per-adapter `trace_propagation = false`
//!   withholds it). Off, the Edge's context is passed on unchanged. Log lines of a traced
//!   execution carry its `trace_id`. Every terminal carries the provider call's duration
//!   (`iop_wire::runtime::METADATA_PROVIDER_US`), from which the Edge computes its overhead.
//!
//! - Every execution runs under a response-stall watchdog (see the `exec` module docs for the
//!   outcome precedence): on a stall the attempt is fenced, the close grace and an exact-target
//!   probe run concurrently, and exactly one `response_stalled` terminal with a typed
//!   `ExecutionFailure` follows; an unconfirmed fence keeps the admission permit until the
//!   provider call returns.
//! - One task per execution: the session loop spawns it, and it polls the adapter's future
//!   itself (no second task) beside the watchdog. The execution's task polls its HTTP/1.1
//!   connection to the provider itself for the response's head and the first 64 KiB of its
//!   body (a JSON answer, or a chat stream of a few KiB, whole); past that, a piece of a
//!   provider's body makes two hops inside the Node: the connection's task (hyper's body
//!   channel) → the execution's task → the session loop (a bounded queue; the loop is the one
//!   writer of the TLS stream, and the execution must not block on the socket). Providers are
//!   called through the Node's own connection pool over hyper (`provider_http`): a provider's
//!   redirect is relayed to the caller, never followed.
//! - A tunnel's body is paced by the reader at the Edge when the Edge gives credit: the Node
//!   registers with `stream_credit`, and a tunnel opened with a `credit_window` sends at most
//!   that window ahead of what the Edge's reader consumed (`StreamWindowUpdate` gives it back).
//!   [`TunnelSink::body`] waits for credit (splitting a body larger than what is left), so an
//!   adapter that awaits it before reading on stops reading its provider, and TCP slows the
//!   provider down. Waiting for credit is not a response stall. Without a window (older
//!   Edges) the body flows as fast as the connection takes it, within [`STREAM_BUFFER`].
//! - No frame carries more than [`MAX_FRAME_PAYLOAD`] (64 KiB) of text, nor of body when the
//!   Edge gives no credit (with credit, the window the Edge opened and 1 MiB bound a frame): a longer
//!   delta or body chunk from an adapter goes out as several frames, so one large event (a long
//!   word echoed back, a provider's large read) never exceeds the Edge's per-stream buffer or
//!   the frame limit. A run's start or terminal the Edge could not take ends that run only: an
//!   error text longer than `iop_wire::validate::MAX_TEXT_LEN` is cut to it, and one too large
//!   for a frame or refused by the wire's validation (tool calls beyond the metadata bound, a
//!   header name that is not a token) is replaced by an `ERROR` that says why.
//!
//! - The built-in `ollama` adapter turns Ollama's native streaming chat into normalized
//!   RunEvents (deltas, usage, native tool calls as `openai_tool_calls` metadata).
//! - [`config`] reads the `iop-node` binary's TOML file with strict, key-naming validation.
//!
//! - Upstream credentials ([`credential`]): in managed mode every provider tunnel carries a
//!   lease sealed to this Node, opened after capacity admission; in legacy mode the Node may
//!   hold its own key per adapter instance ([`NodeOptions::with_local_key`], `[[credentials]]`
//!   in the config file), written in the header the instance's protocol profile declares
//!   (`Authorization: Bearer`, `x-api-key` for Anthropic) on every request and health probe.
//!   Both go through `iop_lease::HeaderSpec::inject`; neither ever reaches the Edge, a log line
//!   or a metric, and a Node refuses to hold both.
//!
//! # Several Edges
//!
//! A Node may serve several Edges at once ([`NodeOptions::with_edge`]; `[[edges]]` in the
//! config file, where the single `[edge]` stays valid). Each Edge gets a session of its own
//! that follows seed 000 on its own: its own registration, generation, config, ready state,
//! supervisor, backoff and jitter, so an Edge that dies costs the Node nothing but that
//! session (it is dialled again under its own policy, and a budget that runs out while
//! another Edge is served starts over after its interval). What the sessions share:
//!
//! - **the capacity gates**, one per adapter instance name ([`CapacityGate`]): two Edges
//!   admitting at once cannot push an adapter past its capacity. A run or tunnel over it is
//!   refused with [`iop_wire::runtime::REFUSED_CAPACITY_EXHAUSTED`], and the Edge sends the
//!   request again (to another candidate, or after a pause) instead of failing it;
//! - **the adapters**: a session whose Edge sends an instance config equal to one another
//!   session already runs uses that adapter (and its pool of provider connections);
//! - **the credential plane**: the recipient key, the issuer pins and the replay guard.
//!
//! Two Edges may send different payloads for the same Node: each session runs the instances
//! its own Edge configured (one instance set per Edge; a config refresh from one Edge changes
//! what that Edge's session runs and nothing else). Instances of the same name share the
//! gate, which admits up to the **smallest** capacity any live instance of that name was
//! given: no Edge's view of the backend is exceeded.
//!
//! [`run_node`] dials every Edge over TCP; [`run_node_dialing`] does the same over
//! connections the caller opens (`tests/tests/mesh_scale_sim.rs` runs hundreds of such Nodes,
//! each on two Edges, on `turmoil`'s network). Each Edge's pool believes it has the Node's
//! whole capacity, so near saturation the Edges together send more than the gate admits and
//! the Node refuses the excess; `docs/capacity.md` measures that and says how to size the
//! Edges' provider capacities to avoid it.
//!
//! # Embedding: [`Node`]
//!
//! [`Node::start`] runs the supervisor on a task of its own; [`Node::run_until`] is what a
//! service's `main` does, [`Node::stop`] ends it. Your own model goes behind the [`Adapter`]
//! trait: every type it names is re-exported here ([`RunRequest`], [`ProviderTunnelRequest`],
//! [`ProviderStatus`], [`Usage`], [`AdapterConfig`], ... and [`async_trait`](macro@async_trait)), its factory
//! returns an [`AdapterBuildError`], and its contract is in the `Adapter` docs: content only
//! (the Node sends `START` and the one terminal), cancellation by drop, the stall fence through
//! [`RunEvents::cancelled`], capacity enforced by the Node's gate. The repository's
//! `examples/custom_adapter_node.rs` is a complete program.
//!
//! ```no_run
//! # async fn example(tls: std::sync::Arc<rustls::ClientConfig>) {
//! use iop_node::{AdapterRegistry, Node, NodeOptions};
//!
//! let opts = NodeOptions::new("node-1", "edge.internal:7443", "edge.internal", tls)
//!     .expect("valid options")
//!     .with_adapters(AdapterRegistry::with_builtins());
//! let exit = Node::start(opts)
//!     .run_until(async { let _ = tokio::signal::ctrl_c().await; })
//!     .await;
//! std::process::exit(exit.exit_code());
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod adapter;
pub mod config;
pub mod credential;
mod credit;
mod demo;
mod exec;
mod node;
pub mod ollama;
pub mod openai;
mod provider_http;
mod session;

use std::sync::Arc;
use std::time::Duration;

pub use adapter::{
    Adapter, AdapterBuildError, AdapterError, AdapterFactory, AdapterRegistry, CapacityGate,
    MAX_FRAME_PAYLOAD, RunCompletion, RunEvents, STREAM_BUFFER, TunnelSink, last_message_text,
    trace_headers,
};
/// The attribute [`Adapter`] implementations are written with.
pub use async_trait::async_trait;
pub use demo::DemoAdapter;
pub use exec::{DEFAULT_CLOSE_GRACE, RESPONSE_STALLED};
use iop_wire::codec::DEFAULT_MAX_FRAME_LEN;
use iop_wire::node::{CloseReason, NodeSessionConfig};
use iop_wire::reconnect::{Action, Failure, Supervisor};
pub use iop_wire::reconnect::{Exit, ReconnectPolicy};
use iop_wire::runtime::RecipientKey;
/// The wire types an [`Adapter`] reads and writes, re-exported so an adapter needs no direct
/// dependency on `iop-wire`.
pub use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, Header, NativeSettings, ProviderStatus, ProviderTunnelRequest,
    RunRequest, TunnelPayload, Usage,
};
pub use node::Node;
pub use ollama::OllamaAdapter;
pub use openai::OpenAiCompatAdapter;
use rustls_pki_types::ServerName;
pub use session::PROBE_TIMEOUT;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

/// Another Edge a Node serves besides its first ([`NodeOptions::with_edge`]).
#[derive(Clone)]
pub struct EdgeTarget {
    /// The Edge's `host:port`.
    pub address: String,
    /// The TLS server name to verify its certificate against (DNS or IP SAN).
    pub server_name: ServerName<'static>,
    /// The TLS client configuration for it: the Node's identity and the verifier of this
    /// Edge's role/name.
    pub tls: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for EdgeTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeTarget")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// Everything a Node needs to run.
#[derive(Clone)]
pub struct NodeOptions {
    /// The Node id; must equal the name in the Node's workload certificate.
    pub node_id: String,
    /// The (first) Edge's `host:port`.
    pub edge_address: String,
    /// The TLS server name to verify the Edge certificate against (DNS or IP SAN).
    pub server_name: ServerName<'static>,
    /// The TLS client configuration: the Node's identity and the verifier of the Edge's
    /// role/name (build it with `workload_identity`).
    pub tls: Arc<rustls::ClientConfig>,
    /// More Edges to serve at once, each in a session of its own ([`NodeOptions::with_edge`]).
    pub more_edges: Vec<EdgeTarget>,
    /// Initial dial and reconnect policy.
    pub reconnect: ReconnectPolicy,
    /// Heartbeat and handshake timeouts. Its `max_frame_len` is ignored: the session takes
    /// [`NodeOptions::max_frame_len`], the one limit of this Node's codec.
    pub session: NodeSessionConfig,
    /// Adapter types this Node can run.
    pub adapters: AdapterRegistry,
    /// Largest frame accepted or sent. A run's start or terminal larger than this (or one the
    /// Edge's validation would refuse) is replaced by an `ERROR` of its stream, never sent to
    /// fail the connection ([`iop_wire::node::NodeSession::send`]).
    pub max_frame_len: usize,
    /// The lease recipient key announced at registration, if any.
    pub recipient: Option<RecipientKey>,
    /// Managed mode (`credential_plane.enabled`): every provider tunnel must carry a lease this
    /// plane can open ([`credential`]). Set with [`NodeOptions::with_credential_plane`].
    pub credentials: Option<Arc<credential::CredentialPlane>>,
    /// Legacy mode: upstream keys the Node holds itself, by adapter instance name
    /// ([`credential::LocalKey`]). Set with [`NodeOptions::with_local_key`]; refused together
    /// with the credential plane.
    pub local_keys: std::collections::HashMap<String, credential::LocalKey>,
    /// Limit on TCP connect plus TLS handshake.
    pub connect_timeout: Duration,
    /// `None` (the default): reconnect jitter from the OS. `Some(seed)`: a sequence from the
    /// seed, so that a simulated run replays exactly (`tests/tests/mesh_sim.rs`).
    pub jitter_seed: Option<u64>,
    /// After a response stall, how long the aborted provider call may take to return before
    /// the terminal reports an unconfirmed fence.
    pub close_grace: Duration,
    /// Where the Node's spans go ([`iop_telemetry`]): each run or tunnel is an `execute` span,
    /// a child of the Edge's dispatch attempt, and its provider call a child of that. Off by
    /// default (the Edge's context is then still passed on to the provider).
    pub telemetry: iop_telemetry::Telemetry,
}

impl std::fmt::Debug for NodeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeOptions")
            .field("node_id", &self.node_id)
            .field("edge_address", &self.edge_address)
            .field("more_edges", &self.more_edges)
            .field("reconnect", &self.reconnect)
            .field("adapters", &self.adapters)
            .finish_non_exhaustive()
    }
}

/// A Node option was invalid; the message names the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OptionsError {
    /// `node_id` is empty or not a valid identifier.
    #[error("node_id: must be 1-128 characters of A-Z a-z 0-9 . _ -")]
    NodeId,
    /// `edge.server_name` is not a DNS name or IP address.
    #[error("edge.server_name: not a valid DNS name or IP address")]
    ServerName,
}

impl NodeOptions {
    /// Options with defaults: reconnect policy per seed 000 (10 attempts, 10 s), default
    /// heartbeat, no adapters (add some with [`NodeOptions::with_adapters`]).
    pub fn new(
        node_id: &str,
        edge_address: &str,
        server_name: &str,
        tls: Arc<rustls::ClientConfig>,
    ) -> Result<Self, OptionsError> {
        let valid_id = !node_id.is_empty()
            && node_id.len() <= 128
            && node_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            && node_id != "."
            && node_id != "..";
        if !valid_id {
            return Err(OptionsError::NodeId);
        }
        let server_name =
            ServerName::try_from(server_name.to_owned()).map_err(|_| OptionsError::ServerName)?;
        Ok(Self {
            node_id: node_id.to_owned(),
            edge_address: edge_address.to_owned(),
            server_name,
            tls,
            more_edges: Vec::new(),
            reconnect: ReconnectPolicy::default(),
            session: NodeSessionConfig::default(),
            adapters: AdapterRegistry::new(),
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            recipient: None,
            credentials: None,
            local_keys: std::collections::HashMap::new(),
            connect_timeout: Duration::from_secs(10),
            jitter_seed: None,
            close_grace: DEFAULT_CLOSE_GRACE,
            telemetry: iop_telemetry::Telemetry::off(),
        })
    }

    /// Sets where the Node's spans go.
    #[must_use]
    pub fn with_telemetry(mut self, telemetry: iop_telemetry::Telemetry) -> Self {
        self.telemetry = telemetry;
        self
    }

    /// Sets the adapter registry.
    pub fn with_adapters(mut self, adapters: AdapterRegistry) -> Self {
        self.adapters = adapters;
        self
    }

    /// Managed mode: announce `recipient`'s public key at registration and require an
    /// openable lease on every provider tunnel.
    pub fn with_credential_plane(mut self, recipient: iop_lease::Recipient) -> Self {
        let plane = credential::CredentialPlane::new(recipient);
        self.recipient = Some(plane.public_key().to_registration());
        self.credentials = Some(Arc::new(plane));
        self
    }

    /// Legacy mode: the Node's own upstream key for adapter instance `adapter` (the instance
    /// name in the Edge's config), written into the header the instance's protocol profile
    /// declares (or the key's own override) on every provider request and health probe.
    pub fn with_local_key(mut self, adapter: &str, key: credential::LocalKey) -> Self {
        self.local_keys.insert(adapter.to_owned(), key);
        self
    }

    /// Serves one more Edge, at `address`, verified as `server_name` by `tls` (its expected
    /// peer is that Edge): the Node keeps one session per Edge, each registering, getting its
    /// own generation and config, and reconnecting under its own supervisor (see the crate
    /// docs: [several Edges](crate#several-edges)).
    pub fn with_edge(
        mut self,
        address: &str,
        server_name: &str,
        tls: Arc<rustls::ClientConfig>,
    ) -> Result<Self, OptionsError> {
        let server_name =
            ServerName::try_from(server_name.to_owned()).map_err(|_| OptionsError::ServerName)?;
        self.more_edges.push(EdgeTarget {
            address: address.to_owned(),
            server_name,
            tls,
        });
        Ok(self)
    }

    /// Every Edge this Node serves, the first one first.
    pub fn edges(&self) -> Vec<EdgeTarget> {
        let first = EdgeTarget {
            address: self.edge_address.clone(),
            server_name: self.server_name.clone(),
            tls: self.tls.clone(),
        };
        std::iter::once(first)
            .chain(self.more_edges.iter().cloned())
            .collect()
    }

    /// Sets the reconnect policy.
    pub fn with_reconnect(mut self, reconnect: ReconnectPolicy) -> Self {
        self.reconnect = reconnect;
        self
    }
}

/// Opens the TCP connection to the Edge's address (the default dialer of [`run_node`]).
async fn dial_tcp(address: String) -> std::io::Result<TcpStream> {
    let tcp = TcpStream::connect(&address).await?;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// Where reconnect jitter comes from: the OS, or a seeded sequence (simulations replay a run
/// by its seed).
struct Jitter(Option<iop_wire::backoff::SplitMix64>);

impl Jitter {
    fn next(&mut self) -> u32 {
        match &mut self.0 {
            // Jitter only spreads a fleet's reconnects; without OS randomness, no jitter.
            None => getrandom::u32().unwrap_or(0),
            Some(rng) => rng.next_u32(),
        }
    }
}

/// Runs the Node until `shutdown` is cancelled, the reconnect budget is exhausted, or a fatal
/// local error. Returns the outcome; [`Exit::exit_code`] maps it to a process exit code.
///
/// With several Edges ([`NodeOptions::with_edge`]) each has its own supervisor, and the Node
/// runs until `shutdown`, a fatal local error, or until every Edge's budget is exhausted at
/// once: an Edge whose budget runs out while another session lives is dialled again after
/// its reconnect interval, with a fresh budget (the Node is still serving, and that Edge may
/// come back).
pub async fn run_node(opts: NodeOptions, shutdown: CancellationToken) -> Exit {
    if opts.more_edges.is_empty() {
        let address = opts.edge_address.clone();
        return run_node_with(opts, shutdown, move || dial_tcp(address.clone())).await;
    }
    run_node_dialing(opts, shutdown, |address: &str| dial_tcp(address.to_owned())).await
}

/// [`run_node`] with every Edge ([`NodeOptions::edges`]) over connections `dial` opens: each
/// attempt to an Edge calls `dial` with that Edge's address for a byte stream, then does the
/// TLS handshake with that Edge's TLS configuration. One supervisor per Edge, sharing the
/// Node's capacity gates and adapters, as [`run_node`] runs them (the deterministic simulation
/// in `tests/tests/mesh_scale_sim.rs` runs many such Nodes on `turmoil`'s network).
/// [`NodeOptions::jitter_seed`] seeds each Edge's jitter (the seed plus the Edge's index).
pub async fn run_node_dialing<D, F, S>(
    opts: NodeOptions,
    shutdown: CancellationToken,
    dial: D,
) -> Exit
where
    D: Fn(&str) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = std::io::Result<S>> + Send + 'static,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    if opts.credentials.is_some() && !opts.local_keys.is_empty() {
        tracing::error!(
            target: "iop_node",
            "local upstream keys are not allowed with the credential plane enabled"
        );
        return Exit::Fatal;
    }
    let gates = Arc::new(adapter::Gates::default());
    let targets = opts.edges();
    let count = targets.len();
    // Supervisors not exhausted now; the one that brings it to zero ends the Node.
    let alive = Arc::new(std::sync::atomic::AtomicUsize::new(count));
    let all_down = shutdown.child_token();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, target) in targets.into_iter().enumerate() {
        let mut o = opts.clone();
        o.edge_address = target.address;
        o.server_name = target.server_name;
        o.tls = target.tls;
        o.more_edges = Vec::new();
        o.jitter_seed = o.jitter_seed.map(|s| s.wrapping_add(i as u64));
        let (gates, alive, all_down) = (gates.clone(), alive.clone(), all_down.clone());
        let dial_edge = dial.clone();
        tasks.spawn(async move {
            use std::sync::atomic::Ordering;
            let address = o.edge_address.clone();
            loop {
                let dial = {
                    let (address, dial_edge) = (address.clone(), dial_edge.clone());
                    move || dial_edge(&address)
                };
                let exit = supervise(&o, &gates, all_down.clone(), dial).await;
                if !matches!(exit, Exit::Exhausted { .. }) {
                    all_down.cancel();
                    return exit;
                }
                if alive.fetch_sub(1, Ordering::AcqRel) == 1 {
                    tracing::warn!(target: "iop_node", edge = %address, "every Edge's reconnect budget is exhausted");
                    all_down.cancel();
                    return exit;
                }
                tracing::warn!(target: "iop_node", edge = %address, "reconnect budget exhausted while other Edges are served; trying again after the interval");
                tokio::select! {
                    () = all_down.cancelled() => return exit,
                    () = tokio::time::sleep(o.reconnect.interval()) => {}
                }
                alive.fetch_add(1, Ordering::AcqRel);
            }
        });
    }
    let mut exits = Vec::with_capacity(count);
    while let Some(r) = tasks.join_next().await {
        exits.push(r.unwrap_or(Exit::Fatal));
    }
    if shutdown.is_cancelled() {
        Exit::Shutdown
    } else if exits.contains(&Exit::Fatal) {
        Exit::Fatal
    } else {
        exits
            .into_iter()
            .find(|e| matches!(e, Exit::Exhausted { .. }))
            .unwrap_or(Exit::Fatal)
    }
}

/// [`run_node`] over connections `dial` opens (another transport, a simulated network): each
/// attempt calls it for a byte stream to the Edge, then does the TLS handshake with
/// `opts.tls` and runs the session on it, under the same supervisor. `edge_address` and
/// [`NodeOptions::more_edges`] are not used (one Edge). [`NodeOptions::jitter_seed`] makes
/// the reconnect jitter a seeded sequence.
pub async fn run_node_with<D, F, S>(opts: NodeOptions, shutdown: CancellationToken, dial: D) -> Exit
where
    D: Fn() -> F,
    F: Future<Output = std::io::Result<S>>,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send,
{
    if opts.credentials.is_some() && !opts.local_keys.is_empty() {
        // One source of truth: a managed Node takes credentials only from leases.
        tracing::error!(
            target: "iop_node",
            "local upstream keys are not allowed with the credential plane enabled"
        );
        return Exit::Fatal;
    }
    supervise(&opts, &adapter::Gates::default(), shutdown, dial).await
}

/// One Edge's supervisor: dials, runs sessions and reconnects under `opts.reconnect` until
/// `shutdown`, exhaustion or a fatal error. `gates` are the Node's, shared by all its Edges.
async fn supervise<D, F, S>(
    opts: &NodeOptions,
    gates: &adapter::Gates,
    shutdown: CancellationToken,
    dial: D,
) -> Exit
where
    D: Fn() -> F,
    F: Future<Output = std::io::Result<S>>,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send,
{
    let mut jitter = Jitter(opts.jitter_seed.map(iop_wire::backoff::SplitMix64));
    let tls = TlsConnector::from(opts.tls.clone());
    let connect = || {
        let tcp = dial();
        let tls = tls.clone();
        let name = opts.server_name.clone();
        async move { tls.connect(name, tcp.await?).await }
    };
    let mut supervisor = Supervisor::new(opts.reconnect);
    loop {
        match supervisor.poll_action() {
            Some(Action::Dial { attempt }) => {
                let now = tokio::time::Instant::now().into_std();
                let dialed = tokio::select! {
                    () = shutdown.cancelled() => {
                        supervisor.handle_shutdown();
                        continue;
                    }
                    r = tokio::time::timeout(opts.connect_timeout, connect()) => r,
                };
                match dialed {
                    Ok(Ok(stream)) => {
                        tracing::debug!(attempt, "connected to edge");
                        let outcome = session::run_session(stream, opts, gates, &shutdown).await;
                        if outcome.reached_ready {
                            supervisor.handle_ready();
                        }
                        let now = tokio::time::Instant::now().into_std();
                        if outcome.reason == CloseReason::Local {
                            supervisor.handle_shutdown();
                        } else {
                            tracing::info!(reason = ?outcome.reason, "session ended; reconnecting under policy");
                            supervisor.handle_failure(now, Failure::Retryable, jitter.next());
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::info!(attempt, error = %e, "dial failed");
                        supervisor.handle_failure(now, Failure::Retryable, jitter.next());
                    }
                    Err(_) => {
                        tracing::info!(attempt, "dial timed out");
                        supervisor.handle_failure(now, Failure::Retryable, jitter.next());
                    }
                }
            }
            Some(Action::Exit(exit)) => return exit,
            None => {
                let Some(at) = supervisor.poll_timeout() else {
                    // No action and no timer: only possible once finished.
                    return supervisor.exit().unwrap_or(Exit::Fatal);
                };
                tokio::select! {
                    () = shutdown.cancelled() => supervisor.handle_shutdown(),
                    () = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {
                        supervisor.handle_timeout(tokio::time::Instant::now().into_std());
                    }
                }
            }
        }
    }
}
