//! Domain types of the Control Plane ⇄ Edge wire (`proto/control.proto`).
//!
//! The Edge dials out to the Control Plane and speaks [`ControlFrame`]s over the same
//! [`codec`](crate::codec) as the runtime wire. Nothing here can name a Node address, token or
//! transport internal: the snapshot types have no such fields. `ScheduleRequest` /
//! `ScheduleResponse` are reserved in the proto and have no domain type.

use std::collections::BTreeMap;

use crate::error::InvalidMessage;
use crate::proto::control as pb;
use crate::runtime::{CredentialLease, CredentialLeaseBinding, ProviderSnapshot};
use crate::validate;

/// One frame of the control wire.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlFrame {
    /// Request/response pairing; zero when unused.
    pub correlation_id: u64,
    /// The message.
    pub message: ControlMessage,
}

/// Every message of the control wire.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ControlMessage {
    /// Edge → CP, first frame.
    EdgeHelloRequest(EdgeHelloRequest),
    /// CP → Edge.
    EdgeHelloResponse(EdgeHelloResponse),
    /// CP → Edge.
    EdgeStatusRequest,
    /// Edge → CP.
    EdgeStatusResponse(EdgeStatusResponse),
    /// CP → Edge.
    EdgeCommandRequest(EdgeCommandRequest),
    /// Edge → CP.
    EdgeCommandResponse(EdgeCommandResponse),
    /// Edge → CP.
    EdgeCommandEvent(EdgeCommandEvent),
    /// Edge → CP.
    EdgeNodeEvent(EdgeNodeEvent),
    /// CP → Edge (managed mode).
    PrincipalProjectionApplyRequest(PrincipalProjection),
    /// Edge → CP.
    PrincipalProjectionApplyResponse(PrincipalProjectionApplyResponse),
    /// Edge → CP (managed mode).
    AcquireLeaseRequest(AcquireLeaseRequest),
    /// CP → Edge.
    AcquireLeaseResponse(AcquireLeaseResponse),
    /// Liveness probe.
    Ping,
    /// Answer to ping.
    Pong,
    /// Edge → CP: usage records (only to a Control Plane that accepts them).
    EdgeUsageReport(EdgeUsageReport),
    /// CP → Edge: the report's records are stored.
    EdgeUsageAck(EdgeUsageAck),
    /// CP → Edge (managed mode, only to an Edge whose hello set
    /// [`EdgeHelloRequest::projection_parts`]): one part of a projection too large for one
    /// frame, [`PrincipalProjection::parts_before`] being its index. The hello answer or apply
    /// request that completes it follows ([`PrincipalProjection::into_parts`]).
    PrincipalProjectionPart(PrincipalProjection),
    /// CP → Edge: a projection part or the apply request completing a push, encoded once and
    /// shared by every session that sends it
    /// ([`SharedProjection`](crate::control_session::SharedProjection)). On the wire it is
    /// exactly [`ControlMessage::PrincipalProjectionPart`] or
    /// [`ControlMessage::PrincipalProjectionApplyRequest`], and the Edge decodes it as one of
    /// those: a decoded frame never holds this variant.
    EncodedProjection(EncodedProjection),
}

/// A [`PrincipalProjection`] already encoded (its protobuf bytes), sent as a part or as the
/// apply request that completes a push ([`ControlMessage::EncodedProjection`]). Made only by
/// the Control Plane's session from a projection it cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedProjection {
    apply: bool,
    bytes: bytes::Bytes,
}

impl EncodedProjection {
    /// `bytes`, the encoding of a `PrincipalProjection` message, sent as a part, or as the
    /// apply request when `apply`.
    pub(crate) fn new(apply: bool, bytes: bytes::Bytes) -> Self {
        Self { apply, bytes }
    }

    /// Sent as the apply request (else as a part).
    pub fn is_apply(&self) -> bool {
        self.apply
    }

    /// The projection's protobuf encoding.
    pub fn bytes(&self) -> &bytes::Bytes {
        &self.bytes
    }

    /// The envelope field it is sent as (`principal_projection_apply_request` or
    /// `principal_projection_part` in `control.proto`).
    pub(crate) fn envelope_field(&self) -> u32 {
        if self.apply { 18 } else { 26 }
    }
}

impl ControlFrame {
    /// A frame without correlation.
    pub fn new(message: ControlMessage) -> Self {
        Self {
            correlation_id: 0,
            message,
        }
    }

    /// A frame paired by `correlation_id`.
    pub fn correlated(correlation_id: u64, message: ControlMessage) -> Self {
        Self {
            correlation_id,
            message,
        }
    }

