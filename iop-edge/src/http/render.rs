//! Responses, in one place per dialect: errors, passthrough, translated tunnel responses and
//! normalized runs, streamed or as one JSON body. The dialect work itself is `iop_dialect`'s;
//! this module moves bytes between the Edge's streams and axum bodies. Event streams the Edge
//! renders (translated or from a native run) are served with axum's `Sse`, with keep-alive
//! comments every 15 s; a passthrough stream is the provider's own bytes, untouched.

use std::collections::BTreeSet;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseOut, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use iop_dialect::decode::{ChatStreamDecoder, MessagesStreamDecoder};
use iop_dialect::sse::SseEvent;
use iop_dialect::{Dialect, Encoder, Event, Message, StreamTranslator, Upstream};
use iop_wire::runtime::{Header, RunEvent, RunEventKind};
use iop_wire::tunnel_order::Delivery;
use serde_json::Value;

use crate::transport::{DispatchError, RunStream, TunnelEvent, TunnelStream};

/// The stable text of a provider failure (no backend detail leaves the Edge).
pub(super) const PROVIDER_FAILED: &str = "provider request failed";

/// Largest upstream error body read to translate its message.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Largest non-streamed upstream body translated (it is parsed as a whole).
pub(super) const MAX_TRANSLATED_BODY: usize = 32 * 1024 * 1024;

/// An error response in `dialect`'s shape.
pub(super) fn error(dialect: Dialect, status: StatusCode, message: &str) -> Response {
    error_with_code(dialect, status, message, None)
}

/// An error response with OpenAI's machine-readable `code` (ignored by Anthropic's shape).
pub(super) fn error_with_code(
    dialect: Dialect,
    status: StatusCode,
    message: &str,
    code: Option<&str>,
) -> Response {
    let body = iop_dialect::error::body(dialect, status.as_u16(), message, code);
    json_response(status, &body)
}

