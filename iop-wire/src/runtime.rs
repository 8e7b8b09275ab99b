//! Domain types of the Edge ⇄ Node runtime wire (`proto/runtime.proto`).
//!
//! Each type converts from the generated protobuf type with validation (`TryFrom`, crate
//! internal) and back with `to_proto`. A [`RuntimeFrame`] is what the
//! [`codec`](crate::codec) reads and writes; its [`RuntimeMessage`] names every message of the
//! contract.
//!
//! Choices where seed 000 is silent (also listed in the crate docs):
//!
//! - Run and tunnel streams are named by the envelope's `stream_id` (non-zero, Edge-chosen);
//!   `run_id` is the provider run id that `CancelRequest` names.
//! - `ExecutionFailure`'s "allowlisted metadata" is a fixed set of typed fields; there is no
//!   free-form map to leak through.
//! - Fields that do not belong to a tunnel frame's kind (a status on a BODY frame, say) are
//!   ignored on receipt and not re-encoded.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::error::InvalidMessage;
use crate::proto::runtime as pb;
use crate::validate::{self, ResponseStallTimeout};

// === impl RuntimeFrame ===

/// One frame of the runtime wire: envelope ids plus one message.
#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeFrame {
    /// Request/response pairing; zero when unused.
    pub correlation_id: u64,
    /// Run/tunnel stream; zero for connection-level messages.
    pub stream_id: u64,
    /// The message.
    pub message: RuntimeMessage,
}

impl RuntimeFrame {
    /// A connection-level frame (no correlation, no stream).
    pub fn new(message: RuntimeMessage) -> Self {
        Self {
            correlation_id: 0,
            stream_id: 0,
            message,
        }
    }

    /// A frame of the run/tunnel stream `stream_id`.
    pub fn on_stream(stream_id: u64, message: RuntimeMessage) -> Self {
        Self {
            correlation_id: 0,
            stream_id,
            message,
        }
    }

    /// A request or response paired by `correlation_id`.
    pub fn correlated(correlation_id: u64, message: RuntimeMessage) -> Self {
        Self {
            correlation_id,
            stream_id: 0,
            message,
        }
    }

    pub(crate) fn to_proto(&self) -> pb::Envelope {
        use pb::envelope::Message as M;
        let message = match &self.message {
            RuntimeMessage::RegisterRequest(m) => M::RegisterRequest(m.to_proto()),
            RuntimeMessage::RegisterResponse(m) => M::RegisterResponse(m.to_proto()),
            RuntimeMessage::NodeReadyRequest(m) => M::NodeReadyRequest(m.to_proto()),
            RuntimeMessage::NodeReadyResponse(m) => M::NodeReadyResponse(m.to_proto()),
            RuntimeMessage::RunRequest(m) => M::RunRequest(m.to_proto()),
            RuntimeMessage::RunEvent(m) => M::RunEvent(m.to_proto()),
            RuntimeMessage::ProviderTunnelRequest(m) => M::ProviderTunnelRequest(m.to_proto()),
            RuntimeMessage::ProviderTunnelFrame(m) => M::ProviderTunnelFrame(m.to_proto()),
            RuntimeMessage::CancelRequest(m) => M::CancelRequest(m.to_proto()),
            RuntimeMessage::NodeCommandRequest(m) => M::NodeCommandRequest(m.to_proto()),
            RuntimeMessage::NodeCommandResponse(m) => M::NodeCommandResponse(m.to_proto()),
            RuntimeMessage::NodeConfigRefreshRequest(m) => {
                M::NodeConfigRefreshRequest(pb::NodeConfigRefreshRequest {
                    config: Some(m.to_proto()),
                })
            }
            RuntimeMessage::NodeConfigRefreshResponse(m) => {
                M::NodeConfigRefreshResponse(m.to_proto())
            }
            RuntimeMessage::Ping => M::Ping(pb::Ping {}),
            RuntimeMessage::Pong => M::Pong(pb::Pong {}),
        };
        pb::Envelope {
            correlation_id: self.correlation_id,
            stream_id: self.stream_id,
            message: Some(message),
        }
    }
}

impl TryFrom<pb::Envelope> for RuntimeFrame {
    type Error = InvalidMessage;

    fn try_from(env: pb::Envelope) -> Result<Self, Self::Error> {
        use pb::envelope::Message as M;
        let message = match env.message.ok_or(InvalidMessage::EmptyEnvelope)? {
            M::RegisterRequest(m) => RuntimeMessage::RegisterRequest(m.try_into()?),
            M::RegisterResponse(m) => RuntimeMessage::RegisterResponse(m.try_into()?),
            M::NodeReadyRequest(m) => RuntimeMessage::NodeReadyRequest(m.try_into()?),
            M::NodeReadyResponse(m) => RuntimeMessage::NodeReadyResponse(m.try_into()?),
            M::RunRequest(m) => RuntimeMessage::RunRequest(m.try_into()?),
            M::RunEvent(m) => RuntimeMessage::RunEvent(m.try_into()?),
            M::ProviderTunnelRequest(m) => RuntimeMessage::ProviderTunnelRequest(m.try_into()?),
            M::ProviderTunnelFrame(m) => RuntimeMessage::ProviderTunnelFrame(m.try_into()?),
            M::CancelRequest(m) => RuntimeMessage::CancelRequest(m.try_into()?),
            M::NodeCommandRequest(m) => RuntimeMessage::NodeCommandRequest(m.try_into()?),
            M::NodeCommandResponse(m) => RuntimeMessage::NodeCommandResponse(m.try_into()?),
            M::NodeConfigRefreshRequest(m) => RuntimeMessage::NodeConfigRefreshRequest(
                m.config
                    .ok_or(InvalidMessage::MissingField("config"))?
                    .try_into()?,
            ),
            M::NodeConfigRefreshResponse(m) => {
                RuntimeMessage::NodeConfigRefreshResponse(m.try_into()?)
            }
            M::Ping(_) => RuntimeMessage::Ping,
            M::Pong(_) => RuntimeMessage::Pong,
        };
        let on_stream = matches!(
            message,
            RuntimeMessage::RunRequest(_)
                | RuntimeMessage::RunEvent(_)
                | RuntimeMessage::ProviderTunnelRequest(_)
                | RuntimeMessage::ProviderTunnelFrame(_)
        );
        match (on_stream, env.stream_id) {
            (true, 0) => return Err(InvalidMessage::StreamId("missing on a stream message")),
            (false, id) if id != 0 => {
                return Err(InvalidMessage::StreamId(
                    "set on a connection-level message",
                ));
            }
            _ => {}
        }
        Ok(Self {
            correlation_id: env.correlation_id,
            stream_id: env.stream_id,
            message,
        })
    }
}

/// Every message of the runtime wire.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum RuntimeMessage {
    /// Node → Edge, first frame.
    RegisterRequest(RegisterRequest),
    /// Edge → Node.
    RegisterResponse(RegisterResponse),
    /// Node → Edge, after config is applied and handlers are installed.
    NodeReadyRequest(NodeReadyRequest),
    /// Edge → Node.
    NodeReadyResponse(NodeReadyResponse),
    /// Edge → Node: normalized execution.
    RunRequest(RunRequest),
    /// Node → Edge: normalized execution event.
    RunEvent(RunEvent),
    /// Edge → Node: provider raw tunnel.
    ProviderTunnelRequest(ProviderTunnelRequest),
    /// Node → Edge: ordered tunnel frame.
    ProviderTunnelFrame(TunnelFrame),
    /// Edge → Node: cancel a run or tunnel by run id.
    CancelRequest(CancelRequest),
    /// Edge → Node: query/control command.
    NodeCommandRequest(NodeCommandRequest),
    /// Node → Edge.
    NodeCommandResponse(NodeCommandResponse),
    /// Edge → Node: apply a new config payload.
    NodeConfigRefreshRequest(NodeConfigPayload),
    /// Node → Edge.
    NodeConfigRefreshResponse(NodeConfigRefreshResponse),
    /// Liveness probe; answered with [`RuntimeMessage::Pong`].
    Ping,
    /// Answer to [`RuntimeMessage::Ping`].
    Pong,
}

