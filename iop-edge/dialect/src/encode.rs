//! [`Event`]s into a client's stream, and a [`Message`] into a client's JSON.
//!
//! Each stream encoder opens its stream lazily on the first event (so a decoder may or may not
//! send [`Event::Start`]), keeps what the closing events need (text for `*.done` events, usage,
//! the finish reason), and ends exactly once: [`finish`](ChatStreamEncoder::finish) for a
//! normal end, or an [`Event::Error`] for a failure. Events after the end are ignored.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use crate::sse::SseEvent;
use crate::{Event, FinishReason, Message, Meta, Usage};

/// An unnamed event whose data is `v` (compact JSON: one line, so one `data:` line).
fn data(out: &mut Vec<SseEvent>, v: &Value) {
    out.push(SseEvent {
        event: String::new(),
        data: v.to_string(),
    });
}

/// `{key: value}` plus `rest`, moving `value` in (the `json!` macro would serialize a `Value`
/// argument into a copy).
fn with(mut rest: Value, key: &str, value: Value) -> Value {
    rest[key] = value;
    rest
}

fn named(out: &mut Vec<SseEvent>, event: &str, v: &Value) {
    out.push(SseEvent {
        event: event.to_owned(),
        data: v.to_string(),
    });
}

fn chat_usage(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.input(),
        "completion_tokens": u.output(),
        "total_tokens": u.input() + u.output(),
    })
}

fn finish_of(finish: Option<&FinishReason>, tools: bool) -> FinishReason {
    match finish {
        Some(r) => r.clone(),
        None if tools => FinishReason::ToolCalls,
        None => FinishReason::Stop,
    }
}

// === Chat completions ===

/// Chat completion chunks: a first chunk with the assistant role, content and tool-call deltas,
/// a last chunk with the finish reason, a usage chunk when the client asked for one
/// (`stream_options.include_usage`), then `data: [DONE]`. A failure is a `data: {"error": …}`
/// line, and no `[DONE]` follows.
#[derive(Debug)]
pub struct ChatStreamEncoder {
    meta: Meta,
    include_usage: bool,
    started: bool,
    done: bool,
    tools: bool,
    finish: Option<FinishReason>,
    usage: Usage,
}

impl ChatStreamEncoder {
    /// An encoder; `include_usage` is the request's `stream_options.include_usage`.
    pub fn new(meta: Meta, include_usage: bool) -> Self {
        Self {
            meta,
            include_usage,
            started: false,
            done: false,
            tools: false,
            finish: None,
            usage: Usage::default(),
        }
    }

    fn chunk(&self, delta: Value, finish: Value) -> Value {
        let choice = with(
            json!({ "index": 0, "logprobs": null, "finish_reason": finish }),
            "delta",
            delta,
        );
        with(
            json!({
                "id": self.meta.id,
                "object": "chat.completion.chunk",
                "created": self.meta.created,
                "model": self.meta.model,
            }),
            "choices",
            Value::Array(vec![choice]),
        )
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if !self.started {
            self.started = true;
            let c = self.chunk(json!({ "role": "assistant", "content": "" }), Value::Null);
            data(out, &c);
        }
    }

    /// Renders one event.
    pub fn event(&mut self, event: &Event, out: &mut Vec<SseEvent>) {
        if self.done {
            return;
        }
        if let Event::Error(message) = event {
            let e = json!({ "error": { "message": message, "type": "server_error", "param": null, "code": null } });
            data(out, &e);
            self.done = true;
            return;
        }
        self.start(out);
        let delta = match event {
            Event::Start | Event::Error(_) => return,
            Event::Usage(u) => {
                self.usage.merge(*u);
                return;
            }
            Event::Finish(r) => {
                self.finish = Some(r.clone());
                return;
            }
            Event::Text(t) => json!({ "content": t }),
            Event::ToolCallStart { index, id, name } => {
                self.tools = true;
                json!({ "tool_calls": [{
                    "index": index, "id": id, "type": "function",
                    "function": { "name": name, "arguments": "" },
                }] })
            }
            Event::ToolCallArguments { index, delta } => {
                json!({ "tool_calls": [{ "index": index, "function": { "arguments": delta } }] })
            }
        };
        let c = self.chunk(delta, Value::Null);
        data(out, &c);
    }