pub(super) fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// "Busy": OpenAI's 503, Anthropic's 529 `overloaded_error`.
pub(super) fn overloaded(dialect: Dialect, message: &str) -> Response {
    let status = match dialect {
        Dialect::Messages => StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(dialect, status, message)
}

/// A refused dispatch in `dialect`'s shape.
pub(super) fn dispatch_error(dialect: Dialect, e: DispatchError, model: &str) -> Response {
    match e {
        DispatchError::UnknownModel => not_found_model(dialect, model),
        DispatchError::QueueFull => error(
            dialect,
            StatusCode::TOO_MANY_REQUESTS,
            "too many queued requests",
        ),
        DispatchError::WaitTimeout | DispatchError::NotReady | DispatchError::Disconnected => {
            overloaded(dialect, "no provider available")
        }
        DispatchError::InvalidRequest => error(dialect, StatusCode::BAD_REQUEST, "invalid request"),
        DispatchError::TooLarge { max, .. } => error(
            dialect,
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!(
                "request exceeds what one Edge–Node frame carries ({max} bytes, with the \
                 request's other fields)"
            ),
        ),
        DispatchError::Stopped => overloaded(dialect, "edge is shutting down"),
        // A refusal added to the machine later: unavailable until it has its own answer.
        _ => overloaded(dialect, "no provider available"),
    }
}

/// 404 for a model this Edge (or this caller's principal) does not serve.
pub(super) fn not_found_model(dialect: Dialect, model: &str) -> Response {
    let model = iop_dialect::error::bounded_message(model);
    let shown: String = model.chars().take(128).collect();
    error_with_code(
        dialect,
        StatusCode::NOT_FOUND,
        &format!("model `{shown}` not found"),
        Some("model_not_found"),
    )
}

/// Keep-alive comments on the event streams the Edge renders: a model that thinks for a minute
/// before its first token must not look like a dead stream to the proxies in between.
const SSE_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// An encoder's event for axum's `Sse` (its data is compact JSON or `[DONE]`: one line, no CR).
fn sse_event(e: SseEvent) -> SseOut {
    // The `event:` line first, as the providers write it (axum writes fields in call order).
    let out = if e.event.is_empty() {
        SseOut::default()
    } else {
        SseOut::default().event(e.event)
    };
    out.data(e.data)
}

/// Batches of encoder events served as `text/event-stream` with axum's `Sse` (framing, the
/// `no-cache` header and keep-alive comments are axum's).
fn sse<S>(batches: S) -> Response
where
    S: futures_util::Stream<Item = Vec<SseEvent>> + Send + 'static,
{
    use futures_util::StreamExt as _;
    let events = batches.flat_map(|batch| {
        futures_util::stream::iter(
            batch
                .into_iter()
                .map(|e| Ok::<_, std::convert::Infallible>(sse_event(e))),
        )
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE))
        .into_response()
}

// === Passthrough ===

/// Waits for the tunnel's response start: `(status, headers)`, or the stream ended first.
pub(super) async fn response_start(s: &mut TunnelStream) -> Option<(u16, Vec<Header>)> {
    loop {
        match s.next().await? {
            TunnelEvent::Frame(Delivery::Start { status, headers }) => {
                return Some((status, headers));
            }
            TunnelEvent::Frame(Delivery::Usage(_)) => {}
            _ => return None,
        }
    }
}

/// Passes a tunnelled provider response through: status, headers, body bytes.
pub(super) async fn passthrough(dialect: Dialect, s: TunnelStream) -> Response {
    passthrough_with(dialect, s, None).await
}

/// [`passthrough`], with the chat stream's usage-only chunk taken out when `strip` is set (the
/// Edge asked the upstream for usage; the client did not).
pub(super) async fn passthrough_with(
    dialect: Dialect,
    mut s: TunnelStream,
    strip: Option<iop_dialect::sse::UsageChunkFilter>,
) -> Response {
    let Some((status, headers)) = response_start(&mut s).await else {
        return error(dialect, StatusCode::BAD_GATEWAY, PROVIDER_FAILED);
    };
    // Only a stream's success carries the chunk.
    let sse = headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("content-type") && h.value.starts_with(b"text/event-stream")
    });
    let ok = (200..300).contains(&status);
    let strip = strip.filter(|_| sse && ok);
    // A stream that fails after it started (the Node's stall watchdog, a fence, a slow
    // consumer cut) ends with an error event in the route's dialect, as translated streams do,
    // rather than a bare cut; `last` is the last two bytes sent, to close an event left open.
    let fail_as_event = sse && ok;
    let state = (s, strip, fail_as_event, [0u8; 2]);
    let body = futures_util::stream::unfold(
        state,
        move |(mut s, mut strip, fail_as_event, mut last)| async move {
            loop {
                match s.next().await? {
                    TunnelEvent::Frame(Delivery::Body(b)) => {
                        let b = match strip.as_mut() {
                            Some(f) => f.feed(b),
                            None => b,
                        };
                        if b.is_empty() {
                            continue;
                        }
                        match b.len() {
                            1 => last = [last[1], b[0]],
                            n => last = [b[n - 2], b[n - 1]],
                        }
                        return Some((Ok::<_, std::io::Error>(b), (s, strip, fail_as_event, last)));
                    }
                    TunnelEvent::Frame(Delivery::End { .. }) => {
                        let rest = strip
                            .as_mut()
                            .map(iop_dialect::sse::UsageChunkFilter::finish)
                            .unwrap_or_default();
                        if rest.is_empty() {
                            return None;
                        }
                        // The held tail goes out; the next call ends the body.
                        return Some((Ok(rest), (s, None, fail_as_event, last)));
                    }
                    TunnelEvent::Frame(Delivery::Usage(_)) => {}
                    // A failure after an event stream started: the dialect's error event, then
                    // the end (the next call finds the stream done).
                    _ if fail_as_event => {
                        let mut out = Vec::new();
                        if last != *b"\n\n" && last != [0, 0] {
                            out.extend_from_slice(b"\n\n");
                        }
                        out.extend_from_slice(&error_event(dialect));
                        return Some((Ok(bytes::Bytes::from(out)), (s, None, false, *b"\n\n")));
                    }
                    // A failure after a JSON body started: cut it short so the client sees it.
                    _ => {
                        return Some((
                            Err(std::io::Error::other(PROVIDER_FAILED)),
                            (s, strip, fail_as_event, last),
                        ));
                    }
                }
            }
        },
    );
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    for h in headers {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(h.name.as_bytes()),
            // The frame's own bytes, validated, not copied.
            HeaderValue::from_maybe_shared(h.value),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    response
}

