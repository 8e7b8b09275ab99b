//! Two-party harness in virtual time: the real [`EdgeCore`] and real Node sessions
//! (`iop_wire::node::NodeSession`) exchange encoded frames (quinn-proto's `Pair`). No sockets,
//! no sleeps, no tokio: time moves only when a test advances it to the next `poll_timeout`.
//! The test plays each Node's application (what it answers to runs, tunnels and commands).
//!
//! Every test names the invariant it checks:
//!
//! - **one owner**: at most one ready generation per Node id; a newer registration fences the
//!   older one;
//! - **no stale routing**: a frame of a fenced generation is never delivered to a stream;
//! - **one terminal**: every opened stream ends with exactly one terminal event;
//! - **fence in one step**: a fence ends that generation's streams and fails its pending
//!   commands in the same call, before anything else happens;
//! - **lease once**: every provider lease is released exactly once (terminal, caller, fence).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;
use common::{run_request, tunnel_request};
use iop_edge_core::pool::ContextSize;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use iop_edge_core::registry::{ConnId, Generation};
use iop_edge_core::{
    Admit, Answer, CoreConfig, DispatchError, EdgeCore, Event, Issuers, Level, Lifecycle,
    NODE_DISCONNECTED, Observer, Open, Opened, SLOW_CONSUMER, Sinks, StreamSink, TunnelEvent,
};
use iop_wire::codec::FrameCodec;
use iop_wire::node::{NodeEvent, NodeSession, NodeSessionConfig};
use iop_wire::runtime::{
    Capability, ConfigRefreshOutcome, ExecutionFailure, FailureEvidence, Fence, HealthEvidence,
    NodeCommandKind, NodeCommandRequest, NodeCommandResponse, NodeConfigPayload,
    NodeConfigRefreshResponse, ProviderStatus, RegisterRequest, RunEvent, RunEventKind,
    RuntimeFrame, RuntimeMessage, TunnelFrame, TunnelPayload,
};
use iop_wire::tunnel_order::Delivery;

// === Stream buffers the test can read (or not) ===

struct BufState<T> {
    queue: VecDeque<(T, usize)>,
    bytes: usize,
    reads: u64,
    reader_gone: bool,
    /// Everything ever pushed (a replaced backlog included), for the one-terminal check.
    pushed: usize,
}

struct Buf<T>(Rc<RefCell<BufState<T>>>);

impl<T> Clone for Buf<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> Buf<T> {
    fn new() -> Self {
        Self(Rc::new(RefCell::new(BufState {
            queue: VecDeque::new(),
            bytes: 0,
            reads: 0,
            reader_gone: false,
            pushed: 0,
        })))
    }

    /// Reads everything queued.
    fn read_all(&self) -> Vec<T> {
        let mut s = self.0.borrow_mut();
        let items: Vec<T> = s.queue.drain(..).map(|(t, _)| t).collect();
        s.bytes = 0;
        s.reads += items.len() as u64;
        items
    }

    fn drop_reader(&self) {
        let mut s = self.0.borrow_mut();
        s.reader_gone = true;
        s.queue.clear();
        s.bytes = 0;
    }

    fn unread(&self) -> usize {
        self.0.borrow().queue.len()
    }
}

impl<T> StreamSink<T> for Buf<T> {
    fn push(&self, item: T, size: usize) -> Option<Level> {
        let mut s = self.0.borrow_mut();
        if s.reader_gone {
            return None;
        }
        s.queue.push_back((item, size));
        s.bytes += size;
        s.pushed += 1;
        Some(Level {
            bytes: s.bytes,
            reads: s.reads,
        })
    }

    fn replace_with(&self, terminal: T) {
        let mut s = self.0.borrow_mut();
        s.queue.clear();
        s.queue.push_back((terminal, 0));
        s.bytes = 0;
        s.pushed += 1;
    }

    fn level(&self) -> Level {
        let s = self.0.borrow();
        Level {
            bytes: s.bytes,
            reads: s.reads,
        }
    }
}

struct TestSinks;

impl Sinks for TestSinks {
    type Run = Buf<RunEvent>;
    type Tunnel = Buf<TunnelEvent>;
}

#[derive(Default)]
struct Counts {
    slow: AtomicU64,
    set_unavailable: AtomicU64,
    cleared: AtomicU64,
}

impl Observer for Counts {
    fn slow_consumer(&self) {
        self.slow.fetch_add(1, Ordering::Relaxed);
    }

