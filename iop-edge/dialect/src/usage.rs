//! The token usage a provider reports in its own response, read on the side of bytes that are
//! passed through untouched: the Node's provider raw tunnel feeds each chunk of the upstream
//! body to a [`UsageScanner`] and sends what it finds to the Edge as USAGE frames.
//!
//! Pure and bounded: a JSON body is read only up to [`MAX_BODY_SCAN`], an SSE line only up to
//! [`MAX_SSE_LINE`] (a longer one is dropped whole, and the next one is read). How the body is
//! cut into chunks does not change the figures handed out last, nor whether they were handed
//! out at a stream's own end or only when the body ended; it can change how many times figures
//! are handed out on the way (a stream that reports usage again after its end). Fuzzed
//! (`fuzz/fuzz_targets/usage_scan.rs`).

/// Largest non-streamed (JSON) body buffered, besides being passed through, to read its usage;
/// a longer body's usage is not read.
pub const MAX_BODY_SCAN: usize = 1024 * 1024;
/// Longest SSE line read for usage; a longer line is dropped whole.
pub const MAX_SSE_LINE: usize = 256 * 1024;
/// A line buffer up to this capacity is kept for the stream's next split line; a larger one
/// (a long line) is given back.
const KEEP_LINE_BUFFER: usize = 4096;

/// A response's token counts, as its provider reported them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenUsage {
    /// Input (prompt) tokens, cached ones included.
    pub prompt_tokens: u64,
    /// Output (completion) tokens.
    pub completion_tokens: u64,
    /// `prompt_tokens + completion_tokens` (saturating).
    pub total_tokens: u64,
    /// Of `prompt_tokens`, those read from the provider's prompt cache (at most
    /// `prompt_tokens`).
    pub cached_prompt_tokens: u64,
}

/// Finds the usage in an SSE stream's `data:` lines or a JSON body, without touching the bytes
/// that are passed through. Each dialect reports it its own way, and all are read:
///
/// - OpenAI chat: a top-level `usage` with `prompt_tokens` and `completion_tokens` (in a
///   stream, the last chunk when the request asked for `stream_options.include_usage`);
/// - OpenAI Responses: `usage` with `input_tokens` and `output_tokens`, top-level in a body,
///   under `response` in a stream's `response.completed` event;
/// - Anthropic Messages: `usage` with `input_tokens` and `output_tokens` in a body; in a
///   stream the input count comes under `message` in `message_start` and the (cumulative)
///   output count in each `message_delta`'s top-level `usage`.
///
/// Cached input (prompt caching) is read too, as tokens *included* in the input count:
/// OpenAI's `prompt_tokens_details.cached_tokens` (chat) and `input_tokens_details.cached_tokens`
/// (Responses); Anthropic counts cache reads and writes apart from `input_tokens`, so there the
/// input is `input_tokens + cache_read_input_tokens + cache_creation_input_tokens` and the
/// cached part `cache_read_input_tokens`.
///
/// A later report of a count replaces an earlier one, so a stream's last figures win. A stream's
/// figures are handed out once its own end has been fed ([`UsageScanner::update`]), a JSON
/// body's at the end ([`UsageScanner::finish`]), which gives only what was not handed out yet.
#[derive(Debug)]
pub struct UsageScanner {
    sse: bool,
    /// Longest SSE line read ([`MAX_SSE_LINE`] unless set).
    max_line: usize,
    /// Largest JSON body read ([`MAX_BODY_SCAN`] unless set).
    max_body: usize,
    buf: Vec<u8>,
    overflow: bool,
    input: Option<u64>,
    output: Option<u64>,
    cached: Option<u64>,
    /// The counts last handed out by [`UsageScanner::update`] (or `finish`).
    reported: Option<TokenUsage>,
    /// The stream's own end was seen (`data: [DONE]`, Anthropic's `message_stop`, the
    /// Responses API's `response.completed` / `.incomplete` / `.failed`): its figures are final.
    ended: bool,
}

