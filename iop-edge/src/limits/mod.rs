//! Per-key rate limits on the Edge (issue #29): requests per minute, tokens per minute and
//! requests in flight, for each gateway key (legacy mode; keys are named by
//! [`crate::http::ApiKeys`]) and optionally for each key × model.
//!
//! The rule is [`iop_edge_core::ratelimit`]'s (GCRA, pure and property-tested); this module
//! keeps one [`KeyState`] per limited key (and key × model) in process, behind one mutex held
//! for one decision, on tokio's clock (so tests in paused time drive it).
//!
//! # A request's life
//!
//! 1. [`Limiter::admit`], after authentication and before the request waits for a provider:
//!    one request and an estimate of its tokens are taken from every limit that applies, or
//!    nothing is taken and the request is refused ([`Refused`], rendered as 429 with
//!    `retry-after`). The estimate is the request's output cap (`max_tokens`,
//!    `max_completion_tokens` or `max_output_tokens`; [`LimitsConfig::output_estimate`] when
//!    it names none) plus the input estimate `count_tokens` uses
//!    (`iop_dialect::request::estimate_tokens`).
//! 2. The returned [`Hold`] rides on the response stream
//!    ([`crate::TunnelStream::watch`], [`crate::RunStream::watch`]) and sees the provider's
//!    usage when the Node reports it.
//! 3. When the stream ends or is dropped, the hold is finished: the reservation is reconciled
//!    to the reported tokens (input + output), or kept whole when no usage was reported (the
//!    estimate is charged: never less than the request may have used when the provider
//!    honours its cap), or given back when the request was never sent to a provider (it failed
//!    before: no tokens were used). The request stops counting as in flight.
//!
//! # What the client is told
//!
//! Every answer to a limited key carries the quota after its admission, in the route's
//! dialect, streamed responses included (the headers go out before the first byte):
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` on OpenAI routes (reset as a
//! duration: `1s`, `6m0s`, `250ms`), `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`
//! on `/v1/messages` (reset as an RFC 3339 time). Where a key and its key × model limit both
//! apply, each quantity shows the one with less remaining. A refusal is 429 with
//! `retry-after` (whole seconds, rounded up) and `retry-after-ms` (both official SDKs read it
//! first): the real time until the request would fit if nothing else were admitted, not a
//! whole window; for a concurrency refusal, which frees when a request ends, 1 s.
//!
//! # Choices where the issue was silent
//!
//! - A key with its own entry ([`LimitsConfig::keys`]) has exactly those limits: the default
//!   ([`LimitsConfig::default`]) is not merged into it field by field.
//! - The estimate is reserved whole even when it exceeds what the provider will use; the
//!   difference comes back at the end. A request whose estimate alone exceeds the token limit
//!   can never fit and is refused without `retry-after`.
//! - A request the Edge could not send (no provider within the wait, a refused lease) keeps
//!   its request unit but gives its tokens back.

pub mod shared;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use iop_dialect::Dialect;
use iop_edge_core::ratelimit::{Admitted, Decision, Exceeded, KeyState, Limits, Rate};
use iop_wire::runtime::Usage;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// One key's limits: its own, and per model (the model group a request is routed to).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    /// The key's limits, over all models.
    pub limits: Limits,
    /// Limits of the key on one model, checked as well as the key's own.
    pub models: BTreeMap<String, Limits>,
}

impl KeyLimits {
    /// Whether a token limit applies to a request for `model`.
    pub fn limits_tokens(&self, model: &str) -> bool {
        self.limits.tokens.is_some() || self.models.get(model).is_some_and(|l| l.tokens.is_some())
    }

    /// Whether nothing is limited.
    pub fn is_unlimited(&self) -> bool {
        self.limits == Limits::default() && self.models.values().all(|l| *l == Limits::default())
    }
}

/// What the [`Limiter`] enforces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitsConfig {
    /// The limits of every key without an entry in [`LimitsConfig::keys`] (each key limited
    /// on its own: the default is per key, not shared).
    pub default: KeyLimits,
    /// Limits by key id; a key with an entry has exactly these.
    pub keys: BTreeMap<String, KeyLimits>,
    /// Output tokens reserved for a request that names no output cap.
    pub output_estimate: u64,
}

/// Default [`LimitsConfig::output_estimate`].
pub const DEFAULT_OUTPUT_ESTIMATE: u64 = 1024;

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            default: KeyLimits::default(),
            keys: BTreeMap::new(),
            output_estimate: DEFAULT_OUTPUT_ESTIMATE,
        }
    }
}

impl LimitsConfig {
    /// Whether any key is limited at all.
    pub fn is_unlimited(&self) -> bool {
        self.default.is_unlimited() && self.keys.values().all(KeyLimits::is_unlimited)
    }

    /// The limits of key `id`.
    pub fn of(&self, id: &str) -> &KeyLimits {
        self.keys.get(id).unwrap_or(&self.default)
    }
}

/// One quantity's state as a client is told it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shown {
    /// Units per minute (or per the rate's period).
    pub limit: u64,
    /// Units that could be admitted now.
    pub remaining: u64,
    /// Time until the quantity is fully replenished.
    pub reset_after: Duration,
}

impl Shown {
    fn of(rate: &Rate, d: &Decision) -> Self {
        Self {
            limit: rate.limit(),
            remaining: d.remaining,
            reset_after: d.reset_after,
        }
    }

    /// Of two, the one with less remaining.
    fn tighter(a: Option<Self>, b: Option<Self>) -> Option<Self> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b.remaining < a.remaining { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}

/// A key's quota after a decision, for the response headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    /// Requests per period, when limited.
    pub requests: Option<Shown>,
    /// Tokens per period, when limited.
    pub tokens: Option<Shown>,
}

impl Quota {
    fn of(limits: &Limits, requests: Option<&Decision>, tokens: Option<&Decision>) -> Self {
        Self {
            requests: limits.requests.zip(requests).map(|(r, d)| Shown::of(&r, d)),
            tokens: limits.tokens.zip(tokens).map(|(r, d)| Shown::of(&r, d)),
        }
    }

    fn tighter(self, other: Self) -> Self {
        Self {
            requests: Shown::tighter(self.requests, other.requests),
            tokens: Shown::tighter(self.tokens, other.tokens),
        }
    }

    /// Adds this quota's headers for a response in `dialect`: `x-ratelimit-*` (OpenAI) or
    /// `anthropic-ratelimit-*` (Messages). `now` is the wall clock, for Anthropic's reset
    /// times.
    pub fn write_headers(&self, dialect: Dialect, now: std::time::SystemTime, h: &mut HeaderMap) {
        for (name, shown) in [("requests", self.requests), ("tokens", self.tokens)] {
            let Some(s) = shown else { continue };
            match dialect {
                Dialect::Messages => {
                    let reset = rfc3339(now + s.reset_after);
                    for (field, value) in [
                        ("limit", s.limit.to_string()),
                        ("remaining", s.remaining.to_string()),
                        ("reset", reset),
                    ] {
                        insert(h, &format!("anthropic-ratelimit-{name}-{field}"), &value);
                    }
                }
                Dialect::Chat | Dialect::Responses => {
                    for (field, value) in [
                        ("limit", s.limit.to_string()),
                        ("remaining", s.remaining.to_string()),
                        ("reset", go_duration(s.reset_after)),
                    ] {
                        insert(h, &format!("x-ratelimit-{field}-{name}"), &value);
                    }
                }
            }
        }
    }
}

fn insert(h: &mut HeaderMap, name: &str, value: &str) {
    if let (Ok(name), Ok(value)) = (
        axum::http::HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        h.insert(name, value);
    }
}

/// A duration as OpenAI writes its resets (Go's form): `250ms`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let mut out = String::new();
    let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    if h > 0 {
        let _ = write!(out, "{h}h");
    }
    if h > 0 || m > 0 {
        let _ = write!(out, "{m}m");
    }
    let (s, frac) = (rest / 1000, rest % 1000);
    if frac == 0 {
        let _ = write!(out, "{s}s");
    } else {
        let f = format!("{frac:03}");
        let _ = write!(out, "{s}.{}s", f.trim_end_matches('0'));
    }
    out
}

/// A wall-clock time in RFC 3339 (UTC, whole seconds), as Anthropic writes its resets.
fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = iop_wire::time::unix_secs(t);
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

/// A request refused by its key's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The limit that refused (of several, the one whose wait is longest).
    pub exceeded: Exceeded,
    /// Whether the refusing limit was the key × model one.
    pub per_model: bool,
    /// When the request would fit if nothing else were admitted; `None` for a concurrency
    /// limit, or when the request's estimate alone exceeds the token limit.
    pub retry_after: Option<Duration>,
    /// The quota as it stands (nothing was taken).
    pub quota: Quota,
}

impl Refused {
    /// The `retry-after` a client is told: the wait rounded up to whole seconds; 1 s for a
    /// concurrency limit; `None` when the request can never fit.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match (self.exceeded, self.retry_after) {
            (_, Some(d)) => {
                Some(u64::try_from(d.as_micros().div_ceil(1_000_000).max(1)).unwrap_or(u64::MAX))
            }
            (Exceeded::Concurrent, None) => Some(1),
            _ => None,
        }
    }

    /// The message the client is shown (no key material: the key is not named).
    pub fn message(&self) -> String {
        let scope = if self.per_model {
            "this key's limit on this model"
        } else {
            "this key's limit"
        };
        match (self.exceeded, self.retry_after) {
            (Exceeded::Concurrent, _) => {
                format!("rate limit reached: {scope} of requests in flight")
            }
            (Exceeded::Tokens, None) => format!(
                "rate limit: the request's token estimate exceeds {scope} of tokens per minute"
            ),
            (e, _) => format!("rate limit reached: {scope} of {} per minute", e.as_str()),
        }
    }
}

#[derive(Debug, Default)]
struct KeyEntry {
    id: Arc<str>,
    state: KeyState,
    models: HashMap<String, KeyState>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KeyLabel {
    key: Arc<str>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RefusedLabels {
    key: Arc<str>,
    limit: &'static str,
}

/// The limiter's Prometheus metrics (labelled by key id: configured ids only).
#[derive(Debug)]
struct LimiterMetrics {
    registry: Registry,
    admitted: Family<KeyLabel, Counter>,
    refused: Family<RefusedLabels, Counter>,
    in_flight: Family<KeyLabel, Gauge>,
}

impl LimiterMetrics {
    fn new() -> Self {
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
        Self {
            registry,
            admitted,
            refused,
            in_flight,
        }
    }
}

/// The in-process limiter: one Edge enforces each key's [`Limits`] alone.
#[derive(Debug)]
pub struct Limiter {
    config: LimitsConfig,
    epoch: tokio::time::Instant,
    keys: Mutex<HashMap<String, KeyEntry>>,
    metrics: LimiterMetrics,
}

impl Limiter {
    /// A limiter enforcing `config`, its clock starting now.
    pub fn new(config: LimitsConfig) -> Self {
        Self {
            config,
            epoch: tokio::time::Instant::now(),
            keys: Mutex::new(HashMap::new()),
            metrics: LimiterMetrics::new(),
        }
    }

    /// What it enforces.
    pub fn config(&self) -> &LimitsConfig {
        &self.config
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, KeyEntry>> {
        self.keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits one request of key `key` to model group `model`, reserving `estimate` tokens,
    /// or refuses it having taken nothing. A key without limits gets an empty [`Hold`].
    pub fn admit(self: &Arc<Self>, key: &str, model: &str, estimate: u64) -> Result<Hold, Refused> {
        let limits = self.config.of(key);
        let model_limits = limits.models.get(model);
        if limits.limits == Limits::default() && model_limits.is_none() {
            return Ok(Hold::default());
        }
        let now = self.now_us();
        let mut keys = self.lock();
        if !keys.contains_key(key) {
            keys.insert(
                key.to_owned(),
                KeyEntry {
                    id: Arc::from(key),
                    ..KeyEntry::default()
                },
            );
        }
        let Some(entry) = keys.get_mut(key) else {
            return Ok(Hold::default());
        };
        if model_limits.is_some() && !entry.models.contains_key(model) {
            entry.models.insert(model.to_owned(), KeyState::default());
        }
        let model_state = model_limits.and(entry.models.get_mut(model));
        // Every limit is checked before any is charged.
        let own = entry.state.check(&limits.limits, now, estimate);
        let per_model = match (model_limits, &model_state) {
            (Some(l), Some(s)) => s.check(l, now, estimate),
            _ => Ok(()),
        };
        let refusal = match (own, per_model) {
            (Ok(()), Ok(())) => None,
            (Err(r), Ok(())) => Some((r, false)),
            (Ok(()), Err(r)) => Some((r, true)),
            (Err(a), Err(b)) => Some(
                if b.retry_after > a.retry_after && a.retry_after.is_some() {
                    (b, true)
                } else {
                    (a, false)
                },
            ),
        };
        if let Some((r, per_model)) = refusal {
            let quota = Quota::of(&limits.limits, r.requests.as_ref(), r.tokens.as_ref());
            self.metrics
                .refused
                .get_or_create(&RefusedLabels {
                    key: Arc::clone(&entry.id),
                    limit: r.exceeded.as_str(),
                })
                .inc();
            return Err(Refused {
                exceeded: r.exceeded,
                per_model,
                retry_after: r.retry_after,
                quota,
            });
        }
        let (model_admitted, model_quota) = match (model_limits, model_state) {
            (Some(l), Some(s)) => match s.admit(l, now, estimate) {
                Ok(a) => {
                    let q = Quota::of(l, a.requests.as_ref(), a.token_decision.as_ref());
                    (Some(a), q)
                }
                Err(_) => (None, Quota::default()),
            },
            _ => (None, Quota::default()),
        };
        let (own_admitted, own_quota) = match entry.state.admit(&limits.limits, now, estimate) {
            Ok(a) => {
                let q = Quota::of(
                    &limits.limits,
                    a.requests.as_ref(),
                    a.token_decision.as_ref(),
                );
                (Some(a), q)
            }
            Err(_) => (None, Quota::default()),
        };
        let label = KeyLabel {
            key: Arc::clone(&entry.id),
        };
        self.metrics.admitted.get_or_create(&label).inc();
        self.metrics.in_flight.get_or_create(&label).inc();
        Ok(Hold {
            limiter: Some(Arc::clone(self)),
            key: Some(Arc::clone(&entry.id)),
            model: model_admitted.as_ref().map(|_| model.to_owned()),
            own: own_admitted,
            per_model: model_admitted,
            usage: None,
            sent: false,
            quota: own_quota.tighter(model_quota),
        })
    }

    fn finish(&self, hold: &mut Hold) {
        let Some(key) = hold.key.take() else { return };
        let now = self.now_us();
        let mut keys = self.lock();
        let Some(entry) = keys.get_mut(&*key) else {
            return;
        };
        let limits = self.config.of(&key);
        let actual = |a: &Admitted| match (hold.sent, hold.usage) {
            (false, _) => 0,
            (true, Some(u)) => u,
            (true, None) => a.reserved(),
        };
        if let Some(a) = hold.own.take() {
            let n = actual(&a);
            entry.state.finish(&limits.limits, now, a, n);
        }
        self.metrics
            .in_flight
            .get_or_create(&KeyLabel {
                key: Arc::clone(&entry.id),
            })
            .dec();
        if let (Some(a), Some(model)) = (hold.per_model.take(), hold.model.as_deref())
            && let (Some(l), Some(s)) = (limits.models.get(model), entry.models.get_mut(model))
        {
            let n = actual(&a);
            s.finish(l, now, a, n);
        }
    }

    /// Appends the limiter's metrics to `out`, an OpenMetrics text that may already end with
    /// `# EOF` (the Edge's own metrics): admissions and refusals (by limit) and requests in
    /// flight, per key id.
    pub fn encode_metrics(&self, out: &mut String) {
        if out.ends_with("# EOF\n") {
            out.truncate(out.len() - "# EOF\n".len());
        }
        // Writing to a String does not fail.
        let _ = prometheus_client::encoding::text::encode(out, &self.metrics.registry);
    }
}