    fn health_transition(&self, to_unavailable: bool) {
        if to_unavailable {
            self.set_unavailable.fetch_add(1, Ordering::Relaxed);
        } else {
            self.cleared.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// === The harness ===

struct Link {
    conn: ConnId,
    node: NodeSession,
    down: bool,
    /// Application frames the Node received (after ready).
    inbox: Vec<RuntimeFrame>,
    /// Registered but holding its config (so not ready) until [`Pair::apply_config`].
    held: bool,
    /// The Node session's [`NodeEvent::AnswerReplaced`]s: stream id and reason.
    replaced: Vec<(u64, String)>,
}

struct Pair {
    now: Instant,
    codec: FrameCodec,
    edge: EdgeCore<TestSinks>,
    links: Vec<Link>,
    by_conn: HashMap<ConnId, usize>,
    events: Vec<Event>,
    counts: Arc<Counts>,
    /// Whether the Nodes dialled from now on announce `stream_credit`.
    stream_credit: bool,
    /// The session settings of the Nodes dialled from now on.
    node_config: NodeSessionConfig,
}

const MAX_BUFFER: usize = 64 * 1024;
const SLOW_TIMEOUT: Duration = Duration::from_secs(30);

impl Pair {
    /// An Edge knowing `node-1` and `node-2`, with model `m` served by one tunnel provider on
    /// each (capacity 1) and a queue of 4.
    fn new() -> Self {
        Self::with_pool(common::pool(4))
    }

    /// The same Edge with another provider pool.
    fn with_pool(pool: iop_edge_core::pool::Pool) -> Self {
        let registry = common::registry();
        let counts = Arc::new(Counts::default());
        let edge = EdgeCore::new(
            registry,
            Some(pool),
            CoreConfig {
                max_stream_buffer: MAX_BUFFER,
                slow_consumer_timeout: SLOW_TIMEOUT,
                stream_window: iop_edge_core::DEFAULT_STREAM_WINDOW,
            },
            counts.clone(),
        );
        Self {
            now: Instant::now(),
            codec: FrameCodec::new(),
            edge,
            links: Vec::new(),
            by_conn: HashMap::new(),
            events: Vec::new(),
            counts,
            stream_credit: false,
            node_config: NodeSessionConfig::default(),
        }
    }

    /// `node_id` dials (its certificate names it), registers and becomes ready.
    fn connect(&mut self, node_id: &str) -> usize {
        self.connect_pinning(node_id, &[])
    }

    /// Like [`Pair::connect`], the registration naming the lease issuer keys the Node pins.
    fn connect_pinning(&mut self, node_id: &str, issuers: &[&str]) -> usize {
        self.dial(node_id, issuers, false)
    }

    /// Like [`Pair::connect_pinning`], but the Node stops after its registration is accepted
    /// (pending: it has not applied its config, so it is not ready) until
    /// [`Pair::apply_config`].
    fn connect_held(&mut self, node_id: &str, issuers: &[&str]) -> usize {
        self.dial(node_id, issuers, true)
    }

    fn dial(&mut self, node_id: &str, issuers: &[&str], held: bool) -> usize {
        let conn = self.edge.accept(self.now, node_id);
        let register = RegisterRequest {
            node_id: node_id.to_owned(),
            issuer_key_ids: issuers.iter().map(|s| (*s).to_owned()).collect(),
            stream_credit: self.stream_credit,
            ..Default::default()
        };
        let node = NodeSession::new(self.node_config, register, self.now);
        self.links.push(Link {
            conn,
            node,
            down: false,
            inbox: Vec::new(),
            replaced: Vec::new(),
            held,
        });
        let i = self.links.len() - 1;
        self.by_conn.insert(conn, i);
        self.settle();
        i
    }

    /// The held Node of link `i` applies its config and reports ready.
    fn apply_config(&mut self, i: usize) {
        self.links[i].held = false;
        self.links[i].node.config_applied(self.now).unwrap();
        self.settle();
    }

    fn wire(&self, frame: &RuntimeFrame) -> RuntimeFrame {
        let mut buf = BytesMut::new();
        self.codec.encode(frame, &mut buf).unwrap();
        self.codec.decode(&mut buf).unwrap().unwrap()
    }

    /// Moves frames and events until nothing changes.
    fn settle(&mut self) {
        loop {
            let mut moved = false;
            for i in 0..self.links.len() {
                while let Some(frame) = self.links[i].node.poll_transmit() {
                    moved = true;
                    if self.links[i].down {
                        continue;
                    }
                    let frame = self.wire(&frame);
                    self.edge.handle_frame(self.now, self.links[i].conn, frame);
                }
                while let Some(event) = self.links[i].node.poll_event() {
                    moved = true;
                    match event {
                        NodeEvent::ApplyConfig { .. } if self.links[i].held => {}
                        NodeEvent::ApplyConfig { .. } => {
                            self.links[i].node.config_applied(self.now).unwrap();
                        }
                        NodeEvent::Closed(_) if !self.links[i].down => {
                            self.links[i].down = true;
                            self.edge.handle_close(self.now, self.links[i].conn);
                        }
                        NodeEvent::Frame(f) => self.links[i].inbox.push(f),
                        NodeEvent::AnswerReplaced { stream_id, reason } => {
                            self.links[i].replaced.push((stream_id, reason));
                        }
                        _ => {}
                    }
                }
            }
            while let Some((conn, frame)) = self.edge.poll_transmit() {
                moved = true;
                let frame = self.wire(&frame);
                // A connection the test accepted without a session reads nothing.
                let Some(&i) = self.by_conn.get(&conn) else {
                    continue;
                };
                if !self.links[i].down {
                    self.links[i].node.handle_frame(self.now, frame);
                }
            }
            while let Some(event) = self.edge.poll_event() {
                moved = true;
                if let Event::CloseConnection { conn, .. } = &event
                    && let Some(&i) = self.by_conn.get(conn)
                    && !self.links[i].down
                {
                    self.links[i].down = true;
                    self.links[i].node.handle_transport_closed();
                }
                self.events.push(event);
            }
            if !moved {
                break;
            }
        }
    }

    /// The Node of link `i` sends `frame` (its application speaking).
    fn node_send(&mut self, i: usize, frame: RuntimeFrame) {
        self.links[i].node.send(self.now, frame).unwrap();
        self.settle();
    }

    /// A frame as if read from link `i`'s socket, whatever its session would do.
    fn inject(&mut self, i: usize, frame: RuntimeFrame) {
        let frame = self.wire(&frame);
        self.edge.handle_frame(self.now, self.links[i].conn, frame);
        self.settle();
    }

    /// The transport of link `i` breaks.
    fn cut(&mut self, i: usize) {
        self.links[i].down = true;
        self.links[i].node.handle_transport_closed();
        self.edge.handle_close(self.now, self.links[i].conn);
        self.settle();
    }

    /// Advances virtual time by `d`, firing every timer on the way.
    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            let mut next = self.edge.poll_timeout();
            for l in &self.links {
                if !l.down
                    && let Some(t) = l.node.poll_timeout()
                {
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
            match next {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.edge.handle_timeout(self.now);
                    for l in &mut self.links {
                        if !l.down {
                            l.node.handle_timeout(self.now);
                        }
                    }
                    self.settle();
                }
                _ => break,
            }
        }
        self.now = end;
    }

    fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// The application frames link `i` received since the last call.
    /// Opens tunnel `id` on `node` into `sink` (no response deadline) and settles.
    fn open_tunnel(&mut self, node: &str, id: &str, sink: &Buf<TunnelEvent>) -> Opened {
        let o = self
            .edge
            .open(
                self.now,
                node,
                Open::Tunnel {
                    request: tunnel_request(id),
                    sink: sink.clone(),
                    response_wait: None,
                },
            )
            .unwrap();
        self.settle();
        o
    }

    fn inbox(&mut self, i: usize) -> Vec<RuntimeFrame> {
        std::mem::take(&mut self.links[i].inbox)
    }

    fn generation(&self, node: &str) -> Generation {
        self.edge
            .ready_nodes()
            .into_iter()
            .find(|(n, _)| n == node)
            .map(|(_, g)| g)
            .expect("ready")
    }

    fn leases(&self) -> u64 {
        self.edge.pool_stats().1
    }
}

fn run_event(kind: RunEventKind, delta: &str) -> RunEvent {
    let mut ev = RunEvent::new(kind);
    ev.delta = delta.into();
    ev
}

fn tunnel_frame(stream_id: u64, sequence: u64, payload: TunnelPayload) -> RuntimeFrame {
    RuntimeFrame::on_stream(
        stream_id,
        RuntimeMessage::ProviderTunnelFrame(TunnelFrame {
            sequence,
            payload,
            metadata: BTreeMap::new(),
        }),
    )
}

fn start() -> TunnelPayload {
    TunnelPayload::ResponseStart {
        status: 200,
        headers: Vec::new(),
    }
}

fn cancels(frames: &[RuntimeFrame]) -> Vec<String> {
    frames
        .iter()
        .filter_map(|f| match &f.message {
            RuntimeMessage::CancelRequest(c) => Some(c.run_id.clone()),
            _ => None,
        })
        .collect()
}

fn terminals_run(events: &[RunEvent]) -> usize {
    events.iter().filter(|e| e.kind.is_terminal()).count()
}

fn terminals_tunnel(events: &[TunnelEvent]) -> usize {
    events.iter().filter(|e| e.is_terminal()).count()
}

// === Tests ===

/// Handshake, then a run: the Node gets the request on a fresh stream, its events reach the
/// stream's buffer in order, the terminal ends the route (**one terminal**).
#[test]
fn a_run_flows_to_its_stream_and_ends_with_the_nodes_terminal() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let g1 = p.generation("node-1");
    assert!(
        p.take_events()
            .contains(&Event::Lifecycle(Lifecycle::Connected {
                node_id: "node-1".into(),
                generation: g1,
            }))
    );
    let buf = Buf::new();
    let opened = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r1"),
                sink: buf.clone(),
            },
        )
        .unwrap();
    p.settle();
    assert_eq!(opened.generation, g1);
    let inbox = p.inbox(n1);
    assert!(matches!(
        &inbox[..],
        [f] if f.stream_id == opened.stream_id
            && matches!(&f.message, RuntimeMessage::RunRequest(r) if r.run_id == "r1")
    ));
    for (kind, delta) in [
        (RunEventKind::Start, ""),
        (RunEventKind::Delta, "hel"),
        (RunEventKind::Delta, "lo"),
        (RunEventKind::Complete, ""),
    ] {
        p.node_send(
            n1,
            RuntimeFrame::on_stream(
                opened.stream_id,
                RuntimeMessage::RunEvent(run_event(kind, delta)),
            ),
        );
    }
    let got = buf.read_all();
    let deltas: String = got.iter().map(|e| e.delta.as_str()).collect();
    assert_eq!(deltas, "hello");
    assert_eq!(terminals_run(&got), 1);
    assert_eq!(p.edge.stream_count(), 0, "the terminal ended the route");
    // A late frame for the finished stream goes nowhere.
    p.node_send(
        n1,
        RuntimeFrame::on_stream(
            opened.stream_id,
            RuntimeMessage::RunEvent(run_event(RunEventKind::Delta, "late")),
        ),
    );
    assert!(buf.read_all().is_empty());
}

/// **one owner** + **fence in one step** + **one terminal**: a second connection registering
/// as the same Node supersedes the first; in that same step the old generation's run and
/// tunnel get the Edge's own terminal and its pending command fails.
#[test]
fn a_supersede_fences_the_old_generation_streams_and_commands_in_one_step() {
    let mut p = Pair::new();
    let old = p.connect("node-1");
    let g_old = p.generation("node-1");
    let run = Buf::new();
    let tunnel = Buf::new();
    p.edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r1"),
                sink: run.clone(),
            },
        )
        .unwrap();
    p.edge
        .open(
            p.now,
            "node-1",
            Open::Tunnel {
                request: tunnel_request("t1"),
                sink: tunnel.clone(),
                response_wait: None,
            },
        )
        .unwrap();
    let ticket = p
        .edge
        .command(
            p.now,
            "node-1",
            NodeCommandRequest {
                kind: NodeCommandKind::Transport,
                adapter: String::new(),
                target: String::new(),
            },
        )
        .unwrap();
    p.settle();
    p.take_events();
    assert_eq!(p.edge.stream_count(), 2);

    let new = p.connect("node-1");
    let g_new = p.generation("node-1");
    assert!(g_new > g_old);
    assert_eq!(
        p.edge.ready_nodes(),
        vec![("node-1".to_owned(), g_new)],
        "one owner"
    );
    let run_events = run.read_all();
    assert_eq!(terminals_run(&run_events), 1);
    assert_eq!(run_events[0].error, NODE_DISCONNECTED);
    assert_eq!(tunnel.read_all(), vec![TunnelEvent::NodeDisconnected]);
    assert_eq!(p.edge.stream_count(), 0);
    let events = p.take_events();
    assert!(events.contains(&Event::Answered {
        ticket,
        answer: Answer::Command(Err(DispatchError::Disconnected)),
    }));
    assert!(events.contains(&Event::Lifecycle(Lifecycle::Disconnected {
        node_id: "node-1".into(),
        generation: g_old,
    })));

    // **no stale routing**: the old connection's frames (injected raw, whatever its session
    // would do) reach nothing, even naming a live stream id of the new generation.
    let fresh = Buf::new();
    let opened = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r2"),
                sink: fresh.clone(),
            },
        )
        .unwrap();
    p.settle();
    p.inject(
        old,
        RuntimeFrame::on_stream(
            opened.stream_id,
            RuntimeMessage::RunEvent(run_event(RunEventKind::Delta, "stale")),
        ),
    );
    assert!(
        fresh.read_all().is_empty(),
        "a stale generation's frame was routed"
    );
    p.node_send(
        new,
        RuntimeFrame::on_stream(
            opened.stream_id,
            RuntimeMessage::RunEvent(run_event(RunEventKind::Delta, "fresh")),
        ),
    );
    assert_eq!(fresh.read_all()[0].delta, "fresh");
}

