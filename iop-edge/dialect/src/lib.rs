//! Translation between the three HTTP dialects the IOP Edge serves: OpenAI Chat Completions,
//! the OpenAI Responses API and the Anthropic Messages API.
//!
//! Pure: JSON values and bytes in, JSON values and bytes out. No tokio, no I/O, no clock (the
//! caller passes `created` times and ids in), so every function here can be fuzzed and tested
//! byte by byte. The Edge calls it where it already renders a response, so a translated request
//! costs no extra hop; the Node uses one part of it, [`usage`], to read the token usage out of
//! the provider responses it relays.
//!
//! # Design
//!
//! Requests meet in the middle in **OpenAI Chat Completions** form, the dialect every
//! OpenAI-compatible server speaks and the one the Node's normalized runs take:
//!
//! - [`request::responses_to_chat`] and [`request::messages_to_chat`] bring a Responses or
//!   Messages request to a chat request; [`request::chat_to_messages`] takes a chat request to an
//!   Anthropic-native upstream. Responses over an Anthropic upstream is the composition of two.
//! - What cannot be represented (a hosted tool such as `web_search`, `previous_response_id`,
//!   `n > 1`, a document block) is refused with a [`TranslateError`] naming the field, never
//!   silently dropped. What has no meaning on the other side and changes no output (`store`,
//!   `top_k`, thinking blocks sent back) is dropped, as documented on each function.
//!
//! Responses meet in a small event model, [`Event`]: start, text, tool-call start, tool-call
//! argument fragment, usage, finish, error.
//!
//! - Decoders turn an upstream's bytes into events: [`decode::ChatStreamDecoder`] (chat
//!   completion chunks) and [`decode::MessagesStreamDecoder`] (Anthropic message stream events),
//!   both incremental over an [`sse::SseParser`] with a hard bound on one event's size; a
//!   non-streamed JSON body becomes a [`Message`] ([`decode::message_from_chat`],
//!   [`decode::message_from_messages`]).
//! - Encoders turn events into the client's server-sent events ([`sse::SseEvent`]: an event
//!   name and one line of JSON data): [`encode::ChatStreamEncoder`],
//!   [`encode::ResponsesStreamEncoder`] and [`encode::MessagesStreamEncoder`], with each
//!   dialect's framing: `[DONE]`, `sequence_number`s, `message_start` … `message_stop` and
//!   `ping`. The Edge serves them with axum's `Sse`; [`sse::SseEvent::write_to`] is the same
//!   `text/event-stream` form without axum. A [`Message`] renders as each dialect's JSON
//!   ([`encode::chat_completion`], [`encode::responses_object`], [`encode::messages_object`]).
//! - [`StreamTranslator`] joins one decoder and one encoder: feed it the upstream body in any
//!   chunking and it yields the client's stream; the output does not depend on where the input
//!   was split (tested at every byte boundary, and fuzzed).
//! - [`splice::passthrough`] is the request side of a passthrough (same dialect both ends): the
//!   client's own bytes with only `model` replaced (and the usage chunk asked for), declined
//!   when a name appears twice or escaped, so the upstream reads what the Edge admitted.
//! - [`usage::UsageScanner`] reads the token usage a provider reports in any of the three
//!   dialects (a JSON body's `usage`, or a stream's usage events and its own end) on the side
//!   of bytes passed through untouched: the Node runs it on every provider raw tunnel.
//! - [`error`] renders an error in a dialect's shape with the original API's status codes and
//!   types, and reads the message out of an upstream error body of either shape.
//!
//! # Choices where the APIs differ
//!
//! - Finish reasons: chat `stop` / `length` / `tool_calls` / `content_filter` ⇄ Anthropic
//!   `end_turn` (and `stop_sequence`) / `max_tokens` / `tool_use` / `refusal` ⇄ Responses
//!   `completed` or `incomplete` (`max_output_tokens`, `content_filter`).
//! - A chat request without `max_tokens` sent to an Anthropic upstream (which requires it) gets
//!   [`request::DEFAULT_MAX_TOKENS`].
//! - Streams translated to a chat upstream ask for `stream_options.include_usage`, so usage is
//!   known for the Responses and Messages events that carry it. Anthropic's `message_start`
//!   carries the input tokens only when the upstream said them up front; the final
//!   `message_delta` always carries both counts.
//! - Anthropic content blocks are strictly sequential: an upstream that interleaves the argument
//!   fragments of two tool calls (no server we know does; OpenAI, vLLM and llama.cpp send one
//!   call after the other) cannot be rendered as Messages events, and the stream ends with an
//!   `error` event saying so. Responses events name their item, so they render interleaving.
//! - `count_tokens` without an upstream that counts: [`request::estimate_tokens`], documented
//!   as an estimate.
//! - The Responses API is served statelessly (`store` is answered `false`; a
//!   `previous_response_id` is refused): the Edge keeps no conversation state.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod decode;
pub mod encode;
pub mod error;
mod event;
pub mod request;
pub mod splice;
pub mod sse;
pub mod usage;

pub use event::{Event, FinishReason, Message, Meta, ToolCall, Usage};

use decode::{ChatStreamDecoder, MessagesStreamDecoder};
use encode::{ChatStreamEncoder, MessagesStreamEncoder, ResponsesStreamEncoder};
use sse::SseEvent;

/// One of the HTTP API dialects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// OpenAI Chat Completions (`/v1/chat/completions`).
    Chat,
    /// OpenAI Responses (`/v1/responses`).
    Responses,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
}

impl Dialect {
    /// A stable lower-case name (`chat_completions`, `responses`, `messages`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chat => "chat_completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
        }
    }
}

