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
//! | `iop_edge_http_errors_total` | `kind` = bad_request, unauthorized, forbidden, not_found, request_timeout, payload_too_large, rate_limited, client_error, provider_failed, unavailable, gateway_timeout, server_error (the answer's status, as the spans' `error.type`) |
//! | `iop_edge_pool_wait_timeouts_total` | — (requests whose wait for a provider ran out) |
//! | `iop_edge_pool_queue_depth`, `iop_edge_pool_in_flight` (gauges, at scrape) | — |
//! | `iop_edge_node_connections_refused_total` | `reason` = capacity (kept for dashboards: the global handshake cap now pauses accepting instead of refusing, so it stays 0), per_ip, handshake_timeout, handshake_failed |
//! | `iop_edge_node_connections_closed_total` | `cause` = superseded, protocol_violation (e.g. a frame on a superseded connection), rejected, heartbeat_timeout, handshake_timeout, not_reading, local (closes the Edge decided; a peer closing its own transport is not counted) |
//! | `iop_edge_accept_errors_total` | `listener` = nodes, http |
//! | `iop_edge_slow_consumers_total` | — (streams ended because their reader fell behind) |
//! | `iop_edge_http_connections_refused_total` | — (over the HTTP connection cap) |
//! | `gen_ai_server_request_duration_seconds` (histogram) | `endpoint`; `model` = a configured model group (the operator's list, so bounded) |
//! | `gen_ai_server_time_to_first_token_seconds` (histogram) | `endpoint`, `model`: to the answer's first content |
//! | `gen_ai_server_time_per_output_token_seconds` (histogram) | `endpoint`, `model`: (end − first content) ÷ (output tokens − 1), when the provider reported more than one |
//! | `gen_ai_client_token_usage` (histogram) | `endpoint`, `model`, `token_type` = input, output: as the provider reported them |
//! | `iop_edge_gateway_overhead_seconds` (histogram) | `endpoint`: the Edge's time for a request minus the provider call's time as the Node measured it (sent back on the terminal): what the mesh adds |
//! | `iop_telemetry_spans_total` | `outcome` = exported, dropped (the export queue was full), failed (the collector refused or was unreachable) |
//!
//! The `gen_ai_*` names are the OpenTelemetry GenAI semantic conventions' metrics
//! (`gen_ai.server.request.duration`, `gen_ai.server.time_to_first_token`,
//! `gen_ai.server.time_per_output_token`, `gen_ai.client.token.usage`: the Edge is a GenAI
//! server to its clients and a client of the providers' token counts) written as Prometheus
//! names, with the conventions' bucket boundaries. A request's duration runs from the handler's
//! start to the end of its response body (the whole stream).
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

/// `gen_ai.server.request.duration`'s recommended boundaries, seconds.
const GENAI_DURATION: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];
/// `gen_ai.server.time_to_first_token`'s, seconds.
const GENAI_TTFT: [f64; 16] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// `gen_ai.server.time_per_output_token`'s, seconds.
const GENAI_TPOT: [f64; 13] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
/// `gen_ai.client.token.usage`'s, tokens.
const GENAI_TOKENS: [f64; 14] = [
    1.0,
    4.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
];
/// The gateway's overhead, seconds: fine at the bottom, where a mesh's figures are.
const OVERHEAD: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_2, 0.000_3, 0.000_5, 0.000_75, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05,
    0.1, 1.0,
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

label_enum!(ErrorKind {
    BadRequest => "bad_request",
    Unauthorized => "unauthorized",
    Forbidden => "forbidden",
    NotFound => "not_found",
    RequestTimeout => "request_timeout",
    PayloadTooLarge => "payload_too_large",
    RateLimited => "rate_limited",
    ClientError => "client_error",
    ProviderFailed => "provider_failed",
    Unavailable => "unavailable",
    GatewayTimeout => "gateway_timeout",
    ServerError => "server_error",
});

impl ErrorKind {
    fn of(status: u16) -> Self {
        match status {
            400 => Self::BadRequest,
            401 => Self::Unauthorized,
            403 => Self::Forbidden,
            404 => Self::NotFound,
            408 => Self::RequestTimeout,
            413 => Self::PayloadTooLarge,
            429 => Self::RateLimited,
            502 => Self::ProviderFailed,
            503 => Self::Unavailable,
            504 => Self::GatewayTimeout,
            402 | 405..=407 | 409..=412 | 414..=428 | 430..=499 => Self::ClientError,
            _ => Self::ServerError,
        }
    }
}

