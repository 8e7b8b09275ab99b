//! Domain types of the Edge ⇄ Node runtime wire (`proto/runtime.proto`).
//!
//! Each type converts from the generated protobuf type with validation (`TryFrom`, crate
//! internal) and back with `to_proto`. A [`RuntimeFrame`] is what the
//! [`codec`](crate::codec) reads and writes; its [`RuntimeMessage`] names every message of the
//! contract.
//!
//! Choices where seed 000 is silent (also listed in the crate docs):
//!
//! - Run and tunnel streams are named by the envelope's `stream_id` (non-zero, Edge-chosen);
//!   `run_id` is the provider run id that `CancelRequest` names.
//! - `ExecutionFailure`'s "allowlisted metadata" is a fixed set of typed fields; there is no
//!   free-form map to leak through.
//! - Fields that do not belong to a tunnel frame's kind (a status on a BODY frame, say) are
//!   ignored on receipt and not re-encoded.
//!
//! One file per section of the contract: the frame envelope and its message, registration and readiness, Node configuration, credential leases, normalized execution,
//! execution failure (the stall terminal), the provider raw tunnel, commands and snapshots.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::error::InvalidMessage;
use crate::proto::runtime as pb;
use crate::validate::{self, ResponseStallTimeout};

mod commands;
mod config;
mod credential;
mod execution;
mod failure;
mod frame;
mod registration;
mod snapshots;
mod tunnel;

pub use commands::*;
pub use config::*;
pub use credential::*;
pub use execution::*;
pub use failure::*;
pub use frame::*;
pub use registration::*;
pub use snapshots::*;
pub use tunnel::*;

/// Observation metadata on a run's or tunnel's terminal (added after the first release; older
/// peers neither send nor read it): the provider call's duration in microseconds, as the Node
/// measured it (from handing the request to its adapter to the adapter's return). The Edge
/// subtracts it from its own time to get what the mesh added.
pub const METADATA_PROVIDER_US: &str = "provider_us";

/// The error text of a Node's refusal of a run or tunnel because the adapter instance's
/// capacity gate is full (a Node serving several Edges can be full while each Edge's own
/// leases say otherwise). Nothing reached the provider: the Edge may send the request again,
/// to another candidate or after a pause (`iop_edge`'s dispatch does).
pub const REFUSED_CAPACITY_EXHAUSTED: &str = "adapter capacity exhausted";

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::pb;

    /// Seed 000 fixes these field numbers; a renumbering would break mixed-version peers.
    #[test]
    fn seed_fixed_field_numbers() {
        let tag = |field: u8| (field << 3) | 2; // length-delimited
        let ev = pb::RunEvent {
            execution_failure: Some(Default::default()),
            ..Default::default()
        };
        assert_eq!(
            ev.encode_to_vec(),
            [tag(13), 0],
            "RunEvent.execution_failure = 13"
        );
        let req = pb::ProviderTunnelRequest {
            operation: "models".into(),
            ..Default::default()
        };
        assert_eq!(
            req.encode_to_vec()[..2],
            [tag(13), 6],
            "ProviderTunnelRequest.operation = 13"
        );
        let f = pb::ProviderTunnelFrame {
            execution_failure: Some(Default::default()),
            ..Default::default()
        };
        assert_eq!(
            f.encode_to_vec(),
            [tag(15), 0],
            "ProviderTunnelFrame.execution_failure = 15"
        );
    }
}
