//! The Edge's configuration in code: Nodes, their adapters and the models each adapter serves
//! as one typed tree, in which every name is written once.
//!
//! The TOML file ([`crate::config`]) lists adapters under `[[nodes]]` and then, under
//! `[[models]]`, repeats each Node id, adapter name and capacity for every provider. Here a
//! model is declared inside the adapter that serves it ([`AdapterSpec::serves`]); the models
//! clients see, their candidate providers (in declaration order, the pool's tie-break), the
//! adapters' target lists and the provider ids are derived. The result goes through the same
//! validation as the file ([`EdgeConfigFile::build_with_tls`], [`EdgeConfigFile::build`]), so
//! an error names the same key a file would.
//!
//! ```no_run
//! # async fn example(ca: &workload_identity::dev_ca::DevCa) -> Result<(), Box<dyn std::error::Error>> {
//! use iop_edge::Edge;
//! use iop_edge::builder::{AdapterSpec, EdgeBuilder, EdgeTls, NodeSpec};
//!
//! let config = EdgeBuilder::new("edge-1")
//!     .listen_nodes("127.0.0.1:7443".parse()?)
//!     .node(NodeSpec::new("node-1").adapter(
//!         AdapterSpec::openai_compat("openai", "https://api.openai.com/v1")
//!             .profile("openai")
//!             .capacity(8)
//!             .serves("gpt-4o-mini"),
//!     ))
//!     .node(NodeSpec::new("node-2").adapter(AdapterSpec::demo("demo").serves("gpt-4o-mini")))
//!     .build(EdgeTls::Material(ca.material("edge", "edge-1")?))?;
//! let edge = Edge::start(config).await?;
//! # Ok(())
//! # }
//! ```
//!
//! Derived names: a provider's id is `<adapter>` when its adapter serves one model and
//! `<adapter>:<model>` otherwise (both are valid wire ids when the names are); the upstream
//! model (`target`) is the model's name unless [`ModelSpec::target`] says otherwise.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use workload_identity::WorkloadTls;

use crate::config::{
    self, ConfigError, EdgeConfig, EdgeConfigFile, Limits, Listen, Model, Pool, Provider, Tls,
    material_error,
};
use crate::http::ApiKeys;

/// Where the Edge's TLS material comes from.
#[derive(Clone, Debug)]
pub enum EdgeTls {
    /// Three PEM files, re-read every `reload` (`None`: never) by [`crate::Edge`].
    Files {
        /// CA bundle.
        ca: PathBuf,
        /// Certificate chain (URI SAN `spiffe://<trust domain>/edge/<edge id>`).
        cert: PathBuf,
        /// Private key.
        key: PathBuf,
        /// Re-read interval.
        reload: Option<Duration>,
    },
    /// PEM bytes (nothing to reload).
    Pem {
        /// CA bundle.
        ca: Vec<u8>,
        /// Certificate chain.
        cert: Vec<u8>,
        /// Private key.
        key: Vec<u8>,
    },
    /// Material you hold (and may replace with [`WorkloadTls::reload_pem`]), for example a
    /// development CA's (`workload_identity::dev_ca::DevCa::material`).
    Material(Arc<WorkloadTls>),
}

/// One model an adapter serves. `From<&str>` and `From<String>` take the model's name.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    name: String,
    target: Option<String>,
    capacity: Option<u32>,
    long_context_capacity: Option<u32>,
    response_stall_timeout: Duration,
}

impl ModelSpec {
    /// The model clients ask for.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            target: None,
            capacity: None,
            long_context_capacity: None,
            response_stall_timeout: Duration::from_secs(300),
        }
    }

    /// The upstream model name (default: the model's name).
    #[must_use]
    pub fn target(mut self, target: impl Into<String>) -> Self {
        self.target = Some(target.into());
        self
    }

    /// Concurrent requests for this model on this adapter (default: the adapter's capacity).
    #[must_use]
    pub fn capacity(mut self, capacity: u32) -> Self {
        self.capacity = Some(capacity);
        self
    }

    /// Of those, long-context requests (default: the adapter's).
    #[must_use]
    pub fn long_context_capacity(mut self, capacity: u32) -> Self {
        self.long_context_capacity = Some(capacity);
        self
    }

    /// No output for this long ends a response (seed 000's stall terminal; default 300 s).
    #[must_use]
    pub fn response_stall_timeout(mut self, timeout: Duration) -> Self {
        self.response_stall_timeout = timeout;
        self
    }
}

