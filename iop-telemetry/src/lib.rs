//! OpenTelemetry tracing for the IOP mesh: one trace from the client to the provider.
//!
//! The Edge continues the client's W3C `traceparent` (or starts a trace), its dispatch attempt
//! span's context crosses the Edge–Node wire on the run or tunnel request
//! ([`iop_wire::trace::TraceContext`]), and the Node sends its provider call span's context to
//! the provider as a `traceparent` header. A managed Edge's lease request carries its lease
//! span's context to `iop-cp`. Every process exports its own spans over OTLP; the collector
//! joins them by trace id.
//!
//! # Use
//!
//! ```no_run
//! # async fn demo() -> Result<(), iop_telemetry::Error> {
//! use iop_telemetry::{SpanKind, Telemetry, TelemetryConfig, attr};
//!
//! // Off unless an endpoint is configured here or in OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT.
//! let mut config = TelemetryConfig::default();
//! config.endpoint = Some("http://127.0.0.1:4318".into());
//! let telemetry = Telemetry::start(&config, "my-service")?;
//! let parent = iop_wire::trace::TraceContext::parse(
//!     b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
//!     None,
//! );
//! let mut span = telemetry.span("chat m", SpanKind::Server, parent.as_ref(), vec![
//!     attr::operation("chat"),
//! ]);
//! let child = telemetry.child(&span, "attempt", SpanKind::Client, Vec::new());
//! let for_the_next_hop = child.context(); // what crosses the wire
//! span.fail("timeout");
//! drop((child, span)); // a span ends when dropped
//! telemetry.flush().await; // before exit
//! # Ok(()) }
//! ```
//!
//! # Configuration
//!
//! [`TelemetryConfig`] (the binaries' `[telemetry]` table and flags) wins over the standard
//! environment variables, which the SDK and the exporter read for anything left unset:
//!
//! | variable | meaning |
//! |---|---|
//! | `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` | the collector; tracing is off when neither (nor the config) names one |
//! | `OTEL_EXPORTER_OTLP_PROTOCOL`, `..._TRACES_PROTOCOL` | `http/protobuf` (default) or `grpc` |
//! | `OTEL_EXPORTER_OTLP_HEADERS`, `..._TIMEOUT` | read by the exporter (headers are never logged) |
//! | `OTEL_EXPORTER_OTLP_CERTIFICATE` | a PEM CA file for an `https` gRPC collector (HTTP uses the platform's roots) |
//! | `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` | the resource |
//! | `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG` | `always_on`, `always_off`, `traceidratio` or their `parentbased_` forms (default `parentbased_always_on`); another value is an error at start |
//! | `OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, `OTEL_BSP_SCHEDULE_DELAY` | the queue (2048 spans), batch (512) and delay (5000 ms) |
//! | `OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none` | off |
//!
//! # What it costs
//!
//! Off (the default), [`Telemetry::span`] records nothing: it only passes a client's context
//! through, so the provider still sees the client's trace id. On, a finished span is handed to
//! a bounded queue (a push under a lock, never a wait); one task exports batches, woken when a
//! batch is full or by its timer, never by each span. A slow or absent collector never
//! blocks a request: when the queue is full, the span is dropped and counted
//! ([`Stats::dropped`]), and a failed export counts its spans in [`Stats::failed`]; both are on
//! the Edge's `/metrics` and logged (at most once a minute) by every process.
//!
//! # What is ours, and why
//!
//! The attribute and span-kind types, the resource (with `OTEL_RESOURCE_ATTRIBUTES` and the SDK's
//! detectors) and the OTLP/gRPC exporter are the OpenTelemetry project's. Three parts are ours,
//! each because the project's was the larger part of what tracing cost or hid what an operator
//! needs:
//!
//! - **the span record** (`record.rs`): one compact value per span, recorded in one allocation,
//!   ended by handing that box to the queue. The SDK's span (a `Context` and an `Arc` per span,
//!   the sampler's result, 288 bytes of span data moved through the processor and the queue)
//!   made one request's four spans cost about 4.4–5.2 µs recorded, queued and encoded; ours
//!   about 2 µs (`span_speed`, `benches/README.md`). The sampler is the standard one
//!   (`OTEL_TRACES_SAMPLER`'s six values, parent-based by default) with the SDK's ratio rule bit
//!   for bit (tested against it); ids come from a per-thread generator seeded from the OS, as
//!   the SDK's do. Spans have no links, and at most 128 attributes and 128 events each (the
//!   SDK's defaults), the rest dropped and counted;
//! - **the queue**: the SDK's batch processor drops spans when its queue is full but does not
//!   expose how many, and that count is what an operator needs to know the trace they look for
//!   was lost;
//! - **the OTLP/HTTP protobuf encoding**: the project's exporter converts every span into owned
//!   protobuf structs before encoding them (about three allocations per attribute); ours writes
//!   the same bytes straight from the records into one buffer per batch (tested byte for byte
//!   against the project's conversion, and decoded with `opentelemetry-proto` in the end-to-end
//!   tests). For gRPC, records become the SDK's span data on the export task, off the request
//!   path.
//!
//! Spans are explicit values passed along the request path (not a thread-local context),
//! because a request crosses tasks and a wire.
//!
//! # What never goes into a span
//!
//! No secret (keys, tokens, leases, credentials), no prompt and no completion text: the
//! attributes are the GenAI semantic conventions' names ([`attr`]) with model names, token
//! counts, provider and Node ids, statuses and error kinds only.

