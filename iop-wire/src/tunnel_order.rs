//! Ordering of provider tunnel frames, per stream.
//!
//! Seed 000: "RESPONSE_START occurs at most once, BODY occurs zero or more times, and exactly
//! one terminal END or ERROR occurs. USAGE is observation-only." Plus a strictly increasing
//! `sequence`. The precise rules this module enforces (the seed is silent on the corner cases):
//!
//! 1. `sequence` is strictly greater than the previous frame's on the same stream (the first
//!    frame may carry any value).
//! 2. RESPONSE_START, if present, is the first frame of the stream (so it is also at most once).
//! 3. BODY and END require a RESPONSE_START before them: a body without a status is not an HTTP
//!    response. ERROR may come at any point (a provider that never answered).
//! 4. USAGE may come at any point before the terminal and is delivered separately; it is never
//!    merged into the body.
//! 5. After END or ERROR the stream is finished and forgotten; a later frame for it is
//!    [`TunnelError::UnknownStream`] and is dropped.
//!
//! Every violation of 1–3 is a [`TunnelError::Violation`], which **is** the stream's single
//! terminal: the stream is removed, and the caller ends the client response as failed (and
//! sends a `CancelRequest` upstream). So each opened stream ends in exactly one terminal: END,
//! ERROR, a violation, or a local [`TunnelSequencer::close`].
//!
//! Memory is bounded by the number of open streams ([`TunnelSequencer::with_max_streams`]);
//! finished streams are not remembered, which is why stream ids must never be reused on one
//! connection (the Edge allocates them increasing).

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::runtime::{FailureEvidence, Header, TunnelFrame, TunnelPayload, Usage};

/// Default bound on concurrently open tunnel streams per connection.
pub const DEFAULT_MAX_STREAMS: usize = 4096;

/// An ordering rule a frame broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// `sequence` did not increase.
    #[error("sequence {got} does not follow {previous}")]
    SequenceNotIncreasing {
        /// The previous frame's sequence.
        previous: u64,
        /// The offending frame's sequence.
        got: u64,
    },
    /// RESPONSE_START was not the first frame (a duplicate, or after USAGE).
    #[error("RESPONSE_START is not the first frame")]
    StartNotFirst,
    /// BODY before RESPONSE_START.
    #[error("BODY before RESPONSE_START")]
    BodyBeforeStart,
    /// END before RESPONSE_START.
    #[error("END before RESPONSE_START")]
    EndBeforeStart,
}

/// Why a frame was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TunnelError {
    /// The stream is not open (never opened, or already finished). The frame is dropped; no
    /// terminal is produced.
    #[error("tunnel stream is not open")]
    UnknownStream,
    /// The frame broke an ordering rule. The stream is now finished: this error is its
    /// terminal.
    #[error("tunnel ordering violation: {0}")]
    Violation(#[from] Violation),
    /// `open` for a stream id that is already open.
    #[error("tunnel stream is already open")]
    AlreadyOpen,
    /// `open` while the stream limit is reached.
    #[error("too many open tunnel streams")]
    TooManyStreams,
}

/// An accepted frame, ready to hand to the client response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Provider status and headers.
    Start {
        /// Status.
        status: u16,
        /// Headers.
        headers: Vec<Header>,
    },
    /// Body bytes, in order.
    Body(Bytes),
    /// A usage observation (not body).
    Usage(Usage),
    /// The single terminal: END. The stream is finished.
    End {
        /// The terminal frame's observation metadata (e.g. the Node's `provider_us`: the
        /// provider call's duration as the Node measured it).
        metadata: BTreeMap<String, String>,
    },
    /// The single terminal: ERROR. The stream is finished.
    Error {
        /// Legacy error string.
        error: String,
        /// Typed stall evidence.
        execution_failure: Option<FailureEvidence>,
        /// The terminal frame's observation metadata (the Edge adds its handoff keys here).
        metadata: BTreeMap<String, String>,
    },
}

impl Delivery {
    /// Whether this delivery finished the stream.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Self::End { .. } | Self::Error { .. })
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct StreamState {
    last_sequence: Option<u64>,
    started: bool,
    any_frame: bool,
}

/// Ordering state of every open tunnel stream on one connection.
#[derive(Clone, Debug)]
pub struct TunnelSequencer {
    streams: BTreeMap<u64, StreamState>,
    max_streams: usize,
}

impl Default for TunnelSequencer {
    fn default() -> Self {
        Self::with_max_streams(DEFAULT_MAX_STREAMS)
    }
}

impl TunnelSequencer {
    /// A sequencer allowing at most `max_streams` open streams.
    pub fn with_max_streams(max_streams: usize) -> Self {
        Self {
            streams: BTreeMap::new(),
            max_streams,
        }
    }

