//! Spans as we record them: one compact value per span, its ids from a per-thread generator,
//! the sampling decision made here, and the whole value handed to the export queue when the
//! span ends.
//!
//! Why not the SDK's span: at 100 % sampling the SDK's span (a `Context` and its `Arc` per
//! span, the sampler's result, the 288-byte span data moved through the processor and the
//! queue) was most of what tracing cost a request (`span_speed` below: one request's four spans
//! recorded, queued and encoded). This records the same data in one allocation and moves a
//! pointer through the queue. The SDK's types are still what the gRPC exporter takes
//! ([`to_span_data`], on the export task, off the request path), and the sampling rule is the
//! SDK's, bit for bit (`ratio_sampled`, tested against it).

use std::borrow::Cow;
use std::cell::Cell;
use std::time::SystemTime;

use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::{InstrumentationScope, KeyValue};

/// Most attributes on a span, and on an event; more are dropped and counted (the SDK's
/// default limits).
pub(crate) const MAX_ATTRIBUTES: usize = 128;
/// Most events on a span; more are dropped and counted.
pub(crate) const MAX_EVENTS: usize = 128;

/// One finished (or running) span.
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) trace_id: [u8; 16],
    pub(crate) span_id: [u8; 8],
    /// All zero for a root span.
    pub(crate) parent_span_id: [u8; 8],
    pub(crate) parent_remote: bool,
    pub(crate) flags: u8,
    /// The W3C `tracestate` header, inherited from the parent.
    pub(crate) state: Option<String>,
    pub(crate) name: Cow<'static, str>,
    pub(crate) kind: SpanKind,
    pub(crate) start: SystemTime,
    pub(crate) end: SystemTime,
    pub(crate) attributes: Vec<KeyValue>,
    pub(crate) dropped_attributes: u32,
    pub(crate) events: Vec<Event>,
    pub(crate) dropped_events: u32,
    /// `error.type` and the status description when the span failed.
    pub(crate) error: Option<&'static str>,
}

/// A span event.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) name: &'static str,
    pub(crate) time: SystemTime,
    pub(crate) attributes: Vec<KeyValue>,
    pub(crate) dropped_attributes: u32,
}

impl Record {
    /// Adds an attribute; setting a key again replaces its value, which the export task sorts
    /// out ([`latest`]), off the request path.
    pub(crate) fn set(&mut self, kv: KeyValue) {
        if self.attributes.len() < MAX_ATTRIBUTES {
            self.attributes.push(kv);
        } else {
            self.dropped_attributes = self.dropped_attributes.saturating_add(1);
        }
    }

    pub(crate) fn event(&mut self, name: &'static str, mut attributes: Vec<KeyValue>) {
        if self.events.len() >= MAX_EVENTS {
            self.dropped_events = self.dropped_events.saturating_add(1);
            return;
        }
        let dropped = attributes.len().saturating_sub(MAX_ATTRIBUTES);
        attributes.truncate(MAX_ATTRIBUTES);
        self.events.push(Event {
            name,
            time: SystemTime::now(),
            attributes,
            dropped_attributes: u32::try_from(dropped).unwrap_or(u32::MAX),
        });
    }
}

/// The attributes as exported: the last value of each key, in the order of those last values.
pub(crate) fn latest(attributes: &[KeyValue]) -> impl Iterator<Item = &KeyValue> {
    attributes
        .iter()
        .enumerate()
        .filter(|(i, a)| !attributes[i + 1..].iter().any(|b| b.key == a.key))
        .map(|(_, a)| a)
}

/// Caps a new span's attributes at [`MAX_ATTRIBUTES`]; the count of the rest.
pub(crate) fn capped(mut attributes: Vec<KeyValue>) -> (Vec<KeyValue>, u32) {
    let dropped = attributes.len().saturating_sub(MAX_ATTRIBUTES);
    attributes.truncate(MAX_ATTRIBUTES);
    (attributes, u32::try_from(dropped).unwrap_or(u32::MAX))
}

/// The sampler: `OTEL_TRACES_SAMPLER`'s six standard values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Sampler {
    /// A span with a parent follows the parent's sampled flag.
    pub(crate) parent_based: bool,
    /// A root (or, not parent-based, every span): recorded with this probability.
    pub(crate) ratio: f64,
}

impl Default for Sampler {
    fn default() -> Self {
        Self {
            parent_based: true,
            ratio: 1.0,
        }
    }
}

