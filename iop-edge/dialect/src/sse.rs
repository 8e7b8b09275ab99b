//! An incremental Server-Sent Events parser (the WHATWG `text/event-stream` rules) with a hard
//! bound on the size of one event.
//!
//! Lines end with LF, CRLF or CR (a CR at the end of one chunk and an LF at the start of the
//! next are one line end). `data` lines of one event are joined with LF; `event` names the
//! event; `id`, `retry` and comment lines (`:`) are ignored; a blank line dispatches. An event
//! still pending when the body ends is dispatched too (servers that omit the final blank line
//! exist). Bytes are buffered only up to [`SseParser::new`]'s bound, so a peer that never ends a
//! line costs at most that much memory.

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

#[cfg(test)]
mod tests {
    use super::*;

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
