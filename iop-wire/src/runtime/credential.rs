//! Credential leases.

use super::*;

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
            .map(|c| *c)
            .ok_or(InvalidMessage::MissingField("credential_lease"))
    }
}

pub(super) fn managed_credential(
    lease: Option<pb::CredentialLease>,
    binding: Option<pb::CredentialLeaseBinding>,
) -> Result<Option<Box<ManagedCredential>>, InvalidMessage> {
    match (lease, binding) {
        (None, None) => Ok(None),
        (Some(lease), Some(binding)) => Ok(Some(Box::new(ManagedCredential {
            lease: lease.try_into()?,
            binding: binding.try_into()?,
        }))),
        _ => Err(InvalidMessage::InvalidValue {
            field: "credential_lease",
            rule: "lease and binding come together",
        }),
    }
}

pub(super) fn managed_credential_to_proto(
    c: Option<&ManagedCredential>,
) -> (
    Option<pb::CredentialLease>,
    Option<pb::CredentialLeaseBinding>,
) {
    c.map_or((None, None), |c| {
        (Some(c.lease.to_proto()), Some(c.binding.to_proto()))
    })
}
