//! The Edge's configuration file (TOML), shared by the `iop-edge` binary and embedders, with
//! strict validation: unknown keys are errors, and every error names its key.
//!
//! ```toml
//! edge_id = "edge-1"                 # the name in the Edge's workload certificate
//!
//! [listen]
//! nodes = "0.0.0.0:7443"             # Node wire (mTLS)
//! http = "127.0.0.1:8080"            # OpenAI / Anthropic-compatible HTTP API
//!
//! [tls]
//! trust_domain = "iop.local"
//! ca = "/etc/iop/ca.pem"             # workload CA bundle (verifies Nodes and the Control Plane)
//! cert = "/etc/iop/edge.pem"         # URI SAN spiffe://<trust_domain>/edge/<edge_id>
//! key = "/etc/iop/edge.key"
//! reload_sec = 5                     # re-read the three files this often (0 = never)
//!
//! [auth]                             # gateway API keys (legacy mode); omitted = no key needed
//! keys_file = "/etc/iop/api-keys"    # per line: a key or sha256:<hex>, then optionally its id
//!                                    #   (`sha256:ab12… team-a`); not world-readable
//! keys_env = "IOP_API_KEYS"          # and/or keys (comma-separated) in this variable
//! output_estimate = 1024             # tokens reserved for a request that names no output cap
//!
//! [auth.limits]                      # every key's own limits (omitted: none); each optional
//! requests_per_minute = 60
//! tokens_per_minute = 100000         # input + output, reserved at admission, settled to usage
//! concurrent = 8                     # requests in flight (per Edge)
//! budget_usd_per_day = 5.0          # spend per UTC day / month, at [prices] (see
//! budget_usd_per_month = 50.0        #   iop_edge::limits::budget); refused for good past it
//! [auth.limits.models."gpt-4o"]      # and per model, checked as well
//! tokens_per_minute = 20000
//!
//! [auth.key_limits.team-a]           # key id team-a: exactly these instead of [auth.limits]
//! requests_per_minute = 600
//!
//! [auth.shared]                      # optional: share limits and budgets with other Edges
//! redis = "redis://127.0.0.1:6379/"  # or redis_env = "IOP_LIMITS_REDIS_URL" (keeps a password
//!                                    #   out of the file)
//! cluster = false                    # true: Redis Cluster, redis = seed URLs, comma-separated
//! on_unavailable = "local"           # store down: "local" (each Edge alone) or "closed" (503)
//! borrow_divisor = 16                # borrow up to limit/16 ahead of need
//! share = 4                          #   at most 1/4 of what remains
//! timeout_ms = 250                   # per store call
//! credit_idle_ms = 2000              # unused credit goes back after this
//!
//! [prices."gpt-4o-mini"]             # USD per million tokens, per model (budgets, records' cost)
//! input = 0.15
//! output = 0.60
//! cached_input = 0.075               # optional: prompt-cache reads (default: input)
//!
//! [usage]                            # optional: one record per keyed request (or principal)
//! sqlite = "/var/lib/iop/usage.db"   # created if missing; see iop_edge::usage
//! queue = 65536                      # records waiting for the writer (then newest dropped)
//! retention_days = 30                # raw rows kept; daily rollups stay
//! spool_max = 1000000                # managed: records waiting for the Control Plane (then
//!                                    #   newest dropped, counted)
//!
//! [pool]
//! queue_wait_sec = 30                # how long a request may wait for a provider (then 503)
//! max_queue = 256                    # waiting requests (then 429)
//!
//! [limits]                           # what slow or hostile peers may cost (defaults shown)
//! tls_handshake_timeout_sec = 10     # Node listener: the TLS handshake
//! register_timeout_sec = 10          # Node listener: register and report ready, after accept
//! max_unauthenticated = 256          # Node connections in their TLS handshake at once (more wait unaccepted)
//! max_unauthenticated_per_ip = 32    #   of which from one address (more: closed at once)
//! stream_buffer_bytes = 4194304      # memory one response's unread events may hold (counted as held, not payload)
//! slow_consumer_timeout_sec = 30     # unread bytes and no read this long: stream ended
//! # stream_window_bytes = 1048576    # a tunnel body's credit window on Nodes that support it:
//! #                                  # a slow reader slows its stream instead of being ended;
//! #                                  # default a quarter of stream_buffer_bytes, at most half; 0 = off
//! http_max_connections = 4096        # HTTP connections (more: closed at once)
//! http_header_timeout_sec = 30       # to send request headers; also the keep-alive idle limit
//! http_body_timeout_sec = 60         # to send the whole request body (then 408)
//! drain_notice_sec = 0               # on SIGTERM: /readyz answers 503 this long, still serving,
//!                                    #   before the listener closes (give a load balancer's
//!                                    #   health check time to see it: interval × fall)
//! drain_timeout_sec = 30             # then requests and streams in flight may finish this long
//!
//! [[nodes]]
//! node_id = "node-1"
//! [[nodes.adapters]]
//! name = "openai"                    # the instance name (a Node's [[credentials]] refer to it)
//! type = "openai_compat"             # or "ollama", "demo", or a native type your Nodes
//!                                    # register (iop_node::AdapterRegistry::register)
//! base_url = "https://api.openai.com/v1"
//! profile = "openai"                 # chat_only (default), openai, anthropic: see iop_edge::profile
//! # operations = { chat_completions = "/chat/completions", models = "/models" }
//! capacity = 8
//! targets = ["gpt-4o-mini"]
//! # stream_usage = false             # do not ask this upstream for usage on chat streams
//!                                    #   (stream_options.include_usage) if it refuses the field
//! # trace_propagation = false        # do not send this upstream a traceparent header
//!
//! [[models]]
//! name = "gpt-4o-mini"               # what clients ask for
//! [[models.providers]]
//! node_id = "node-1"
//! provider_id = "openai-mini"
//! adapter = "openai"
//! target = "gpt-4o-mini"             # the upstream model
//! capacity = 8
//! response_stall_timeout_sec = 300
//!
//! [control_plane]                    # optional
//! address = "cp.internal:7600"       # or addresses = ["cp-a:7600", "cp-b:7600"] (replicas)
//! server_name = "cp.internal"
//! name = "cp-1"                      # spiffe://<trust_domain>/control-plane/<name>
//! credential_plane = true            # managed mode: projection auth and leases
//! stale_binding_wait_ms = 1000       # managed: how long a stale binding waits for a newer
//!                                    # projection before 503 + Retry-After
//! ```
//!
//! - `profile` names a preset (see [`crate::profile`]): which operations the upstream serves
//!   (the HTTP surface translates the others), the header a Node's own key goes in, and fixed
//!   headers. `operations` replaces the preset's operation list with explicit paths and keeps
//!   its name, auth header and fixed headers.
//! - `[auth]` applies in legacy mode; managed mode (`credential_plane = true`) authenticates
//!   against the Control Plane's projection, takes each principal's limits and budgets from it
//!   (`iop-cp principal limits`), and accepts only `auth.output_estimate` and `[auth.shared]`
//!   (how this Edge enforces them).
//! - Rate limits (`[auth.limits]`, `[auth.key_limits.<id>]`, `[auth.shared]`) are
//!   [`crate::limits`]'s: the rule, the headers clients see, and what sharing through Redis
//!   guarantees.
//! - Upstream keys are not configured here: each Node holds its own (`iop_node::config`
//!   `[[credentials]]`), or the Control Plane leases them (managed mode).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, NativeSettings, NodeConfigPayload, OpenAiCompatSettings,
};
use serde::Deserialize;
use workload_identity::reload::TlsPaths;
use workload_identity::{ExpectedPeer, WorkloadTls, role};

