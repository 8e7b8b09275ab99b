//! Untrusted `traceparent` / `tracestate` header bytes (a client's, at the Edge) through
//! `iop_wire::trace::TraceContext::parse`.
//!
//! Input: byte 0 is where the `tracestate` starts in the rest (its value modulo the length);
//! before it is the `traceparent`, after it the `tracestate`.
//!
//! Oracles: never panics; a parsed context's ids are not all zero; writing it back gives a
//! version-00 `traceparent` that parses to the same context; a kept `tracestate` is at most
//! `MAX_TRACESTATE_LEN` printable ASCII bytes and is the input's, unchanged.

use iop_wire::trace::{MAX_TRACESTATE_LEN, TraceContext};

/// One input.
pub fn run(data: &[u8]) {
    let [cut, rest @ ..] = data else {
        return;
    };
    let at = usize::from(*cut) % (rest.len() + 1);
    let (parent, state) = rest.split_at(at);
    let state = (!state.is_empty()).then_some(state);
    let Some(c) = TraceContext::parse(parent, state) else {
        return;
    };
    assert_ne!(c.trace_id, [0; 16]);
    assert_ne!(c.span_id, [0; 8]);
    let written = c.traceparent();
    assert_eq!(written.len(), 55);
    let back = TraceContext::parse(written.as_bytes(), c.state.as_deref().map(str::as_bytes))
        .expect("a written traceparent parses");
    assert_eq!(back, c);
    if let Some(s) = &c.state {
        assert!(s.len() <= MAX_TRACESTATE_LEN);
        assert!(s.bytes().all(|b| (0x20..0x7f).contains(&b)));
        assert_eq!(Some(s.as_bytes()), state);
    }
}