    /// Ends the stream.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        if self.done {
            return;
        }
        self.start(out);
        let reason = finish_of(self.finish.as_ref(), self.tools);
        let c = self.chunk(json!({}), json!(reason.chat()));
        data(out, &c);
        if self.include_usage {
            let u = json!({
                "id": self.meta.id,
                "object": "chat.completion.chunk",
                "created": self.meta.created,
                "model": self.meta.model,
                "choices": [],
                "usage": chat_usage(self.usage),
            });
            data(out, &u);
        }
        out.push(SseEvent {
            event: String::new(),
            data: "[DONE]".to_owned(),
        });
        self.done = true;
    }

    /// Whether the stream ended.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

/// A [`Message`] as a `chat.completion` object.
pub fn chat_completion(message: &Message, meta: &Meta) -> Value {
    let mut msg = json!({ "role": "assistant", "content": message.text, "refusal": null });
    if !message.tool_calls.is_empty() {
        if message.text.is_empty() {
            msg["content"] = Value::Null;
        }
        let calls: Vec<Value> = message
            .tool_calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.id, "type": "function",
                    "function": { "name": c.name, "arguments": c.arguments },
                })
            })
            .collect();
        msg["tool_calls"] = Value::Array(calls);
    }
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": msg,
            "logprobs": null,
            "finish_reason": message.finish_reason().chat(),
        }],
        "usage": chat_usage(message.usage),
    })
}

// === Responses ===

/// The request fields a Responses API `response` object echoes (`instructions`, `tools`,
/// `tool_choice`, `temperature`, …), taken from the client's request.
pub fn responses_echo(request: &Value) -> Value {
    let mut echo = Map::new();
    for key in [
        "instructions",
        "max_output_tokens",
        "metadata",
        "parallel_tool_calls",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_p",
        "user",
    ] {
        if let Some(v) = request.get(key).filter(|v| !v.is_null()) {
            echo.insert(key.to_owned(), v.clone());
        }
    }
    Value::Object(echo)
}

fn responses_usage(u: Usage) -> Value {
    json!({
        "input_tokens": u.input(),
        "input_tokens_details": { "cached_tokens": 0 },
        "output_tokens": u.output(),
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": u.input() + u.output(),
    })
}

fn response_base(
    meta: &Meta,
    echo: &Value,
    status: &str,
    output: Vec<Value>,
    usage: Option<Usage>,
) -> Value {
    let pick = |key: &str, default: Value| echo.get(key).cloned().unwrap_or(default);
    // Built field by field: `json!` would serialize every `Value` argument into a copy.
    let mut r = Map::new();
    let mut put = |k: &str, v: Value| {
        r.insert(k.to_owned(), v);
    };
    put("id", Value::String(meta.id.clone()));
    put("object", Value::String("response".into()));
    put("created_at", json!(meta.created));
    put("status", Value::String(status.to_owned()));
    put("error", Value::Null);
    put("incomplete_details", Value::Null);
    put("instructions", pick("instructions", Value::Null));
    put("max_output_tokens", pick("max_output_tokens", Value::Null));
    put("metadata", pick("metadata", json!({})));
    put("model", Value::String(meta.model.clone()));
    put("output", Value::Array(output));
    put(
        "parallel_tool_calls",
        pick("parallel_tool_calls", Value::Bool(true)),
    );
    put("previous_response_id", Value::Null);
    put("reasoning", json!({ "effort": null, "summary": null }));
    put("store", Value::Bool(false));
    put("temperature", pick("temperature", json!(1.0)));
    put(
        "text",
        pick("text", json!({ "format": { "type": "text" } })),
    );
    put("tool_choice", pick("tool_choice", json!("auto")));
    put("tools", pick("tools", json!([])));
    put("top_p", pick("top_p", json!(1.0)));
    put("truncation", Value::String("disabled".into()));
    put("usage", usage.map_or(Value::Null, responses_usage));
    put("user", pick("user", Value::Null));
    Value::Object(r)
}

fn item_suffix(meta: &Meta) -> &str {
    meta.id
        .strip_prefix("resp_")
        .or_else(|| meta.id.strip_prefix("resp-"))
        .unwrap_or(&meta.id)
}

fn text_part(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [] })
}

fn message_item(id: &str, status: &str, text: Option<&str>) -> Value {
    let content = text.map_or_else(Vec::new, |t| vec![text_part(t)]);
    json!({ "id": id, "type": "message", "status": status, "role": "assistant", "content": content })
}

fn call_item(id: &str, status: &str, call_id: &str, name: &str, arguments: &str) -> Value {
    json!({
        "id": id, "type": "function_call", "status": status,
        "arguments": arguments, "call_id": call_id, "name": name,
    })
}