/// A frame routed by another Node's connection, naming this stream's id, is not delivered:
/// transport identity decides (**no stale routing**).
#[test]
fn a_frame_from_another_node_naming_a_stream_is_not_routed() {
    let mut p = Pair::new();
    let _n1 = p.connect("node-1");
    let n2 = p.connect("node-2");
    let buf = Buf::new();
    let opened = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r1"),
                sink: buf.clone(),
            },
        )
        .unwrap();
    p.settle();
    p.node_send(
        n2,
        RuntimeFrame::on_stream(
            opened.stream_id,
            RuntimeMessage::RunEvent(run_event(RunEventKind::Complete, "")),
        ),
    );
    assert!(buf.read_all().is_empty());
    assert_eq!(p.edge.stream_count(), 1);
}

/// Tunnel ordering: Start, Body, End are delivered; a body before any start is a violation,
/// which is the stream's one terminal, and the run is cancelled on the Node.
#[test]
fn tunnel_frames_are_ordered_and_a_violation_is_the_terminal_and_cancels() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let ok = Buf::new();
    let a = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Tunnel {
                request: tunnel_request("ok"),
                sink: ok.clone(),
                response_wait: None,
            },
        )
        .unwrap();
    let bad = Buf::new();
    let b = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Tunnel {
                request: tunnel_request("bad"),
                sink: bad.clone(),
                response_wait: None,
            },
        )
        .unwrap();
    p.settle();
    p.inbox(n1);
    p.node_send(n1, tunnel_frame(a.stream_id, 1, start()));
    p.node_send(
        n1,
        tunnel_frame(
            a.stream_id,
            2,
            TunnelPayload::Body(Bytes::from_static(b"x")),
        ),
    );
    p.node_send(
        n1,
        tunnel_frame(
            b.stream_id,
            1,
            TunnelPayload::Body(Bytes::from_static(b"y")),
        ),
    );
    p.node_send(n1, tunnel_frame(a.stream_id, 3, TunnelPayload::End));
    let got = ok.read_all();
    assert_eq!(got.len(), 3);
    assert_eq!(
        got[1],
        TunnelEvent::Frame(Delivery::Body(Bytes::from_static(b"x")))
    );
    assert_eq!(terminals_tunnel(&got), 1);
    let got = bad.read_all();
    assert!(matches!(&got[..], [TunnelEvent::Violation(_)]));
    assert_eq!(cancels(&p.inbox(n1)), vec!["bad".to_owned()]);
    assert_eq!(p.edge.stream_count(), 0);
}

/// Per-stream credit: a tunnel gets a window only on a Node that announced `stream_credit`
/// (half the byte bound here, the default window being larger), its reader's grants reach that
/// Node on the tunnel's stream, and nothing reaches an older Node or a stream that ended.
#[test]
fn credit_goes_only_to_nodes_that_announce_it_and_only_for_open_tunnels() {
    let mut p = Pair::new();
    p.stream_credit = true;
    let n1 = p.connect("node-1");
    p.stream_credit = false;
    let n2 = p.connect("node-2");
    let a = p.open_tunnel("node-1", "a", &Buf::new());
    let b = p.open_tunnel("node-2", "b", &Buf::new());
    let window = |frames: &[RuntimeFrame]| -> Vec<u64> {
        frames
            .iter()
            .filter_map(|f| match &f.message {
                RuntimeMessage::ProviderTunnelRequest(r) => Some(r.credit_window),
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        a.credit_window,
        (MAX_BUFFER / 2) as u64,
        "at most half the bound"
    );
    assert_eq!(window(&p.inbox(n1)), vec![a.credit_window]);
    assert_eq!(b.credit_window, 0, "an older Node gets no window");
    assert_eq!(window(&p.inbox(n2)), vec![0]);

    p.edge.grant(p.now, a.stream_id, 1000);
    p.edge.grant(p.now, b.stream_id, 1000);
    p.settle();
    let got = p.inbox(n1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].stream_id, a.stream_id);
    assert_eq!(got[0].message, RuntimeMessage::StreamWindowUpdate(1000));
    assert!(p.inbox(n2).is_empty(), "nothing for an older Node");

    // After the terminal a grant (one that crossed it) sends nothing.
    p.node_send(n1, tunnel_frame(a.stream_id, 1, start()));
    p.node_send(n1, tunnel_frame(a.stream_id, 2, TunnelPayload::End));
    p.edge.grant(p.now, a.stream_id, 1000);
    p.settle();
    assert!(p.inbox(n1).is_empty());
    assert!(!p.links[n1].down && !p.links[n2].down, "both sessions live");

    // The window in effect: the configured one, at most half the bound, and none below the
    // smallest useful window.
    let config = |max_stream_buffer, stream_window| CoreConfig {
        max_stream_buffer,
        slow_consumer_timeout: SLOW_TIMEOUT,
        stream_window,
    };
    assert_eq!(config(4 << 20, 1 << 20).effective_stream_window(), 1 << 20);
    assert_eq!(
        config(1 << 20, 1 << 20).effective_stream_window(),
        512 << 10
    );
    assert_eq!(config(4 << 20, 0).effective_stream_window(), 0);
    assert_eq!(
        config(iop_edge_core::MIN_STREAM_WINDOW * 2 - 2, 1 << 20).effective_stream_window(),
        0
    );
}

/// Response-wait timer, in virtual time: nothing arrives within the wait, so the stream ends
/// with `WaitTimeout` and the Node is told to cancel; a stream whose first frame arrived in
/// time is untouched.
#[test]
fn a_tunnel_without_a_response_in_time_ends_with_wait_timeout_and_is_cancelled() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let slow = Buf::new();
    let fast = Buf::new();
    let wait = Some(Duration::from_secs(5));
    p.edge
        .open(
            p.now,
            "node-1",
            Open::Tunnel {
                request: tunnel_request("slow"),
                sink: slow.clone(),
                response_wait: wait,
            },
        )
        .unwrap();
    let f = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Tunnel {
                request: tunnel_request("fast"),
                sink: fast.clone(),
                response_wait: wait,
            },
        )
        .unwrap();
    p.settle();
    p.inbox(n1);
    p.advance(Duration::from_secs(1));
    p.node_send(n1, tunnel_frame(f.stream_id, 1, start()));
    p.advance(Duration::from_millis(3_999));
    assert!(slow.read_all().is_empty(), "not before the wait");
    p.advance(Duration::from_millis(2));
    assert_eq!(slow.read_all(), vec![TunnelEvent::WaitTimeout]);
    assert_eq!(cancels(&p.inbox(n1)), vec!["slow".to_owned()]);
    assert_eq!(fast.read_all().len(), 1, "the answered stream is untouched");
    p.advance(Duration::from_secs(60));
    assert!(fast.read_all().is_empty());
    assert_eq!(p.edge.stream_count(), 1);
}