use crate::control::ControlConfig;
use crate::http::{ApiKeys, HttpConfig, ServeLimits};
use crate::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use crate::profile::{DEFAULT_PRESET, Profile};
use crate::transport::TransportConfig;

/// A configuration error; the text names the key (or file) it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML did not parse or had unknown/missing keys (toml's message names them).
    #[error("{0}")]
    Syntax(String),
    /// A key had an invalid value.
    #[error("{key}: {message}")]
    Invalid {
        /// The key, e.g. `nodes.adapters.profile`.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Refused TLS material, under the key of the file it came from.
pub(crate) fn material_error(e: workload_identity::MaterialError) -> ConfigError {
    let key = match e {
        workload_identity::MaterialError::Ca(_) => "tls.ca",
        workload_identity::MaterialError::Key(_) => "tls.key",
        _ => "tls.cert",
    };
    invalid(key, e)
}

fn invalid(key: &'static str, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        key,
        message: message.to_string(),
    }
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeConfigFile {
    /// `edge_id`.
    pub edge_id: String,
    /// `[listen]`.
    pub listen: Listen,
    /// `[tls]`.
    pub tls: Tls,
    /// `[auth]`.
    pub auth: Option<Auth>,
    /// `[pool]`.
    #[serde(default)]
    pub pool: Pool,
    /// `[limits]`.
    #[serde(default)]
    pub limits: Limits,
    /// `[[nodes]]`.
    #[serde(default)]
    pub nodes: Vec<Node>,
    /// `[[models]]`.
    #[serde(default)]
    pub models: Vec<Model>,
    /// `[control_plane]`.
    pub control_plane: Option<ControlPlane>,
    /// `[usage]`: usage records in a local SQLite file (managed mode: also the spool of
    /// records sent to the Control Plane).
    pub usage: Option<UsageToml>,
    /// `[prices.<model>]`: per-model prices, for budgets and the records' cost.
    #[serde(default)]
    pub prices: BTreeMap<String, PriceToml>,
    /// `[telemetry]`: OpenTelemetry tracing ([`iop_telemetry::TelemetryToml`]); the `OTEL_*`
    /// variables fill what it leaves out, and tracing is off when neither names a collector.
    #[serde(default)]
    pub telemetry: iop_telemetry::TelemetryToml,
    /// `[admin]`: the status page's listener ([`crate::admin`]).
    pub admin: Option<AdminToml>,
}

/// `[admin]`: the status page for operators, on its own listener.
///
/// ```toml
/// [admin]
/// listen = "127.0.0.1:9180"          # never the public API port
/// token_file = "/etc/iop/admin.token" # one line, at least 16 printable characters
/// ```
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminToml {
    /// `admin.listen`.
    pub listen: SocketAddr,
    /// `admin.token_file`: the admin token (Bearer, or the Basic password in a browser).
    pub token_file: PathBuf,
}

/// The status page's listener and credential ([`EdgeConfig::admin`]).
#[derive(Clone, Debug)]
pub struct AdminConfig {
    /// Where to serve [`crate::Edge::status_page`].
    pub listen: SocketAddr,
    /// The credential every request to it needs.
    pub token: crate::admin::AdminToken,
}

/// `[usage]` ([`crate::usage`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageToml {
    /// `usage.sqlite`: the file (created if missing).
    pub sqlite: PathBuf,
    /// `usage.queue`: records waiting for the writer at most (default 65536; then the newest
    /// is dropped, counted).
    pub queue: Option<usize>,
    /// `usage.retention_days`: raw rows kept this long (default 30; daily rollups stay).
    pub retention_days: Option<u32>,
    /// `usage.spool_max`: managed mode, records waiting for the Control Plane at most
    /// (default 1000000; then the newest is dropped, counted).
    pub spool_max: Option<u64>,
}

/// `[listen]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listen {
    /// `listen.nodes`.
    pub nodes: SocketAddr,
    /// `listen.http`.
    pub http: SocketAddr,
}

/// `[tls]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    /// `tls.trust_domain`.
    pub trust_domain: String,
    /// `tls.ca` (required unless the material is given in code:
    /// [`EdgeConfigFile::build_with_tls`]).
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// `tls.cert` (likewise).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// `tls.key` (likewise).
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// `tls.reload_sec` (default 5; 0 = never).
    #[serde(default = "default_reload")]
    pub reload_sec: u64,
}

fn default_reload() -> u64 {
    5
}