impl RuntimeMessage {
    /// The message name, for logs and metric labels (a closed set).
    pub fn name(&self) -> &'static str {
        match self {
            Self::RegisterRequest(_) => "register_request",
            Self::RegisterResponse(_) => "register_response",
            Self::NodeReadyRequest(_) => "node_ready_request",
            Self::NodeReadyResponse(_) => "node_ready_response",
            Self::RunRequest(_) => "run_request",
            Self::RunEvent(_) => "run_event",
            Self::ProviderTunnelRequest(_) => "provider_tunnel_request",
            Self::ProviderTunnelFrame(_) => "provider_tunnel_frame",
            Self::CancelRequest(_) => "cancel_request",
            Self::NodeCommandRequest(_) => "node_command_request",
            Self::NodeCommandResponse(_) => "node_command_response",
            Self::NodeConfigRefreshRequest(_) => "node_config_refresh_request",
            Self::NodeConfigRefreshResponse(_) => "node_config_refresh_response",
            Self::Ping => "ping",
            Self::Pong => "pong",
        }
    }
}

// === Registration and readiness ===

/// Node → Edge: register this connection as `node_id`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegisterRequest {
    /// The Node identity; must equal the name in the Node's workload certificate.
    pub node_id: String,
    /// Node software version (diagnostic).
    pub version: String,
    /// Adapter types the Node can run.
    pub adapter_types: Vec<String>,
    /// The Node's lease recipient key, when it has one.
    pub recipient: Option<RecipientKey>,
}

/// A Node's X25519 lease recipient public key and its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecipientKey {
    /// Key id (for rotation).
    pub key_id: String,
    /// The 32-byte X25519 public key.
    pub public_key: [u8; 32],
}

impl RegisterRequest {
    pub(crate) fn to_proto(&self) -> pb::RegisterRequest {
        pb::RegisterRequest {
            node_id: self.node_id.clone(),
            version: self.version.clone(),
            adapter_types: self.adapter_types.clone(),
            recipient_public_key: self
                .recipient
                .as_ref()
                .map_or_else(Bytes::new, |r| Bytes::copy_from_slice(&r.public_key)),
            recipient_key_id: self
                .recipient
                .as_ref()
                .map(|r| r.key_id.clone())
                .unwrap_or_default(),
        }
    }
}

impl TryFrom<pb::RegisterRequest> for RegisterRequest {
    type Error = InvalidMessage;

    fn try_from(m: pb::RegisterRequest) -> Result<Self, Self::Error> {
        validate::node_id("node_id", &m.node_id)?;
        validate::text("version", &m.version)?;
        if m.adapter_types.len() > 64 {
            return Err(InvalidMessage::TooLong("adapter_types"));
        }
        for t in &m.adapter_types {
            validate::id("adapter_types", t)?;
        }
        let recipient = match (
            m.recipient_public_key.is_empty(),
            m.recipient_key_id.is_empty(),
        ) {
            (true, true) => None,
            (false, false) => {
                validate::id("recipient_key_id", &m.recipient_key_id)?;
                let public_key =
                    <[u8; 32]>::try_from(&m.recipient_public_key[..]).map_err(|_| {
                        InvalidMessage::InvalidValue {
                            field: "recipient_public_key",
                            rule: "must be 32 bytes",
                        }
                    })?;
                Some(RecipientKey {
                    key_id: m.recipient_key_id,
                    public_key,
                })
            }
            _ => {
                return Err(InvalidMessage::InvalidValue {
                    field: "recipient_public_key",
                    rule: "key and key id come together",
                });
            }
        };
        Ok(Self {
            node_id: m.node_id,
            version: m.version,
            adapter_types: m.adapter_types,
            recipient,
        })
    }
}

/// Edge → Node: the answer to registration.
#[derive(Clone, Debug, PartialEq)]
pub enum RegisterResponse {
    /// Ownership claimed as *pending*: apply `config`, then send ready.
    Accepted {
        /// The Node identity to use in the ready request.
        node_id: String,
        /// The configuration to apply.
        config: NodeConfigPayload,
        /// Expected heartbeat interval; `None` = receiver default.
        heartbeat_interval: Option<Duration>,
    },
    /// Refused; the Node closes and reconnects under its policy.
    Rejected {
        /// Stable, low-sensitivity reason.
        reason: String,
    },
}

impl RegisterResponse {
    pub(crate) fn to_proto(&self) -> pb::RegisterResponse {
        match self {
            Self::Accepted {
                node_id,
                config,
                heartbeat_interval,
            } => pb::RegisterResponse {
                accepted: true,
                reason: String::new(),
                node_id: node_id.clone(),
                config: Some(config.to_proto()),
                heartbeat_interval_ms: heartbeat_interval
                    .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX)),
            },
            Self::Rejected { reason } => pb::RegisterResponse {
                accepted: false,
                reason: reason.clone(),
                ..Default::default()
            },
        }
    }
}

impl TryFrom<pb::RegisterResponse> for RegisterResponse {
    type Error = InvalidMessage;

    fn try_from(m: pb::RegisterResponse) -> Result<Self, Self::Error> {
        validate::text("reason", &m.reason)?;
        if !m.accepted {
            return Ok(Self::Rejected { reason: m.reason });
        }
        validate::node_id("node_id", &m.node_id)?;
        Ok(Self::Accepted {
            node_id: m.node_id,
            config: m
                .config
                .ok_or(InvalidMessage::MissingField("config"))?
                .try_into()?,
            heartbeat_interval: (m.heartbeat_interval_ms != 0)
                .then(|| Duration::from_millis(u64::from(m.heartbeat_interval_ms))),
        })
    }
}

/// Node → Edge: this Node is ready for dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeReadyRequest {
    /// The node id from the accepted [`RegisterResponse`].
    pub node_id: String,
}

impl NodeReadyRequest {
    pub(crate) fn to_proto(&self) -> pb::NodeReadyRequest {
        pb::NodeReadyRequest {
            node_id: self.node_id.clone(),
        }
    }
}

impl TryFrom<pb::NodeReadyRequest> for NodeReadyRequest {
    type Error = InvalidMessage;

    fn try_from(m: pb::NodeReadyRequest) -> Result<Self, Self::Error> {
        validate::node_id("node_id", &m.node_id)?;
        Ok(Self { node_id: m.node_id })
    }
}

/// Edge → Node: the answer to ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeReadyResponse {
    /// Dispatch-ready (first transition or duplicate from the same ready owner).
    Ready,
    /// Stale, superseded or rejected: close the session and reconnect.
    NotReady {
        /// Stable, low-sensitivity reason.
        reason: String,
    },
}

impl NodeReadyResponse {
    pub(crate) fn to_proto(&self) -> pb::NodeReadyResponse {
        match self {
            Self::Ready => pb::NodeReadyResponse {
                ready: true,
                reason: String::new(),
            },
            Self::NotReady { reason } => pb::NodeReadyResponse {
                ready: false,
                reason: reason.clone(),
            },
        }
    }
}

impl TryFrom<pb::NodeReadyResponse> for NodeReadyResponse {
    type Error = InvalidMessage;

    fn try_from(m: pb::NodeReadyResponse) -> Result<Self, Self::Error> {
        validate::text("reason", &m.reason)?;
        Ok(if m.ready {
            Self::Ready
        } else {
            Self::NotReady { reason: m.reason }
        })
    }
}

// === Node configuration ===

/// The adapter configuration the Edge sends to a Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeConfigPayload {
    /// Adapter instances; instance identities are unique.
    pub adapters: Vec<AdapterConfig>,
    /// Legacy runtime metadata.
    pub runtime: NodeRuntimeConfig,
    /// Edge-side revision (diagnostic).
    pub revision: u64,
}

/// Most adapter instances one config payload may carry.
pub const MAX_ADAPTERS: usize = 256;

impl NodeConfigPayload {
    pub(crate) fn to_proto(&self) -> pb::NodeConfigPayload {
        pb::NodeConfigPayload {
            adapters: self.adapters.iter().map(AdapterConfig::to_proto).collect(),
            runtime: Some(pb::NodeRuntimeConfig {
                concurrency: self.runtime.concurrency,
            }),
            revision: self.revision,
        }
    }
}

impl TryFrom<pb::NodeConfigPayload> for NodeConfigPayload {
    type Error = InvalidMessage;

    fn try_from(m: pb::NodeConfigPayload) -> Result<Self, Self::Error> {
        if m.adapters.len() > MAX_ADAPTERS {
            return Err(InvalidMessage::TooLong("adapters"));
        }
        let adapters = m
            .adapters
            .into_iter()
            .map(AdapterConfig::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let mut keys: Vec<&str> = adapters.iter().map(AdapterConfig::instance_key).collect();
        keys.sort_unstable();
        if keys.windows(2).any(|w| w[0] == w[1]) {
            return Err(InvalidMessage::InvalidValue {
                field: "adapters.name",
                rule: "instance identities must be unique",
            });
        }
        Ok(Self {
            adapters,
            runtime: NodeRuntimeConfig {
                concurrency: m.runtime.map_or(0, |r| r.concurrency),
            },
            revision: m.revision,
        })
    }
}

/// Legacy runtime metadata. `concurrency` is not an admission gate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeRuntimeConfig {
    /// Legacy compatibility value.
    pub concurrency: u32,
}