/// A caller going away ends its stream and cancels the run on the Node; later frames of that
/// run are dropped.
#[test]
fn a_dropped_caller_cancels_its_run_on_the_node() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let buf = Buf::new();
    let o = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r1"),
                sink: buf.clone(),
            },
        )
        .unwrap();
    p.settle();
    p.inbox(n1);
    buf.drop_reader();
    p.edge.end_stream(p.now, o.stream_id, "caller_disconnected");
    p.settle();
    assert_eq!(cancels(&p.inbox(n1)), vec!["r1".to_owned()]);
    assert_eq!(p.edge.stream_count(), 0);
    // A reader that is gone when the Node's next event arrives: the same cancel, once.
    let buf = Buf::new();
    let o = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r2"),
                sink: buf.clone(),
            },
        )
        .unwrap();
    p.settle();
    p.inbox(n1);
    buf.drop_reader();
    for _ in 0..3 {
        p.node_send(
            n1,
            RuntimeFrame::on_stream(
                o.stream_id,
                RuntimeMessage::RunEvent(run_event(RunEventKind::Delta, "x")),
            ),
        );
    }
    assert_eq!(cancels(&p.inbox(n1)), vec!["r2".to_owned()]);
}

/// Slow consumers: past the byte bound the backlog is replaced by one terminal at once; under
/// it, no read for the timeout ends the stream; reading in time keeps it alive.
#[test]
fn a_reader_that_falls_behind_is_ended_and_cancelled_in_virtual_time() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let open = |p: &mut Pair, id: &str, buf: &Buf<TunnelEvent>| {
        let s = p.open_tunnel("node-1", id, buf).stream_id;
        p.node_send(n1, tunnel_frame(s, 1, start()));
        s
    };
    let chunk = Bytes::from(vec![b'x'; 16 * 1024]);

    // Over the byte bound.
    let big = Buf::new();
    let s = open(&mut p, "big", &big);
    for seq in 2..8 {
        p.node_send(n1, tunnel_frame(s, seq, TunnelPayload::Body(chunk.clone())));
    }
    assert_eq!(big.read_all(), vec![TunnelEvent::SlowConsumer]);
    assert_eq!(cancels(&p.inbox(n1)), vec!["big".to_owned()]);

    // Under the bound, stuck: ended after the timeout, not before.
    let stuck = Buf::new();
    let s = open(&mut p, "stuck", &stuck);
    p.node_send(n1, tunnel_frame(s, 2, TunnelPayload::Body(chunk.clone())));
    // A reader that keeps reading is never ended.
    let live = Buf::new();
    let l = open(&mut p, "live", &live);
    p.inbox(n1);
    for i in 0..4 {
        p.node_send(
            n1,
            tunnel_frame(l, 2 + i, TunnelPayload::Body(chunk.clone())),
        );
        live.read_all();
        p.advance(SLOW_TIMEOUT / 3);
    }
    // ≥ 30 s passed with `stuck` never read.
    assert_eq!(stuck.unread(), 1, "replaced by its terminal");
    assert_eq!(stuck.read_all(), vec![TunnelEvent::SlowConsumer]);
    assert_eq!(cancels(&p.inbox(n1)), vec!["stuck".to_owned()]);
    p.node_send(n1, tunnel_frame(l, 10, TunnelPayload::End));
    assert_eq!(terminals_tunnel(&live.read_all()), 1);
    assert_eq!(p.counts.slow.load(Ordering::Relaxed), 2);
}

/// The slow-consumer timeout counts from the reader's last read: a reader that read and then
/// stopped, with bytes unread since, is not ended before one timeout of silence, and is ended
/// within a quarter timeout after it (the stream is looked at four times per timeout).
#[test]
fn a_stopped_reader_is_ended_one_timeout_after_its_last_read() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let buf = Buf::new();
    let s = p.open_tunnel("node-1", "stops", &buf).stream_id;
    let chunk = || TunnelPayload::Body(Bytes::from(vec![b'x'; 1024]));
    p.node_send(n1, tunnel_frame(s, 1, start()));
    p.node_send(n1, tunnel_frame(s, 2, chunk()));
    // It reads 0.6 of a timeout later, and never again; a new body waits unread from then on.
    p.advance(SLOW_TIMEOUT * 6 / 10);
    assert_eq!(buf.read_all().len(), 2);
    p.node_send(n1, tunnel_frame(s, 3, chunk()));
    p.advance(SLOW_TIMEOUT * 95 / 100);
    assert_eq!(
        buf.unread(),
        1,
        "0.95 of a timeout after its last read: still served"
    );
    p.advance(SLOW_TIMEOUT * 30 / 100);
    assert_eq!(
        buf.read_all(),
        vec![TunnelEvent::SlowConsumer],
        "1.25 timeouts after its last read: ended"
    );
    p.inbox(n1);
    assert_eq!(p.counts.slow.load(Ordering::Relaxed), 1);
}

/// The pool's queue through the machine: capacity 1 per provider, a third caller waits, is
/// granted when a stream's terminal releases its lease, and a fourth times out in virtual time
/// (**lease once**: the count of held leases is always that of live admissions and streams).
#[test]
fn queued_admissions_are_granted_on_release_and_time_out() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let _n2 = p.connect("node-2");
    let wait = Duration::from_secs(5);
    let Admit::Granted(a) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("capacity")
    };
    let Admit::Granted(b) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("capacity")
    };
    assert_ne!(a.lease.key, b.lease.key, "least loaded first");
    let Admit::Queued(c) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("no capacity left")
    };
    assert_eq!(p.leases(), 2);
    // Send on node-1's lease; its terminal releases the lease and grants `c`.
    let a = if a.lease.key.node_id == "node-1" {
        a
    } else {
        b
    };
    let buf = Buf::new();
    let o = p
        .edge
        .send_admitted(
            p.now,
            &a.lease,
            Open::Tunnel {
                request: tunnel_request("q1"),
                sink: buf.clone(),
                response_wait: None,
            },
        )
        .unwrap();
    p.settle();
    let sent = p.inbox(n1);
    assert!(
        matches!(
            &sent[..],
            [f] if matches!(&f.message, RuntimeMessage::ProviderTunnelRequest(r)
                if r.adapter == "p1-adapter" && r.target == "p1-target")
        ),
        "adapter and target come from the lease"
    );
    p.take_events();
    p.node_send(
        n1,
        tunnel_frame(
            o.stream_id,
            1,
            TunnelPayload::Error {
                error: "boom".into(),
                execution_failure: None,
            },
        ),
    );
    let events = p.take_events();
    let granted = events.iter().find_map(|e| match e {
        Event::Admitted {
            request,
            result: Ok(adm),
        } if *request == c => Some(adm.clone()),
        _ => None,
    });
    let granted = granted.expect("the waiter was granted on release");
    assert_eq!(p.leases(), 2);
    // A fourth waits and times out: exactly at its deadline.
    let Admit::Queued(d) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("full")
    };
    p.advance(wait - Duration::from_millis(1));
    assert!(p.take_events().is_empty());
    p.advance(Duration::from_millis(2));
    assert_eq!(
        p.take_events(),
        vec![Event::Admitted {
            request: d,
            result: Err(DispatchError::WaitTimeout),
        }]
    );
    // Released by the caller, then again (no-op): counted once.
    p.edge.release(p.now, granted.lease.id);
    p.edge.release(p.now, granted.lease.id);
    assert_eq!(p.leases(), 1);
}

/// Issuer key rotation (managed mode): once the Control Plane signs with a new key, a ready
/// Node that does not trust it is no longer selected while the lease it holds runs to its
/// end; a Node pinning both keys keeps serving; not trusting the staged key is a warning only;
/// the excluded Node registering again with the new key pinned is selected again (and takes
/// the waiter queued meanwhile).
#[test]
fn a_rotated_issuer_key_stops_selecting_nodes_that_do_not_trust_it() {
    let mut p = Pair::new();
    let n1 = p.connect_pinning("node-1", &["p256:old"]);
    let _n2 = p.connect_pinning("node-2", &["p256:old", "p256:new"]);
    p.edge.set_issuers(
        p.now,
        Issuers {
            active: Some("p256:old".into()),
            staged: Some(("p256:new".into(), 1_900_000_000_000)),
        },
    );
    assert!(
        p.edge
            .warning("node-1")
            .is_some_and(|w| w.contains("p256:new")),
        "{:?}",
        p.edge.warning("node-1")
    );
    assert_eq!(p.edge.warning("node-2"), None);
    assert_eq!(p.edge.refused("node-1"), None, "a warning only");
    let wait = Duration::from_secs(5);
    let mut granted = Vec::new();
    for _ in 0..2 {
        let Admit::Granted(a) = p
            .edge
            .admit(p.now, "m", ContextSize::Standard, wait)
            .unwrap()
        else {
            panic!("both nodes are selectable before the switch")
        };
        granted.push(a.lease);
    }
    let on = |node: &str| granted.iter().find(|l| l.key.node_id == node).unwrap().id;
    let (l1, l2) = (on("node-1"), on("node-2"));

    // The switch: node-1 trusts only the old key.
    p.edge.set_issuers(
        p.now,
        Issuers {
            active: Some("p256:new".into()),
            staged: None,
        },
    );
    let refused = p.edge.refused("node-1").expect("node-1 is not selected");
    assert!(
        refused.starts_with(iop_edge_core::registry::reason::ISSUER_KEY_NOT_TRUSTED)
            && refused.contains("p256:new")
            && refused.contains("p256:old"),
        "{refused}"
    );
    assert_eq!(p.edge.refused("node-2"), None);
    assert_eq!(p.edge.warning("node-1"), None, "nothing is staged any more");
    assert_eq!(p.leases(), 2, "node-1's lease runs to its end");
    p.edge.release(p.now, l1);
    p.edge.release(p.now, l2);
    let Admit::Granted(a) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("node-2 has room")
    };
    assert_eq!(a.lease.key.node_id, "node-2");
    let Admit::Queued(waiter) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("node-1 has room but must not be selected")
    };
    let snap = p.edge.snapshot();
    let n1_snap = snap.iter().find(|s| s.node_id == "node-1").unwrap();
    assert_eq!(
        (n1_snap.status.as_str(), n1_snap.queued),
        ("unavailable", 0)
    );

    // node-1 comes back pinning the new key: selected again, and it takes the waiter.
    p.cut(n1);
    p.take_events();
    let _n1 = p.connect_pinning("node-1", &["p256:new"]);
    let events = p.take_events();
    assert!(
        events.iter().any(|e| matches!(e,
            Event::Admitted { request, result: Ok(adm) }
                if *request == waiter && adm.lease.key.node_id == "node-1")),
        "{events:?}"
    );
    assert_eq!(p.edge.refused("node-1"), None);
}