    pub(crate) fn to_proto(&self) -> pb::ControlEnvelope {
        use pb::control_envelope::Message as M;
        let message = match &self.message {
            ControlMessage::EdgeHelloRequest(m) => M::EdgeHelloRequest(pb::EdgeHelloRequest {
                edge_id: m.edge_id.clone(),
                version: m.version.clone(),
                managed: m.managed,
                metadata: m.metadata.clone(),
                projection_parts: m.projection_parts,
                max_frame_len: m.max_frame_len,
            }),
            ControlMessage::EdgeHelloResponse(m) => M::EdgeHelloResponse(m.to_proto()),
            ControlMessage::EdgeStatusRequest => M::EdgeStatusRequest(pb::EdgeStatusRequest {}),
            ControlMessage::EdgeStatusResponse(m) => M::EdgeStatusResponse(m.to_proto()),
            ControlMessage::EdgeCommandRequest(m) => {
                M::EdgeCommandRequest(pb::EdgeCommandRequest {
                    command_id: m.command_id.clone(),
                    operation: m.operation.clone(),
                    target_selector: m.target_selector.clone(),
                    args: m.args.clone(),
                    metadata: m.metadata.clone(),
                })
            }
            ControlMessage::EdgeCommandResponse(m) => {
                M::EdgeCommandResponse(pb::EdgeCommandResponse {
                    command_id: m.command_id.clone(),
                    ok: m.ok,
                    error: m.error.clone(),
                    result: m.result.clone(),
                })
            }
            ControlMessage::EdgeCommandEvent(m) => M::EdgeCommandEvent(pb::EdgeCommandEvent {
                command_id: m.command_id.clone(),
                phase: m.phase.clone(),
                message: m.message.clone(),
                metadata: m.metadata.clone(),
            }),
            ControlMessage::EdgeNodeEvent(m) => M::EdgeNodeEvent(pb::EdgeNodeEvent {
                event_type: m.kind.as_str().to_owned(),
                node_id: m.node_id.clone(),
                edge_id: m.edge_id.clone(),
                occurred_at_unix_ms: m.occurred_at_unix_ms,
                metadata: m.metadata.clone(),
            }),
            ControlMessage::PrincipalProjectionApplyRequest(p) => {
                M::PrincipalProjectionApplyRequest(pb::PrincipalProjectionApplyRequest {
                    projection: Some(p.to_proto()),
                })
            }
            ControlMessage::PrincipalProjectionApplyResponse(m) => {
                M::PrincipalProjectionApplyResponse(pb::PrincipalProjectionApplyResponse {
                    accepted: m.accepted,
                    generation: m.generation,
                    reason: m.reason.clone(),
                })
            }
            ControlMessage::AcquireLeaseRequest(m) => {
                M::AcquireLeaseRequest(pb::AcquireLeaseRequest {
                    binding: Some(m.binding.to_proto()),
                    recipient_public_key: bytes::Bytes::copy_from_slice(&m.recipient_public_key),
                    trace: m.trace.as_ref().map(crate::trace::TraceContext::to_proto),
                })
            }
            ControlMessage::AcquireLeaseResponse(m) => M::AcquireLeaseResponse(match m {
                AcquireLeaseResponse::Granted(lease) => pb::AcquireLeaseResponse {
                    granted: true,
                    reason: String::new(),
                    lease: Some(lease.to_proto()),
                },
                AcquireLeaseResponse::Refused { reason } => pb::AcquireLeaseResponse {
                    granted: false,
                    reason: reason.clone(),
                    lease: None,
                },
            }),
            ControlMessage::Ping => M::Ping(crate::proto::runtime::Ping {}),
            ControlMessage::Pong => M::Pong(crate::proto::runtime::Pong {}),
            ControlMessage::EdgeUsageReport(m) => M::EdgeUsageReport(pb::EdgeUsageReport {
                records: m.records.iter().map(UsageRecord::to_proto).collect(),
            }),
            ControlMessage::EdgeUsageAck(m) => M::EdgeUsageAck(pb::EdgeUsageAck {
                stored: m.stored,
                duplicates: m.duplicates,
            }),
            ControlMessage::PrincipalProjectionPart(p) => M::PrincipalProjectionPart(p.to_proto()),
            ControlMessage::EncodedProjection(e) => {
                // Not the hot path (the codec writes the bytes as they are): decoded back.
                use prost::Message as _;
                let p = pb::PrincipalProjection::decode(e.bytes.clone())
                    .expect("made by PrincipalProjection::encode_bytes");
                if e.apply {
                    M::PrincipalProjectionApplyRequest(pb::PrincipalProjectionApplyRequest {
                        projection: Some(p),
                    })
                } else {
                    M::PrincipalProjectionPart(p)
                }
            }
        };
        pb::ControlEnvelope {
            correlation_id: self.correlation_id,
            message: Some(message),
        }
    }
}

impl TryFrom<pb::ControlEnvelope> for ControlFrame {
    type Error = InvalidMessage;

    fn try_from(env: pb::ControlEnvelope) -> Result<Self, Self::Error> {
        use pb::control_envelope::Message as M;
        let message = match env.message.ok_or(InvalidMessage::EmptyEnvelope)? {
            M::EdgeHelloRequest(m) => {
                validate::id("edge_id", &m.edge_id)?;
                validate::text("version", &m.version)?;
                metadata("metadata", &m.metadata)?;
                ControlMessage::EdgeHelloRequest(EdgeHelloRequest {
                    edge_id: m.edge_id,
                    version: m.version,
                    managed: m.managed,
                    metadata: m.metadata,
                    projection_parts: m.projection_parts,
                    max_frame_len: m.max_frame_len,
                })
            }
            M::EdgeHelloResponse(m) => ControlMessage::EdgeHelloResponse(m.try_into()?),
            M::EdgeStatusRequest(_) => ControlMessage::EdgeStatusRequest,
            M::EdgeStatusResponse(m) => ControlMessage::EdgeStatusResponse(m.try_into()?),
            M::EdgeCommandRequest(m) => {
                validate::id("command_id", &m.command_id)?;
                validate::id("operation", &m.operation)?;
                validate::text("target_selector", &m.target_selector)?;
                metadata("args", &m.args)?;
                metadata("metadata", &m.metadata)?;
                ControlMessage::EdgeCommandRequest(EdgeCommandRequest {
                    command_id: m.command_id,
                    operation: m.operation,
                    target_selector: m.target_selector,
                    args: m.args,
                    metadata: m.metadata,
                })
            }
            M::EdgeCommandResponse(m) => {
                validate::id("command_id", &m.command_id)?;
                validate::text("error", &m.error)?;
                metadata("result", &m.result)?;
                ControlMessage::EdgeCommandResponse(EdgeCommandResponse {
                    command_id: m.command_id,
                    ok: m.ok,
                    error: m.error,
                    result: m.result,
                })
            }
            M::EdgeCommandEvent(m) => {
                validate::id("command_id", &m.command_id)?;
                validate::id("phase", &m.phase)?;
                validate::text("message", &m.message)?;
                metadata("metadata", &m.metadata)?;
                ControlMessage::EdgeCommandEvent(EdgeCommandEvent {
                    command_id: m.command_id,
                    phase: m.phase,
                    message: m.message,
                    metadata: m.metadata,
                })
            }
            M::EdgeNodeEvent(m) => {
                let kind =
                    NodeEventKind::parse(&m.event_type).ok_or(InvalidMessage::InvalidValue {
                        field: "event_type",
                        rule: "node.connected or node.disconnected",
                    })?;
                validate::node_id("node_id", &m.node_id)?;
                validate::id("edge_id", &m.edge_id)?;
                metadata("metadata", &m.metadata)?;
                ControlMessage::EdgeNodeEvent(EdgeNodeEvent {
                    kind,
                    node_id: m.node_id,
                    edge_id: m.edge_id,
                    occurred_at_unix_ms: m.occurred_at_unix_ms,
                    metadata: m.metadata,
                })
            }
            M::PrincipalProjectionApplyRequest(m) => {
                ControlMessage::PrincipalProjectionApplyRequest(
                    m.projection
                        .ok_or(InvalidMessage::MissingField("projection"))?
                        .try_into()?,
                )
            }
            M::PrincipalProjectionApplyResponse(m) => {
                validate::text("reason", &m.reason)?;
                ControlMessage::PrincipalProjectionApplyResponse(PrincipalProjectionApplyResponse {
                    accepted: m.accepted,
                    generation: m.generation,
                    reason: m.reason,
                })
            }
            M::AcquireLeaseRequest(m) => {
                let recipient_public_key = <[u8; 32]>::try_from(&m.recipient_public_key[..])
                    .map_err(|_| InvalidMessage::InvalidValue {
                        field: "recipient_public_key",
                        rule: "must be 32 bytes",
                    })?;
                ControlMessage::AcquireLeaseRequest(AcquireLeaseRequest {
                    binding: m
                        .binding
                        .ok_or(InvalidMessage::MissingField("binding"))?
                        .try_into()?,
                    recipient_public_key,
                    trace: crate::trace::TraceContext::from_proto(m.trace),
                })
            }
            M::AcquireLeaseResponse(m) => {
                validate::text("reason", &m.reason)?;
                ControlMessage::AcquireLeaseResponse(if m.granted {
                    AcquireLeaseResponse::Granted(
                        m.lease
                            .ok_or(InvalidMessage::MissingField("lease"))?
                            .try_into()?,
                    )
                } else {
                    // A refusal never carries lease material; drop any that was sent.
                    AcquireLeaseResponse::Refused { reason: m.reason }
                })
            }
            M::Ping(_) => ControlMessage::Ping,
            M::Pong(_) => ControlMessage::Pong,
            M::EdgeUsageReport(m) => {
                if m.records.len() > MAX_USAGE_RECORDS {
                    return Err(InvalidMessage::TooLong("usage.records"));
                }
                ControlMessage::EdgeUsageReport(EdgeUsageReport {
                    records: m
                        .records
                        .into_iter()
                        .map(UsageRecord::try_from)
                        .collect::<Result<_, _>>()?,
                })
            }
            M::EdgeUsageAck(m) => ControlMessage::EdgeUsageAck(EdgeUsageAck {
                stored: m.stored,
                duplicates: m.duplicates,
            }),
            M::PrincipalProjectionPart(m) => ControlMessage::PrincipalProjectionPart(m.try_into()?),
        };
        Ok(Self {
            correlation_id: env.correlation_id,
            message,
        })
    }
}