/// One adapter instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterConfig {
    /// Instance identity; empty means the legacy single instance named by `adapter_type`.
    pub name: String,
    /// Adapter type.
    pub adapter_type: String,
    /// Whether the instance is started.
    pub enabled: bool,
    /// Local capacity gate size.
    pub capacity: u32,
    /// Of which long-context.
    pub long_context_capacity: u32,
    /// Provider targets served.
    pub targets: Vec<String>,
    /// Type-specific settings.
    pub settings: AdapterSettings,
}

impl AdapterConfig {
    /// The instance identity: `name`, or the type name for the legacy single instance.
    pub fn instance_key(&self) -> &str {
        if self.name.is_empty() {
            &self.adapter_type
        } else {
            &self.name
        }
    }

    fn to_proto(&self) -> pb::AdapterConfig {
        use pb::adapter_config::Settings;
        pb::AdapterConfig {
            name: self.name.clone(),
            r#type: self.adapter_type.clone(),
            enabled: self.enabled,
            capacity: self.capacity,
            long_context_capacity: self.long_context_capacity,
            targets: self.targets.clone(),
            settings: match &self.settings {
                AdapterSettings::None => None,
                AdapterSettings::OpenAiCompat(s) => {
                    Some(Settings::OpenaiCompat(pb::OpenAiCompatAdapterConfig {
                        base_url: s.base_url.clone(),
                        protocol_profile: Some(pb::ConcreteProtocolProfile {
                            name: s.protocol_profile.name.clone(),
                            operation_paths: s
                                .protocol_profile
                                .operation_paths
                                .iter()
                                .map(|(op, path)| (op.as_str().to_owned(), path.clone()))
                                .collect(),
                            health_path: s.protocol_profile.health_path.clone(),
                            auth_header: s.protocol_profile.auth_header.clone(),
                            auth_prefix: s.protocol_profile.auth_prefix.clone(),
                            headers: headers_to_proto(&s.protocol_profile.headers),
                        }),
                        request_timeout_sec: s.request_timeout_sec,
                    }))
                }
                AdapterSettings::Native(s) => Some(Settings::Native(pb::NativeAdapterConfig {
                    base_url: s.base_url.clone(),
                    options: s.options.clone(),
                })),
            },
        }
    }
}

impl TryFrom<pb::AdapterConfig> for AdapterConfig {
    type Error = InvalidMessage;

    fn try_from(m: pb::AdapterConfig) -> Result<Self, Self::Error> {
        use pb::adapter_config::Settings;
        validate::optional_id("adapters.name", &m.name)?;
        validate::id("adapters.type", &m.r#type)?;
        if m.long_context_capacity > m.capacity {
            return Err(InvalidMessage::InvalidValue {
                field: "adapters.long_context_capacity",
                rule: "must not exceed capacity",
            });
        }
        if m.targets.len() > 1024 {
            return Err(InvalidMessage::TooLong("adapters.targets"));
        }
        for t in &m.targets {
            validate::target("adapters.targets", t)?;
        }
        let settings = match m.settings {
            None => AdapterSettings::None,
            Some(Settings::OpenaiCompat(s)) => {
                validate::text("adapters.openai_compat.base_url", &s.base_url)?;
                let profile = s.protocol_profile.unwrap_or_default();
                validate::text(
                    "adapters.openai_compat.protocol_profile.name",
                    &profile.name,
                )?;
                validate::text(
                    "adapters.openai_compat.protocol_profile.health_path",
                    &profile.health_path,
                )?;
                let mut operation_paths = BTreeMap::new();
                for (op, path) in profile.operation_paths {
                    let op = Operation::parse(&op).ok_or(InvalidMessage::InvalidValue {
                        field: "adapters.openai_compat.protocol_profile.operation_paths",
                        rule: "unknown operation",
                    })?;
                    validate::text(
                        "adapters.openai_compat.protocol_profile.operation_paths",
                        &path,
                    )?;
                    operation_paths.insert(op, path);
                }
                if !profile.auth_header.is_empty() {
                    validate::header_name(&profile.auth_header)?;
                }
                validate::header_value(profile.auth_prefix.as_bytes())?;
                if profile.headers.len() > MAX_PROFILE_HEADERS {
                    return Err(InvalidMessage::TooLong(
                        "adapters.openai_compat.protocol_profile.headers",
                    ));
                }
                AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                    base_url: s.base_url,
                    protocol_profile: ConcreteProtocolProfile {
                        name: profile.name,
                        operation_paths,
                        health_path: profile.health_path,
                        auth_header: profile.auth_header,
                        auth_prefix: profile.auth_prefix,
                        headers: headers_from_proto(profile.headers)?,
                    },
                    request_timeout_sec: s.request_timeout_sec,
                })
            }
            Some(Settings::Native(s)) => {
                validate::text("adapters.native.base_url", &s.base_url)?;
                metadata("adapters.native.options", &s.options)?;
                AdapterSettings::Native(NativeSettings {
                    base_url: s.base_url,
                    options: s.options,
                })
            }
        };
        Ok(Self {
            name: m.name,
            adapter_type: m.r#type,
            enabled: m.enabled,
            capacity: m.capacity,
            long_context_capacity: m.long_context_capacity,
            targets: m.targets,
            settings,
        })
    }
}

/// Type-specific adapter settings.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdapterSettings {
    /// No settings (e.g. the demo adapter).
    None,
    /// OpenAI-compatible passthrough.
    OpenAiCompat(OpenAiCompatSettings),
    /// Native/normalized adapter (e.g. Ollama).
    Native(NativeSettings),
}

/// OpenAI-compatible passthrough settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenAiCompatSettings {
    /// Upstream base URL.
    pub base_url: String,
    /// The resolved concrete protocol profile.
    pub protocol_profile: ConcreteProtocolProfile,
    /// Provider request timeout; 0 = Node default.
    pub request_timeout_sec: u32,
}

/// A resolved protocol profile.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConcreteProtocolProfile {
    /// Profile name (diagnostic).
    pub name: String,
    /// Operation → upstream path relative to the base URL.
    pub operation_paths: BTreeMap<Operation, String>,
    /// Health probe path; empty = the `models` operation path.
    pub health_path: String,
    /// The header a credential the Node holds itself is written into (legacy mode); empty =
    /// `authorization` with the `Bearer ` prefix. Managed leases declare their own header.
    pub auth_header: String,
    /// The value prefix before the secret in `auth_header` (used when `auth_header` is set).
    pub auth_prefix: String,
    /// Fixed request headers the upstream protocol requires (e.g. `anthropic-version`), sent
    /// on every request and probe; at most [`MAX_PROFILE_HEADERS`].
    pub headers: Vec<Header>,
}

/// Most fixed headers one protocol profile declares.
pub const MAX_PROFILE_HEADERS: usize = 32;

impl ConcreteProtocolProfile {
    /// The `(header, prefix)` a credential the Node holds itself is written as.
    pub fn credential_header(&self) -> (&str, &str) {
        if self.auth_header.is_empty() {
            ("authorization", "Bearer ")
        } else {
            (&self.auth_header, &self.auth_prefix)
        }
    }

    /// Whether the upstream serves `operation`.
    pub fn serves(&self, operation: Operation) -> bool {
        self.operation_paths.contains_key(&operation)
    }
}

/// Native adapter settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NativeSettings {
    /// Upstream base URL; empty for adapters without network.
    pub base_url: String,
    /// Adapter-specific options.
    pub options: BTreeMap<String, String>,
}

/// Edge → Node / Node → Edge: outcome of a config refresh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeConfigRefreshResponse {
    /// What the Node did.
    pub outcome: ConfigRefreshOutcome,
    /// Reason for `RestartRequired` or `Failed`.
    pub reason: String,
    /// The revision the Node now runs.
    pub revision: u64,
}

/// What a Node did with a config refresh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConfigRefreshOutcome {
    /// Applied on the live session.
    Applied,
    /// Takes effect only after a restart.
    RestartRequired,
    /// Rejected; the old config stays.
    Failed,
}

