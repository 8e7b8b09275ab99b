//! Provider raw tunnel.

use super::*;

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

pub(super) fn headers_from_proto(hs: Vec<pb::Header>) -> Result<Vec<Header>, InvalidMessage> {
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

fn headers_into_proto(hs: Vec<Header>) -> Vec<pb::Header> {
    hs.into_iter()
        .map(|h| pb::Header {
            name: h.name,
            value: h.value,
        })
        .collect()
}

pub(super) fn headers_to_proto(hs: &[Header]) -> Vec<pb::Header> {
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
///
/// `Default` leaves every field empty: set at least `run_id`, `method` and `path` (or
/// `operation`), and take the rest with `..Default::default()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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
    /// Managed credential, when the credential plane is enabled. Boxed: inline it made every
    /// `RuntimeFrame` (an enum as large as its largest message) 664 bytes, moved whole on every
    /// frame of every kind.
    pub credential: Option<Box<ManagedCredential>>,
    /// The Edge's dispatch attempt span, if the request is traced (the Node's spans are its
    /// children; see [`crate::trace`]).
    pub trace: Option<Box<crate::trace::TraceContext>>,
    /// Per-stream credit for the response body, in credit bytes (see [`TUNNEL_FRAME_CREDIT`]);
    /// `0` = none (older Edges, and Nodes that did not register with
    /// [`RegisterRequest::stream_credit`](super::RegisterRequest::stream_credit)).
    pub credit_window: u64,
}

/// What one `BODY` frame costs of a tunnel's credit besides its body bytes: about what the
/// Edge holds per buffered frame (its queue slot and allocation headers), so that a window
/// bounds the Edge's memory for a stream of many small frames as for one of large ones.
pub const TUNNEL_FRAME_CREDIT: u64 = 512;

impl ProviderTunnelRequest {
    pub(crate) fn to_proto(&self) -> pb::ProviderTunnelRequest {
        let (credential_lease, credential_binding) =
            managed_credential_to_proto(self.credential.as_deref());
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
            trace: self
                .trace
                .as_deref()
                .map(crate::trace::TraceContext::to_proto),
            credit_window: self.credit_window,
        }
    }
}

impl ProviderTunnelRequest {
    /// [`ProviderTunnelRequest::to_proto`], moving the strings, headers and map instead of
    /// cloning them.
    pub(crate) fn into_proto(self) -> pb::ProviderTunnelRequest {
        let (credential_lease, credential_binding) =
            managed_credential_to_proto(self.credential.as_deref());
        pb::ProviderTunnelRequest {
            run_id: self.run_id,
            adapter: self.adapter,
            target: self.target,
            method: self.method,
            path: self.path,
            headers: headers_into_proto(self.headers),
            body: self.body,
            stream: self.stream,
            timeout_sec: timeout_to_sec(self.timeout),
            metadata: self.metadata,
            session_id: self.session_id,
            long_context: self.long_context,
            operation: self
                .operation
                .map(|o| o.as_str().to_owned())
                .unwrap_or_default(),
            response_stall_timeout_ms: self.response_stall_timeout.to_wire_ms(),
            credential_lease,
            credential_binding,
            trace: self
                .trace
                .as_deref()
                .map(crate::trace::TraceContext::to_proto),
            credit_window: self.credit_window,
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
            trace: crate::trace::TraceContext::from_proto(m.trace).map(Box::new),
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
            credit_window: m.credit_window,
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
    /// [`TunnelFrame::to_proto`], moving the payload and the map instead of cloning them.
    pub(crate) fn into_proto(self) -> pb::ProviderTunnelFrame {
        let mut m = pb::ProviderTunnelFrame {
            sequence: self.sequence,
            metadata: self.metadata,
            ..Default::default()
        };
        m.kind = match self.payload {
            TunnelPayload::ResponseStart { status, headers } => {
                m.status = u32::from(status);
                m.headers = headers_into_proto(headers);
                pb::TunnelFrameKind::ResponseStart
            }
            TunnelPayload::Body(b) => {
                m.body = b;
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
                m.error = error;
                m.execution_failure = execution_failure.as_ref().map(|f| Box::new(f.to_proto()));
                pb::TunnelFrameKind::Error
            }
        } as i32;
        m
    }

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
                m.execution_failure = execution_failure.as_ref().map(|f| Box::new(f.to_proto()));
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
                        .map(|f| FailureEvidence::from_proto(*f, true)),
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
