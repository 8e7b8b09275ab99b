//! Upstream responses into [`Event`]s (streams) or a [`Message`] (JSON bodies).
//!
//! Decoders are lenient where servers differ and the meaning is clear (a missing `role`
//! chunk, a whole tool call in one chunk, a stream without `[DONE]`, reasoning fields they do
//! not render) and strict where the bytes are not the dialect at all (an event whose data is
//! not a JSON object: [`StreamError::InvalidEvent`]).

use std::collections::HashMap;

use serde_json::Value;

use crate::sse::{SseEvent, SseParser};
use crate::{Event, FinishReason, Message, StreamError, ToolCall, Usage};

fn chat_usage(u: &Value) -> Option<Usage> {
    if !u.is_object() {
        return None;
    }
    Some(Usage {
        input_tokens: u["prompt_tokens"].as_u64(),
        output_tokens: u["completion_tokens"].as_u64(),
    })
}

fn anthropic_usage(u: &Value) -> Option<Usage> {
    if !u.is_object() {
        return None;
    }
    // Anthropic counts cached prompt tokens apart; a chat client's prompt_tokens includes them.
    let input = u["input_tokens"].as_u64().map(|n| {
        n + u["cache_creation_input_tokens"].as_u64().unwrap_or(0)
            + u["cache_read_input_tokens"].as_u64().unwrap_or(0)
    });
    Some(Usage {
        input_tokens: input,
        output_tokens: u["output_tokens"].as_u64(),
    })
}

fn error_text(v: &Value) -> String {
    let message = v
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("upstream stream failed");
    crate::error::bounded_message(message)
}

// === Chat completions ===

/// Chat completion chunks (`data: {…}` … `data: [DONE]`) into events.
#[derive(Debug, Default)]
pub struct ChatStreamDecoder {
    sse: SseParser,
    pending: Vec<SseEvent>,
    started: bool,
    done: bool,
    /// Upstream tool-call index → our ordinal.
    tools: HashMap<u64, u32>,
}

impl ChatStreamDecoder {
    /// A decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds body bytes.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<Event>) -> Result<(), StreamError> {
        let mut events = std::mem::take(&mut self.pending);
        let parsed = self.sse.feed(bytes, &mut events);
        let decoded = self.decode(&mut events, out);
        self.pending = events;
        // The events were dispatched before any framing failure: their error came first.
        decoded?;
        Ok(parsed?)
    }

    /// The body ended.
    pub fn finish(&mut self, out: &mut Vec<Event>) -> Result<(), StreamError> {
        let mut events = std::mem::take(&mut self.pending);
        self.sse.finish(&mut events)?;
        self.decode(&mut events, out)
    }

    fn decode(
        &mut self,
        events: &mut Vec<SseEvent>,
        out: &mut Vec<Event>,
    ) -> Result<(), StreamError> {
        for ev in events.drain(..) {
            if self.done {
                continue;
            }
            let data = ev.data.trim();
            if data == "[DONE]" {
                self.done = true;
                continue;
            }
            let chunk: Value =
                serde_json::from_str(data).map_err(|_| StreamError::InvalidEvent("chat chunk"))?;
            if !chunk.is_object() {
                return Err(StreamError::InvalidEvent("chat chunk"));
            }
            if chunk.get("error").is_some_and(|e| !e.is_null()) {
                out.push(Event::Error(error_text(&chunk)));
                self.done = true;
                continue;
            }
            if !self.started {
                self.started = true;
                out.push(Event::Start);
            }
            if let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) {
                self.choice(choice, out);
            }
            if let Some(u) = chat_usage(&chunk["usage"]) {
                out.push(Event::Usage(u));
            }
        }
        Ok(())
    }

    fn choice(&mut self, choice: &Value, out: &mut Vec<Event>) {
        let delta = &choice["delta"];
        if let Some(text) = delta["content"].as_str()
            && !text.is_empty()
        {
            out.push(Event::Text(text.to_owned()));
        }
        if let Some(calls) = delta["tool_calls"].as_array() {
            for (position, call) in calls.iter().enumerate() {
                let upstream = call["index"].as_u64().unwrap_or(position as u64);
                let next = u32::try_from(self.tools.len()).unwrap_or(u32::MAX);
                let index = match self.tools.get(&upstream) {
                    Some(&i) => i,
                    None => {
                        self.tools.insert(upstream, next);
                        let id = call["id"]
                            .as_str()
                            .map_or_else(|| format!("call_{next}"), str::to_owned);
                        let name = call
                            .pointer("/function/name")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_owned();
                        out.push(Event::ToolCallStart {
                            index: next,
                            id,
                            name,
                        });
                        next
                    }
                };
                if let Some(args) = call.pointer("/function/arguments").and_then(Value::as_str)
                    && !args.is_empty()
                {
                    out.push(Event::ToolCallArguments {
                        index,
                        delta: args.to_owned(),
                    });
                }
            }
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            out.push(Event::Finish(FinishReason::from_chat(reason)));
        }
    }
}

