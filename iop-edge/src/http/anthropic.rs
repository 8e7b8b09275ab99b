//! `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic Messages API).
//!
//! Messages: passed through to an upstream that serves `messages` (Anthropic itself, with the
//! `anthropic` profile's `x-api-key` and `anthropic-version` headers); otherwise translated to
//! chat completions or served by a normalized run: system, text and image blocks, `tool_use` /
//! `tool_result`, `tool_choice`, `stop_sequences` and `max_tokens` carry over, and the answer
//! comes back as a `message` object or the `message_start` … `message_stop` stream with `ping`
//! and usage (see `iop_dialect::encode::MessagesStreamEncoder`). Errors use Anthropic's shape
//! and types.
//!
//! count_tokens: passed through when the selected provider serves `count_tokens`. Otherwise the
//! Edge answers at once, without taking a provider, with `iop_dialect::request::estimate_tokens`
//! (about four bytes of text per token) and `"estimated": true` in the body.

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use iop_dialect::encode::{MessagesStreamEncoder, messages_object};
use iop_dialect::request::{estimate_tokens, messages_to_chat};
use iop_dialect::{Dialect, Encoder, Meta};
use iop_wire::runtime::Operation;
use serde_json::{Value, json};

use super::render::{self, ClientSide};
use super::{AppState, Plan, Route, authenticate, bad_request, measured, model_group, parse, plan};
use crate::metrics::Endpoint;
use crate::transport::Dispatched;

const ROUTE: Route = Route {
    dialect: Dialect::Messages,
    operation: Operation::Messages,
    run_prefix: "msg",
    id: |n| format!("msg_{n}"),
    check: |request| super::require_array(request, "messages"),
    to_chat: messages_to_chat,
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

fn client(_request: &Value, meta: Meta, stream: bool) -> ClientSide {
    let json_meta = meta.clone();
    ClientSide {
        dialect: Dialect::Messages,
        stream,
        encoder: Encoder::Messages(MessagesStreamEncoder::new(meta)),
        json: Box::new(move |m| messages_object(m, &json_meta)),
    }
}

pub(super) fn messages(
    State(state): State<AppState>,
    headers: HeaderMap,
    app_key: Option<axum::Extension<crate::limits::KeyId>>,
    body: Result<Bytes, BytesRejection>,
) -> impl Future<Output = Response> {
    super::handle(state, Endpoint::Messages, &ROUTE, headers, app_key, body)
}

pub(super) async fn count_tokens(
    State(state): State<AppState>,
    headers: HeaderMap,
    app_key: Option<axum::Extension<crate::limits::KeyId>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    measured(&state, Endpoint::CountTokens, async {
        let dialect = Dialect::Messages;
        let parsed = match parse(dialect, body) {
            Ok(p) => p,
            Err(r) => return r,
        };
        let caller = match authenticate(&state, dialect, &headers, app_key.as_deref()) {
            Ok(c) => c,
            Err(r) => return r,
        };
        if let Err(e) = super::require_array(&parsed.json, "messages") {
            return bad_request(dialect, &e);
        }
        let group = match model_group(&state, dialect, &caller, &parsed.model) {
            Ok(g) => g,
            Err(r) => return r,
        };
        let counts = state
            .catalog
            .models
            .get(&group)
            .is_some_and(|caps| caps.operations.contains(&Operation::CountTokens));
        if counts {
            let admission = match super::admit(&state, dialect, &group, &parsed.model).await {
                Ok(a) => a,
                Err(r) => return r,
            };
            let lease = admission.lease();
            let planned = plan(
                Operation::CountTokens,
                lease.kind,
                state.catalog.profile(&admission),
            );
            if planned == Plan::Passthrough(Operation::CountTokens) {
                let body = super::with_model(parsed.json.clone(), &lease.target);
                let run_id = format!("count-{}", super::next_request());
                let mut request = super::tunnel(run_id, Operation::CountTokens, &body, false);
                super::forward_anthropic_beta(&headers, &mut request);
                return match super::send(
                    &state,
                    dialect,
                    &caller,
                    &group,
                    &parsed.model,
                    admission,
                    request,
                    // count_tokens is not traced.
                    &mut iop_telemetry::Span::none(),
                )
                .await
                {
                    Ok(Dispatched::Tunnel(s)) => render::passthrough(dialect, s).await,
                    Ok(_) => {
                        render::error(dialect, StatusCode::BAD_GATEWAY, render::PROVIDER_FAILED)
                    }
                    Err(r) => r,
                };
            }
            // The selected provider does not count: release it and estimate.
            drop(admission);
        }
        match messages_to_chat(&parsed.json) {
            Ok(chat) => render::json_response(
                StatusCode::OK,
                &json!({ "input_tokens": estimate_tokens(&chat), "estimated": true }),
            ),
            Err(e) => bad_request(dialect, &e),
        }
    })
    .await
}
