//! The `Adapter` trait embedders implement, the per-instance capacity gate, and the registry
//! that builds adapter instances from the Edge's `NodeConfigPayload`.
//!
//! An adapter only produces content: for a normalized run it sends `DELTA` text through
//! [`RunEvents`] and returns a [`RunCompletion`] or an error. The session driver owns the
//! stream's framing: it sends `START` before calling the adapter and exactly one terminal
//! (`COMPLETE`, `ERROR` or `CANCELLED`) after it, so an adapter cannot break the
//! one-terminal rule. Cancellation is by drop: when a caller cancels, the deadline passes or
//! the session ends, the driver drops the adapter's future, which aborts any upstream I/O it
//! owns.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use iop_wire::runtime::{
    AdapterConfig, Header, ProviderStatus, ProviderTunnelRequest, RunRequest, TunnelPayload, Usage,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::credential::{LocalKey, UpstreamCredential};

/// Why an adapter run failed. The text goes on the wire as the legacy error string, so it must
/// be stable and low-sensitivity (no credentials, no upstream bodies).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterError {
    /// The adapter does not support this kind of request (e.g. a tunnel on a native adapter).
    #[error("operation not supported by this adapter")]
    Unsupported,
    /// The target is not served by this instance.
    #[error("unknown target")]
    UnknownTarget,
    /// The request input could not be interpreted.
    #[error("invalid input: {0}")]
    InvalidInput(&'static str),
    /// The provider failed; the text is a stable classification.
    #[error("provider error: {0}")]
    Provider(String),
}

/// The text a normalized run asks about: the `content` of the last message of a
/// `{"messages": [...]}` input (what the Edge sends for chat, Responses and Messages requests to
/// a native adapter), or the whole input when it is plain text. For adapters that answer the
/// last message.
pub fn last_message_text(input: &[u8]) -> Result<String, AdapterError> {
    let raw =
        std::str::from_utf8(input).map_err(|_| AdapterError::InvalidInput("input is not UTF-8"))?;
    let last = serde_json::from_str::<serde_json::Value>(raw)
        .ok()
        .and_then(|v| {
            v["messages"].as_array()?.last()?["content"]
                .as_str()
                .map(str::to_owned)
        });
    Ok(last.unwrap_or_else(|| raw.to_owned()))
}

/// How a normalized run ended successfully.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunCompletion {
    /// Metadata for the `COMPLETE` event (e.g. `openai_tool_calls`).
    pub metadata: BTreeMap<String, String>,
    /// Usage observation.
    pub usage: Option<Usage>,
}

/// Bytes one run or tunnel may hold between its adapter and the connection writer. An adapter
/// that produces faster than the connection drains waits (and with it the provider read), so a
/// stream never buffers more than this at the Node.
pub const STREAM_BUFFER: usize = 1024 * 1024;

/// The most text one frame carries, and the most body bytes when the Edge gives no credit (with
/// credit, the window bounds a frame). A longer delta or body is sent as several frames (text
/// cut on character boundaries), so that no single event can exceed the Edge's
/// per-stream buffer (`stream_buffer_bytes`, 4 MiB by default, which would end the stream as
/// if its reader had fallen behind) or the wire's frame limit (8 MiB by default). A client
/// sees the same text and bytes, in more pieces.
pub const MAX_FRAME_PAYLOAD: usize = 64 * 1024;

/// The most body bytes one frame carries when the Edge gives the tunnel credit: the window
/// bounds a frame below the Edge's stream buffer, and this bounds it below the wire's frame
/// limit whatever window an Edge opens; frames this large keep the bulk path's per-frame work
/// down.
const MAX_CREDITED_FRAME_PAYLOAD: usize = 1024 * 1024;

use iop_wire::validate::floor_char_boundary;

/// A payload in a stream's buffer with its share of the stream's byte budget (released when
/// the payload moves on to the connection writer).
pub(crate) type Budgeted<T> = (T, Option<OwnedSemaphorePermit>);

