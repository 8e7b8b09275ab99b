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
//! | `iop_edge_node_connections_refused_total` | `reason` = capacity, per_ip, handshake_timeout, handshake_failed |
//! | `iop_edge_accept_errors_total` | `listener` = nodes, http |
//! | `iop_edge_slow_consumers_total` | — (streams ended because their reader fell behind) |
//! | `iop_edge_http_connections_refused_total` | — (over the HTTP connection cap) |
//!
//! The matching structured log events are `edge_provider_health_observation` and
//! `edge_liveness_recovery_observation` (tracing, target `iop_edge`), emitted after the overlay
//! decision is final.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Histogram bucket bounds, seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{b}\"}} {}",
                self.buckets[i].load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// An HTTP endpoint, as a bounded label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    const ALL: [Self; ENDPOINTS] = [
        Self::Models,
        Self::ChatCompletions,
        Self::Responses,
        Self::Messages,
        Self::CountTokens,
    ];

    fn index(self) -> usize {
        self as usize
    }

    fn label(self) -> &'static str {
        match self {
            Self::Models => "models",
            Self::ChatCompletions => "chat_completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
            Self::CountTokens => "count_tokens",
        }
    }
}

const ENDPOINTS: usize = 5;

/// Why a Node connection was refused before registration (a bounded label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Too many connections in their TLS handshake.
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

/// The Edge's counters. Cheap to share (`Arc`).
#[derive(Debug, Default)]
pub struct Metrics {
    evidence: [AtomicU64; 3],
    transitions: [AtomicU64; 2],
    eligibility: [AtomicU64; 2],
    recovery: [AtomicU64; 2],
    requests: [[AtomicU64; 2]; ENDPOINTS],
    durations: [Histogram; ENDPOINTS],
    refused: [AtomicU64; 4],
    accept_errors: [AtomicU64; 2],
    slow_consumers: AtomicU64,
    http_refused: AtomicU64,
}

impl Metrics {
    /// Validated stall evidence by provider health (`available`, `unavailable`, `unknown`).
    pub(crate) fn count_health_evidence(&self, provider_health: &str) {
        let i = match provider_health {
            "available" => 0,
            "unavailable" => 1,
            _ => 2,
        };
        self.evidence[i].fetch_add(1, Ordering::Relaxed);
    }

    /// An overlay transition.
    pub(crate) fn count_health_transition(&self, to_unavailable: bool) {
        self.transitions[usize::from(!to_unavailable)].fetch_add(1, Ordering::Relaxed);
    }

    /// A stall terminal's handoff: confirmed (validated current bound stall) or rejected.
    pub(crate) fn count_recovery_eligibility(&self, confirmed: bool) {
        self.eligibility[usize::from(!confirmed)].fetch_add(1, Ordering::Relaxed);
    }

    /// A CAPABILITIES recovery answer's effect on one overlay.
    pub(crate) fn count_recovery_result(&self, cleared: bool) {
        self.recovery[usize::from(!cleared)].fetch_add(1, Ordering::Relaxed);
    }