/// `[auth]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    /// `auth.keys_file`.
    pub keys_file: Option<PathBuf>,
    /// `auth.keys_env`.
    pub keys_env: Option<String>,
    /// `auth.output_estimate`: output tokens reserved for a request that names no cap
    /// (default [`crate::limits::DEFAULT_OUTPUT_ESTIMATE`]).
    pub output_estimate: Option<u64>,
    /// `[auth.limits]`: every key's own limits, unless `[auth.key_limits.<id>]` sets them.
    pub limits: Option<KeyLimitsToml>,
    /// `[auth.key_limits.<id>]`: one key's limits (replacing `[auth.limits]` for it).
    #[serde(default)]
    pub key_limits: BTreeMap<String, KeyLimitsToml>,
    /// `[auth.shared]`: share the limits with other Edges through Redis.
    pub shared: Option<SharedToml>,
}

/// `[prices.<model>]`: USD per million tokens, as providers publish them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceToml {
    /// `input`.
    pub input: f64,
    /// `output`.
    pub output: f64,
    /// `cached_input`: input read from the provider's prompt cache (default: `input`).
    pub cached_input: Option<f64>,
}

/// `[auth.shared]` ([`crate::limits::SharedConfig`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedToml {
    /// `redis`: the store's URL.
    pub redis: Option<String>,
    /// `redis_env`: or the variable holding it (a URL with a password stays out of the file).
    pub redis_env: Option<String>,
    /// `cluster`: the URL names Redis Cluster seed nodes (comma-separated).
    pub cluster: Option<bool>,
    /// `prefix` (default `iop:rl`).
    pub prefix: Option<String>,
    /// `on_unavailable`: `local` (default) or `closed`.
    pub on_unavailable: Option<String>,
    /// `borrow_divisor` (default 16).
    pub borrow_divisor: Option<u64>,
    /// `share` (default 4).
    pub share: Option<u64>,
    /// `timeout_ms` (default 250).
    pub timeout_ms: Option<u64>,
    /// `credit_idle_ms` (default 2000).
    pub credit_idle_ms: Option<u64>,
}

impl SharedToml {
    fn build(&self) -> Result<crate::limits::SharedConfig, ConfigError> {
        let url = match (&self.redis, &self.redis_env) {
            (Some(u), None) => u.clone(),
            (None, Some(var)) => std::env::var(var)
                .ok()
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    invalid(
                        "auth.shared.redis_env",
                        format!("environment variable {var} is not set or empty"),
                    )
                })?,
            _ => {
                return Err(invalid(
                    "auth.shared",
                    "set exactly one of redis and redis_env",
                ));
            }
        };
        let mut c = crate::limits::SharedConfig::new(url);
        c.cluster = self.cluster.unwrap_or(false);
        if let Some(p) = &self.prefix {
            if p.is_empty() || p.contains(['{', '}']) {
                return Err(invalid(
                    "auth.shared.prefix",
                    "must be non-empty, without { or } (the key id is the hash tag)",
                ));
            }
            c.prefix = p.clone();
        }
        c.on_unavailable = match self.on_unavailable.as_deref() {
            None | Some("local") => crate::limits::OnUnavailable::Local,
            Some("closed") => crate::limits::OnUnavailable::Closed,
            Some(other) => {
                return Err(invalid(
                    "auth.shared.on_unavailable",
                    format!("`{other}`: expected `local` or `closed`"),
                ));
            }
        };
        for (key, value, slot) in [
            (
                "auth.shared.borrow_divisor",
                self.borrow_divisor,
                &mut c.borrow_divisor,
            ),
            ("auth.shared.share", self.share, &mut c.share),
        ] {
            match value {
                Some(0) => return Err(invalid(key, "must be at least 1")),
                Some(v) => *slot = v,
                None => {}
            }
        }
        if let Some(ms) = self.timeout_ms {
            if ms == 0 {
                return Err(invalid("auth.shared.timeout_ms", "must be at least 1"));
            }
            c.timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = self.credit_idle_ms {
            c.credit_idle = Duration::from_millis(ms.max(10));
        }
        Ok(c)
    }
}

/// A key's limits as written (`[auth.limits]`, `[auth.key_limits.<id>]`); each omitted limit
/// is not enforced.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyLimitsToml {
    /// `requests_per_minute`.
    pub requests_per_minute: Option<u64>,
    /// `tokens_per_minute` (input + output).
    pub tokens_per_minute: Option<u64>,
    /// `concurrent`: requests in flight at once.
    pub concurrent: Option<u32>,
    /// `budget_usd_per_day`: spend per UTC day (needs `[prices]` for the models).
    pub budget_usd_per_day: Option<f64>,
    /// `budget_usd_per_month`: spend per UTC calendar month.
    pub budget_usd_per_month: Option<f64>,
    /// `[….models.<model>]`: the key's limits on one model, checked as well.
    #[serde(default)]
    pub models: BTreeMap<String, ModelLimitsToml>,
}

/// A key × model's limits as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelLimitsToml {
    /// `requests_per_minute`.
    pub requests_per_minute: Option<u64>,
    /// `tokens_per_minute`.
    pub tokens_per_minute: Option<u64>,
    /// `concurrent`.
    pub concurrent: Option<u32>,
}

fn rate_limits(
    key: &'static str,
    requests: Option<u64>,
    tokens: Option<u64>,
    concurrent: Option<u32>,
) -> Result<iop_edge_core::ratelimit::Limits, ConfigError> {
    use iop_edge_core::ratelimit::Rate;
    let rate = |v: Option<u64>| match v {
        None => Ok(None),
        Some(n) => Rate::per_minute(n)
            .map(Some)
            .ok_or_else(|| invalid(key, "a limit must be at least 1 (omit it for no limit)")),
    };
    if concurrent == Some(0) {
        return Err(invalid(
            key,
            "concurrent must be at least 1 (omit it for no limit)",
        ));
    }
    Ok(iop_edge_core::ratelimit::Limits {
        requests: rate(requests)?,
        tokens: rate(tokens)?,
        concurrent,
    })
}

