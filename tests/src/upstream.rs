//! Fake provider upstreams that need a key, for end-to-end tests with real clients: an
//! OpenAI-compatible server that serves **only** models and chat completions, and an
//! Anthropic-native server (messages, count_tokens, models). Each answers 401 in its own
//! dialect unless the request carries exactly the configured key in its own header
//! (`Authorization: Bearer` / `x-api-key` with `anthropic-version`), and records every request
//! it saw, so a test can check what reached the provider.
//!
//! Behaviour (deterministic): the answer to a user message `m` is `echo: m`; when the request
//! declares tools and the user asks about the weather (and no tool result came back yet), the
//! model calls `get_weather` with `{"city":"Paris"}`; after a tool result `r` it answers
//! `It is r in Paris.`. Streams split the answer into words, as real providers send tokens.
//! The model `slow` streams one word every 50 ms without end, `hang` (chat, Messages) one event then
//! nothing, `firehose` streams 16 KiB chunks
//! as fast as its reader takes them and `trickle` 64 KiB every 100 ms, without end; they
//! report when their client went away ([`Upstream::dropped`], [`Upstream::dropped_count`]).
//! A chat for the model `linger` is answered as the configured model's, but its stream is held
//! open after `data: [DONE]` until its client goes away.
//! A streamed chat for a model named `bulk…` gets `max_tokens` MiB of 16 KiB chunks as fast as
//! its reader takes them, then `data: [DONE]`; [`Upstream::bulk_sent`] tells how much of it
//! left so far, and a reader that goes away before the end counts as dropped.
//! On the Anthropic fake, the user message `redirect me` is answered `307` to `/v1/elsewhere`
//! (which only records a request that followed it).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::Notify;

/// One request the upstream saw.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The path.
    pub path: String,
    /// Every header, `name: value`, lower-case names.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Bytes,
}

impl Seen {
    /// The value of header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON (`Null` if it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// Which dialect the fake speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// OpenAI-compatible, `/v1/models` and `/v1/chat/completions` only.
    ChatOnly,
    /// Anthropic-native: `/v1/messages`, `/v1/messages/count_tokens`, `/v1/models`.
    Anthropic,
}

#[derive(Debug)]
struct Shared {
    kind: Kind,
    key: String,
    model: String,
    seen: Mutex<Vec<Seen>>,
    dropped: Notify,
    drops: std::sync::atomic::AtomicUsize,
    /// Bytes of each `bulk…` model's body handed to the connection so far.
    bulk: Mutex<std::collections::BTreeMap<String, u64>>,
}

/// A running fake upstream.
#[derive(Clone, Debug)]
pub struct Upstream {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl Upstream {
    /// Starts a fake of `kind` on a free loopback port, accepting `key` (any request when it
    /// is empty) and serving `model`.
    pub async fn start(kind: Kind, key: &str, model: &str) -> Self {
        let shared = Arc::new(Shared {
            kind,
            key: key.to_owned(),
            model: model.to_owned(),
            seen: Mutex::new(Vec::new()),
            dropped: Notify::new(),
            drops: std::sync::atomic::AtomicUsize::new(0),
            bulk: Mutex::default(),
        });
        let app = match kind {
            Kind::ChatOnly => Router::new()
                .route("/v1/models", get(models))
                .route("/v1/chat/completions", post(chat)),
            Kind::Anthropic => Router::new()
                .route("/v1/models", get(models))
                .route("/v1/elsewhere", post(elsewhere))
                .route("/v1/messages", post(messages))
                .route("/v1/messages/count_tokens", post(count_tokens)),
        };
        let app = app
            .fallback(|| async { (StatusCode::NOT_FOUND, "no such route on this provider") })
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { shared, addr }
    }

    /// Bytes of the `bulk…` body of `model` handed to the connection so far (0 before it
    /// started).
    pub fn bulk_sent(&self, model: &str) -> u64 {
        self.shared
            .bulk
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(model)
            .copied()
            .unwrap_or(0)
    }