#![allow(
    clippy::vec_box,
    reason = "a span's record is boxed once when it starts; the box, not the record, moves through the queue and into the batch"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use iop_wire::trace::TraceContext;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanExporter as _;
use tokio::sync::{mpsc, oneshot};

pub use opentelemetry::trace::SpanKind;
pub use opentelemetry::{KeyValue, StringValue};

pub mod attr;
mod otlp_http;
mod record;

/// How spans reach the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/gRPC (port 4317 by convention).
    Grpc,
    /// OTLP/HTTP with protobuf bodies, to `<endpoint>/v1/traces` (port 4318 by convention).
    HttpProtobuf,
}

impl Protocol {
    /// From the `OTEL_EXPORTER_OTLP_PROTOCOL` spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "grpc" => Some(Self::Grpc),
            "http/protobuf" => Some(Self::HttpProtobuf),
            _ => None,
        }
    }
}

/// Tracing settings; every `None` falls back to the standard environment variable (see the
/// crate docs), and tracing is off when no endpoint is named anywhere.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct TelemetryConfig {
    /// The collector's base URL (`http://host:4318` for HTTP, `http://host:4317` for gRPC).
    pub endpoint: Option<String>,
    /// The protocol.
    pub protocol: Option<Protocol>,
    /// `service.name`.
    pub service_name: Option<String>,
    /// Parent-based ratio sampling: a request with a sampled parent is recorded, one with an
    /// unsampled parent is not, and a new trace is recorded with this probability (0–1).
    pub sample_ratio: Option<f64>,
    /// Most finished spans waiting for export (default 2048).
    pub queue_max: Option<usize>,
}

/// The `[telemetry]` table of the binaries' configuration files (every key optional; the
/// `OTEL_*` variables fill what is left out):
///
/// ```toml
/// [telemetry]
/// otlp_endpoint = "http://127.0.0.1:4318"   # the collector's base URL
/// otlp_protocol = "http/protobuf"           # or "grpc" (then usually port 4317)
/// service_name = "iop-edge"
/// sample_ratio = 0.01                       # new traces; a client's sampled flag is followed
/// queue_max = 2048                          # finished spans waiting for export
/// ```
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryToml {
    /// `otlp_endpoint`.
    pub otlp_endpoint: Option<String>,
    /// `otlp_protocol`: `grpc` or `http/protobuf`.
    pub otlp_protocol: Option<String>,
    /// `service_name`.
    pub service_name: Option<String>,
    /// `sample_ratio`, 0–1.
    pub sample_ratio: Option<f64>,
    /// `queue_max`.
    pub queue_max: Option<usize>,
}

