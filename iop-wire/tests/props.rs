//! Property tests: operation sequences against small reference models (the shape of quinn's
//! `fuzz/fuzz_targets/streams.rs`). The models are written from the rules in seed 000, not
//! from the implementation.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use iop_wire::codec::FrameCodec;
use iop_wire::registry::{ConnId, FenceCause, Registry, RegistryConfig, RegistryEvent};
use iop_wire::runtime::{
    NodeConfigPayload, NodeReadyRequest, RegisterRequest, RunEvent, RunEventKind, RuntimeFrame,
    RuntimeMessage, TunnelFrame, TunnelPayload, Usage,
};
use iop_wire::tunnel::{Delivery, TunnelError, TunnelSequencer, Violation};
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
                                (Delivery::Start { .. }, 0) | (Delivery::End, 3) | (Delivery::Error { .. }, 4) => {}
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

// === registry fencing ===

#[derive(Clone, Debug)]
enum ROp {
    Accept,
    Register { conn: u8, node: u8 },
    Ready { conn: u8, node: u8 },
    Close { conn: u8 },
    AppFrame { conn: u8 },
}

const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

fn registry_op() -> impl Strategy<Value = ROp> {
    prop_oneof![
        2 => Just(ROp::Accept),
        3 => (0u8..6, 0u8..3).prop_map(|(conn, node)| ROp::Register { conn, node }),
        3 => (0u8..6, 0u8..3).prop_map(|(conn, node)| ROp::Ready { conn, node }),
        2 => (0u8..6).prop_map(|conn| ROp::Close { conn }),
        1 => (0u8..6).prop_map(|conn| ROp::AppFrame { conn }),
    ]
}

/// Lifecycle events the model predicts, with generations as the model numbers them.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Life {
    Registered(usize, u64),
    Ready(usize, u64),
    Fenced(usize, u64),
    Frame(usize, u64),
}

#[derive(Default)]
struct Model {
    /// conn index -> Some(bound node) / None (unbound); absent = closed.
    conns: HashMap<u8, Option<usize>>,
    /// node -> (conn, generation, ready)
    owners: HashMap<usize, (u8, u64, bool)>,
    next_gen: u64,
}

impl Model {
    fn is_owner(&self, conn: u8) -> Option<(usize, u64, bool)> {
        let node = (*self.conns.get(&conn)?)?;
        let &(c, g, r) = self.owners.get(&node)?;
        (c == conn).then_some((node, g, r))
    }

    fn close(&mut self, conn: u8, out: &mut Vec<Life>) {
        if let Some((node, g, ready)) = self.is_owner(conn) {
            self.owners.remove(&node);
            if ready {
                out.push(Life::Fenced(node, g));
            }
        }
        self.conns.remove(&conn);
    }