    /// The base URL a Node points at (`http://127.0.0.1:<port>/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Every request seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Resolves when a `slow` or `firehose` stream's client goes away.
    pub async fn dropped(&self) {
        self.shared.dropped.notified().await;
    }

    /// How many `slow` or `firehose` streams were dropped by their client so far.
    pub fn dropped_count(&self) -> usize {
        self.shared.drops.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn record(s: &Shared, path: &str, headers: &HeaderMap, body: &Bytes) {
    let mut seen = s
        .seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if seen.len() < 10_000 {
        seen.push(Seen {
            path: path.to_owned(),
            headers: headers
                .iter()
                .map(|(n, v)| {
                    (
                        n.as_str().to_owned(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: body.clone(),
        });
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn openai_error(status: StatusCode, message: &str, code: &str) -> Response {
    json_response(
        status,
        &json!({ "error": { "message": message, "type": "invalid_request_error", "param": null, "code": code } }),
    )
}

fn anthropic_error(status: StatusCode, kind: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({ "type": "error", "error": { "type": kind, "message": message } }),
    )
}

/// Checks the key in this dialect's header; the refusal in this dialect otherwise.
#[expect(
    clippy::result_large_err,
    reason = "the error is the response, returned at once"
)]
fn authorized(s: &Shared, headers: &HeaderMap) -> Result<(), Response> {
    if s.key.is_empty() {
        return Ok(()); // a keyless provider (load tools)
    }
    let get = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    match s.kind {
        Kind::ChatOnly => {
            if get("authorization") == Some(&format!("Bearer {}", s.key)) {
                return Ok(());
            }
            Err(openai_error(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided.",
                "invalid_api_key",
            ))
        }
        Kind::Anthropic => {
            if get("x-api-key") != Some(s.key.as_str()) {
                return Err(anthropic_error(
                    StatusCode::UNAUTHORIZED,
                    "authentication_error",
                    "invalid x-api-key",
                ));
            }
            if get("anthropic-version").is_none() {
                return Err(anthropic_error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "anthropic-version header is required",
                ));
            }
            Ok(())
        }
    }
}

async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    record(&s, "/v1/models", &headers, &Bytes::new());
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    match s.kind {
        Kind::ChatOnly => json_response(
            StatusCode::OK,
            &json!({ "object": "list", "data": [{ "id": s.model, "object": "model", "created": 0, "owned_by": "fake" }] }),
        ),
        Kind::Anthropic => json_response(
            StatusCode::OK,
            &json!({ "data": [{ "type": "model", "id": s.model, "display_name": s.model, "created_at": "2025-01-01T00:00:00Z" }],
                     "has_more": false, "first_id": s.model, "last_id": s.model }),
        ),
    }
}

/// What the fake model answers.
enum Answer {
    Text(String),
    Call,
}

/// The text of a message's content in either dialect.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str().or_else(|| p["content"].as_str()))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

fn answer(messages: &[Value], has_tools: bool) -> Answer {
    // A tool result, in either dialect, ends the tool round.
    for m in messages.iter().rev() {
        if m["role"] == "tool" {
            return Answer::Text(format!("It is {} in Paris.", text_of(&m["content"])));
        }
        if let Some(blocks) = m["content"].as_array()
            && let Some(r) = blocks.iter().find(|b| b["type"] == "tool_result")
        {
            return Answer::Text(format!("It is {} in Paris.", text_of(&r["content"])));
        }
        if m["role"] == "user" {
            break;
        }
    }
    let last = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .map(|m| text_of(&m["content"]))
        .unwrap_or_default();
    if has_tools && last.to_lowercase().contains("weather") {
        return Answer::Call;
    }
    Answer::Text(format!("echo: {last}"))
}

fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, w) in text.split(' ').enumerate() {
        out.push(if i == 0 {
            w.to_owned()
        } else {
            format!(" {w}")
        });
    }
    out
}

fn prompt_tokens(body: &Value) -> u64 {
    (body["messages"].to_string().len() as u64).div_ceil(4)
}

/// A `text/event-stream` response whose body is `stream`.
fn event_stream<S>(stream: S) -> Response
where
    S: futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
{
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        "text/event-stream".parse().expect("valid"),
    );
    r
}

fn sse(chunks: Vec<String>) -> Response {
    let stream = futures_util::stream::iter(
        chunks
            .into_iter()
            .map(|c| Ok::<_, Infallible>(Bytes::from(c))),
    );
    event_stream(stream)
}

struct OnDrop(Arc<Shared>);
impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0
            .drops
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.0.dropped.notify_waiters();
    }
}

