//! The OTLP/HTTP protobuf exporter: each batch encoded straight from our span records into
//! one `ExportTraceServiceRequest` (no intermediate `opentelemetry-proto` structs), posted with
//! our reqwest client.
//!
//! Why our own: the OpenTelemetry exporter converts every span into owned protobuf structs
//! before encoding (every id a `Vec<u8>`, every attribute key and value a `String`), about three
//! allocations per attribute; at 100 % sampling that conversion was the largest part of what
//! tracing cost a request (`benches/README.md`, tracing cost). Encoding in place writes the
//! same bytes with one buffer per batch. The tests decode what it sends with
//! `opentelemetry-proto` (`tests/tests/telemetry.rs`, `bins/tests/tracing.rs`). The gRPC
//! transport is still the OpenTelemetry exporter.
//!
//! Configuration as the OTLP exporter specification says: the signal endpoint
//! (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is used as is, the base endpoint
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`, or the config's) gets `/v1/traces`; headers from
//! `OTEL_EXPORTER_OTLP_TRACES_HEADERS` or `OTEL_EXPORTER_OTLP_HEADERS` (`k=v` pairs, comma
//! separated, percent-decoded; never logged); timeout from `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`
//! or `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds, default 10000).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::SpanKind;
use opentelemetry::{Array, KeyValue, Value};
use opentelemetry_sdk::Resource;

use crate::record::Record;

// === Protobuf encoding (wire types: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32) ===

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn bytes_field(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    if b.is_empty() {
        return;
    }
    key(out, field, 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        key(out, field, 0);
        varint(out, v);
    }
}