/// What a [`TunnelSink`] hands the tunnel's task: the part of
/// [`TunnelPayload`] an adapter sends (the task sends the terminal itself). Its own type, not
/// `TunnelPayload`: that one is 160 bytes for its `Error` variant's failure report, and every
/// tunnel's channel allocates a block of 32 slots when it is made (5.6 KiB of every
/// in-flight request, against 1.8 KiB with this 40-byte type).
#[derive(Debug)]
pub(crate) enum Piece {
    /// The provider's status and headers.
    Start {
        /// HTTP status.
        status: u16,
        /// Response headers.
        headers: Vec<Header>,
    },
    /// Body bytes.
    Body(Bytes),
    /// A usage observation.
    Usage(Usage),
}

impl From<Piece> for TunnelPayload {
    fn from(piece: Piece) -> Self {
        match piece {
            Piece::Start { status, headers } => Self::ResponseStart { status, headers },
            Piece::Body(b) => Self::Body(b),
            Piece::Usage(u) => Self::Usage(u),
        }
    }
}

/// The byte budget of one stream.
pub(crate) fn stream_budget() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(STREAM_BUFFER))
}

/// Waits for `len` bytes of `budget` (at most the whole budget, so an oversized item passes
/// alone). `None` if the budget is closed.
async fn reserve(budget: &Arc<Semaphore>, len: usize) -> Option<OwnedSemaphorePermit> {
    let n = u32::try_from(len.min(STREAM_BUFFER)).unwrap_or(u32::MAX);
    budget.clone().acquire_many_owned(n).await.ok()
}

/// Where an adapter sends the text deltas of a run. Sending after the run ended (or after the
/// session closed) is a no-op that returns `false`.
///
/// [`RunEvents::cancelled`] resolves when the driver fences the attempt after a response stall:
/// an adapter should then stop and return promptly. (Caller cancels, deadlines and disconnects
/// drop the adapter's future instead.)
#[derive(Clone, Debug)]
pub struct RunEvents {
    tx: mpsc::Sender<Budgeted<String>>,
    budget: Arc<Semaphore>,
    fence: CancellationToken,
}

impl RunEvents {
    pub(crate) fn new(
        tx: mpsc::Sender<Budgeted<String>>,
        budget: Arc<Semaphore>,
        fence: CancellationToken,
    ) -> Self {
        Self { tx, budget, fence }
    }

    /// Resolves once the attempt is fenced.
    pub async fn cancelled(&self) {
        self.fence.cancelled().await;
    }

    /// Whether the attempt is fenced.
    pub fn is_cancelled(&self) -> bool {
        self.fence.is_cancelled()
    }

    /// Sends one text delta; waits when the connection is congested or this run already holds
    /// [`STREAM_BUFFER`] bytes (backpressure).
    ///
    /// A delta longer than [`MAX_FRAME_PAYLOAD`] goes out as several, cut on character
    /// boundaries.
    pub async fn delta(&self, text: impl Into<String>) -> bool {
        let text = text.into();
        if text.len() <= MAX_FRAME_PAYLOAD {
            return self.send_delta(text).await;
        }
        // Each piece in a string of its own size: a piece that kept the whole text's
        // allocation would hold it once per piece in flight.
        let mut rest = &text[..];
        while !rest.is_empty() {
            let (piece, after) = rest.split_at(floor_char_boundary(rest, MAX_FRAME_PAYLOAD));
            if !self.send_delta(piece.to_owned()).await {
                return false;
            }
            rest = after;
        }
        true
    }

    async fn send_delta(&self, text: String) -> bool {
        let permit = reserve(&self.budget, text.len()).await;
        self.tx.send((text, permit)).await.is_ok()
    }
}

/// Where an adapter sends a tunnelled provider response. The driver numbers the frames and
/// sends the single terminal (END when the adapter returns `Ok`, ERROR otherwise), so the
/// adapter sends only the response start, body bytes and usage observations. Each method
/// returns `false` once the tunnel is gone (cancelled or disconnected).
///
/// [`TunnelSink::cancelled`] resolves when the driver fences the attempt after a response
/// stall, as for [`RunEvents::cancelled`].
#[derive(Clone)]
pub struct TunnelSink {
    tx: mpsc::Sender<Budgeted<Piece>>,
    budget: Arc<Semaphore>,
    fence: CancellationToken,
    credential: Arc<Mutex<Option<Injection>>>,
    /// The Edge's per-stream credit, when it opened the tunnel with a window.
    credit: Option<Arc<crate::credit::Credit>>,
}