fn metadata(field: &'static str, m: &BTreeMap<String, String>) -> Result<(), InvalidMessage> {
    if m.len() > crate::runtime::MAX_METADATA_ENTRIES {
        return Err(InvalidMessage::TooLong(field));
    }
    for (k, v) in m {
        validate::id(field, k)?;
        validate::text(field, v)?;
    }
    Ok(())
}

// === Hello ===

/// Edge → Control Plane: enrol this Edge connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeHelloRequest {
    /// Edge identity (non-empty; equals the certificate name in managed mode).
    pub edge_id: String,
    /// Edge software version.
    pub version: String,
    /// `credential_plane.enabled`.
    pub managed: bool,
    /// Identity/operational helper information only.
    pub metadata: BTreeMap<String, String>,
    /// The Edge assembles a projection sent in parts
    /// ([`ControlMessage::PrincipalProjectionPart`]); `false` from older Edges, which are only
    /// ever sent a projection whole.
    pub projection_parts: bool,
    /// The largest frame the Edge reads (0: not said, taken as
    /// [`DEFAULT_MAX_FRAME_LEN`](crate::codec::DEFAULT_MAX_FRAME_LEN)).
    pub max_frame_len: u32,
}

/// Control Plane → Edge: hello accepted or refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EdgeHelloResponse {
    /// Accepted.
    Accepted {
        /// The current projection (managed mode); a managed Edge rejects `None`.
        projection: Option<PrincipalProjection>,
        /// Heartbeat interval; `None` = receiver default.
        heartbeat_interval_ms: Option<u32>,
        /// The Control Plane stores usage records sent on this session ([`EdgeUsageReport`]);
        /// `false` from older Control Planes.
        accepts_usage: bool,
        /// The largest frame the Control Plane reads; 0 (older Control Planes): not said,
        /// taken as [`DEFAULT_MAX_FRAME_LEN`](crate::codec::DEFAULT_MAX_FRAME_LEN). The Edge's
        /// session fits its status answers to it.
        max_frame_len: u32,
    },
    /// Refused.
    Rejected {
        /// Stable reason.
        reason: String,
    },
}

impl EdgeHelloResponse {
    fn to_proto(&self) -> pb::EdgeHelloResponse {
        match self {
            Self::Accepted {
                projection,
                heartbeat_interval_ms,
                accepts_usage,
                max_frame_len,
            } => pb::EdgeHelloResponse {
                accepted: true,
                reason: String::new(),
                projection: projection.as_ref().map(PrincipalProjection::to_proto),
                heartbeat_interval_ms: heartbeat_interval_ms.unwrap_or(0),
                accepts_usage: *accepts_usage,
                max_frame_len: *max_frame_len,
            },
            Self::Rejected { reason } => pb::EdgeHelloResponse {
                accepted: false,
                reason: reason.clone(),
                ..Default::default()
            },
        }
    }
}

impl TryFrom<pb::EdgeHelloResponse> for EdgeHelloResponse {
    type Error = InvalidMessage;

    fn try_from(m: pb::EdgeHelloResponse) -> Result<Self, Self::Error> {
        validate::text("reason", &m.reason)?;
        if !m.accepted {
            return Ok(Self::Rejected { reason: m.reason });
        }
        Ok(Self::Accepted {
            projection: m
                .projection
                .map(PrincipalProjection::try_from)
                .transpose()?,
            heartbeat_interval_ms: (m.heartbeat_interval_ms != 0)
                .then_some(m.heartbeat_interval_ms),
            accepts_usage: m.accepts_usage,
            max_frame_len: m.max_frame_len,
        })
    }
}

// === Status ===

/// Edge → Control Plane: the Edge-owned Node snapshot view.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeStatusResponse {
    /// The Edge.
    pub edge_id: String,
    /// Every configured or connected Node, in `node_id` order, unless some were left out.
    pub nodes: Vec<EdgeNodeSnapshot>,
    /// How many Nodes were left out so that the answer fits the status bounds and the
    /// Control Plane's frame ([`EdgeStatusResponse::fit`]); they come after the last one
    /// listed. Always 0 from older Edges.
    pub omitted_nodes: u32,
}

/// Most Nodes one status answer may list.
pub const MAX_STATUS_NODES: usize = 65_536;
/// Most provider snapshots one status answer may carry, over all its Nodes. At the ≈80 bytes a
/// real snapshot takes on the wire, more would not fit the default 8 MiB frame anyway; an
/// empty one takes 2 bytes and decodes into about 200, so the bound also holds what a
/// hostile answer costs the Control Plane to decode (see `codec`).
pub const MAX_STATUS_PROVIDERS: usize = 1 << 17;
/// Most adapters (names, and types alike) one status answer may list, over all its Nodes.
pub const MAX_STATUS_ADAPTERS: usize = 1 << 18;

