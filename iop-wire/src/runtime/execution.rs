//! Normalized execution.

use super::*;

/// Most metadata entries on one message.
pub const MAX_METADATA_ENTRIES: usize = 64;

pub(super) fn metadata(
    field: &'static str,
    m: &BTreeMap<String, String>,
) -> Result<(), InvalidMessage> {
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
    /// Managed credential, when the credential plane is enabled. Boxed: inline it made every
    /// `RuntimeFrame` (an enum as large as its largest message) 664 bytes, moved whole on every
    /// frame of every kind.
    pub credential: Option<Box<ManagedCredential>>,
    /// The Edge's dispatch attempt span, if the request is traced (the Node's spans are its
    /// children; see [`crate::trace`]).
    pub trace: Option<Box<crate::trace::TraceContext>>,
}

impl RunRequest {
    pub(crate) fn to_proto(&self) -> pb::RunRequest {
        let (credential_lease, credential_binding) =
            managed_credential_to_proto(self.credential.as_deref());
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
            trace: self
                .trace
                .as_deref()
                .map(crate::trace::TraceContext::to_proto),
        }
    }
}

impl RunRequest {
    /// [`RunRequest::to_proto`], moving the strings and the map instead of cloning them.
    pub(crate) fn into_proto(self) -> pb::RunRequest {
        let (credential_lease, credential_binding) =
            managed_credential_to_proto(self.credential.as_deref());
        pb::RunRequest {
            run_id: self.run_id,
            adapter: self.adapter,
            target: self.target,
            input: self.input,
            metadata: self.metadata,
            response_stall_timeout_ms: self.response_stall_timeout.to_wire_ms(),
            timeout_sec: timeout_to_sec(self.timeout),
            long_context: self.long_context,
            credential_lease,
            credential_binding,
            trace: self
                .trace
                .as_deref()
                .map(crate::trace::TraceContext::to_proto),
        }
    }
}

pub(super) fn timeout_to_sec(t: Option<Duration>) -> u32 {
    t.map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX))
}

pub(super) fn timeout_from_sec(s: u32) -> Option<Duration> {
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
            trace: crate::trace::TraceContext::from_proto(m.trace).map(Box::new),
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
                .map(|f| Box::new(f.to_proto())),
        }
    }
}

impl RunEvent {
    /// [`RunEvent::to_proto`], moving the strings and the map instead of cloning them.
    pub(crate) fn into_proto(self) -> pb::RunEvent {
        let execution_failure = self
            .execution_failure
            .as_ref()
            .map(|f| Box::new(f.to_proto()));
        pb::RunEvent {
            r#type: match self.kind {
                RunEventKind::Start => pb::RunEventType::Start,
                RunEventKind::Delta => pb::RunEventType::Delta,
                RunEventKind::Complete => pb::RunEventType::Complete,
                RunEventKind::Error => pb::RunEventType::Error,
                RunEventKind::Cancelled => pb::RunEventType::Cancelled,
            } as i32,
            delta: self.delta,
            error: self.error,
            metadata: self.metadata,
            usage: self.usage.map(Usage::to_proto),
            execution_failure,
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
            .map(|f| FailureEvidence::from_proto(*f, kind == RunEventKind::Error));
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
    /// Of `prompt_tokens`, those read from the provider's prompt cache (0 when it reported
    /// none, and from older Nodes).
    pub cached_prompt_tokens: u64,
}

impl Usage {
    /// Prompt and completion tokens, their total, nothing cached.
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            cached_prompt_tokens: 0,
        }
    }

    pub(super) fn to_proto(self) -> pb::Usage {
        pb::Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: self.total_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
        }
    }

    pub(super) fn from_proto(m: pb::Usage) -> Self {
        Self {
            prompt_tokens: m.prompt_tokens,
            completion_tokens: m.completion_tokens,
            total_tokens: m.total_tokens,
            // Never more than the prompt it is part of.
            cached_prompt_tokens: m.cached_prompt_tokens.min(m.prompt_tokens),
        }
    }
}
