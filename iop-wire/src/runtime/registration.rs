//! Registration and readiness.

use super::*;

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
    /// Managed mode: the ids of the lease issuer keys the Node trusts (at most
    /// [`MAX_ISSUER_KEY_IDS`]; empty from older Nodes and in legacy mode).
    pub issuer_key_ids: Vec<String>,
    /// The Node honours per-stream credit on tunnel bodies
    /// ([`ProviderTunnelRequest::credit_window`](super::ProviderTunnelRequest::credit_window),
    /// [`RuntimeMessage::StreamWindowUpdate`](super::RuntimeMessage::StreamWindowUpdate)).
    /// `false` from older Nodes: the Edge then never sends them either.
    pub stream_credit: bool,
}

/// Most issuer key ids one registration may name.
pub const MAX_ISSUER_KEY_IDS: usize = 16;

/// Most adapter types one registration may announce.
pub const MAX_ADAPTER_TYPES: usize = 64;

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
            issuer_key_ids: self.issuer_key_ids.clone(),
            stream_credit: self.stream_credit,
        }
    }
}

impl TryFrom<pb::RegisterRequest> for RegisterRequest {
    type Error = InvalidMessage;

    fn try_from(m: pb::RegisterRequest) -> Result<Self, Self::Error> {
        validate::node_id("node_id", &m.node_id)?;
        validate::text("version", &m.version)?;
        if m.adapter_types.len() > MAX_ADAPTER_TYPES {
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
        if m.issuer_key_ids.len() > MAX_ISSUER_KEY_IDS {
            return Err(InvalidMessage::TooLong("issuer_key_ids"));
        }
        for id in &m.issuer_key_ids {
            validate::id("issuer_key_ids", id)?;
        }
        Ok(Self {
            node_id: m.node_id,
            version: m.version,
            adapter_types: m.adapter_types,
            recipient,
            issuer_key_ids: m.issuer_key_ids,
            stream_credit: m.stream_credit,
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