impl KeyLimitsToml {
    fn build(
        &self,
        key: &'static str,
        models: &BTreeSet<&str>,
    ) -> Result<crate::limits::KeyLimits, ConfigError> {
        let limits = rate_limits(
            key,
            self.requests_per_minute,
            self.tokens_per_minute,
            self.concurrent,
        )?;
        let mut per_model = BTreeMap::new();
        for (name, m) in &self.models {
            if !models.contains(name.as_str()) {
                return Err(invalid(
                    key,
                    format!("models.{name}: no [[models]] entry has this name"),
                ));
            }
            per_model.insert(
                name.clone(),
                rate_limits(
                    key,
                    m.requests_per_minute,
                    m.tokens_per_minute,
                    m.concurrent,
                )?,
            );
        }
        let money = |v: Option<f64>| match v {
            None => Ok(None),
            Some(usd) => crate::limits::budget::usd(usd)
                .filter(|p| *p > 0)
                .map(Some)
                .ok_or_else(|| invalid(key, "a budget must be a positive amount of USD")),
        };
        Ok(crate::limits::KeyLimits {
            limits,
            models: per_model,
            budget: crate::limits::budget::Budget {
                per_day_pusd: money(self.budget_usd_per_day)?,
                per_month_pusd: money(self.budget_usd_per_month)?,
            },
        })
    }
}

impl Auth {
    /// The limits `[auth]` sets for `keys`, `None` when it sets none. `models` are the
    /// configured model names.
    fn limits(
        &self,
        keys: &ApiKeys,
        models: &BTreeSet<&str>,
        prices: &BTreeMap<String, crate::limits::budget::Price>,
    ) -> Result<Option<crate::limits::LimitsConfig>, ConfigError> {
        let mut config = crate::limits::LimitsConfig {
            prices: prices.clone(),
            ..crate::limits::LimitsConfig::default()
        };
        if let Some(n) = self.output_estimate {
            config.output_estimate = n;
        }
        if let Some(l) = &self.limits {
            config.default = l.build("auth.limits", models)?;
        }
        let ids: BTreeSet<&str> = keys.ids().collect();
        for (id, l) in &self.key_limits {
            if !ids.contains(id.as_str()) {
                return Err(invalid(
                    "auth.key_limits",
                    format!(
                        "{id}: no key has this id (name a key in the key file: `<key or sha256:hex> {id}`)"
                    ),
                ));
            }
            config
                .keys
                .insert(id.clone(), l.build("auth.key_limits", models)?);
        }
        if let Some(shared) = &self.shared {
            config.shared = Some(shared.build()?);
            let rates = std::iter::once(&config.default)
                .chain(config.keys.values())
                .flat_map(|k| std::iter::once(&k.limits).chain(k.models.values()))
                .flat_map(|l| [l.requests, l.tokens])
                .flatten();
            for rate in rates {
                if !crate::limits::shared::exact_in_lua(&rate) {
                    return Err(invalid(
                        "auth.shared",
                        format!(
                            "a shared limit of {} per minute is more than the store computes exactly (150000000)",
                            rate.limit()
                        ),
                    ));
                }
            }
        }
        Ok((!config.is_unlimited()).then_some(config))
    }
}

/// `[pool]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    /// `pool.queue_wait_sec`.
    #[serde(default = "default_wait")]
    pub queue_wait_sec: u64,
    /// `pool.max_queue`.
    #[serde(default = "default_queue")]
    pub max_queue: usize,
}

impl Default for Pool {
    fn default() -> Self {
        Self {
            queue_wait_sec: default_wait(),
            max_queue: default_queue(),
        }
    }
}

fn default_wait() -> u64 {
    30
}

fn default_queue() -> usize {
    256
}

/// `[limits]` (see the module docs for the defaults).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// `limits.tls_handshake_timeout_sec`.
    pub tls_handshake_timeout_sec: u64,
    /// `limits.register_timeout_sec`.
    pub register_timeout_sec: u64,
    /// `limits.max_unauthenticated`.
    pub max_unauthenticated: usize,
    /// `limits.max_unauthenticated_per_ip`.
    pub max_unauthenticated_per_ip: usize,
    /// `limits.stream_buffer_bytes`.
    pub stream_buffer_bytes: usize,
    /// `limits.slow_consumer_timeout_sec`.
    pub slow_consumer_timeout_sec: u64,
    /// `limits.stream_window_bytes`: a tunnel body's credit window
    /// ([`crate::TransportConfig::stream_window`]); unset = a quarter of
    /// `stream_buffer_bytes`, `0` = credit off, more than half of `stream_buffer_bytes` is an
    /// error.
    pub stream_window_bytes: Option<usize>,
    /// `limits.http_max_connections`.
    pub http_max_connections: usize,
    /// `limits.http_header_timeout_sec`.
    pub http_header_timeout_sec: u64,
    /// `limits.http_body_timeout_sec`.
    pub http_body_timeout_sec: u64,
    /// `limits.drain_notice_sec`: on a graceful stop, how long `/readyz` answers 503 while the
    /// Edge still serves, before its listener closes (may be 0).
    pub drain_notice_sec: u64,
    /// `limits.drain_timeout_sec`: then how long the requests in flight may take to finish.
    pub drain_timeout_sec: u64,
}

impl Default for Limits {
    fn default() -> Self {
        let serve = ServeLimits::default();
        Self {
            tls_handshake_timeout_sec: crate::transport::DEFAULT_TLS_HANDSHAKE_TIMEOUT.as_secs(),
            register_timeout_sec: iop_edge_core::registry::DEFAULT_HANDSHAKE_TIMEOUT.as_secs(),
            max_unauthenticated: crate::transport::DEFAULT_MAX_UNAUTHENTICATED,
            max_unauthenticated_per_ip: crate::transport::DEFAULT_MAX_UNAUTHENTICATED_PER_IP,
            stream_buffer_bytes: crate::transport::DEFAULT_MAX_STREAM_BUFFER,
            slow_consumer_timeout_sec: crate::transport::DEFAULT_SLOW_CONSUMER_TIMEOUT.as_secs(),
            stream_window_bytes: None,
            http_max_connections: serve.max_connections,
            http_header_timeout_sec: serve.header_timeout.as_secs(),
            http_body_timeout_sec: crate::http::DEFAULT_BODY_TIMEOUT.as_secs(),
            drain_notice_sec: 0,
            drain_timeout_sec: serve.drain_timeout.as_secs(),
        }
    }
}