/// Bytes a frame takes at most beside a status answer's Nodes: the envelope's correlation id,
/// the message's tag and length, the Edge id (at most [`validate::MAX_ID_LEN`] bytes) and
/// `omitted_nodes`.
const STATUS_FRAME_OVERHEAD: usize = 256;

impl EdgeStatusResponse {
    /// Leaves Nodes out, from the end, until the answer is within the status bounds
    /// ([`MAX_STATUS_NODES`], [`MAX_STATUS_PROVIDERS`], [`MAX_STATUS_ADAPTERS`]) and its frame
    /// within `max_frame_len`; the Nodes are first sorted by `node_id`, so those kept are the
    /// first in that order. Adds how many this call left out to `omitted_nodes`, and returns
    /// that number.
    ///
    /// Whole Nodes or none: a Node listed with some of its providers would read as a Node
    /// that has only those. The Edge's session calls this on every answer
    /// ([`EdgeControlSession::respond_status`](crate::control_session::EdgeControlSession::respond_status))
    /// with the Control Plane's frame limit, so that an Edge with more Nodes than one answer
    /// holds still answers, instead of sending what the Control Plane refuses (or its own
    /// codec cannot write) and losing its session on every status request.
    pub fn fit(&mut self, max_frame_len: usize) -> u32 {
        use prost::Message as _;
        self.nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        let budget = max_frame_len.saturating_sub(STATUS_FRAME_OVERHEAD);
        let (mut used, mut providers, mut adapters) = (0usize, 0usize, 0usize);
        let mut kept = 0;
        for n in &self.nodes {
            used += repeated_field_len(node_to_proto(n).encoded_len());
            providers += n.provider_snapshots.len();
            adapters += n.config.adapters.len();
            if kept == MAX_STATUS_NODES
                || used > budget
                || providers > MAX_STATUS_PROVIDERS
                || adapters > MAX_STATUS_ADAPTERS
            {
                break;
            }
            kept += 1;
        }
        let omitted = u32::try_from(self.nodes.len() - kept).unwrap_or(u32::MAX);
        self.nodes.truncate(kept);
        self.omitted_nodes = self.omitted_nodes.saturating_add(omitted);
        omitted
    }

    fn to_proto(&self) -> pb::EdgeStatusResponse {
        pb::EdgeStatusResponse {
            edge_id: self.edge_id.clone(),
            nodes: self.nodes.iter().map(node_to_proto).collect(),
            omitted_nodes: self.omitted_nodes,
        }
    }
}

/// What a message of `len` bytes takes as an entry of a repeated field numbered below 16 (all
/// those that [`PrincipalProjection::into_parts`], [`EdgeStatusResponse::fit`] and
/// [`EdgeUsageReport::records_that_fit`] count): its tag, its length, itself.
fn repeated_field_len(len: usize) -> usize {
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

fn node_to_proto(n: &EdgeNodeSnapshot) -> pb::EdgeNodeSnapshot {
    pb::EdgeNodeSnapshot {
        node_id: n.node_id.clone(),
        connected: n.connected,
        config: Some(pb::EdgeNodeConfigSummary {
            revision: n.config.revision,
            adapter_names: n.config.adapters.iter().map(|a| a.0.clone()).collect(),
            adapter_types: n.config.adapters.iter().map(|a| a.1.clone()).collect(),
        }),
        provider_snapshots: n
            .provider_snapshots
            .iter()
            .map(ProviderSnapshot::to_proto)
            .collect(),
        refused: n.refused.clone(),
        warning: n.warning.clone(),
    }
}

impl TryFrom<pb::EdgeStatusResponse> for EdgeStatusResponse {
    type Error = InvalidMessage;

    fn try_from(m: pb::EdgeStatusResponse) -> Result<Self, Self::Error> {
        validate::id("edge_id", &m.edge_id)?;
        if m.nodes.len() > MAX_STATUS_NODES {
            return Err(InvalidMessage::TooLong("nodes"));
        }
        let (mut providers, mut adapters) = (0usize, 0usize);
        for n in &m.nodes {
            providers += n.provider_snapshots.len();
            adapters += n.config.as_ref().map_or(0, |c| c.adapter_names.len());
        }
        if providers > MAX_STATUS_PROVIDERS {
            return Err(InvalidMessage::TooLong("nodes.provider_snapshots"));
        }
        if adapters > MAX_STATUS_ADAPTERS {
            return Err(InvalidMessage::TooLong("nodes.config.adapter_names"));
        }
        let nodes = m
            .nodes
            .into_iter()
            .map(|n| {
                validate::node_id("nodes.node_id", &n.node_id)?;
                let c = n.config.unwrap_or_default();
                if c.adapter_names.len() != c.adapter_types.len() {
                    return Err(InvalidMessage::InvalidValue {
                        field: "nodes.config",
                        rule: "adapter_names and adapter_types have the same length",
                    });
                }
                for (name, ty) in c.adapter_names.iter().zip(&c.adapter_types) {
                    validate::optional_id("nodes.config.adapter_names", name)?;
                    validate::id("nodes.config.adapter_types", ty)?;
                }
                validate::text("nodes.refused", &n.refused)?;
                validate::text("nodes.warning", &n.warning)?;
                Ok(EdgeNodeSnapshot {
                    node_id: n.node_id,
                    connected: n.connected,
                    config: EdgeNodeConfigSummary {
                        revision: c.revision,
                        adapters: c.adapter_names.into_iter().zip(c.adapter_types).collect(),
                    },
                    provider_snapshots: n
                        .provider_snapshots
                        .into_iter()
                        .map(ProviderSnapshot::try_from)
                        .collect::<Result<_, _>>()?,
                    refused: n.refused,
                    warning: n.warning,
                })
            })
            .collect::<Result<_, InvalidMessage>>()?;
        Ok(Self {
            edge_id: m.edge_id,
            nodes,
            omitted_nodes: m.omitted_nodes,
        })
    }
}

/// One Node in the Edge's status view.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeNodeSnapshot {
    /// Node id.
    pub node_id: String,
    /// Current dispatch-ready ownership.
    pub connected: bool,
    /// Config summary.
    pub config: EdgeNodeConfigSummary,
    /// Provider snapshots (offline figures when not connected).
    pub provider_snapshots: Vec<ProviderSnapshot>,
    /// Why the Node's last registration was refused, when its configuration disagrees with
    /// the Edge's or the Control Plane's, or why it is not selected now (it does not trust
    /// the current lease issuer key); empty otherwise.
    pub refused: String,
    /// What will stop the Node being selected (it does not trust the staged lease issuer
    /// key); empty otherwise.
    pub warning: String,
}

