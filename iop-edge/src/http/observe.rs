//! What a model request leaves behind besides its answer: its spans (the Edge's server span
//! and the dispatch attempt that served it) and the GenAI metrics, both finished when the
//! response stream ends ([`Observed`] rides on it as its [`StreamWatch`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use iop_telemetry::{Span, attr};
use iop_wire::runtime::Usage;
use iop_wire::trace::TraceContext;

use crate::metrics::{Endpoint, Metrics, ModelRequest};
use crate::transport::{StreamEnd, StreamWatch};

/// The client's W3C trace context, if it sent a valid one (an invalid one starts a new trace).
pub(super) fn client_context(headers: &HeaderMap) -> Option<TraceContext> {
    let parent = headers.get("traceparent")?;
    TraceContext::parse(
        parent.as_bytes(),
        headers
            .get("tracestate")
            .map(axum::http::HeaderValue::as_bytes),
    )
}

/// The longest model name put on a span (the client wrote it).
const MAX_MODEL_ATTR: usize = 256;

/// `model` as an attribute value: the client's text, cut at a character boundary.
pub(super) fn model_attr(model: &str) -> String {
    let mut end = model.len().min(MAX_MODEL_ATTR);
    while !model.is_char_boundary(end) {
        end -= 1;
    }
    model[..end].to_owned()
}

/// A fixed `error.type` word for a response status.
pub(super) fn status_error(status: u16) -> &'static str {
    crate::metrics::error_kind(status)
}

/// The watch every dispatched model request's stream carries: it forwards to the request's
/// own watch (the rate limiter's hold, when there is one), and when the stream is dropped
/// records the GenAI metrics and finishes the attempt and server spans with what it saw.
pub(super) struct Observed {
    pub(super) inner: Option<Box<dyn StreamWatch>>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) endpoint: Endpoint,
    /// The configured model group (a bounded label).
    pub(super) model: String,
    pub(super) started: Instant,
    /// Before `server`: fields drop in order, and the attempt ends inside the server span.
    pub(super) attempt: Span,
    pub(super) server: Span,
    first: Option<Instant>,
    usage: Option<Usage>,
    provider_us: Option<u64>,
    status: Option<u16>,
    end: Option<StreamEnd>,
}

impl Observed {
    pub(super) fn new(
        inner: Option<Box<dyn StreamWatch>>,
        metrics: Arc<Metrics>,
        endpoint: Endpoint,
        model: String,
        started: Instant,
        server: Span,
        attempt: Span,
    ) -> Self {
        Self {
            inner,
            metrics,
            endpoint,
            model,
            started,
            attempt,
            server,
            first: None,
            usage: None,
            provider_us: None,
            status: None,
            end: None,
        }
    }
}

impl StreamWatch for Observed {
    fn usage(&mut self, usage: &Usage) {
        self.usage = Some(*usage);
        if let Some(w) = self.inner.as_mut() {
            w.usage(usage);
        }
    }

    fn status(&mut self, status: u16) {
        self.status = Some(status);
        if let Some(w) = self.inner.as_mut() {
            w.status(status);
        }
    }

    fn end(&mut self, end: StreamEnd) {
        self.end = Some(end);
        if let Some(w) = self.inner.as_mut() {
            w.end(end);
        }
    }

    fn first_data(&mut self) {
        self.first.get_or_insert_with(Instant::now);
        if let Some(w) = self.inner.as_mut() {
            w.first_data();
        }
    }

    fn provider_time(&mut self, us: u64) {
        self.provider_us = Some(us);
        if let Some(w) = self.inner.as_mut() {
            w.provider_time(us);
        }
    }

    fn event(&mut self, name: &'static str) {
        self.attempt.event(name, Vec::new());
        if let Some(w) = self.inner.as_mut() {
            w.event(name);
        }
    }
}

impl Drop for Observed {
    fn drop(&mut self) {
        let duration = self.started.elapsed();
        let tokens = self
            .usage
            .as_ref()
            .map(|u| (u.prompt_tokens, u.completion_tokens));
        let provider = self.provider_us.map(Duration::from_micros);
        self.metrics.model_request(
            self.endpoint,
            &self.model,
            &ModelRequest {
                duration,
                first_content: self
                    .first
                    .map(|f| f.saturating_duration_since(self.started)),
                tokens,
                provider,
            },
        );
        if !self.server.is_recording() && !self.attempt.is_recording() {
            return;
        }
        for span in [&mut self.attempt, &mut self.server] {
            if let Some((input, output)) = tokens {
                span.set(attr::input_tokens(input));
                span.set(attr::output_tokens(output));
            }
            if let Some(status) = self.status {
                span.set(attr::http_status(status));
                if status >= 400 {
                    span.fail(status_error(status));
                }
            }
            match self.end {
                Some(StreamEnd::Failed) => span.fail("provider_error"),
                Some(StreamEnd::Cancelled) => span.fail("cancelled"),
                None => span.fail("client_cancelled"),
                Some(_) => {}
            }
        }
        if let Some(p) = provider {
            self.server.set(attr::overhead_us(
                u64::try_from(duration.saturating_sub(p).as_micros()).unwrap_or(u64::MAX),
            ));
        }
    }
}