/// A Node whose registration was accepted under the old issuer key and that turns ready after
/// the switch to a key it does not pin is excluded in the same step as its activation: a waiter
/// queued meanwhile is never granted on it.
#[test]
fn a_node_that_turns_ready_untrusted_is_never_granted_a_waiter() {
    let mut p = Pair::new();
    let _n1 = p.connect_pinning("node-1", &["p256:old", "p256:new"]);
    p.edge.set_issuers(
        p.now,
        Issuers {
            active: Some("p256:old".into()),
            staged: None,
        },
    );
    let n2 = p.connect_held("node-2", &["p256:old"]);
    assert!(
        !p.edge.ready_nodes().iter().any(|(n, _)| n == "node-2"),
        "node-2 is pending"
    );
    let wait = Duration::from_secs(5);
    let Admit::Granted(_busy) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("node-1 has room")
    };
    let Admit::Queued(waiter) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("node-1 is full and node-2 not ready")
    };
    p.edge.set_issuers(
        p.now,
        Issuers {
            active: Some("p256:new".into()),
            staged: None,
        },
    );
    p.take_events();
    p.apply_config(n2);
    assert!(p.edge.ready_nodes().iter().any(|(n, _)| n == "node-2"));
    let events = p.take_events();
    assert!(
        !events.iter().any(|e| matches!(e,
            Event::Admitted { request, result: Ok(_) } if *request == waiter)),
        "the waiter was granted on a Node that cannot verify its lease: {events:?}"
    );
    assert!(
        p.edge
            .refused("node-2")
            .is_some_and(|r| r.contains("p256:new")),
        "{:?}",
        p.edge.refused("node-2")
    );
    assert_eq!(p.edge.pool_stats().0, 1, "still waiting");
}

/// The two refusals are kept apart: a Node whose registration was refused (it did not pin the
/// active key) keeps that refusal, for the status view, until it is ready again, even when an
/// issuer change meanwhile finds its new, still pending registration trusted (that change may
/// clear only the refusal it made itself).
#[test]
fn a_registration_refusal_outlives_issuer_changes_until_the_node_is_ready() {
    let mut p = Pair::new();
    p.edge.set_issuers(
        p.now,
        Issuers {
            active: Some("p256:new".into()),
            staged: None,
        },
    );
    let _refused = p.connect_pinning("node-1", &["p256:old"]);
    let why = p
        .edge
        .refused("node-1")
        .expect("refused at registration")
        .to_owned();
    assert!(
        why.starts_with(iop_edge_core::registry::reason::ISSUER_KEY_NOT_TRUSTED),
        "{why}"
    );
    // Registered again, pinning the active key, but not ready yet.
    let again = p.connect_held("node-1", &["p256:old", "p256:new"]);
    p.edge.set_issuers(
        p.now,
        Issuers {
            active: Some("p256:new".into()),
            staged: Some(("p256:next".into(), 1)),
        },
    );
    assert_eq!(
        p.edge.refused("node-1"),
        Some(why.as_str()),
        "kept while pending"
    );
    p.apply_config(again);
    assert_eq!(p.edge.refused("node-1"), None, "cleared once ready");
    assert!(
        p.edge
            .warning("node-1")
            .is_some_and(|w| w.contains("p256:next")),
        "{:?}",
        p.edge.warning("node-1")
    );
}

/// Without a ready provider a request waits — never hangs — and times out at its deadline; the
/// queue is bounded (a fifth waiter is refused at once with `QueueFull`, no waiting); an unknown
/// model is refused before anything is queued. (Moved here from a socket test that used a real
/// 50 ms sleep to be sure the first waiter was queued.)
#[test]
fn without_a_ready_provider_requests_wait_boundedly_then_time_out() {
    let mut p = Pair::new();
    let wait = Duration::from_millis(300);
    assert_eq!(
        p.edge
            .admit(p.now, "nope", ContextSize::Standard, wait)
            .unwrap_err(),
        DispatchError::UnknownModel
    );
    // No Node connected: every admission queues, up to the queue's bound of 4.
    let mut queued = Vec::new();
    for _ in 0..4 {
        let Admit::Queued(q) = p
            .edge
            .admit(p.now, "m", ContextSize::Standard, wait)
            .unwrap()
        else {
            panic!("no provider is ready")
        };
        queued.push(q);
    }
    assert_eq!(
        p.edge
            .admit(p.now, "m", ContextSize::Standard, wait)
            .unwrap_err(),
        DispatchError::QueueFull
    );
    assert!(p.take_events().is_empty());
    p.advance(wait);
    let timed_out: Vec<_> = p
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Admitted {
                request,
                result: Err(DispatchError::WaitTimeout),
            } => Some(request),
            _ => None,
        })
        .collect();
    assert_eq!(timed_out, queued, "each waiter times out once, in order");
    assert_eq!(p.leases(), 0);
}

/// **lease once** across a fence: a lease held by a stream and one held by an unsent admission
/// are both released by the fence of their generation; the stream's own terminal path and a
/// late send then change nothing.
#[test]
fn a_fence_releases_its_generations_leases_exactly_once() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let wait = Duration::from_secs(5);
    let Admit::Granted(a) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("capacity")
    };
    assert_eq!(a.lease.key.node_id, "node-1", "node-2 is not connected");
    let buf = Buf::new();
    p.edge
        .send_admitted(
            p.now,
            &a.lease,
            Open::Run {
                request: run_request("r1"),
                sink: buf.clone(),
            },
        )
        .unwrap();
    p.settle();
    assert_eq!(p.leases(), 1);
    p.cut(n1);
    assert_eq!(p.leases(), 0, "released by the fence");
    assert_eq!(terminals_run(&buf.read_all()), 1);
    // A late send on the fenced lease is refused and releases nothing twice.
    let again = Buf::new();
    assert_eq!(
        p.edge.send_admitted(
            p.now,
            &a.lease,
            Open::Run {
                request: run_request("r2"),
                sink: again,
            },
        ),
        Err(DispatchError::Disconnected)
    );
    p.edge.release(p.now, a.lease.id);
    assert_eq!(p.leases(), 0);
    // Back on a new generation, with full capacity (the old lease did not leak into it).
    let n1b = p.connect("node-1");
    let Admit::Granted(b) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, wait)
        .unwrap()
    else {
        panic!("the old lease leaked into the new generation")
    };
    assert_eq!(
        Some(b.lease.generation),
        p.edge.registry().ready_generation("node-1").map(|(_, g)| g),
        "granted on the new generation"
    );
    // An admission granted but never sent: its lease, too, is released by the fence, once.
    assert_eq!(p.leases(), 1);
    p.cut(n1b);
    assert_eq!(
        p.leases(),
        0,
        "the unsent admission's lease released by the fence"
    );
    assert_eq!(
        p.edge.send_admitted(
            p.now,
            &b.lease,
            Open::Run {
                request: run_request("r3"),
                sink: Buf::new(),
            },
        ),
        Err(DispatchError::Disconnected)
    );
    p.edge.release(p.now, b.lease.id);
    assert_eq!(p.leases(), 0, "released once");
    let _n1c = p.connect("node-1");
    assert!(matches!(
        p.edge.admit(p.now, "m", ContextSize::Standard, wait),
        Ok(Admit::Granted(_))
    ));
}