/// A non-streamed chat completion as a [`Message`].
pub fn message_from_chat(body: &Value) -> Result<Message, StreamError> {
    let choice = body["choices"]
        .as_array()
        .and_then(|c| c.first())
        .ok_or(StreamError::InvalidEvent("chat completion"))?;
    let message = &choice["message"];
    let mut out = Message {
        text: message["content"].as_str().unwrap_or_default().to_owned(),
        ..Message::default()
    };
    if let Some(calls) = message["tool_calls"].as_array() {
        for (i, c) in calls.iter().enumerate() {
            out.tool_calls.push(ToolCall {
                id: c["id"]
                    .as_str()
                    .map_or_else(|| format!("call_{i}"), str::to_owned),
                name: c
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                arguments: c
                    .pointer("/function/arguments")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            });
        }
    }
    out.finish = choice["finish_reason"]
        .as_str()
        .map(FinishReason::from_chat);
    if let Some(u) = chat_usage(&body["usage"]) {
        out.usage = u;
    }
    Ok(out)
}

// === Anthropic Messages ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    Text,
    Tool(u32),
    Other,
}

/// Anthropic message stream events (`message_start` … `message_stop`) into events.
#[derive(Debug, Default)]
pub struct MessagesStreamDecoder {
    sse: SseParser,
    pending: Vec<SseEvent>,
    /// Content block index → what it is.
    blocks: HashMap<u64, Block>,
    tools: u32,
    done: bool,
}

