//! Errors in each dialect's shape, with the original APIs' status codes and types.
//!
//! - OpenAI (chat and Responses): `{"error": {"message", "type", "param", "code"}}`; types by
//!   status: 400/404/409/413/422 `invalid_request_error`, 401 `authentication_error`, 403
//!   `permission_error`, 429 `rate_limit_error`, 5xx `server_error`.
//! - Anthropic: `{"type": "error", "error": {"type", "message"}}`; types by status (Anthropic's
//!   published table): 400 `invalid_request_error`, 401 `authentication_error`, 403
//!   `permission_error`, 404 `not_found_error`, 413 `request_too_large`, 429
//!   `rate_limit_error`, 500 `api_error`, 529 `overloaded_error` (other 4xx are
//!   `invalid_request_error`, other 5xx `api_error`).

use serde_json::{Value, json};

use crate::Dialect;

/// Longest message carried over from an upstream error body.
pub const MAX_MESSAGE: usize = 1024;

/// The OpenAI error `type` for a status.
pub fn openai_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

/// The Anthropic error `type` for a status.
pub fn anthropic_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error body in `dialect`'s shape. `code` is OpenAI's machine-readable code
/// (`model_not_found`, `invalid_api_key`, …), omitted by Anthropic's shape.
pub fn body(dialect: Dialect, status: u16, message: &str, code: Option<&str>) -> Value {
    match dialect {
        Dialect::Chat | Dialect::Responses => json!({
            "error": { "message": message, "type": openai_type(status), "param": null, "code": code },
        }),
        Dialect::Messages => json!({
            "type": "error",
            "error": { "type": anthropic_type(status), "message": message },
        }),
    }
}

/// `message` cut to at most [`MAX_MESSAGE`] bytes on a character boundary.
pub fn bounded_message(message: &str) -> String {
    if message.len() <= MAX_MESSAGE {
        return message.to_owned();
    }
    let mut end = MAX_MESSAGE;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message[..end].to_owned()
}

/// The message of an upstream error body in either shape (`error.message`, or `message`, or
/// a plain-text body), bounded; `None` when there is nothing readable.
pub fn upstream_message(body: &[u8]) -> Option<String> {
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        let message = v
            .pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error").filter(|e| e.is_string()))
            .and_then(Value::as_str)?;
        return Some(bounded_message(message));
    }
    let text = std::str::from_utf8(body).ok()?.trim();
    (!text.is_empty()).then(|| bounded_message(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_types() {
        let e = body(Dialect::Messages, 404, "model `x` not found", None);
        assert_eq!(
            e,
            json!({ "type": "error", "error": { "type": "not_found_error", "message": "model `x` not found" } })
        );
        let e = body(
            Dialect::Chat,
            401,
            "invalid api key",
            Some("invalid_api_key"),
        );
        assert_eq!(e["error"]["type"], "authentication_error");
        assert_eq!(e["error"]["code"], "invalid_api_key");
        assert_eq!(anthropic_type(529), "overloaded_error");
        assert_eq!(anthropic_type(413), "request_too_large");
        assert_eq!(anthropic_type(418), "invalid_request_error");
        assert_eq!(anthropic_type(503), "api_error");
        assert_eq!(openai_type(503), "server_error");
    }

    #[test]
    fn upstream_messages_of_both_shapes_bounded() {
        assert_eq!(
            upstream_message(br#"{"error":{"message":"bad","type":"x"}}"#).as_deref(),
            Some("bad")
        );
        assert_eq!(
            upstream_message(br#"{"type":"error","error":{"type":"x","message":"worse"}}"#)
                .as_deref(),
            Some("worse")
        );
        assert_eq!(
            upstream_message(b"plain text\n").as_deref(),
            Some("plain text")
        );
        assert_eq!(upstream_message(b"{}"), None);
        let long = format!(
            "{{\"error\":{{\"message\":\"{}\"}}}}",
            "é".repeat(MAX_MESSAGE)
        );
        let m = upstream_message(long.as_bytes()).unwrap();
        assert!(m.len() <= MAX_MESSAGE && m.len() > MAX_MESSAGE - 2);
    }
}