    /// A Node connection refused before registration.
    pub fn node_connection_refused(&self, reason: Refusal) {
        self.refused[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A failed `accept` on the Node listener.
    pub(crate) fn accept_error(&self) {
        self.accept_errors[0].fetch_add(1, Ordering::Relaxed);
    }

    /// A failed `accept` on the HTTP listener.
    pub fn http_accept_error(&self) {
        self.accept_errors[1].fetch_add(1, Ordering::Relaxed);
    }

    /// A stream ended because its reader fell behind.
    pub(crate) fn count_slow_consumer(&self) {
        self.slow_consumers.fetch_add(1, Ordering::Relaxed);
    }

    /// An HTTP connection closed at once over the connection cap.
    pub fn http_connection_refused(&self) {
        self.http_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// One HTTP request's outcome and duration.
    pub fn request(&self, endpoint: Endpoint, ok: bool, duration: Duration) {
        self.requests[endpoint.index()][usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
        self.durations[endpoint.index()].observe(duration);
    }

    /// Prometheus text exposition; `queue_depth` and `in_flight` are read at scrape time.
    pub fn render(&self, queue_depth: usize, in_flight: u64) -> String {
        let mut out = String::new();
        let counter = |out: &mut String,
                       name: &str,
                       help: &str,
                       label: &str,
                       values: &[(&str, &AtomicU64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (v, c) in values {
                let _ = writeln!(
                    out,
                    "{name}{{{label}=\"{v}\"}} {}",
                    c.load(Ordering::Relaxed)
                );
            }
        };
        counter(
            &mut out,
            "iop_edge_provider_health_evidence_total",
            "Validated stall health evidence.",
            "provider_health",
            &[
                ("available", &self.evidence[0]),
                ("unavailable", &self.evidence[1]),
                ("unknown", &self.evidence[2]),
            ],
        );
        counter(
            &mut out,
            "iop_edge_provider_health_transitions_total",
            "Runtime-unavailable overlay transitions.",
            "to",
            &[
                ("unavailable", &self.transitions[0]),
                ("available", &self.transitions[1]),
            ],
        );
        counter(
            &mut out,
            "iop_edge_liveness_recovery_eligibility_total",
            "Stall terminals by recovery handoff.",
            "eligibility",
            &[
                ("confirmed", &self.eligibility[0]),
                ("rejected", &self.eligibility[1]),
            ],
        );
        counter(
            &mut out,
            "iop_edge_liveness_recovery_results_total",
            "CAPABILITIES recovery answers by effect.",
            "result",
            &[
                ("cleared", &self.recovery[0]),
                ("unchanged", &self.recovery[1]),
            ],
        );
        let _ = writeln!(
            out,
            "# HELP iop_edge_requests_total HTTP requests.\n# TYPE iop_edge_requests_total counter"
        );
        for e in Endpoint::ALL {
            for (i, outcome) in ["ok", "error"].iter().enumerate() {
                let _ = writeln!(
                    out,
                    "iop_edge_requests_total{{endpoint=\"{}\",outcome=\"{outcome}\"}} {}",
                    e.label(),
                    self.requests[e.index()][i].load(Ordering::Relaxed)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP iop_edge_request_duration_seconds Time to the response head.\n# TYPE iop_edge_request_duration_seconds histogram"
        );
        for e in Endpoint::ALL {
            self.durations[e.index()].render(
                &mut out,
                "iop_edge_request_duration_seconds",
                &format!("endpoint=\"{}\"", e.label()),
            );
        }
        counter(
            &mut out,
            "iop_edge_node_connections_refused_total",
            "Node connections refused or failed before registration.",
            "reason",
            &Refusal::ALL.map(|r| (r.as_str(), &self.refused[r as usize])),
        );
        counter(
            &mut out,
            "iop_edge_accept_errors_total",
            "Failed accepts (e.g. out of file descriptors).",
            "listener",
            &[
                ("nodes", &self.accept_errors[0]),
                ("http", &self.accept_errors[1]),
            ],
        );
        let _ = writeln!(
            out,
            "# HELP iop_edge_slow_consumers_total Streams ended because their reader fell behind.\n# TYPE iop_edge_slow_consumers_total counter\niop_edge_slow_consumers_total {}",
            self.slow_consumers.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP iop_edge_http_connections_refused_total HTTP connections closed over the connection cap.\n# TYPE iop_edge_http_connections_refused_total counter\niop_edge_http_connections_refused_total {}",
            self.http_refused.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP iop_edge_pool_queue_depth Requests waiting for a provider.\n# TYPE iop_edge_pool_queue_depth gauge\niop_edge_pool_queue_depth {queue_depth}"
        );
        let _ = writeln!(
            out,
            "# HELP iop_edge_pool_in_flight Provider leases held.\n# TYPE iop_edge_pool_in_flight gauge\niop_edge_pool_in_flight {in_flight}"
        );
        out
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
            "iop_edge_request_duration_seconds_bucket{endpoint=\"chat_completions\",le=\"0.005\"} 1"
        ));
        for endpoint in ["models", "responses", "messages", "count_tokens"] {
            assert!(text.contains(&format!(
                "iop_edge_requests_total{{endpoint=\"{endpoint}\",outcome=\"error\"}} 0"
            )));
        }
        assert!(text.contains("iop_edge_pool_queue_depth 2"));
        assert!(text.contains("iop_edge_pool_in_flight 5"));
    }
}
