//! The secret-free `PrincipalProjection` (seed `001`), built from one store snapshot.
//!
//! It carries principals (with their enabled flag and their rate limits and budgets), the SHA-256 digests of active tokens, and
//! active routes with their slot's profile and credential revision. Never raw tokens, sealed or
//! plain credentials, keys or headers. What is left out:
//! - revoked tokens, and tokens of disabled principals;
//! - disabled routes, routes of disabled principals, routes whose slot is disabled.

use std::collections::{HashMap, HashSet};

use iop_wire::control::{PrincipalProjection, ProjectedPrincipal, ProjectedRoute, ProjectedToken};

use crate::store::Snapshot;

/// The projection of `snapshot` (its generation included), naming the active issuer key
/// (leases are signed with it) and the staged one with its activation time, if any.
pub fn build(snapshot: &Snapshot) -> PrincipalProjection {
    // Indexed once: a lookup per token and route, not a scan (tens of thousands of each).
    let enabled: HashSet<&str> = (snapshot.principals.iter())
        .filter(|p| p.enabled)
        .map(|p| p.id.as_str())
        .collect();
    let enabled_principal = |id: &str| enabled.contains(id);
    let slots: HashMap<&str, _> = (snapshot.slots.iter())
        .filter(|s| s.enabled)
        .map(|s| (s.id.as_str(), s))
        .collect();
    let slot = |id: &str| slots.get(id).copied();
    PrincipalProjection {
        generation: snapshot.generation,
        issuer_key_id: snapshot
            .active_issuer()
            .map(|k| k.id.clone())
            .unwrap_or_default(),
        staged_issuer_key_id: snapshot
            .staged_issuer()
            .map(|k| k.id.clone())
            .unwrap_or_default(),
        staged_issuer_activates_at_unix_ms: snapshot
            .staged_issuer()
            .map_or(0, |k| k.activates_at_unix_ms),
        principals: snapshot
            .principals
            .iter()
            .map(|p| ProjectedPrincipal {
                principal_id: p.id.clone(),
                display_name: p.display_name.clone(),
                enabled: p.enabled,
                limits: p.limits.clone(),
            })
            .collect(),
        tokens: snapshot
            .tokens
            .iter()
            .filter(|t| !t.revoked && enabled_principal(&t.principal_id))
            .map(|t| ProjectedToken {
                token_id: t.id.clone(),
                principal_id: t.principal_id.clone(),
                sha256_digest: t.digest,
            })
            .collect(),
        routes: snapshot
            .routes
            .iter()
            .filter(|r| r.enabled && enabled_principal(&r.principal_id))
            .filter_map(|r| {
                let s = slot(&r.slot_id)?;
                Some(ProjectedRoute {
                    route_id: r.id.clone(),
                    principal_id: r.principal_id.clone(),
                    model: r.model.clone(),
                    slot_id: r.slot_id.clone(),
                    profile: r.profile.clone(),
                    upstream_target: r.upstream_target.clone(),
                    selector: r.selector.clone(),
                    route_revision: r.revision,
                    credential_revision: s.revision,
                })
            })
            .collect(),
        parts_before: 0,
    }
}