impl From<&str> for ModelSpec {
    fn from(name: &str) -> Self {
        Self::new(name)
    }
}

impl From<String> for ModelSpec {
    fn from(name: String) -> Self {
        Self::new(name)
    }
}

/// One adapter instance on a Node, and the models it serves.
#[derive(Clone, Debug)]
pub struct AdapterSpec {
    name: String,
    adapter_type: String,
    base_url: String,
    profile: Option<String>,
    operations: Option<BTreeMap<String, String>>,
    options: BTreeMap<String, String>,
    stream_usage: Option<bool>,
    trace_propagation: Option<bool>,
    capacity: u32,
    long_context_capacity: Option<u32>,
    request_timeout: Duration,
    serves: Vec<ModelSpec>,
}

impl AdapterSpec {
    fn new(name: impl Into<String>, adapter_type: &str, base_url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            adapter_type: adapter_type.to_owned(),
            base_url: base_url.into(),
            profile: None,
            operations: None,
            options: BTreeMap::new(),
            stream_usage: None,
            trace_propagation: None,
            capacity: 1,
            long_context_capacity: None,
            request_timeout: Duration::ZERO,
            serves: Vec::new(),
        }
    }

    /// An OpenAI-compatible upstream (vLLM, OpenAI, an Anthropic-native API with the
    /// `anthropic` profile, …) at `base_url`.
    pub fn openai_compat(name: impl Into<String>, base_url: impl Into<String>) -> Self {
        Self::new(name, "openai_compat", base_url)
    }

    /// A local Ollama at `base_url`.
    pub fn ollama(name: impl Into<String>, base_url: impl Into<String>) -> Self {
        Self::new(name, "ollama", base_url)
    }

    /// The Node's built-in demo provider (streams a canned answer; option `delay_ms`).
    pub fn demo(name: impl Into<String>) -> Self {
        Self::new(name, "demo", "")
    }

    /// A native adapter type your Nodes register (`iop_node::AdapterRegistry::register`); a
    /// Node without it refuses the configuration. `base_url` is handed to the adapter as is
    /// (`""` for one that needs none).
    pub fn native(
        name: impl Into<String>,
        adapter_type: impl Into<String>,
        base_url: impl Into<String>,
    ) -> Self {
        let mut spec = Self::new(name, "", base_url);
        spec.adapter_type = adapter_type.into();
        spec
    }

    /// The protocol profile of an OpenAI-compatible adapter (`chat_only`, `openai`,
    /// `anthropic`; see [`crate::profile`]).
    #[must_use]
    pub fn profile(mut self, preset: impl Into<String>) -> Self {
        self.profile = Some(preset.into());
        self
    }

    /// Explicit operation paths replacing the profile's (see [`crate::config`]).
    #[must_use]
    pub fn operations(mut self, operations: BTreeMap<String, String>) -> Self {
        self.operations = Some(operations);
        self
    }

    /// Whether to ask this upstream for usage on chat streams (default true; the file's
    /// `stream_usage`): `false` for an upstream that refuses `stream_options`.
    #[must_use]
    pub fn stream_usage(mut self, ask: bool) -> Self {
        self.stream_usage = Some(ask);
        self
    }

    /// Whether the Node sends the request's trace to this upstream as a `traceparent` header
    /// (default true; the file's `trace_propagation`).
    #[must_use]
    pub fn trace_propagation(mut self, send: bool) -> Self {
        self.trace_propagation = Some(send);
        self
    }

    /// A setting of a native adapter (for the demo: `delay_ms`).
    #[must_use]
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }

    /// Concurrent requests on this adapter (default 1); also each model's default.
    #[must_use]
    pub fn capacity(mut self, capacity: u32) -> Self {
        self.capacity = capacity;
        self
    }

    /// Of those, long-context requests (default: all of them).
    #[must_use]
    pub fn long_context_capacity(mut self, capacity: u32) -> Self {
        self.long_context_capacity = Some(capacity);
        self
    }

    /// The Node's timeout for one upstream request (default: none).
    #[must_use]
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// A model this adapter serves (a name, or a [`ModelSpec`]).
    #[must_use]
    pub fn serves(mut self, model: impl Into<ModelSpec>) -> Self {
        self.serves.push(model.into());
        self
    }
}