impl TelemetryToml {
    /// The settings, checked.
    pub fn to_config(&self) -> Result<TelemetryConfig, Error> {
        let protocol = self
            .otlp_protocol
            .as_deref()
            .map(|p| {
                Protocol::parse(p).ok_or(Error::Invalid {
                    setting: "telemetry.otlp_protocol",
                    rule: "grpc or http/protobuf",
                })
            })
            .transpose()?;
        if let Some(r) = self.sample_ratio
            && !(0.0..=1.0).contains(&r)
        {
            return Err(Error::Invalid {
                setting: "telemetry.sample_ratio",
                rule: "between 0 and 1",
            });
        }
        if self.queue_max == Some(0) {
            return Err(Error::Invalid {
                setting: "telemetry.queue_max",
                rule: "at least 1",
            });
        }
        Ok(TelemetryConfig {
            endpoint: self.otlp_endpoint.clone(),
            protocol,
            service_name: self.service_name.clone(),
            sample_ratio: self.sample_ratio,
            queue_max: self.queue_max,
        })
    }
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is not valid.
    #[error("telemetry setting {setting}: {rule}")]
    Invalid {
        /// The config key or environment variable.
        setting: &'static str,
        /// What it must be.
        rule: &'static str,
    },
    /// The exporter could not be built.
    #[error("OTLP exporter: {0}")]
    Exporter(String),
}

/// The settings once the environment filled in the gaps.
#[derive(Clone, Debug, PartialEq)]
struct Resolved {
    /// Explicit endpoint (the config's); `None` = the exporter reads the environment.
    endpoint: Option<String>,
    protocol: Protocol,
    service_name: Option<String>,
    sampler: record::Sampler,
    queue_max: usize,
    batch_max: usize,
    delay: Duration,
    grpc_ca: Option<String>,
}

fn env_number<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<T>, Error> {
    env(var)
        .filter(|v| !v.trim().is_empty())
        .map(|v| {
            v.trim().parse().map_err(|_| Error::Invalid {
                setting: var,
                rule: "a non-negative integer",
            })
        })
        .transpose()
}

impl TelemetryConfig {
    /// Whether and how to trace, with `env` as the environment; `None` = off.
    fn resolve(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Resolved>, Error> {
        let set = |var: &str| env(var).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
            || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim() == "none")
        {
            return Ok(None);
        }
        let endpoint = self.endpoint.clone().filter(|e| !e.trim().is_empty());
        if endpoint.is_none()
            && set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
            && set("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
        {
            return Ok(None);
        }
        let protocol = match self.protocol {
            Some(p) => p,
            None => match set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                .or_else(|| set("OTEL_EXPORTER_OTLP_PROTOCOL"))
            {
                None => Protocol::HttpProtobuf,
                Some(p) => Protocol::parse(&p).ok_or(Error::Invalid {
                    setting: "OTEL_EXPORTER_OTLP_PROTOCOL",
                    rule: "grpc or http/protobuf",
                })?,
            },
        };
        if let Some(r) = self.sample_ratio
            && !(0.0..=1.0).contains(&r)
        {
            return Err(Error::Invalid {
                setting: "sample_ratio",
                rule: "between 0 and 1",
            });
        }
        let sampler = match self.sample_ratio {
            Some(ratio) => record::Sampler {
                parent_based: true,
                ratio,
            },
            None => record::Sampler::from_env(
                set("OTEL_TRACES_SAMPLER").as_deref(),
                set("OTEL_TRACES_SAMPLER_ARG").as_deref(),
            )?,
        };
        let queue_max = match self.queue_max {
            Some(q) => q,
            None => env_number(env, "OTEL_BSP_MAX_QUEUE_SIZE")?.unwrap_or(2048),
        };
        let batch_max = env_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")?.unwrap_or(512);
        let delay_ms: u64 = env_number(env, "OTEL_BSP_SCHEDULE_DELAY")?.unwrap_or(5000);
        if queue_max == 0 || batch_max == 0 {
            return Err(Error::Invalid {
                setting: "OTEL_BSP_MAX_QUEUE_SIZE",
                rule: "the queue and the batch hold at least one span",
            });
        }
        Ok(Some(Resolved {
            endpoint,
            protocol,
            service_name: self.service_name.clone(),
            sampler,
            queue_max,
            batch_max: batch_max.min(queue_max),
            delay: Duration::from_millis(delay_ms.max(1)),
            grpc_ca: set("OTEL_EXPORTER_OTLP_CERTIFICATE"),
        }))
    }
}

/// What the exporter did, since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Spans sent to the collector.
    pub exported: u64,
    /// Spans dropped because the queue was full (the collector slow or down).
    pub dropped: u64,
    /// Spans whose export failed (the collector refused them, was unreachable or timed out).
    pub failed: u64,
}