/// Observational config summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeNodeConfigSummary {
    /// Config revision.
    pub revision: u64,
    /// `(instance name, adapter type)` pairs.
    pub adapters: Vec<(String, String)>,
}

// === Commands and events ===

/// Control Plane → Edge: an Edge-owned operation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeCommandRequest {
    /// Command id (events and the response echo it).
    pub command_id: String,
    /// Edge-owned operation name.
    pub operation: String,
    /// Selector the operation interprets.
    pub target_selector: String,
    /// Arguments.
    pub args: BTreeMap<String, String>,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
}

/// Edge → Control Plane: a command's final result.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeCommandResponse {
    /// Command id.
    pub command_id: String,
    /// Success.
    pub ok: bool,
    /// Stable error text.
    pub error: String,
    /// Result.
    pub result: BTreeMap<String, String>,
}

/// Edge → Control Plane: a command phase.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeCommandEvent {
    /// Command id.
    pub command_id: String,
    /// Phase name.
    pub phase: String,
    /// Message.
    pub message: String,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
}

/// Kind of a Node lifecycle event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeEventKind {
    /// The Node's first ready transition on a connection generation.
    Connected,
    /// The ready owner's generation was fenced (close or heartbeat timeout).
    Disconnected,
}

impl NodeEventKind {
    /// Wire value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connected => "node.connected",
            Self::Disconnected => "node.disconnected",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Self::Connected, Self::Disconnected]
            .into_iter()
            .find(|k| k.as_str() == s)
    }
}

/// Edge → Control Plane: a relayed Node lifecycle event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgeNodeEvent {
    /// Kind.
    pub kind: NodeEventKind,
    /// Node.
    pub node_id: String,
    /// Edge.
    pub edge_id: String,
    /// When, Unix milliseconds.
    pub occurred_at_unix_ms: i64,
    /// Metadata.
    pub metadata: BTreeMap<String, String>,
}

// === Projection ===

/// Secret-free projection of principals, token verifiers and routes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrincipalProjection {
    /// Strictly increasing durable mutation generation.
    pub generation: u64,
    /// Principals.
    pub principals: Vec<ProjectedPrincipal>,
    /// Token verifiers.
    pub tokens: Vec<ProjectedToken>,
    /// Routes.
    pub routes: Vec<ProjectedRoute>,
    /// The id of the key the Control Plane signs leases with now (`iop_lease::issuer_key_id`);
    /// empty from older Control Planes. A managed Edge refuses Nodes that do not trust it.
    pub issuer_key_id: String,
    /// The key staged to replace it (empty when none): Nodes should pin it before
    /// `staged_issuer_activates_at_unix_ms`; a managed Edge reports those that do not.
    pub staged_issuer_key_id: String,
    /// When the staged key becomes the signing key (Unix ms; 0 when none is staged).
    pub staged_issuer_activates_at_unix_ms: i64,
    /// How many parts of this projection came before this message (0: it is whole). Set by
    /// [`PrincipalProjection::into_parts`] and read by the Edge's session, which assembles the
    /// parts and installs a whole projection (`0` again); leave it 0 when building one.
    pub parts_before: u32,
}

/// Most entries of each list in one projection.
pub const MAX_PROJECTION_ENTRIES: usize = 1 << 20;

/// A projected principal.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProjectedPrincipal {
    /// Id.
    pub principal_id: String,
    /// Display name.
    pub display_name: String,
    /// Enabled.
    pub enabled: bool,
    /// Rate limits and spend budgets; `None`: not limited (and from older Control Planes).
    pub limits: Option<PrincipalLimits>,
}

/// Most per-model entries in one principal's limits.
pub const MAX_MODEL_LIMITS: usize = 1024;

/// A principal's rate limits and spend budgets (issue #29). Zero means "not limited" for each
/// value. The Edge enforces them with the same rule as a gateway key's (`iop_edge::limits`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrincipalLimits {
    /// Requests per minute.
    pub requests_per_minute: u64,
    /// Tokens (input + output) per minute.
    pub tokens_per_minute: u64,
    /// Requests in flight at once, per Edge.
    pub concurrent: u32,
    /// Spend budget per UTC day, millionths of a US dollar.
    pub budget_per_day_micro_usd: u64,
    /// Spend budget per UTC calendar month, millionths of a US dollar.
    pub budget_per_month_micro_usd: u64,
    /// Limits on one external model each (unique models, at most [`MAX_MODEL_LIMITS`]).
    pub models: Vec<ModelLimits>,
}

/// A principal's limits on one external model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelLimits {
    /// External model name (the wire's target rule).
    pub model: String,
    /// Requests per minute (0: not limited).
    pub requests_per_minute: u64,
    /// Tokens per minute (0: not limited).
    pub tokens_per_minute: u64,
    /// Requests in flight at once, per Edge (0: not limited).
    pub concurrent: u32,
}

impl PrincipalLimits {
    fn to_proto(&self) -> pb::PrincipalLimits {
        pb::PrincipalLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            concurrent: self.concurrent,
            budget_per_day_micro_usd: self.budget_per_day_micro_usd,
            budget_per_month_micro_usd: self.budget_per_month_micro_usd,
            models: self
                .models
                .iter()
                .map(|m| pb::ModelLimits {
                    model: m.model.clone(),
                    requests_per_minute: m.requests_per_minute,
                    tokens_per_minute: m.tokens_per_minute,
                    concurrent: m.concurrent,
                })
                .collect(),
        }
    }
}

impl TryFrom<pb::PrincipalLimits> for PrincipalLimits {
    type Error = InvalidMessage;