/// The route's error event for a stream that failed after it started (the translated
/// streams' form: chat's `data: {"error": …}`, Responses' `response.failed`, Messages'
/// `event: error`), with the stable provider-failure text.
fn error_event(dialect: Dialect) -> Vec<u8> {
    let meta = iop_dialect::Meta {
        id: "error".into(),
        model: String::new(),
        created: 0,
    };
    let mut encoder = match dialect {
        Dialect::Chat => Encoder::Chat(iop_dialect::encode::ChatStreamEncoder::new(meta, false)),
        Dialect::Responses => Encoder::Responses(iop_dialect::encode::ResponsesStreamEncoder::new(
            meta,
            Value::Object(Default::default()),
        )),
        Dialect::Messages => {
            Encoder::Messages(iop_dialect::encode::MessagesStreamEncoder::new(meta))
        }
    };
    let mut events = Vec::new();
    encoder.event(&Event::Error(PROVIDER_FAILED.to_owned()), &mut events);
    let mut out = Vec::new();
    SseEvent::write_all(&events, &mut out);
    out
}

/// Reads the rest of a tunnel's body, at most `limit` bytes (`None` past it or on failure).
async fn collect(s: &mut TunnelStream, limit: usize) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        match s.next().await? {
            TunnelEvent::Frame(Delivery::Body(b)) => {
                if body.len() + b.len() > limit {
                    return None;
                }
                body.extend_from_slice(&b);
            }
            TunnelEvent::Frame(Delivery::Usage(_)) => {}
            TunnelEvent::Frame(Delivery::End { .. }) => return Some(body),
            _ => return None,
        }
    }
}

// === Translated tunnel responses ===

/// How the client wants its answer.
pub(super) struct ClientSide {
    pub(super) dialect: Dialect,
    pub(super) stream: bool,
    /// The stream encoder (used for streams, and for a stream made of a JSON answer).
    pub(super) encoder: Encoder,
    /// Renders a whole message as the dialect's JSON body.
    pub(super) json: Box<dyn FnOnce(&Message) -> Value + Send>,
}

/// A tunnel response in `upstream`'s dialect rendered for `client`: an upstream error status
/// becomes the client dialect's error with the same status and the upstream's message; a
/// stream is translated as it arrives; a JSON body is translated whole.
pub(super) async fn translated(
    upstream: Upstream,
    mut s: TunnelStream,
    client: ClientSide,
) -> Response {
    let dialect = client.dialect;
    let Some((status, headers)) = response_start(&mut s).await else {
        return error(dialect, StatusCode::BAD_GATEWAY, PROVIDER_FAILED);
    };
    if !(200..300).contains(&status) {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        let message = collect(&mut s, MAX_ERROR_BODY)
            .await
            .and_then(|b| iop_dialect::error::upstream_message(&b))
            .unwrap_or_else(|| {
                status
                    .canonical_reason()
                    .unwrap_or("upstream error")
                    .to_owned()
            });
        return error(dialect, status, &message);
    }
    let upstream_sse = headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("content-type") && h.value.starts_with(b"text/event-stream")
    });
    if upstream_sse && client.stream {
        return sse(stream_translated(
            s,
            StreamTranslator::new(upstream, client.encoder),
        ));
    }
    let Some(body) = collect(&mut s, MAX_TRANSLATED_BODY).await else {
        return error(dialect, StatusCode::BAD_GATEWAY, PROVIDER_FAILED);
    };
    let message = if upstream_sse {
        fold_stream(upstream, &body)
    } else {
        serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| match upstream {
                Upstream::Chat => iop_dialect::decode::message_from_chat(&v).ok(),
                Upstream::Messages => iop_dialect::decode::message_from_messages(&v).ok(),
            })
    };
    let Some(message) = message.filter(|m| m.error.is_none()) else {
        return error(dialect, StatusCode::BAD_GATEWAY, PROVIDER_FAILED);
    };
    whole(client, &message)
}