fn finished(response: &mut Value, finish: &FinishReason) -> &'static str {
    match finish.responses_incomplete() {
        Some(reason) => {
            response["status"] = json!("incomplete");
            response["incomplete_details"] = json!({ "reason": reason });
            "response.incomplete"
        }
        None => "response.completed",
    }
}

/// A [`Message`] as a Responses API `response` object (`echo` from [`responses_echo`]).
pub fn responses_object(message: &Message, meta: &Meta, echo: &Value) -> Value {
    let suffix = item_suffix(meta);
    let mut output = Vec::new();
    if !message.text.is_empty() || message.tool_calls.is_empty() {
        output.push(message_item(
            &format!("msg_{suffix}_0"),
            "completed",
            Some(&message.text),
        ));
    }
    for c in &message.tool_calls {
        let n = output.len();
        output.push(call_item(
            &format!("fc_{suffix}_{n}"),
            "completed",
            &c.id,
            &c.name,
            &c.arguments,
        ));
    }
    let mut r = response_base(meta, echo, "completed", output, Some(message.usage));
    finished(&mut r, &message.finish_reason());
    r
}

#[derive(Debug)]
struct OpenMessage {
    output_index: usize,
    id: String,
    text: String,
}

#[derive(Debug)]
struct OpenCall {
    output_index: usize,
    id: String,
    call_id: String,
    name: String,
    arguments: String,
}

/// Responses API events, each with its `sequence_number`: `response.created`,
/// `response.in_progress`, then per output item `response.output_item.added`, for a message
/// `response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
/// `response.content_part.done`, for a function call `response.function_call_arguments.delta`…
/// and `.done`, then `response.output_item.done`; finally `response.completed` (or
/// `response.incomplete` at the token limit) with the whole response, or `response.failed`.
///
/// A message item closes when a tool call starts (text after it opens a new message item);
/// function call items stay open until the end, so interleaved argument fragments render.
#[derive(Debug)]
pub struct ResponsesStreamEncoder {
    meta: Meta,
    echo: Value,
    sequence: u64,
    started: bool,
    done: bool,
    message: Option<OpenMessage>,
    calls: Vec<Option<OpenCall>>,
    items: Vec<Value>,
    usage: Usage,
    finish: Option<FinishReason>,
}

impl ResponsesStreamEncoder {
    /// An encoder (`echo` from [`responses_echo`]).
    pub fn new(meta: Meta, echo: Value) -> Self {
        Self {
            meta,
            echo,
            sequence: 0,
            started: false,
            done: false,
            message: None,
            calls: Vec::new(),
            items: Vec::new(),
            usage: Usage::default(),
            finish: None,
        }
    }

    fn emit(&mut self, out: &mut Vec<SseEvent>, kind: &str, mut body: Value) {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        named(out, kind, &body);
    }

    fn base(&mut self, status: &str) -> Value {
        let usage = self.usage.is_known().then_some(self.usage);
        // Called once, at the end: the items move into the final object.
        let items = std::mem::take(&mut self.items);
        response_base(&self.meta, &self.echo, status, items, usage)
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        let r = response_base(&self.meta, &self.echo, "in_progress", Vec::new(), None);
        self.emit(
            out,
            "response.created",
            with(json!({}), "response", r.clone()),
        );
        self.emit(out, "response.in_progress", with(json!({}), "response", r));
    }

    fn open_message(&mut self, out: &mut Vec<SseEvent>) {
        if self.message.is_some() {
            return;
        }
        let output_index = self.items.len();
        let id = format!("msg_{}_{output_index}", item_suffix(&self.meta));
        let item = message_item(&id, "in_progress", None);
        self.items.push(item.clone());
        self.emit(
            out,
            "response.output_item.added",
            with(json!({ "output_index": output_index }), "item", item),
        );
        self.emit(
            out,
            "response.content_part.added",
            json!({ "item_id": id, "output_index": output_index, "content_index": 0, "part": text_part("") }),
        );
        self.message = Some(OpenMessage {
            output_index,
            id,
            text: String::new(),
        });
    }

    fn close_message(&mut self, out: &mut Vec<SseEvent>) {
        let Some(m) = self.message.take() else { return };
        self.emit(
            out,
            "response.output_text.done",
            json!({ "item_id": m.id, "output_index": m.output_index, "content_index": 0, "text": m.text, "logprobs": [] }),
        );
        self.emit(
            out,
            "response.content_part.done",
            json!({ "item_id": m.id, "output_index": m.output_index, "content_index": 0, "part": text_part(&m.text) }),
        );
        let item = message_item(&m.id, "completed", Some(&m.text));
        self.items[m.output_index] = item.clone();
        self.emit(
            out,
            "response.output_item.done",
            with(json!({ "output_index": m.output_index }), "item", item),
        );
    }