impl Limits {
    /// Every value must be positive.
    fn check(&self) -> Result<(), ConfigError> {
        let positive = [
            (
                "limits.tls_handshake_timeout_sec",
                self.tls_handshake_timeout_sec as usize,
            ),
            (
                "limits.register_timeout_sec",
                self.register_timeout_sec as usize,
            ),
            ("limits.max_unauthenticated", self.max_unauthenticated),
            (
                "limits.max_unauthenticated_per_ip",
                self.max_unauthenticated_per_ip,
            ),
            ("limits.stream_buffer_bytes", self.stream_buffer_bytes),
            (
                "limits.slow_consumer_timeout_sec",
                self.slow_consumer_timeout_sec as usize,
            ),
            ("limits.http_max_connections", self.http_max_connections),
            (
                "limits.http_header_timeout_sec",
                self.http_header_timeout_sec as usize,
            ),
            (
                "limits.http_body_timeout_sec",
                self.http_body_timeout_sec as usize,
            ),
            ("limits.drain_timeout_sec", self.drain_timeout_sec as usize),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        if self
            .stream_window_bytes
            .is_some_and(|w| w > self.stream_buffer_bytes / 2)
        {
            return Err(invalid(
                "limits.stream_window_bytes",
                "must be at most half of limits.stream_buffer_bytes (0 turns credit off)",
            ));
        }
        Ok(())
    }

    /// The credit window in effect.
    pub fn stream_window(&self) -> usize {
        self.stream_window_bytes
            .unwrap_or(self.stream_buffer_bytes / 4)
    }
}

/// `[[nodes]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// `nodes.node_id`.
    pub node_id: String,
    /// `[[nodes.adapters]]`.
    #[serde(default)]
    pub adapters: Vec<Adapter>,
}

/// `[[nodes.adapters]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adapter {
    /// `nodes.adapters.name`.
    pub name: String,
    /// `nodes.adapters.type`.
    #[serde(rename = "type")]
    pub adapter_type: String,
    /// `nodes.adapters.base_url`.
    #[serde(default)]
    pub base_url: String,
    /// `nodes.adapters.capacity`.
    #[serde(default = "one")]
    pub capacity: u32,
    /// `nodes.adapters.long_context_capacity`.
    #[serde(default)]
    pub long_context_capacity: u32,
    /// `nodes.adapters.targets`.
    #[serde(default)]
    pub targets: Vec<String>,
    /// `nodes.adapters.request_timeout_sec`.
    #[serde(default)]
    pub request_timeout_sec: u32,
    /// `nodes.adapters.profile`.
    pub profile: Option<String>,
    /// `nodes.adapters.operations`.
    pub operations: Option<BTreeMap<String, String>>,
    /// `nodes.adapters.options` (native adapters).
    #[serde(default)]
    pub options: BTreeMap<String, String>,
    /// `nodes.adapters.stream_usage` (default true): ask this upstream for usage on chat
    /// streams (`stream_options.include_usage`), so they are charged exactly; `false` for an
    /// upstream that refuses the field (its streams then keep their reservation).
    #[serde(default)]
    pub stream_usage: Option<bool>,
    /// `nodes.adapters.trace_propagation` (default true): the Node sends the request's trace
    /// to this upstream as a `traceparent` header (`false` for one that refuses unknown
    /// headers, or that must not learn trace ids).
    #[serde(default)]
    pub trace_propagation: Option<bool>,
}

fn one() -> u32 {
    1
}

/// `[[models]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// `models.name`.
    pub name: String,
    /// `[[models.providers]]`.
    pub providers: Vec<Provider>,
}

/// `[[models.providers]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provider {
    /// `models.providers.node_id`.
    pub node_id: String,
    /// `models.providers.provider_id`.
    pub provider_id: String,
    /// `models.providers.adapter`.
    pub adapter: String,
    /// `models.providers.target`.
    pub target: String,
    /// `models.providers.capacity`.
    #[serde(default = "one")]
    pub capacity: u32,
    /// `models.providers.long_context_capacity`.
    #[serde(default)]
    pub long_context_capacity: u32,
    /// `models.providers.response_stall_timeout_sec`.
    #[serde(default = "stall")]
    pub response_stall_timeout_sec: u64,
}

fn stall() -> u64 {
    300
}

/// `[control_plane]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlPlane {
    /// `control_plane.address`: `host:port`.
    #[serde(default)]
    pub address: Option<String>,
    /// `control_plane.addresses`: several replicas sharing one store (instead of `address`),
    /// dialled in order from the last that worked.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// `control_plane.server_name`.
    pub server_name: String,
    /// `control_plane.name`.
    pub name: String,
    /// `control_plane.credential_plane`.
    #[serde(default)]
    pub credential_plane: bool,
    /// `control_plane.stale_binding_wait_ms`: how long, in all, a managed request whose
    /// binding went stale (or whose Control Plane session went away) waits for a newer
    /// projection or a live session before 503 + `Retry-After` (default 1000; 1..=60000).
    #[serde(default = "default_stale_binding_wait_ms")]
    pub stale_binding_wait_ms: u64,
}

fn default_stale_binding_wait_ms() -> u64 {
    u64::try_from(iop_edge_core::binding::DEFAULT_STALE_WAIT.as_millis()).unwrap_or(1000)
}

/// The three TLS files and how often to re-read them.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The files.
    pub paths: TlsPaths,
    /// Re-read interval; `None` = never.
    pub reload: Option<Duration>,
}

/// Everything the Edge needs, built from the file.
#[derive(Debug)]
pub struct EdgeConfig {
    /// The Edge's id.
    pub edge_id: String,
    /// The Node listener, its Node configs and the pool.
    pub transport: TransportConfig,
    /// The HTTP listener address.
    pub http_listen: SocketAddr,
    /// The HTTP surface.
    pub http: HttpConfig,
    /// Connection limits of the HTTP listener (for [`crate::http::serve_with`]), the drain
    /// bound included.
    pub serve: ServeLimits,
    /// On a graceful stop, how long `/readyz` answers 503 while the Edge still serves, before
    /// its listener closes ([`crate::Edge::draining`]).
    pub drain_notice: Duration,
    /// The Control Plane connector, when configured.
    pub control: Option<ControlConfig>,
    /// The TLS material every listener and dialer reads at each handshake; [`crate::Edge`]
    /// reloads it when [`EdgeConfig::tls_files`] ask for it.
    pub tls: Arc<WorkloadTls>,
    /// Where the TLS material comes from: `None` when it was given in code
    /// ([`EdgeConfigFile::build_with_tls`]; reload it yourself with
    /// [`WorkloadTls::reload_pem`]).
    pub tls_files: Option<TlsFiles>,
    /// Tracing settings; [`crate::Edge::start`] starts the exporter (unless
    /// [`HttpConfig::telemetry`] is already on).
    pub telemetry: iop_telemetry::TelemetryConfig,
    /// The status page's listener (`[admin]`); the embedder serves
    /// [`crate::Edge::status_page`] there (the `iop-edge` binary does).
    pub admin: Option<AdminConfig>,
}

