//! impl RuntimeFrame.

use super::*;

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

    /// Checks this frame exactly as its receiver will: encoded and decoded again through the
    /// validating conversion, so a bad field in one request cannot cost the receiver its
    /// session. [`RuntimeFrame::into_validated`] is the same check by value (what the Edge runs
    /// once per request it sends).
    pub fn validate(&self) -> Result<(), InvalidMessage> {
        self.validated_len().map(drop)
    }

    /// [`RuntimeFrame::validate`], and the length of the frame's envelope once encoded (the
    /// four-byte length prefix not included): what its sender compares with the connection's
    /// `max_frame_len` before sending, so that a request too large for the wire is refused on
    /// its own instead of failing the connection's writer.
    pub fn validated_len(&self) -> Result<usize, InvalidMessage> {
        self.clone().into_validated().map(|(_, len)| len)
    }

    /// [`RuntimeFrame::validated_len`] consuming the frame: its contents move into the
    /// protobuf form and back instead of being cloned. Returns the frame as its receiver will
    /// decode it, and its envelope's encoded length. What a sender that queues the frame next
    /// uses (the Edge's registry, once per request: the clone was eight allocations of each
    /// tunnel request).
    pub fn into_validated(self) -> Result<(Self, usize), InvalidMessage> {
        let proto = self.into_proto();
        let len = prost::Message::encoded_len(&proto);
        Self::try_from(proto).map(|frame| (frame, len))
    }

    /// The length of the frame's envelope once encoded (the four-byte length prefix not
    /// included), without validating it.
    pub fn encoded_len(&self) -> usize {
        prost::Message::encoded_len(&self.to_proto())
    }

    /// [`RuntimeFrame::to_proto`], moving what the run and tunnel messages carry instead of
    /// cloning it (the other messages are connection-level and rare: they are converted by
    /// reference).
    fn into_proto(self) -> pb::Envelope {
        use pb::envelope::Message as M;
        let message = match self.message {
            RuntimeMessage::RunRequest(m) => M::RunRequest(Box::new(m.into_proto())),
            RuntimeMessage::RunEvent(m) => M::RunEvent(m.into_proto()),
            RuntimeMessage::ProviderTunnelRequest(m) => {
                M::ProviderTunnelRequest(Box::new(m.into_proto()))
            }
            RuntimeMessage::ProviderTunnelFrame(m) => M::ProviderTunnelFrame(m.into_proto()),
            other => {
                return Self {
                    message: other,
                    ..self
                }
                .to_proto();
            }
        };
        pb::Envelope {
            correlation_id: self.correlation_id,
            stream_id: self.stream_id,
            message: Some(message),
        }
    }

    pub(crate) fn to_proto(&self) -> pb::Envelope {
        use pb::envelope::Message as M;
        let message = match &self.message {
            RuntimeMessage::RegisterRequest(m) => M::RegisterRequest(Box::new(m.to_proto())),
            RuntimeMessage::RegisterResponse(m) => M::RegisterResponse(m.to_proto()),
            RuntimeMessage::NodeReadyRequest(m) => M::NodeReadyRequest(m.to_proto()),
            RuntimeMessage::NodeReadyResponse(m) => M::NodeReadyResponse(m.to_proto()),
            RuntimeMessage::RunRequest(m) => M::RunRequest(Box::new(m.to_proto())),
            RuntimeMessage::RunEvent(m) => M::RunEvent(m.to_proto()),
            RuntimeMessage::ProviderTunnelRequest(m) => {
                M::ProviderTunnelRequest(Box::new(m.to_proto()))
            }
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
            RuntimeMessage::StreamWindowUpdate(bytes) => {
                M::StreamWindowUpdate(pb::StreamWindowUpdate { bytes: *bytes })
            }
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
            M::RegisterRequest(m) => RuntimeMessage::RegisterRequest((*m).try_into()?),
            M::RegisterResponse(m) => RuntimeMessage::RegisterResponse(m.try_into()?),
            M::NodeReadyRequest(m) => RuntimeMessage::NodeReadyRequest(m.try_into()?),
            M::NodeReadyResponse(m) => RuntimeMessage::NodeReadyResponse(m.try_into()?),
            M::RunRequest(m) => RuntimeMessage::RunRequest((*m).try_into()?),
            M::RunEvent(m) => RuntimeMessage::RunEvent(m.try_into()?),
            M::ProviderTunnelRequest(m) => RuntimeMessage::ProviderTunnelRequest((*m).try_into()?),
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
            M::StreamWindowUpdate(m) => RuntimeMessage::StreamWindowUpdate(m.bytes),
        };
        let on_stream = matches!(
            message,
            RuntimeMessage::RunRequest(_)
                | RuntimeMessage::RunEvent(_)
                | RuntimeMessage::ProviderTunnelRequest(_)
                | RuntimeMessage::ProviderTunnelFrame(_)
                | RuntimeMessage::StreamWindowUpdate(_)
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
    /// Edge → Node, on a tunnel's stream: its reader consumed this many more credit bytes of
    /// the body, which the Node may now send (see
    /// [`ProviderTunnelRequest::credit_window`]). Sent only to a Node that registered with
    /// [`RegisterRequest::stream_credit`], for a tunnel opened with a window.
    StreamWindowUpdate(u64),
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
            Self::StreamWindowUpdate(_) => "stream_window_update",
        }
    }
}
