//! The gRPC transport (tonic): DTO mapping, status codes, the worker identity from mTLS, and
//! the server's limits. The server serves `ReportRuntime` through [`report`], which decodes the
//! request straight into canonical counters. The other RPCs go through the generated prost code.
//!
//! Status codes (messages are stable and low-sensitivity: never a Redis key, session id, proxy
//! address, certificate content or backend text):
//!
//! | domain outcome | gRPC |
//! |---|---|
//! | invalid field | `INVALID_ARGUMENT` (`invalid <field>`) |
//! | unsupported protocol version | `FAILED_PRECONDITION` |
//! | request `worker_id` ≠ certificate identity | `PERMISSION_DENIED` |
//! | session replaced or expired | `FAILED_PRECONDITION` (`stale session`) |
//! | report sequence went back | `ABORTED` |
//! | same sequence, different content | `ALREADY_EXISTS` |
//! | snapshot mismatch (ACK or report) | `OK` with `require_full_snapshot = true`, nothing written |
//! | stale ACK (an older snapshot than acknowledged or published) | the same: the ACK fails (nothing written) and the worker resyncs with a full snapshot (seed §3.3); not an error status, since every error status means another recovery (`FAILED_PRECONDITION` re-register, `ABORTED` a newer sequence) |
//! | store unavailable | `UNAVAILABLE` |
//! | `WatchSnapshots`, `ReportOutcomes` | `UNIMPLEMENTED` |

pub mod report;

use std::pin::Pin;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::domain::{
    AcknowledgeCommand, CanonicalReportCommand, Decision, RegisterCommand, Service, ServiceError,
};
use crate::metrics::{Metrics, Rpc};
use crate::proto::controlplane as pb;
use crate::proto::controlplane::worker_control_plane_server::WorkerControlPlane;

/// The tonic service.
#[derive(Clone)]
pub struct Controller {
    service: Arc<Service>,
    metrics: Arc<Metrics>,
    /// mTLS listener: a request without a verified identity is refused.
    require_identity: bool,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("require_identity", &self.require_identity)
            .finish_non_exhaustive()
    }
}

impl Controller {
    /// A controller over `service`; `require_identity` for mTLS listeners.
    pub fn new(service: Arc<Service>, metrics: Arc<Metrics>, require_identity: bool) -> Self {
        Self {
            service,
            metrics,
            require_identity,
        }
    }

    /// The service's `maxRuntimeCounters`.
    pub fn max_runtime_counters(&self) -> usize {
        self.service.config().max_runtime_counters
    }

    /// `ReportRuntime` with the counters already in canonical form: decoded straight from the
    /// wire by [`report::decode`] (what [`report::WorkerControlPlaneService`] serves), or from
    /// the generated message by [`report::from_proto`] (the generated server's
    /// `report_runtime`). One handler, so both answer with the same checks, status codes and
    /// metrics.
    pub async fn report_canonical(
        &self,
        request: Request<CanonicalReportCommand>,
    ) -> Result<Response<pb::ReportRuntimeResponse>, Status> {
        let started = std::time::Instant::now();
        let identity = self.identity(&request)?;
        let result = self
            .service
            .report_canonical(request.into_inner(), identity.as_deref())
            .await;
        self.metrics
            .observe(Rpc::Report, result.as_ref().err(), started.elapsed());
        let (ownership_epoch, require_full_snapshot) = match result.map_err(|e| status(&e))? {
            Decision::Accepted { ownership_epoch } => (ownership_epoch, false),
            Decision::RequireFullSnapshot { ownership_epoch } => {
                self.metrics.full_snapshot_required(Rpc::Report);
                (ownership_epoch, true)
            }
        };
        Ok(Response::new(pb::ReportRuntimeResponse {
            ownership_epoch,
            require_full_snapshot,
            revoke_proxy_ids: Vec::new(),
        }))
    }

    fn identity<T>(&self, request: &Request<T>) -> Result<Option<String>, Status> {
        let identity = request
            .extensions()
            .get::<crate::tls::PeerInfo>()
            .map(|p| p.worker_id.clone());
        if self.require_identity && identity.is_none() {
            return Err(Status::unauthenticated("client certificate required"));
        }
        Ok(identity)
    }
}

