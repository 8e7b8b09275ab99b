//! Commands.

use super::*;

/// Most capabilities one command answer may report.
pub const MAX_CAPABILITIES: usize = 4096;

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
        if m.capabilities.len() > MAX_CAPABILITIES {
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
