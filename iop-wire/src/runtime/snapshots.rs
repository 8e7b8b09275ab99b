//! Snapshots.

use super::*;

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