impl Sampler {
    /// From `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
    pub(crate) fn from_env(name: Option<&str>, arg: Option<&str>) -> Result<Self, crate::Error> {
        let ratio = || -> Result<f64, crate::Error> {
            match arg.map(str::trim).filter(|a| !a.is_empty()) {
                None => Ok(1.0),
                Some(a) => a
                    .parse::<f64>()
                    .ok()
                    .filter(|r| (0.0..=1.0).contains(r))
                    .ok_or(crate::Error::Invalid {
                        setting: "OTEL_TRACES_SAMPLER_ARG",
                        rule: "a probability between 0 and 1",
                    }),
            }
        };
        let (parent_based, ratio) = match name.map(str::trim).unwrap_or("") {
            "" | "parentbased_always_on" => (true, 1.0),
            "parentbased_always_off" => (true, 0.0),
            "parentbased_traceidratio" => (true, ratio()?),
            "always_on" => (false, 1.0),
            "always_off" => (false, 0.0),
            "traceidratio" => (false, ratio()?),
            _ => {
                return Err(crate::Error::Invalid {
                    setting: "OTEL_TRACES_SAMPLER",
                    rule: "always_on, always_off, traceidratio or their parentbased_ forms",
                });
            }
        };
        Ok(Self {
            parent_based,
            ratio,
        })
    }

    /// Whether a span of `trace_id` with a parent sampled or not (`None`: a root) is
    /// recorded.
    pub(crate) fn sampled(&self, trace_id: &[u8; 16], parent_sampled: Option<bool>) -> bool {
        match parent_sampled {
            Some(p) if self.parent_based => p,
            _ => ratio_sampled(trace_id, self.ratio),
        }
    }
}

/// The SDK's `TraceIdRatioBased` rule: the trace id's low 63 bits below `ratio` × 2⁶³, so that
/// every process sampling a trace at the same ratio makes the same decision.
pub(crate) fn ratio_sampled(trace_id: &[u8; 16], ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "the SDK's own arithmetic, a probability scaled to 2^63"
    )]
    let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    (u64::from_be_bytes(low) >> 1) < bound
}

thread_local! {
    /// wyrand state, seeded per thread from the standard library's per-thread random keys.
    static RNG: Cell<u64> = Cell::new({
        use std::hash::{BuildHasher as _, Hasher as _};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x2545_f491_4f6c_dd1d);
        h.finish()
    });
}

/// The next 64 random bits of this thread's generator (wyrand: fast, passes the usual
/// statistical suites; ids need to be unique and unpredictable enough not to collide, not
/// secret).
fn next_u64() -> u64 {
    RNG.with(|s| {
        let x = s.get().wrapping_add(0xa076_1d64_78bd_642f);
        s.set(x);
        let t = u128::from(x) * u128::from(x ^ 0xe703_7ed1_a0b4_28db);
        #[expect(clippy::cast_possible_truncation, reason = "folding 128 bits to 64")]
        let folded = (t >> 64) as u64 ^ t as u64;
        folded
    })
}

/// A new, non-zero span id.
pub(crate) fn span_id() -> [u8; 8] {
    loop {
        let v = next_u64();
        if v != 0 {
            return v.to_be_bytes();
        }
    }
}

/// A new, non-zero trace id.
pub(crate) fn trace_id() -> [u8; 16] {
    loop {
        let (a, b) = (next_u64(), next_u64());
        if a != 0 || b != 0 {
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&a.to_be_bytes());
            id[8..].copy_from_slice(&b.to_be_bytes());
            return id;
        }
    }
}

