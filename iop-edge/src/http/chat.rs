//! `POST /v1/chat/completions` (OpenAI Chat Completions).
//!
//! Passed through to an upstream that serves `chat_completions`; translated to an
//! Anthropic-native upstream (`messages`); a normalized run on native providers, with tool calls
//! from native metadata or, under the seed's text fallback mark, from `<tool_call>` text (see
//! [`crate::tools`]). Streams end with `data: [DONE]`; usage is sent in its own chunk when the
//! request asks for it (`stream_options.include_usage`), as OpenAI does.

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use iop_dialect::encode::{ChatStreamEncoder, chat_completion};
use iop_dialect::{Dialect, Encoder, Meta};
use iop_wire::runtime::Operation;
use serde_json::{Value, json};

use super::render::ClientSide;
use super::{AppState, Route};
use crate::metrics::Endpoint;

const ROUTE: Route = Route {
    dialect: Dialect::Chat,
    operation: Operation::ChatCompletions,
    run_prefix: "chatcmpl",
    id: |n| format!("chatcmpl-{n}"),
    check: |request| super::require_array(request, "messages"),
    to_chat: |request| Ok(request.clone()),
    native_input,
    client,
};

/// The normalized run input: `messages`, and `tools` and `options` when present.
fn native_input(request: &Value, _chat: &Value) -> Value {
    let mut input = json!({ "messages": request["messages"].clone() });
    for key in ["tools", "options"] {
        if !request[key].is_null() {
            input[key] = request[key].clone();
        }
    }
    input
}

fn client(request: &Value, meta: Meta, stream: bool) -> ClientSide {
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let json_meta = meta.clone();
    ClientSide {
        dialect: Dialect::Chat,
        stream,
        encoder: Encoder::Chat(ChatStreamEncoder::new(meta, include_usage)),
        json: Box::new(move |m| chat_completion(m, &json_meta)),
    }
}

pub(super) fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    app_key: Option<axum::Extension<crate::limits::KeyId>>,
    body: Result<Bytes, BytesRejection>,
) -> impl Future<Output = Response> {
    super::handle(
        state,
        Endpoint::ChatCompletions,
        &ROUTE,
        headers,
        app_key,
        body,
    )
}