/// Streams ` w` every 50 ms until the client goes away, then notifies.
fn slow(s: Arc<Shared>, frame: fn(&str) -> String) -> Response {
    let guard = OnDrop(s);
    let stream = futures_util::stream::unfold(guard, move |g| async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Some((Ok::<_, Infallible>(Bytes::from(frame(" w"))), g))
    });
    event_stream(stream)
}

/// The whole stream, `[DONE]` included, and then the response held open until the client goes
/// away (a provider slow to end its response after its last event).
fn linger(s: Arc<Shared>, chunks: Vec<String>) -> Response {
    let guard = OnDrop(s);
    let stream =
        futures_util::stream::unfold((guard, chunks.into_iter()), |(g, mut chunks)| async move {
            match chunks.next() {
                Some(c) => Some((Ok::<_, Infallible>(Bytes::from(c)), (g, chunks))),
                None => std::future::pending().await,
            }
        });
    event_stream(stream)
}

/// One event, then nothing, the connection held open until the client goes away (a provider
/// that stalls mid-stream).
fn hang(s: Arc<Shared>, first: String) -> Response {
    let guard = OnDrop(s);
    let stream = futures_util::stream::unfold((guard, Some(first)), |(g, first)| async move {
        match first {
            Some(f) => Some((Ok::<_, Infallible>(Bytes::from(f)), (g, None))),
            None => std::future::pending().await,
        }
    });
    event_stream(stream)
}

/// Chat chunks of `size` bytes of text every `every` (or as fast as the reader takes them),
/// until it goes away.
fn firehose(s: Arc<Shared>, size: usize, every: Option<Duration>) -> Response {
    let chunk = Bytes::from(format!(
        "data: {}\n\n",
        json!({ "choices": [{ "index": 0, "delta": { "content": "x".repeat(size) } }] })
    ));
    let guard = OnDrop(s);
    let stream = futures_util::stream::unfold(guard, move |g| {
        let chunk = chunk.clone();
        async move {
            match every {
                Some(d) => tokio::time::sleep(d).await,
                None => tokio::task::yield_now().await,
            }
            Some((Ok::<_, Infallible>(chunk), g))
        }
    });
    event_stream(stream)
}

/// `mib` MiB of 16 KiB chat chunks as fast as the reader takes them, then `[DONE]`; counted
/// in `bulk` under `model`. A reader that goes away before the end counts as dropped.
fn bulk(s: Arc<Shared>, model: String, mib: u64) -> Response {
    let chunk = Bytes::from(format!(
        "data: {}\n\n",
        json!({ "choices": [{ "index": 0, "delta": { "content": "x".repeat(16 * 1024) } }] })
    ));
    let total = mib << 20;
    struct Sent {
        s: Arc<Shared>,
        model: String,
        sent: u64,
        done: bool,
    }
    impl Drop for Sent {
        fn drop(&mut self) {
            if !self.done {
                drop(OnDrop(self.s.clone()));
            }
        }
    }
    let state = Sent {
        s,
        model,
        sent: 0,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, move |mut st| {
        let chunk = chunk.clone();
        async move {
            if st.done {
                return None;
            }
            let out = if st.sent >= total {
                st.done = true;
                Bytes::from_static(b"data: [DONE]\n\n")
            } else {
                chunk
            };
            st.sent += out.len() as u64;
            st.s.bulk
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(st.model.clone(), st.sent);
            tokio::task::yield_now().await;
            Some((Ok::<_, Infallible>(out), st))
        }
    });
    event_stream(stream)
}

