//! Prometheus metrics with bounded labels only: the RPC (3 values) and the outcome (a fixed
//! set). Never a session id, certificate identity, worker id, proxy address or client detail.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::domain::ServiceError;

/// The RPCs measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rpc {
    /// RegisterWorker.
    Register,
    /// AcknowledgeSnapshot.
    Acknowledge,
    /// ReportRuntime.
    Report,
}

const RPCS: [(Rpc, &str); 3] = [
    (Rpc::Register, "register_worker"),
    (Rpc::Acknowledge, "acknowledge_snapshot"),
    (Rpc::Report, "report_runtime"),
];

const OUTCOMES: [&str; 8] = [
    "ok",
    "invalid_argument",
    "failed_precondition",
    "permission_denied",
    "stale_session",
    "aborted",
    "already_exists",
    "unavailable",
];

/// Latency buckets (seconds).
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

fn outcome(e: Option<&ServiceError>) -> usize {
    match e {
        None => 0,
        Some(ServiceError::Invalid(_)) => 1,
        Some(ServiceError::UnsupportedProtocol) => 2,
        Some(ServiceError::IdentityMismatch) => 3,
        Some(ServiceError::StaleSession) => 4,
        Some(ServiceError::StaleReport) => 5,
        Some(ServiceError::ConflictingReport) => 6,
        Some(ServiceError::Unavailable) => 7,
    }
}

fn rpc_index(rpc: Rpc) -> usize {
    match rpc {
        Rpc::Register => 0,
        Rpc::Acknowledge => 1,
        Rpc::Report => 2,
    }
}

/// The controller's counters and histograms.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: [[AtomicU64; OUTCOMES.len()]; 3],
    full_snapshot: [AtomicU64; 3],
    buckets: [[AtomicU64; BUCKETS.len()]; 3],
    sum_micros: [AtomicU64; 3],
    count: [AtomicU64; 3],
}

impl Metrics {
    /// Records one RPC.
    pub fn observe(&self, rpc: Rpc, error: Option<&ServiceError>, took: Duration) {
        let i = rpc_index(rpc);
        self.requests[i][outcome(error)].fetch_add(1, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        for (b, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                self.buckets[i][b].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_micros[i].fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.count[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Records a `require_full_snapshot` answer.
    pub fn full_snapshot_required(&self, rpc: Rpc) {
        self.full_snapshot[rpc_index(rpc)].fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP proxypool_controlplane_requests_total Worker control-plane RPCs by outcome.\n",
        );
        out.push_str("# TYPE proxypool_controlplane_requests_total counter\n");
        for (rpc, name) in RPCS {
            let i = rpc_index(rpc);
            for (o, outcome) in OUTCOMES.iter().enumerate() {
                let v = self.requests[i][o].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "proxypool_controlplane_requests_total{{rpc=\"{name}\",outcome=\"{outcome}\"}} {v}"
                );
            }
        }
        out.push_str("# HELP proxypool_controlplane_full_snapshot_required_total Answers asking the worker to resynchronise.\n");
        out.push_str("# TYPE proxypool_controlplane_full_snapshot_required_total counter\n");
        for (rpc, name) in RPCS {
            let v = self.full_snapshot[rpc_index(rpc)].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "proxypool_controlplane_full_snapshot_required_total{{rpc=\"{name}\"}} {v}"
            );
        }
        out.push_str("# HELP proxypool_controlplane_request_duration_seconds RPC latency.\n");
        out.push_str("# TYPE proxypool_controlplane_request_duration_seconds histogram\n");
        for (rpc, name) in RPCS {
            let i = rpc_index(rpc);
            for (b, bound) in BUCKETS.iter().enumerate() {
                let v = self.buckets[i][b].load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "proxypool_controlplane_request_duration_seconds_bucket{{rpc=\"{name}\",le=\"{bound}\"}} {v}"
                );
            }
            let count = self.count[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "proxypool_controlplane_request_duration_seconds_bucket{{rpc=\"{name}\",le=\"+Inf\"}} {count}"
            );
            let sum = self.sum_micros[i].load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(
                out,
                "proxypool_controlplane_request_duration_seconds_sum{{rpc=\"{name}\"}} {sum}"
            );
            let _ = writeln!(
                out,
                "proxypool_controlplane_request_duration_seconds_count{{rpc=\"{name}\"}} {count}"
            );
        }
        out
    }
}
