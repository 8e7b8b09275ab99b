//! Node configuration.

use super::*;

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

/// Most provider targets one adapter may serve.
pub const MAX_ADAPTER_TARGETS: usize = 1024;

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

    pub(super) fn to_proto(&self) -> pb::AdapterConfig {
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
        if m.targets.len() > MAX_ADAPTER_TARGETS {
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