fn stall_evidence(adapter: &str, target: &str, seq: u64) -> FailureEvidence {
    FailureEvidence::Valid(ExecutionFailure {
        health: HealthEvidence::Unavailable,
        idle_duration: Duration::from_secs(120),
        run_id: "s1".into(),
        attempt_id: "a1".into(),
        fence: Fence::Unconfirmed,
        adapter: adapter.into(),
        target: target.into(),
        health_observation_seq: Some(seq),
    })
}

/// Stall handoff and recovery: a stall terminal naming the lease's own adapter and target gets
/// the handoff metadata and sets the overlay (the provider is no longer selected); one naming
/// another target changes nothing; a CAPABILITIES answer clears the overlay only when fresher.
#[test]
fn a_validated_stall_sets_the_overlay_and_only_a_fresher_probe_clears_it() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let wait = Duration::from_secs(5);
    let stall_on = |p: &mut Pair, evidence: FailureEvidence| -> Vec<TunnelEvent> {
        let Admit::Granted(a) = p
            .edge
            .admit(p.now, "m", ContextSize::Standard, wait)
            .unwrap()
        else {
            panic!("capacity")
        };
        let buf = Buf::new();
        let o = p
            .edge
            .send_admitted(
                p.now,
                &a.lease,
                Open::Tunnel {
                    request: tunnel_request("s1"),
                    sink: buf.clone(),
                    response_wait: None,
                },
            )
            .unwrap();
        p.settle();
        p.node_send(
            n1,
            tunnel_frame(
                o.stream_id,
                1,
                TunnelPayload::Error {
                    error: "stalled".into(),
                    execution_failure: Some(evidence),
                },
            ),
        );
        buf.read_all()
    };
    // Mismatched target: no handoff, no overlay.
    let got = stall_on(&mut p, stall_evidence("p1-adapter", "other", 5));
    let TunnelEvent::Frame(Delivery::Error { metadata, .. }) = &got[0] else {
        panic!("{got:?}")
    };
    assert!(!metadata.contains_key("recovery_handoff"));
    assert_eq!(p.counts.set_unavailable.load(Ordering::Relaxed), 0);
    // Matching: confirmed, overlay set.
    let got = stall_on(&mut p, stall_evidence("p1-adapter", "p1-target", 5));
    let TunnelEvent::Frame(Delivery::Error { metadata, .. }) = &got[0] else {
        panic!("{got:?}")
    };
    assert_eq!(
        metadata.get("recovery_handoff").map(String::as_str),
        Some("confirmed")
    );
    assert_eq!(metadata.get("provider_id").map(String::as_str), Some("p1"));
    assert_eq!(p.counts.set_unavailable.load(Ordering::Relaxed), 1);
    assert!(
        matches!(
            p.edge.admit(p.now, "m", ContextSize::Standard, wait),
            Ok(Admit::Queued(_))
        ),
        "the overlaid provider is not selected"
    );
    // Recovery: a probe answer with a stale sequence clears nothing, a fresher one clears.
    for (seq, expected) in [(5, 0), (6, 1)] {
        let ticket = p.edge.recover(p.now, "node-1").unwrap();
        p.settle();
        let probe = p.inbox(n1).pop().unwrap();
        assert!(
            matches!(&probe.message, RuntimeMessage::NodeCommandRequest(r)
            if r.kind == NodeCommandKind::Capabilities)
        );
        p.take_events();
        p.node_send(
            n1,
            RuntimeFrame::correlated(
                probe.correlation_id,
                RuntimeMessage::NodeCommandResponse(NodeCommandResponse {
                    ok: true,
                    error: String::new(),
                    capabilities: vec![Capability {
                        adapter_key: "p1-adapter".into(),
                        target: "p1-target".into(),
                        provider_status: ProviderStatus::Available,
                        health_observation_seq: seq,
                        adapter: "openai_compat".into(),
                        instance_key: "p1".into(),
                    }],
                    result: BTreeMap::new(),
                }),
            ),
        );
        let events = p.take_events();
        assert!(
            events.contains(&Event::Answered {
                ticket,
                answer: Answer::Recovered(Ok(expected)),
            }),
            "seq {seq}: {events:?}"
        );
    }
    assert_eq!(p.counts.cleared.load(Ordering::Relaxed), 1);
}

/// The status view ([`EdgeCore::status`]) in virtual time: why and since when an overlay is
/// set, the waiter's age, the last probe answer (stale, then clearing), the Node's version,
/// last heard and streams in flight.
#[test]
fn the_status_view_shows_the_overlay_cause_the_oldest_wait_and_the_last_probe() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let status = p.edge.status(p.now);
    let node = status.nodes.iter().find(|n| n.node_id == "node-1").unwrap();
    assert!(node.ready);
    assert_eq!(node.version.as_deref(), Some(""));
    assert_eq!((node.runs, node.tunnels), (0, 0));
    assert!(status.health.iter().all(|h| h.overlay.is_none()));
    // A stall with `unavailable` evidence on p1 (node-1's only provider for "m").
    let (_, buf, stream_id) = tunnel_on_lease(&mut p, "s1");
    assert_eq!(
        p.edge.status(p.now).nodes[0].tunnels,
        1,
        "a tunnel in flight"
    );
    p.advance(Duration::from_secs(2));
    p.node_send(
        n1,
        tunnel_frame(
            stream_id,
            1,
            TunnelPayload::Error {
                error: "stalled".into(),
                execution_failure: Some(stall_evidence("p1-adapter", "p1-target", 5)),
            },
        ),
    );
    drop(buf.read_all());
    let heard_at = p.now;
    let Ok(Admit::Queued(_)) =
        p.edge
            .admit(p.now, "m", ContextSize::Standard, Duration::from_secs(30))
    else {
        panic!("the overlaid provider is not selected")
    };
    p.advance(Duration::from_secs(3));
    let status = p.edge.status(p.now);
    let i = status
        .providers
        .iter()
        .position(|s| s.provider_id == "p1")
        .unwrap();
    assert_eq!(status.providers[i].health, "unavailable");
    let overlay = status.health[i].overlay.expect("the overlay's cause");
    assert_eq!(overlay.age, Duration::from_secs(3));
    assert_eq!(overlay.idle, Duration::from_secs(120));
    assert_eq!(overlay.fence, Fence::Unconfirmed);
    assert_eq!(status.health[i].last_probe, None);
    assert_eq!(status.queue_depth, 1);
    assert_eq!(status.oldest_wait, Some(Duration::from_secs(3)));
    let node = &status.nodes[0];
    assert_eq!(node.tunnels, 0, "the stalled tunnel ended");
    // The Node's heartbeats keep it heard within an interval, whatever the page's age.
    assert!(node.last_heard.unwrap() <= p.now - heard_at);
    // Probes: a stale answer is shown and changes nothing; a fresher one clears.
    for (seq, fresh) in [(5, false), (6, true)] {
        p.edge.recover(p.now, "node-1").unwrap();
        p.settle();
        let probe = p.inbox(n1).pop().unwrap();
        p.take_events();
        p.node_send(
            n1,
            RuntimeFrame::correlated(
                probe.correlation_id,
                RuntimeMessage::NodeCommandResponse(NodeCommandResponse {
                    ok: true,
                    error: String::new(),
                    capabilities: vec![Capability {
                        adapter_key: "p1-adapter".into(),
                        target: "p1-target".into(),
                        provider_status: ProviderStatus::Available,
                        health_observation_seq: seq,
                        adapter: "openai_compat".into(),
                        instance_key: "p1".into(),
                    }],
                    result: BTreeMap::new(),
                }),
            ),
        );
        p.advance(Duration::from_secs(1));
        let status = p.edge.status(p.now);
        let probe = status.health[i].last_probe.expect("the probe's answer");
        assert_eq!(probe.age, Duration::from_secs(1));
        assert_eq!(probe.provider_status, "available");
        assert_eq!((probe.fresh, probe.cleared), (fresh, fresh), "seq {seq}");
        assert_eq!(status.health[i].overlay.is_none(), fresh, "seq {seq}");
    }
    // The waiter got the cleared provider.
    assert_eq!(p.edge.status(p.now).oldest_wait, None);
}