/// The status of a domain error.
pub fn status(e: &ServiceError) -> Status {
    match e {
        ServiceError::Invalid(field) => Status::invalid_argument(format!("invalid {field}")),
        ServiceError::UnsupportedProtocol => {
            Status::failed_precondition("unsupported protocol version")
        }
        ServiceError::IdentityMismatch => Status::permission_denied("worker identity mismatch"),
        ServiceError::StaleSession => Status::failed_precondition("stale session"),
        ServiceError::StaleReport => Status::aborted("stale report"),
        ServiceError::ConflictingReport => Status::already_exists("conflicting report"),
        ServiceError::Unavailable => Status::unavailable("store unavailable"),
    }
}

fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Now, in Unix milliseconds. The proxy-pool controller's one wall-clock read (its TTL clock is
/// the monotonic `memory::Clock`); it does not share `iop_wire::time`, as it depends on none of
/// the IOP crates.
fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

type SnapshotStream =
    Pin<Box<dyn futures_core::Stream<Item = Result<pb::Snapshot, Status>> + Send>>;

#[tonic::async_trait]
impl WorkerControlPlane for Controller {
    async fn register_worker(
        &self,
        request: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
        let started = std::time::Instant::now();
        let identity = self.identity(&request)?;
        let m = request.into_inner();
        let cmd = RegisterCommand {
            worker_id: m.worker_id,
            instance_id: m.instance_id,
            zone: m.zone,
            labels: m.labels,
            supported_protocol_version: m.supported_protocol_version,
        };
        let result = self.service.register(&cmd, identity.as_deref()).await;
        self.metrics
            .observe(Rpc::Register, result.as_ref().err(), started.elapsed());
        let r = result.map_err(|e| status(&e))?;
        let ttl = self.service.config().session_ttl;
        Ok(Response::new(pb::RegisterWorkerResponse {
            session_id: r.session_id.to_vec().into(),
            ownership_epoch: r.ownership_epoch,
            protocol_version: r.protocol_version,
            heartbeat_interval_ms: millis(r.heartbeat_interval),
            max_stale_age_ms: millis(r.max_stale_age),
            session_expires_at_unix_ms: unix_ms()
                .saturating_add(i64::try_from(millis(ttl)).unwrap_or(i64::MAX)),
        }))
    }

    async fn acknowledge_snapshot(
        &self,
        request: Request<pb::AcknowledgeSnapshotRequest>,
    ) -> Result<Response<pb::AcknowledgeSnapshotResponse>, Status> {
        let started = std::time::Instant::now();
        let identity = self.identity(&request)?;
        let m = request.into_inner();
        let cmd = AcknowledgeCommand {
            worker_id: m.worker_id,
            session_id: m.session_id.to_vec(),
            snapshot_version: m.snapshot_version,
            ownership_epoch: m.ownership_epoch,
            checksum: m.checksum.to_vec(),
            applied: m.applied,
            error_code: m.error_code,
            error_message: m.error_message,
        };
        let result = self.service.acknowledge(&cmd, identity.as_deref()).await;
        self.metrics
            .observe(Rpc::Acknowledge, result.as_ref().err(), started.elapsed());
        let (ownership_epoch, require_full_snapshot) = match result.map_err(|e| status(&e))? {
            Decision::Accepted { ownership_epoch } => (ownership_epoch, false),
            Decision::RequireFullSnapshot { ownership_epoch } => {
                self.metrics.full_snapshot_required(Rpc::Acknowledge);
                (ownership_epoch, true)
            }
        };
        Ok(Response::new(pb::AcknowledgeSnapshotResponse {
            require_full_snapshot,
            ownership_epoch,
        }))
    }

    async fn report_runtime(
        &self,
        request: Request<pb::ReportRuntimeRequest>,
    ) -> Result<Response<pb::ReportRuntimeResponse>, Status> {
        let max = self.max_runtime_counters();
        self.report_canonical(request.map(|m| report::from_proto(m, max)))
            .await
    }

    type WatchSnapshotsStream = SnapshotStream;

    async fn watch_snapshots(
        &self,
        _request: Request<pb::WatchSnapshotsRequest>,
    ) -> Result<Response<Self::WatchSnapshotsStream>, Status> {
        Err(Status::unimplemented(
            "WatchSnapshots is not implemented in this delivery unit",
        ))
    }

    async fn report_outcomes(
        &self,
        _request: Request<pb::ReportOutcomesRequest>,
    ) -> Result<Response<pb::ReportOutcomesResponse>, Status> {
        Err(Status::unimplemented(
            "ReportOutcomes is not implemented in this delivery unit",
        ))
    }
}
