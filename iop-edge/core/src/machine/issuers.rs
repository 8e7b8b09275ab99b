//! The lease issuer keys a managed Edge holds Nodes to: trust (one rule,
//! [`crate::registry::pins_trust`]), exclusion of registered Nodes that do not pin the active
//! key, warnings for the staged one.

use std::time::Instant;

use super::*;

impl<S: Sinks> EdgeCore<S> {
    /// Managed mode: the lease issuer keys the Control Plane names in its projection. A Node
    /// registering without trusting the active key is refused
    /// ([`crate::registry::Registry::set_required_issuer`]); a registered Node that does not
    /// trust it (the key was just rotated) is no longer selected, its running work finishing
    /// ([`Pool::set_node_excluded`]), until it registers again trusting it; a Node that does
    /// not trust the staged key gets a warning (log and status) before the switch. Nodes
    /// that announce no key ids (legacy) are not checked.
    pub fn set_issuers(&mut self, now: Instant, issuers: Issuers) {
        self.registry.set_required_issuer(issuers.active.clone());
        if self.issuers == issuers {
            return;
        }
        self.issuers = issuers;
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, e)| e.registration.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        for node_id in nodes {
            self.check_issuers(&node_id);
        }
        // Taking a Node back in may have granted waiters.
        self.settle(now);
    }

    /// Why Node `node_id`'s last registration was refused for a configuration disagreement,
    /// if it was and it has not been ready since, or why it is not selected now.
    pub fn refused(&self, node_id: &str) -> Option<&str> {
        self.nodes
            .get(node_id)?
            .refusal
            .as_ref()
            .map(NodeRefusal::reason)
    }

    /// Whether Node `node_id`'s registration of `generation` pins issuer key `key_id` (true when
    /// it announced no ids, `key_id` is empty, or that generation is gone: its dispatch fails
    /// on its own).
    pub fn trusts(&self, node_id: &str, generation: Generation, key_id: &str) -> bool {
        self.registration(node_id)
            .is_none_or(|r| r.generation != generation || pins_trust(&r.pins, key_id))
    }

    /// What will stop Node `node_id` being selected (it does not trust the staged issuer key).
    pub fn warning(&self, node_id: &str) -> Option<&str> {
        self.nodes.get(node_id)?.warning.as_deref()
    }

    /// Node `node_id`'s current registration, if it has one.
    pub(super) fn registration(&self, node_id: &str) -> Option<&Registration> {
        self.nodes.get(node_id)?.registration.as_ref()
    }

    /// Why registered Node `node_id` must not be selected (it does not pin the active key).
    pub(super) fn untrusted(&self, node_id: &str) -> Option<String> {
        let pins = &self.registration(node_id)?.pins;
        self.issuers
            .active
            .as_ref()
            .filter(|a| !pins_trust(pins, a))
            .map(|a| {
                format!(
                    "{}: the control plane signs leases with {a} now; this node trusts {}; pin the key `iop-cp issuer-key` prints and restart the node",
                    crate::registry::reason::ISSUER_KEY_NOT_TRUSTED,
                    pins.join(", ")
                )
            })
    }

    /// Applies the issuer rules of [`EdgeCore::set_issuers`] to one registered Node.
    pub(super) fn check_issuers(&mut self, node_id: &str) {
        let Some(pins) = self
            .registration(node_id)
            .map(|r| &r.pins)
            .filter(|p| !p.is_empty())
        else {
            return;
        };
        let warning = self
            .issuers
            .staged
            .as_ref()
            .filter(|(s, _)| !pins_trust(pins, s))
            .map(|(s, at)| {
                format!(
                    "does not trust the staged issuer key {s}, which the control plane signs with from {at} (Unix ms); it will not be selected then: pin the key `iop-cp issuer-key --staged` prints"
                )
            });
        let untrusted = self.untrusted(node_id);
        let excluded = untrusted.is_some();
        let changed = self
            .pool
            .as_mut()
            .is_some_and(|p| p.set_node_excluded(node_id, excluded));
        let entry = self.nodes.entry(node_id.to_owned()).or_default();
        match untrusted {
            Some(reason) => {
                let refusal = NodeRefusal::IssuerUntrusted(reason);
                if changed || entry.refusal.as_ref() != Some(&refusal) {
                    tracing::warn!(target: "iop_edge", event = "edge_node_issuer_untrusted", %node_id, reason = %refusal.reason(), "node not selected: it cannot verify the key leases are signed with");
                }
                entry.refusal = Some(refusal);
            }
            None => {
                if matches!(entry.refusal, Some(NodeRefusal::IssuerUntrusted(_))) {
                    entry.refusal = None;
                }
            }
        }
        if let Some(w) = &warning
            && entry.warning.as_ref() != Some(w)
        {
            tracing::warn!(target: "iop_edge", event = "edge_node_issuer_staged_untrusted", %node_id, warning = %w, "node does not trust the staged lease issuer key");
        }
        entry.warning = warning;
    }
}

impl<S: Sinks> crate::binding::NodeTrust for EdgeCore<S> {
    fn trusts(&self, node_id: &str, generation: Generation, issuer_key_id: &str) -> bool {
        Self::trusts(self, node_id, generation, issuer_key_id)
    }
}