impl EdgeConfigFile {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))
    }

    /// Validates every key, reads the TLS files and key files, and builds the Edge's parts.
    pub fn build(self) -> Result<EdgeConfig, ConfigError> {
        let read = |key: &'static str, p: &Option<PathBuf>| {
            let p = p
                .as_deref()
                .ok_or_else(|| invalid(key, "required (the file's path)"))?;
            std::fs::read(p).map_err(|e| invalid(key, format!("cannot read {}: {e}", p.display())))
        };
        let ca = read("tls.ca", &self.tls.ca)?;
        let cert = read("tls.cert", &self.tls.cert)?;
        let key = read("tls.key", &self.tls.key)?;
        let tls = WorkloadTls::from_pem(&ca, &cert, &key).map_err(material_error)?;
        let files = TlsFiles {
            paths: TlsPaths {
                ca: self.tls.ca.clone().unwrap_or_default(),
                cert: self.tls.cert.clone().unwrap_or_default(),
                key: self.tls.key.clone().unwrap_or_default(),
            },
            reload: (self.tls.reload_sec > 0).then(|| Duration::from_secs(self.tls.reload_sec)),
        };
        self.build_parts(tls, Some(files))
    }

    /// Like [`EdgeConfigFile::build`], with the TLS material given in code (PEM bytes through
    /// [`WorkloadTls::from_pem`], or a development CA's `workload_identity::dev_ca`) instead
    /// of `tls.ca`/`cert`/`key`, which must then be absent (`tls.trust_domain` is still
    /// checked against the certificate). Nothing is reloaded: call
    /// [`WorkloadTls::reload_pem`] on your `Arc` when your material changes.
    pub fn build_with_tls(self, tls: Arc<WorkloadTls>) -> Result<EdgeConfig, ConfigError> {
        for (key, set) in [
            ("tls.ca", self.tls.ca.is_some()),
            ("tls.cert", self.tls.cert.is_some()),
            ("tls.key", self.tls.key.is_some()),
        ] {
            if set {
                return Err(invalid(
                    key,
                    "not used when the TLS material is given in code (build_with_tls)",
                ));
            }
        }
        self.build_parts(tls, None)
    }

    fn build_parts(
        self,
        tls: Arc<WorkloadTls>,
        tls_files: Option<TlsFiles>,
    ) -> Result<EdgeConfig, ConfigError> {
        self.limits.check()?;
        let own = tls.identity();
        if own.role() != role::EDGE
            || own.name() != self.edge_id
            || own.trust_domain() != self.tls.trust_domain
        {
            return Err(invalid(
                "tls.cert",
                format!(
                    "identity {own} is not spiffe://{}/edge/{} (tls.trust_domain, edge_id)",
                    self.tls.trust_domain, self.edge_id
                ),
            ));
        }
        let nodes_expected = ExpectedPeer::any_name(&self.tls.trust_domain, role::NODE)
            .map_err(|e| invalid("tls.trust_domain", e))?;
        let server_tls = tls
            .server_config(nodes_expected)
            .map_err(|e| invalid("tls.ca", e))?;

        let managed = self
            .control_plane
            .as_ref()
            .is_some_and(|c| c.credential_plane);
        let api_keys = match &self.auth {
            None => None,
            Some(a) if managed => {
                // Managed: the Control Plane's tokens authenticate, and its principals carry
                // their limits; only how this Edge enforces them is configured here.
                let legacy = [
                    ("auth.keys_file", a.keys_file.is_some()),
                    ("auth.keys_env", a.keys_env.is_some()),
                    ("auth.limits", a.limits.is_some()),
                    ("auth.key_limits", !a.key_limits.is_empty()),
                ];
                if let Some((key, _)) = legacy.iter().find(|(_, set)| *set) {
                    return Err(invalid(
                        key,
                        "not used in managed mode (control_plane.credential_plane = true): the Control Plane's tokens authenticate requests, and `iop-cp principal limits` sets each principal's limits; only auth.output_estimate and [auth.shared] apply",
                    ));
                }
                None
            }
            Some(a) => Some(Arc::new(
                ApiKeys::load(a.keys_file.as_deref(), a.keys_env.as_deref()).map_err(|e| {
                    let key = if a.keys_file.is_some() && a.keys_env.is_none() {
                        "auth.keys_file"
                    } else if a.keys_file.is_none() {
                        "auth.keys_env"
                    } else {
                        "auth"
                    };
                    invalid(key, e)
                })?,
            )),
        };
        let usage: Option<Arc<dyn crate::usage::UsageSink>> = match &self.usage {
            None => None,
            Some(u) => {
                let mut c = crate::usage::UsageConfig::default();
                if let Some(q) = u.queue {
                    c.queue = q.max(1);
                }
                if let Some(d) = u.retention_days {
                    c.retention_days = d;
                }
                // Managed: the file is also the spool of records for the Control Plane.
                c.ship = managed;
                if let Some(m) = u.spool_max {
                    c.spool_max = m.max(1);
                }
                let store = crate::usage::SqliteUsage::open(&u.sqlite, c)
                    .map_err(|e| invalid("usage.sqlite", e))?;
                Some(store)
            }
        };
        let limiter = match (&self.auth, &api_keys) {
            (auth, keys) if managed || keys.is_some() => {
                let names: BTreeSet<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
                let mut prices = BTreeMap::new();
                for (model, p) in &self.prices {
                    if !names.contains(model.as_str()) {
                        return Err(invalid(
                            "prices",
                            format!("{model}: no [[models]] entry has this name"),
                        ));
                    }
                    let price = crate::limits::budget::Price::per_million_usd(p.input, p.output)
                        .and_then(|price| match p.cached_input {
                            Some(c) => price.with_cached_input_usd(c),
                            None => Some(price),
                        })
                        .ok_or_else(|| {
                            invalid(
                                "prices",
                                format!("{model}: prices are USD per million tokens, 0 or more"),
                            )
                        })?;
                    prices.insert(model.clone(), price);
                }
                let config = match (auth, keys) {
                    (Some(a), Some(keys)) => a.limits(keys, &names, &prices)?,
                    // Managed: always a limiter, for the limits principals get later.
                    (auth, _) => Some(crate::limits::LimitsConfig {
                        prices,
                        output_estimate: auth
                            .as_ref()
                            .and_then(|a| a.output_estimate)
                            .unwrap_or(crate::limits::DEFAULT_OUTPUT_ESTIMATE),
                        shared: match auth.as_ref().and_then(|a| a.shared.as_ref()) {
                            Some(s) => Some(s.build()?),
                            None => None,
                        },
                        ..crate::limits::LimitsConfig::default()
                    })
                    .filter(|_| managed),
                };
                match config {
                    Some(c) => Some(Arc::new(
                        crate::limits::Limiter::new(c)
                            .map_err(|e| invalid("auth.shared.redis", e))?,
                    )),
                    None => None,
                }
            }
            _ => None,
        };

        let mut node_configs = Vec::new();
        let mut kinds = HashMap::new();
        let mut no_stream_usage = std::collections::HashSet::new();
        let mut no_trace_propagation = std::collections::HashSet::new();
        for n in &self.nodes {
            let mut adapters = Vec::new();
            for a in &n.adapters {
                if a.stream_usage == Some(false) {
                    no_stream_usage.insert((n.node_id.clone(), a.name.clone()));
                }
                if a.trace_propagation == Some(false) {
                    no_trace_propagation.insert((n.node_id.clone(), a.name.clone()));
                }
                let (settings, kind) = adapter_settings(a)?;
                kinds.insert((n.node_id.clone(), a.name.clone()), kind);
                adapters.push(AdapterConfig {
                    name: a.name.clone(),
                    adapter_type: a.adapter_type.clone(),
                    enabled: true,
                    capacity: a.capacity,
                    long_context_capacity: a.long_context_capacity,
                    targets: adapter_targets(&a.targets, &self.models, &n.node_id, &a.name),
                    settings,
                });
            }
            node_configs.push((
                n.node_id.clone(),
                NodeConfigPayload {
                    adapters,
                    revision: 1,
                    ..Default::default()
                },
            ));
        }
        let mut providers = Vec::new();
        let mut models = Vec::new();
        for m in &self.models {
            let mut keys = Vec::new();
            for p in &m.providers {
                let Some(kind) = kinds.get(&(p.node_id.clone(), p.adapter.clone())) else {
                    return Err(invalid(
                        "models.providers.adapter",
                        format!("no adapter `{}` on node `{}`", p.adapter, p.node_id),
                    ));
                };
                let key = ProviderKey {
                    node_id: p.node_id.clone(),
                    provider_id: p.provider_id.clone(),
                };
                keys.push(key.clone());
                providers.push(ProviderSpec {
                    key,
                    adapter: p.adapter.clone(),
                    target: p.target.clone(),
                    kind: *kind,
                    category: if *kind == ProviderKind::OpenAiCompat {
                        "api".into()
                    } else {
                        "local_inference".into()
                    },
                    capacity: p.capacity,
                    long_context_capacity: p.long_context_capacity,
                    response_stall_timeout: Duration::from_secs(
                        p.response_stall_timeout_sec.max(1),
                    ),
                    enabled: true,
                });
            }
            models.push((m.name.clone(), keys));
        }
        let mut transport = TransportConfig::new(self.listen.nodes, Arc::new(server_tls));
        let l = &self.limits;
        transport.handshake_timeout = Duration::from_secs(l.tls_handshake_timeout_sec);
        transport.registry.handshake_timeout = Duration::from_secs(l.register_timeout_sec);
        transport.max_unauthenticated = l.max_unauthenticated;
        transport.max_unauthenticated_per_ip = l.max_unauthenticated_per_ip;
        transport.max_stream_buffer = l.stream_buffer_bytes;
        transport.slow_consumer_timeout = Duration::from_secs(l.slow_consumer_timeout_sec);
        transport.stream_window = l.stream_window();
        transport.node_configs = node_configs;
        transport.pool = Some(PoolConfig {
            models: models.clone(),
            providers,
            max_queue: self.pool.max_queue,
        });
        let admin = match &self.admin {
            None => None,
            Some(a) => {
                if a.listen == self.listen.http {
                    return Err(invalid(
                        "admin.listen",
                        "the status page needs its own listener, not the API's",
                    ));
                }
                let text = std::fs::read_to_string(&a.token_file).map_err(|e| {
                    invalid(
                        "admin.token_file",
                        format!("{}: {}", a.token_file.display(), e.kind()),
                    )
                })?;
                let token = crate::admin::AdminToken::new(&text).ok_or_else(|| {
                    invalid(
                        "admin.token_file",
                        "the token must be one line of at least 16 printable characters",
                    )
                })?;
                Some(AdminConfig {
                    listen: a.listen,
                    token,
                })
            }
        };
        let telemetry = self
            .telemetry
            .to_config()
            .map_err(|e| invalid("telemetry", e))?;
        let control = match &self.control_plane {
            None => None,
            Some(cp) => {
                let expected =
                    ExpectedPeer::exact(&self.tls.trust_domain, role::CONTROL_PLANE, &cp.name)
                        .map_err(|e| invalid("control_plane.name", e))?;
                let client = tls
                    .client_config(expected)
                    .map_err(|e| invalid("tls.ca", e))?;
                let addresses = match (&cp.address, cp.addresses.is_empty()) {
                    (Some(a), true) => vec![a.clone()],
                    (None, false) => cp.addresses.clone(),
                    _ => {
                        return Err(invalid(
                            "control_plane.address",
                            "give address or addresses (a list of replicas), not both",
                        ));
                    }
                };
                if !(1..=60_000).contains(&cp.stale_binding_wait_ms) {
                    return Err(invalid(
                        "control_plane.stale_binding_wait_ms",
                        "must be between 1 and 60000",
                    ));
                }
                Some(ControlConfig {
                    addresses,
                    server_name: rustls_pki_types::ServerName::try_from(cp.server_name.clone())
                        .map_err(|_| {
                            invalid("control_plane.server_name", "not a DNS name or IP")
                        })?,
                    tls: Arc::new(client),
                    edge_id: self.edge_id.clone(),
                    managed: cp.credential_plane,
                    max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
                    dialer: None,
                    jitter_seed: None,
                    binding: crate::control::BindingConfig::with_stale_wait(Duration::from_millis(
                        cp.stale_binding_wait_ms,
                    )),
                })
            }
        };
        Ok(EdgeConfig {
            edge_id: self.edge_id,
            transport,
            http_listen: self.listen.http,
            http: HttpConfig {
                no_stream_usage,
                no_trace_propagation,
                api_keys,
                limiter: {
                    if let (Some(l), Some(u)) = (&limiter, &usage) {
                        l.set_usage(Arc::clone(u));
                    }
                    limiter
                },
                usage,
                body_timeout: Duration::from_secs(self.limits.http_body_timeout_sec),
                ..HttpConfig::new(
                    models.into_iter().map(|(m, _)| m).collect(),
                    Duration::from_secs(self.pool.queue_wait_sec),
                )
            },
            serve: ServeLimits {
                max_connections: self.limits.http_max_connections,
                header_timeout: Duration::from_secs(self.limits.http_header_timeout_sec),
                drain_timeout: Duration::from_secs(self.limits.drain_timeout_sec),
                ..ServeLimits::default()
            },
            drain_notice: Duration::from_secs(self.limits.drain_notice_sec),
            control,
            tls,
            tls_files,
            telemetry,
            admin,
        })
    }
}