#[derive(Debug, Default)]
struct Counters {
    exported: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

/// The bounded queue's receiving end and what the export task sends batches with.
trait Export: Send + Sync + 'static {
    /// Sends one batch; the error is a short description without the collector's body.
    fn export(
        &self,
        batch: Vec<Box<record::Record>>,
    ) -> impl Future<Output = Result<(), String>> + Send;
}

impl Export for otlp_http::HttpExporter {
    fn export(
        &self,
        batch: Vec<Box<record::Record>>,
    ) -> impl Future<Output = Result<(), String>> + Send {
        self.send(&batch)
    }
}

/// The OpenTelemetry project's OTLP/gRPC exporter, given the SDK's span data.
struct GrpcExporter {
    exporter: opentelemetry_otlp::SpanExporter,
    scope: opentelemetry::InstrumentationScope,
}

impl Export for GrpcExporter {
    fn export(
        &self,
        batch: Vec<Box<record::Record>>,
    ) -> impl Future<Output = Result<(), String>> + Send {
        let spans = batch
            .into_iter()
            .map(|r| record::to_span_data(*r, &self.scope))
            .collect();
        let sent = self.exporter.export(spans);
        async move { sent.await.map_err(|e| e.to_string()) }
    }
}

/// Finished spans waiting for export: at most `max`; the export task is woken only when a
/// batch is full (or by its timer), not by every span.
#[derive(Debug)]
struct Queue {
    spans: std::sync::Mutex<Vec<Box<record::Record>>>,
    /// A batch is full.
    ready: tokio::sync::Notify,
    max: usize,
    batch: usize,
}

impl Queue {
    /// Adds a finished span; `false` when the queue is full (the span is dropped).
    fn push(&self, span: Box<record::Record>) -> bool {
        let Ok(mut spans) = self.spans.lock() else {
            return false;
        };
        if spans.len() >= self.max {
            return false;
        }
        spans.push(span);
        let full = spans.len() == self.batch;
        drop(spans);
        if full {
            self.ready.notify_one();
        }
        true
    }

    /// Up to `batch` of the oldest spans.
    fn take(&self) -> Vec<Box<record::Record>> {
        let Ok(mut spans) = self.spans.lock() else {
            return Vec::new();
        };
        let n = spans.len().min(self.batch);
        spans.drain(..n).collect()
    }
}

/// The export task: a batch when `batch_max` spans are waiting, and everything waiting every
/// `delay`; a flush request sends everything queued, then answers. It ends, exporting what is
/// left, when the last `Telemetry` and span are gone.
async fn export_loop<E: Export>(
    queue: Arc<Queue>,
    mut flushes: mpsc::Receiver<oneshot::Sender<()>>,
    exporter: E,
    delay: Duration,
    counters: Arc<Counters>,
) {
    let mut warned: Option<tokio::time::Instant> = None;
    let mut export = async |spans: Vec<Box<record::Record>>| {
        if spans.is_empty() {
            return;
        }
        let n = spans.len() as u64;
        let timeout = Duration::from_secs(10);
        match tokio::time::timeout(timeout, exporter.export(spans)).await {
            Ok(Ok(())) => {
                counters.exported.fetch_add(n, Ordering::Relaxed);
            }
            outcome => {
                counters.failed.fetch_add(n, Ordering::Relaxed);
                let now = tokio::time::Instant::now();
                if warned.is_none_or(|w| now.duration_since(w) >= Duration::from_secs(60)) {
                    warned = Some(now);
                    let why = match outcome {
                        Err(_) => "timed out".to_owned(),
                        Ok(Err(e)) => e,
                        Ok(Ok(())) => String::new(),
                    };
                    let s = counters_snapshot(&counters);
                    tracing::warn!(
                        target: "iop_telemetry",
                        error = %why,
                        failed = s.failed,
                        dropped = s.dropped,
                        "spans were not exported (logged at most once a minute)"
                    );
                }
            }
        }
    };
    let mut tick = tokio::time::interval(delay);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.reset();
    loop {
        tokio::select! {
            biased;
            f = flushes.recv() => {
                loop {
                    let spans = queue.take();
                    if spans.is_empty() {
                        break;
                    }
                    export(spans).await;
                }
                match f {
                    Some(done) => {
                        let _ = done.send(());
                    }
                    None => return,
                }
            }
            () = queue.ready.notified() => {
                // Only full batches: the rest waits for the timer or for more spans.
                loop {
                    let spans = queue.take();
                    let full = spans.len() == queue.batch;
                    export(spans).await;
                    if !full || queue.spans.lock().map_or(0, |s| s.len()) < queue.batch {
                        break;
                    }
                }
            }
            _ = tick.tick() => loop {
                let spans = queue.take();
                if spans.is_empty() {
                    break;
                }
                export(spans).await;
            },
        }
    }
}