impl NodeConfigRefreshResponse {
    pub(crate) fn to_proto(&self) -> pb::NodeConfigRefreshResponse {
        pb::NodeConfigRefreshResponse {
            outcome: match self.outcome {
                ConfigRefreshOutcome::Applied => pb::ConfigRefreshOutcome::Applied,
                ConfigRefreshOutcome::RestartRequired => pb::ConfigRefreshOutcome::RestartRequired,
                ConfigRefreshOutcome::Failed => pb::ConfigRefreshOutcome::Failed,
            } as i32,
            reason: self.reason.clone(),
            revision: self.revision,
        }
    }
}

impl TryFrom<pb::NodeConfigRefreshResponse> for NodeConfigRefreshResponse {
    type Error = InvalidMessage;

    fn try_from(m: pb::NodeConfigRefreshResponse) -> Result<Self, Self::Error> {
        validate::text("reason", &m.reason)?;
        let outcome = match pb::ConfigRefreshOutcome::try_from(m.outcome) {
            Ok(pb::ConfigRefreshOutcome::Applied) => ConfigRefreshOutcome::Applied,
            Ok(pb::ConfigRefreshOutcome::RestartRequired) => ConfigRefreshOutcome::RestartRequired,
            Ok(pb::ConfigRefreshOutcome::Failed) => ConfigRefreshOutcome::Failed,
            Ok(pb::ConfigRefreshOutcome::Unspecified) | Err(_) => {
                return Err(InvalidMessage::UnknownEnum("outcome"));
            }
        };
        Ok(Self {
            outcome,
            reason: m.reason,
            revision: m.revision,
        })
    }
}

// === Credential leases ===

/// The exact dispatch scope of a managed credential lease.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CredentialLeaseBinding {
    /// Principal the request authenticated as.
    pub principal_id: String,
    /// Credential slot.
    pub slot_id: String,
    /// Route.
    pub route_id: String,
    /// Protocol profile.
    pub profile: String,
    /// Upstream target.
    pub upstream_target: String,
    /// Selected Node.
    pub node_id: String,
    /// Selected Node's recipient key id.
    pub recipient_key_id: String,
    /// Credential slot revision.
    pub credential_revision: u64,
    /// Route revision.
    pub route_revision: u64,
    /// Projection generation the Edge resolved the route under.
    pub projection_generation: u64,
}

impl CredentialLeaseBinding {
    pub(crate) fn to_proto(&self) -> pb::CredentialLeaseBinding {
        pb::CredentialLeaseBinding {
            principal_id: self.principal_id.clone(),
            slot_id: self.slot_id.clone(),
            route_id: self.route_id.clone(),
            profile: self.profile.clone(),
            upstream_target: self.upstream_target.clone(),
            node_id: self.node_id.clone(),
            recipient_key_id: self.recipient_key_id.clone(),
            credential_revision: self.credential_revision,
            route_revision: self.route_revision,
            projection_generation: self.projection_generation,
        }
    }
}

impl TryFrom<pb::CredentialLeaseBinding> for CredentialLeaseBinding {
    type Error = InvalidMessage;

    fn try_from(m: pb::CredentialLeaseBinding) -> Result<Self, Self::Error> {
        validate::id("credential_binding.principal_id", &m.principal_id)?;
        validate::id("credential_binding.slot_id", &m.slot_id)?;
        validate::id("credential_binding.route_id", &m.route_id)?;
        validate::id("credential_binding.profile", &m.profile)?;
        validate::target("credential_binding.upstream_target", &m.upstream_target)?;
        validate::node_id("credential_binding.node_id", &m.node_id)?;
        validate::id("credential_binding.recipient_key_id", &m.recipient_key_id)?;
        Ok(Self {
            principal_id: m.principal_id,
            slot_id: m.slot_id,
            route_id: m.route_id,
            profile: m.profile,
            upstream_target: m.upstream_target,
            node_id: m.node_id,
            recipient_key_id: m.recipient_key_id,
            credential_revision: m.credential_revision,
            route_revision: m.route_revision,
            projection_generation: m.projection_generation,
        })
    }
}

/// A signed, recipient-sealed lease as it travels. `iop-lease` verifies and opens it; this
/// crate only bounds its sizes.
#[derive(Clone, PartialEq, Eq)]
pub struct CredentialLease {
    /// Envelope format version.
    pub version: u32,
    /// 128-bit lease id.
    pub lease_id: [u8; 16],
    /// Signing issuer key id.
    pub issuer_key_id: String,
    /// Issue time, Unix milliseconds.
    pub issued_at_unix_ms: i64,
    /// Expiry, Unix milliseconds.
    pub not_after_unix_ms: i64,
    /// HPKE encapsulated key.
    pub enc: Bytes,
    /// Recipient X25519 public key.
    pub recipient_public_key: Bytes,
    /// HPKE ciphertext.
    pub ciphertext: Bytes,
    /// Issuer signature.
    pub signature: Bytes,
}

impl std::fmt::Debug for CredentialLease {
    // Sealed material is not secret, but it has no business in logs either.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialLease")
            .field("version", &self.version)
            .field("issuer_key_id", &self.issuer_key_id)
            .field("not_after_unix_ms", &self.not_after_unix_ms)
            .finish_non_exhaustive()
    }
}

impl CredentialLease {
    pub(crate) fn to_proto(&self) -> pb::CredentialLease {
        pb::CredentialLease {
            version: self.version,
            lease_id: Bytes::copy_from_slice(&self.lease_id),
            issuer_key_id: self.issuer_key_id.clone(),
            issued_at_unix_ms: self.issued_at_unix_ms,
            not_after_unix_ms: self.not_after_unix_ms,
            enc: self.enc.clone(),
            recipient_public_key: self.recipient_public_key.clone(),
            ciphertext: self.ciphertext.clone(),
            signature: self.signature.clone(),
        }
    }
}

impl TryFrom<pb::CredentialLease> for CredentialLease {
    type Error = InvalidMessage;

    fn try_from(m: pb::CredentialLease) -> Result<Self, Self::Error> {
        let lease_id =
            <[u8; 16]>::try_from(&m.lease_id[..]).map_err(|_| InvalidMessage::InvalidValue {
                field: "credential_lease.lease_id",
                rule: "16 bytes",
            })?;
        validate::id("credential_lease.issuer_key_id", &m.issuer_key_id)?;
        for (field, len, max) in [
            ("credential_lease.enc", m.enc.len(), 256),
            (
                "credential_lease.recipient_public_key",
                m.recipient_public_key.len(),
                256,
            ),
            ("credential_lease.ciphertext", m.ciphertext.len(), 64 * 1024),
            ("credential_lease.signature", m.signature.len(), 256),
        ] {
            if len > max {
                return Err(InvalidMessage::TooLong(field));
            }
        }
        Ok(Self {
            version: m.version,
            lease_id,
            issuer_key_id: m.issuer_key_id,
            issued_at_unix_ms: m.issued_at_unix_ms,
            not_after_unix_ms: m.not_after_unix_ms,
            enc: m.enc,
            recipient_public_key: m.recipient_public_key,
            ciphertext: m.ciphertext,
            signature: m.signature,
        })
    }
}

/// A lease and its binding: an inseparable managed pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManagedCredential {
    /// The sealed lease.
    pub lease: CredentialLease,
    /// Its exact dispatch scope.
    pub binding: CredentialLeaseBinding,
}

impl ManagedCredential {
    /// The standalone encoding (protobuf `CredentialEnvelope`), for storage and fuzzing. On the
    /// runtime wire the pair travels inside `RunRequest` / `ProviderTunnelRequest`.
    pub fn to_bytes(&self) -> Vec<u8> {
        use prost::Message as _;
        pb::CredentialEnvelope {
            lease: Some(self.lease.to_proto()),
            binding: Some(self.binding.to_proto()),
        }
        .encode_to_vec()
    }

    /// Parses and validates the standalone encoding. Bounded: every field has a size limit.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, InvalidMessage> {
        use prost::Message as _;
        let env = pb::CredentialEnvelope::decode(bytes)?;
        managed_credential(env.lease, env.binding)?
            .ok_or(InvalidMessage::MissingField("credential_lease"))
    }
}

