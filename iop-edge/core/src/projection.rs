//! The principal projection (seed `001`), indexed for request authentication and route
//! resolution: what the managed [`binding`](crate::binding) machine decides with.

use std::collections::{HashMap, HashSet};

use iop_wire::control::{PrincipalProjection, ProjectedRoute};
use iop_wire::runtime::CredentialLeaseBinding;
use ring::digest::{SHA256, digest};

/// The projection, indexed for request authentication and route resolution. Immutable: a
/// request keeps the `Arc` it authenticated with.
#[derive(Debug)]
pub struct ProjectionIndex {
    projection: PrincipalProjection,
    /// First 8 digest bytes → token entries (the full digest is compared in constant time).
    tokens: HashMap<[u8; 8], Vec<usize>>,
    routes: HashMap<(String, String), usize>,
    enabled: HashSet<String>,
}

impl ProjectionIndex {
    /// Indexes a projection.
    pub fn new(projection: PrincipalProjection) -> Self {
        let mut tokens: HashMap<[u8; 8], Vec<usize>> = HashMap::new();
        for (i, t) in projection.tokens.iter().enumerate() {
            let mut k = [0u8; 8];
            k.copy_from_slice(&t.sha256_digest[..8]);
            tokens.entry(k).or_default().push(i);
        }
        let routes = projection
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| ((r.principal_id.clone(), r.model.clone()), i))
            .collect();
        let enabled = projection
            .principals
            .iter()
            .filter(|p| p.enabled)
            .map(|p| p.principal_id.clone())
            .collect();
        Self {
            projection,
            tokens,
            routes,
            enabled,
        }
    }

    /// The projection it indexes.
    pub fn projection(&self) -> &PrincipalProjection {
        &self.projection
    }

    /// The projection generation.
    pub fn generation(&self) -> u64 {
        self.projection.generation
    }

    /// The key leases of this generation are signed with (empty from older Control Planes).
    pub fn issuer_key_id(&self) -> &str {
        &self.projection.issuer_key_id
    }

    /// The principal a raw bearer token authenticates as: SHA-256 of the token, compared in
    /// constant time with the projected digests; disabled principals authenticate nothing.
    pub fn authenticate(&self, token: &str) -> Option<&str> {
        let d = digest(&SHA256, token.as_bytes());
        let d = d.as_ref();
        let mut k = [0u8; 8];
        k.copy_from_slice(&d[..8]);
        let found = self.tokens.get(&k)?.iter().find_map(|&i| {
            let t = &self.projection.tokens[i];
            bool::from(subtle::ConstantTimeEq::ct_eq(&t.sha256_digest[..], d))
                .then_some(t.principal_id.as_str())
        })?;
        self.enabled.contains(found).then_some(found)
    }

    /// The route of `principal_id` for the external `model`.
    pub fn route(&self, principal_id: &str, model: &str) -> Option<&ProjectedRoute> {
        self.routes
            .get(&(principal_id.to_owned(), model.to_owned()))
            .map(|&i| &self.projection.routes[i])
    }

    /// Whether `binding` is still valid under this projection: the token still authenticates
    /// the binding's principal, and its route resolves to the same slot, profile, target and
    /// revisions. The Edge checks this against the request's snapshot before acquiring a lease
    /// and against the current projection right before dispatch.
    pub fn admits(&self, token: &str, model: &str, binding: &CredentialLeaseBinding) -> bool {
        let Some(principal) = self.authenticate(token) else {
            return false;
        };
        if principal != binding.principal_id {
            return false;
        }
        self.route(principal, model).is_some_and(|r| {
            r.route_id == binding.route_id
                && r.slot_id == binding.slot_id
                && r.profile == binding.profile
                && r.upstream_target == binding.upstream_target
                && r.route_revision == binding.route_revision
                && r.credential_revision == binding.credential_revision
        })
    }
}