/// A fixed `error.type` word for an error answer's status (the spans' `error.type`, the
/// `kind` label of `iop_edge_http_errors_total`, the status page's errors by kind).
pub fn error_kind(status: u16) -> &'static str {
    ErrorKind::of(status).as_str()
}

label_values!(
    ErrorKind,
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
struct KindLabels {
    kind: ErrorKind,
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

/// `endpoint` and `model` (a configured model group).
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ModelLabels {
    endpoint: Endpoint,
    model: String,
}

/// [`ModelLabels`] and the token type.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TokenLabels {
    endpoint: Endpoint,
    model: String,
    token_type: TokenType,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum TokenType {
    Input,
    Output,
}

impl TokenType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Input => "input",
            Self::Output => "output",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum SpanOutcome {
    Exported,
    Dropped,
    Failed,
}

impl SpanOutcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Exported => "exported",
            Self::Dropped => "dropped",
            Self::Failed => "failed",
        }
    }
}

label_values!(TokenType, SpanOutcome);

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SpanLabels {
    outcome: SpanOutcome,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// What one finished model request measured ([`Metrics::model_request`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelRequest {
    /// Handler start to the end of the response body.
    pub duration: Duration,
    /// To the answer's first content, if any came.
    pub first_content: Option<Duration>,
    /// The provider's reported (input, output) tokens, if it reported them.
    pub tokens: Option<(u64, u64)>,
    /// The provider call's duration at the Node, if the Node said.
    pub provider: Option<Duration>,
}

/// The GenAI histograms.
#[derive(Debug)]
struct GenAi {
    duration: HistogramFamily<ModelLabels>,
    ttft: HistogramFamily<ModelLabels>,
    tpot: HistogramFamily<ModelLabels>,
    tokens: HistogramFamily<TokenLabels>,
    overhead: Vec<Histogram>,
    spans: Vec<Counter>,
    /// Serializes the scrape-time update of `spans`.
    spans_seen: std::sync::Mutex<[u64; 3]>,
}

/// Request counters since start ([`Metrics::traffic`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Traffic {
    /// Model API requests answered successfully.
    pub requests_ok: u64,
    /// Model API requests that failed.
    pub requests_failed: u64,
    /// Streams cut because their client read too slowly.
    pub slow_consumer_cuts: u64,
    /// HTTP connections refused over the connection cap.
    pub connections_refused: u64,
    /// The gateway's own overhead (the Edge's time minus the provider call's time at the
    /// Node) over the last [`RECENT`] model requests that had both: p50 and p99.
    pub overhead: Option<(Duration, Duration)>,
    /// Time to first content over the last [`RECENT`] model requests that had any: p50 and
    /// p99.
    pub ttft: Option<(Duration, Duration)>,
    /// Error answers since start by kind (the `kind` words of `iop_edge_http_errors_total`),
    /// only the kinds seen.
    pub errors: Vec<(&'static str, u64)>,
    /// Requests whose wait for a provider ran out, since start.
    pub wait_timeouts: u64,
    /// The same, in the last minute.
    pub wait_timeouts_last_minute: u64,
}

/// Events counted per second over the last minute (60 one-second buckets, each stamped with
/// its second so a stale one counts as empty).
#[derive(Debug)]
struct MinuteWindow {
    start: std::time::Instant,
    buckets: [(u64, u64); 60],
}

impl MinuteWindow {
    fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            buckets: [(u64::MAX, 0); 60],
        }
    }

    fn second(&self, now: std::time::Instant) -> u64 {
        now.saturating_duration_since(self.start).as_secs()
    }

    fn add(&mut self, now: std::time::Instant) {
        let sec = self.second(now);
        let b = &mut self.buckets[(sec % 60) as usize];
        if b.0 != sec {
            *b = (sec, 0);
        }
        b.1 += 1;
    }

    /// Events in the 60 seconds up to `now` (this second included).
    fn sum(&self, now: std::time::Instant) -> u64 {
        let sec = self.second(now);
        self.buckets
            .iter()
            .filter(|(s, _)| *s != u64::MAX && *s <= sec && sec - *s < 60)
            .map(|(_, n)| n)
            .sum()
    }
}

/// Model requests the status page's percentiles are taken over ([`Metrics::traffic`]).
pub const RECENT: usize = 1024;