fn managed_credential(
    lease: Option<pb::CredentialLease>,
    binding: Option<pb::CredentialLeaseBinding>,
) -> Result<Option<ManagedCredential>, InvalidMessage> {
    match (lease, binding) {
        (None, None) => Ok(None),
        (Some(lease), Some(binding)) => Ok(Some(ManagedCredential {
            lease: lease.try_into()?,
            binding: binding.try_into()?,
        })),
        _ => Err(InvalidMessage::InvalidValue {
            field: "credential_lease",
            rule: "lease and binding come together",
        }),
    }
}

fn managed_credential_to_proto(
    c: Option<&ManagedCredential>,
) -> (
    Option<pb::CredentialLease>,
    Option<pb::CredentialLeaseBinding>,
) {
    c.map_or((None, None), |c| {
        (Some(c.lease.to_proto()), Some(c.binding.to_proto()))
    })
}

// === Normalized execution ===

/// Most metadata entries on one message.
pub const MAX_METADATA_ENTRIES: usize = 64;

fn metadata(field: &'static str, m: &BTreeMap<String, String>) -> Result<(), InvalidMessage> {
    if m.len() > MAX_METADATA_ENTRIES {
        return Err(InvalidMessage::TooLong(field));
    }
    for (k, v) in m {
        if k.is_empty() {
            return Err(InvalidMessage::MissingField(field));
        }
        if k.len() > validate::MAX_ID_LEN || v.len() > 64 * 1024 {
            return Err(InvalidMessage::TooLong(field));
        }
    }
    Ok(())
}

/// Edge → Node: one normalized execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunRequest {
    /// Provider run id (named by cancel).
    pub run_id: String,
    /// Adapter instance.
    pub adapter: String,
    /// Provider target.
    pub target: String,
    /// Normalized input the adapter interprets.
    pub input: Bytes,
    /// Caller-defined metadata (no control surface).
    pub metadata: BTreeMap<String, String>,
    /// Validated response-stall timeout.
    pub response_stall_timeout: ResponseStallTimeout,
    /// Hard deadline; `None` = none.
    pub timeout: Option<Duration>,
    /// Admitted as long-context.
    pub long_context: bool,
    /// Managed credential, when the credential plane is enabled.
    pub credential: Option<ManagedCredential>,
}

impl RunRequest {
    pub(crate) fn to_proto(&self) -> pb::RunRequest {
        let (credential_lease, credential_binding) =
            managed_credential_to_proto(self.credential.as_ref());
        pb::RunRequest {
            run_id: self.run_id.clone(),
            adapter: self.adapter.clone(),
            target: self.target.clone(),
            input: self.input.clone(),
            metadata: self.metadata.clone(),
            response_stall_timeout_ms: self.response_stall_timeout.to_wire_ms(),
            timeout_sec: timeout_to_sec(self.timeout),
            long_context: self.long_context,
            credential_lease,
            credential_binding,
        }
    }
}

fn timeout_to_sec(t: Option<Duration>) -> u32 {
    t.map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX))
}

fn timeout_from_sec(s: u32) -> Option<Duration> {
    (s != 0).then(|| Duration::from_secs(u64::from(s)))
}

impl TryFrom<pb::RunRequest> for RunRequest {
    type Error = InvalidMessage;

    fn try_from(m: pb::RunRequest) -> Result<Self, Self::Error> {
        validate::id("run_id", &m.run_id)?;
        validate::optional_id("adapter", &m.adapter)?;
        validate::target("target", &m.target)?;
        metadata("metadata", &m.metadata)?;
        Ok(Self {
            response_stall_timeout: ResponseStallTimeout::from_wire_ms(
                m.response_stall_timeout_ms,
            )?,
            credential: managed_credential(m.credential_lease, m.credential_binding)?,
            run_id: m.run_id,
            adapter: m.adapter,
            target: m.target,
            input: m.input,
            metadata: m.metadata,
            timeout: timeout_from_sec(m.timeout_sec),
            long_context: m.long_context,
        })
    }
}

/// Kind of a [`RunEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunEventKind {
    /// Execution started.
    Start,
    /// A text delta.
    Delta,
    /// Terminal: completed.
    Complete,
    /// Terminal: failed.
    Error,
    /// Terminal: cancelled.
    Cancelled,
}

impl RunEventKind {
    /// Whether this kind ends the run stream.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Complete | Self::Error | Self::Cancelled)
    }
}

/// Node → Edge: one event of a normalized execution stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunEvent {
    /// Kind.
    pub kind: RunEventKind,
    /// Text delta (`Delta`).
    pub delta: String,
    /// Legacy error string (`Error`).
    pub error: String,
    /// Metadata, e.g. `openai_tool_calls` on `Complete`.
    pub metadata: BTreeMap<String, String>,
    /// Usage observation.
    pub usage: Option<Usage>,
    /// Typed stall evidence (`Error` only).
    pub execution_failure: Option<FailureEvidence>,
}

impl RunEvent {
    /// An event of `kind` with every other field empty.
    pub fn new(kind: RunEventKind) -> Self {
        Self {
            kind,
            delta: String::new(),
            error: String::new(),
            metadata: BTreeMap::new(),
            usage: None,
            execution_failure: None,
        }
    }

    pub(crate) fn to_proto(&self) -> pb::RunEvent {
        pb::RunEvent {
            r#type: match self.kind {
                RunEventKind::Start => pb::RunEventType::Start,
                RunEventKind::Delta => pb::RunEventType::Delta,
                RunEventKind::Complete => pb::RunEventType::Complete,
                RunEventKind::Error => pb::RunEventType::Error,
                RunEventKind::Cancelled => pb::RunEventType::Cancelled,
            } as i32,
            delta: self.delta.clone(),
            error: self.error.clone(),
            metadata: self.metadata.clone(),
            usage: self.usage.map(Usage::to_proto),
            execution_failure: self
                .execution_failure
                .as_ref()
                .map(FailureEvidence::to_proto),
        }
    }
}

impl TryFrom<pb::RunEvent> for RunEvent {
    type Error = InvalidMessage;

    fn try_from(m: pb::RunEvent) -> Result<Self, Self::Error> {
        let kind = match pb::RunEventType::try_from(m.r#type) {
            Ok(pb::RunEventType::Start) => RunEventKind::Start,
            Ok(pb::RunEventType::Delta) => RunEventKind::Delta,
            Ok(pb::RunEventType::Complete) => RunEventKind::Complete,
            Ok(pb::RunEventType::Error) => RunEventKind::Error,
            Ok(pb::RunEventType::Cancelled) => RunEventKind::Cancelled,
            Ok(pb::RunEventType::Unspecified) | Err(_) => {
                return Err(InvalidMessage::UnknownEnum("type"));
            }
        };
        validate::text("error", &m.error)?;
        metadata("metadata", &m.metadata)?;
        let execution_failure = m
            .execution_failure
            .map(|f| FailureEvidence::from_proto(f, kind == RunEventKind::Error));
        Ok(Self {
            kind,
            delta: m.delta,
            error: m.error,
            metadata: m.metadata,
            usage: m.usage.map(Usage::from_proto),
            execution_failure,
        })
    }
}

/// A token usage observation. Never merged into a tunnel body.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Total tokens.
    pub total_tokens: u64,
}

impl Usage {
    fn to_proto(self) -> pb::Usage {
        pb::Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: self.total_tokens,
        }
    }

    fn from_proto(m: pb::Usage) -> Self {
        Self {
            prompt_tokens: m.prompt_tokens,
            completion_tokens: m.completion_tokens,
            total_tokens: m.total_tokens,
        }
    }
}

// === Execution failure (stall terminal) ===

/// The only `failure_code` that carries an [`ExecutionFailure`].
pub const FAILURE_CODE_RESPONSE_STALLED: &str = "response_stalled";

/// Three-way health evidence from the exact-target probe, each paired with its liveness
/// classification as seed 000 fixes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HealthEvidence {
    /// `provider_health=available`, `liveness_classification=request_stalled`.
    Available,
    /// `provider_health=unavailable`, `liveness_classification=provider_unhealthy`.
    Unavailable,
    /// `provider_health=unknown`, `liveness_classification=health_unknown`.
    Unknown,
}

impl HealthEvidence {
    /// The `provider_health` wire value.
    pub fn provider_health(self) -> &'static str {
        match self {
            Self::Available => "available",
            Self::Unavailable => "unavailable",
            Self::Unknown => "unknown",
        }
    }

    /// The `liveness_classification` wire value.
    pub fn liveness_classification(self) -> &'static str {
        match self {
            Self::Available => "request_stalled",
            Self::Unavailable => "provider_unhealthy",
            Self::Unknown => "health_unknown",
        }
    }

    fn parse(provider_health: &str, liveness: &str) -> Option<Self> {
        [Self::Available, Self::Unavailable, Self::Unknown]
            .into_iter()
            .find(|e| {
                e.provider_health() == provider_health && e.liveness_classification() == liveness
            })
    }
}