/// Opens a tunnel on a fresh lease for model `m`; the lease, its sink and the stream id.
fn tunnel_on_lease(
    p: &mut Pair,
    run_id: &str,
) -> (iop_edge_core::pool::Lease, Buf<TunnelEvent>, u64) {
    let Admit::Granted(a) = p
        .edge
        .admit(p.now, "m", ContextSize::Standard, Duration::from_secs(5))
        .unwrap()
    else {
        panic!("capacity")
    };
    let buf = Buf::new();
    let o = p
        .edge
        .send_admitted(
            p.now,
            &a.lease,
            Open::Tunnel {
                request: tunnel_request(run_id),
                sink: buf.clone(),
                response_wait: None,
            },
        )
        .unwrap();
    p.settle();
    (a.lease, buf, o.stream_id)
}

fn stall_terminal(stream_id: u64, evidence: FailureEvidence) -> RuntimeFrame {
    tunnel_frame(
        stream_id,
        1,
        TunnelPayload::Error {
            error: "stalled".into(),
            execution_failure: Some(evidence),
        },
    )
}

/// `provider_id`'s status in the Edge's snapshot.
fn status_of(p: &Pair, provider_id: &str) -> String {
    p.edge
        .snapshot()
        .into_iter()
        .find(|s| s.provider_id == provider_id)
        .map(|s| s.status)
        .unwrap_or_default()
}

/// Seed 000 terminal handoff: a stall terminal whose evidence names another adapter or
/// target, whose evidence is rejected when decoded, or that arrives on a superseded
/// connection gets no handoff metadata and lowers no overlay; its provider lease is still
/// released exactly once (at the terminal, or by the fence that ended the stream).
#[test]
fn a_handoff_that_does_not_match_its_lease_changes_no_health_and_releases_once() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    // Valid on the Node's side, but an empty run id is rejected when the Edge decodes it.
    let rejected = {
        let FailureEvidence::Valid(mut f) = stall_evidence("p1-adapter", "p1-target", 5) else {
            unreachable!()
        };
        f.run_id = String::new();
        FailureEvidence::Valid(f)
    };
    for (what, evidence) in [
        (
            "another adapter",
            stall_evidence("other-adapter", "p1-target", 5),
        ),
        (
            "another target",
            stall_evidence("p1-adapter", "other-target", 6),
        ),
        ("rejected evidence", rejected),
    ] {
        let (lease, buf, stream) = tunnel_on_lease(&mut p, "s1");
        assert_eq!(p.leases(), 1);
        p.inject(n1, stall_terminal(stream, evidence));
        let got = buf.read_all();
        let [TunnelEvent::Frame(Delivery::Error { metadata, .. })] = got.as_slice() else {
            panic!("{what}: one error terminal, got {got:?}")
        };
        for key in ["recovery_handoff", "provider_id", "provider_health"] {
            assert!(!metadata.contains_key(key), "{what}: {key} in {metadata:?}");
        }
        assert_eq!(p.leases(), 0, "{what}: released at the terminal");
        p.edge.release(p.now, lease.id);
        assert_eq!(p.leases(), 0, "{what}: the caller's release is a no-op");
        assert_eq!(
            p.counts.set_unavailable.load(Ordering::Relaxed),
            0,
            "{what}"
        );
        assert_eq!(status_of(&p, "p1"), "available", "{what}");
    }

    // A superseded connection's terminal: the fence released the lease; the late terminal
    // (matching evidence, a fresh sequence) reaches nothing and lowers nothing.
    let (lease, buf, stream) = tunnel_on_lease(&mut p, "s2");
    let _n1b = p.connect("node-1");
    assert_eq!(buf.read_all(), vec![TunnelEvent::NodeDisconnected]);
    assert_eq!(p.leases(), 0, "released by the fence");
    p.inject(
        n1,
        stall_terminal(stream, stall_evidence("p1-adapter", "p1-target", 50)),
    );
    p.edge.release(p.now, lease.id);
    assert_eq!(p.leases(), 0);
    assert_eq!(p.counts.set_unavailable.load(Ordering::Relaxed), 0);
    assert_eq!(status_of(&p, "p1"), "available");
    // The new generation has its whole capacity.
    assert!(matches!(
        p.edge
            .admit(p.now, "m", ContextSize::Standard, Duration::from_secs(5)),
        Ok(Admit::Granted(_))
    ));
}

/// Sends a CAPABILITIES recovery probe to link `i` and answers it with `answer`; what the
/// Edge made of it.
fn recovery(p: &mut Pair, i: usize, answer: NodeCommandResponse) -> Answer {
    let ticket = p.edge.recover(p.now, "node-1").unwrap();
    p.settle();
    let probe = p.inbox(i).pop().unwrap();
    p.take_events();
    p.node_send(
        i,
        RuntimeFrame::correlated(
            probe.correlation_id,
            RuntimeMessage::NodeCommandResponse(answer),
        ),
    );
    p.take_events()
        .into_iter()
        .find_map(|e| match e {
            Event::Answered { ticket: t, answer } if t == ticket => Some(answer),
            _ => None,
        })
        .expect("the probe was answered")
}

fn capability(adapter: &str, target: &str, status: ProviderStatus, seq: u64) -> Capability {
    Capability {
        adapter_key: adapter.into(),
        target: target.into(),
        provider_status: status,
        health_observation_seq: seq,
        adapter: "openai_compat".into(),
        instance_key: adapter.into(),
    }
}

fn answer(ok: bool, capabilities: Vec<Capability>) -> NodeCommandResponse {
    NodeCommandResponse {
        ok,
        error: if ok {
            String::new()
        } else {
            "probe failed".into()
        },
        capabilities,
        result: BTreeMap::new(),
    }
}

/// Seed 000 CAPABILITIES recovery: empty, failed, mismatched (adapter or target), stale,
/// unknown and unavailable answers never clear an overlay; only a fresher `available` answer
/// naming exactly one provider of the Node does (the control at the end).
#[test]
fn only_a_fresh_exact_available_answer_clears_an_overlay() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let (_, _, stream) = tunnel_on_lease(&mut p, "s1");
    p.node_send(
        n1,
        stall_terminal(stream, stall_evidence("p1-adapter", "p1-target", 5)),
    );
    assert_eq!(status_of(&p, "p1"), "unavailable");
    let available = ProviderStatus::Available;
    for (what, resp) in [
        ("empty", answer(true, vec![])),
        (
            "failed",
            answer(
                false,
                vec![capability("p1-adapter", "p1-target", available, 6)],
            ),
        ),
        (
            "another adapter",
            answer(
                true,
                vec![capability("p2-adapter", "p1-target", available, 7)],
            ),
        ),
        (
            "another target",
            answer(
                true,
                vec![capability("p1-adapter", "p2-target", available, 8)],
            ),
        ),
        (
            "stale",
            answer(
                true,
                vec![capability("p1-adapter", "p1-target", available, 5)],
            ),
        ),
        (
            "unknown",
            answer(
                true,
                vec![capability(
                    "p1-adapter",
                    "p1-target",
                    ProviderStatus::Unknown,
                    9,
                )],
            ),
        ),
        (
            "unavailable",
            answer(
                true,
                vec![capability(
                    "p1-adapter",
                    "p1-target",
                    ProviderStatus::Unavailable,
                    10,
                )],
            ),
        ),
        // Stale again: 10 was seen by the unavailable answer.
        (
            "stale after unavailable",
            answer(
                true,
                vec![capability("p1-adapter", "p1-target", available, 10)],
            ),
        ),
    ] {
        let got = recovery(&mut p, n1, resp);
        assert!(
            matches!(got, Answer::Recovered(Ok(0)) | Answer::Recovered(Err(_))),
            "{what}: {got:?}"
        );
        assert_eq!(p.counts.cleared.load(Ordering::Relaxed), 0, "{what}");
        assert_eq!(status_of(&p, "p1"), "unavailable", "{what}");
    }
    let got = recovery(
        &mut p,
        n1,
        answer(
            true,
            vec![capability("p1-adapter", "p1-target", available, 11)],
        ),
    );
    assert_eq!(got, Answer::Recovered(Ok(1)));
    assert_eq!(status_of(&p, "p1"), "available");
}

