//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the `traceparent` and
//! `tracestate` HTTP headers, and their binary form on both wires (`TraceContext` on
//! `RunRequest`, `ProviderTunnelRequest` and `AcquireLeaseRequest`).
//!
//! One trace spans a request from the client to the provider: the Edge continues the client's
//! `traceparent` (or starts a trace), sends its dispatch attempt's context to the Node on the
//! run or tunnel request, and the Node sends its provider call's context to the provider as a
//! `traceparent` header. This module only parses and writes the context; spans and their
//! export live in `iop-telemetry`.
//!
//! # Rules
//!
//! - A `traceparent` is parsed as the recommendation says: version `00` must be exactly 55
//!   bytes; a higher version (not `ff`) may carry more after a `-`, which is ignored; ids are
//!   lowercase hex and not all zero. Anything else is no context at all
//!   ([`TraceContext::parse`] returns `None`), and the caller starts a new trace.
//! - `tracestate` is passed on unchanged when it is at most [`MAX_TRACESTATE_LEN`] bytes of
//!   printable ASCII, and dropped otherwise (its list members are not interpreted here).
//! - On the wire, a malformed context is ignored, never an error: tracing never fails a run.
//!   (Every other field of these messages is strict; this one is advisory.)

use crate::proto::runtime as pb;

/// The longest `tracestate` passed on (the recommendation's limit for a whole header).
pub const MAX_TRACESTATE_LEN: usize = 512;

/// One span's W3C trace context: the trace it belongs to, its own id (the parent of the
/// receiver's spans), its flags and the vendors' `tracestate`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The trace id; never all zero.
    pub trace_id: [u8; 16],
    /// The sender's span id; never all zero.
    pub span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
    /// The `tracestate` header value, if any (validated: at most [`MAX_TRACESTATE_LEN`]
    /// printable ASCII bytes).
    pub state: Option<String>,
    /// On a run or tunnel request: whether the Node sends the trace on to the provider as a
    /// `traceparent` header (the adapter's `trace_propagation` at the Edge; default true).
    pub to_provider: bool,
}

impl std::fmt::Debug for TraceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.traceparent())
    }
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

fn parse_hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *o = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Some(out)
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn push_hex(out: &mut String, bytes: &[u8]) {
    for b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 15)]));
    }
}

/// `bytes` as lowercase hex (trace and span ids in logs and attributes).
pub fn to_hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push_hex(&mut s, bytes);
    s
}

fn valid_state(s: &[u8]) -> bool {
    !s.is_empty() && s.len() <= MAX_TRACESTATE_LEN && s.iter().all(|b| (0x20..0x7f).contains(b))
}

impl TraceContext {
    /// Parses a `traceparent` header value and an optional `tracestate`; `None` when the
    /// `traceparent` is not a valid one (see the module docs). An invalid `tracestate` is
    /// dropped; the context is kept.
    pub fn parse(traceparent: &[u8], tracestate: Option<&[u8]>) -> Option<Self> {
        let t = traceparent.strip_suffix(b" ").unwrap_or(traceparent);
        if t.len() < 55 {
            return None;
        }
        let version = parse_hex::<1>(&t[0..2])?[0];
        if version == 0xff
            || (version == 0 && t.len() != 55)
            || (t.len() > 55 && t[55] != b'-')
            || t[2] != b'-'
            || t[35] != b'-'
            || t[52] != b'-'
        {
            return None;
        }
        let trace_id = parse_hex::<16>(&t[3..35])?;
        let span_id = parse_hex::<8>(&t[36..52])?;
        let flags = parse_hex::<1>(&t[53..55])?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        let state = tracestate
            .filter(|s| valid_state(s))
            .and_then(|s| std::str::from_utf8(s).ok())
            .map(str::to_owned);
        Some(Self {
            trace_id,
            span_id,
            flags,
            state,
            to_provider: true,
        })
    }

    /// The `traceparent` header value (version `00`).
    pub fn traceparent(&self) -> String {
        let mut s = String::with_capacity(55);
        s.push_str("00-");
        push_hex(&mut s, &self.trace_id);
        s.push('-');
        push_hex(&mut s, &self.span_id);
        s.push('-');
        push_hex(&mut s, &[self.flags]);
        s
    }

    /// Whether the sender sampled (recorded) its span.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The trace id as 32 lowercase hex digits (what log lines carry).
    pub fn trace_id_hex(&self) -> String {
        to_hex(&self.trace_id)
    }

    /// The same trace with `span_id` as the sender's span (a child of this context).
    #[must_use]
    pub fn with_span(&self, span_id: [u8; 8]) -> Self {
        Self {
            span_id,
            ..self.clone()
        }
    }

    /// The binary wire form.
    pub(crate) fn to_proto(&self) -> pb::TraceContext {
        pb::TraceContext {
            trace_id: self.trace_id.to_vec().into(),
            span_id: self.span_id.to_vec().into(),
            flags: u32::from(self.flags),
            tracestate: self.state.clone().unwrap_or_default(),
            no_provider_header: !self.to_provider,
        }
    }

    /// From the wire form; `None` for a malformed one (ignored, never an error).
    pub(crate) fn from_proto(m: Option<pb::TraceContext>) -> Option<Self> {
        let m = m?;
        let trace_id: [u8; 16] = m.trace_id.as_ref().try_into().ok()?;
        let span_id: [u8; 8] = m.span_id.as_ref().try_into().ok()?;
        let flags = u8::try_from(m.flags).ok()?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        let state = (!m.tracestate.is_empty())
            .then_some(m.tracestate)
            .filter(|s| valid_state(s.as_bytes()));
        Some(Self {
            trace_id,
            span_id,
            flags,
            state,
            to_provider: !m.no_provider_header,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_writes_the_recommendations_example() {
        let c = TraceContext::parse(TP.as_bytes(), Some(b"congo=t61rcWkgMzE")).unwrap();
        assert_eq!(c.traceparent(), TP);
        assert!(c.sampled());
        assert_eq!(c.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.state.as_deref(), Some("congo=t61rcWkgMzE"));
        let back = TraceContext::from_proto(Some(c.to_proto())).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn refuses_what_the_recommendation_refuses() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad.as_bytes(), None), None, "{bad}");
        }
        // A later version may carry more after a dash.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more";
        assert!(TraceContext::parse(later.as_bytes(), None).is_some());
    }

    #[test]
    fn drops_a_bad_tracestate_but_keeps_the_context() {
        let long = vec![b'a'; MAX_TRACESTATE_LEN + 1];
        for bad in [&long[..], b"a=\x01", b""] {
            let c = TraceContext::parse(TP.as_bytes(), Some(bad)).unwrap();
            assert_eq!(c.state, None);
        }
    }

    #[test]
    fn ignores_a_malformed_wire_context() {
        let good = TraceContext::parse(TP.as_bytes(), None).unwrap().to_proto();
        let mut short = good.clone();
        short.trace_id = vec![1; 15].into();
        let mut zero = good.clone();
        zero.span_id = vec![0; 8].into();
        let mut flags = good.clone();
        flags.flags = 256;
        for bad in [short, zero, flags] {
            assert_eq!(TraceContext::from_proto(Some(bad)), None);
        }
        assert!(TraceContext::from_proto(Some(good)).is_some());
    }
}