    fn try_from(m: pb::PrincipalLimits) -> Result<Self, Self::Error> {
        if m.models.len() > MAX_MODEL_LIMITS {
            return Err(InvalidMessage::TooLong(
                "projection.principals.limits.models",
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        let models = m
            .models
            .into_iter()
            .map(|l| {
                validate::target("projection.principals.limits.models.model", &l.model)?;
                if !seen.insert(l.model.clone()) {
                    return Err(InvalidMessage::InvalidValue {
                        field: "projection.principals.limits.models.model",
                        rule: "unique per principal",
                    });
                }
                Ok(ModelLimits {
                    model: l.model,
                    requests_per_minute: l.requests_per_minute,
                    tokens_per_minute: l.tokens_per_minute,
                    concurrent: l.concurrent,
                })
            })
            .collect::<Result<_, InvalidMessage>>()?;
        Ok(Self {
            requests_per_minute: m.requests_per_minute,
            tokens_per_minute: m.tokens_per_minute,
            concurrent: m.concurrent,
            budget_per_day_micro_usd: m.budget_per_day_micro_usd,
            budget_per_month_micro_usd: m.budget_per_month_micro_usd,
            models,
        })
    }
}

/// A projected token verifier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectedToken {
    /// Token id.
    pub token_id: String,
    /// Owning principal.
    pub principal_id: String,
    /// SHA-256 of the raw token.
    pub sha256_digest: [u8; 32],
}

/// A projected route.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProjectedRoute {
    /// Route id.
    pub route_id: String,
    /// Principal.
    pub principal_id: String,
    /// External model name.
    pub model: String,
    /// Credential slot.
    pub slot_id: String,
    /// Protocol profile.
    pub profile: String,
    /// Upstream target.
    pub upstream_target: String,
    /// Provider selector.
    pub selector: String,
    /// Route revision.
    pub route_revision: u64,
    /// Credential revision.
    pub credential_revision: u64,
}

impl PrincipalProjection {
    fn to_proto(&self) -> pb::PrincipalProjection {
        pb::PrincipalProjection {
            generation: self.generation,
            principals: self
                .principals
                .iter()
                .map(|p| pb::ProjectedPrincipal {
                    principal_id: p.principal_id.clone(),
                    display_name: p.display_name.clone(),
                    enabled: p.enabled,
                    limits: p.limits.as_ref().map(PrincipalLimits::to_proto),
                })
                .collect(),
            tokens: self
                .tokens
                .iter()
                .map(|t| pb::ProjectedToken {
                    token_id: t.token_id.clone(),
                    principal_id: t.principal_id.clone(),
                    sha256_digest: bytes::Bytes::copy_from_slice(&t.sha256_digest),
                })
                .collect(),
            routes: self
                .routes
                .iter()
                .map(|r| pb::ProjectedRoute {
                    route_id: r.route_id.clone(),
                    principal_id: r.principal_id.clone(),
                    model: r.model.clone(),
                    slot_id: r.slot_id.clone(),
                    profile: r.profile.clone(),
                    upstream_target: r.upstream_target.clone(),
                    selector: r.selector.clone(),
                    route_revision: r.route_revision,
                    credential_revision: r.credential_revision,
                })
                .collect(),
            issuer_key_id: self.issuer_key_id.clone(),
            staged_issuer_key_id: self.staged_issuer_key_id.clone(),
            staged_issuer_activates_at_unix_ms: self.staged_issuer_activates_at_unix_ms,
            parts_before: self.parts_before,
        }
    }
}

impl TryFrom<pb::PrincipalProjection> for PrincipalProjection {
    type Error = InvalidMessage;

    fn try_from(m: pb::PrincipalProjection) -> Result<Self, Self::Error> {
        if m.generation == 0 {
            return Err(InvalidMessage::InvalidValue {
                field: "projection.generation",
                rule: "starts at 1",
            });
        }
        if m.principals.len() > MAX_PROJECTION_ENTRIES
            || m.tokens.len() > MAX_PROJECTION_ENTRIES
            || m.routes.len() > MAX_PROJECTION_ENTRIES
        {
            return Err(InvalidMessage::TooLong("projection"));
        }
        let principals = m
            .principals
            .into_iter()
            .map(|p| {
                validate::id("projection.principals.principal_id", &p.principal_id)?;
                validate::text("projection.principals.display_name", &p.display_name)?;
                Ok(ProjectedPrincipal {
                    principal_id: p.principal_id,
                    display_name: p.display_name,
                    enabled: p.enabled,
                    limits: p.limits.map(PrincipalLimits::try_from).transpose()?,
                })
            })
            .collect::<Result<_, InvalidMessage>>()?;
        let tokens = m
            .tokens
            .into_iter()
            .map(|t| {
                validate::id("projection.tokens.token_id", &t.token_id)?;
                validate::id("projection.tokens.principal_id", &t.principal_id)?;
                let sha256_digest = <[u8; 32]>::try_from(&t.sha256_digest[..]).map_err(|_| {
                    InvalidMessage::InvalidValue {
                        field: "projection.tokens.sha256_digest",
                        rule: "32 bytes",
                    }
                })?;
                Ok(ProjectedToken {
                    token_id: t.token_id,
                    principal_id: t.principal_id,
                    sha256_digest,
                })
            })
            .collect::<Result<_, InvalidMessage>>()?;
        let routes = m
            .routes
            .into_iter()
            .map(|r| {
                validate::id("projection.routes.route_id", &r.route_id)?;
                validate::id("projection.routes.principal_id", &r.principal_id)?;
                validate::target("projection.routes.model", &r.model)?;
                validate::id("projection.routes.slot_id", &r.slot_id)?;
                validate::id("projection.routes.profile", &r.profile)?;
                validate::target("projection.routes.upstream_target", &r.upstream_target)?;
                validate::optional_target("projection.routes.selector", &r.selector)?;
                Ok(ProjectedRoute {
                    route_id: r.route_id,
                    principal_id: r.principal_id,
                    model: r.model,
                    slot_id: r.slot_id,
                    profile: r.profile,
                    upstream_target: r.upstream_target,
                    selector: r.selector,
                    route_revision: r.route_revision,
                    credential_revision: r.credential_revision,
                })
            })
            .collect::<Result<_, InvalidMessage>>()?;
        if !m.issuer_key_id.is_empty() {
            validate::id("projection.issuer_key_id", &m.issuer_key_id)?;
        }
        if !m.staged_issuer_key_id.is_empty() {
            validate::id("projection.staged_issuer_key_id", &m.staged_issuer_key_id)?;
        }
        if m.staged_issuer_activates_at_unix_ms < 0
            || m.staged_issuer_key_id.is_empty() != (m.staged_issuer_activates_at_unix_ms == 0)
        {
            return Err(InvalidMessage::InvalidValue {
                field: "projection.staged_issuer_activates_at_unix_ms",
                rule: "positive exactly when a staged key is named",
            });
        }
        Ok(Self {
            generation: m.generation,
            principals,
            tokens,
            routes,
            issuer_key_id: m.issuer_key_id,
            staged_issuer_key_id: m.staged_issuer_key_id,
            staged_issuer_activates_at_unix_ms: m.staged_issuer_activates_at_unix_ms,
            parts_before: m.parts_before,
        })
    }
}

/// Bytes a frame takes at most beside a projection's entries: the envelope's correlation id, the
/// message's tag and length, the hello answer's other fields, the projection's generation, its
/// issuer key ids (at most [`validate::MAX_ID_LEN`] bytes each) and `parts_before`.
const PROJECTION_FRAME_OVERHEAD: usize = 1024;

/// A projection the Control Plane cannot send to an Edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProjectionTooLarge {
    /// It does not fit one frame, and the Edge does not take parts (an older Edge).
    #[error(
        "a principal projection of {len} bytes does not fit one frame of {max_frame_len} bytes, \
         and this edge does not take it in parts"
    )]
    Whole {
        /// The projection's encoded size.
        len: usize,
        /// The frame limit.
        max_frame_len: usize,
    },
    /// One entry alone is larger than a frame: no cut helps.
    #[error(
        "a principal projection entry of {len} bytes does not fit frames of {max_frame_len} bytes"
    )]
    Entry {
        /// The entry's encoded size.
        len: usize,
        /// The frame limit.
        max_frame_len: usize,
    },
    /// More than an Edge assembles from parts: a list longer than [`MAX_PROJECTION_ENTRIES`],
    /// or more heap than
    /// [`MAX_ASSEMBLED_PROJECTION_BYTES`](crate::control_session::MAX_ASSEMBLED_PROJECTION_BYTES).
    #[error(
        "a principal projection of {entries} entries in its longest list and {held_bytes} bytes \
         of heap is more than an edge assembles ({MAX_PROJECTION_ENTRIES} entries per list, {} \
         bytes)",
        crate::control_session::MAX_ASSEMBLED_PROJECTION_BYTES
    )]
    Assembly {
        /// The length of its longest list.
        entries: usize,
        /// [`PrincipalProjection::held_bytes`].
        held_bytes: usize,
    },
}