impl UsageScanner {
    /// A scanner for one response body: `sse` when its content type is `text/event-stream`
    /// (read line by line as it comes), otherwise a JSON body (read whole at the end).
    pub fn new(sse: bool) -> Self {
        Self::with_bounds(sse, MAX_SSE_LINE, MAX_BODY_SCAN)
    }

    /// [`Self::new`] with other bounds: the longest SSE line and the largest JSON body read
    /// (the fuzz target uses small ones, so that its short inputs reach them).
    pub fn with_bounds(sse: bool, max_line: usize, max_body: usize) -> Self {
        Self {
            sse,
            max_line,
            max_body,
            buf: Vec::new(),
            overflow: false,
            input: None,
            output: None,
            cached: None,
            reported: None,
            ended: false,
        }
    }

    /// A stream's final usage, once the stream's own end has been fed (and not yet handed
    /// out): it goes ahead of the bytes that carry that end. A client may go away as soon as it
    /// has read `data: [DONE]` (or `message_stop`), before the provider ends its response and
    /// [`Self::finish`] would run, and the Edge charges, meters and records what it was told
    /// by then. Figures seen before the end are not handed out early: they can be partial
    /// (Anthropic's `message_start` counts one output token), and a client that leaves
    /// mid-stream keeps its whole token reservation, as the provider bills what it generated.
    pub fn update(&mut self) -> Option<TokenUsage> {
        if !self.ended {
            return None;
        }
        let now = self.current()?;
        if self.reported == Some(now) {
            return None;
        }
        self.reported = Some(now);
        Some(now)
    }

    /// The body's next chunk, cut anywhere.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.sse {
            if self.buf.len() + chunk.len() > self.max_body {
                self.overflow = true;
                self.buf = Vec::new();
            } else if !self.overflow {
                self.buf.extend_from_slice(chunk);
            }
            return;
        }
        // Line by line with memchr (a byte-at-a-time loop here was a fifth of the Node's CPU
        // on a bulk stream). A line whole in this chunk is read where it lies; only a line
        // split across chunks is copied, into a buffer kept for the next one (a fresh buffer
        // per line was an allocation per SSE line).
        let mut rest = chunk;
        while let Some(i) = memchr::memchr(b'\n', rest) {
            let piece = &rest[..i];
            if self.buf.is_empty() && !self.overflow {
                if piece.len() <= self.max_line {
                    self.line(piece);
                }
            } else {
                self.append(piece);
                if !self.overflow {
                    let mut line = std::mem::take(&mut self.buf);
                    self.line(&line);
                    if line.capacity() <= KEEP_LINE_BUFFER {
                        line.clear();
                        self.buf = line;
                    }
                }
            }
            self.overflow = false;
            rest = &rest[i + 1..];
        }
        self.append(rest);
    }

    /// Adds a piece of the current line; a line longer than the bound is dropped whole.
    fn append(&mut self, piece: &[u8]) {
        if self.overflow {
            return;
        }
        if self.buf.len() + piece.len() > self.max_line {
            self.overflow = true;
            self.buf = Vec::new();
        } else {
            self.buf.extend_from_slice(piece);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(data) = line.strip_prefix(b"data:") {
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                self.ended = true;
            } else {
                self.json(data);
            }
        } else if let Some(name) = line.strip_prefix(b"event:") {
            self.ended |= is_final_event(name.trim_ascii());
        }
    }

    fn json(&mut self, json: &[u8]) {
        if let Some(u) = usage_of(json) {
            self.ended |= u.ends;
            self.input = u.input.or(self.input);
            self.output = u.output.or(self.output);
            self.cached = u.cached.or(self.cached);
        }
    }

    /// The body has ended: its usage, if any was found and not handed out by
    /// [`Self::update`] already (a JSON body's usage comes only here).
    pub fn finish(mut self) -> Option<TokenUsage> {
        if self.sse {
            let rest = std::mem::take(&mut self.buf);
            if !self.overflow {
                self.line(&rest);
            }
        } else if !self.overflow {
            let body = std::mem::take(&mut self.buf);
            self.json(&body);
        }
        let now = self.current()?;
        // Already reported by `update`: nothing new to send.
        (self.reported != Some(now)).then_some(now)
    }

    /// The bytes this scanner holds for the body: at most twice its bound on a JSON body
    /// ([`MAX_BODY_SCAN`]) or on an SSE line ([`MAX_SSE_LINE`], for a line split across
    /// chunks), whatever the provider sends.
    pub fn held(&self) -> usize {
        self.buf.capacity()
    }

    /// The counts seen so far, if any.
    fn current(&self) -> Option<TokenUsage> {
        if self.input.is_none() && self.output.is_none() {
            return None;
        }
        let prompt = self.input.unwrap_or(0);
        let completion = self.output.unwrap_or(0);
        let cached = self.cached.unwrap_or(0).min(prompt);
        Some(TokenUsage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
            cached_prompt_tokens: cached,
        })
    }
}