/// The credential a tunnel's provider request carries: a lease opened for this dispatch
/// (managed mode) or the key the Node holds for the instance (legacy mode). Both are written by
/// `iop_lease::HeaderSpec::inject`.
pub(crate) enum Injection {
    /// An opened lease (zeroized once written).
    Lease(iop_lease::OpenedCredential),
    /// The Node's own key for the instance.
    Local(UpstreamCredential),
}

impl std::fmt::Debug for TunnelSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelSink").finish_non_exhaustive()
    }
}

impl TunnelSink {
    pub(crate) fn new(
        tx: mpsc::Sender<Budgeted<Piece>>,
        budget: Arc<Semaphore>,
        fence: CancellationToken,
        credential: Option<Injection>,
        credit: Option<Arc<crate::credit::Credit>>,
    ) -> Self {
        Self {
            tx,
            budget,
            fence,
            credential: Arc::new(Mutex::new(credential)),
            credit,
        }
    }

    /// Writes the tunnel's credential into `headers` — the opened lease (managed mode; its
    /// plaintext is zeroized) or the Node's own key for the instance (legacy mode) — exactly in
    /// its declared header, replacing a caller's value. Call it right before sending the
    /// upstream request. Returns whether there was a credential (only once).
    pub fn inject_credential(&self, headers: &mut http::HeaderMap) -> bool {
        let taken = self
            .credential
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        match taken {
            Some(Injection::Lease(c)) => {
                c.inject(headers);
                true
            }
            Some(Injection::Local(c)) => {
                c.inject(headers);
                true
            }
            None => false,
        }
    }

    /// Resolves once the attempt is fenced.
    pub async fn cancelled(&self) {
        self.fence.cancelled().await;
    }

    /// The provider's status and headers (send it first, once).
    pub async fn start(&self, status: u16, headers: Vec<Header>) -> bool {
        self.tx
            .send((Piece::Start { status, headers }, None))
            .await
            .is_ok()
    }

    /// Body bytes exactly as the provider sent them; waits while this tunnel already holds
    /// [`STREAM_BUFFER`] bytes on their way to the Edge, and, when the Edge gives the tunnel
    /// credit, while the Edge's reader is a window behind (the bytes may then go out as
    /// several frames). An adapter that awaits this before reading more from its provider is
    /// paced by the reader at the other end. Without credit, bytes beyond
    /// [`MAX_FRAME_PAYLOAD`] go out as several frames (views of the same buffer, not copies);
    /// with credit, a frame carries at most the window the Edge opened (which it sized to half
    /// its stream buffer at most) and at most 1 MiB.
    pub async fn body(&self, mut bytes: Bytes) -> bool {
        loop {
            let chunk = match &self.credit {
                None if bytes.len() <= MAX_FRAME_PAYLOAD => std::mem::take(&mut bytes),
                None => bytes.split_to(MAX_FRAME_PAYLOAD),
                Some(credit) => {
                    let n = credit
                        .take(bytes.len().min(MAX_CREDITED_FRAME_PAYLOAD))
                        .await;
                    if n >= bytes.len() {
                        std::mem::take(&mut bytes)
                    } else {
                        bytes.split_to(n)
                    }
                }
            };
            let permit = reserve(&self.budget, chunk.len()).await;
            if self.tx.send((Piece::Body(chunk), permit)).await.is_err() {
                return false;
            }
            if bytes.is_empty() {
                return true;
            }
        }
    }

    /// A usage observation (never merged into the body).
    pub async fn usage(&self, usage: Usage) -> bool {
        self.tx.send((Piece::Usage(usage), None)).await.is_ok()
    }
}