fn counters_snapshot(c: &Counters) -> Stats {
    Stats {
        exported: c.exported.load(Ordering::Relaxed),
        dropped: c.dropped.load(Ordering::Relaxed),
        failed: c.failed.load(Ordering::Relaxed),
    }
}

struct Inner {
    sampler: record::Sampler,
    /// The bounded queue to the export task: never a wait.
    queue: Arc<Queue>,
    counters: Arc<Counters>,
    flush: mpsc::Sender<oneshot::Sender<()>>,
}

/// A process's tracer: cheap to clone; [`Telemetry::off`] (the default) records nothing.
#[derive(Clone, Default)]
pub struct Telemetry(Option<Arc<Inner>>);

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("on", &self.0.is_some())
            .finish_non_exhaustive()
    }
}

fn process_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

impl Telemetry {
    /// Tracing off: spans record nothing and only pass a parent's context through.
    pub fn off() -> Self {
        Self(None)
    }

    /// Starts tracing as `config` and the environment say (off when neither names a
    /// collector); `default_service` is `service.name` unless `OTEL_SERVICE_NAME` or the config
    /// names one. Spawns the export task: call it inside a tokio runtime.
    pub fn start(config: &TelemetryConfig, default_service: &str) -> Result<Self, Error> {
        let Some(r) = config.resolve(&process_env)? else {
            return Ok(Self::off());
        };
        let service = r
            .service_name
            .clone()
            .or_else(|| process_env("OTEL_SERVICE_NAME").filter(|s| !s.is_empty()))
            .unwrap_or_else(|| default_service.to_owned());
        let resource = Resource::builder().with_service_name(service).build();
        match r.protocol {
            Protocol::HttpProtobuf => {
                let exporter = otlp_http::HttpExporter::new(
                    http_client()?,
                    r.endpoint.as_deref(),
                    &process_env,
                    &resource,
                )?;
                Ok(Self::with_exporter(exporter, r))
            }
            Protocol::Grpc => {
                use opentelemetry_otlp::{WithExportConfig as _, WithTonicConfig as _};
                let mut b = opentelemetry_otlp::SpanExporter::builder().with_tonic();
                if let Some(e) = &r.endpoint {
                    b = b.with_endpoint(e.clone());
                }
                if let Some(path) = &r.grpc_ca {
                    let pem = std::fs::read(path).map_err(|_| Error::Invalid {
                        setting: "OTEL_EXPORTER_OTLP_CERTIFICATE",
                        rule: "a readable PEM file",
                    })?;
                    b = b.with_tls_config(
                        tonic::transport::ClientTlsConfig::new()
                            .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
                    );
                }
                let mut exporter = b.build().map_err(|e| Error::Exporter(e.to_string()))?;
                exporter.set_resource(&resource);
                let scope = opentelemetry::InstrumentationScope::builder(SCOPE).build();
                Ok(Self::with_exporter(GrpcExporter { exporter, scope }, r))
            }
        }
    }

    fn with_exporter<E: Export>(exporter: E, r: Resolved) -> Self {
        let counters = Arc::new(Counters::default());
        let queue = Arc::new(Queue {
            spans: std::sync::Mutex::new(Vec::with_capacity(r.batch_max)),
            ready: tokio::sync::Notify::new(),
            max: r.queue_max,
            batch: r.batch_max,
        });
        let (flush, flushes) = mpsc::channel(4);
        let sampler = r.sampler;
        tokio::spawn(export_loop(
            queue.clone(),
            flushes,
            exporter,
            r.delay,
            counters.clone(),
        ));
        Self(Some(Arc::new(Inner {
            sampler,
            queue,
            counters,
            flush,
        })))
    }