/// One Node and its adapters.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    node_id: String,
    adapters: Vec<AdapterSpec>,
}

impl NodeSpec {
    /// The Node `node_id` (the name in its workload certificate).
    pub fn new(node_id: impl Into<String>) -> Self {
        Self {
            node_id: node_id.into(),
            adapters: Vec::new(),
        }
    }

    /// An adapter instance on this Node.
    #[must_use]
    pub fn adapter(mut self, adapter: AdapterSpec) -> Self {
        self.adapters.push(adapter);
        self
    }
}

/// The Control Plane connector's settings (the file's `[control_plane]`).
#[derive(Clone, Debug)]
pub struct ControlPlaneSpec {
    addresses: Vec<String>,
    server_name: String,
    name: String,
    credential_plane: bool,
    stale_binding_wait: Duration,
}

impl ControlPlaneSpec {
    /// A Control Plane at `addresses` (`host:port`; several replicas sharing one store are
    /// dialled in order from the last that worked), whose certificate carries DNS name
    /// `server_name` and identity `spiffe://<trust domain>/control-plane/<name>`.
    pub fn new(
        addresses: impl IntoIterator<Item = impl Into<String>>,
        server_name: impl Into<String>,
        name: impl Into<String>,
    ) -> Self {
        Self {
            addresses: addresses.into_iter().map(Into::into).collect(),
            server_name: server_name.into(),
            name: name.into(),
            credential_plane: false,
            stale_binding_wait: iop_edge_core::binding::DEFAULT_STALE_WAIT,
        }
    }

    /// Managed mode: requests are authenticated against the Control Plane's projection and
    /// upstream keys are leased per request.
    #[must_use]
    pub fn managed(mut self) -> Self {
        self.credential_plane = true;
        self
    }

    /// How long a managed request whose binding went stale waits for a newer projection
    /// (default 1 s; 1 ms ..= 60 s).
    #[must_use]
    pub fn stale_binding_wait(mut self, wait: Duration) -> Self {
        self.stale_binding_wait = wait;
        self
    }
}

/// The Edge's configuration in code. See the module docs.
#[derive(Debug)]
pub struct EdgeBuilder {
    edge_id: String,
    listen: Listen,
    nodes: Vec<NodeSpec>,
    pool: Pool,
    limits: Limits,
    api_keys: Option<Arc<ApiKeys>>,
    rate_limits: Option<crate::limits::LimitsConfig>,
    usage: Option<Arc<dyn crate::usage::UsageSink>>,
    control_plane: Option<ControlPlaneSpec>,
    telemetry: iop_telemetry::TelemetryConfig,
}

impl EdgeBuilder {
    /// An Edge named `edge_id` (the name in its certificate) with the file's defaults: Nodes
    /// on `0.0.0.0:7443`, `listen.http` `127.0.0.1:8080` (informational: you bind the HTTP
    /// listener), no gateway keys.
    pub fn new(edge_id: impl Into<String>) -> Self {
        Self {
            edge_id: edge_id.into(),
            listen: Listen {
                nodes: SocketAddr::from(([0, 0, 0, 0], 7443)),
                http: SocketAddr::from(([127, 0, 0, 1], 8080)),
            },
            nodes: Vec::new(),
            pool: Pool::default(),
            limits: Limits::default(),
            api_keys: None,
            rate_limits: None,
            usage: None,
            control_plane: None,
            telemetry: iop_telemetry::TelemetryConfig::default(),
        }
    }

    /// OpenTelemetry tracing ([`iop_telemetry`]); the `OTEL_*` variables fill what it leaves
    /// out, and it is off when neither names a collector.
    #[must_use]
    pub fn telemetry(mut self, telemetry: iop_telemetry::TelemetryConfig) -> Self {
        self.telemetry = telemetry;
        self
    }