async fn chat(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    record(&s, "/v1/chat/completions", &headers, &body);
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return openai_error(StatusCode::BAD_REQUEST, "invalid JSON body", "invalid_json");
    };
    let model = req["model"].as_str().unwrap_or_default();
    let stream = req["stream"] == true;
    if model == "firehose" && stream {
        return firehose(s, 16 * 1024, None);
    }
    if model.starts_with("bulk") && stream {
        let mib = req["max_tokens"].as_u64().unwrap_or(1);
        return bulk(s.clone(), model.to_owned(), mib);
    }
    if model == "trickle" && stream {
        return firehose(s, 64 * 1024, Some(Duration::from_millis(100)));
    }
    if model == "slow" && stream {
        return slow(s, |w| {
            format!(
                "data: {}\n\n",
                json!({ "choices": [{ "index": 0, "delta": { "content": w } }] })
            )
        });
    }
    if model == "hang" && stream {
        return hang(
            s,
            format!(
                "data: {}\n\n",
                json!({ "choices": [{ "index": 0, "delta": { "content": "Hel" } }] })
            ),
        );
    }
    if model != s.model && model != "linger" {
        return openai_error(
            StatusCode::NOT_FOUND,
            &format!("The model `{model}` does not exist."),
            "model_not_found",
        );
    }
    let Some(messages) = req["messages"].as_array() else {
        return openai_error(
            StatusCode::BAD_REQUEST,
            "messages is required",
            "invalid_value",
        );
    };
    let has_tools = req["tools"].as_array().is_some_and(|t| !t.is_empty());
    let answer = answer(messages, has_tools);
    let prompt = prompt_tokens(&req);
    let id = "chatcmpl-fake";
    let chunk = |delta: Value, finish: Value| {
        format!(
            "data: {}\n\n",
            json!({ "id": id, "object": "chat.completion.chunk", "created": 1, "model": model,
                    "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
        )
    };
    let (message, finish, completion) = match &answer {
        Answer::Text(t) => (
            json!({ "role": "assistant", "content": t }),
            "stop",
            words(t).len() as u64,
        ),
        Answer::Call => (
            json!({ "role": "assistant", "content": null, "tool_calls": [{
                "id": "call_fake_1", "type": "function",
                "function": { "name": "get_weather", "arguments": "{\"city\":\"Paris\"}" } }] }),
            "tool_calls",
            7,
        ),
    };
    // Half the prompt "from the provider's cache", as OpenAI reports prompt caching.
    let usage = json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": { "cached_tokens": prompt / 2 } });
    if !stream {
        return json_response(
            StatusCode::OK,
            &json!({ "id": id, "object": "chat.completion", "created": 1, "model": model,
                     "choices": [{ "index": 0, "message": message, "finish_reason": finish }],
                     "usage": usage }),
        );
    }
    let mut out = vec![chunk(
        json!({ "role": "assistant", "content": "" }),
        Value::Null,
    )];
    match &answer {
        Answer::Text(t) => {
            for w in words(t) {
                out.push(chunk(json!({ "content": w }), Value::Null));
            }
        }
        Answer::Call => {
            out.push(chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "call_fake_1", "type": "function", "function": { "name": "get_weather", "arguments": "" } }] }),
                Value::Null,
            ));
            for part in ["{\"city\":", "\"Paris\"}"] {
                out.push(chunk(
                    json!({ "tool_calls": [{ "index": 0, "function": { "arguments": part } }] }),
                    Value::Null,
                ));
            }
        }
    }
    out.push(chunk(json!({}), json!(finish)));
    if req["stream_options"]["include_usage"] == true {
        out.push(format!(
            "data: {}\n\n",
            json!({ "id": id, "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage })
        ));
    }
    out.push("data: [DONE]\n\n".to_owned());
    if model == "linger" {
        return linger(s, out);
    }
    sse(out)
}

/// Where the `redirect me` answer points; only recorded.
async fn elsewhere(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    record(&s, "/v1/elsewhere", &headers, &body);
    (StatusCode::OK, "followed").into_response()
}

async fn messages(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    record(&s, "/v1/messages", &headers, &body);
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid JSON body",
        );
    };
    let model = req["model"].as_str().unwrap_or_default();
    let stream = req["stream"] == true;
    let event = |kind: &str, data: Value| format!("event: {kind}\ndata: {data}\n\n");
    if model == "hang" && stream {
        return hang(
            s,
            event(
                "message_start",
                json!({ "type": "message_start", "message": { "id": "msg_hang", "type": "message", "role": "assistant", "content": [], "model": "hang", "usage": { "input_tokens": 3, "output_tokens": 1 } } }),
            ),
        );
    }
    if model == "slow" && stream {
        return slow(s, |w| {
            format!(
                "event: content_block_delta\ndata: {}\n\n",
                json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": w } })
            )
        });
    }
    if model != s.model {
        return anthropic_error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            &format!("model: {model}"),
        );
    }
    if req["messages"][0]["content"] == "redirect me" {
        // A provider pointing elsewhere: the client must see this answer, and nothing must
        // follow it to `/v1/elsewhere` (recorded if anything does).
        return Response::builder()
            .status(StatusCode::TEMPORARY_REDIRECT)
            .header(header::LOCATION, "/v1/elsewhere")
            .body(Body::from("moved"))
            .expect("static response");
    }
    if req["max_tokens"].as_u64().is_none() {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "max_tokens: Field required",
        );
    }
    let Some(list) = req["messages"].as_array() else {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "messages: Field required",
        );
    };
    let has_tools = req["tools"].as_array().is_some_and(|t| !t.is_empty());
    let answer = answer(list, has_tools);
    let input = prompt_tokens(&req);
    let id = "msg_fake";
    let (content, stop, output) = match &answer {
        Answer::Text(t) => (
            json!([{ "type": "text", "text": t }]),
            "end_turn",
            words(t).len() as u64,
        ),
        Answer::Call => (
            json!([{ "type": "tool_use", "id": "toolu_fake_1", "name": "get_weather", "input": { "city": "Paris" } }]),
            "tool_use",
            7,
        ),
    };
    if !stream {
        return json_response(
            StatusCode::OK,
            &json!({ "id": id, "type": "message", "role": "assistant", "model": model,
                     "content": content, "stop_reason": stop, "stop_sequence": null,
                     "usage": { "input_tokens": input, "output_tokens": output } }),
        );
    }
    let mut out = vec![event(
        "message_start",
        json!({ "type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": input, "output_tokens": 1 } } }),
    )];
    match &answer {
        Answer::Text(t) => {
            out.push(event("content_block_start", json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } })));
            out.push(event("ping", json!({ "type": "ping" })));
            for w in words(t) {
                out.push(event("content_block_delta", json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": w } })));
            }
        }
        Answer::Call => {
            out.push(event("content_block_start", json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "tool_use", "id": "toolu_fake_1", "name": "get_weather", "input": {} } })));
            for part in ["{\"city\":", " \"Paris\"}"] {
                out.push(event("content_block_delta", json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "input_json_delta", "partial_json": part } })));
            }
        }
    }
    out.push(event(
        "content_block_stop",
        json!({ "type": "content_block_stop", "index": 0 }),
    ));
    out.push(event("message_delta", json!({ "type": "message_delta", "delta": { "stop_reason": stop, "stop_sequence": null }, "usage": { "output_tokens": output } })));
    out.push(event("message_stop", json!({ "type": "message_stop" })));
    sse(out)
}

async fn count_tokens(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    record(&s, "/v1/messages/count_tokens", &headers, &body);
    if let Err(r) = authorized(&s, &headers) {
        return r;
    }
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return anthropic_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid JSON body",
        );
    };
    if req["model"].as_str() != Some(s.model.as_str()) {
        return anthropic_error(StatusCode::NOT_FOUND, "not_found_error", "model not found");
    }
    json_response(
        StatusCode::OK,
        &json!({ "input_tokens": prompt_tokens(&req) }),
    )
}