/// Whether the stalled provider call returned within the bounded close grace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fence {
    /// Returned within the grace; the attempt is fenced.
    Confirmed,
    /// Grace expired first; the Node keeps ownership until the call returns.
    Unconfirmed,
}

/// Typed stall terminal evidence (RunEvent field 13, ProviderTunnelFrame field 15).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionFailure {
    /// Probe evidence.
    pub health: HealthEvidence,
    /// Provider inactivity before the watchdog fired.
    pub idle_duration: Duration,
    /// Node-owned run id.
    pub run_id: String,
    /// Node-owned attempt id.
    pub attempt_id: String,
    /// Fence state.
    pub fence: Fence,
    /// Adapter instance.
    pub adapter: String,
    /// Provider target.
    pub target: String,
    /// Connection-scoped observation sequence (≥ 1); `None` on an unbound session.
    pub health_observation_seq: Option<u64>,
}

impl ExecutionFailure {
    pub(crate) fn to_proto(&self) -> pb::ExecutionFailure {
        pb::ExecutionFailure {
            failure_code: FAILURE_CODE_RESPONSE_STALLED.to_owned(),
            provider_health: self.health.provider_health().to_owned(),
            liveness_classification: self.health.liveness_classification().to_owned(),
            idle_duration_ms: u64::try_from(self.idle_duration.as_millis()).unwrap_or(u64::MAX),
            run_id: self.run_id.clone(),
            attempt_id: self.attempt_id.clone(),
            fence: match self.fence {
                Fence::Confirmed => pb::FenceState::Confirmed,
                Fence::Unconfirmed => pb::FenceState::Unconfirmed,
            } as i32,
            adapter: self.adapter.clone(),
            target: self.target.clone(),
            health_observation_seq: self.health_observation_seq,
        }
    }
}

impl TryFrom<pb::ExecutionFailure> for ExecutionFailure {
    type Error = InvalidMessage;

    fn try_from(m: pb::ExecutionFailure) -> Result<Self, Self::Error> {
        const F: &str = "execution_failure";
        if m.failure_code != FAILURE_CODE_RESPONSE_STALLED {
            return Err(InvalidMessage::InvalidValue {
                field: "execution_failure.failure_code",
                rule: "only response_stalled is typed",
            });
        }
        let health = HealthEvidence::parse(&m.provider_health, &m.liveness_classification).ok_or(
            InvalidMessage::InvalidValue {
                field: F,
                rule: "provider_health/liveness_classification pair is not one of the three",
            },
        )?;
        let fence = match pb::FenceState::try_from(m.fence) {
            Ok(pb::FenceState::Confirmed) => Fence::Confirmed,
            Ok(pb::FenceState::Unconfirmed) => Fence::Unconfirmed,
            Ok(pb::FenceState::Unspecified) | Err(_) => {
                return Err(InvalidMessage::UnknownEnum("execution_failure.fence"));
            }
        };
        validate::id("execution_failure.run_id", &m.run_id)?;
        validate::id("execution_failure.attempt_id", &m.attempt_id)?;
        validate::optional_id("execution_failure.adapter", &m.adapter)?;
        validate::target("execution_failure.target", &m.target)?;
        if m.health_observation_seq == Some(0) {
            return Err(InvalidMessage::InvalidValue {
                field: "execution_failure.health_observation_seq",
                rule: "starts at 1",
            });
        }
        Ok(Self {
            health,
            idle_duration: Duration::from_millis(m.idle_duration_ms),
            run_id: m.run_id,
            attempt_id: m.attempt_id,
            fence,
            adapter: m.adapter,
            target: m.target,
            health_observation_seq: m.health_observation_seq,
        })
    }
}

/// Stall evidence as received: valid, or rejected while the terminal itself still counts.
///
/// Seed 000: "A current terminal releases that lease exactly once even when optional health
/// evidence is rejected." So invalid evidence does not invalidate the frame that carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureEvidence {
    /// Well-formed evidence.
    Valid(ExecutionFailure),
    /// Malformed evidence, or evidence on a non-error event. Kept encoded so that a relay
    /// re-encodes exactly what it received.
    Rejected(RejectedEvidence),
}

/// Evidence that failed validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RejectedEvidence {
    /// Why it was rejected.
    pub error: InvalidMessage,
    raw: Bytes,
}

impl FailureEvidence {
    /// The valid evidence, if any.
    pub fn valid(&self) -> Option<&ExecutionFailure> {
        match self {
            Self::Valid(f) => Some(f),
            Self::Rejected(_) => None,
        }
    }

    fn from_proto(m: pb::ExecutionFailure, on_error: bool) -> Self {
        use prost::Message as _;
        let raw = Bytes::from(m.encode_to_vec());
        let parsed = if on_error {
            ExecutionFailure::try_from(m)
        } else {
            Err(InvalidMessage::InvalidValue {
                field: "execution_failure",
                rule: "only on an error terminal",
            })
        };
        match parsed {
            Ok(f) => Self::Valid(f),
            Err(error) => Self::Rejected(RejectedEvidence { error, raw }),
        }
    }

    fn to_proto(&self) -> pb::ExecutionFailure {
        use prost::Message as _;
        match self {
            Self::Valid(f) => f.to_proto(),
            // `raw` was produced by encoding a decoded message, so it decodes.
            Self::Rejected(r) => pb::ExecutionFailure::decode(r.raw.clone()).unwrap_or_default(),
        }
    }
}

/// Edge → Node: cancel by run id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CancelRequest {
    /// The run to cancel.
    pub run_id: String,
    /// Stable reason.
    pub reason: String,
}

impl CancelRequest {
    pub(crate) fn to_proto(&self) -> pb::CancelRequest {
        pb::CancelRequest {
            run_id: self.run_id.clone(),
            reason: self.reason.clone(),
        }
    }
}

impl TryFrom<pb::CancelRequest> for CancelRequest {
    type Error = InvalidMessage;

    fn try_from(m: pb::CancelRequest) -> Result<Self, Self::Error> {
        validate::id("run_id", &m.run_id)?;
        validate::text("reason", &m.reason)?;
        Ok(Self {
            run_id: m.run_id,
            reason: m.reason,
        })
    }
}

// === Provider raw tunnel ===

/// One HTTP header.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    /// Name (an RFC 9110 token).
    pub name: String,
    /// Value (no CR, LF or NUL).
    pub value: Bytes,
}

/// Most headers on one tunnel request or response start.
pub const MAX_HEADERS: usize = 128;

fn headers_from_proto(hs: Vec<pb::Header>) -> Result<Vec<Header>, InvalidMessage> {
    if hs.len() > MAX_HEADERS {
        return Err(InvalidMessage::TooLong("headers"));
    }
    hs.into_iter()
        .map(|h| {
            validate::header_name(&h.name)?;
            validate::header_value(&h.value)?;
            Ok(Header {
                name: h.name,
                value: h.value,
            })
        })
        .collect()
}

fn headers_to_proto(hs: &[Header]) -> Vec<pb::Header> {
    hs.iter()
        .map(|h| pb::Header {
            name: h.name.clone(),
            value: h.value.clone(),
        })
        .collect()
}

/// A named profile operation (`ProviderTunnelRequest.operation`, field 13).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Operation {
    /// `GET /models`.
    Models,
    /// Chat completions.
    ChatCompletions,
    /// Anthropic-style messages.
    Messages,
    /// Token counting.
    CountTokens,
    /// Responses API.
    Responses,
}

impl Operation {
    /// Every operation.
    pub const ALL: [Self; 5] = [
        Self::Models,
        Self::ChatCompletions,
        Self::Messages,
        Self::CountTokens,
        Self::Responses,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Models => "models",
            Self::ChatCompletions => "chat_completions",
            Self::Messages => "messages",
            Self::CountTokens => "count_tokens",
            Self::Responses => "responses",
        }
    }

    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.as_str() == s)
    }
}