/// The last [`RECENT`] figures of each kind, in microseconds.
#[derive(Debug, Default)]
struct Recent {
    overhead: std::collections::VecDeque<u32>,
    ttft: std::collections::VecDeque<u32>,
    wait_timeouts: Option<MinuteWindow>,
}

fn push_recent(q: &mut std::collections::VecDeque<u32>, d: Duration) {
    if q.len() == RECENT {
        q.pop_front();
    }
    q.push_back(u32::try_from(d.as_micros()).unwrap_or(u32::MAX));
}

/// p50 and p99 of `q` (nearest rank).
fn percentiles(q: &std::collections::VecDeque<u32>) -> Option<(Duration, Duration)> {
    if q.is_empty() {
        return None;
    }
    let mut v: Vec<u32> = q.iter().copied().collect();
    v.sort_unstable();
    let at = |p: usize| {
        let rank = (v.len() * p).div_ceil(100).max(1);
        Duration::from_micros(u64::from(v[rank - 1]))
    };
    Some((at(50), at(99)))
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
    errors: Vec<Counter>,
    wait_timeouts: Counter,
    queue_depth: Gauge,
    in_flight: Gauge,
    genai: GenAi,
    recent: std::sync::Mutex<Recent>,
}

fn histogram_family<
    L: EncodeLabelSet + Clone + Eq + std::hash::Hash + std::fmt::Debug + Send + Sync + 'static,
>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    make: fn() -> Histogram,
) -> HistogramFamily<L> {
    let f = HistogramFamily::<L>::new_with_constructor(make);
    registry.register(name, help, f.clone());
    f
}

