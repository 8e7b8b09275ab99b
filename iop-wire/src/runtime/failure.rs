//! Execution failure (stall terminal).

use super::*;

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

    pub(super) fn from_proto(m: pb::ExecutionFailure, on_error: bool) -> Self {
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

    pub(super) fn to_proto(&self) -> pb::ExecutionFailure {
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
