//! What the seed 001 pair harness (`control_pair.rs`) uses: the session settings, a projection
//! of a generation, a lease binding. (The model check of the same machines is
//! `iop-cp/tests/control_model.rs`, where the real lease service answers.)

use std::time::Duration;

use iop_wire::control::PrincipalProjection;
use iop_wire::control_session::ControlSessionConfig;
use iop_wire::runtime::CredentialLeaseBinding;

/// A 10 s handshake, 5 s heartbeats.
pub(crate) fn config() -> ControlSessionConfig {
    ControlSessionConfig {
        handshake_timeout: Duration::from_secs(10),
        heartbeat: Duration::from_secs(5),
        ..ControlSessionConfig::default()
    }
}

/// An empty projection of `generation`.
pub(crate) fn projection(generation: u64) -> PrincipalProjection {
    PrincipalProjection {
        generation,
        ..Default::default()
    }
}

/// A lease binding resolved under projection `generation`.
pub(crate) fn binding(generation: u64) -> CredentialLeaseBinding {
    CredentialLeaseBinding {
        principal_id: "p".into(),
        slot_id: "s".into(),
        route_id: "r".into(),
        profile: "openai".into(),
        upstream_target: "m".into(),
        node_id: "node-1".into(),
        recipient_key_id: "k".into(),
        credential_revision: 1,
        route_revision: 1,
        projection_generation: generation,
    }
}