/// The targets an adapter is told: those `[[nodes.adapters]] targets` lists, then every
/// `[[models.providers]]` target bound to it that the list lacks. The Node probes exactly
/// these on a recovery probe (seed 000's CAPABILITIES), and an adapter with a list serves no
/// other target, so a provider's own target must be on it: without this, an adapter declared
/// without `targets` was never probed, and an overlay on it could only clear when its Node
/// reconnected.
fn adapter_targets(
    declared: &[String],
    models: &[Model],
    node_id: &str,
    adapter: &str,
) -> Vec<String> {
    let mut targets = declared.to_vec();
    for p in models.iter().flat_map(|m| &m.providers) {
        if p.node_id == node_id && p.adapter == adapter && !targets.contains(&p.target) {
            targets.push(p.target.clone());
        }
    }
    targets
}

/// An adapter's settings and dispatch kind.
fn adapter_settings(a: &Adapter) -> Result<(AdapterSettings, ProviderKind), ConfigError> {
    match a.adapter_type.as_str() {
        "openai_compat" => {
            if a.base_url.is_empty() {
                return Err(invalid(
                    "nodes.adapters.base_url",
                    format!("adapter `{}`: required for openai_compat", a.name),
                ));
            }
            let preset = a.profile.as_deref().unwrap_or(DEFAULT_PRESET);
            let profile = match &a.operations {
                None => {
                    Profile::preset(preset).map_err(|e| invalid("nodes.adapters.profile", e))?
                }
                Some(ops) => Profile::custom(preset, preset, ops)
                    .map_err(|e| invalid("nodes.adapters.operations", e))?,
            };
            Ok((
                AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                    base_url: a.base_url.clone(),
                    protocol_profile: profile,
                    request_timeout_sec: a.request_timeout_sec,
                }),
                ProviderKind::OpenAiCompat,
            ))
        }
        // `ollama`, `demo`, or a native type the embedder registers on its Nodes
        // (`iop_node::AdapterRegistry::register`); a Node refuses a type it does not have.
        native if is_adapter_type(native) => {
            if a.profile.is_some() || a.operations.is_some() {
                return Err(invalid(
                    "nodes.adapters.profile",
                    format!(
                        "adapter `{}`: only openai_compat adapters have a profile",
                        a.name
                    ),
                ));
            }
            Ok((
                AdapterSettings::Native(NativeSettings {
                    base_url: a.base_url.clone(),
                    options: a.options.clone(),
                }),
                ProviderKind::Native,
            ))
        }
        _ => Err(invalid(
            "nodes.adapters.type",
            "must be openai_compat, ollama, demo or a native type of 1-64 characters of a-z 0-9 _ -",
        )),
    }
}