/// A provider adapter instance. Implement it to plug your own backend into a Node, register a
/// factory for it with [`AdapterRegistry::register`], and name its type in the Edge's
/// `[[nodes.adapters]]`.
///
/// The contract:
///
/// - **Content only.** [`Adapter::run`] sends text through [`RunEvents`] and returns a
///   [`RunCompletion`] or an [`AdapterError`] (its text goes on the wire: keep it stable and
///   free of secrets); the Node sends `START` before and exactly one terminal after. A tunnel
///   sends the response start, body and usage through [`TunnelSink`]; the Node numbers the
///   frames and sends END or ERROR.
/// - **Cancellation is by drop.** A caller's cancel, the run's deadline and a lost connection
///   drop the future: hold nothing that must be released by hand.
/// - **Stalls.** When the provider is silent past the run's stall timeout, the Node fences the
///   attempt: [`RunEvents::cancelled`] (or [`TunnelSink::cancelled`]) resolves and the adapter
///   should return promptly; until it does, the Node keeps its capacity permit.
/// - **Capacity.** The Node admits at most the instance's configured `capacity` at once
///   ([`CapacityGate`], behind the Edge's own leases): no limit of your own is needed.
/// - **Backpressure.** Sending waits while the stream holds [`STREAM_BUFFER`] bytes.
/// - **Probes.** [`Adapter::probe`] must answer within the driver's timeout; `Unknown` is
///   reported when it does not.
#[async_trait]
pub trait Adapter: Send + Sync + 'static {
    /// Runs one normalized execution, sending deltas through `events`.
    async fn run(
        &self,
        request: RunRequest,
        events: RunEvents,
    ) -> Result<RunCompletion, AdapterError>;

    /// Opens a provider HTTP request and streams its response through `frames` (OpenAI-style
    /// passthrough). Adapters without a raw HTTP surface keep the default, which refuses.
    async fn tunnel(
        &self,
        request: ProviderTunnelRequest,
        frames: TunnelSink,
    ) -> Result<(), AdapterError> {
        let _ = (request, frames);
        Err(AdapterError::Unsupported)
    }

    /// A bounded, fail-closed health probe of exactly `target` (CAPABILITIES and stall
    /// evidence). Must not take longer than the caller's timeout to be useful; the driver
    /// enforces that timeout and reports `Unknown` when it passes. `credential` is the key the
    /// Node holds for this instance (legacy mode), to write into the probe request; managed
    /// mode has no lease for probes.
    async fn probe(&self, target: &str, credential: Option<&UpstreamCredential>) -> ProviderStatus;
}

/// Why a factory could not build an adapter instance from its configuration. The text goes to
/// the Edge as the reason the Node's config was refused, so it must name the setting and never
/// carry a secret.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterBuildError {
    /// A setting is unusable; the message names it (for example `base_url must be http or
    /// https`).
    #[error("{0}")]
    InvalidSetting(String),
    /// The instance's settings are for another kind of adapter (OpenAI-compatible settings
    /// given to a native type, or the reverse).
    #[error("settings of another adapter kind")]
    WrongSettings,
}

impl From<String> for AdapterBuildError {
    fn from(message: String) -> Self {
        Self::InvalidSetting(message)
    }
}

/// Builds adapter instances of one type from their configuration (the Edge's
/// `[[nodes.adapters]]` entry for this Node, pushed at registration and on every refresh).
pub type AdapterFactory = Arc<
    dyn Fn(&AdapterConfig) -> Result<Arc<dyn Adapter>, AdapterBuildError> + Send + Sync + 'static,
>;

/// Adapter factories by type name (`"demo"`, `"ollama"`, `"openai_compat"`, or your own).
#[derive(Clone, Default)]
pub struct AdapterRegistry {
    factories: HashMap<String, AdapterFactory>,
}

impl std::fmt::Debug for AdapterRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut types: Vec<_> = self.factories.keys().collect();
        types.sort();
        f.debug_struct("AdapterRegistry")
            .field("types", &types)
            .finish()
    }
}