    fn apply(&mut self, op: &ROp, out: &mut Vec<Life>) {
        match *op {
            ROp::Accept => {}
            ROp::Register { conn, node } => {
                let node = usize::from(node);
                let Some(binding) = self.conns.get(&conn) else {
                    return;
                };
                if binding.is_some() {
                    return; // rejected, nothing changes
                }
                self.next_gen += 1;
                let g = self.next_gen;
                self.conns.insert(conn, Some(node));
                if let Some((old_conn, old_g, ready)) = self.owners.insert(node, (conn, g, false)) {
                    if ready {
                        out.push(Life::Fenced(node, old_g));
                    }
                    self.conns.remove(&old_conn);
                }
                out.push(Life::Registered(node, g));
            }
            ROp::Ready { conn, node } => {
                let node = usize::from(node);
                if !self.conns.contains_key(&conn) {
                    return;
                }
                match self.is_owner(conn) {
                    Some((n, g, ready)) if n == node => {
                        if !ready {
                            self.owners.insert(node, (conn, g, true));
                            out.push(Life::Ready(node, g));
                        }
                    }
                    _ => self.close(conn, out),
                }
            }
            ROp::Close { conn } => self.close(conn, out),
            ROp::AppFrame { conn } => match self.is_owner(conn) {
                Some((n, g, true)) => out.push(Life::Frame(n, g)),
                _ => self.close(conn, out),
            },
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn registry_fencing_matches_the_model(ops in proptest::collection::vec(registry_op(), 0..60)) {
        let now = Instant::now();
        let mut reg = Registry::new(RegistryConfig {
            default_node_config: Some(NodeConfigPayload::default()),
            // The model covers ownership and fencing; the handshake timeout has its own test.
            handshake_timeout: Duration::MAX,
            ..Default::default()
        });
        let mut model = Model::default();
        let mut conns: Vec<ConnId> = Vec::new();
        // Registry generation -> model generation, learned from Registered events in order.
        let mut gen_map = HashMap::new();
        let node_index = |id: &str| NODES.iter().position(|n| *n == id).unwrap();

        for op in &ops {
            let mut expected = Vec::new();
            if let ROp::Accept = op {
                if conns.len() < 6 {
                    let idx = u8::try_from(conns.len()).unwrap();
                    conns.push(reg.accept(now, None));
                    model.conns.insert(idx, None);
                }
                continue;
            }
            let conn_of = |c: u8| conns.get(usize::from(c)).copied();
            let applies = match *op {
                ROp::Register { conn, .. } | ROp::Ready { conn, .. } | ROp::Close { conn } | ROp::AppFrame { conn } => conn_of(conn).is_some(),
                ROp::Accept => false,
            };
            if !applies {
                continue;
            }
            model.apply(op, &mut expected);
            match *op {
                ROp::Register { conn, node } => reg.handle_frame(now, conn_of(conn).unwrap(), RuntimeFrame::new(
                    RuntimeMessage::RegisterRequest(RegisterRequest { node_id: NODES[usize::from(node)].into(), ..Default::default() }))),
                ROp::Ready { conn, node } => reg.handle_frame(now, conn_of(conn).unwrap(), RuntimeFrame::new(
                    RuntimeMessage::NodeReadyRequest(NodeReadyRequest { node_id: NODES[usize::from(node)].into() }))),
                ROp::Close { conn } => reg.handle_close(conn_of(conn).unwrap()),
                ROp::AppFrame { conn } => reg.handle_frame(now, conn_of(conn).unwrap(), RuntimeFrame::on_stream(1,
                    RuntimeMessage::RunEvent(RunEvent::new(RunEventKind::Delta)))),
                ROp::Accept => unreachable!(),
            }
            while reg.poll_transmit().is_some() {}
            let mut got = Vec::new();
            while let Some(e) = reg.poll_event() {
                match e {
                    RegistryEvent::Registered { node_id, generation, .. } => {
                        let model_gen = u64::try_from(gen_map.len()).unwrap() + 1;
                        gen_map.insert(generation, model_gen);
                        got.push(Life::Registered(node_index(&node_id), model_gen));
                    }
                    RegistryEvent::NodeReady { node_id, generation, .. } => got.push(Life::Ready(node_index(&node_id), gen_map[&generation])),
                    RegistryEvent::NodeFenced { node_id, generation, cause } => {
                        prop_assert!(cause != FenceCause::HeartbeatTimeout);
                        got.push(Life::Fenced(node_index(&node_id), gen_map[&generation]));
                    }
                    RegistryEvent::Frame { node_id, generation, .. } => got.push(Life::Frame(node_index(&node_id), gen_map[&generation])),
                    RegistryEvent::CloseConnection { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            // A supersede reports the old generation's fence before the new registration.
            prop_assert_eq!(&got, &expected, "after {:?}", op);
            // Registry state agrees with the model.
            for (n, id) in NODES.iter().enumerate() {
                let want = model.owners.get(&n).map(|&(c, g, r)| (conns[usize::from(c)], g, r));
                let have = reg.ready_generation(id).map(|(c, g)| (c, gen_map[&g], true))
                    .or_else(|| reg.pending_generation(id).map(|(c, g)| (c, gen_map[&g], false)));
                prop_assert_eq!(have, want);
            }
        }
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
