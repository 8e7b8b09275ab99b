//! The Edge terminal handoff of stalled runs and tunnels (evidence checked against the lease;
//! only a fresh `unavailable` sets the overlay) and the results of recovery probes.

use super::*;

impl<S: Sinks> EdgeCore<S> {
    /// Edge terminal handoff (seed 000). A stall terminal arrived on `generation` for the stream
    /// holding `lease`: when its typed evidence is valid and names the lease's own adapter and
    /// target on the lease's generation, it is a validated current bound stall — the metadata
    /// (of the run's ERROR event or the tunnel's ERROR delivery) gets `provider_id`,
    /// `provider_health` and `recovery_handoff=confirmed`, and only a *fresh* (higher
    /// `health_observation_seq`) `unavailable` observation sets the runtime-unavailable overlay.
    /// Rejected or mismatched evidence changes nothing; the lease is released by the terminal
    /// either way. Never adds `recovery_eligible`.
    pub(super) fn handoff(
        &mut self,
        now: Instant,
        lease: Option<LeaseId>,
        generation: Generation,
        evidence: &FailureEvidence,
        metadata: &mut BTreeMap<String, String>,
    ) {
        let (Some(pool), Some(lease), FailureEvidence::Valid(f)) =
            (self.pool.as_mut(), lease, evidence)
        else {
            return;
        };
        let Some(lease) = pool.lease(lease).cloned() else {
            return;
        };
        if lease.generation != generation || f.adapter != lease.adapter || f.target != lease.target
        {
            self.observer.recovery_eligibility(false);
            return;
        }
        self.observer.recovery_eligibility(true);
        self.observer.health_evidence(f.health.provider_health());
        metadata.insert("provider_id".into(), lease.key.provider_id.clone());
        metadata.insert("provider_health".into(), f.health.provider_health().into());
        metadata.insert("recovery_handoff".into(), "confirmed".into());
        let last = self
            .observed
            .entry((lease.key.clone(), generation))
            .or_insert(0);
        let fresh = f.health_observation_seq.is_some_and(|seq| seq > *last);
        if fresh {
            *last = f.health_observation_seq.unwrap_or(*last);
            if f.health == HealthEvidence::Unavailable
                && pool.set_unavailable(&lease.key, generation)
            {
                self.observer.health_transition(true);
                let log = self.health.entry(lease.key.clone()).or_default();
                if log.overlay.is_none_or(|(g, ..)| g != generation) {
                    log.overlay = Some((generation, now, f.idle_duration, f.fence));
                }
            }
        }
        tracing::info!(
            target: "iop_edge",
            event = "edge_provider_health_observation",
            provider_health = f.health.provider_health(),
            fresh,
            "stall terminal handed off"
        );
    }

    /// Applies a CAPABILITIES answer from `(node_id, generation)` to the overlays: each entry
    /// clears at most one overlay, only when `available`, fresher than anything seen for that
    /// binding, and matching exactly one provider of the Node.
    pub(super) fn apply_recovery(
        &mut self,
        now: Instant,
        node_id: &str,
        generation: Generation,
        resp: &NodeCommandResponse,
    ) -> usize {
        let Some(pool) = self.pool.as_mut() else {
            return 0;
        };
        if !resp.ok {
            return 0;
        }
        let mut cleared = 0;
        for cap in &resp.capabilities {
            let matches: Vec<ProviderKey> = pool
                .bindings(node_id)
                .into_iter()
                .filter(|(_, adapter, target)| *adapter == cap.adapter_key && *target == cap.target)
                .map(|(key, _, _)| key)
                .collect();
            let [key] = matches.as_slice() else { continue }; // none or ambiguous
            let last = self.observed.entry((key.clone(), generation)).or_insert(0);
            let log = self.health.entry(key.clone()).or_default();
            if cap.health_observation_seq <= *last {
                log.probe = Some((now, cap.provider_status.as_str(), false, false));
                continue; // stale
            }
            *last = cap.health_observation_seq;
            let ok = cap.provider_status == ProviderStatus::Available
                && pool.clear_unavailable(key, generation);
            log.probe = Some((now, cap.provider_status.as_str(), true, ok));
            self.observer.recovery_result(ok);
            if ok {
                log.overlay = None;
                self.observer.health_transition(false);
                cleared += 1;
            }
            tracing::info!(
                target: "iop_edge",
                event = "edge_liveness_recovery_observation",
                provider_status = cap.provider_status.as_str(),
                cleared = ok,
                "recovery probe answer applied"
            );
        }
        cleared
    }
}