impl AdapterRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The built-in adapters: `demo`, `openai_compat` and `ollama`.
    pub fn with_builtins() -> Self {
        let mut r = Self::new();
        r.register(
            "demo",
            Arc::new(|c: &AdapterConfig| {
                Ok(Arc::new(crate::demo::DemoAdapter::from_config(c)) as Arc<dyn Adapter>)
            }),
        );
        r.register(
            crate::openai::ADAPTER_TYPE,
            Arc::new(|c: &AdapterConfig| {
                let adapter = crate::openai::OpenAiCompatAdapter::from_config(c)?;
                Ok(Arc::new(adapter) as Arc<dyn Adapter>)
            }),
        );
        r.register(
            crate::ollama::ADAPTER_TYPE,
            Arc::new(|c: &AdapterConfig| {
                let adapter = crate::ollama::OllamaAdapter::from_config(c)?;
                Ok(Arc::new(adapter) as Arc<dyn Adapter>)
            }),
        );
        r
    }

    /// Adds (or replaces) the factory for `adapter_type`.
    pub fn register(&mut self, adapter_type: &str, factory: AdapterFactory) {
        self.factories.insert(adapter_type.to_owned(), factory);
    }

    /// The adapter types this registry can build (what `RegisterRequest.adapter_types` says).
    pub fn types(&self) -> Vec<String> {
        let mut t: Vec<_> = self.factories.keys().cloned().collect();
        t.sort();
        t
    }

    /// Builds every enabled instance of `configs`, pairing each with the Node's own key for
    /// it, if any (with the header its protocol profile declares). Fails without side effects
    /// if any instance fails, so a bad refresh leaves the old set in force.
    pub(crate) fn build(
        &self,
        configs: &[AdapterConfig],
        keys: &HashMap<String, LocalKey>,
        gates: &Gates,
    ) -> Result<Instances, String> {
        let mut by_key = HashMap::new();
        for c in configs.iter().filter(|c| c.enabled) {
            let factory = self.factories.get(&c.adapter_type).ok_or_else(|| {
                format!(
                    "adapter type `{}` is not available on this node",
                    c.adapter_type
                )
            })?;
            // Another Edge's session built this instance from the same config: share it (and
            // with it the provider connections).
            let adapter = match gates.adapter(c) {
                Some(a) => a,
                None => {
                    let a =
                        factory(c).map_err(|e| format!("adapter `{}`: {e}", c.instance_key()))?;
                    gates.keep(c, &a);
                    a
                }
            };
            let credential = match keys.get(c.instance_key()) {
                None => None,
                Some(key) => {
                    let declared = match &c.settings {
                        iop_wire::runtime::AdapterSettings::OpenAiCompat(s) => {
                            s.protocol_profile.credential_header()
                        }
                        _ => ("authorization", "Bearer "),
                    };
                    Some(
                        key.for_profile(declared)
                            .map_err(|e| format!("adapter `{}`: {e}", c.instance_key()))?,
                    )
                }
            };
            let gate = gates.gate(c.instance_key());
            by_key.insert(
                c.instance_key().to_owned(),
                Arc::new(Instance {
                    trace: TraceAttrs::of(c),
                    config: c.clone(),
                    adapter,
                    declared: gate.declare(c.capacity),
                    gate,
                    credential,
                }),
            );
        }
        Ok(Instances { by_key })
    }
}

/// A running adapter instance with its gate.
pub(crate) struct Instance {
    pub(crate) config: AdapterConfig,
    pub(crate) adapter: Arc<dyn Adapter>,
    /// The Node's gate for this instance name, shared by every Edge session's instance of it.
    pub(crate) gate: Arc<CapacityGate>,
    /// This instance's capacity, counted in the gate's until the instance is dropped (after a
    /// refresh replaced it and its executions ended, or when its session ended).
    #[expect(dead_code, reason = "held for its drop")]
    declared: Declaration,
    /// The Node's own key for this instance (legacy mode).
    pub(crate) credential: Option<UpstreamCredential>,
    /// The span attributes every execution on it carries, made once.
    pub(crate) trace: TraceAttrs,
}

/// An instance's span attributes, reference-counted (a span clones them for the cost of a
/// count): the adapter instance, the provider kind, and the upstream's host and port.
#[derive(Debug)]
pub(crate) struct TraceAttrs {
    pub(crate) adapter: iop_telemetry::KeyValue,
    pub(crate) provider: iop_telemetry::KeyValue,
    pub(crate) server: Vec<iop_telemetry::KeyValue>,
}