    /// Whether spans are recorded and exported.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// A span whose parent is `parent` (a remote context: the client's `traceparent`, or the
    /// previous hop's on the wire), or the root of a new trace. Off, it records nothing and
    /// passes `parent` on.
    pub fn span(
        &self,
        name: impl Into<std::borrow::Cow<'static, str>>,
        kind: SpanKind,
        parent: Option<&TraceContext>,
        attributes: Vec<KeyValue>,
    ) -> Span {
        self.span_at(name, kind, parent, attributes, None)
    }

    /// As [`Telemetry::span`], started at `start` instead of now (a wait measured before it was
    /// known to be one).
    pub fn span_at(
        &self,
        name: impl Into<std::borrow::Cow<'static, str>>,
        kind: SpanKind,
        parent: Option<&TraceContext>,
        attributes: Vec<KeyValue>,
        start: Option<SystemTime>,
    ) -> Span {
        let Some(inner) = &self.0 else {
            return Span(State::Remote(parent.cloned()));
        };
        let parent = parent.map(|p| Parent {
            trace_id: p.trace_id,
            span_id: p.span_id,
            flags: p.flags,
            state: p.state.clone(),
            remote: true,
        });
        inner.start(parent, name.into(), kind, attributes, start)
    }

    /// A child of `parent`.
    pub fn child(
        &self,
        parent: &Span,
        name: impl Into<std::borrow::Cow<'static, str>>,
        kind: SpanKind,
        attributes: Vec<KeyValue>,
    ) -> Span {
        match (&self.0, &parent.0) {
            // The parent's own record, without a round trip through the wire form.
            (Some(inner), State::On { record: p, .. }) => inner.start(
                Some(Parent {
                    trace_id: p.trace_id,
                    span_id: p.span_id,
                    flags: p.flags,
                    state: p.state.clone(),
                    remote: false,
                }),
                name.into(),
                kind,
                attributes,
                None,
            ),
            _ => self.span(name, kind, parent.context().as_ref(), attributes),
        }
    }

    /// Export counts since start (zeros when off).
    pub fn stats(&self) -> Stats {
        self.0
            .as_ref()
            .map_or_else(Stats::default, |i| counters_snapshot(&i.counters))
    }

    /// Exports every finished span now and waits for it (up to 10 s); call before exit.
    pub async fn flush(&self) {
        let Some(inner) = &self.0 else { return };
        let (tx, rx) = oneshot::channel();
        if inner.flush.send(tx).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(10), rx).await;
        }
    }
}

/// A span's starting attributes with room for four more, for the ones set as it runs (status,
/// token counts), so that setting them does not grow the list.
pub fn attributes<const N: usize>(kvs: [KeyValue; N]) -> Vec<KeyValue> {
    let mut v = Vec::with_capacity(N + 4);
    v.extend(kvs);
    v
}

/// The instrumentation scope of every span.
const SCOPE: &str = "iop-mesh";

/// A new span's parent.
struct Parent {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
    state: Option<String>,
    remote: bool,
}

impl Inner {
    fn start(
        self: &Arc<Self>,
        parent: Option<Parent>,
        name: std::borrow::Cow<'static, str>,
        kind: SpanKind,
        attributes: Vec<KeyValue>,
        start: Option<SystemTime>,
    ) -> Span {
        let (trace_id, parent_span_id, parent_flags, state, remote) = match parent {
            Some(p) => (p.trace_id, p.span_id, Some(p.flags), p.state, p.remote),
            None => (record::trace_id(), [0; 8], None, None, false),
        };
        let span_id = record::span_id();
        let sampled = self
            .sampler
            .sampled(&trace_id, parent_flags.map(|f| f & 1 == 1));
        let flags = (parent_flags.unwrap_or(0) & !1) | u8::from(sampled);
        if !sampled {
            // Not recorded, but the next hop still learns the trace and that it is not sampled.
            return Span(State::Remote(Some(TraceContext {
                trace_id,
                span_id,
                flags,
                state,
                to_provider: true,
            })));
        }
        let (attributes, dropped_attributes) = record::capped(attributes);
        let start = start.unwrap_or_else(SystemTime::now);
        Span(State::On {
            record: Box::new(record::Record {
                trace_id,
                span_id,
                parent_span_id,
                parent_remote: remote,
                flags,
                state,
                name,
                kind,
                start,
                end: start,
                attributes,
                dropped_attributes,
                events: Vec::new(),
                dropped_events: 0,
                error: None,
            }),
            tracer: self.clone(),
        })
    }
}