/// A native adapter type name: what a Node's `AdapterRegistry` can register.
fn is_adapter_type(t: &str) -> bool {
    (1..=64).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn adapter(extra: &str) -> Adapter {
        toml::from_str(&format!(
            "name = \"a\"\ntype = \"openai_compat\"\nbase_url = \"http://x/v1\"\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn adapter_profiles_resolve_from_presets_and_errors_name_the_key() {
        let (s, kind) = adapter_settings(&adapter("")).unwrap();
        assert_eq!(kind, ProviderKind::OpenAiCompat);
        let AdapterSettings::OpenAiCompat(s) = s else {
            panic!("openai_compat settings")
        };
        assert_eq!(s.protocol_profile.name, "chat_only");
        let (s, _) = adapter_settings(&adapter("profile = \"anthropic\"")).unwrap();
        let AdapterSettings::OpenAiCompat(s) = s else {
            panic!("openai_compat settings")
        };
        assert_eq!(s.protocol_profile.auth_header, "x-api-key");
        let e = adapter_settings(&adapter("profile = \"claude\"")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("nodes.adapters.profile: unknown profile preset `claude`"),
            "{e}"
        );
        let e = adapter_settings(&adapter("operations = { chat = \"/c\" }")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("nodes.adapters.operations: unknown operation `chat`"),
            "{e}"
        );
        let e =
            adapter_settings(&toml::from_str("name = \"a\"\ntype = \"openai_compat\"").unwrap())
                .unwrap_err();
        assert!(e.to_string().starts_with("nodes.adapters.base_url:"), "{e}");
        let e = EdgeConfigFile::parse("edge_id = \"e\"\nbogus = 1\n").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }
}
