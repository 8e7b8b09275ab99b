//! Arbitrary open/close/frame sequences against a `TunnelSequencer`, checked against a tiny
//! model of the ordering rules (`iop_wire::tunnel_order` docs, rules 1–5): each opened stream ends
//! in at most one terminal (END, ERROR or a violation) before it is reopened, frames for
//! streams that are not open are `UnknownStream`, and at most the limit of streams are open.

use std::collections::HashMap;

use arbitrary::Arbitrary;
use bytes::Bytes;
use iop_wire::runtime::{Header, TunnelFrame, TunnelPayload, Usage};
use iop_wire::tunnel_order::{Delivery, TunnelError, TunnelSequencer, Violation};

use crate::seed::{ToSeed, variant};

/// The stream limit the sequencer runs with.
pub const MAX_STREAMS: usize = 8;

/// A tunnel frame kind.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// RESPONSE_START (200, one header).
    Start,
    /// BODY.
    Body,
    /// USAGE.
    Usage,
    /// END.
    End,
    /// ERROR.
    Error,
}

/// One step.
#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `open(stream)`.
    Open(u8),
    /// `close(stream)`.
    Close(u8),
    /// `handle_frame(stream, frame)`.
    Frame {
        /// Stream id.
        stream: u8,
        /// Frame sequence.
        sequence: u8,
        /// Frame kind.
        kind: Kind,
    },
}

/// Model state of one open stream.
#[derive(Debug, Default)]
struct Stream {
    last: Option<u8>,
    started: bool,
}

/// Runs one input.
pub fn run(ops: &[Op]) {
    let mut seq = TunnelSequencer::with_max_streams(MAX_STREAMS);
    // Streams opened and not finished yet (by a terminal, a violation or a close).
    let mut open: HashMap<u64, Stream> = HashMap::new();
    for &op in ops {
        match op {
            Op::Open(s) => {
                let s = u64::from(s);
                match seq.open(s) {
                    Ok(()) => assert!(open.insert(s, Stream::default()).is_none()),
                    Err(TunnelError::AlreadyOpen) => assert!(open.contains_key(&s)),
                    Err(TunnelError::TooManyStreams) => {
                        assert!(!open.contains_key(&s) && open.len() == MAX_STREAMS);
                    }
                    Err(e) => panic!("open: unexpected {e:?}"),
                }
            }
            Op::Close(s) => {
                let s = u64::from(s);
                assert_eq!(seq.close(s), open.remove(&s).is_some(), "close disagrees");
            }
            Op::Frame {
                stream,
                sequence,
                kind,
            } => {
                let s = u64::from(stream);
                let frame = TunnelFrame {
                    sequence: u64::from(sequence),
                    payload: payload(kind),
                    metadata: Default::default(),
                };
                let got = seq.handle_frame(s, frame);
                let Some(state) = open.get_mut(&s) else {
                    assert_eq!(got, Err(TunnelError::UnknownStream));
                    continue;
                };
                let expected = expect(state, sequence, kind);
                match (&got, expected) {
                    (Err(TunnelError::Violation(v)), Err(want)) => assert_eq!(*v, want),
                    (Ok(d), Ok(())) => assert_eq!(kind_of(d), kind),
                    _ => panic!("{kind:?} seq {sequence}: got {got:?}, model says {expected:?}"),
                }
                // A terminal or a violation finishes the stream. The model forgets it, so any
                // later outcome for it before a reopen must be `UnknownStream` (checked above).
                if got.as_ref().map_or(true, Delivery::is_terminal) {
                    open.remove(&s);
                }
            }
        }
        assert!(seq.open_streams() <= MAX_STREAMS);
        assert_eq!(seq.open_streams(), open.len());
        assert!(open.keys().all(|&s| seq.is_open(s)));
    }
}

/// The ordering rules, written independently of `iop_wire::tunnel_order`.
fn expect(state: &mut Stream, sequence: u8, kind: Kind) -> Result<(), Violation> {
    if let Some(previous) = state.last.filter(|&p| sequence <= p) {
        return Err(Violation::SequenceNotIncreasing {
            previous: u64::from(previous),
            got: u64::from(sequence),
        });
    }
    match kind {
        Kind::Start if state.last.is_some() => return Err(Violation::StartNotFirst),
        Kind::Start => state.started = true,
        Kind::Body if !state.started => return Err(Violation::BodyBeforeStart),
        Kind::End if !state.started => return Err(Violation::EndBeforeStart),
        Kind::Body | Kind::End | Kind::Usage | Kind::Error => {}
    }
    state.last = Some(sequence);
    Ok(())
}

fn kind_of(d: &Delivery) -> Kind {
    match d {
        Delivery::Start { .. } => Kind::Start,
        Delivery::Body(_) => Kind::Body,
        Delivery::Usage(_) => Kind::Usage,
        Delivery::End { .. } => Kind::End,
        Delivery::Error { .. } => Kind::Error,
    }
}

fn payload(kind: Kind) -> TunnelPayload {
    match kind {
        Kind::Start => TunnelPayload::ResponseStart {
            status: 200,
            headers: vec![Header {
                name: "content-type".into(),
                value: Bytes::from_static(b"text/event-stream"),
            }],
        },
        Kind::Body => TunnelPayload::Body(Bytes::from_static(b"data: {}\n\n")),
        Kind::Usage => TunnelPayload::Usage(Usage::default()),
        Kind::End => TunnelPayload::End,
        Kind::Error => TunnelPayload::Error {
            error: "upstream failed".into(),
            execution_failure: None,
        },
    }
}

impl ToSeed for Kind {
    fn write_seed(&self, out: &mut Vec<u8>) {
        variant(out, *self as u32, 5);
    }
}

impl ToSeed for Op {
    fn write_seed(&self, out: &mut Vec<u8>) {
        match *self {
            Self::Open(s) => {
                variant(out, 0, 3);
                s.write_seed(out);
            }
            Self::Close(s) => {
                variant(out, 1, 3);
                s.write_seed(out);
            }
            Self::Frame {
                stream,
                sequence,
                kind,
            } => {
                variant(out, 2, 3);
                stream.write_seed(out);
                sequence.write_seed(out);
                kind.write_seed(out);
            }
        }
    }
}