/// The HTTP exporter's client: our reqwest, TLS by rustls with ring and the platform's roots.
fn http_client() -> Result<reqwest::Client, Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls_platform_verifier::Verifier::new(provider.clone())
        .map_err(|e| Error::Exporter(format!("platform certificate verifier: {e}")))?;
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Exporter(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .build()
        .map_err(|e| Error::Exporter(e.to_string()))
}

enum State {
    /// Not recorded (tracing off, or not sampled): the context to pass on.
    Remote(Option<TraceContext>),
    /// Recorded: handed to the export queue when the span ends.
    On {
        record: Box<record::Record>,
        tracer: Arc<Inner>,
    },
}

/// One span; it ends when dropped. Off, it records nothing.
pub struct Span(State);

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.context() {
            Some(c) => write!(f, "Span({c:?})"),
            None => f.write_str("Span(none)"),
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let State::On { record, tracer } = std::mem::replace(&mut self.0, State::Remote(None)) {
            let mut record = record;
            record.end = SystemTime::now().max(record.start);
            if !tracer.queue.push(record) {
                tracer.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Span {
    /// A span that records nothing and has no context.
    pub fn none() -> Self {
        Self(State::Remote(None))
    }

    /// The context to send to the next hop (this span as its parent): `None` when there is no
    /// trace at all (tracing off and no client context).
    pub fn context(&self) -> Option<TraceContext> {
        match &self.0 {
            State::Remote(c) => c.clone(),
            State::On { record, .. } => Some(TraceContext {
                trace_id: record.trace_id,
                span_id: record.span_id,
                flags: record.flags,
                state: record.state.clone(),
                to_provider: true,
            }),
        }
    }

    /// The trace id as hex, for log lines (`None` without a trace).
    pub fn trace_id(&self) -> Option<String> {
        self.context().map(|c| c.trace_id_hex())
    }

    /// Whether this span is recorded (tracing on and sampled).
    pub fn is_recording(&self) -> bool {
        matches!(&self.0, State::On { .. })
    }

    /// Sets an attribute (setting a key again replaces its value).
    pub fn set(&mut self, kv: KeyValue) {
        if let State::On { record, .. } = &mut self.0 {
            record.set(kv);
        }
    }

    /// Adds an event (a stall, a fence, a cancel, a slow-consumer cut).
    pub fn event(&mut self, name: &'static str, attributes: Vec<KeyValue>) {
        if let State::On { record, .. } = &mut self.0 {
            record.event(name, attributes);
        }
    }

    /// Marks the span failed with `error.type` = `kind` (a fixed word, never a message).
    pub fn fail(&mut self, kind: &'static str) {
        if let State::On { record, .. } = &mut self.0 {
            record.set(attr::error_type(kind));
            record.error = Some(kind);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn off_without_an_endpoint_or_when_disabled() {
        let c = TelemetryConfig::default();
        assert_eq!(c.resolve(&env(&[])).unwrap(), None);
        assert_eq!(
            c.resolve(&env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_SDK_DISABLED", "true")
            ]))
            .unwrap(),
            None
        );
        assert_eq!(
            c.resolve(&env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_TRACES_EXPORTER", "none")
            ]))
            .unwrap(),
            None
        );
    }

    #[test]
    fn the_config_wins_over_the_environment() {
        let c = TelemetryConfig {
            endpoint: Some("http://a:4317".into()),
            protocol: Some(Protocol::Grpc),
            queue_max: Some(16),
            ..TelemetryConfig::default()
        };
        let r = c
            .resolve(&env(&[
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("OTEL_BSP_MAX_QUEUE_SIZE", "99"),
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ]))
            .unwrap()
            .unwrap();
        assert_eq!(r.protocol, Protocol::Grpc);
        assert_eq!(r.queue_max, 16);
        assert_eq!(r.batch_max, 16);
        assert_eq!(r.delay, Duration::from_millis(100));
        let from_env = TelemetryConfig::default()
            .resolve(&env(&[
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ]))
            .unwrap()
            .unwrap();
        assert_eq!(from_env.protocol, Protocol::Grpc);
        assert_eq!(
            from_env.endpoint, None,
            "the exporter reads it from the environment"
        );
    }

    #[test]
    fn bad_settings_are_named() {
        let e = TelemetryConfig::default()
            .resolve(&env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ]))
            .unwrap_err();
        assert!(e.to_string().contains("OTEL_EXPORTER_OTLP_PROTOCOL"), "{e}");
        let e = TelemetryConfig {
            endpoint: Some("http://c".into()),
            sample_ratio: Some(1.5),
            ..TelemetryConfig::default()
        }
        .resolve(&env(&[]))
        .unwrap_err();
        assert!(e.to_string().contains("sample_ratio"), "{e}");
    }

    #[test]
    fn off_passes_the_parents_context_through() {
        let t = Telemetry::off();
        let p = TraceContext::parse(
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            None,
        )
        .unwrap();
        let s = t.span("x", SpanKind::Server, Some(&p), Vec::new());
        let c = t.child(&s, "y", SpanKind::Client, Vec::new());
        assert_eq!(c.context(), Some(p));
        assert!(!c.is_recording());
        assert_eq!(
            t.span("z", SpanKind::Server, None, Vec::new()).context(),
            None
        );
    }
}