/// Edge → Node: open a provider HTTP request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderTunnelRequest {
    /// Provider run id.
    pub run_id: String,
    /// Adapter instance.
    pub adapter: String,
    /// Provider target.
    pub target: String,
    /// HTTP method.
    pub method: String,
    /// Fallback path when `operation` is `None`.
    pub path: String,
    /// Request headers.
    pub headers: Vec<Header>,
    /// Final serialized body.
    pub body: Bytes,
    /// Streamed (SSE) response requested.
    pub stream: bool,
    /// Hard deadline; `None` = none.
    pub timeout: Option<Duration>,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
    /// Caller session id (diagnostic).
    pub session_id: String,
    /// Admitted as long-context.
    pub long_context: bool,
    /// Named operation; `None` = use `path` (mixed-version fallback).
    pub operation: Option<Operation>,
    /// Validated response-stall timeout.
    pub response_stall_timeout: ResponseStallTimeout,
    /// Managed credential, when the credential plane is enabled.
    pub credential: Option<ManagedCredential>,
}

impl ProviderTunnelRequest {
    pub(crate) fn to_proto(&self) -> pb::ProviderTunnelRequest {
        let (credential_lease, credential_binding) =
            managed_credential_to_proto(self.credential.as_ref());
        pb::ProviderTunnelRequest {
            run_id: self.run_id.clone(),
            adapter: self.adapter.clone(),
            target: self.target.clone(),
            method: self.method.clone(),
            path: self.path.clone(),
            headers: headers_to_proto(&self.headers),
            body: self.body.clone(),
            stream: self.stream,
            timeout_sec: timeout_to_sec(self.timeout),
            metadata: self.metadata.clone(),
            session_id: self.session_id.clone(),
            long_context: self.long_context,
            operation: self
                .operation
                .map(|o| o.as_str().to_owned())
                .unwrap_or_default(),
            response_stall_timeout_ms: self.response_stall_timeout.to_wire_ms(),
            credential_lease,
            credential_binding,
        }
    }
}

impl TryFrom<pb::ProviderTunnelRequest> for ProviderTunnelRequest {
    type Error = InvalidMessage;

    fn try_from(m: pb::ProviderTunnelRequest) -> Result<Self, Self::Error> {
        validate::id("run_id", &m.run_id)?;
        validate::optional_id("adapter", &m.adapter)?;
        validate::target("target", &m.target)?;
        if !matches!(
            m.method.as_str(),
            "GET" | "POST" | "PUT" | "PATCH" | "DELETE" | "HEAD"
        ) {
            return Err(InvalidMessage::InvalidValue {
                field: "method",
                rule: "one of GET POST PUT PATCH DELETE HEAD",
            });
        }
        let operation = if m.operation.is_empty() {
            None
        } else {
            Some(
                Operation::parse(&m.operation).ok_or(InvalidMessage::InvalidValue {
                    field: "operation",
                    rule: "unknown operation",
                })?,
            )
        };
        if operation.is_none() && !m.path.starts_with('/') {
            return Err(InvalidMessage::InvalidValue {
                field: "path",
                rule: "absolute path required when operation is empty",
            });
        }
        validate::text("path", &m.path)?;
        if m.path.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(InvalidMessage::InvalidCharacters("path"));
        }
        validate::text("session_id", &m.session_id)?;
        metadata("metadata", &m.metadata)?;
        Ok(Self {
            headers: headers_from_proto(m.headers)?,
            response_stall_timeout: ResponseStallTimeout::from_wire_ms(
                m.response_stall_timeout_ms,
            )?,
            credential: managed_credential(m.credential_lease, m.credential_binding)?,
            run_id: m.run_id,
            adapter: m.adapter,
            target: m.target,
            method: m.method,
            path: m.path,
            body: m.body,
            stream: m.stream,
            timeout: timeout_from_sec(m.timeout_sec),
            metadata: m.metadata,
            session_id: m.session_id,
            long_context: m.long_context,
            operation,
        })
    }
}

/// Node → Edge: one ordered frame of a tunnelled provider response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunnelFrame {
    /// Strictly increasing within the stream.
    pub sequence: u64,
    /// What the frame carries.
    pub payload: TunnelPayload,
    /// Observation metadata; never merged into the body.
    pub metadata: BTreeMap<String, String>,
}

/// The kind-specific content of a [`TunnelFrame`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TunnelPayload {
    /// Provider status and headers; at most once, first.
    ResponseStart {
        /// HTTP status, 100..=599.
        status: u16,
        /// Response headers.
        headers: Vec<Header>,
    },
    /// Passthrough body bytes (SSE byte-for-byte).
    Body(Bytes),
    /// Observation-only usage candidate.
    Usage(Usage),
    /// Terminal: the provider response ended.
    End,
    /// Terminal: failed.
    Error {
        /// Legacy error string.
        error: String,
        /// Typed stall evidence.
        execution_failure: Option<FailureEvidence>,
    },
}

impl TunnelPayload {
    /// Whether this frame ends the stream.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Self::End | Self::Error { .. })
    }

    /// The frame kind name, for errors and metrics.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Self::ResponseStart { .. } => "RESPONSE_START",
            Self::Body(_) => "BODY",
            Self::Usage(_) => "USAGE",
            Self::End => "END",
            Self::Error { .. } => "ERROR",
        }
    }
}

impl TunnelFrame {
    pub(crate) fn to_proto(&self) -> pb::ProviderTunnelFrame {
        let mut m = pb::ProviderTunnelFrame {
            sequence: self.sequence,
            metadata: self.metadata.clone(),
            ..Default::default()
        };
        m.kind = match &self.payload {
            TunnelPayload::ResponseStart { status, headers } => {
                m.status = u32::from(*status);
                m.headers = headers_to_proto(headers);
                pb::TunnelFrameKind::ResponseStart
            }
            TunnelPayload::Body(b) => {
                m.body = b.clone();
                pb::TunnelFrameKind::Body
            }
            TunnelPayload::Usage(u) => {
                m.usage = Some(u.to_proto());
                pb::TunnelFrameKind::Usage
            }
            TunnelPayload::End => pb::TunnelFrameKind::End,
            TunnelPayload::Error {
                error,
                execution_failure,
            } => {
                m.error = error.clone();
                m.execution_failure = execution_failure.as_ref().map(FailureEvidence::to_proto);
                pb::TunnelFrameKind::Error
            }
        } as i32;
        m
    }
}

impl TryFrom<pb::ProviderTunnelFrame> for TunnelFrame {
    type Error = InvalidMessage;

    fn try_from(m: pb::ProviderTunnelFrame) -> Result<Self, Self::Error> {
        metadata("metadata", &m.metadata)?;
        let payload = match pb::TunnelFrameKind::try_from(m.kind) {
            Ok(pb::TunnelFrameKind::ResponseStart) => {
                let status = u16::try_from(m.status)
                    .ok()
                    .filter(|s| (100..=599).contains(s))
                    .ok_or(InvalidMessage::InvalidValue {
                        field: "status",
                        rule: "100..=599",
                    })?;
                TunnelPayload::ResponseStart {
                    status,
                    headers: headers_from_proto(m.headers)?,
                }
            }
            Ok(pb::TunnelFrameKind::Body) => TunnelPayload::Body(m.body),
            Ok(pb::TunnelFrameKind::Usage) => {
                TunnelPayload::Usage(Usage::from_proto(m.usage.unwrap_or_default()))
            }
            Ok(pb::TunnelFrameKind::End) => TunnelPayload::End,
            Ok(pb::TunnelFrameKind::Error) => {
                validate::text("error", &m.error)?;
                TunnelPayload::Error {
                    error: m.error,
                    execution_failure: m
                        .execution_failure
                        .map(|f| FailureEvidence::from_proto(f, true)),
                }
            }
            Ok(pb::TunnelFrameKind::Unspecified) | Err(_) => {
                return Err(InvalidMessage::UnknownEnum("kind"));
            }
        };
        Ok(Self {
            sequence: m.sequence,
            payload,
            metadata: m.metadata,
        })
    }
}

// === Commands ===

/// Kind of a Node command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeCommandKind {
    /// Probe adapter instances (recovery evidence).
    Capabilities,
    /// Transport state.
    Transport,
    /// Provider lifecycle state.
    ProviderLifecycle,
}

/// Edge → Node: a query/control command (never execution).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCommandRequest {
    /// The command.
    pub kind: NodeCommandKind,
    /// Adapter instance; empty = all.
    pub adapter: String,
    /// Target; empty = all of the instance's targets.
    pub target: String,
}

impl NodeCommandRequest {
    pub(crate) fn to_proto(&self) -> pb::NodeCommandRequest {
        pb::NodeCommandRequest {
            r#type: match self.kind {
                NodeCommandKind::Capabilities => pb::NodeCommandType::Capabilities,
                NodeCommandKind::Transport => pb::NodeCommandType::Transport,
                NodeCommandKind::ProviderLifecycle => pb::NodeCommandType::ProviderLifecycle,
            } as i32,
            adapter: self.adapter.clone(),
            target: self.target.clone(),
        }
    }
}