impl PrincipalProjection {
    /// The projection cut into frames of at most `max_frame_len` bytes: itself alone when it
    /// fits one, otherwise parts of whole entries (principals, then tokens, then routes, in
    /// their order), each with the projection's generation and its index in `parts_before`.
    /// The last part carries the issuer key fields; it is the one the hello answer or apply
    /// request carries, after the others as [`ControlMessage::PrincipalProjectionPart`]s.
    ///
    /// Fails only when one entry alone does not fit a frame (a principal with a thousand
    /// per-model limits is about 300 KB). The Control Plane's session cuts what it sends
    /// (`control_session`); an embedder does not need to call this.
    pub fn into_parts(mut self, max_frame_len: usize) -> Result<Vec<Self>, ProjectionTooLarge> {
        use prost::Message as _;
        let budget = max_frame_len.saturating_sub(PROJECTION_FRAME_OVERHEAD);
        self.parts_before = 0;
        let proto = self.to_proto();
        if proto.encoded_len() <= budget {
            return Ok(vec![self]);
        }
        // Each entry as a repeated field: its tag, its length, itself.
        let field = repeated_field_len;
        let sizes = (proto.principals.iter().map(|e| field(e.encoded_len())))
            .chain(proto.tokens.iter().map(|e| field(e.encoded_len())))
            .chain(proto.routes.iter().map(|e| field(e.encoded_len())));
        // How many entries each part holds.
        let mut counts = Vec::new();
        let (mut in_part, mut used) = (0usize, 0usize);
        for size in sizes {
            if size > budget {
                return Err(ProjectionTooLarge::Entry {
                    len: size,
                    max_frame_len,
                });
            }
            if used + size > budget {
                counts.push(in_part);
                (in_part, used) = (0, 0);
            }
            in_part += 1;
            used += size;
        }
        counts.push(in_part);
        drop(proto);
        let mut principals = std::mem::take(&mut self.principals).into_iter();
        let mut tokens = std::mem::take(&mut self.tokens).into_iter();
        let mut routes = std::mem::take(&mut self.routes).into_iter();
        let last = counts.len() - 1;
        let mut parts = Vec::with_capacity(counts.len());
        for (index, mut n) in counts.into_iter().enumerate() {
            let mut part = if index == last {
                std::mem::take(&mut self)
            } else {
                Self {
                    generation: self.generation,
                    ..Self::default()
                }
            };
            // At most 3 × 2^20 entries, so the index fits.
            part.parts_before = u32::try_from(index).unwrap_or(u32::MAX);
            let k = n.min(principals.len());
            part.principals.extend(principals.by_ref().take(k));
            n -= k;
            let k = n.min(tokens.len());
            part.tokens.extend(tokens.by_ref().take(k));
            n -= k;
            part.routes.extend(routes.by_ref().take(n));
            parts.push(part);
        }
        Ok(parts)
    }

    /// Its protobuf encoding (what a part carries).
    pub(crate) fn encode_bytes(&self) -> bytes::Bytes {
        use prost::Message as _;
        bytes::Bytes::from(self.to_proto().encode_to_vec())
    }

    /// Its size on the wire, without the envelope around it.
    pub fn encoded_len(&self) -> usize {
        use prost::Message as _;
        self.to_proto().encoded_len()
    }

    /// About the heap this projection holds: each entry's size and its strings' capacity. The
    /// Edge's session bounds the parts it assembles by it.
    pub fn held_bytes(&self) -> usize {
        use std::mem::size_of;
        let principals: usize = (self.principals.iter())
            .map(|p| {
                let limits = p.limits.as_ref().map_or(0, |l| {
                    size_of::<PrincipalLimits>()
                        + l.models.capacity() * size_of::<ModelLimits>()
                        + l.models.iter().map(|m| m.model.capacity()).sum::<usize>()
                });
                size_of::<ProjectedPrincipal>()
                    + p.principal_id.capacity()
                    + p.display_name.capacity()
                    + limits
            })
            .sum();
        let tokens: usize = (self.tokens.iter())
            .map(|t| {
                size_of::<ProjectedToken>() + t.token_id.capacity() + t.principal_id.capacity()
            })
            .sum();
        let routes: usize = (self.routes.iter())
            .map(|r| {
                size_of::<ProjectedRoute>()
                    + r.route_id.capacity()
                    + r.principal_id.capacity()
                    + r.model.capacity()
                    + r.slot_id.capacity()
                    + r.profile.capacity()
                    + r.upstream_target.capacity()
                    + r.selector.capacity()
            })
            .sum();
        principals + tokens + routes
    }
}