    /// Number of open streams.
    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// Whether `stream_id` is open.
    pub fn is_open(&self, stream_id: u64) -> bool {
        self.streams.contains_key(&stream_id)
    }

    /// Opens a stream (when the Edge sends its `ProviderTunnelRequest`).
    pub fn open(&mut self, stream_id: u64) -> Result<(), TunnelError> {
        if self.streams.contains_key(&stream_id) {
            return Err(TunnelError::AlreadyOpen);
        }
        if self.streams.len() >= self.max_streams {
            return Err(TunnelError::TooManyStreams);
        }
        self.streams.insert(stream_id, StreamState::default());
        Ok(())
    }

    /// Closes a stream locally (caller disconnect, wait timeout, write failure, session end).
    /// Returns whether it was open, i.e. whether this close is the stream's terminal.
    pub fn close(&mut self, stream_id: u64) -> bool {
        self.streams.remove(&stream_id).is_some()
    }

    /// Checks one received frame against the stream's order and returns what to deliver.
    pub fn handle_frame(
        &mut self,
        stream_id: u64,
        frame: TunnelFrame,
    ) -> Result<Delivery, TunnelError> {
        let state = self
            .streams
            .get_mut(&stream_id)
            .ok_or(TunnelError::UnknownStream)?;
        let checked = check(state, &frame);
        if let Err(v) = checked {
            self.streams.remove(&stream_id);
            return Err(TunnelError::Violation(v));
        }
        let metadata = frame.metadata;
        let delivery = match frame.payload {
            TunnelPayload::ResponseStart { status, headers } => Delivery::Start { status, headers },
            TunnelPayload::Body(b) => Delivery::Body(b),
            TunnelPayload::Usage(u) => Delivery::Usage(u),
            TunnelPayload::End => Delivery::End { metadata },
            TunnelPayload::Error {
                error,
                execution_failure,
            } => Delivery::Error {
                error,
                execution_failure,
                metadata,
            },
        };
        if delivery.is_terminal() {
            self.streams.remove(&stream_id);
        }
        Ok(delivery)
    }
}

fn check(state: &mut StreamState, frame: &TunnelFrame) -> Result<(), Violation> {
    if let Some(previous) = state.last_sequence
        && frame.sequence <= previous
    {
        return Err(Violation::SequenceNotIncreasing {
            previous,
            got: frame.sequence,
        });
    }
    match frame.payload {
        TunnelPayload::ResponseStart { .. } if state.any_frame => {
            return Err(Violation::StartNotFirst);
        }
        TunnelPayload::ResponseStart { .. } => state.started = true,
        TunnelPayload::Body(_) if !state.started => return Err(Violation::BodyBeforeStart),
        TunnelPayload::End if !state.started => return Err(Violation::EndBeforeStart),
        TunnelPayload::Body(_)
        | TunnelPayload::End
        | TunnelPayload::Usage(_)
        | TunnelPayload::Error { .. } => {}
    }
    state.any_frame = true;
    state.last_sequence = Some(frame.sequence);
    Ok(())
}

/// The Node side: numbers outgoing frames so they satisfy [`TunnelSequencer`] by construction.
///
/// Sequences start at 1. Once a terminal has been produced, [`TunnelWriter::frame`] returns
/// `None`, so a Node cannot emit a second terminal (e.g. a stall ERROR racing an END).
#[derive(Clone, Debug, Default)]
pub struct TunnelWriter {
    next_sequence: u64,
    started: bool,
    finished: bool,
}

impl TunnelWriter {
    /// A writer whose first frame gets sequence 1.
    pub fn new() -> Self {
        Self {
            next_sequence: 1,
            started: false,
            finished: false,
        }
    }

    /// Whether the terminal has been produced.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Whether RESPONSE_START has been produced.
    pub fn is_started(&self) -> bool {
        self.started
    }

