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
use std::sync::Arc;

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

/// A payload in a stream's buffer with its share of the stream's byte budget (released when
/// the payload moves on to the connection writer).
pub(crate) type Budgeted<T> = (T, Option<OwnedSemaphorePermit>);

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
    pub async fn delta(&self, text: impl Into<String>) -> bool {
        let text = text.into();
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
    tx: mpsc::Sender<Budgeted<TunnelPayload>>,
    budget: Arc<Semaphore>,
    fence: CancellationToken,
    credential: Arc<std::sync::Mutex<Option<Injection>>>,
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
        tx: mpsc::Sender<Budgeted<TunnelPayload>>,
        budget: Arc<Semaphore>,
        fence: CancellationToken,
        credential: Option<Injection>,
    ) -> Self {
        Self {
            tx,
            budget,
            fence,
            credential: Arc::new(std::sync::Mutex::new(credential)),
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
            .send((TunnelPayload::ResponseStart { status, headers }, None))
            .await
            .is_ok()
    }

    /// Body bytes exactly as the provider sent them; waits while this tunnel already holds
    /// [`STREAM_BUFFER`] bytes on their way to the Edge.
    pub async fn body(&self, bytes: Bytes) -> bool {
        let permit = reserve(&self.budget, bytes.len()).await;
        self.tx
            .send((TunnelPayload::Body(bytes), permit))
            .await
            .is_ok()
    }

    /// A usage observation (never merged into the body).
    pub async fn usage(&self, usage: Usage) -> bool {
        self.tx
            .send((TunnelPayload::Usage(usage), None))
            .await
            .is_ok()
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
    ) -> Result<Instances, String> {
        let mut by_key = HashMap::new();
        for c in configs.iter().filter(|c| c.enabled) {
            let factory = self.factories.get(&c.adapter_type).ok_or_else(|| {
                format!(
                    "adapter type `{}` is not available on this node",
                    c.adapter_type
                )
            })?;
            let adapter = factory(c).map_err(|e| format!("adapter `{}`: {e}", c.instance_key()))?;
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
            by_key.insert(
                c.instance_key().to_owned(),
                Arc::new(Instance {
                    trace: TraceAttrs::of(c),
                    config: c.clone(),
                    adapter,
                    gate: CapacityGate::new(c.capacity),
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
    pub(crate) gate: CapacityGate,
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
/// protects the backend from executions that bypassed the Edge queue. A zero capacity admits
/// nothing.
#[derive(Debug)]
pub struct CapacityGate {
    permits: Arc<Semaphore>,
    capacity: u32,
}

impl CapacityGate {
    /// A gate admitting `capacity` concurrent executions.
    pub fn new(capacity: u32) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(capacity as usize)),
            capacity,
        }
    }

    /// Admits one execution now, or refuses (never waits: the Edge already queued).
    pub fn try_admit(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// Executions currently admitted.
    pub fn in_flight(&self) -> u32 {
        let available = u32::try_from(self.permits.available_permits()).unwrap_or(u32::MAX);
        self.capacity.saturating_sub(available)
    }

    /// The configured capacity.
    pub fn capacity(&self) -> u32 {
        self.capacity
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
