//! What clients are told: the quota after a decision, as `x-ratelimit-*` (OpenAI routes) or
//! `anthropic-ratelimit-*` (`/v1/messages`) headers.

use std::fmt::Write as _;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use iop_dialect::Dialect;
use iop_edge_core::ratelimit::{Decision, Limits, Rate};

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
    pub(super) fn of(rate: &Rate, d: &Decision) -> Self {
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
    pub(super) fn of(
        limits: &Limits,
        requests: Option<&Decision>,
        tokens: Option<&Decision>,
    ) -> Self {
        Self {
            requests: limits.requests.zip(requests).map(|(r, d)| Shown::of(&r, d)),
            tokens: limits.tokens.zip(tokens).map(|(r, d)| Shown::of(&r, d)),
        }
    }

    pub(super) fn tighter(self, other: Self) -> Self {
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
pub(super) fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = iop_wire::time::unix_secs(t);
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}
