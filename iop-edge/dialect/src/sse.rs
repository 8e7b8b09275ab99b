//! An incremental Server-Sent Events parser (the WHATWG `text/event-stream` rules) with a hard
//! bound on the size of one event.
//!
//! Lines end with LF, CRLF or CR (a CR at the end of one chunk and an LF at the start of the
//! next are one line end). `data` lines of one event are joined with LF; `event` names the
//! event; `id`, `retry` and comment lines (`:`) are ignored; a blank line dispatches. An event
//! still pending when the body ends is dispatched too (servers that omit the final blank line
//! exist). Bytes are buffered only up to [`SseParser::new`]'s bound, so a peer that never ends a
//! line costs at most that much memory.
//!
//! [`UsageChunkFilter`] takes the usage-only chunk out of a chat completions stream passed
//! through byte for byte (fuzzed: `usage_filter`).

/// Default bound on one event (its field lines and data together).
pub const DEFAULT_MAX_EVENT: usize = 4 * 1024 * 1024;

/// One dispatched event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event` field (empty when absent, i.e. `message`).
    pub event: String,
    /// The `data` lines joined with LF.
    pub data: String,
}

impl SseEvent {
    /// The event in `text/event-stream` form: an `event:` line when named, one `data:` line per
    /// line of data, and the blank line that dispatches it. The Edge serves the encoders'
    /// events through axum's `Sse` (which writes the same form and adds keep-alive comments);
    /// this is the form for embedders without axum, the golden files and the fuzz oracle.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        if !self.event.is_empty() {
            out.extend_from_slice(b"event: ");
            out.extend_from_slice(self.event.as_bytes());
            out.push(b'\n');
        }
        for line in self.data.split('\n') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
    }

    /// `events`, each [written](Self::write_to) in turn.
    pub fn write_all(events: &[Self], out: &mut Vec<u8>) {
        for e in events {
            e.write_to(out);
        }
    }
}

/// Why an SSE stream was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SseError {
    /// One event exceeded the bound.
    #[error("an event exceeds {0} bytes")]
    TooLarge(usize),
    /// A line was not UTF-8.
    #[error("an event is not UTF-8")]
    NotUtf8,
}

/// The parser.
#[derive(Debug)]
pub struct SseParser {
    max: usize,
    line: Vec<u8>,
    event: String,
    data: String,
    has_data: bool,
    /// Bytes of the pending event so far (lines already folded in plus `line`).
    pending: usize,
    after_cr: bool,
    failed: Option<SseError>,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT)
    }
}

impl SseParser {
    /// A parser refusing events larger than `max_event` bytes.
    pub fn new(max_event: usize) -> Self {
        Self {
            max: max_event,
            line: Vec::new(),
            event: String::new(),
            data: String::new(),
            has_data: false,
            pending: 0,
            after_cr: false,
            failed: None,
        }
    }