impl TraceAttrs {
    fn of(c: &AdapterConfig) -> Self {
        use iop_telemetry::{KeyValue, attr};
        let rc = |s: &str| -> Arc<str> { Arc::from(s) };
        let base = match &c.settings {
            iop_wire::runtime::AdapterSettings::OpenAiCompat(s) => Some(s.base_url.as_str()),
            iop_wire::runtime::AdapterSettings::Native(s) => Some(s.base_url.as_str()),
            _ => None,
        };
        let mut server = Vec::new();
        if let Some(uri) = base.and_then(|b| b.parse::<http::Uri>().ok())
            && let Some(host) = uri.host()
        {
            server.push(KeyValue::new("server.address", rc(host)));
            if let Some(port) = uri.port_u16() {
                server.push(attr::server_port(port));
            }
        }
        Self {
            adapter: KeyValue::new("iop.adapter", rc(c.instance_key())),
            provider: KeyValue::new("gen_ai.provider.name", rc(&c.adapter_type)),
            server,
        }
    }
}

/// The running set, keyed by instance identity.
#[derive(Default)]
pub(crate) struct Instances {
    pub(crate) by_key: HashMap<String, Arc<Instance>>,
}

impl Instances {
    /// Resolves a request's adapter field: an instance key, or empty for the legacy single
    /// instance (the only instance, when there is exactly one).
    pub(crate) fn resolve(&self, adapter: &str) -> Option<Arc<Instance>> {
        if adapter.is_empty() && self.by_key.len() == 1 {
            return self.by_key.values().next().cloned();
        }
        self.by_key.get(adapter).cloned()
    }
}

/// A per-adapter-instance capacity gate, shared by normalized runs and provider tunnels.
///
/// Defense in depth: the Edge's provider leases are the admission authority; this gate only
/// protects the backend from executions that bypassed the Edge queue, and from two Edges
/// whose leases do not see each other. A zero capacity admits nothing.
///
/// A Node keeps one gate per adapter instance name for all its Edge sessions (each session
/// builds its own instances from its own Edge's payload; see the crate docs). Each instance
/// declares the capacity its Edge gave it while it lives, and the gate admits up to the
/// **smallest** capacity declared: no Edge's view of the backend is exceeded, however many
/// Edges admit at once. A lowered capacity never cuts an execution already admitted: it
/// takes effect as executions end.
#[derive(Debug)]
pub struct CapacityGate {
    permits: Arc<Semaphore>,
    limits: Mutex<GateLimits>,
}

#[derive(Debug, Default)]
struct GateLimits {
    /// The capacity admitted up to now.
    capacity: u32,
    /// Permits to take out of the semaphore as executions return them (a lowered capacity
    /// with executions holding the permits).
    debt: usize,
    /// Capacities declared by live instances, by declaration.
    declared: BTreeMap<u64, u32>,
    next: u64,
}

impl CapacityGate {
    /// A gate admitting `capacity` concurrent executions.
    pub fn new(capacity: u32) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(capacity as usize)),
            limits: Mutex::new(GateLimits {
                capacity,
                ..GateLimits::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateLimits> {
        self.limits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits one execution now, or refuses (never waits: the Edge already queued).
    pub fn try_admit(&self) -> Option<OwnedSemaphorePermit> {
        let mut l = self.lock();
        if l.debt > 0 {
            l.debt -= self.permits.forget_permits(l.debt);
        }
        self.permits.clone().try_acquire_owned().ok()
    }

    /// Executions currently admitted.
    pub fn in_flight(&self) -> u32 {
        let l = self.lock();
        let total = (l.capacity as usize).saturating_add(l.debt);
        u32::try_from(total.saturating_sub(self.permits.available_permits())).unwrap_or(u32::MAX)
    }

    /// The capacity it admits up to.
    pub fn capacity(&self) -> u32 {
        self.lock().capacity
    }

    /// Counts `capacity` among the declared ones until the returned guard is dropped.
    fn declare(self: &Arc<Self>, capacity: u32) -> Declaration {
        let mut l = self.lock();
        let id = l.next;
        l.next += 1;
        l.declared.insert(id, capacity);
        self.settle(&mut l);
        Declaration {
            gate: Arc::clone(self),
            id,
        }
    }

    /// Moves the admitted capacity to the smallest declared one (unchanged when none is).
    fn settle(&self, l: &mut GateLimits) {
        let Some(&target) = l.declared.values().min() else {
            return;
        };
        if target > l.capacity {
            let mut more = (target - l.capacity) as usize;
            let repaid = more.min(l.debt);
            l.debt -= repaid;
            more -= repaid;
            self.permits.add_permits(more);
        } else if target < l.capacity {
            let less = (l.capacity - target) as usize;
            l.debt += less - self.permits.forget_permits(less);
        }
        l.capacity = target;
    }
}

/// A live instance's declared capacity ([`CapacityGate`]): removed when dropped.
#[derive(Debug)]
pub(crate) struct Declaration {
    gate: Arc<CapacityGate>,
    id: u64,
}

impl Drop for Declaration {
    fn drop(&mut self) {
        let mut l = self.gate.lock();
        l.declared.remove(&self.id);
        self.gate.settle(&mut l);
    }
}

/// An adapter built from a config, while an instance holds it.
type Built = (AdapterConfig, std::sync::Weak<dyn Adapter>);

/// What a Node's Edge sessions share (made once per run of the Node): the gates by adapter
/// instance name, and the adapters built, by instance name and config, so that two sessions
/// given the same config use one adapter (one pool of provider connections). Both live while
/// an instance holds them.
#[derive(Default)]
pub(crate) struct Gates {
    gates: Mutex<HashMap<String, std::sync::Weak<CapacityGate>>>,
    adapters: Mutex<HashMap<String, Built>>,
}

impl std::fmt::Debug for Gates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gates").finish_non_exhaustive()
    }
}