/// What the four spans of one request cost, recorded and exported to a collector that
/// discards (a measurement, not a test:
/// `cargo test --release -p iop-telemetry --lib -- --ignored span_speed --nocapture`).
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::print_stdout, reason = "a measurement")]
mod span_speed {
    use super::*;

    /// The binaries' allocator, so that the figure is theirs.
    #[global_allocator]
    static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

    #[derive(Debug)]
    struct Discard;

    impl Export for Discard {
        async fn export(&self, batch: Vec<Box<record::Record>>) -> Result<(), String> {
            std::hint::black_box(otlp_http::encode(&[], "", &batch));
            Ok(())
        }
    }

    /// One request's spans as the Edge and the Node make them at 100 % sampling.
    fn request(t: &Telemetry, parent: &TraceContext, node: &str, target: &str) {
        let mut server = t.span(
            "POST /v1/chat/completions",
            SpanKind::Server,
            Some(parent),
            vec![
                attr::http_method("POST"),
                attr::http_route("/v1/chat/completions"),
                attr::operation("chat"),
            ],
        );
        let mut attempt = t.child(
            &server,
            "dispatch",
            SpanKind::Client,
            vec![
                attr::operation("chat"),
                attr::attempt(1),
                attr::attempt_reason("first"),
                attr::node_id(node.to_owned()),
                attr::adapter("upstream".to_owned()),
                attr::response_model(target.to_owned()),
            ],
        );
        let wire = attempt.context().unwrap();
        let mut exec = t.span(
            "execute",
            SpanKind::Server,
            Some(&wire),
            vec![
                attr::run_id("r-1".to_owned()),
                attr::adapter("upstream".to_owned()),
                KeyValue::new("gen_ai.request.model", target.to_owned()),
            ],
        );
        let mut provider = t.child(
            &exec,
            format!("chat {target}"),
            SpanKind::Client,
            vec![
                attr::operation("chat"),
                attr::provider("openai"),
                KeyValue::new("gen_ai.request.model", target.to_owned()),
                attr::server_address("127.0.0.1"),
                attr::server_port(8080),
            ],
        );
        std::hint::black_box(provider.context());
        for s in [&mut provider, &mut exec, &mut attempt] {
            s.set(attr::input_tokens(11));
            s.set(attr::output_tokens(3));
        }
        server.set(attr::http_status(200));
        drop((provider, exec, attempt, server));
    }

    #[test]
    #[ignore = "a measurement"]
    fn span_speed() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let r = TelemetryConfig {
                endpoint: Some("http://127.0.0.1:1".into()),
                sample_ratio: Some(1.0),
                queue_max: Some(4096),
                ..TelemetryConfig::default()
            }
            .resolve(&|_| None)
            .unwrap()
            .unwrap();
            let t = Telemetry::with_exporter(Discard, r);
            let parent = TraceContext::parse(
                b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            )
            .unwrap();
            let n = 200_000;
            for _ in 0..3 {
                let start = std::time::Instant::now();
                for i in 0..n {
                    request(&t, &parent, "node-1", "fake-model");
                    if i % 16 == 15 {
                        tokio::task::yield_now().await;
                    }
                }
                t.flush().await;
                println!(
                    "per request (4 spans, recorded, queued, encoded): {:.0} ns",
                    start.elapsed().as_secs_f64() * 1e9 / f64::from(n)
                );
            }
            assert_eq!(t.stats().dropped, 0);
        });
    }
}
