//! Prometheus text metrics with bounded labels only (every label value comes from a fixed set;
//! no payloads, credentials, caller-controlled or unbounded ids).
//!
//! | metric | labels |
//! |---|---|
//! | `iop_edge_provider_health_evidence_total` | `provider_health` = available, unavailable, unknown |
//! | `iop_edge_provider_health_transitions_total` | `to` = unavailable, available |
//! | `iop_edge_liveness_recovery_eligibility_total` | `eligibility` = confirmed, rejected |
//! | `iop_edge_liveness_recovery_results_total` | `result` = cleared, unchanged |
//! | `iop_edge_requests_total` | `endpoint` = models, chat_completions, responses, messages, count_tokens; `outcome` = ok, error |
//! | `iop_edge_request_duration_seconds` (histogram) | `endpoint` |
//! | `iop_edge_pool_queue_depth`, `iop_edge_pool_in_flight` (gauges, at scrape) | — |
//! | `iop_edge_node_connections_refused_total` | `reason` = capacity (kept for dashboards: the global handshake cap now pauses accepting instead of refusing, so it stays 0), per_ip, handshake_timeout, handshake_failed |
//! | `iop_edge_node_connections_closed_total` | `cause` = superseded, protocol_violation (e.g. a frame on a superseded connection), rejected, heartbeat_timeout, handshake_timeout, not_reading, local (closes the Edge decided; a peer closing its own transport is not counted) |
//! | `iop_edge_accept_errors_total` | `listener` = nodes, http |
//! | `iop_edge_slow_consumers_total` | — (streams ended because their reader fell behind) |
//! | `iop_edge_http_connections_refused_total` | — (over the HTTP connection cap) |
//!
//! The matching structured log events are `edge_provider_health_observation` and
//! `edge_liveness_recovery_observation` (tracing, target `iop_edge`), emitted after the overlay
//! decision is final.
//!
//! Built on `prometheus-client`: every label is a typed set whose values are enums, so an
//! unbounded label (an id, a path, a peer address) cannot be written without changing a type.
//! The exposition is OpenMetrics text (`/metrics` serves it as
//! `application/openmetrics-text`, which Prometheus scrapes), ending in `# EOF`. Every series
//! exists from the start (at zero): the handles are made when the metrics are, and the hot
//! path only increments them.

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Histogram bucket bounds, seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// A label value written as its fixed name.
macro_rules! label_values {
    ($($ty:ty),*) => {$(
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
                std::fmt::Write::write_str(encoder, self.as_str())
            }
        }
    )*};
}