impl Gates {
    /// The live adapter built from exactly `config`, if a session holds one.
    fn adapter(&self, config: &AdapterConfig) -> Option<Arc<dyn Adapter>> {
        let adapters = self
            .adapters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (c, a) = adapters.get(config.instance_key())?;
        (c == config).then(|| a.upgrade()).flatten()
    }

    /// Remembers `adapter` as the one built from `config` (replacing another config's).
    fn keep(&self, config: &AdapterConfig, adapter: &Arc<dyn Adapter>) {
        let mut adapters = self
            .adapters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        adapters.retain(|_, (_, a)| a.strong_count() > 0);
        adapters.insert(
            config.instance_key().to_owned(),
            (config.clone(), Arc::downgrade(adapter)),
        );
    }

    /// The gate of instance name `name`, made (admitting nothing until an instance declares
    /// its capacity) if no live instance holds one.
    pub(crate) fn gate(&self, name: &str) -> Arc<CapacityGate> {
        let mut gates = self
            .gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(g) = gates.get(name).and_then(std::sync::Weak::upgrade) {
            return g;
        }
        gates.retain(|_, g| g.strong_count() > 0);
        let g = Arc::new(CapacityGate::new(0));
        gates.insert(name.to_owned(), Arc::downgrade(&g));
        g
    }
}