impl GenAi {
    fn new(r: &mut Registry) -> Self {
        let duration = histogram_family(
            r,
            "gen_ai_server_request_duration_seconds",
            "GenAI request duration, to the end of the response body",
            || Histogram::new(GENAI_DURATION),
        );
        let ttft = histogram_family(
            r,
            "gen_ai_server_time_to_first_token_seconds",
            "Time to the answer's first content",
            || Histogram::new(GENAI_TTFT),
        );
        let tpot = histogram_family(
            r,
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first",
            || Histogram::new(GENAI_TPOT),
        );
        let tokens = histogram_family(
            r,
            "gen_ai_client_token_usage",
            "Tokens per request as the provider reported them",
            || Histogram::new(GENAI_TOKENS),
        );
        let overhead_family = histogram_family::<EndpointLabels>(
            r,
            "iop_edge_gateway_overhead_seconds",
            "The Edge's time minus the provider call's time at the Node",
            || Histogram::new(OVERHEAD),
        );
        let overhead = Endpoint::ALL
            .iter()
            .map(|&endpoint| {
                overhead_family
                    .get_or_create(&EndpointLabels { endpoint })
                    .clone()
            })
            .collect();
        let spans = counters(
            r,
            "iop_telemetry_spans",
            "Finished trace spans by what became of them",
            &[
                SpanOutcome::Exported,
                SpanOutcome::Dropped,
                SpanOutcome::Failed,
            ],
            |outcome| SpanLabels { outcome },
        );
        Self {
            duration,
            ttft,
            tpot,
            tokens,
            overhead,
            spans,
            spans_seen: std::sync::Mutex::new([0; 3]),
        }
    }
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
        let errors = counters(
            &mut r,
            "iop_edge_http_errors",
            "Error answers by kind",
            ErrorKind::ALL,
            |kind| KindLabels { kind },
        );
        let wait_timeouts = Counter::default();
        r.register(
            "iop_edge_pool_wait_timeouts",
            "Requests whose wait for a provider ran out",
            wait_timeouts.clone(),
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
        let genai = GenAi::new(&mut r);
        Self {
            registry: r,
            genai,
            recent: std::sync::Mutex::default(),
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
            errors,
            wait_timeouts,
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

    /// A queued request's wait for a provider ran out.
    pub(crate) fn count_wait_timeout(&self) {
        self.wait_timeouts.inc();
        if let Ok(mut r) = self.recent.lock() {
            r.wait_timeouts
                .get_or_insert_with(MinuteWindow::new)
                .add(std::time::Instant::now());
        }
    }

    /// An HTTP connection closed at once over the connection cap.
    pub fn http_connection_refused(&self) {
        self.http_refused.inc();
    }

    /// Request counters since start, for the status page ([`crate::admin`]).
    pub fn traffic(&self) -> Traffic {
        let (mut ok, mut failed) = (0, 0);
        for [o, f] in &self.requests {
            ok += o.get();
            failed += f.get();
        }
        let (overhead, ttft, last_minute) = self.recent.lock().map_or((None, None, 0), |r| {
            (
                percentiles(&r.overhead),
                percentiles(&r.ttft),
                r.wait_timeouts
                    .as_ref()
                    .map_or(0, |w| w.sum(std::time::Instant::now())),
            )
        });
        Traffic {
            requests_ok: ok,
            requests_failed: failed,
            slow_consumer_cuts: self.slow_consumers.get(),
            connections_refused: self.http_refused.get(),
            overhead,
            ttft,
            errors: ErrorKind::ALL
                .iter()
                .zip(&self.errors)
                .map(|(k, c)| (k.as_str(), c.get()))
                .filter(|(_, n)| *n > 0)
                .collect(),
            wait_timeouts: self.wait_timeouts.get(),
            wait_timeouts_last_minute: last_minute,
        }
    }

    /// One HTTP request's answer: [`Metrics::request`], and an error answer counted by kind.
    pub fn answered(&self, endpoint: Endpoint, status: u16, duration: Duration) {
        let ok = (200..300).contains(&status);
        if !ok {
            self.errors[index_of(ErrorKind::ALL, &ErrorKind::of(status))].inc();
        }
        self.request(endpoint, ok, duration);
    }

    /// One HTTP request's outcome and duration.
    pub fn request(&self, endpoint: Endpoint, ok: bool, duration: Duration) {
        let e = index_of(&Endpoint::ALL, &endpoint);
        self.requests[e][usize::from(!ok)].inc();
        self.durations[e].observe(duration.as_secs_f64());
    }

    /// One finished model request of `endpoint` to configured model group `model` (the
    /// GenAI histograms and the gateway overhead).
    pub fn model_request(&self, endpoint: Endpoint, model: &str, m: &ModelRequest) {
        let g = &self.genai;
        let labels = ModelLabels {
            endpoint,
            model: model.to_owned(),
        };
        g.duration
            .get_or_create(&labels)
            .observe(m.duration.as_secs_f64());
        if let Some(first) = m.first_content {
            g.ttft.get_or_create(&labels).observe(first.as_secs_f64());
            if let Some((_, output)) = m.tokens
                && output > 1
            {
                #[allow(clippy::cast_precision_loss, reason = "a token count as a divisor")]
                let per = m.duration.saturating_sub(first).as_secs_f64() / (output - 1) as f64;
                g.tpot.get_or_create(&labels).observe(per);
            }
        }
        if let Some((input, output)) = m.tokens {
            for (token_type, n) in [(TokenType::Input, input), (TokenType::Output, output)] {
                #[allow(clippy::cast_precision_loss, reason = "a token count in a histogram")]
                g.tokens
                    .get_or_create(&TokenLabels {
                        endpoint,
                        model: labels.model.clone(),
                        token_type,
                    })
                    .observe(n as f64);
            }
        }
        if let Some(p) = m.provider {
            g.overhead[index_of(&Endpoint::ALL, &endpoint)]
                .observe(m.duration.saturating_sub(p).as_secs_f64());
        }
        if let Ok(mut r) = self.recent.lock() {
            if let Some(p) = m.provider {
                push_recent(&mut r.overhead, m.duration.saturating_sub(p));
            }
            if let Some(first) = m.first_content {
                push_recent(&mut r.ttft, first);
            }
        }
    }

    /// Brings `iop_telemetry_spans_total` up to `stats` (read at scrape time).
    pub fn telemetry(&self, stats: iop_telemetry::Stats) {
        let g = &self.genai;
        let mut seen = g
            .spans_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (i, now) in [stats.exported, stats.dropped, stats.failed]
            .into_iter()
            .enumerate()
        {
            g.spans[i].inc_by(now.saturating_sub(seen[i]));
            seen[i] = seen[i].max(now);
        }
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
    fn the_minute_window_counts_the_last_sixty_seconds() {
        let mut w = MinuteWindow::new();
        let t0 = w.start;
        let at = |s: u64| t0 + Duration::from_secs(s);
        w.add(at(0));
        w.add(at(0));
        w.add(at(30));
        assert_eq!(w.sum(at(59)), 3);
        assert_eq!(w.sum(at(60)), 1, "second 0 is a minute old");
        // Second 60 reuses second 0's bucket.
        w.add(at(60));
        assert_eq!(w.sum(at(60)), 2);
        assert_eq!(w.sum(at(89)), 2);
        assert_eq!(w.sum(at(90)), 1);
        assert_eq!(w.sum(at(500)), 0);
    }

    #[test]
    fn errors_are_counted_by_kind() {
        let m = Metrics::default();
        m.answered(Endpoint::ChatCompletions, 200, Duration::from_millis(1));
        m.answered(Endpoint::ChatCompletions, 429, Duration::from_millis(1));
        m.answered(Endpoint::Messages, 429, Duration::from_millis(1));
        m.answered(Endpoint::Messages, 529, Duration::from_millis(1));
        let t = m.traffic();
        assert_eq!((t.requests_ok, t.requests_failed), (1, 3));
        assert_eq!(t.errors, [("rate_limited", 2), ("server_error", 1)]);
        assert!(
            m.render(0, 0)
                .contains("iop_edge_http_errors_total{kind=\"rate_limited\"} 2")
        );
    }

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
    fn a_model_request_fills_the_genai_histograms_and_the_overhead() {
        let m = Metrics::default();
        m.model_request(
            Endpoint::ChatCompletions,
            "mesh-model",
            &ModelRequest {
                duration: Duration::from_millis(500),
                first_content: Some(Duration::from_millis(100)),
                tokens: Some((20, 5)),
                provider: Some(Duration::from_micros(499_800)),
            },
        );
        // No provider time (an older Node), no usage, no content: only the duration.
        m.model_request(
            Endpoint::Messages,
            "other",
            &ModelRequest {
                duration: Duration::from_millis(30),
                ..ModelRequest::default()
            },
        );
        m.telemetry(iop_telemetry::Stats {
            exported: 7,
            dropped: 2,
            failed: 1,
        });
        m.telemetry(iop_telemetry::Stats {
            exported: 9,
            dropped: 2,
            failed: 1,
        });
        let text = m.render(0, 0);
        let labels = "endpoint=\"chat_completions\",model=\"mesh-model\"";
        assert!(text.contains(&format!(
            "gen_ai_server_request_duration_seconds_bucket{{le=\"0.64\",{labels}}} 1"
        )));
        assert!(text.contains(&format!(
            "gen_ai_server_request_duration_seconds_bucket{{le=\"0.32\",{labels}}} 0"
        )));
        assert!(text.contains(&format!(
            "gen_ai_server_time_to_first_token_seconds_bucket{{le=\"0.1\",{labels}}} 1"
        )));
        // (500 - 100) ms over 4 tokens after the first.
        assert!(text.contains(&format!(
            "gen_ai_server_time_per_output_token_seconds_bucket{{le=\"0.1\",{labels}}} 1"
        )));
        assert!(text.contains(&format!(
            "gen_ai_server_time_per_output_token_seconds_bucket{{le=\"0.075\",{labels}}} 0"
        )));
        assert!(text.contains(&format!(
            "gen_ai_client_token_usage_sum{{{labels},token_type=\"input\"}} 20.0"
        )));
        assert!(text.contains(&format!(
            "gen_ai_client_token_usage_sum{{{labels},token_type=\"output\"}} 5.0"
        )));
        // 500 ms - 499.8 ms = 200 us.
        assert!(text.contains(
            "iop_edge_gateway_overhead_seconds_bucket{le=\"0.0002\",endpoint=\"chat_completions\"} 1"
        ));
        assert!(text.contains(
            "iop_edge_gateway_overhead_seconds_bucket{le=\"0.0001\",endpoint=\"chat_completions\"} 0"
        ));
        assert!(text.contains("iop_edge_gateway_overhead_seconds_count{endpoint=\"messages\"} 0"));
        assert!(!text.contains("model=\"other\",token_type"));
        assert!(text.contains("iop_telemetry_spans_total{outcome=\"exported\"} 9"));
        assert!(text.contains("iop_telemetry_spans_total{outcome=\"dropped\"} 2"));
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

#[cfg(test)]
mod recent_tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_over_the_last_window() {
        let mut q = std::collections::VecDeque::new();
        assert_eq!(percentiles(&q), None);
        for us in 1..=100 {
            push_recent(&mut q, Duration::from_micros(us));
        }
        assert_eq!(
            percentiles(&q),
            Some((Duration::from_micros(50), Duration::from_micros(99)))
        );
        for _ in 0..RECENT {
            push_recent(&mut q, Duration::from_micros(7));
        }
        assert_eq!(q.len(), RECENT, "bounded");
        assert_eq!(
            percentiles(&q),
            Some((Duration::from_micros(7), Duration::from_micros(7)))
        );
    }
}