impl TryFrom<pb::NodeCommandRequest> for NodeCommandRequest {
    type Error = InvalidMessage;

    fn try_from(m: pb::NodeCommandRequest) -> Result<Self, Self::Error> {
        let kind = match pb::NodeCommandType::try_from(m.r#type) {
            Ok(pb::NodeCommandType::Capabilities) => NodeCommandKind::Capabilities,
            Ok(pb::NodeCommandType::Transport) => NodeCommandKind::Transport,
            Ok(pb::NodeCommandType::ProviderLifecycle) => NodeCommandKind::ProviderLifecycle,
            Ok(pb::NodeCommandType::Unspecified) | Err(_) => {
                return Err(InvalidMessage::UnknownEnum("type"));
            }
        };
        validate::optional_id("adapter", &m.adapter)?;
        validate::optional_target("target", &m.target)?;
        Ok(Self {
            kind,
            adapter: m.adapter,
            target: m.target,
        })
    }
}

/// Normalized provider status in a CAPABILITIES answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderStatus {
    /// The exact-target probe succeeded.
    Available,
    /// The probe failed.
    Unavailable,
    /// The probe could not decide (fail closed).
    Unknown,
}

impl ProviderStatus {
    /// Wire value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Available => "available",
            Self::Unavailable => "unavailable",
            Self::Unknown => "unknown",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Self::Available, Self::Unavailable, Self::Unknown]
            .into_iter()
            .find(|p| p.as_str() == s)
    }
}

/// One adapter instance/target in a CAPABILITIES answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capability {
    /// Stable adapter instance key.
    pub adapter_key: String,
    /// Target probed.
    pub target: String,
    /// Normalized status.
    pub provider_status: ProviderStatus,
    /// Session-owned observation sequence (≥ 1).
    pub health_observation_seq: u64,
    /// Diagnostic adapter type.
    pub adapter: String,
    /// Diagnostic instance key.
    pub instance_key: String,
}

/// Node → Edge: command result.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeCommandResponse {
    /// Success.
    pub ok: bool,
    /// Stable error text when `!ok`.
    pub error: String,
    /// CAPABILITIES entries.
    pub capabilities: Vec<Capability>,
    /// Other commands' key/value result.
    pub result: BTreeMap<String, String>,
}

impl NodeCommandResponse {
    pub(crate) fn to_proto(&self) -> pb::NodeCommandResponse {
        pb::NodeCommandResponse {
            ok: self.ok,
            error: self.error.clone(),
            capabilities: self
                .capabilities
                .iter()
                .map(|c| pb::Capability {
                    adapter_key: c.adapter_key.clone(),
                    target: c.target.clone(),
                    provider_status: c.provider_status.as_str().to_owned(),
                    health_observation_seq: c.health_observation_seq,
                    adapter: c.adapter.clone(),
                    instance_key: c.instance_key.clone(),
                })
                .collect(),
            result: self.result.clone(),
        }
    }
}

impl TryFrom<pb::NodeCommandResponse> for NodeCommandResponse {
    type Error = InvalidMessage;

    fn try_from(m: pb::NodeCommandResponse) -> Result<Self, Self::Error> {
        validate::text("error", &m.error)?;
        metadata("result", &m.result)?;
        if m.capabilities.len() > 4096 {
            return Err(InvalidMessage::TooLong("capabilities"));
        }
        let capabilities = m
            .capabilities
            .into_iter()
            .map(|c| {
                validate::id("capabilities.adapter_key", &c.adapter_key)?;
                validate::target("capabilities.target", &c.target)?;
                validate::optional_id("capabilities.adapter", &c.adapter)?;
                validate::optional_id("capabilities.instance_key", &c.instance_key)?;
                let provider_status = ProviderStatus::parse(&c.provider_status).ok_or(
                    InvalidMessage::InvalidValue {
                        field: "capabilities.provider_status",
                        rule: "available, unavailable or unknown",
                    },
                )?;
                if c.health_observation_seq == 0 {
                    return Err(InvalidMessage::InvalidValue {
                        field: "capabilities.health_observation_seq",
                        rule: "starts at 1",
                    });
                }
                Ok(Capability {
                    adapter_key: c.adapter_key,
                    target: c.target,
                    provider_status,
                    health_observation_seq: c.health_observation_seq,
                    adapter: c.adapter,
                    instance_key: c.instance_key,
                })
            })
            .collect::<Result<_, InvalidMessage>>()?;
        Ok(Self {
            ok: m.ok,
            error: m.error,
            capabilities,
            result: m.result,
        })
    }
}

// === Snapshots ===

/// A Node resource/provider snapshot (legacy wire name `ProviderSnapshot`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProviderSnapshot {
    /// Provider id.
    pub provider_id: String,
    /// Owning Node.
    pub node_id: String,
    /// Adapter instance.
    pub adapter: String,
    /// Target.
    pub target: String,
    /// Resource kind: `api`, `local_inference`, `cli`.
    pub category: String,
    /// `available` / `unavailable`.
    pub status: String,
    /// `healthy` / `unavailable` / `offline`.
    pub health: String,
    /// Effective capacity.
    pub capacity: u32,
    /// Effective long-context capacity.
    pub long_context_capacity: u32,
    /// Lease occupancy.
    pub in_flight: u32,
    /// Long-context lease occupancy.
    pub long_in_flight: u32,
    /// Candidate pressure.
    pub queued: u32,
    /// Long-context candidate pressure.
    pub long_queued: u32,
    /// Configured enabled.
    pub enabled: bool,
}

impl ProviderSnapshot {
    pub(crate) fn to_proto(&self) -> pb::ProviderSnapshot {
        pb::ProviderSnapshot {
            provider_id: self.provider_id.clone(),
            node_id: self.node_id.clone(),
            adapter: self.adapter.clone(),
            target: self.target.clone(),
            category: self.category.clone(),
            status: self.status.clone(),
            health: self.health.clone(),
            capacity: self.capacity,
            long_context_capacity: self.long_context_capacity,
            in_flight: self.in_flight,
            long_in_flight: self.long_in_flight,
            queued: self.queued,
            long_queued: self.long_queued,
            enabled: self.enabled,
        }
    }
}

impl TryFrom<pb::ProviderSnapshot> for ProviderSnapshot {
    type Error = InvalidMessage;

    fn try_from(m: pb::ProviderSnapshot) -> Result<Self, Self::Error> {
        validate::id("provider_id", &m.provider_id)?;
        validate::node_id("node_id", &m.node_id)?;
        validate::optional_id("adapter", &m.adapter)?;
        validate::optional_target("target", &m.target)?;
        for (field, v) in [
            ("category", &m.category),
            ("status", &m.status),
            ("health", &m.health),
        ] {
            validate::optional_id(field, v)?;
        }
        Ok(Self {
            provider_id: m.provider_id,
            node_id: m.node_id,
            adapter: m.adapter,
            target: m.target,
            category: m.category,
            status: m.status,
            health: m.health,
            capacity: m.capacity,
            long_context_capacity: m.long_context_capacity,
            in_flight: m.in_flight,
            long_in_flight: m.long_in_flight,
            queued: m.queued,
            long_queued: m.long_queued,
            enabled: m.enabled,
        })
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::pb;

    /// Seed 000 fixes these field numbers; a renumbering would break mixed-version peers.
    #[test]
    fn seed_fixed_field_numbers() {
        let tag = |field: u8| (field << 3) | 2; // length-delimited
        let ev = pb::RunEvent {
            execution_failure: Some(Default::default()),
            ..Default::default()
        };
        assert_eq!(
            ev.encode_to_vec(),
            [tag(13), 0],
            "RunEvent.execution_failure = 13"
        );
        let req = pb::ProviderTunnelRequest {
            operation: "models".into(),
            ..Default::default()
        };
        assert_eq!(
            req.encode_to_vec()[..2],
            [tag(13), 6],
            "ProviderTunnelRequest.operation = 13"
        );
        let f = pb::ProviderTunnelFrame {
            execution_failure: Some(Default::default()),
            ..Default::default()
        };
        assert_eq!(
            f.encode_to_vec(),
            [tag(15), 0],
            "ProviderTunnelFrame.execution_failure = 15"
        );
    }
}