/// An answer that matches two providers of the Node (same adapter instance and target) is
/// ambiguous and clears neither overlay.
#[test]
fn an_ambiguous_recovery_answer_clears_nothing() {
    use iop_edge_core::pool::{PoolConfig, ProviderKind};
    let mut twin = common::provider("node-1", "p1b", ProviderKind::OpenAiCompat);
    twin.adapter = "p1-adapter".into();
    twin.target = "p1-target".into();
    let providers = vec![
        common::provider("node-1", "p1", ProviderKind::OpenAiCompat),
        twin,
    ];
    let models = vec![(
        "m".to_owned(),
        providers.iter().map(|p| p.key.clone()).collect(),
    )];
    let mut p = Pair::with_pool(iop_edge_core::pool::Pool::new(PoolConfig {
        providers,
        models,
        max_queue: 4,
    }));
    let n1 = p.connect("node-1");
    let (_, _, stream) = tunnel_on_lease(&mut p, "s1");
    p.node_send(
        n1,
        stall_terminal(stream, stall_evidence("p1-adapter", "p1-target", 5)),
    );
    assert_eq!(status_of(&p, "p1"), "unavailable");
    let got = recovery(
        &mut p,
        n1,
        answer(
            true,
            vec![capability(
                "p1-adapter",
                "p1-target",
                ProviderStatus::Available,
                6,
            )],
        ),
    );
    assert_eq!(got, Answer::Recovered(Ok(0)));
    assert_eq!(p.counts.cleared.load(Ordering::Relaxed), 0);
    assert_eq!(status_of(&p, "p1"), "unavailable");
}

/// Command and refresh correlation: an answer with an unknown correlation id, or of the other
/// kind, is not an answer; the right one is, once.
#[test]
fn commands_and_refreshes_are_matched_by_correlation_id_and_kind() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let command = p
        .edge
        .command(
            p.now,
            "node-1",
            NodeCommandRequest {
                kind: NodeCommandKind::Transport,
                adapter: String::new(),
                target: String::new(),
            },
        )
        .unwrap();
    let refresh = p
        .edge
        .refresh(
            p.now,
            "node-1",
            NodeConfigPayload {
                revision: 2,
                ..Default::default()
            },
        )
        .unwrap();
    p.settle();
    let inbox = p.inbox(n1);
    assert_eq!(inbox.len(), 2);
    let refresh_answer = |id| {
        RuntimeFrame::correlated(
            id,
            RuntimeMessage::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
                outcome: ConfigRefreshOutcome::Applied,
                reason: String::new(),
                revision: 2,
            }),
        )
    };
    let command_answer = |id| {
        RuntimeFrame::correlated(
            id,
            RuntimeMessage::NodeCommandResponse(NodeCommandResponse {
                ok: true,
                ..Default::default()
            }),
        )
    };
    p.take_events();
    p.node_send(n1, command_answer(999));
    p.node_send(n1, refresh_answer(command));
    p.node_send(n1, command_answer(refresh));
    assert!(p.take_events().is_empty(), "no answer matched");
    p.node_send(n1, command_answer(command));
    p.node_send(n1, refresh_answer(refresh));
    p.node_send(n1, command_answer(command));
    let events = p.take_events();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        matches!(&events[0], Event::Answered { ticket, answer: Answer::Command(Ok(_)) } if *ticket == command)
    );
    assert!(
        matches!(&events[1], Event::Answered { ticket, answer: Answer::Refresh(Ok(r)) } if *ticket == refresh && r.revision == 2)
    );
}

/// Registration timeout and liveness in virtual time: a connection that never registers is
/// closed after the handshake timeout; a ready Node that goes silent is fenced after its idle
/// timeout, ending its streams.
#[test]
fn silent_connections_are_closed_and_silent_nodes_fenced_on_time() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let silent = p.edge.accept(p.now, "node-2");
    p.settle();
    p.advance(Duration::from_millis(9_999));
    assert!(
        !p.take_events()
            .iter()
            .any(|e| matches!(e, Event::CloseConnection { conn, .. } if *conn == silent))
    );
    p.advance(Duration::from_millis(2));
    assert!(
        p.take_events()
            .iter()
            .any(|e| matches!(e, Event::CloseConnection { conn, .. } if *conn == silent))
    );
    // node-1 stops talking (its transport half-dead: frames from it are lost).
    let buf = Buf::new();
    p.edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r1"),
                sink: buf.clone(),
            },
        )
        .unwrap();
    p.settle();
    p.links[n1].down = true;
    p.advance(Duration::from_secs(31));
    assert!(
        p.edge.ready_nodes().is_empty(),
        "fenced by the idle timeout"
    );
    assert_eq!(buf.read_all()[0].error, NODE_DISCONNECTED);
}

/// A run stream ended by a slow consumer carries the documented reason.
#[test]
fn the_slow_consumer_terminal_of_a_run_names_its_reason() {
    let mut p = Pair::new();
    let n1 = p.connect("node-1");
    let buf = Buf::new();
    let o = p
        .edge
        .open(
            p.now,
            "node-1",
            Open::Run {
                request: run_request("r1"),
                sink: buf.clone(),
            },
        )
        .unwrap();
    p.settle();
    let big = "y".repeat(MAX_BUFFER);
    p.node_send(
        n1,
        RuntimeFrame::on_stream(
            o.stream_id,
            RuntimeMessage::RunEvent(run_event(RunEventKind::Delta, &big)),
        ),
    );
    let got = buf.read_all();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].error, SLOW_CONSUMER);
}

/// **one terminal**, and a Node's connection outlives what its application answers: an error
/// text over `MAX_TEXT_LEN` (the Edge's validation would refuse it and close the connection), a
/// `COMPLETE` larger than the frames both ends read (it would fail the Node's writer), and a
/// tunnel header the Edge refuses are made to fit by the Node's session. Each stream ends with
/// the Node's own `ERROR`, saying why; the same generation serves the next run.
#[test]
fn answers_the_edge_could_not_take_end_their_stream_not_the_connection() {
    const FRAME: usize = 16 * 1024;
    let mut p = Pair::new();
    p.codec = FrameCodec::with_max_frame_len(FRAME);
    p.node_config.max_frame_len = FRAME;
    let n1 = p.connect("node-1");
    let g1 = p.generation("node-1");
    let run = |p: &mut Pair, id: &str, buf: &Buf<RunEvent>| {
        let o = (p.edge)
            .open(
                p.now,
                "node-1",
                Open::Run {
                    request: run_request(id),
                    sink: buf.clone(),
                },
            )
            .unwrap();
        p.settle();
        o.stream_id
    };

    let buf = Buf::new();
    let stream = run(&mut p, "r1", &buf);
    let mut ev = RunEvent::new(RunEventKind::Error);
    ev.error = "é".repeat(5_000);
    p.node_send(
        n1,
        RuntimeFrame::on_stream(stream, RuntimeMessage::RunEvent(ev)),
    );
    let got = buf.read_all();
    assert!(
        matches!(&got[..], [e] if e.kind == RunEventKind::Error
            && e.error.len() == iop_wire::validate::MAX_TEXT_LEN
            && e.error.chars().all(|c| c == 'é')),
        "the text cut on a character: {:?}",
        got.iter()
            .map(|e| (e.kind, e.error.len()))
            .collect::<Vec<_>>()
    );
    assert!(p.links[n1].replaced.is_empty(), "cut, not replaced");

    let buf = Buf::new();
    let stream = run(&mut p, "r2", &buf);
    let mut complete = RunEvent::new(RunEventKind::Complete);
    complete
        .metadata
        .insert("openai_tool_calls".into(), "x".repeat(2 * FRAME));
    p.node_send(
        n1,
        RuntimeFrame::on_stream(stream, RuntimeMessage::RunEvent(complete)),
    );
    let got = buf.read_all();
    assert!(
        matches!(&got[..], [e] if e.kind == RunEventKind::Error && e.error.contains("too large")),
        "{got:?}"
    );
    assert!(
        matches!(&p.links[n1].replaced[..], [(s, r)] if *s == stream && r.contains("too large"))
    );

    let sink = Buf::new();
    let opened = p.open_tunnel("node-1", "t1", &sink);
    let bad_start = TunnelPayload::ResponseStart {
        status: 200,
        headers: vec![iop_wire::runtime::Header {
            name: "bad name".into(),
            value: "v".into(),
        }],
    };
    p.node_send(n1, tunnel_frame(opened.stream_id, 1, bad_start));
    let got = sink.read_all();
    assert!(
        matches!(&got[..], [TunnelEvent::Frame(Delivery::Error { error, .. })] if error.contains("not valid")),
        "{got:?}"
    );
    assert_eq!(p.links[n1].replaced.len(), 2);

    assert!(!p.links[n1].down, "the connection is up");
    assert_eq!(p.generation("node-1"), g1, "the same generation");
    let buf = Buf::new();
    let stream = run(&mut p, "r3", &buf);
    p.node_send(
        n1,
        RuntimeFrame::on_stream(
            stream,
            RuntimeMessage::RunEvent(run_event(RunEventKind::Complete, "")),
        ),
    );
    assert!(matches!(&buf.read_all()[..], [e] if e.kind == RunEventKind::Complete));
}