    fn close_calls(&mut self, out: &mut Vec<SseEvent>) {
        let calls = std::mem::take(&mut self.calls);
        for c in calls.into_iter().flatten() {
            self.emit(
                out,
                "response.function_call_arguments.done",
                json!({ "item_id": c.id, "output_index": c.output_index, "name": c.name, "arguments": c.arguments }),
            );
            let item = call_item(&c.id, "completed", &c.call_id, &c.name, &c.arguments);
            self.items[c.output_index] = item.clone();
            self.emit(
                out,
                "response.output_item.done",
                with(json!({ "output_index": c.output_index }), "item", item),
            );
        }
    }

    /// Renders one event.
    pub fn event(&mut self, event: &Event, out: &mut Vec<SseEvent>) {
        if self.done {
            return;
        }
        self.start(out);
        match event {
            Event::Start => {}
            Event::Usage(u) => self.usage.merge(*u),
            Event::Finish(r) => self.finish = Some(r.clone()),
            Event::Text(t) => {
                self.open_message(out);
                let Some(m) = self.message.as_mut() else {
                    return;
                };
                m.text.push_str(t);
                let body = json!({ "item_id": m.id, "output_index": m.output_index, "content_index": 0, "delta": t, "logprobs": [] });
                self.emit(out, "response.output_text.delta", body);
            }
            Event::ToolCallStart { index, id, name } => {
                let i = *index as usize;
                if self.calls.get(i).is_some_and(Option::is_some) {
                    return;
                }
                self.close_message(out);
                let output_index = self.items.len();
                let item_id = format!("fc_{}_{output_index}", item_suffix(&self.meta));
                let item = call_item(&item_id, "in_progress", id, name, "");
                self.items.push(item.clone());
                self.emit(
                    out,
                    "response.output_item.added",
                    with(json!({ "output_index": output_index }), "item", item),
                );
                if self.calls.len() <= i {
                    self.calls.resize_with(i + 1, || None);
                }
                self.calls[i] = Some(OpenCall {
                    output_index,
                    id: item_id,
                    call_id: id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                });
            }
            Event::ToolCallArguments { index, delta } => {
                let Some(Some(c)) = self.calls.get_mut(*index as usize) else {
                    return;
                };
                c.arguments.push_str(delta);
                let body =
                    json!({ "item_id": c.id, "output_index": c.output_index, "delta": delta });
                self.emit(out, "response.function_call_arguments.delta", body);
            }
            Event::Error(message) => {
                let mut r = self.base("failed");
                r["error"] = json!({ "code": "server_error", "message": message });
                self.emit(out, "response.failed", with(json!({}), "response", r));
                self.done = true;
            }
        }
    }

    /// Ends the stream.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        if self.done {
            return;
        }
        self.start(out);
        self.close_message(out);
        let tools = self.calls.iter().any(Option::is_some);
        self.close_calls(out);
        let reason = finish_of(self.finish.as_ref(), tools);
        let mut r = self.base("completed");
        if r["usage"].is_null() {
            r["usage"] = responses_usage(self.usage);
        }
        let kind = finished(&mut r, &reason);
        self.emit(out, kind, with(json!({}), "response", r));
        self.done = true;
    }

    /// Whether the stream ended.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

// === Anthropic Messages ===

fn messages_usage(u: Usage) -> Value {
    json!({ "input_tokens": u.input(), "output_tokens": u.output() })
}