/// Why a request could not be translated. The text is meant for the client (a 400): it names
/// the field and never echoes more than a short, bounded piece of the request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TranslateError {
    /// A field has the wrong shape.
    #[error("`{field}`: {reason}")]
    Invalid {
        /// The JSON path of the field, e.g. `input[2].content`.
        field: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A feature the target dialect cannot represent.
    #[error("`{field}`: {what} is not supported by this model's provider")]
    Unsupported {
        /// The JSON path of the field.
        field: String,
        /// The feature (a short, bounded name).
        what: String,
    },
}

impl TranslateError {
    pub(crate) fn invalid(field: impl Into<String>, reason: &'static str) -> Self {
        Self::Invalid {
            field: field.into(),
            reason,
        }
    }

    pub(crate) fn unsupported(field: impl Into<String>, what: &str) -> Self {
        Self::Unsupported {
            field: field.into(),
            what: bounded(what),
        }
    }
}

/// At most 64 bytes of caller-controlled text (cut on a character boundary), for messages.
pub(crate) fn bounded(s: &str) -> String {
    const MAX: usize = 64;
    if s.len() <= MAX {
        return s.to_owned();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Why an upstream stream could not be translated. Rendered to the client as the dialect's
/// stream error event (the stream then ends).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The SSE framing was invalid (an event over the size bound, or not UTF-8).
    #[error("upstream stream framing: {0}")]
    Sse(#[from] sse::SseError),
    /// An event's data was not the JSON the upstream dialect defines.
    #[error("upstream sent an event that is not valid {0} JSON")]
    InvalidEvent(&'static str),
    /// The upstream interleaved the argument fragments of two tool calls, which Anthropic's
    /// sequential content blocks cannot represent.
    #[error("upstream interleaved tool-call arguments, which this dialect cannot represent")]
    Interleaved,
}

/// The upstream side of a [`StreamTranslator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upstream {
    /// An OpenAI-compatible chat completions stream.
    Chat,
    /// An Anthropic Messages stream.
    Messages,
}

#[derive(Debug)]
enum Decoder {
    Chat(ChatStreamDecoder),
    Messages(MessagesStreamDecoder),
}

/// Which encoder a [`StreamTranslator`] writes with.
#[derive(Debug)]
pub enum Encoder {
    /// Chat completion chunks.
    Chat(ChatStreamEncoder),
    /// Responses API events.
    Responses(ResponsesStreamEncoder),
    /// Anthropic message stream events.
    Messages(MessagesStreamEncoder),
}

impl Encoder {
    /// Renders one event.
    pub fn event(&mut self, event: &Event, out: &mut Vec<SseEvent>) {
        match self {
            Self::Chat(e) => e.event(event, out),
            Self::Responses(e) => e.event(event, out),
            Self::Messages(e) => e.event(event, out),
        }
    }

    /// Ends the stream normally (closing blocks, final usage, the dialect's terminator).
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        match self {
            Self::Chat(e) => e.finish(out),
            Self::Responses(e) => e.finish(out),
            Self::Messages(e) => e.finish(out),
        }
    }

    /// Whether the stream already ended (after `finish` or an error event).
    pub fn is_done(&self) -> bool {
        match self {
            Self::Chat(e) => e.is_done(),
            Self::Responses(e) => e.is_done(),
            Self::Messages(e) => e.is_done(),
        }
    }
}

/// An upstream stream in one dialect rendered as a client stream in another: an incremental
/// decoder and an encoder. Output does not depend on how the input is split.
#[derive(Debug)]
pub struct StreamTranslator {
    decoder: Decoder,
    encoder: Encoder,
    events: Vec<Event>,
}

impl StreamTranslator {
    /// A translator from `upstream` bytes to `encoder`'s dialect.
    pub fn new(upstream: Upstream, encoder: Encoder) -> Self {
        let decoder = match upstream {
            Upstream::Chat => Decoder::Chat(ChatStreamDecoder::new()),
            Upstream::Messages => Decoder::Messages(MessagesStreamDecoder::new()),
        };
        Self {
            decoder,
            encoder,
            events: Vec::new(),
        }
    }

    /// Feeds upstream body bytes; appends the client events they complete to `out`. A decoding
    /// failure is rendered as the dialect's error event and ends the stream; later input is
    /// ignored.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) {
        if self.encoder.is_done() {
            return;
        }
        let result = match &mut self.decoder {
            Decoder::Chat(d) => d.feed(bytes, &mut self.events),
            Decoder::Messages(d) => d.feed(bytes, &mut self.events),
        };
        self.drain(result, out);
    }

    /// The upstream body ended normally: renders what is pending and the dialect's end.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        if self.encoder.is_done() {
            return;
        }
        let result = match &mut self.decoder {
            Decoder::Chat(d) => d.finish(&mut self.events),
            Decoder::Messages(d) => d.finish(&mut self.events),
        };
        self.drain(result, out);
        self.encoder.finish(out);
    }

    /// The upstream failed mid-stream (`message` is a stable, low-sensitivity text): renders the
    /// dialect's error event and ends the stream.
    pub fn fail(&mut self, message: &str, out: &mut Vec<SseEvent>) {
        self.encoder.event(&Event::Error(message.to_owned()), out);
    }

    /// Whether the client stream has ended.
    pub fn is_done(&self) -> bool {
        self.encoder.is_done()
    }

    fn drain(&mut self, result: Result<(), StreamError>, out: &mut Vec<SseEvent>) {
        for ev in self.events.drain(..) {
            self.encoder.event(&ev, out);
        }
        if let Err(e) = result {
            self.encoder.event(&Event::Error(e.to_string()), out);
        }
    }
}