/// A whole message for the client: its JSON, or a stream of its events.
pub(super) fn whole(client: ClientSide, message: &Message) -> Response {
    if client.stream {
        let mut encoder = client.encoder;
        let mut out = Vec::new();
        for e in message.events() {
            encoder.event(&e, &mut out);
        }
        encoder.finish(&mut out);
        return sse(futures_util::stream::iter([out]));
    }
    json_response(StatusCode::OK, &(client.json)(message))
}

fn fold_stream(upstream: Upstream, body: &[u8]) -> Option<Message> {
    let mut events = Vec::new();
    let ok = match upstream {
        Upstream::Chat => {
            let mut d = ChatStreamDecoder::new();
            d.feed(body, &mut events)
                .and_then(|()| d.finish(&mut events))
        }
        Upstream::Messages => {
            let mut d = MessagesStreamDecoder::new();
            d.feed(body, &mut events)
                .and_then(|()| d.finish(&mut events))
        }
    };
    ok.ok()?;
    let mut m = Message::default();
    for e in &events {
        m.apply(e);
    }
    Some(m)
}

fn stream_translated(
    s: TunnelStream,
    t: StreamTranslator,
) -> impl futures_util::Stream<Item = Vec<SseEvent>> + Send + 'static {
    futures_util::stream::unfold((s, t), |(mut s, mut t)| async move {
        if t.is_done() {
            // Dropping `s` here cancels a tunnel the translator gave up on.
            return None;
        }
        loop {
            let mut out = Vec::new();
            match s.next().await {
                Some(TunnelEvent::Frame(Delivery::Body(b))) => t.feed(&b, &mut out),
                Some(TunnelEvent::Frame(Delivery::Usage(_) | Delivery::Start { .. })) => {}
                Some(TunnelEvent::Frame(Delivery::End { .. })) | None => t.finish(&mut out),
                Some(_) => t.fail(PROVIDER_FAILED, &mut out),
            }
            if !out.is_empty() {
                return Some((out, (s, t)));
            }
            if t.is_done() {
                return None;
            }
        }
    })
}

// === Normalized runs ===

/// A native run's events as dialect [`Event`]s: deltas as text (held back while they could be
/// a text tool call, when the request declared tools), and on `Complete` the tool calls (native
/// `openai_tool_calls` metadata, or text calls under the fallback mark; see [`crate::tools`]),
/// usage and the finish reason.
///
/// A non-streamed run keeps all its text until `Complete` (so recovered calls are cut from the
/// whole content, and what remains is trimmed as one piece).
pub(super) struct NativeEvents {
    tools: BTreeSet<String>,
    held: Option<crate::tools::HoldBack>,
    /// Non-streamed: nothing is released before `Complete`.
    whole: Option<String>,
}

impl NativeEvents {
    pub(super) fn new(tools: BTreeSet<String>, stream: bool) -> Self {
        let held = (stream && !tools.is_empty()).then(crate::tools::HoldBack::default);
        let whole = (!stream).then(String::new);
        Self { tools, held, whole }
    }

