//! Untrusted upstream bytes through `iop_dialect::sse::UsageChunkFilter` (the Edge taking the
//! usage-only chunk out of a chat completions stream it passes through, when it asked the
//! upstream for usage and the client did not).
//!
//! Input: byte 0 is the size of the reads the body arrives in (1–255); the rest is the body.
//!
//! Oracles: never panics; the output does not depend on how the body is cut (whole, in reads of
//! the chosen size, one byte at a time for short bodies); it is never longer than the input; a
//! body with no `"usage"` in it comes out byte for byte; and read by an SSE client (the crate's
//! WHATWG parser), the output's events are exactly the input's without the usage-only ones
//! (JSON with an empty `choices` and a `usage` object).

use bytes::Bytes;
use iop_dialect::sse::{SseEvent, SseParser, UsageChunkFilter};

/// One input.
pub fn run(data: &[u8]) {
    let [read, body @ ..] = data else {
        return;
    };
    let whole = filter(body, body.len().max(1));
    let parts = filter(body, usize::from(*read).max(1));
    assert_eq!(whole, parts, "the output depends on the cut");
    if body.len() <= 512 {
        assert_eq!(whole, filter(body, 1), "the output depends on the cut");
    }
    assert!(whole.len() <= body.len());
    if memchr::memmem::find(body, b"\"usage\"").is_none() {
        assert_eq!(whole, body, "a body without usage is untouched");
    }
    // What was taken out, as an SSE client reads it: the events of the output are the events
    // of the input without the usage-only ones (both read with the crate's WHATWG parser).
    let events = |b: &[u8]| -> Option<Vec<SseEvent>> {
        let mut p = SseParser::new(1 << 20);
        let mut out = Vec::new();
        p.feed(b, &mut out).ok()?;
        p.finish(&mut out).ok()?;
        Some(out)
    };
    if let (Some(input), Some(output)) = (events(body), events(&whole)) {
        let expected: Vec<SseEvent> = input
            .into_iter()
            .filter(|e| !is_usage_only(&e.data))
            .collect();
        assert_eq!(
            output, expected,
            "the client reads other events than the provider sent"
        );
    }
}

fn filter(body: &[u8], read: usize) -> Vec<u8> {
    let mut f = UsageChunkFilter::default();
    let mut out = Vec::new();
    for chunk in body.chunks(read) {
        out.extend_from_slice(&f.feed(Bytes::copy_from_slice(chunk)));
    }
    out.extend_from_slice(&f.finish());
    out
}

fn is_usage_only(data: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(data)
        .is_ok_and(|v| v["usage"].is_object() && v["choices"].as_array().is_some_and(Vec::is_empty))
}
