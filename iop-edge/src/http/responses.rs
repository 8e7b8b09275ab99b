//! `POST /v1/responses` (OpenAI Responses API).
//!
//! Passed through to an upstream that serves `responses` (OpenAI itself); otherwise translated
//! to chat completions (or on to an Anthropic-native upstream), or served by a normalized run:
//! `input` text or items and `instructions` become messages, function tools and `tool_choice`
//! carry over, and the answer comes back as a `response` object or the `response.*` event
//! sequence with `sequence_number`s (see `iop_dialect::encode::ResponsesStreamEncoder`).
//!
//! Served statelessly: the Edge stores no responses, so `store` is answered `false` and a
//! `previous_response_id` is refused with 400 on translated routes (send the whole input
//! instead); a passthrough to OpenAI keeps OpenAI's own semantics.

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use iop_dialect::encode::{ResponsesStreamEncoder, responses_echo, responses_object};
use iop_dialect::request::responses_to_chat;
use iop_dialect::{Dialect, Encoder, Meta};
use iop_wire::runtime::Operation;
use serde_json::{Value, json};

use super::render::ClientSide;
use super::{AppState, Route};
use crate::metrics::Endpoint;

const ROUTE: Route = Route {
    dialect: Dialect::Responses,
    operation: Operation::Responses,
    run_prefix: "resp",
    id: |n| format!("resp_{n}"),
    check: |request| match &request["input"] {
        Value::String(_) | Value::Array(_) => Ok(()),
        _ => Err(iop_dialect::TranslateError::Invalid {
            field: "input".into(),
            reason: "must be text or an array of input items",
        }),
    },
    to_chat: responses_to_chat,
    native_input,
    client,
};

/// The normalized run input: the chat form's `messages` and `tools`.
fn native_input(_request: &Value, chat: &Value) -> Value {
    let mut input = json!({ "messages": chat["messages"].clone() });
    if !chat["tools"].is_null() {
        input["tools"] = chat["tools"].clone();
    }
    input
}

fn client(request: &Value, meta: Meta, stream: bool) -> ClientSide {
    let echo = responses_echo(request);
    let json_meta = meta.clone();
    let json_echo = echo.clone();
    ClientSide {
        dialect: Dialect::Responses,
        stream,
        encoder: Encoder::Responses(ResponsesStreamEncoder::new(meta, echo)),
        json: Box::new(move |m| responses_object(m, &json_meta, &json_echo)),
    }
}

pub(super) fn responses(
    State(state): State<AppState>,
    headers: HeaderMap,
    app_key: Option<axum::Extension<crate::limits::KeyId>>,
    body: Result<Bytes, BytesRejection>,
) -> impl Future<Output = Response> {
    super::handle(state, Endpoint::Responses, &ROUTE, headers, app_key, body)
}