fn fixed64_field(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// A length-delimited sub-message written by `body`: the length is known only after, so one
/// byte is kept for it and, in the rare case of a body of 128 bytes or more, the rest of the
/// length inserted after it (a shift of the body).
fn message(out: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    key(out, field, 2);
    let at = out.len();
    out.push(0);
    body(out);
    let mut v = (out.len() - at - 1) as u64;
    if v < 0x80 {
        out[at] = v as u8;
        return;
    }
    let mut buf = [0u8; 10];
    let mut n = 0;
    while v >= 0x80 {
        buf[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    buf[n] = v as u8;
    n += 1;
    out[at] = buf[0];
    out.splice(at + 1..at + 1, buf[1..n].iter().copied());
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// `AnyValue` (fields: 1 string, 2 bool, 3 int, 4 double, 5 array).
fn any_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::String(s) => {
            key(out, 1, 2);
            varint(out, s.as_str().len() as u64);
            out.extend_from_slice(s.as_str().as_bytes());
        }
        Value::Bool(b) => {
            key(out, 2, 0);
            varint(out, u64::from(*b));
        }
        Value::I64(i) => {
            key(out, 3, 0);
            varint(out, *i as u64);
        }
        Value::F64(f) => {
            key(out, 4, 1);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Array(a) => message(out, 5, |out| match a {
            Array::Bool(v) => v
                .iter()
                .for_each(|x| message(out, 1, |o| any_value(o, &Value::Bool(*x)))),
            Array::I64(v) => v
                .iter()
                .for_each(|x| message(out, 1, |o| any_value(o, &Value::I64(*x)))),
            Array::F64(v) => v
                .iter()
                .for_each(|x| message(out, 1, |o| any_value(o, &Value::F64(*x)))),
            Array::String(v) => v
                .iter()
                .for_each(|x| message(out, 1, |o| any_value(o, &Value::String(x.clone())))),
            other => {
                let s = other.to_string();
                message(out, 1, |o| bytes_field(o, 1, s.as_bytes()));
            }
        }),
        other => {
            let s = other.to_string();
            bytes_field(out, 1, s.as_bytes());
        }
    }
}

/// `KeyValue` as field `field` of the enclosing message.
fn attribute(out: &mut Vec<u8>, field: u32, k: &str, v: &Value) {
    message(out, field, |out| {
        bytes_field(out, 1, k.as_bytes());
        message(out, 2, |out| any_value(out, v));
    });
}

fn attributes(out: &mut Vec<u8>, field: u32, kvs: &[KeyValue]) {
    for kv in kvs {
        attribute(out, field, kv.key.as_str(), &kv.value);
    }
}

fn kind(k: &SpanKind) -> u64 {
    match k {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// One `Span` (opentelemetry/proto/trace/v1/trace.proto).
fn span(out: &mut Vec<u8>, s: &Record) {
    bytes_field(out, 1, &s.trace_id);
    bytes_field(out, 2, &s.span_id);
    bytes_field(out, 3, s.state.as_deref().unwrap_or_default().as_bytes());
    if s.parent_span_id != [0; 8] {
        bytes_field(out, 4, &s.parent_span_id);
    }
    bytes_field(out, 5, s.name.as_bytes());
    varint_field(out, 6, kind(&s.kind));
    fixed64_field(out, 7, unix_nanos(s.start));
    fixed64_field(out, 8, unix_nanos(s.end));
    for kv in crate::record::latest(&s.attributes) {
        attribute(out, 9, kv.key.as_str(), &kv.value);
    }
    varint_field(out, 10, u64::from(s.dropped_attributes));
    for e in &s.events {
        message(out, 11, |out| {
            fixed64_field(out, 1, unix_nanos(e.time));
            bytes_field(out, 2, e.name.as_bytes());
            attributes(out, 3, &e.attributes);
            varint_field(out, 4, u64::from(e.dropped_attributes));
        });
    }
    varint_field(out, 12, u64::from(s.dropped_events));
    // Always present (as the OpenTelemetry exporter writes it), empty when unset.
    match s.error {
        None => message(out, 15, |_| {}),
        Some(description) => message(out, 15, |out| {
            bytes_field(out, 2, description.as_bytes());
            varint_field(out, 3, 2);
        }),
    }
    key(out, 16, 5);
    out.extend_from_slice(&span_flags(s.flags, s.parent_remote).to_le_bytes());
}

/// Span `flags`: the W3C trace flags, that the parent's remoteness is known (bit 8) and
/// whether it was remote (bit 9).
fn span_flags(trace_flags: u8, remote: bool) -> u32 {
    u32::from(trace_flags) | 0x100 | if remote { 0x200 } else { 0 }
}

/// The `Resource` message's body.
fn resource_body(r: &Resource) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in r.iter() {
        attribute(&mut out, 1, k.as_str(), v);
    }
    out
}

/// One `ExportTraceServiceRequest` for `spans`: one `ResourceSpans` with one `ScopeSpans`
/// (every span of ours has the one instrumentation scope, `iop-mesh`).
pub(crate) fn encode(resource: &[u8], schema_url: &str, spans: &[Box<Record>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + spans.len() * 384);
    message(&mut out, 1, |out| {
        message(out, 1, |out| out.extend_from_slice(resource));
        if !spans.is_empty() {
            message(out, 2, |out| {
                message(out, 1, |out| bytes_field(out, 1, crate::SCOPE.as_bytes()));
                for s in spans {
                    message(out, 2, |out| span(out, s));
                }
            });
        }
        bytes_field(out, 3, schema_url.as_bytes());
    });
    out
}

/// `k=v,k2=v2` (values percent-decoded) as header pairs; a malformed pair is skipped.
fn parse_headers(s: &str) -> reqwest::header::HeaderMap {
    let mut h = reqwest::header::HeaderMap::new();
    for pair in s.split(',') {
        let Some((k, v)) = pair.split_once('=') else {
            continue;
        };
        let v = percent_decode(v.trim());
        if let (Ok(k), Ok(v)) = (
            reqwest::header::HeaderName::from_bytes(k.trim().as_bytes()),
            reqwest::header::HeaderValue::from_bytes(&v),
        ) {
            h.append(k, v);
        }
    }
    h
}

fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).and_then(|c| hex(*c)),
                b.get(i + 2).and_then(|c| hex(*c)),
            )
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The exporter.
#[derive(Debug)]
pub(crate) struct HttpExporter {
    client: reqwest::Client,
    url: String,
    headers: reqwest::header::HeaderMap,
    timeout: Duration,
    resource: Vec<u8>,
    schema_url: String,
}

impl HttpExporter {
    /// To `base` (the config's endpoint: `/v1/traces` is added) or the environment's.
    pub(crate) fn new(
        client: reqwest::Client,
        base: Option<&str>,
        env: &dyn Fn(&str) -> Option<String>,
        resource: &Resource,
    ) -> Result<Self, crate::Error> {
        let set = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        let url = match (base, set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) {
            (Some(b), _) => format!("{}/v1/traces", b.trim_end_matches('/')),
            (None, Some(signal)) => signal,
            (None, None) => match set("OTEL_EXPORTER_OTLP_ENDPOINT") {
                Some(b) => format!("{}/v1/traces", b.trim_end_matches('/')),
                None => {
                    return Err(crate::Error::Invalid {
                        setting: "OTEL_EXPORTER_OTLP_ENDPOINT",
                        rule: "a collector URL",
                    });
                }
            },
        };
        if reqwest::Url::parse(&url).is_err() {
            return Err(crate::Error::Invalid {
                setting: "otlp_endpoint",
                rule: "an http or https URL",
            });
        }
        let headers = set("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
            .or_else(|| set("OTEL_EXPORTER_OTLP_HEADERS"))
            .map(|h| parse_headers(&h))
            .unwrap_or_default();
        let timeout = set("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|| set("OTEL_EXPORTER_OTLP_TIMEOUT"))
            .and_then(|t| t.trim().parse::<u64>().ok())
            .map_or(Duration::from_secs(10), Duration::from_millis);
        Ok(Self {
            client,
            url,
            headers,
            timeout,
            resource: resource_body(resource),
            schema_url: resource.schema_url().unwrap_or_default().to_owned(),
        })
    }

    /// Posts one batch; the error names what failed, never the collector's answer body.
    pub(crate) fn send(
        &self,
        batch: &[Box<Record>],
    ) -> impl Future<Output = Result<(), String>> + Send + use<> {
        let body = encode(&self.resource, &self.schema_url, batch);
        let request = self
            .client
            .post(&self.url)
            .headers(self.headers.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
            .timeout(self.timeout)
            .body(body);
        async move {
            match request.send().await {
                Ok(r) if r.status().is_success() => Ok(()),
                // The status only: a collector's error body may echo what it was sent.
                Ok(r) => Err(format!("the collector answered {}", r.status())),
                Err(e) => Err(if e.is_timeout() {
                    "the collector did not answer in time".to_owned()
                } else if e.is_connect() {
                    "the collector is unreachable".to_owned()
                } else {
                    "the request to the collector failed".to_owned()
                }),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn lengths_of_every_size_are_prefixed_minimally() {
        for n in [0usize, 1, 127, 128, 300, 16_384, 70_000] {
            let mut out = Vec::new();
            message(&mut out, 1, |o| o.extend(std::iter::repeat_n(7u8, n)));
            let mut expect = Vec::new();
            key(&mut expect, 1, 2);
            varint(&mut expect, n as u64);
            expect.extend(std::iter::repeat_n(7u8, n));
            assert_eq!(out, expect, "{n}");
        }
    }

    /// A record with every field set, and one with none.
    pub(crate) fn records() -> Vec<Box<Record>> {
        use opentelemetry::StringValue;
        let t0 = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let trace_id = 0x4bf9_2f35_u128.to_be_bytes();
        vec![
            Box::new(Record {
                trace_id,
                span_id: 0x00f0_67aa_u64.to_be_bytes(),
                parent_span_id: 7_u64.to_be_bytes(),
                parent_remote: true,
                flags: 1,
                state: Some("congo=t61rcWkgMzE".into()),
                name: "POST /v1/chat/completions".into(),
                kind: SpanKind::Server,
                start: t0,
                end: t0 + Duration::from_millis(12),
                attributes: vec![
                    KeyValue::new("gen_ai.request.model", "m"),
                    KeyValue::new("empty", ""),
                    KeyValue::new("gen_ai.usage.input_tokens", 11_i64),
                    KeyValue::new("negative", -3_i64),
                    KeyValue::new("ratio", 0.25),
                    KeyValue::new("flag", false),
                    KeyValue::new(
                        "list",
                        Value::Array(Array::String(vec![StringValue::from("a"), "b".into()])),
                    ),
                    KeyValue::new("ints", Value::Array(Array::I64(vec![1, -2]))),
                    // Long enough that its length takes two bytes.
                    KeyValue::new("long", "x".repeat(300)),
                    // Set again: the last value is the one exported.
                    KeyValue::new("gen_ai.usage.input_tokens", 12_i64),
                ],
                dropped_attributes: 2,
                events: vec![crate::record::Event {
                    name: "response_stalled",
                    time: t0 + Duration::from_millis(5),
                    attributes: vec![KeyValue::new("idle_ms", 5_i64)],
                    dropped_attributes: 1,
                }],
                dropped_events: 3,
                error: Some("timeout"),
            }),
            Box::new(Record {
                trace_id,
                span_id: 0x11_u64.to_be_bytes(),
                parent_span_id: [0; 8],
                parent_remote: false,
                flags: 1,
                state: None,
                name: "dispatch".into(),
                kind: SpanKind::Client,
                start: t0,
                end: t0 + Duration::from_micros(3),
                attributes: Vec::new(),
                dropped_attributes: 0,
                events: Vec::new(),
                dropped_events: 0,
                error: None,
            }),
        ]
    }

    /// The same bytes as the OpenTelemetry project's own conversion gives for the same spans
    /// in the SDK's form (which is also what the gRPC exporter is given).
    #[test]
    fn encodes_what_the_opentelemetry_exporter_encodes() {
        use opentelemetry::InstrumentationScope;
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
        use prost::Message as _;

        let resource = Resource::builder_empty()
            .with_service_name("iop-edge")
            .with_attribute(KeyValue::new("host.name", "h1"))
            .build();
        let scope = InstrumentationScope::builder(crate::SCOPE).build();
        let ours = encode(&resource_body(&resource), "", &records());
        let decoded = ExportTraceServiceRequest::decode(ours.as_slice()).unwrap();
        let sdk = records()
            .into_iter()
            .map(|r| crate::record::to_span_data(*r, &scope))
            .collect();
        let theirs = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(sdk, &(&resource).into()),
        };
        assert_eq!(decoded, theirs);
        assert_eq!(ours, theirs.encode_to_vec(), "byte for byte");
    }

    #[test]
    fn headers_are_parsed_and_percent_decoded() {
        let h = parse_headers("api-key=a%3Db, x-tenant = t1 ,bad");
        assert_eq!(h.get("api-key").unwrap(), "a=b");
        assert_eq!(h.get("x-tenant").unwrap(), "t1");
        assert_eq!(h.len(), 2);
    }
}

/// Encoding speed against the OpenTelemetry exporter's conversion (a measurement, not a test:
/// `cargo test --release -p iop-telemetry --lib -- --ignored encoding_speed --nocapture`).
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::print_stdout, reason = "a measurement")]
mod speed {
    use super::*;
    use opentelemetry::InstrumentationScope;

    fn batch(n: usize) -> Vec<Box<Record>> {
        (0..n)
            .map(|i| {
                Box::new(Record {
                    trace_id: (i as u128 + 1).to_be_bytes(),
                    span_id: (i as u64 + 1).to_be_bytes(),
                    parent_span_id: 7_u64.to_be_bytes(),
                    parent_remote: false,
                    flags: 1,
                    state: None,
                    name: "dispatch".into(),
                    kind: SpanKind::Client,
                    start: SystemTime::now(),
                    end: SystemTime::now(),
                    attributes: vec![
                        KeyValue::new("gen_ai.operation.name", "chat"),
                        KeyValue::new("iop.attempt", 1_i64),
                        KeyValue::new("iop.attempt.reason", "first"),
                        KeyValue::new("iop.node.id", "node-1".to_owned()),
                        KeyValue::new("iop.adapter", "upstream".to_owned()),
                        KeyValue::new("gen_ai.response.model", "fake-model".to_owned()),
                        KeyValue::new("gen_ai.usage.input_tokens", 11_i64),
                        KeyValue::new("gen_ai.usage.output_tokens", 3_i64),
                    ],
                    dropped_attributes: 0,
                    events: Vec::new(),
                    dropped_events: 0,
                    error: None,
                })
            })
            .collect()
    }

    #[test]
    #[ignore = "a measurement"]
    fn encoding_speed() {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
        use prost::Message as _;
        let resource = Resource::builder_empty().with_service_name("s").build();
        let scope = InstrumentationScope::builder(crate::SCOPE).build();
        let body = resource_body(&resource);
        let rounds = 200;
        let n = 512;
        for _ in 0..3 {
            let mut ours = Duration::ZERO;
            let mut theirs = Duration::ZERO;
            for _ in 0..rounds {
                let b = batch(n);
                let t = std::time::Instant::now();
                std::hint::black_box(encode(&body, "", &b));
                ours += t.elapsed();
                let b: Vec<_> = batch(n)
                    .into_iter()
                    .map(|r| crate::record::to_span_data(*r, &scope))
                    .collect();
                let t = std::time::Instant::now();
                let req = ExportTraceServiceRequest {
                    resource_spans: group_spans_by_resource_and_scope(b, &(&resource).into()),
                };
                std::hint::black_box(req.encode_to_vec());
                theirs += t.elapsed();
            }
            let per = |d: Duration| d.as_secs_f64() * 1e9 / (rounds * n) as f64;
            println!(
                "per span: ours {:.0} ns, the exporter's conversion + encoding {:.0} ns",
                per(ours),
                per(theirs)
            );
        }
    }
}
