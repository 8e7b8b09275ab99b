//! Property tests: operation sequences against small reference models (the shape of quinn's
//! `fuzz/fuzz_targets/streams.rs`). The models are written from the rules in seed 000, not
//! from the implementation.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use iop_wire::codec::FrameCodec;
use iop_wire::runtime::{
    NodeReadyRequest, RuntimeFrame, RuntimeMessage, TunnelFrame, TunnelPayload, Usage,
};
use iop_wire::tunnel_order::{Delivery, TunnelError, TunnelSequencer, Violation};
use proptest::prelude::*;

// === tunnel ordering ===

#[derive(Clone, Debug)]
enum TOp {
    Open(u8),
    Close(u8),
    Frame { stream: u8, sequence: u8, kind: u8 },
}

fn tunnel_op() -> impl Strategy<Value = TOp> {
    prop_oneof![
        1 => (0u8..4).prop_map(TOp::Open),
        1 => (0u8..4).prop_map(TOp::Close),
        6 => (0u8..4, 0u8..12, 0u8..5).prop_map(|(stream, sequence, kind)| TOp::Frame { stream, sequence, kind }),
    ]
}

fn payload(kind: u8) -> TunnelPayload {
    match kind {
        0 => TunnelPayload::ResponseStart {
            status: 200,
            headers: vec![],
        },
        1 => TunnelPayload::Body(Bytes::from_static(b"data: {}\n\n")),
        2 => TunnelPayload::Usage(Usage {
            prompt_tokens: 1,
            completion_tokens: 2,
            total_tokens: 3,
            cached_prompt_tokens: 0,
        }),
        3 => TunnelPayload::End,
        _ => TunnelPayload::Error {
            error: "upstream failed".into(),
            execution_failure: None,
        },
    }
}

/// The reference model of one stream.
#[derive(Clone, Copy, Default)]
struct MStream {
    last: Option<u8>,
    started: bool,
    frames: u32,
}

#[derive(Debug, PartialEq)]
enum Expect {
    Unknown,
    Violation,
    Deliver { terminal: bool },
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn tunnel_ordering_matches_the_model(ops in proptest::collection::vec(tunnel_op(), 0..80)) {
        let mut seq = TunnelSequencer::with_max_streams(16);
        let mut model: HashMap<u8, MStream> = HashMap::new();
        // Per opening of a stream, as the *sequencer* reported it (not the model): how many
        // terminals (END, ERROR, violation, local close) it produced.
        let mut terminals: HashMap<(u8, u32), u32> = HashMap::new();
        let mut epoch: HashMap<u8, u32> = HashMap::new();
        for op in ops {
            match op {
                TOp::Open(s) => {
                    let was_open = model.contains_key(&s);
                    let r = seq.open(u64::from(s));
                    prop_assert_eq!(r.is_ok(), !was_open);
                    if r.is_ok() {
                        let e = epoch.entry(s).or_default();
                        *e += 1;
                        terminals.insert((s, *e), 0);
                    }
                    if !was_open {
                        model.insert(s, MStream::default());
                    }
                }
                TOp::Close(s) => {
                    let was_open = model.remove(&s).is_some();
                    let closed = seq.close(u64::from(s));
                    prop_assert_eq!(closed, was_open);
                    if closed {
                        *terminals.entry((s, epoch[&s])).or_default() += 1;
                    }
                }
                TOp::Frame { stream, sequence, kind } => {
                    let expect = match model.get_mut(&stream) {
                        None => Expect::Unknown,
                        Some(m) => {
                            let ordered = m.last.is_none_or(|l| sequence > l);
                            let allowed = match kind {
                                0 => m.frames == 0,
                                1 | 3 => m.started,
                                _ => true,
                            };
                            if ordered && allowed {
                                m.last = Some(sequence);
                                m.frames += 1;
                                m.started |= kind == 0;
                                Expect::Deliver { terminal: kind >= 3 }
                            } else {
                                Expect::Violation
                            }
                        }
                    };
                    let frame = TunnelFrame { sequence: u64::from(sequence), payload: payload(kind), metadata: Default::default() };
                    let got = match seq.handle_frame(u64::from(stream), frame) {
                        Err(TunnelError::UnknownStream) => Expect::Unknown,
                        Err(TunnelError::Violation(_)) => Expect::Violation,
                        Err(e) => panic!("unexpected {e:?}"),
                        Ok(d) => {
                            // USAGE never turns into body, and body bytes arrive intact.
                            match (&d, kind) {
                                (Delivery::Usage(u), 2) => prop_assert_eq!(u.total_tokens, 3),
                                (Delivery::Body(b), 1) => prop_assert_eq!(&b[..], b"data: {}\n\n"),
                                (Delivery::Start { .. }, 0) | (Delivery::End { .. }, 3) | (Delivery::Error { .. }, 4) => {}
                                other => panic!("delivery {other:?} for kind {kind}"),
                            }
                            Expect::Deliver { terminal: d.is_terminal() }
                        }
                    };
                    if matches!(got, Expect::Violation | Expect::Deliver { terminal: true }) {
                        // Counted from what the sequencer said, before comparing with the model.
                        let e = epoch.get(&stream).copied().unwrap_or(0);
                        *terminals.entry((stream, e)).or_default() += 1;
                    }
                    prop_assert_eq!(&got, &expect);
                    if matches!(got, Expect::Violation | Expect::Deliver { terminal: true }) {
                        model.remove(&stream);
                    }
                }
            }
            prop_assert_eq!(seq.open_streams(), model.len());
        }
        // Exactly one terminal per opening: an opening the sequencer still holds open has had
        // none, every other has had exactly one (a terminal for a stream it never opened would
        // show as epoch 0).
        for (&(stream, e), &n) in &terminals {
            let open_now = e == epoch[&stream] && seq.is_open(u64::from(stream));
            prop_assert_eq!(n, u32::from(!open_now), "stream {} opening {}", stream, e);
        }
    }