/// A [`Message`] as an Anthropic `message` object.
pub fn messages_object(message: &Message, meta: &Meta) -> Value {
    let mut content = Vec::new();
    if !message.text.is_empty() {
        content.push(json!({ "type": "text", "text": message.text }));
    }
    for c in &message.tool_calls {
        content.push(json!({ "type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(&c.arguments) }));
    }
    let finish = message.finish_reason();
    let sequence = match &finish {
        FinishReason::StopSequence(s) => json!(s),
        _ => Value::Null,
    };
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": finish.anthropic(),
        "stop_sequence": sequence,
        "usage": messages_usage(message.usage),
    })
}

/// A tool call's arguments as Anthropic `input` (a JSON object; arguments that are not one
/// are kept as `{"arguments": "<text>"}` rather than lost).
fn tool_input(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return json!({});
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({ "arguments": arguments }),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Open {
    Text,
    Tool(u32),
}

/// Anthropic message stream events: `message_start`, a `ping`, then per content block
/// `content_block_start`, `content_block_delta` (`text_delta` or `input_json_delta`)… and
/// `content_block_stop`, then `message_delta` (stop reason and usage) and `message_stop`. A
/// failure is an `error` event.
#[derive(Debug)]
pub struct MessagesStreamEncoder {
    meta: Meta,
    started: bool,
    done: bool,
    open: Option<(u32, Open)>,
    next_block: u32,
    /// Tool ordinal → whether its block was closed.
    tools: HashMap<u32, bool>,
    usage: Usage,
    finish: Option<FinishReason>,
}

impl MessagesStreamEncoder {
    /// An encoder.
    pub fn new(meta: Meta) -> Self {
        Self {
            meta,
            started: false,
            done: false,
            open: None,
            next_block: 0,
            tools: HashMap::new(),
            usage: Usage::default(),
            finish: None,
        }
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        let message = json!({
            "id": self.meta.id, "type": "message", "role": "assistant", "model": self.meta.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": self.usage.input(), "output_tokens": self.usage.output() },
        });
        named(
            out,
            "message_start",
            &with(json!({ "type": "message_start" }), "message", message),
        );
        named(out, "ping", &json!({ "type": "ping" }));
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if let Some((index, open)) = self.open.take() {
            if let Open::Tool(ordinal) = open {
                self.tools.insert(ordinal, true);
            }
            named(
                out,
                "content_block_stop",
                &json!({ "type": "content_block_stop", "index": index }),
            );
        }
    }

    fn open(&mut self, out: &mut Vec<SseEvent>, kind: Open, block: Value) -> u32 {
        self.close(out);
        let index = self.next_block;
        self.next_block += 1;
        self.open = Some((index, kind));
        named(
            out,
            "content_block_start",
            &with(
                json!({ "type": "content_block_start", "index": index }),
                "content_block",
                block,
            ),
        );
        index
    }

    fn fail(&mut self, out: &mut Vec<SseEvent>, message: &str) {
        let e = json!({ "type": "error", "error": { "type": "api_error", "message": message } });
        named(out, "error", &e);
        self.done = true;
    }

    /// Renders one event.
    pub fn event(&mut self, event: &Event, out: &mut Vec<SseEvent>) {
        if self.done {
            return;
        }
        match event {
            // Opening waits for the first content so that usage said up front is in it.
            Event::Start => {}
            Event::Usage(u) => self.usage.merge(*u),
            Event::Finish(r) => self.finish = Some(r.clone()),
            Event::Error(message) => self.fail(out, message),
            Event::Text(t) => {
                self.start(out);
                let index = match self.open {
                    Some((index, Open::Text)) => index,
                    _ => self.open(out, Open::Text, json!({ "type": "text", "text": "" })),
                };
                let delta = json!({ "type": "content_block_delta", "index": index, "delta": { "type": "text_delta", "text": t } });
                named(out, "content_block_delta", &delta);
            }
            Event::ToolCallStart { index, id, name } => {
                if self.tools.contains_key(index) {
                    return;
                }
                self.start(out);
                let block = json!({ "type": "tool_use", "id": id, "name": name, "input": {} });
                self.open(out, Open::Tool(*index), block);
                self.tools.insert(*index, false);
            }
            Event::ToolCallArguments { index, delta } => match (self.open, self.tools.get(index)) {
                (Some((block, Open::Tool(open))), _) if open == *index => {
                    let d = json!({ "type": "content_block_delta", "index": block, "delta": { "type": "input_json_delta", "partial_json": delta } });
                    named(out, "content_block_delta", &d);
                }
                (_, Some(true)) => {
                    let message = crate::StreamError::Interleaved.to_string();
                    self.fail(out, &message);
                }
                _ => {}
            },
        }
    }

    /// Ends the stream.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        if self.done {
            return;
        }
        self.start(out);
        self.close(out);
        let reason = finish_of(self.finish.as_ref(), !self.tools.is_empty());
        let sequence = match &reason {
            FinishReason::StopSequence(s) => json!(s),
            _ => Value::Null,
        };
        named(
            out,
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": { "stop_reason": reason.anthropic(), "stop_sequence": sequence },
                "usage": messages_usage(self.usage),
            }),
        );
        named(out, "message_stop", &json!({ "type": "message_stop" }));
        self.done = true;
    }

    /// Whether the stream ended.
    pub fn is_done(&self) -> bool {
        self.done
    }
}