/// An HTTP endpoint, as a bounded label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `/v1/models`.
    Models,
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/responses`.
    Responses,
    /// `/v1/messages`.
    Messages,
    /// `/v1/messages/count_tokens`.
    CountTokens,
}

impl Endpoint {
    const ALL: [Self; 5] = [
        Self::Models,
        Self::ChatCompletions,
        Self::Responses,
        Self::Messages,
        Self::CountTokens,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Models => "models",
            Self::ChatCompletions => "chat_completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
            Self::CountTokens => "count_tokens",
        }
    }
}

/// Why a Node connection was refused before registration (a bounded label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Too many connections in their TLS handshake. No longer counted: at the global cap the
    /// transport stops accepting (connections wait in the listen backlog); the series stays
    /// so that dashboards and alerts keep their label set.
    Capacity,
    /// Too many from one source address.
    PerIp,
    /// The TLS handshake did not finish in time.
    HandshakeTimeout,
    /// The TLS handshake failed (wrong CA, role, name, protocol, or an aborted attempt).
    HandshakeFailed,
}

impl Refusal {
    const ALL: [Self; 4] = [
        Self::Capacity,
        Self::PerIp,
        Self::HandshakeTimeout,
        Self::HandshakeFailed,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Capacity => "capacity",
            Self::PerIp => "per_ip",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::HandshakeFailed => "handshake_failed",
        }
    }
}

/// Defines a private label enum: its variants and their label values.
macro_rules! label_enum {
    ($name:ident { $($variant:ident => $value:literal),* $(,)? }) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        enum $name { $($variant),* }
        impl $name {
            const ALL: &[Self] = &[$(Self::$variant),*];
            fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $value),* }
            }
        }
    };
}

label_enum!(ProviderHealth { Available => "available", Unavailable => "unavailable", Unknown => "unknown" });
label_enum!(Transition { Unavailable => "unavailable", Available => "available" });
label_enum!(Eligibility { Confirmed => "confirmed", Rejected => "rejected" });
label_enum!(RecoveryResult { Cleared => "cleared", Unchanged => "unchanged" });
label_enum!(Outcome { Ok => "ok", Error => "error" });
label_enum!(Listener { Nodes => "nodes", Http => "http" });
label_enum!(CloseCause {
    Superseded => "superseded",
    ProtocolViolation => "protocol_violation",
    Rejected => "rejected",
    HeartbeatTimeout => "heartbeat_timeout",
    HandshakeTimeout => "handshake_timeout",
    NotReading => "not_reading",
    Local => "local",
});

label_values!(
    Endpoint,
    Refusal,
    ProviderHealth,
    Transition,
    Eligibility,
    RecoveryResult,
    Outcome,
    Listener,
    CloseCause
);

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HealthLabels {
    provider_health: ProviderHealth,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TransitionLabels {
    to: Transition,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct EligibilityLabels {
    eligibility: Eligibility,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: RecoveryResult,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    endpoint: Endpoint,
    outcome: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct EndpointLabels {
    endpoint: Endpoint,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: Refusal,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ListenerLabels {
    listener: Listener,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CauseLabels {
    cause: CloseCause,
}

/// Registers a counter family under `name` (the exposition adds `_total`) with every label
/// set of `all`, and returns one handle per label set, in `all`'s order.
fn counters<L, V>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    all: &[V],
    labels: impl Fn(V) -> L,
) -> Vec<Counter>
where
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
    V: Copy,
{
    let family = Family::<L, Counter>::default();
    registry.register(name, help, family.clone());
    all.iter()
        .map(|v| family.get_or_create(&labels(*v)).clone())
        .collect()
}

fn new_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The Edge's metrics. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    evidence: Vec<Counter>,
    transitions: Vec<Counter>,
    eligibility: Vec<Counter>,
    recovery: Vec<Counter>,
    /// By endpoint, then ok / error.
    requests: Vec<[Counter; 2]>,
    durations: Vec<Histogram>,
    refused: Vec<Counter>,
    closed: Vec<Counter>,
    accept_errors: Vec<Counter>,
    slow_consumers: Counter,
    http_refused: Counter,
    queue_depth: Gauge,
    in_flight: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let evidence = counters(
            &mut r,
            "iop_edge_provider_health_evidence",
            "Validated stall health evidence",
            ProviderHealth::ALL,
            |provider_health| HealthLabels { provider_health },
        );
        let transitions = counters(
            &mut r,
            "iop_edge_provider_health_transitions",
            "Runtime-unavailable overlay transitions",
            Transition::ALL,
            |to| TransitionLabels { to },
        );
        let eligibility = counters(
            &mut r,
            "iop_edge_liveness_recovery_eligibility",
            "Stall terminals by recovery handoff",
            Eligibility::ALL,
            |eligibility| EligibilityLabels { eligibility },
        );
        let recovery = counters(
            &mut r,
            "iop_edge_liveness_recovery_results",
            "CAPABILITIES recovery answers by effect",
            RecoveryResult::ALL,
            |result| ResultLabels { result },
        );
        let requests_family = Family::<RequestLabels, Counter>::default();
        r.register(
            "iop_edge_requests",
            "HTTP requests",
            requests_family.clone(),
        );
        let requests = Endpoint::ALL
            .iter()
            .map(|&endpoint| {
                [Outcome::ALL[0], Outcome::ALL[1]].map(|outcome| {
                    requests_family
                        .get_or_create(&RequestLabels { endpoint, outcome })
                        .clone()
                })
            })
            .collect();
        let durations_family =
            Family::<EndpointLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                new_histogram,
            );
        r.register(
            "iop_edge_request_duration_seconds",
            "Time to the response head",
            durations_family.clone(),
        );
        let durations = Endpoint::ALL
            .iter()
            .map(|&endpoint| {
                durations_family
                    .get_or_create(&EndpointLabels { endpoint })
                    .clone()
            })
            .collect();
        let refused = counters(
            &mut r,
            "iop_edge_node_connections_refused",
            "Node connections refused or failed before registration",
            &Refusal::ALL,
            |reason| ReasonLabels { reason },
        );
        let closed = counters(
            &mut r,
            "iop_edge_node_connections_closed",
            "Node connections the Edge closed, by cause",
            CloseCause::ALL,
            |cause| CauseLabels { cause },
        );
        let accept_errors = counters(
            &mut r,
            "iop_edge_accept_errors",
            "Failed accepts (e.g. out of file descriptors)",
            Listener::ALL,
            |listener| ListenerLabels { listener },
        );
        let slow_consumers = Counter::default();
        r.register(
            "iop_edge_slow_consumers",
            "Streams ended because their reader fell behind",
            slow_consumers.clone(),
        );
        let http_refused = Counter::default();
        r.register(
            "iop_edge_http_connections_refused",
            "HTTP connections closed over the connection cap",
            http_refused.clone(),
        );
        let queue_depth = Gauge::default();
        r.register(
            "iop_edge_pool_queue_depth",
            "Requests waiting for a provider",
            queue_depth.clone(),
        );
        let in_flight = Gauge::default();
        r.register(
            "iop_edge_pool_in_flight",
            "Provider leases held",
            in_flight.clone(),
        );
        Self {
            registry: r,
            evidence,
            transitions,
            eligibility,
            recovery,
            requests,
            durations,
            refused,
            closed,
            accept_errors,
            slow_consumers,
            http_refused,
            queue_depth,
            in_flight,
        }
    }
}

fn index_of<V: PartialEq>(all: &[V], v: &V) -> usize {
    all.iter().position(|x| x == v).unwrap_or(0)
}

impl Metrics {
    /// Validated stall evidence by provider health (`available`, `unavailable`, `unknown`).
    pub(crate) fn count_health_evidence(&self, provider_health: &str) {
        let h = match provider_health {
            "available" => ProviderHealth::Available,
            "unavailable" => ProviderHealth::Unavailable,
            _ => ProviderHealth::Unknown,
        };
        self.evidence[index_of(ProviderHealth::ALL, &h)].inc();
    }

    /// An overlay transition.
    pub(crate) fn count_health_transition(&self, to_unavailable: bool) {
        self.transitions[usize::from(!to_unavailable)].inc();
    }

    /// A stall terminal's handoff: confirmed (validated current bound stall) or rejected.
    pub(crate) fn count_recovery_eligibility(&self, confirmed: bool) {
        self.eligibility[usize::from(!confirmed)].inc();
    }

    /// A CAPABILITIES recovery answer's effect on one overlay.
    pub(crate) fn count_recovery_result(&self, cleared: bool) {
        self.recovery[usize::from(!cleared)].inc();
    }

    /// A Node connection the Edge closed (`cause` from its registry). A transport the peer
    /// closed itself (`FenceCause::Closed`) is not counted here.
    pub(crate) fn node_connection_closed(&self, cause: iop_edge_core::registry::FenceCause) {
        use iop_edge_core::registry::FenceCause as F;
        let cause = match cause {
            F::Superseded => CloseCause::Superseded,
            F::ProtocolViolation => CloseCause::ProtocolViolation,
            F::Rejected => CloseCause::Rejected,
            F::HeartbeatTimeout => CloseCause::HeartbeatTimeout,
            F::HandshakeTimeout => CloseCause::HandshakeTimeout,
            F::NotReading => CloseCause::NotReading,
            F::Local => CloseCause::Local,
            _ => return,
        };
        self.closed[index_of(CloseCause::ALL, &cause)].inc();
    }

    /// A Node connection refused before registration.
    pub fn node_connection_refused(&self, reason: Refusal) {
        self.refused[index_of(&Refusal::ALL, &reason)].inc();
    }

    /// A failed `accept` on the Node listener.
    pub(crate) fn accept_error(&self) {
        self.accept_errors[0].inc();
    }

    /// A failed `accept` on the HTTP listener.
    pub fn http_accept_error(&self) {
        self.accept_errors[1].inc();
    }

    /// A stream ended because its reader fell behind.
    pub(crate) fn count_slow_consumer(&self) {
        self.slow_consumers.inc();
    }

    /// An HTTP connection closed at once over the connection cap.
    pub fn http_connection_refused(&self) {
        self.http_refused.inc();
    }

    /// One HTTP request's outcome and duration.
    pub fn request(&self, endpoint: Endpoint, ok: bool, duration: Duration) {
        let e = index_of(&Endpoint::ALL, &endpoint);
        self.requests[e][usize::from(!ok)].inc();
        self.durations[e].observe(duration.as_secs_f64());
    }

    /// The exposition (OpenMetrics text); `queue_depth` and `in_flight` are read at scrape
    /// time.
    pub fn render(&self, queue_depth: usize, in_flight: u64) -> String {
        self.queue_depth
            .set(i64::try_from(queue_depth).unwrap_or(i64::MAX));
        self.in_flight
            .set(i64::try_from(in_flight).unwrap_or(i64::MAX));
        let mut out = String::new();
        // Writing to a String does not fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl bounded_http::ServeEvents for Metrics {
    fn accept_error(&self) {
        self.http_accept_error();
    }

    fn connection_refused(&self) {
        self.http_connection_refused();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_every_series_with_bounded_labels() {
        let m = Metrics::default();
        m.count_health_evidence("unavailable");
        m.count_health_transition(true);
        m.count_recovery_eligibility(true);
        m.count_recovery_result(false);
        m.request(Endpoint::ChatCompletions, true, Duration::from_millis(3));
        let text = m.render(2, 5);
        assert!(text.contains(
            "iop_edge_provider_health_evidence_total{provider_health=\"unavailable\"} 1"
        ));
        assert!(text.contains("iop_edge_provider_health_transitions_total{to=\"unavailable\"} 1"));
        assert!(
            text.contains(
                "iop_edge_liveness_recovery_eligibility_total{eligibility=\"confirmed\"} 1"
            )
        );
        assert!(text.contains("iop_edge_liveness_recovery_results_total{result=\"unchanged\"} 1"));
        assert!(
            text.contains(
                "iop_edge_requests_total{endpoint=\"chat_completions\",outcome=\"ok\"} 1"
            )
        );
        assert!(text.contains(
            "iop_edge_request_duration_seconds_bucket{le=\"0.005\",endpoint=\"chat_completions\"} 1"
        ));
        assert!(text.contains("# TYPE iop_edge_request_duration_seconds histogram"));
        assert!(text.contains("# HELP iop_edge_requests HTTP requests.\n"));
        assert!(text.ends_with("# EOF\n"));
        for endpoint in ["models", "responses", "messages", "count_tokens"] {
            assert!(text.contains(&format!(
                "iop_edge_requests_total{{endpoint=\"{endpoint}\",outcome=\"error\"}} 0"
            )));
        }
        assert!(text.contains("iop_edge_pool_queue_depth 2"));
        assert!(text.contains("iop_edge_pool_in_flight 5"));
    }

    #[test]
    fn closes_are_counted_by_cause_and_a_peer_close_is_not() {
        use iop_edge_core::registry::FenceCause;
        let m = Metrics::default();
        m.node_connection_closed(FenceCause::Superseded);
        m.node_connection_closed(FenceCause::Superseded);
        m.node_connection_closed(FenceCause::ProtocolViolation);
        m.node_connection_closed(FenceCause::Closed);
        let text = m.render(0, 0);
        assert!(text.contains("iop_edge_node_connections_closed_total{cause=\"superseded\"} 2"));
        assert!(
            text.contains("iop_edge_node_connections_closed_total{cause=\"protocol_violation\"} 1")
        );
        for cause in [
            "rejected",
            "heartbeat_timeout",
            "handshake_timeout",
            "not_reading",
            "local",
        ] {
            assert!(text.contains(&format!(
                "iop_edge_node_connections_closed_total{{cause=\"{cause}\"}} 0"
            )));
        }
        assert!(!text.contains("cause=\"closed\""));
    }
}
