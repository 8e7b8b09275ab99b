//! Prometheus metrics with bounded labels only: the RPC (3 values) and the outcome (a fixed
//! set). Never a session id, certificate identity, worker id, proxy address or client detail.
//!
//! Built on `prometheus-client`: the labels are typed sets of enums, so an unbounded label
//! cannot be written without changing a type. Every series exists from the start (at zero).
//! The exposition is OpenMetrics text ([`CONTENT_TYPE`]), ending in `# EOF`.

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::domain::ServiceError;

/// The RPCs measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rpc {
    /// RegisterWorker.
    Register,
    /// AcknowledgeSnapshot.
    Acknowledge,
    /// ReportRuntime.
    Report,
}

impl Rpc {
    const ALL: [Self; 3] = [Self::Register, Self::Acknowledge, Self::Report];

    fn as_str(self) -> &'static str {
        match self {
            Self::Register => "register_worker",
            Self::Acknowledge => "acknowledge_snapshot",
            Self::Report => "report_runtime",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// An RPC's outcome, as a bounded label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Outcome {
    Ok,
    InvalidArgument,
    FailedPrecondition,
    PermissionDenied,
    StaleSession,
    Aborted,
    AlreadyExists,
    Unavailable,
}

impl Outcome {
    const ALL: [Self; 8] = [
        Self::Ok,
        Self::InvalidArgument,
        Self::FailedPrecondition,
        Self::PermissionDenied,
        Self::StaleSession,
        Self::Aborted,
        Self::AlreadyExists,
        Self::Unavailable,
    ];

    fn of(e: Option<&ServiceError>) -> Self {
        match e {
            None => Self::Ok,
            Some(ServiceError::Invalid(_)) => Self::InvalidArgument,
            Some(ServiceError::UnsupportedProtocol) => Self::FailedPrecondition,
            Some(ServiceError::IdentityMismatch) => Self::PermissionDenied,
            Some(ServiceError::StaleSession) => Self::StaleSession,
            Some(ServiceError::StaleReport) => Self::Aborted,
            Some(ServiceError::ConflictingReport) => Self::AlreadyExists,
            Some(ServiceError::Unavailable) => Self::Unavailable,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::InvalidArgument => "invalid_argument",
            Self::FailedPrecondition => "failed_precondition",
            Self::PermissionDenied => "permission_denied",
            Self::StaleSession => "stale_session",
            Self::Aborted => "aborted",
            Self::AlreadyExists => "already_exists",
            Self::Unavailable => "unavailable",
        }
    }
}

impl EncodeLabelValue for Rpc {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    rpc: Rpc,
    outcome: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RpcLabels {
    rpc: Rpc,
}

/// Latency buckets (seconds).
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

fn new_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The controller's counters and histograms.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// By RPC, then outcome (in `Outcome::ALL`'s order).
    requests: Vec<Vec<Counter>>,
    full_snapshot: Vec<Counter>,
    durations: Vec<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests_family = Family::<RequestLabels, Counter>::default();
        registry.register(
            "proxypool_controlplane_requests",
            "Worker control-plane RPCs by outcome",
            requests_family.clone(),
        );
        let full_family = Family::<RpcLabels, Counter>::default();
        registry.register(
            "proxypool_controlplane_full_snapshot_required",
            "Answers asking the worker to resynchronise",
            full_family.clone(),
        );
        let durations_family =
            Family::<RpcLabels, Histogram, fn() -> Histogram>::new_with_constructor(new_histogram);
        registry.register(
            "proxypool_controlplane_request_duration_seconds",
            "RPC latency",
            durations_family.clone(),
        );
        let requests = Rpc::ALL
            .iter()
            .map(|&rpc| {
                Outcome::ALL
                    .iter()
                    .map(|&outcome| {
                        requests_family
                            .get_or_create(&RequestLabels { rpc, outcome })
                            .clone()
                    })
                    .collect()
            })
            .collect();
        let full_snapshot = Rpc::ALL
            .iter()
            .map(|&rpc| full_family.get_or_create(&RpcLabels { rpc }).clone())
            .collect();
        let durations = Rpc::ALL
            .iter()
            .map(|&rpc| durations_family.get_or_create(&RpcLabels { rpc }).clone())
            .collect();
        Self {
            registry,
            requests,
            full_snapshot,
            durations,
        }
    }
}

impl Metrics {
    /// Records one RPC.
    pub fn observe(&self, rpc: Rpc, error: Option<&ServiceError>, took: Duration) {
        let outcome = Outcome::of(error);
        let o = Outcome::ALL.iter().position(|x| *x == outcome).unwrap_or(0);
        self.requests[rpc.index()][o].inc();
        self.durations[rpc.index()].observe(took.as_secs_f64());
    }

    /// Records a `require_full_snapshot` answer.
    pub fn full_snapshot_required(&self, rpc: Rpc) {
        self.full_snapshot[rpc.index()].inc();
    }

    /// The exposition (OpenMetrics text).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String does not fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_exists_with_bounded_labels() {
        let m = Metrics::default();
        m.observe(Rpc::Report, None, Duration::from_micros(700));
        m.observe(
            Rpc::Report,
            Some(&ServiceError::StaleReport),
            Duration::from_millis(2),
        );
        m.full_snapshot_required(Rpc::Acknowledge);
        let text = m.render();
        assert!(text.contains(
            "proxypool_controlplane_requests_total{rpc=\"report_runtime\",outcome=\"ok\"} 1"
        ));
        assert!(text.contains(
            "proxypool_controlplane_requests_total{rpc=\"report_runtime\",outcome=\"aborted\"} 1"
        ));
        for rpc in ["register_worker", "acknowledge_snapshot", "report_runtime"] {
            for outcome in Outcome::ALL {
                assert!(text.contains(&format!(
                    "proxypool_controlplane_requests_total{{rpc=\"{rpc}\",outcome=\"{}\"}}",
                    outcome.as_str()
                )));
            }
        }
        assert!(text.contains(
            "proxypool_controlplane_full_snapshot_required_total{rpc=\"acknowledge_snapshot\"} 1"
        ));
        assert!(text.contains(
            "proxypool_controlplane_request_duration_seconds_bucket{le=\"0.001\",rpc=\"report_runtime\"} 1"
        ));
        assert!(text.contains(
            "proxypool_controlplane_request_duration_seconds_count{rpc=\"report_runtime\"} 2"
        ));
        assert!(text.contains("# TYPE proxypool_controlplane_request_duration_seconds histogram"));
        assert!(text.ends_with("# EOF\n"));
    }
}