    /// The events of one run event; `true` once the run ended.
    pub(super) fn on(&mut self, ev: &RunEvent, out: &mut Vec<Event>) -> bool {
        match ev.kind {
            RunEventKind::Start => out.push(Event::Start),
            RunEventKind::Delta if self.whole.is_some() => {
                if let Some(w) = self.whole.as_mut() {
                    w.push_str(&ev.delta);
                }
            }
            RunEventKind::Delta => {
                let now = match self.held.as_mut() {
                    Some(h) => h.push(&ev.delta),
                    None => ev.delta.clone(),
                };
                if !now.is_empty() {
                    out.push(Event::Text(now));
                }
            }
            RunEventKind::Complete => {
                let pending = match (self.whole.take(), self.held.as_mut()) {
                    (Some(whole), _) => whole,
                    (None, Some(h)) => h.take(),
                    (None, None) => String::new(),
                };
                let (text, calls) = match crate::tools::finish(ev, &pending, &self.tools) {
                    Some((rest, calls)) => (rest, calls),
                    None => (pending, Value::Null),
                };
                if !text.is_empty() {
                    out.push(Event::Text(text));
                }
                let calls = calls.as_array().cloned().unwrap_or_default();
                for (i, c) in calls.iter().enumerate() {
                    let index = u32::try_from(i).unwrap_or(u32::MAX);
                    out.push(Event::ToolCallStart {
                        index,
                        id: c["id"]
                            .as_str()
                            .map_or_else(|| format!("call_{i}"), str::to_owned),
                        name: c["function"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                    });
                    let arguments = match &c["function"]["arguments"] {
                        Value::String(s) => s.clone(),
                        Value::Null => String::new(),
                        other => other.to_string(),
                    };
                    if !arguments.is_empty() {
                        out.push(Event::ToolCallArguments {
                            index,
                            delta: arguments,
                        });
                    }
                }
                if let Some(u) = ev.usage {
                    out.push(Event::Usage(iop_dialect::Usage {
                        input_tokens: Some(u.prompt_tokens),
                        output_tokens: Some(u.completion_tokens),
                    }));
                }
                out.push(Event::Finish(if calls.is_empty() {
                    iop_dialect::FinishReason::Stop
                } else {
                    iop_dialect::FinishReason::ToolCalls
                }));
                return true;
            }
            RunEventKind::Error | RunEventKind::Cancelled => {
                out.push(Event::Error(PROVIDER_FAILED.to_owned()));
                return true;
            }
        }
        false
    }
}

/// A native run rendered for `client`: streamed as it runs, or folded into one JSON body.
pub(super) async fn native(
    mut s: RunStream,
    mut events: NativeEvents,
    client: ClientSide,
) -> Response {
    if client.stream {
        let state = (s, events, client.encoder);
        let stream =
            futures_util::stream::unfold(state, |(mut s, mut events, mut enc)| async move {
                let mut batch = Vec::new();
                loop {
                    if enc.is_done() {
                        return None;
                    }
                    let mut out = Vec::new();
                    match s.next().await {
                        Some(ev) => {
                            let ended = events.on(&ev, &mut batch);
                            for e in batch.drain(..) {
                                enc.event(&e, &mut out);
                            }
                            if ended {
                                enc.finish(&mut out);
                            }
                        }
                        None => enc.event(&Event::Error(PROVIDER_FAILED.to_owned()), &mut out),
                    }
                    if !out.is_empty() {
                        return Some((out, (s, events, enc)));
                    }
                }
            });
        return sse(stream);
    }
    let mut message = Message::default();
    let mut batch = Vec::new();
    let mut ended = false;
    while let Some(ev) = s.next().await {
        ended = events.on(&ev, &mut batch);
        for e in batch.drain(..) {
            message.apply(&e);
        }
        if ended {
            break;
        }
    }
    if !ended || message.error.is_some() {
        return error(client.dialect, StatusCode::BAD_GATEWAY, PROVIDER_FAILED);
    }
    json_response(StatusCode::OK, &(client.json)(&message))
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    /// The events go out in the `text/event-stream` form `SseEvent::write_to` documents, and a
    /// quiet stream gets a keep-alive comment every 15 s (in virtual time).
    #[tokio::test(start_paused = true)]
    async fn rendered_events_are_framed_by_axum_and_kept_alive() {
        let events = vec![
            SseEvent {
                event: "message_start".into(),
                data: r#"{"type":"message_start"}"#.into(),
            },
            SseEvent {
                event: String::new(),
                data: "[DONE]".into(),
            },
        ];
        let mut expected = Vec::new();
        SseEvent::write_all(&events, &mut expected);
        let (tx, rx) = tokio::sync::mpsc::channel::<Vec<SseEvent>>(1);
        let response = sse(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (b, rx))
        }));
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/event-stream"
        );
        let mut body = response.into_body();
        tx.send(events).await.expect("open");
        let mut got = Vec::new();
        while got.len() < expected.len() {
            let frame = body.frame().await.expect("a frame").expect("ok");
            got.extend_from_slice(&frame.into_data().expect("data"));
        }
        assert_eq!(got, expected);
        // Nothing for 15 s: a comment keeps the stream alive.
        let t = tokio::time::Instant::now();
        let frame = body.frame().await.expect("a frame").expect("ok");
        assert_eq!(&frame.into_data().expect("data")[..], b":\n\n");
        assert_eq!(t.elapsed(), SSE_KEEP_ALIVE);
        drop(tx);
    }
}