    /// The Node listener's address (port 0: any free port, see [`crate::Edge::node_addr`]).
    #[must_use]
    pub fn listen_nodes(mut self, addr: SocketAddr) -> Self {
        self.listen.nodes = addr;
        self
    }

    /// `listen.http`: where the HTTP surface should be served ([`crate::Edge::http_listen`]).
    #[must_use]
    pub fn listen_http(mut self, addr: SocketAddr) -> Self {
        self.listen.http = addr;
        self
    }

    /// A Node and its adapters.
    #[must_use]
    pub fn node(mut self, node: NodeSpec) -> Self {
        self.nodes.push(node);
        self
    }

    /// How long a request may wait for a provider (then 503), and how many may wait (then
    /// 429). Defaults: 30 s, 256.
    #[must_use]
    pub fn queue(mut self, wait: Duration, max_queue: usize) -> Self {
        self.pool = Pool {
            queue_wait_sec: wait.as_secs().max(1),
            max_queue,
        };
        self
    }

    /// What slow or hostile peers may cost (the file's `[limits]`, same defaults).
    #[must_use]
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Gateway API keys clients must present (legacy mode; none = no key needed).
    #[must_use]
    pub fn api_keys(mut self, keys: ApiKeys) -> Self {
        self.api_keys = Some(Arc::new(keys));
        self
    }

    /// Where each keyed request's usage record goes ([`crate::usage`]: a
    /// [`crate::usage::SqliteUsage`], or your own [`crate::usage::UsageSink`]).
    pub fn usage(mut self, sink: Arc<dyn crate::usage::UsageSink>) -> Self {
        self.usage = Some(sink);
        self
    }

    /// Per-key rate limits ([`crate::limits`]): for the [`Self::api_keys`] by their ids, or,
    /// without gateway keys, for the ids your own authentication puts on each request
    /// ([`crate::limits::KeyId`]). In managed mode each principal's limits come with the
    /// Control Plane's projection (a managed Edge always has a limiter); what is set here is
    /// how this Edge enforces them (shared store, output estimate, prices).
    pub fn rate_limits(mut self, limits: crate::limits::LimitsConfig) -> Self {
        self.rate_limits = Some(limits);
        self
    }

    /// The Control Plane connector.
    #[must_use]
    pub fn control_plane(mut self, control_plane: ControlPlaneSpec) -> Self {
        self.control_plane = Some(control_plane);
        self
    }