/// Writes `trace` into a provider request as W3C `traceparent` (and `tracestate`), unless the
/// Edge said this adapter must not get it (`to_provider`); a client's own header of that name
/// never reaches here (the Edge forwards none). Adapters that speak HTTP call this.
pub fn trace_headers(headers: &mut http::HeaderMap, trace: Option<&iop_wire::trace::TraceContext>) {
    let Some(t) = trace.filter(|t| t.to_provider) else {
        return;
    };
    if let Ok(v) = http::HeaderValue::from_str(&t.traceparent()) {
        headers.insert("traceparent", v);
    }
    if let Some(state) = &t.state
        && let Ok(v) = http::HeaderValue::from_str(state)
    {
        headers.insert("tracestate", v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_long_delta_goes_out_in_pieces_cut_on_characters() {
        let (tx, mut rx) = mpsc::channel(64);
        let events = RunEvents::new(tx, stream_budget(), CancellationToken::new());
        // Two-byte characters after one ASCII byte: no multiple of the limit is a boundary.
        let text = format!("a{}", "é".repeat(MAX_FRAME_PAYLOAD * 2));
        let sender = tokio::spawn({
            let text = text.clone();
            async move { events.delta(text).await }
        });
        let mut pieces = Vec::new();
        while let Some((piece, _permit)) = rx.recv().await {
            pieces.push(piece);
        }
        assert!(sender.await.unwrap());
        assert_eq!(pieces.len(), 5, "4 MAX_FRAME_PAYLOAD pieces and the rest");
        assert!(
            pieces
                .iter()
                .all(|p| !p.is_empty() && p.len() <= MAX_FRAME_PAYLOAD)
        );
        // Each piece holds an allocation of its own size, not the whole text's.
        assert!(pieces.iter().all(|p| p.capacity() <= MAX_FRAME_PAYLOAD));
        assert_eq!(pieces.concat(), text);
    }

    /// Every tunnel's channel allocates a block of 32 of these when it is made: what each
    /// in-flight request costs the Node before anything is sent (see [`Piece`]).
    #[test]
    fn a_tunnels_channel_slot_stays_small() {
        let size = size_of::<Budgeted<Piece>>();
        assert!(size <= 64, "a tunnel channel's slot is {size} bytes");
    }

    #[tokio::test]
    async fn a_long_body_goes_out_in_frames_of_at_most_the_limit() {
        let (tx, mut rx) = mpsc::channel(64);
        let sink = TunnelSink::new(tx, stream_budget(), CancellationToken::new(), None, None);
        let body = Bytes::from(vec![7u8; MAX_FRAME_PAYLOAD * 3 + 1]);
        let sender = tokio::spawn({
            let body = body.clone();
            async move { sink.body(body).await }
        });
        let mut sizes = Vec::new();
        let mut got = Vec::new();
        while let Some((payload, _permit)) = rx.recv().await {
            let Piece::Body(b) = payload else {
                panic!("only body frames")
            };
            sizes.push(b.len());
            got.extend_from_slice(&b);
        }
        assert!(sender.await.unwrap());
        assert_eq!(
            sizes,
            [MAX_FRAME_PAYLOAD, MAX_FRAME_PAYLOAD, MAX_FRAME_PAYLOAD, 1]
        );
        assert_eq!(got, body);
    }

    /// Two sessions' instances of one name share the gate at the smaller capacity; a lowered
    /// capacity cuts nothing admitted and takes effect as executions end; the last
    /// declaration gone, the name gets a fresh gate.
    #[test]
    fn a_shared_gate_admits_up_to_the_smallest_declared_capacity() {
        let gates = Gates::default();
        let g = gates.gate("openai");
        let a = g.declare(4);
        assert!(Arc::ptr_eq(&g, &gates.gate("openai")));
        let held: Vec<_> = (0..4).map(|_| g.try_admit().unwrap()).collect();
        assert!(g.try_admit().is_none(), "4 admitted");
        // A second Edge's instance declares 2: nothing admitted is cut.
        let b = g.declare(2);
        assert_eq!((g.capacity(), g.in_flight()), (2, 4));
        assert!(g.try_admit().is_none());
        let mut held = held.into_iter();
        drop(held.next());
        drop(held.next());
        assert_eq!(g.in_flight(), 2);
        assert!(
            g.try_admit().is_none(),
            "still at the smaller capacity (2 in flight)"
        );
        drop(held.next());
        assert_eq!(g.in_flight(), 1);
        let c = g.try_admit().unwrap();
        assert!(g.try_admit().is_none());
        // The smaller declaration gone: back to 4.
        drop(b);
        assert_eq!((g.capacity(), g.in_flight()), (4, 2));
        let more: Vec<_> = (0..2).map(|_| g.try_admit().unwrap()).collect();
        assert!(g.try_admit().is_none());
        assert_eq!(g.in_flight(), 4);
        drop((a, c, more, held));
        assert_eq!(g.in_flight(), 0);
        drop(g);
        let fresh = gates.gate("openai");
        assert_eq!(
            fresh.capacity(),
            0,
            "no instance holds it: a new gate admitting nothing"
        );
        assert!(fresh.try_admit().is_none());
    }

    #[test]
    fn gate_admits_up_to_capacity_and_releases_on_drop() {
        let g = CapacityGate::new(2);
        let a = g.try_admit().unwrap();
        let _b = g.try_admit().unwrap();
        assert!(g.try_admit().is_none());
        assert_eq!(g.in_flight(), 2);
        drop(a);
        assert_eq!(g.in_flight(), 1);
        assert!(g.try_admit().is_some());
        assert!(CapacityGate::new(0).try_admit().is_none());
    }
}