    /// Feeds bytes; appends the events they complete to `out`. After an error the parser
    /// refuses everything.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let mut rest = bytes;
        while !rest.is_empty() {
            if self.after_cr {
                self.after_cr = false;
                if rest[0] == b'\n' {
                    rest = &rest[1..];
                    continue;
                }
            }
            match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(i) => {
                    self.push(&rest[..i])?;
                    self.after_cr = rest[i] == b'\r';
                    rest = &rest[i + 1..];
                    let line = std::mem::take(&mut self.line);
                    self.line_done(&line, out)?;
                    self.line = line;
                    self.line.clear();
                }
                None => {
                    self.push(rest)?;
                    rest = &[];
                }
            }
        }
        Ok(())
    }

    /// The body ended: dispatches a pending event.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, out)?;
        }
        self.dispatch(out);
        Ok(())
    }

    fn push(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        self.pending += bytes.len();
        if self.pending > self.max {
            self.failed = Some(SseError::TooLarge(self.max));
            self.line = Vec::new();
            self.data = String::new();
            return Err(SseError::TooLarge(self.max));
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        let line = std::str::from_utf8(line).map_err(|_| {
            self.failed = Some(SseError::NotUtf8);
            SseError::NotUtf8
        })?;
        if line.starts_with(':') {
            return Ok(());
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => value.clone_into(&mut self.event),
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        if self.has_data {
            out.push(SseEvent {
                event: std::mem::take(&mut self.event),
                data: std::mem::take(&mut self.data),
            });
        }
        self.event.clear();
        self.data.clear();
        self.has_data = false;
        self.pending = 0;
    }
}

// === Usage chunk filter ===

/// Takes the usage-only chunk (`"choices": []` with a `usage` object) out of a chat completions
/// stream passed through, leaving every other byte as the provider sent it: the Edge asks the
/// upstream for usage (`stream_options.include_usage`) to charge a stream exactly, and a client
/// that did not ask must not see the extra chunk.
///
/// Events end at a blank line under the same line rules as [`SseParser`] (LF, CRLF or CR; a CR
/// at the end of one chunk and an LF at the start of the next are one line end), found by one
/// pass over the bytes in order, so where the stream is cut never changes what comes out
/// (fuzzed: `usage_filter`). Whole events go out as they came (a chunk of whole events without
/// a usage chunk, uncopied); only an event cut across chunks is held until its end. An event
/// longer than [`UsageChunkFilter::MAX_HELD`] makes the filter give up: it and the rest of the
/// stream pass through untouched.
#[derive(Debug, Default)]
pub struct UsageChunkFilter {
    /// The current event's bytes from earlier chunks.
    held: Vec<u8>,
    /// Bytes of the current event so far (held and in the chunk being read).
    event_len: usize,
    /// The last byte ended a line.
    line_start: bool,
    /// The last byte was a CR (an LF next completes its line end).
    after_cr: bool,
    /// The last byte was a CR that ended an event.
    ended_by_cr: bool,
    gave_up: bool,
}

impl UsageChunkFilter {
    /// Longest event looked at.
    pub const MAX_HELD: usize = 1024 * 1024;

    /// The bytes of `chunk` to pass on now.
    pub fn feed(&mut self, chunk: bytes::Bytes) -> bytes::Bytes {
        if self.gave_up {
            return chunk;
        }
        let mut out: Option<Vec<u8>> = None;
        // Where the current event starts in `chunk` (its earlier bytes are in `held`).
        let mut start = 0;
        // Whole events of this chunk not yet emitted start at `emit`.
        let mut emit = 0;
        let mut i = 0;
        while i < chunk.len() {
            let Some(at) = memchr::memchr2(b'\r', b'\n', &chunk[i..]) else {
                self.line_start = false;
                self.after_cr = false;
                self.ended_by_cr = false;
                self.event_len += chunk.len() - i;
                break;
            };
            if at > 0 {
                self.line_start = false;
                self.after_cr = false;
                self.ended_by_cr = false;
            }
            self.event_len += at + 1;
            let b = chunk[i + at];
            i += at + 1;
            if b == b'\n' && self.after_cr {
                // The LF of a CRLF: the line already ended. When that CR ended an event, the LF
                // is that event's last byte: it goes out whatever happened to the event.
                self.after_cr = false;
                if std::mem::take(&mut self.ended_by_cr) {
                    start = i;
                    self.event_len = 0;
                }
                continue;
            }
            self.ended_by_cr = false;
            self.after_cr = b == b'\r';
            if !self.line_start {
                self.line_start = true;
                continue;
            }
            // A blank line: the event ends here.
            self.ended_by_cr = b == b'\r';
            let event_start = start;
            start = i;
            self.event_len = 0;
            let whole = if self.held.is_empty() {
                std::borrow::Cow::Borrowed(&chunk[event_start..i])
            } else {
                let mut e = std::mem::take(&mut self.held);
                e.extend_from_slice(&chunk[event_start..i]);
                std::borrow::Cow::Owned(e)
            };
            let drop = is_usage_chunk(&whole);
            if drop || matches!(whole, std::borrow::Cow::Owned(_)) || out.is_some() {
                let o = out.get_or_insert_with(|| chunk[..emit.min(event_start)].to_vec());
                if emit < event_start && matches!(whole, std::borrow::Cow::Borrowed(_)) {
                    o.extend_from_slice(&chunk[emit..event_start]);
                }
                if !drop {
                    o.extend_from_slice(&whole);
                }
                emit = i;
            }
        }
        // The current event continues past this chunk: hold its bytes, or give up on a long one.
        let tail = &chunk[start..];
        if self.held.len() + tail.len() > Self::MAX_HELD || self.event_len > Self::MAX_HELD {
            self.gave_up = true;
            let mut o = out.unwrap_or_else(|| chunk[..emit.min(start)].to_vec());
            if emit < start {
                o.extend_from_slice(&chunk[emit..start]);
            }
            o.extend_from_slice(&std::mem::take(&mut self.held));
            o.extend_from_slice(tail);
            return bytes::Bytes::from(o);
        }
        self.held.extend_from_slice(tail);
        match out {
            None => chunk.slice(..start),
            Some(mut o) => {
                if emit < start {
                    o.extend_from_slice(&chunk[emit..start]);
                }
                bytes::Bytes::from(o)
            }
        }
    }

    /// What is held at the end of the stream (an unterminated last event), as it came; nothing
    /// if it is the usage chunk (a lenient client would read it).
    pub fn finish(&mut self) -> bytes::Bytes {
        self.event_len = 0;
        let held = std::mem::take(&mut self.held);
        if self.gave_up || is_usage_chunk(&held) {
            return bytes::Bytes::new();
        }
        bytes::Bytes::from(held)
    }
}

/// Whether one SSE event's bytes are the usage-only chat chunk, read as [`SseParser`] reads
/// them (the same line rules, a pending event dispatched at the end).
fn is_usage_chunk(event: &[u8]) -> bool {
    if memchr::memmem::find(event, b"\"usage\"").is_none() {
        return false;
    }
    let mut p = SseParser::new(UsageChunkFilter::MAX_HELD);
    let mut events = Vec::new();
    if p.feed(event, &mut events)
        .and_then(|()| p.finish(&mut events))
        .is_err()
    {
        return false;
    }
    let [only] = events.as_slice() else {
        return false;
    };
    serde_json::from_str::<serde_json::Value>(&only.data)
        .is_ok_and(|c| c["usage"].is_object() && c["choices"].as_array().is_some_and(Vec::is_empty))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The usage-only chunk is taken out however the stream is cut, and nothing else changes.
    #[test]
    fn the_usage_chunk_is_taken_out_of_a_stream_cut_anywhere() {
        let kept = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"usage\"}}]}\n\ndata: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\r\n\r\n";
        let usage = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n";
        let done = "data: [DONE]\n\n";
        let stream = format!("{kept}{usage}{done}");
        let expected = format!("{kept}{done}");
        for a in 0..stream.len() {
            for b in [a, (a + 7).min(stream.len()), stream.len()] {
                let mut f = UsageChunkFilter::default();
                let mut out = Vec::new();
                for piece in [&stream[..a], &stream[a..b], &stream[b..]] {
                    out.extend_from_slice(&f.feed(bytes::Bytes::copy_from_slice(piece.as_bytes())));
                }
                out.extend_from_slice(&f.finish());
                assert_eq!(String::from_utf8(out).unwrap(), expected, "cut at {a}, {b}");
            }
        }
        // An unterminated last event comes out as it was.
        let mut f = UsageChunkFilter::default();
        let mut out = f.feed(bytes::Bytes::from_static(b"data: [DONE]")).to_vec();
        out.extend_from_slice(&f.finish());
        assert_eq!(out, b"data: [DONE]");
    }

    fn parse_all(chunks: &[&[u8]]) -> Result<Vec<SseEvent>, SseError> {
        let mut p = SseParser::new(64);
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, &mut out)?;
        }
        p.finish(&mut out)?;
        Ok(out)
    }

    #[test]
    fn fields_line_ends_and_comments() {
        let text =
            b": comment\r\nevent: a\r\ndata: x\r\ndata:y\r\n\r\ndata: z\rid: 1\r\rdata: last";
        let want = vec![
            SseEvent {
                event: "a".into(),
                data: "x\ny".into(),
            },
            SseEvent {
                event: String::new(),
                data: "z".into(),
            },
            SseEvent {
                event: String::new(),
                data: "last".into(),
            },
        ];
        for cut in 0..=text.len() {
            assert_eq!(
                parse_all(&[&text[..cut], &text[cut..]]).unwrap(),
                want,
                "cut {cut}"
            );
        }
    }

    #[test]
    fn an_event_over_the_bound_is_refused_at_limit_plus_one() {
        let ok = format!("data: {}\n\n", "a".repeat(64 - 6));
        assert_eq!(parse_all(&[ok.as_bytes()]).unwrap().len(), 1);
        let too_big = format!("data: {}\n\n", "a".repeat(64 - 5));
        assert_eq!(
            parse_all(&[too_big.as_bytes()]),
            Err(SseError::TooLarge(64))
        );
        // A line that never ends is refused once it passes the bound, not buffered.
        let mut p = SseParser::new(64);
        let mut out = Vec::new();
        assert!(p.feed(&[b'x'; 64], &mut out).is_ok());
        assert!(p.feed(b"x", &mut out).is_err());
        assert!(p.feed(b"\n\n", &mut out).is_err(), "stays failed");
    }

    #[test]
    fn not_utf8_is_refused() {
        assert_eq!(parse_all(&[b"data: \xff\n\n"]), Err(SseError::NotUtf8));
    }
}