    /// Numbers `payload`, or returns `None` if the stream already ended or the payload would
    /// break the ordering rules (START twice or late, BODY/END before START).
    pub fn frame(&mut self, payload: TunnelPayload) -> Option<TunnelFrame> {
        if self.finished {
            return None;
        }
        match payload {
            TunnelPayload::ResponseStart { .. } if self.next_sequence != 1 => return None,
            TunnelPayload::ResponseStart { .. } => self.started = true,
            TunnelPayload::Body(_) | TunnelPayload::End if !self.started => return None,
            _ => {}
        }
        if payload.is_terminal() {
            self.finished = true;
        }
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        Some(TunnelFrame {
            sequence,
            payload,
            metadata: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(sequence: u64, payload: TunnelPayload) -> TunnelFrame {
        TunnelFrame {
            sequence,
            payload,
            metadata: Default::default(),
        }
    }

    fn start() -> TunnelPayload {
        TunnelPayload::ResponseStart {
            status: 200,
            headers: vec![],
        }
    }

    #[test]
    fn happy_stream_and_forgetting() {
        let mut s = TunnelSequencer::default();
        s.open(1).unwrap();
        assert!(matches!(
            s.handle_frame(1, f(1, start())),
            Ok(Delivery::Start { status: 200, .. })
        ));
        assert_eq!(
            s.handle_frame(
                1,
                f(2, TunnelPayload::Body(Bytes::from_static(b"data: x\n\n")))
            ),
            Ok(Delivery::Body(Bytes::from_static(b"data: x\n\n")))
        );
        assert_eq!(
            s.handle_frame(1, f(5, TunnelPayload::Usage(Usage::default()))),
            Ok(Delivery::Usage(Usage::default()))
        );
        assert_eq!(
            s.handle_frame(1, f(6, TunnelPayload::End)),
            Ok(Delivery::End {
                metadata: BTreeMap::new()
            })
        );
        assert_eq!(s.open_streams(), 0);
        assert_eq!(
            s.handle_frame(1, f(7, TunnelPayload::End)),
            Err(TunnelError::UnknownStream)
        );
    }

    #[test]
    fn violations_end_the_stream() {
        let mut s = TunnelSequencer::default();
        s.open(1).unwrap();
        s.handle_frame(1, f(3, start())).unwrap();
        assert_eq!(
            s.handle_frame(1, f(3, TunnelPayload::End)),
            Err(TunnelError::Violation(Violation::SequenceNotIncreasing {
                previous: 3,
                got: 3
            }))
        );
        assert!(!s.is_open(1));

        s.open(2).unwrap();
        assert_eq!(
            s.handle_frame(2, f(1, TunnelPayload::Body(Bytes::new()))),
            Err(Violation::BodyBeforeStart.into())
        );
        s.open(3).unwrap();
        s.handle_frame(3, f(1, TunnelPayload::Usage(Usage::default())))
            .unwrap();
        assert_eq!(
            s.handle_frame(3, f(2, start())),
            Err(Violation::StartNotFirst.into())
        );
        s.open(4).unwrap();
        assert_eq!(
            s.handle_frame(4, f(1, TunnelPayload::End)),
            Err(Violation::EndBeforeStart.into())
        );
        s.open(5).unwrap();
        assert!(matches!(
            s.handle_frame(
                5,
                f(
                    1,
                    TunnelPayload::Error {
                        error: "x".into(),
                        execution_failure: None
                    }
                )
            ),
            Ok(Delivery::Error { .. })
        ));
    }

    #[test]
    fn stream_limit_and_reopen() {
        let mut s = TunnelSequencer::with_max_streams(1);
        s.open(1).unwrap();
        assert_eq!(s.open(1), Err(TunnelError::AlreadyOpen));
        assert_eq!(s.open(2), Err(TunnelError::TooManyStreams));
        assert!(s.close(1));
        assert!(!s.close(1));
        s.open(2).unwrap();
    }

    #[test]
    fn writer_produces_valid_streams_and_one_terminal() {
        let mut w = TunnelWriter::new();
        let mut s = TunnelSequencer::default();
        s.open(9).unwrap();
        assert!(
            w.frame(TunnelPayload::Body(Bytes::new())).is_none(),
            "body before start refused"
        );
        for p in [
            start(),
            TunnelPayload::Body(Bytes::from_static(b"a")),
            TunnelPayload::End,
        ] {
            let frame = w.frame(p).unwrap();
            s.handle_frame(9, frame).unwrap();
        }
        assert!(w.is_finished());
        assert!(
            w.frame(TunnelPayload::Error {
                error: String::new(),
                execution_failure: None
            })
            .is_none()
        );
    }
}