/// An admitted request's hold on its key's limits. It is finished when dropped: reconciled
/// to the usage it [saw](Hold::usage), given back if it was never [sent](Hold::sent).
#[derive(Debug, Default)]
#[must_use = "a hold is finished when dropped; drop it when the request ends"]
pub struct Hold {
    limiter: Option<Arc<Limiter>>,
    key: Option<Arc<str>>,
    model: Option<String>,
    own: Option<Admitted>,
    per_model: Option<Admitted>,
    usage: Option<u64>,
    sent: bool,
    quota: Quota,
}

impl Hold {
    /// Whether this hold holds nothing (the key has no limits): it need not ride on the
    /// stream.
    pub fn is_empty(&self) -> bool {
        self.limiter.is_none()
    }

    /// The quota after this admission, for the response headers (empty for a key without
    /// limits).
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The request was sent to a provider: from now on its tokens are charged (the usage it
    /// sees, else its whole reservation).
    pub fn sent(&mut self) {
        self.sent = true;
    }

    /// The provider's usage for the request (the last report counts).
    pub fn usage(&mut self, usage: &Usage) {
        let total = if usage.total_tokens > 0 {
            usage.total_tokens
        } else {
            usage.prompt_tokens.saturating_add(usage.completion_tokens)
        };
        self.usage = Some(total);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(limiter) = self.limiter.take() {
            limiter.finish(self);
        }
    }
}

impl crate::transport::StreamWatch for Hold {
    fn usage(&mut self, usage: &Usage) {
        Self::usage(self, usage);
    }