impl MessagesStreamDecoder {
    /// A decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds body bytes.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<Event>) -> Result<(), StreamError> {
        let mut events = std::mem::take(&mut self.pending);
        let parsed = self.sse.feed(bytes, &mut events);
        let decoded = self.decode(&mut events, out);
        self.pending = events;
        // The events were dispatched before any framing failure: their error came first.
        decoded?;
        Ok(parsed?)
    }

    /// The body ended.
    pub fn finish(&mut self, out: &mut Vec<Event>) -> Result<(), StreamError> {
        let mut events = std::mem::take(&mut self.pending);
        self.sse.finish(&mut events)?;
        self.decode(&mut events, out)
    }

    fn decode(
        &mut self,
        events: &mut Vec<SseEvent>,
        out: &mut Vec<Event>,
    ) -> Result<(), StreamError> {
        for ev in events.drain(..) {
            if self.done {
                continue;
            }
            let data: Value = serde_json::from_str(&ev.data)
                .map_err(|_| StreamError::InvalidEvent("Anthropic stream event"))?;
            let kind = data["type"]
                .as_str()
                .ok_or(StreamError::InvalidEvent("Anthropic stream event"))?;
            match kind {
                "message_start" => {
                    out.push(Event::Start);
                    if let Some(u) = anthropic_usage(&data["message"]["usage"]) {
                        out.push(Event::Usage(u));
                    }
                }
                "content_block_start" => self.block_start(&data, out),
                "content_block_delta" => self.block_delta(&data, out),
                "message_delta" => {
                    if let Some(reason) = data["delta"]["stop_reason"].as_str() {
                        let sequence = data["delta"]["stop_sequence"].as_str();
                        out.push(Event::Finish(FinishReason::from_anthropic(
                            reason, sequence,
                        )));
                    }
                    if let Some(u) = anthropic_usage(&data["usage"]) {
                        out.push(Event::Usage(u));
                    }
                }
                "message_stop" => self.done = true,
                "error" => {
                    out.push(Event::Error(error_text(&data)));
                    self.done = true;
                }
                // ping, content_block_stop and event types added later change nothing here.
                _ => {}
            }
        }
        Ok(())
    }

    fn block_start(&mut self, data: &Value, out: &mut Vec<Event>) {
        let index = data["index"].as_u64().unwrap_or(0);
        let block = &data["content_block"];
        let kind = match block["type"].as_str() {
            Some("text") => {
                if let Some(t) = block["text"].as_str()
                    && !t.is_empty()
                {
                    out.push(Event::Text(t.to_owned()));
                }
                Block::Text
            }
            Some("tool_use") => {
                let ordinal = self.tools;
                self.tools = self.tools.saturating_add(1);
                out.push(Event::ToolCallStart {
                    index: ordinal,
                    id: block["id"].as_str().unwrap_or_default().to_owned(),
                    name: block["name"].as_str().unwrap_or_default().to_owned(),
                });
                // The input normally streams as input_json_delta from `{}`; a non-empty start
                // input is the whole input.
                if let Some(input) = block["input"].as_object()
                    && !input.is_empty()
                {
                    out.push(Event::ToolCallArguments {
                        index: ordinal,
                        delta: block["input"].to_string(),
                    });
                }
                Block::Tool(ordinal)
            }
            _ => Block::Other,
        };
        self.blocks.insert(index, kind);
    }

    fn block_delta(&mut self, data: &Value, out: &mut Vec<Event>) {
        let index = data["index"].as_u64().unwrap_or(0);
        let delta = &data["delta"];
        match (self.blocks.get(&index), delta["type"].as_str()) {
            (Some(Block::Text) | None, Some("text_delta")) => {
                if let Some(t) = delta["text"].as_str()
                    && !t.is_empty()
                {
                    out.push(Event::Text(t.to_owned()));
                }
            }
            (Some(Block::Tool(ordinal)), Some("input_json_delta")) => {
                if let Some(j) = delta["partial_json"].as_str()
                    && !j.is_empty()
                {
                    out.push(Event::ToolCallArguments {
                        index: *ordinal,
                        delta: j.to_owned(),
                    });
                }
            }
            // thinking, signature and citation deltas are not rendered in the other dialects.
            _ => {}
        }
    }
}

/// A non-streamed Anthropic message as a [`Message`].
pub fn message_from_messages(body: &Value) -> Result<Message, StreamError> {
    let blocks = body["content"]
        .as_array()
        .ok_or(StreamError::InvalidEvent("Anthropic message"))?;
    let mut out = Message::default();
    for b in blocks {
        match b["type"].as_str() {
            Some("text") => out.text.push_str(b["text"].as_str().unwrap_or_default()),
            Some("tool_use") => out.tool_calls.push(ToolCall {
                id: b["id"].as_str().unwrap_or_default().to_owned(),
                name: b["name"].as_str().unwrap_or_default().to_owned(),
                arguments: if b["input"].is_null() {
                    "{}".to_owned()
                } else {
                    b["input"].to_string()
                },
            }),
            _ => {}
        }
    }
    out.finish = body["stop_reason"]
        .as_str()
        .map(|r| FinishReason::from_anthropic(r, body["stop_sequence"].as_str()));
    if let Some(u) = anthropic_usage(&body["usage"]) {
        out.usage = u;
    }
    Ok(out)
}