/// The `type` and `usage` of a JSON object (the usage top-level, or under `message` or
/// `response`), read in one pass without building the rest of the document (every other member
/// is skipped, not materialised: on a 1 KiB completion this was most of the Node's JSON cost).
#[derive(serde::Deserialize)]
struct WithUsage<'a> {
    /// The event's `type`: Anthropic's `message_stop` (no usage) and the Responses API's
    /// `response.completed` (with it) end their streams.
    #[serde(default, rename = "type", borrow)]
    kind: Option<std::borrow::Cow<'a, str>>,
    /// Any JSON value, so that an odd `usage` (not an object) loses only itself, not the
    /// event's `type`.
    #[serde(default)]
    usage: Option<serde_json::Value>,
    #[serde(default)]
    message: Option<Nested>,
    #[serde(default)]
    response: Option<Nested>,
}

#[derive(serde::Deserialize)]
struct Nested {
    #[serde(default)]
    usage: Option<serde_json::Value>,
}

/// An event's `type` alone, for a document [`WithUsage`] cannot read (a member of another
/// shape, a name twice): it still says whether the event ends its stream.
#[derive(serde::Deserialize)]
struct Typed<'a> {
    #[serde(default, rename = "type", borrow)]
    kind: Option<std::borrow::Cow<'a, str>>,
}

/// `value` if it is a JSON object.
fn object(value: Option<serde_json::Value>) -> Option<serde_json::Map<String, serde_json::Value>> {
    match value {
        Some(serde_json::Value::Object(map)) => Some(map),
        _ => None,
    }
}

/// Whether an event's `type` ends its stream.
fn ends_stream(kind: Option<&str>) -> bool {
    kind.is_some_and(|k| is_final_event(k.as_bytes()))
}

/// Whether an SSE event name (or an event's `type`) ends its stream.
fn is_final_event(name: &[u8]) -> bool {
    matches!(
        name,
        b"message_stop" | b"response.completed" | b"response.incomplete" | b"response.failed"
    )
}

/// What one JSON document reports: whether it ends its stream, and each count if present.
struct Counts {
    /// The document is an event that ends its stream (its `type`).
    ends: bool,
    input: Option<u64>,
    output: Option<u64>,
    cached: Option<u64>,
}

impl Counts {
    /// A document whose counts are absent or unread: worth reporting only if it ends its
    /// stream.
    fn end_only(ends: bool) -> Option<Self> {
        ends.then_some(Self {
            ends,
            input: None,
            output: None,
            cached: None,
        })
    }
}