    /// An upstream error status: the provider used (and bills) nothing, unless it reports
    /// usage after all.
    fn status(&mut self, status: u16) {
        if !(200..300).contains(&status) && self.usage.is_none() {
            self.usage = Some(0);
        }
    }
}

/// The tokens to reserve for `request` (a JSON request body in any route's form; `chat` its
/// chat form): its output cap, else `output_estimate`, plus the input estimate.
pub fn estimate(
    request: &serde_json::Value,
    chat: &serde_json::Value,
    output_estimate: u64,
) -> u64 {
    let cap = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| request[*k].as_u64())
        .unwrap_or(output_estimate);
    cap.saturating_add(iop_dialect::request::estimate_tokens(chat))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn resets_read_like_openai_writes_them() {
        assert_eq!(go_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_secs(60)), "1m0s");
        assert_eq!(go_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(go_duration(Duration::from_millis(3_723_040)), "1h2m3.04s");
        assert_eq!(
            rfc3339(std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            "2023-11-14T22:13:20Z"
        );
    }

    fn per_minute(requests: u64, tokens: u64) -> Limits {
        Limits {
            requests: Rate::per_minute(requests),
            tokens: Rate::per_minute(tokens),
            concurrent: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_is_charged_its_usage_its_reservation_or_nothing() {
        let config = LimitsConfig {
            default: KeyLimits {
                limits: per_minute(100, 1000),
                models: BTreeMap::new(),
            },
            ..LimitsConfig::default()
        };
        let l = Arc::new(Limiter::new(config));
        // Sent with usage: 400 reserved, 100 charged.
        let mut h = l.admit("k", "m", 400).unwrap();
        assert_eq!(h.quota().tokens.unwrap().remaining, 600);
        h.sent();
        h.usage(&Usage {
            prompt_tokens: 60,
            completion_tokens: 40,
            total_tokens: 100,
        });
        drop(h);
        // Never sent: nothing charged.
        drop(l.admit("k", "m", 500).unwrap());
        // Sent, no usage: the reservation stands.
        let mut h = l.admit("k", "m", 300).unwrap();
        h.sent();
        drop(h);
        let h = l.admit("k", "m", 0).unwrap();
        assert_eq!(h.quota().tokens.unwrap().remaining, 600);
        assert_eq!(h.quota().requests.unwrap().remaining, 96);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_model_limit_is_checked_with_the_key_and_refusal_takes_nothing() {
        let mut models = BTreeMap::new();
        models.insert("big".to_owned(), per_minute(2, 1_000_000));
        let config = LimitsConfig {
            default: KeyLimits {
                limits: per_minute(10, 1_000_000),
                models,
            },
            ..LimitsConfig::default()
        };
        let l = Arc::new(Limiter::new(config));
        let a = l.admit("k", "big", 1).unwrap();
        assert_eq!(
            a.quota().requests.unwrap().remaining,
            1,
            "the tighter shown"
        );
        let _b = l.admit("k", "big", 1).unwrap();
        let r = l.admit("k", "big", 1).unwrap_err();
        assert!(r.per_model);
        assert_eq!(r.exceeded, Exceeded::Requests);
        assert_eq!(r.retry_after_secs(), Some(30));
        // The refusal took nothing from the key: 8 left on another model.
        let c = l.admit("k", "small", 1).unwrap();
        assert_eq!(c.quota().requests.unwrap().remaining, 7);
        // Another key is limited on its own.
        let d = l.admit("other", "big", 1).unwrap();
        assert_eq!(d.quota().requests.unwrap().remaining, 1);
        let mut m = String::from("# EOF\n");
        l.encode_metrics(&mut m);
        assert!(
            m.contains("iop_edge_ratelimit_refused_total{key=\"k\",limit=\"requests\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("iop_edge_ratelimit_in_flight{key=\"k\"} 3"),
            "{m}"
        );
        assert_eq!(m.matches("# EOF").count(), 1, "{m}");
    }
}
