//! Attribute names from the OpenTelemetry semantic conventions (GenAI, HTTP, server, error),
//! and the mesh's own (`iop.*`), as constructors so that a value's type is fixed.
//!
//! Only names, counts, ids and fixed words go in: never a key, token, lease, prompt or
//! completion text.

use opentelemetry::KeyValue;

/// `gen_ai.operation.name`: `chat`, `text_completion`, … (the route's operation).
pub fn operation(v: &'static str) -> KeyValue {
    KeyValue::new("gen_ai.operation.name", v)
}

/// `gen_ai.provider.name`: `openai`, `anthropic`, `ollama`, … (the adapter's kind).
pub fn provider(v: impl Into<String>) -> KeyValue {
    KeyValue::new("gen_ai.provider.name", v.into())
}

/// `gen_ai.request.model`: the model the client asked for.
pub fn request_model(v: impl Into<String>) -> KeyValue {
    KeyValue::new("gen_ai.request.model", v.into())
}

/// `gen_ai.response.model`: the provider's model (the target the request was sent to).
pub fn response_model(v: impl Into<String>) -> KeyValue {
    KeyValue::new("gen_ai.response.model", v.into())
}

/// `gen_ai.usage.input_tokens`.
pub fn input_tokens(v: u64) -> KeyValue {
    KeyValue::new(
        "gen_ai.usage.input_tokens",
        i64::try_from(v).unwrap_or(i64::MAX),
    )
}

/// `gen_ai.usage.output_tokens`.
pub fn output_tokens(v: u64) -> KeyValue {
    KeyValue::new(
        "gen_ai.usage.output_tokens",
        i64::try_from(v).unwrap_or(i64::MAX),
    )
}

/// `error.type`: a fixed word (`timeout`, `node_disconnected`, `response_stalled`, an HTTP
/// status class, …).
pub fn error_type(v: &'static str) -> KeyValue {
    KeyValue::new("error.type", v)
}

/// `server.address`: the host the span's request went to.
pub fn server_address(v: impl Into<String>) -> KeyValue {
    KeyValue::new("server.address", v.into())
}

/// `server.port`.
pub fn server_port(v: u16) -> KeyValue {
    KeyValue::new("server.port", i64::from(v))
}

/// `http.request.method`.
pub fn http_method(v: &'static str) -> KeyValue {
    KeyValue::new("http.request.method", v)
}

/// `http.route`: the route template (`/v1/chat/completions`).
pub fn http_route(v: &'static str) -> KeyValue {
    KeyValue::new("http.route", v)
}

/// `http.response.status_code`.
pub fn http_status(v: u16) -> KeyValue {
    KeyValue::new("http.response.status_code", i64::from(v))
}

/// `iop.node.id`: the Node a dispatch attempt went to.
pub fn node_id(v: impl Into<String>) -> KeyValue {
    KeyValue::new("iop.node.id", v.into())
}

/// `iop.adapter`: the Node's adapter instance.
pub fn adapter(v: impl Into<String>) -> KeyValue {
    KeyValue::new("iop.adapter", v.into())
}

/// `iop.attempt`: the dispatch attempt's number, from 1.
pub fn attempt(v: u32) -> KeyValue {
    KeyValue::new("iop.attempt", i64::from(v))
}

/// `iop.attempt.reason`: why this attempt exists (`first`, `fallback`, `readmit`, `rebind`).
pub fn attempt_reason(v: &'static str) -> KeyValue {
    KeyValue::new("iop.attempt.reason", v)
}

/// `iop.run_id`: the provider run id on the Edge–Node wire (Edge-assigned, not
/// caller-controlled).
pub fn run_id(v: impl Into<String>) -> KeyValue {
    KeyValue::new("iop.run_id", v.into())
}

/// `iop.principal.id` / key id: who the request was admitted for (an id, never the secret).
pub fn principal(v: impl Into<String>) -> KeyValue {
    KeyValue::new("iop.principal.id", v.into())
}

/// `iop.gateway.overhead_us`: the Edge's time minus the provider's, microseconds.
pub fn overhead_us(v: u64) -> KeyValue {
    KeyValue::new(
        "iop.gateway.overhead_us",
        i64::try_from(v).unwrap_or(i64::MAX),
    )
}
