//! The limiter's Prometheus metrics (labelled by key id: configured or application-named ids
//! only, and forgotten with their key).

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct KeyLabel {
    pub(super) key: Arc<str>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct RefusedLabels {
    pub(super) key: Arc<str>,
    pub(super) limit: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct OpLabel {
    pub(super) op: &'static str,
}

/// The limiter's Prometheus metrics (labelled by key id: configured ids only).
#[derive(Debug)]
pub(super) struct LimiterMetrics {
    pub(super) registry: Registry,
    pub(super) admitted: Family<KeyLabel, Counter>,
    pub(super) refused: Family<RefusedLabels, Counter>,
    pub(super) in_flight: Family<KeyLabel, Gauge>,
    pub(super) store_calls: Family<OpLabel, Counter>,
    pub(super) store_errors: Counter,
    pub(super) unavailable: Family<KeyLabel, Counter>,
}

impl LimiterMetrics {
    pub(super) fn new() -> Self {
        let mut registry = Registry::default();
        let admitted = Family::<KeyLabel, Counter>::default();
        registry.register(
            "iop_edge_ratelimit_admitted",
            "Requests admitted by their key's rate limits",
            admitted.clone(),
        );
        let refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "iop_edge_ratelimit_refused",
            "Requests refused by their key's rate limits, by the limit that refused",
            refused.clone(),
        );
        let in_flight = Family::<KeyLabel, Gauge>::default();
        registry.register(
            "iop_edge_ratelimit_in_flight",
            "Requests of a rate-limited key in flight",
            in_flight.clone(),
        );
        let store_calls = Family::<OpLabel, Counter>::default();
        registry.register(
            "iop_edge_ratelimit_store_calls",
            "Calls to the shared limits' Redis store, by operation (borrow, charge, refund)",
            store_calls.clone(),
        );
        let store_errors = Counter::default();
        registry.register(
            "iop_edge_ratelimit_store_errors",
            "Shared limits' store calls that failed (down, slow, unreachable)",
            store_errors.clone(),
        );
        let unavailable = Family::<KeyLabel, Counter>::default();
        registry.register(
            "iop_edge_ratelimit_store_unavailable",
            "Requests decided without the shared store: by this Edge alone (on_unavailable = local) or refused (closed)",
            unavailable.clone(),
        );
        Self {
            registry,
            admitted,
            refused,
            in_flight,
            store_calls,
            store_errors,
            unavailable,
        }
    }
}