/// What one JSON document reports (see [`UsageScanner`] for the dialects): `None` when it
/// neither carries counts nor ends its stream.
fn usage_of(json: &[u8]) -> Option<Counts> {
    // Most stream chunks carry no usage and are no stream's end: no parse for them. (An end
    // without usage is Anthropic's `message_stop`; the Responses API's ends carry usage.)
    if memchr::memmem::find(json, b"\"usage\"").is_none()
        && memchr::memmem::find(json, b"message_stop").is_none()
    {
        return None;
    }
    let Ok(doc) = serde_json::from_slice::<WithUsage<'_>>(json) else {
        // Odd elsewhere: its counts are not read, but it may still end its stream (one more
        // parse, only for such documents).
        let ends =
            serde_json::from_slice::<Typed<'_>>(json).is_ok_and(|t| ends_stream(t.kind.as_deref()));
        return Counts::end_only(ends);
    };
    let ends = ends_stream(doc.kind.as_deref());
    let Some(u) = object(doc.usage)
        .or_else(|| doc.response.and_then(|r| object(r.usage)))
        .or_else(|| doc.message.and_then(|m| object(m.usage)))
    else {
        return Counts::end_only(ends);
    };
    let n = |k: &str| u.get(k).and_then(serde_json::Value::as_u64);
    let detail = |k: &str| {
        u.get(k)
            .and_then(|d| d.get("cached_tokens"))
            .and_then(serde_json::Value::as_u64)
    };
    // OpenAI chat names, then Responses and Anthropic names.
    let mut input = n("prompt_tokens").or_else(|| n("input_tokens"));
    let output = n("completion_tokens").or_else(|| n("output_tokens"));
    let mut cached = detail("prompt_tokens_details").or_else(|| detail("input_tokens_details"));
    // Anthropic: cache reads and writes are counted apart from `input_tokens`.
    let (read, written) = (
        n("cache_read_input_tokens"),
        n("cache_creation_input_tokens"),
    );
    if read.is_some() || written.is_some() {
        input = Some(
            input
                .unwrap_or(0)
                .saturating_add(read.unwrap_or(0))
                .saturating_add(written.unwrap_or(0)),
        );
        cached = read.or(cached);
    }
    (ends || input.is_some() || output.is_some()).then_some(Counts {
        ends,
        input,
        output,
        cached,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_input_is_read_in_every_dialect() {
        let read = |json: &str| {
            let mut s = UsageScanner::new(false);
            s.feed(json.as_bytes());
            s.finish().unwrap()
        };
        let chat = read(
            r#"{"usage":{"prompt_tokens":100,"completion_tokens":5,"total_tokens":105,"prompt_tokens_details":{"cached_tokens":80}}}"#,
        );
        assert_eq!((chat.prompt_tokens, chat.cached_prompt_tokens), (100, 80));
        let responses = read(
            r#"{"usage":{"input_tokens":50,"output_tokens":5,"input_tokens_details":{"cached_tokens":40}}}"#,
        );
        assert_eq!(
            (responses.prompt_tokens, responses.cached_prompt_tokens),
            (50, 40)
        );
        // Anthropic: reads and writes apart from input_tokens.
        let messages = read(
            r#"{"usage":{"input_tokens":10,"cache_read_input_tokens":70,"cache_creation_input_tokens":20,"output_tokens":5}}"#,
        );
        assert_eq!(
            (messages.prompt_tokens, messages.cached_prompt_tokens),
            (100, 70)
        );
        // A cached count larger than the prompt is capped at it.
        let odd = read(
            r#"{"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":9}}}"#,
        );
        assert_eq!(odd.cached_prompt_tokens, 3);
        // A stream: message_start has input and cache reads, message_delta the output.
        let mut s = UsageScanner::new(true);
        s.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":4,\"cache_read_input_tokens\":6,\"output_tokens\":1}}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n");
        let u = s.finish().unwrap();
        assert_eq!(
            (u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens),
            (10, 6, 9)
        );
    }

    #[test]
    fn a_line_of_exactly_the_bound_is_read_and_one_byte_more_is_not_wherever_it_is_cut() {
        // `data: {"usage":{"prompt_tokens":7}}` padded with spaces to `len` bytes (the newline
        // not counted), then a plain end.
        let stream = |len: usize| {
            let line = b"data: {\"usage\":{\"prompt_tokens\":7}}";
            let mut s = line.to_vec();
            s.splice(6..6, std::iter::repeat_n(b' ', len - line.len()));
            s.extend_from_slice(b"\ndata: [DONE]\n");
            s
        };
        let bound = 64;
        for (len, expected) in [(bound, Some(7)), (bound + 1, None)] {
            let body = stream(len);
            for cut in 0..=body.len() {
                let mut s = UsageScanner::with_bounds(true, bound, MAX_BODY_SCAN);
                s.feed(&body[..cut]);
                s.feed(&body[cut..]);
                assert_eq!(
                    s.finish().map(|u| u.prompt_tokens),
                    expected,
                    "a line of {len} bytes cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn an_overlong_sse_line_is_dropped_whole_and_the_next_one_is_read() {
        let usage = |n: u64| {
            format!(
                "data: {{\"usage\":{{\"prompt_tokens\":{n},\"completion_tokens\":1,\"total_tokens\":{}}}}}\n\n",
                n + 1
            )
        };
        // A usage line too long to scan, after a normal one: the normal one stands; then a
        // normal one after the long one is read again.
        let long = format!(
            "data: {{\"pad\":\"{}\",\"usage\":{{\"prompt_tokens\":7,\"completion_tokens\":1,\"total_tokens\":8}}}}\n\n",
            "x".repeat(MAX_SSE_LINE)
        );
        for (stream, expected) in [
            (format!("{}{long}", usage(9)), 9),
            (format!("{long}{}", usage(3)), 3),
        ] {
            for piece in [1, 7, 4096, stream.len()] {
                let mut s = UsageScanner::new(true);
                for chunk in stream.as_bytes().chunks(piece) {
                    s.feed(chunk);
                }
                assert_eq!(
                    s.finish().map(|u| u.prompt_tokens),
                    Some(expected),
                    "piece {piece}"
                );
            }
        }
    }

    #[test]
    fn usage_from_every_dialects_stream_split_anywhere() {
        // Chat: the usage chunk asked for with `include_usage`.
        let chat = b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5,\"total_tokens\":8}}\n\ndata: [DONE]\n\n";
        // Anthropic: input under `message` in message_start, cumulative output in each
        // message_delta.
        let anthropic = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":7}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n";
        // Responses: under `response` in response.completed.
        let responses = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":5,\"output_tokens\":3,\"total_tokens\":8}}}\n\n";
        for (stream, (input, output)) in [
            (&chat[..], (3, 5)),
            (&anthropic[..], (12, 9)),
            (&responses[..], (5, 3)),
        ] {
            for cut in 0..stream.len() {
                let mut s = UsageScanner::new(true);
                s.feed(&stream[..cut]);
                s.feed(&stream[cut..]);
                assert_eq!(
                    s.finish(),
                    Some(TokenUsage {
                        prompt_tokens: input,
                        completion_tokens: output,
                        total_tokens: input + output,
                        cached_prompt_tokens: 0
                    })
                );
            }
        }
    }

    #[test]
    fn a_stream_hands_out_its_usage_at_its_own_end_and_finish_only_what_is_new() {
        let usage = |input, output| TokenUsage {
            prompt_tokens: input,
            completion_tokens: output,
            total_tokens: input + output,
            cached_prompt_tokens: 0,
        };
        // Anthropic: message_start, then cumulative output in each message_delta.
        let mut s = UsageScanner::new(true);
        s.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n");
        assert_eq!(
            s.update(),
            None,
            "partial figures wait for the stream's end"
        );
        s.feed(b"data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\n");
        s.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n");
        assert_eq!(s.update(), None, "message_delta is not the end");
        s.feed(b"event: message_stop\ndata: {\"type\":\"message_");
        assert_eq!(s.update(), Some(usage(12, 9)), "the event line ends it");
        assert_eq!(s.update(), None, "nothing new");
        s.feed(b"stop\"}\n\n");
        assert_eq!(s.update(), None);
        assert_eq!(s.finish(), None, "already reported");
        // Without event lines, the data's `type` ends it.
        let mut s = UsageScanner::new(true);
        s.feed(b"data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":2,\"output_tokens\":4}}\n\n");
        assert_eq!(s.update(), None);
        s.feed(b"data: {\"type\": \"message_stop\"}\n");
        assert_eq!(s.update(), Some(usage(2, 4)));
        // An end whose other members are odd (of another shape, or named twice) still ends
        // the stream.
        for end in [
            &b"data: {\"type\":\"message_stop\",\"usage\":7}\n\n"[..],
            b"data: {\"type\":\"message_stop\",\"message\":\"x\"}\n\n",
            b"data: {\"type\":\"message_stop\",\"message\":{\"usage\":[]}}\n\n",
            b"data: {\"type\":\"message_stop\",\"response\":1,\"response\":2}\n\n",
        ] {
            let mut s = UsageScanner::new(true);
            s.feed(b"data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":2,\"output_tokens\":4}}\n\n");
            s.feed(end);
            assert_eq!(
                s.update(),
                Some(usage(2, 4)),
                "{}",
                String::from_utf8_lossy(end)
            );
        }
        // An odd top-level `usage` loses only itself: the end's own usage under `response`
        // is read.
        let mut s = UsageScanner::new(true);
        s.feed(b"data: {\"type\":\"response.completed\",\"usage\":7,\"response\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":3}}}\n\n");
        assert_eq!(s.update(), Some(usage(5, 3)));
        // A text that mentions message_stop does not end a stream.
        let mut s = UsageScanner::new(true);
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"message_stop\"}}]}\n\n");
        assert_eq!(s.update(), None);
        // Chat: the usage chunk, then [DONE] in a later piece.
        let mut s = UsageScanner::new(true);
        s.feed(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}\n\n",
        );
        assert_eq!(s.update(), None, "the usage chunk alone");
        s.feed(b"data: [DONE]\n\n");
        assert_eq!(s.update(), Some(usage(3, 5)));
        assert_eq!(s.finish(), None);
        // Responses: the usage comes in the event that ends the stream.
        let mut s = UsageScanner::new(true);
        s.feed(b"data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":3}}}\n\n");
        assert_eq!(s.update(), Some(usage(5, 3)));
        // A last line without its newline is read at the end, and reported then.
        let mut s = UsageScanner::new(true);
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}");
        assert_eq!(s.update(), None);
        assert_eq!(s.finish(), Some(usage(3, 5)));
        // A JSON body is read whole, at the end.
        let mut s = UsageScanner::new(false);
        s.feed(br#"{"usage":{"prompt_tokens":2,"completion_tokens":4}}"#);
        assert_eq!(s.update(), None);
        assert_eq!(s.finish(), Some(usage(2, 4)));
    }

    #[test]
    fn usage_from_json_body_and_bounds() {
        let mut s = UsageScanner::new(false);
        s.feed(br#"{"id":"x","usage":{"input_tokens":2,"output_tokens":4}}"#);
        assert_eq!(
            s.finish(),
            Some(TokenUsage {
                prompt_tokens: 2,
                completion_tokens: 4,
                total_tokens: 6,
                cached_prompt_tokens: 0
            })
        );
        let mut s = UsageScanner::new(false);
        s.feed(&vec![b' '; MAX_BODY_SCAN + 1]);
        assert_eq!(s.finish(), None);
        let mut s = UsageScanner::new(true);
        s.feed(b"data: not json\n\n");
        assert_eq!(s.finish(), None);
    }
}