/// The SDK's form of a record, for the gRPC exporter (on the export task).
pub(crate) fn to_span_data(
    r: Record,
    scope: &InstrumentationScope,
) -> opentelemetry_sdk::trace::SpanData {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    let state = r
        .state
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let mut events = opentelemetry_sdk::trace::SpanEvents::default();
    events.events = r
        .events
        .into_iter()
        .map(|e| {
            opentelemetry::trace::Event::new(e.name, e.time, e.attributes, e.dropped_attributes)
        })
        .collect();
    events.dropped_count = r.dropped_events;
    opentelemetry_sdk::trace::SpanData {
        span_context: SpanContext::new(
            TraceId::from_bytes(r.trace_id),
            SpanId::from_bytes(r.span_id),
            TraceFlags::new(r.flags),
            false,
            state,
        ),
        parent_span_id: SpanId::from_bytes(r.parent_span_id),
        parent_span_is_remote: r.parent_remote,
        span_kind: r.kind,
        name: r.name,
        start_time: r.start,
        end_time: r.end,
        attributes: latest(&r.attributes).cloned().collect(),
        dropped_attributes_count: r.dropped_attributes,
        events,
        links: opentelemetry_sdk::trace::SpanLinks::default(),
        status: match r.error {
            Some(kind) => Status::error(kind),
            None => Status::Unset,
        },
        instrumentation_scope: scope.clone(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceId;
    use opentelemetry_sdk::trace::{Sampler as SdkSampler, SamplingDecision, ShouldSample as _};

    /// The same decision as the SDK's `TraceIdRatioBased` for the same trace ids.
    #[test]
    fn ratio_sampling_is_the_sdks() {
        for ratio in [0.0, 0.01, 0.25, 0.5, 0.999, 1.0] {
            let sdk = SdkSampler::TraceIdRatioBased(ratio);
            for _ in 0..2000 {
                let id = trace_id();
                let theirs = sdk
                    .should_sample(
                        None,
                        TraceId::from_bytes(id),
                        "x",
                        &SpanKind::Internal,
                        &[],
                        &[],
                    )
                    .decision
                    == SamplingDecision::RecordAndSample;
                assert_eq!(ratio_sampled(&id, ratio), theirs, "{ratio}");
            }
        }
    }

    #[test]
    fn parent_based_follows_the_parent() {
        let s = Sampler {
            parent_based: true,
            ratio: 0.0,
        };
        let id = trace_id();
        assert!(s.sampled(&id, Some(true)));
        assert!(!s.sampled(&id, None));
        let s = Sampler {
            parent_based: false,
            ratio: 1.0,
        };
        assert!(s.sampled(&id, Some(false)), "not parent-based: the ratio");
    }

    #[test]
    fn the_samplers_names() {
        let s = |n, a| Sampler::from_env(n, a);
        assert_eq!(s(None, None).unwrap(), Sampler::default());
        assert_eq!(
            s(Some("parentbased_traceidratio"), Some("0.25")).unwrap(),
            Sampler {
                parent_based: true,
                ratio: 0.25
            }
        );
        assert_eq!(
            s(Some("always_off"), None).unwrap(),
            Sampler {
                parent_based: false,
                ratio: 0.0
            }
        );
        let e = s(Some("traceidratio"), Some("2")).unwrap_err();
        assert!(e.to_string().contains("OTEL_TRACES_SAMPLER_ARG"), "{e}");
        let e = s(Some("jaeger_remote"), None).unwrap_err();
        assert!(e.to_string().contains("OTEL_TRACES_SAMPLER"), "{e}");
    }

    #[test]
    fn ids_are_distinct_and_non_zero() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let t = trace_id();
            assert_ne!(t, [0; 16]);
            assert!(seen.insert(t));
            assert_ne!(span_id(), [0; 8]);
        }
    }

    #[test]
    fn attributes_and_events_are_bounded() {
        let mut r = Record {
            trace_id: trace_id(),
            span_id: span_id(),
            parent_span_id: [0; 8],
            parent_remote: false,
            flags: 1,
            state: None,
            name: "x".into(),
            kind: SpanKind::Internal,
            start: SystemTime::now(),
            end: SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes: 0,
            events: Vec::new(),
            dropped_events: 0,
            error: None,
        };
        for i in 0..200_i64 {
            r.set(KeyValue::new(format!("k{i}"), i));
            r.event("e", vec![KeyValue::new("i", i); 130]);
        }
        assert_eq!(r.attributes.len(), MAX_ATTRIBUTES);
        assert_eq!(r.dropped_attributes, 72);
        assert_eq!(r.events.len(), MAX_EVENTS);
        assert_eq!(r.dropped_events, 72);
        assert_eq!(r.events[0].dropped_attributes, 2);
        let set_twice = [
            KeyValue::new("a", 1_i64),
            KeyValue::new("b", 2_i64),
            KeyValue::new("a", 3_i64),
        ];
        let kept: Vec<_> = latest(&set_twice).collect();
        assert_eq!(
            kept,
            [&set_twice[1], &set_twice[2]],
            "the last value of each key"
        );
        let (kept, dropped) = capped(vec![KeyValue::new("a", 1_i64); 129]);
        assert_eq!((kept.len(), dropped), (MAX_ATTRIBUTES, 1));
    }
}