    /// Validates everything and builds the [`EdgeConfig`] for [`crate::Edge::start`]. The
    /// trust domain is the Edge certificate's.
    pub fn build(self, tls: EdgeTls) -> Result<EdgeConfig, ConfigError> {
        let material = match &tls {
            EdgeTls::Files { ca, cert, key, .. } => {
                let read = |key: &'static str, p: &PathBuf| {
                    std::fs::read(p).map_err(|e| ConfigError::Invalid {
                        key,
                        message: format!("cannot read {}: {e}", p.display()),
                    })
                };
                WorkloadTls::from_pem(
                    &read("tls.ca", ca)?,
                    &read("tls.cert", cert)?,
                    &read("tls.key", key)?,
                )
                .map_err(material_error)?
            }
            EdgeTls::Pem { ca, cert, key } => {
                WorkloadTls::from_pem(ca, cert, key).map_err(material_error)?
            }
            EdgeTls::Material(m) => m.clone(),
        };
        let api_keys = self.api_keys.clone();
        let rate_limits = self.rate_limits.clone();
        let usage = self.usage.clone();
        let telemetry = self.telemetry.clone();
        if api_keys.is_some()
            && self
                .control_plane
                .as_ref()
                .is_some_and(|c| c.credential_plane)
        {
            return Err(ConfigError::Invalid {
                key: "auth",
                message:
                    "not used in managed mode: the Control Plane's tokens authenticate requests"
                        .into(),
            });
        }
        let trust_domain = material.identity().trust_domain().to_owned();
        let file = self.into_file(trust_domain, &tls);
        let mut config = match tls {
            EdgeTls::Files { .. } => file.build()?,
            EdgeTls::Pem { .. } | EdgeTls::Material(_) => file.build_with_tls(material)?,
        };
        if let Some(limits) = rate_limits {
            // With gateway keys, every per-key entry must name one of them; without, the ids
            // come from the application (`limits::KeyId` on the request).
            if let Some(keys) = &api_keys {
                let ids: std::collections::BTreeSet<&str> = keys.ids().collect();
                if let Some(id) = limits.keys.keys().find(|id| !ids.contains(id.as_str())) {
                    return Err(ConfigError::Invalid {
                        key: "auth.key_limits",
                        message: format!("{id}: no key has this id"),
                    });
                }
            }
            let limiter =
                crate::limits::Limiter::new(limits).map_err(|e| ConfigError::Invalid {
                    key: "auth.shared.redis",
                    message: e.to_string(),
                })?;
            config.http.limiter = Some(Arc::new(limiter));
        }
        config.http.api_keys = api_keys;
        if let (Some(l), Some(u)) = (&config.http.limiter, &usage) {
            l.set_usage(Arc::clone(u));
        }
        config.http.usage = usage;
        config.telemetry = telemetry;
        Ok(config)
    }

    /// The same configuration as the file would write it.
    fn into_file(self, trust_domain: String, tls: &EdgeTls) -> EdgeConfigFile {
        let mut nodes = Vec::new();
        // Model name → its providers, in declaration order.
        let mut models: Vec<Model> = Vec::new();
        for node in self.nodes {
            let mut adapters = Vec::new();
            for a in node.adapters {
                let single = a.serves.len() == 1;
                let long = a.long_context_capacity.unwrap_or(a.capacity);
                let mut targets = Vec::new();
                for m in &a.serves {
                    let target = m.target.clone().unwrap_or_else(|| m.name.clone());
                    if !targets.contains(&target) {
                        targets.push(target.clone());
                    }
                    let provider = Provider {
                        node_id: node.node_id.clone(),
                        provider_id: if single {
                            a.name.clone()
                        } else {
                            format!("{}:{}", a.name, m.name)
                        },
                        adapter: a.name.clone(),
                        target,
                        capacity: m.capacity.unwrap_or(a.capacity),
                        long_context_capacity: m.long_context_capacity.unwrap_or(long),
                        response_stall_timeout_sec: m.response_stall_timeout.as_secs().max(1),
                    };
                    match models.iter_mut().find(|x| x.name == m.name) {
                        Some(model) => model.providers.push(provider),
                        None => models.push(Model {
                            name: m.name.clone(),
                            providers: vec![provider],
                        }),
                    }
                }
                adapters.push(config::Adapter {
                    name: a.name,
                    adapter_type: a.adapter_type,
                    base_url: a.base_url,
                    capacity: a.capacity,
                    long_context_capacity: long,
                    targets,
                    request_timeout_sec: u32::try_from(a.request_timeout.as_secs())
                        .unwrap_or(u32::MAX),
                    profile: a.profile,
                    operations: a.operations,
                    options: a.options,
                    stream_usage: a.stream_usage,
                    trace_propagation: a.trace_propagation,
                });
            }
            nodes.push(config::Node {
                node_id: node.node_id,
                adapters,
            });
        }
        let (ca, cert, key, reload_sec) = match tls {
            EdgeTls::Files {
                ca,
                cert,
                key,
                reload,
            } => (
                Some(ca.clone()),
                Some(cert.clone()),
                Some(key.clone()),
                reload.map_or(0, |d| d.as_secs().max(1)),
            ),
            _ => (None, None, None, 0),
        };
        EdgeConfigFile {
            edge_id: self.edge_id,
            listen: self.listen,
            tls: Tls {
                trust_domain,
                ca,
                cert,
                key,
                reload_sec,
            },
            auth: None,
            usage: None,
            telemetry: iop_telemetry::TelemetryToml::default(),
            admin: None,
            prices: BTreeMap::new(),
            pool: self.pool,
            limits: self.limits,
            nodes,
            models,
            control_plane: self.control_plane.map(|c| config::ControlPlane {
                address: None,
                addresses: c.addresses,
                server_name: c.server_name,
                name: c.name,
                credential_plane: c.credential_plane,
                stale_binding_wait_ms: u64::try_from(c.stale_binding_wait.as_millis())
                    .unwrap_or(u64::MAX),
            }),
        }
    }
}