    #[test]
    fn violations_are_typed(previous in 1u64..1000, back in 0u64..1000) {
        let mut seq = TunnelSequencer::default();
        seq.open(1).unwrap();
        seq.handle_frame(1, TunnelFrame { sequence: previous, payload: payload(0), metadata: Default::default() }).unwrap();
        let got = previous.saturating_sub(back);
        prop_assert_eq!(
            seq.handle_frame(1, TunnelFrame { sequence: got, payload: payload(1), metadata: Default::default() }),
            Err(TunnelError::Violation(Violation::SequenceNotIncreasing { previous, got }))
        );
    }
}

// === codec streaming ===

fn arb_frame() -> impl Strategy<Value = RuntimeFrame> {
    prop_oneof![
        Just(RuntimeFrame::new(RuntimeMessage::Ping)),
        "[a-z]{1,12}".prop_map(|id| RuntimeFrame::new(RuntimeMessage::NodeReadyRequest(
            NodeReadyRequest { node_id: id }
        ))),
        (
            1u64..1000,
            proptest::collection::vec(any::<u8>(), 0..300),
            0u64..100
        )
            .prop_map(|(stream, body, sequence)| {
                RuntimeFrame::on_stream(
                    stream,
                    RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
                        sequence,
                        payload: TunnelPayload::Body(Bytes::from(body)),
                        metadata: Default::default(),
                    }),
                )
            }),
    ]
}

proptest! {
    /// Splitting a stream of frames at arbitrary points never changes what is decoded.
    #[test]
    fn chunked_decoding_equals_whole_decoding(
        frames in proptest::collection::vec(arb_frame(), 1..8),
        cuts in proptest::collection::vec(1usize..64, 1..40),
    ) {
        let codec = FrameCodec::new();
        let mut wire = BytesMut::new();
        for f in &frames {
            codec.encode(f, &mut wire).unwrap();
        }
        let wire = wire.freeze();
        let mut buf = BytesMut::new();
        let mut decoded = Vec::new();
        let mut pos = 0;
        let mut cuts = cuts.into_iter().cycle();
        while pos < wire.len() {
            let n = cuts.next().unwrap().min(wire.len() - pos);
            buf.extend_from_slice(&wire[pos..pos + n]);
            pos += n;
            while let Some(f) = codec.decode::<RuntimeFrame>(&mut buf).unwrap() {
                decoded.push(f);
            }
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(decoded, frames);
    }

    /// Arbitrary bytes, on both wires, are exactly one of: a typed error, "incomplete" asking
    /// for bytes the input does not have, or a frame consuming exactly its prefix's length;
    /// never a panic, never more than the input.
    #[test]
    fn arbitrary_bytes_are_an_error_or_incomplete_or_a_frame(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let codec = FrameCodec::with_max_frame_len(256);
        let declared = (bytes.len() >= 4)
            .then(|| u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize);
        check_decoded(codec.decode_slice::<RuntimeFrame>(&bytes).map(erase), &bytes, declared)?;
        check_decoded(
            codec.decode_slice::<iop_wire::control::ControlFrame>(&bytes).map(erase),
            &bytes,
            declared,
        )?;
    }
}

/// What [`arbitrary_bytes_are_an_error_or_incomplete_or_a_frame`] requires of one decode.
fn check_decoded(
    r: Result<iop_wire::codec::Decoded<()>, iop_wire::error::FrameError>,
    bytes: &[u8],
    declared: Option<usize>,
) -> Result<(), TestCaseError> {
    use iop_wire::codec::Decoded;
    match (r, declared) {
        (Ok(Decoded::Frame { consumed, .. }), Some(len)) => {
            prop_assert_eq!(
                consumed,
                4 + len,
                "a frame consumes its prefix and its length"
            );
            prop_assert!(consumed <= bytes.len() && len <= 256);
        }
        (Ok(Decoded::Frame { .. }), None) => prop_assert!(false, "a frame without a prefix"),
        (Ok(Decoded::Incomplete { needed }), declared) => {
            prop_assert!(needed > 0);
            let whole = declared.map_or(4, |len| 4 + len);
            prop_assert!(
                bytes.len() < whole,
                "incomplete although {} >= {}",
                bytes.len(),
                whole
            );
            prop_assert!(
                declared.is_none_or(|len| len <= 256),
                "incomplete beyond the limit"
            );
        }
        (Err(iop_wire::error::FrameError::TooLarge { declared: d, max }), Some(len)) => {
            prop_assert_eq!((d, max), (len as u64, 256));
            prop_assert!(len > 256);
        }
        (Err(iop_wire::error::FrameError::Invalid(_)), Some(len)) => {
            prop_assert!(
                len <= 256 && bytes.len() >= 4 + len,
                "invalid only once whole"
            );
        }
        (Err(e), _) => prop_assert!(false, "unexpected {e:?}"),
    }
    Ok(())
}

fn erase<F>(d: iop_wire::codec::Decoded<F>) -> iop_wire::codec::Decoded<()> {
    use iop_wire::codec::Decoded;
    match d {
        Decoded::Frame { consumed, .. } => Decoded::Frame {
            frame: (),
            consumed,
        },
        Decoded::Incomplete { needed } => Decoded::Incomplete { needed },
    }
}