/// Edge → Control Plane: answer to a projection apply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrincipalProjectionApplyResponse {
    /// Accepted (strictly higher generation, valid).
    pub accepted: bool,
    /// Generation the Edge now holds.
    pub generation: u64,
    /// Stable reason when refused.
    pub reason: String,
}

// === Leases ===

/// Edge → Control Plane: acquire a lease for one dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcquireLeaseRequest {
    /// Exact dispatch scope.
    pub binding: CredentialLeaseBinding,
    /// Selected Node's X25519 public key.
    pub recipient_public_key: [u8; 32],
    /// The Edge's lease acquisition span, if the request is traced (see [`crate::trace`]).
    pub trace: Option<crate::trace::TraceContext>,
}

/// Control Plane → Edge: a lease, or a refusal without any credential material.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireLeaseResponse {
    /// Granted.
    Granted(CredentialLease),
    /// Refused.
    Refused {
        /// Stable reason.
        reason: String,
    },
}

// === Usage records ===

/// Most records in one [`EdgeUsageReport`].
pub const MAX_USAGE_RECORDS: usize = 512;

/// Edge → Control Plane: usage records, each sent until a report holding it is acknowledged
/// (so at least once: the Control Plane stores them idempotently by request id).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EdgeUsageReport {
    /// At most [`MAX_USAGE_RECORDS`].
    pub records: Vec<UsageRecord>,
}

/// Bytes a frame takes beside a usage report's records: the envelope's correlation id and the
/// message's tag and length.
const USAGE_FRAME_OVERHEAD: usize = 32;

impl EdgeUsageReport {
    /// How many of its first records fit one frame of `max_frame_len` bytes (all of them when
    /// the report does). The Edge's session refuses a report that does not fit the Control
    /// Plane's frame
    /// ([`ControlSessionError::UsageReportTooLarge`](crate::control_session::ControlSessionError::UsageReportTooLarge)),
    /// saying this number, so that the sender sends fewer rather than a frame that would end
    /// the session.
    pub fn records_that_fit(&self, max_frame_len: usize) -> usize {
        use prost::Message as _;
        let budget = max_frame_len.saturating_sub(USAGE_FRAME_OVERHEAD);
        let mut used = 0;
        for (i, r) in self.records.iter().enumerate() {
            used += repeated_field_len(r.to_proto().encoded_len());
            if used > budget {
                return i;
            }
        }
        self.records.len()
    }
}

/// Control Plane → Edge: every record of the report is durably stored (or already was).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EdgeUsageAck {
    /// Records stored by this report.
    pub stored: u32,
    /// Records already stored (a replay).
    pub duplicates: u32,
}

/// One request's usage, by principal (never a token or key).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageRecord {
    /// Unique across Edges and restarts.
    pub request_id: String,
    /// Admission time, Unix ms.
    pub at_unix_ms: i64,
    /// The principal.
    pub principal_id: String,
    /// The external model asked for.
    pub model: String,
    /// The provider that served it (`node/provider`); empty when none took it.
    pub provider: String,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens read from the provider's prompt cache (included in `input_tokens`).
    pub cached_input_tokens: u64,
    /// The tokens are the Edge's reservation (the provider reported none).
    pub estimated: bool,
    /// Cost at the Edge's prices, pico-dollars.
    pub cost_pico_usd: u64,
    /// `completed`, `failed`, `cancelled`, `refused` (an id-like word; newer values pass).
    pub outcome: String,
    /// Admission to end, microseconds.
    pub duration_us: u64,
    /// Admission to the answer's first byte, microseconds (0: not measured).
    pub first_byte_us: u64,
    /// What the mesh added (the duration less the provider's time at the Node), microseconds
    /// (0: not measured).
    pub added_us: u64,
}

impl UsageRecord {
    /// The checks a receiver applies ([`TryFrom`] on the wire form): a sender skips a record
    /// that fails them rather than have its whole report refused.
    pub fn check(&self) -> Result<(), InvalidMessage> {
        Self::try_from(self.to_proto()).map(|_| ())
    }

    fn to_proto(&self) -> pb::UsageRecord {
        pb::UsageRecord {
            request_id: self.request_id.clone(),
            at_unix_ms: self.at_unix_ms,
            principal_id: self.principal_id.clone(),
            model: self.model.clone(),
            provider: self.provider.clone(),
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            cached_input_tokens: self.cached_input_tokens,
            estimated: self.estimated,
            cost_pico_usd: self.cost_pico_usd,
            outcome: self.outcome.clone(),
            duration_us: self.duration_us,
            first_byte_us: self.first_byte_us,
            added_us: self.added_us,
        }
    }
}

impl TryFrom<pb::UsageRecord> for UsageRecord {
    type Error = InvalidMessage;

    fn try_from(m: pb::UsageRecord) -> Result<Self, Self::Error> {
        validate::id("usage.request_id", &m.request_id)?;
        validate::id("usage.principal_id", &m.principal_id)?;
        validate::target("usage.model", &m.model)?;
        validate::optional_target("usage.provider", &m.provider)?;
        validate::id("usage.outcome", &m.outcome)?;
        if m.outcome.len() > 32 {
            return Err(InvalidMessage::TooLong("usage.outcome"));
        }
        if m.at_unix_ms < 0 {
            return Err(InvalidMessage::InvalidValue {
                field: "usage.at_unix_ms",
                rule: "not negative",
            });
        }
        // Stored as signed 64-bit integers: larger values cannot be true counts.
        let fits = |v: u64| i64::try_from(v).is_ok();
        if ![
            m.input_tokens,
            m.output_tokens,
            m.cached_input_tokens,
            m.cost_pico_usd,
            m.duration_us,
            m.first_byte_us,
            m.added_us,
        ]
        .into_iter()
        .all(fits)
            || m.cached_input_tokens > m.input_tokens
        {
            return Err(InvalidMessage::InvalidValue {
                field: "usage",
                rule: "counts below 2^63, cached input within input",
            });
        }
        Ok(Self {
            request_id: m.request_id,
            at_unix_ms: m.at_unix_ms,
            principal_id: m.principal_id,
            model: m.model,
            provider: m.provider,
            input_tokens: m.input_tokens,
            output_tokens: m.output_tokens,
            cached_input_tokens: m.cached_input_tokens,
            estimated: m.estimated,
            cost_pico_usd: m.cost_pico_usd,
            outcome: m.outcome,
            duration_us: m.duration_us,
            first_byte_us: m.first_byte_us,
            added_us: m.added_us,
        })
    }
}
