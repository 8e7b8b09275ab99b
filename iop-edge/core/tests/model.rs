//! Exhaustive model check of the Edge–Node runtime wire (seed 000) with `stateright`: the real
//! [`EdgeCore`] (its `Registry` and provider `Pool`) and real Node sessions
//! ([`NodeSession`]), with the network between them made explicit.
//!
//! Every connection has two FIFO queues of frames in flight (Edge → Node, Node → Edge), and
//! each delivery is its own step, so the checker interleaves them with everything else: a
//! Node's second connection registering while the first one's frames are still in flight, a
//! terminal racing a fence, a transport break seen by the Node before the Edge, a queued
//! request granted while its candidate is being superseded. From the empty mesh the checker
//! applies, in every order, within the [`Bounds`]:
//!
//! - `Connect(n)`: Node `n` dials again (a new connection, so a new generation once it
//!   registers): its session queues `RegisterRequest`, and later `NodeReadyRequest`;
//! - `ToEdge(l)` / `ToNode(l)`: the next frame in flight on connection `l` arrives;
//! - `Cut(l)`: the transport breaks; the Node sees it at once, the Edge only at
//!   `EdgeEof(l)`, after the frames already in flight to it (the Node learns of an Edge-side
//!   close at `NodeEof(l)`, likewise);
//! - `Dispatch` / `DispatchTunnel`: a caller asks the pool for model `m` (admit, then send the
//!   run or the provider tunnel on the lease in the same task, as `iop-edge` does; a queued one
//!   is sent when it is granted);
//! - `Complete(l, r)`: the Node's application ends run or tunnel `r` it received on `l` (a
//!   run's `Complete`; a tunnel's response start and END, two frames, each delivered on its
//!   own);
//! - `Command(n)` / `AnswerCommand(l, c)`: the Edge sends a command to ready Node `n`; the
//!   Node's application answers command `c` it received on `l`;
//! - `CallerGone(s)`: the caller of stream `s` goes away (`end_stream`);
//! - `Grant(s)`: the reader of tunnel `s` gives credit back (`grant`), before or after its
//!   terminal (a grant may cross it);
//! - `Tick`: virtual time jumps to the next timer of any machine (heartbeat silence,
//!   handshake timeout, queue wait), which fires.
//!
//! Invariants, each named after the seed rule it encodes (a transition that breaks one is
//! recorded in the state and reported with the path to it):
//!
//! - **one-owner**: the registry's owner of a Node id is a connection of that Node that the Edge
//!   still has open; a connection the Edge keeps and its Node believes ready is the owner until
//!   a newer connection of that Node registers; a Node's ready generation only moves forward;
//! - **no-stale-generation-routed**: an event the Node sent reaches a stream only from the
//!   connection and generation the stream was opened on, while that generation is current; a
//!   frame from a superseded or closed connection changes no stream and no lease;
//! - **one-terminal**: no stream ever gets two terminals; at quiescence (every connection dead
//!   on both sides, nothing in flight) every stream whose caller stayed has exactly one;
//! - **tunnel-frames-in-order**: the Edge never reports an ordering violation for a Node that
//!   numbers its frames correctly;
//! - **command-answered-once**: every command gets exactly one answer (the Node's, or a failure
//!   when its generation is fenced; all of them by quiescence), and a Node's answer completes
//!   it only from the connection and generation it was sent to (under
//!   **no-stale-generation-routed**);
//! - **lease-released-once**: a stream's provider lease is held exactly while the stream has no
//!   terminal and its caller stays, and the pool holds no other lease;
//! - **registration-completes**: a connection both sides keep, with nothing in flight and no
//!   newer connection of its Node, is ready, and the Edge closes a Node's connection on its own
//!   only when a newer connection of that Node exists or a timer fired (no handshake is lost
//!   in an interleaving);
//! - **no-stranded-waiter**: no request waits in the queue while a ready Node's provider has
//!   free capacity (capacity counted from this model's own streams, not the pool's view);
//! - **credit-only-when-announced**: a tunnel reaches a Node with a credit window, and a
//!   `StreamWindowUpdate` reaches it at all, only if that Node registered with
//!   `stream_credit` (Node 1 does, Node 2 is an older Node that does not); every tunnel to
//!   Node 1 has a window;
//! - **credit-on-its-stream**: an update reaches a Node only on the connection its tunnel went
//!   to, for that tunnel;
//! - **no-protocol-violation**: no Node session is ever closed for a protocol violation (an
//!   update the Node did not expect would be one).
//!
//! States are fingerprinted by the machines' full `Debug` state ([`EdgeCore::state`]; the
//! registry's, pool's and sessions' maps are ordered, so the same state prints the same) plus
//! the model's own bookkeeping.
//!
//! ## Bounds, state space, time
//!
//! The test command runs [`Bounds::SMALL`]: Node 2 connected and ready at the start, Node 1
//! dialling twice (two connections, two generations), two dispatches through a pool of one
//! provider per Node (capacity 1, a queue of 1), one transport cut, no timer jumps: 160,787
//! unique states (491,607 generated) in ≈25 s in a debug build on 2 cores (≈9 s in release).
//! It also runs [`Bounds::TIMERS`]: one timer jump (every machine's next timer fires:
//! heartbeat silence, handshake and queue deadlines), Node 1 dialling once, two dispatches, no
//! cut: 139,396 unique states (500,582 generated) in ≈15 s in a debug build. Tunnels and
//! commands get two bounds of their own: [`Bounds::WIRE`] (Node 1 ready at the start, a run, a
//! tunnel, a command and one credit grant, one timer jump, one cut: 317,671 states) and
//! [`Bounds::REDIAL`] (the same with Node 1 dialling once more and no timer jump: 343,155
//! states). One bound with all of them (registration, a redial, a timer jump, a
//! run, a tunnel and a command) ran past ten minutes here, so each bound drops what another
//! covers. The four run in parallel in ≈60 s on 2 cores (WIRE and REDIAL ≈35–40 s each).
//! `EDGE_MODEL=large` runs [`Bounds::LARGE`] by hand (both Nodes dialling twice, three
//! dispatches, two cuts, one timer jump: heartbeats, handshake and queue deadlines), and
//! `EDGE_MODEL_BOUNDS=r1,r2,c1,c2,dispatches,ticks,cuts[,tunnels,commands,grants]` any other size. Timer jumps multiply
//! the space most (every machine's pings become frames in flight).
//!
//! ## Does it catch bugs?
//!
//! Checked against a deliberately broken machine (the change made, the checker run, the
//! change reverted): `Registry::drop_conn` made to remove the Node's owner entry whatever
//! connection closed (a "release on a stale close": the owner looked up by the closing
//! connection's Node id instead of `current_owner_of(conn)`). The checker found
//! **registration-completes** broken (a 20-step path: Node 1 dials twice, the second connection
//! registers, supersedes and closes the first, and that close drops the second's pending
//! registration, so the Edge then closes a connection no newer one superseded). Before the
//! property existed, the same break went unnoticed by the safety rules alone (the Node just
//! never became ready again), which is why the model also states the liveness of the handshake.
//!
//! For tunnels and commands: a fence made not to fail its generation's pending commands → "one
//! command answer at quiescence" fails (`WIRE`, 18 steps). Dropping only the generation check
//! when a command's answer is matched (`take_pending`) is *not* caught, and cannot be: a
//! superseded connection's frames never reach the matching (the Edge ignores them), and its
//! fence already failed the command.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;
use common::NODES;

/// Which Nodes register with `stream_credit`: Node 1 does, Node 2 is an older Node.
const STREAM_CREDIT: [bool; 2] = [true, false];
use iop_edge_core::pool::ContextSize;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_edge_core::pool::LeaseId;
use iop_edge_core::registry::{ConnId, FenceCause, Generation};
use iop_edge_core::{
    Admit, Answer, CoreConfig, EdgeCore, Event, Level, NoObserver, Open, Sinks, StreamSink,
    TunnelEvent,
};
use iop_wire::node::{CloseReason, NodeEvent, NodeSession, NodeSessionConfig};
use iop_wire::runtime::{
    NodeCommandKind, NodeCommandRequest, NodeCommandResponse, RegisterRequest, RunEvent,
    RunEventKind, RuntimeFrame, RuntimeMessage, TunnelPayload,
};
use iop_wire::tunnel_order::TunnelWriter;
use stateright::{Checker, Model, Property};

/// What the Node's application writes into its terminals (the Edge's own say otherwise).
const FROM_NODE: &str = "from-node";

// === Sinks: a token per stream; what the machine pushes is logged for the model ===

/// What the machine pushed into a stream, as the checks read it.
#[derive(Clone, Copy, Debug)]
struct Pushed {
    /// Written by the Node's application (a run event it sent, a tunnel frame), not by the
    /// Edge itself.
    from_node: bool,
    terminal: bool,
    /// A tunnel ordering violation (the model's Node numbers its frames correctly).
    violation: bool,
}

thread_local! {
    static PUSHED: RefCell<Vec<(u32, Pushed)>> = const { RefCell::new(Vec::new()) };
}

#[derive(Clone, Debug)]
struct Tok(u32);

impl Tok {
    fn log(&self, p: Pushed) {
        PUSHED.with(|v| v.borrow_mut().push((self.0, p)));
    }
}

fn run_pushed(ev: &RunEvent) -> Pushed {
    Pushed {
        from_node: ev.error == FROM_NODE || ev.delta == FROM_NODE,
        terminal: ev.kind.is_terminal(),
        violation: false,
    }
}

fn tunnel_pushed(ev: &TunnelEvent) -> Pushed {
    Pushed {
        from_node: matches!(ev, TunnelEvent::Frame(_)),
        terminal: ev.is_terminal(),
        violation: matches!(ev, TunnelEvent::Violation(_)),
    }
}

impl StreamSink<RunEvent> for Tok {
    fn push(&self, item: RunEvent, _size: usize) -> Option<Level> {
        self.log(run_pushed(&item));
        // The reader keeps up (slow consumers are the pair harness's business).
        Some(Level::default())
    }
    fn replace_with(&self, item: RunEvent) {
        self.log(run_pushed(&item));
    }
    fn level(&self) -> Level {
        Level::default()
    }
}

impl StreamSink<TunnelEvent> for Tok {
    fn push(&self, item: TunnelEvent, _size: usize) -> Option<Level> {
        self.log(tunnel_pushed(&item));
        Some(Level::default())
    }
    fn replace_with(&self, item: TunnelEvent) {
        self.log(tunnel_pushed(&item));
    }
    fn level(&self) -> Level {
        Level::default()
    }
}

#[derive(Clone, Debug)]
struct ModelSinks;

impl Sinks for ModelSinks {
    type Run = Tok;
    type Tunnel = Tok;
}

// === The mesh ===

#[derive(Clone, Copy, Debug)]
struct Bounds {
    /// Connections each Node has, registered and ready, when the exploration starts.
    ready_at_start: [u8; 2],
    /// Connections each Node may open during the exploration.
    conns_per_node: [u8; 2],
    /// Runs dispatched through the pool.
    dispatches: u8,
    /// Tunnels dispatched through the pool.
    tunnels: u8,
    /// Commands sent to a Node.
    commands: u8,
    /// Credit grants by tunnel readers.
    grants: u8,
    ticks: u8,
    cuts: u8,
}

impl Bounds {
    const SMALL: Self = Self {
        ready_at_start: [0, 1],
        conns_per_node: [2, 0],
        dispatches: 2,
        tunnels: 0,
        commands: 0,
        grants: 0,
        ticks: 0,
        cuts: 1,
    };
    /// What the test command runs beside [`Bounds::SMALL`]: one timer jump (heartbeat
    /// silence, handshake and queue deadlines all due at once in virtual time), Node 1 dialling
    /// once, two dispatches, no cut.
    const TIMERS: Self = Self {
        ready_at_start: [0, 1],
        conns_per_node: [1, 0],
        dispatches: 2,
        tunnels: 0,
        commands: 0,
        grants: 0,
        ticks: 1,
        cuts: 0,
    };
    /// What the test command runs third: a run, a tunnel and a command on Node 1, ready at the
    /// start (its registration is `SMALL`'s business), one timer jump, one cut.
    const WIRE: Self = Self {
        ready_at_start: [1, 0],
        conns_per_node: [0, 0],
        dispatches: 1,
        tunnels: 1,
        commands: 1,
        grants: 1,
        ticks: 1,
        cuts: 1,
    };
    /// And fourth: the same with Node 1 dialling once more (its new connection supersedes the
    /// first with a run, a tunnel or a command in flight) and no timer jump.
    const REDIAL: Self = Self {
        ready_at_start: [1, 0],
        conns_per_node: [1, 0],
        dispatches: 1,
        tunnels: 1,
        commands: 1,
        grants: 1,
        ticks: 0,
        cuts: 1,
    };
    const LARGE: Self = Self {
        ready_at_start: [0, 0],
        conns_per_node: [2, 2],
        dispatches: 3,
        tunnels: 1,
        commands: 1,
        grants: 1,
        ticks: 1,
        cuts: 2,
    };
}

#[derive(Clone, Debug)]
struct Link {
    node: usize,
    conn: ConnId,
    session: NodeSession,
    to_node: VecDeque<RuntimeFrame>,
    to_edge: VecDeque<RuntimeFrame>,
    /// The Node still has this transport.
    node_up: bool,
    /// The Edge still has this connection.
    edge_up: bool,
    /// The generation the Edge bound this connection to, once it registered.
    generation: Option<Generation>,
    /// Runs and tunnels the Node's application received: (stream id, run id, answered,
    /// a tunnel).
    runs: Vec<(u64, String, bool, bool)>,
    /// Commands the Node's application received: (correlation id, answered).
    commands: Vec<(u64, bool)>,
}

#[derive(Clone, Debug)]
struct Stream {
    tok: u32,
    stream_id: u64,
    node: usize,
    generation: Generation,
    lease: LeaseId,
    tunnel: bool,
    terminals: u8,
    caller_gone: bool,
}

/// A command the Edge sent: to which Node's generation, and how many answers it got.
#[derive(Clone, Debug)]
struct Command {
    ticket: u64,
    node: usize,
    generation: Generation,
    answers: u8,
}

#[derive(Clone, Debug)]
struct Mesh {
    now: Instant,
    edge: EdgeCore<ModelSinks>,
    links: Vec<Link>,
    streams: Vec<Stream>,
    /// Queued admissions: (request, a tunnel).
    queued: Vec<(iop_edge_core::pool::RequestId, bool)>,
    commands: Vec<Command>,
    opened: [u8; 2],
    dispatches: u8,
    tunnels: u8,
    grants: u8,
    ticks: u8,
    cuts: u8,
    last_ready: [Option<Generation>; 2],
    broken: Option<&'static str>,
}

impl Mesh {
    /// Everything, in a form where equal states are equal (ordered maps throughout).
    fn key(&self) -> String {
        format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{}|{}|{}|{}|{}|{:?}|{:?}",
            self.now,
            self.edge.state(),
            self.links,
            self.streams,
            self.queued,
            self.commands,
            self.opened,
            self.dispatches,
            self.tunnels,
            self.grants,
            self.ticks,
            self.cuts,
            self.last_ready,
            self.broken
        )
    }
}

impl Hash for Mesh {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.key().hash(h);
    }
}

impl PartialEq for Mesh {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

const QUEUE_WAIT: Duration = Duration::from_secs(5);

impl Mesh {
    fn new(now: Instant) -> Self {
        let registry = common::registry();
        let pool = common::pool(1);
        Self {
            now,
            edge: EdgeCore::new(
                registry,
                Some(pool),
                CoreConfig::default(),
                Arc::new(NoObserver),
            ),
            links: Vec::new(),
            streams: Vec::new(),
            queued: Vec::new(),
            commands: Vec::new(),
            opened: [0; 2],
            dispatches: 0,
            tunnels: 0,
            grants: 0,
            ticks: 0,
            cuts: 0,
            last_ready: [None; 2],
            broken: None,
        }
    }

    fn broke(&mut self, rule: &'static str) {
        self.broken.get_or_insert(rule);
    }

    /// What the machine pushed into streams since the last call, checked and counted.
    /// `from`: the link whose frame was being delivered, and whether it was current.
    fn take_pushed(&mut self, from: Option<(usize, bool)>) {
        let pushed = PUSHED.with(|p| std::mem::take(&mut *p.borrow_mut()));
        for (tok, ev) in pushed {
            let Some(si) = self.streams.iter().position(|s| s.tok == tok) else {
                self.broke("no-stale-generation-routed");
                continue;
            };
            if ev.violation {
                self.broke("tunnel-frames-in-order");
            }
            if ev.from_node {
                let ok = from.is_some_and(|(li, current)| {
                    let l = &self.links[li];
                    current
                        && l.node == self.streams[si].node
                        && l.generation == Some(self.streams[si].generation)
                });
                if !ok {
                    self.broke("no-stale-generation-routed");
                }
            }
            if ev.terminal {
                let s = &mut self.streams[si];
                s.terminals += 1;
                if s.terminals > 1 {
                    self.broke("one-terminal");
                }
            }
        }
    }

    /// Moves the machines' output into the network and the callers, until nothing is left.
    fn drain(&mut self) {
        loop {
            let mut moved = false;
            while let Some((conn, frame)) = self.edge.poll_transmit() {
                moved = true;
                if let Some(l) = self.links.iter_mut().find(|l| l.conn == conn)
                    && l.edge_up
                {
                    l.to_node.push_back(frame);
                }
            }
            while let Some(event) = self.edge.poll_event() {
                moved = true;
                match event {
                    Event::CloseConnection { conn, cause } => {
                        // The Edge closes a Node's connection on its own only when a newer
                        // connection of that Node registered, or a timer said so.
                        let timed = matches!(
                            cause,
                            FenceCause::HeartbeatTimeout | FenceCause::HandshakeTimeout
                        );
                        if let Some(l) = self.links.iter().find(|l| l.conn == conn) {
                            // Registration order makes generations, not dial order.
                            let newer = self.links.iter().any(|o| {
                                o.node == l.node
                                    && o.generation.is_some()
                                    && o.generation > l.generation
                            });
                            if !timed && !newer {
                                self.broken.get_or_insert("registration-completes");
                            }
                        }
                        if let Some(l) = self.links.iter_mut().find(|l| l.conn == conn) {
                            l.edge_up = false;
                            l.to_edge.clear();
                        }
                    }
                    Event::Admitted { request, result } => {
                        let tunnel = self.queued.iter().any(|(r, t)| *r == request && *t);
                        self.queued.retain(|(r, _)| *r != request);
                        if let Ok(admitted) = result {
                            self.send_on(admitted.lease, tunnel);
                        }
                    }
                    Event::Answered { ticket, answer } => self.answered(ticket, &answer),
                    Event::Lifecycle(_) => {}
                }
            }
            self.take_pushed(None);
            for li in 0..self.links.len() {
                let now = self.now;
                let l = &mut self.links[li];
                while let Some(frame) = l.session.poll_transmit() {
                    moved = true;
                    if l.node_up {
                        l.to_edge.push_back(frame);
                    }
                }
                while let Some(event) = l.session.poll_event() {
                    moved = true;
                    match event {
                        NodeEvent::ApplyConfig { .. } => {
                            let _ = l.session.config_applied(now);
                        }
                        NodeEvent::Frame(frame) => match &frame.message {
                            RuntimeMessage::RunRequest(r)
                                if l.session.admit_run(&r.run_id).is_ok() =>
                            {
                                l.runs
                                    .push((frame.stream_id, r.run_id.clone(), false, false));
                            }
                            RuntimeMessage::ProviderTunnelRequest(r)
                                if l.session.admit_run(&r.run_id).is_ok() =>
                            {
                                if (r.credit_window > 0) != STREAM_CREDIT[l.node] {
                                    self.broken.get_or_insert("credit-only-when-announced");
                                }
                                l.runs
                                    .push((frame.stream_id, r.run_id.clone(), false, true));
                            }
                            RuntimeMessage::StreamWindowUpdate(_) => {
                                if !STREAM_CREDIT[l.node] {
                                    self.broken.get_or_insert("credit-only-when-announced");
                                }
                                if !l.runs.iter().any(|r| r.0 == frame.stream_id && r.3) {
                                    self.broken.get_or_insert("credit-on-its-stream");
                                }
                            }
                            RuntimeMessage::NodeCommandRequest(_) => {
                                l.commands.push((frame.correlation_id, false));
                            }
                            _ => {}
                        },
                        NodeEvent::Closed(reason) => {
                            if matches!(reason, CloseReason::ProtocolViolation(_)) {
                                self.broken.get_or_insert("no-protocol-violation");
                            }
                            l.node_up = false;
                            l.to_node.clear();
                        }
                        _ => {}
                    }
                }
            }
            if !moved {
                break;
            }
        }
        self.check_state();
    }

    /// Sends a run (or a tunnel) on a granted lease, in the caller's task.
    fn send_on(&mut self, lease: iop_edge_core::pool::Lease, tunnel: bool) {
        let tok = u32::try_from(self.streams.len()).unwrap();
        let node = NODES.iter().position(|n| *n == lease.key.node_id).unwrap();
        let id = format!("stream-{tok}");
        let open = if tunnel {
            Open::Tunnel {
                request: common::tunnel_request(&id),
                sink: Tok(tok),
                response_wait: None,
            }
        } else {
            Open::Run {
                request: common::run_request(&id),
                sink: Tok(tok),
            }
        };
        if let Ok(o) = self.edge.send_admitted(self.now, &lease, open) {
            self.streams.push(Stream {
                tok,
                stream_id: o.stream_id,
                node,
                generation: o.generation,
                lease: lease.id,
                tunnel,
                terminals: 0,
                caller_gone: false,
            });
        }
    }

    /// A command's answer: exactly one per ticket, and a Node's answer only from the
    /// connection and generation the command went to.
    fn answered(&mut self, ticket: u64, answer: &Answer) {
        let Some(c) = self.commands.iter_mut().find(|c| c.ticket == ticket) else {
            return self.broke("command-answered-once");
        };
        c.answers += 1;
        let (node, generation, answers) = (c.node, c.generation, c.answers);
        if answers > 1 {
            self.broke("command-answered-once");
        }
        match answer {
            Answer::Command(Ok(response)) => {
                let from = response
                    .result
                    .get("link")
                    .and_then(|l| l.parse::<usize>().ok())
                    .and_then(|l| self.links.get(l));
                let ok = from.is_some_and(|l| l.node == node && l.generation == Some(generation));
                if !ok {
                    self.broke("no-stale-generation-routed");
                }
            }
            Answer::Command(Err(_)) => {}
            _ => self.broke("command-answered-once"),
        }
    }

    /// The state invariants (see the module docs).
    fn check_state(&mut self) {
        for (n, node) in NODES.iter().enumerate() {
            for (conn, generation) in [
                self.edge.registry().ready_generation(node),
                self.edge.registry().pending_generation(node),
            ]
            .into_iter()
            .flatten()
            .map(|x| (x.0, x.1))
            {
                let ok = self
                    .links
                    .iter()
                    .any(|l| l.conn == conn && l.node == n && l.edge_up);
                if !ok {
                    self.broke("one-owner");
                }
                let _ = generation;
            }
            if let Some((_, g)) = self.edge.registry().ready_generation(node) {
                if self.last_ready[n].is_some_and(|last| g < last) {
                    self.broke("one-owner");
                }
                self.last_ready[n] = Some(g);
            }
        }
        // Nothing lost in the handshake: a connection both sides keep, with nothing in flight
        // and no newer connection of its Node, is ready.
        for l in &self.links {
            let settled = l.edge_up && l.node_up && l.to_edge.is_empty() && l.to_node.is_empty();
            let superseded = self
                .links
                .iter()
                .any(|o| o.node == l.node && o.generation.is_some() && o.generation > l.generation);
            if settled && !superseded && !l.session.is_ready() {
                self.broken.get_or_insert("registration-completes");
            }
        }
        // A connection the Edge keeps open and the Node believes ready is the owner, until a
        // newer connection of the same Node registers.
        for l in &self.links {
            if !(l.edge_up && l.node_up && l.session.is_ready()) {
                continue;
            }
            let superseded = self
                .links
                .iter()
                .any(|o| o.node == l.node && o.generation.is_some() && o.generation > l.generation);
            let owner = self.edge.registry().ready_generation(NODES[l.node]);
            if !superseded && owner != l.generation.map(|g| (l.conn, g)) {
                self.broken.get_or_insert("one-owner");
            }
        }
        let pool = self.edge.pool().expect("pool");
        let mut held = 0;
        for s in &self.streams {
            let should_hold = s.terminals == 0 && !s.caller_gone;
            if pool.lease(s.lease).is_some() != should_hold {
                self.broken.get_or_insert("lease-released-once");
            }
            held += usize::from(should_hold);
        }
        if pool.lease_count() != held {
            self.broken.get_or_insert("lease-released-once");
        }
        if !self.queued.is_empty() {
            for (n, node) in NODES.iter().enumerate() {
                let Some((_, g)) = self.edge.registry().ready_generation(node) else {
                    continue;
                };
                let busy = self.streams.iter().any(|s| {
                    s.node == n && s.generation == g && s.terminals == 0 && !s.caller_gone
                });
                if !busy {
                    self.broken.get_or_insert("no-stranded-waiter");
                }
            }
        }
    }

    fn quiescent(&self) -> bool {
        self.links
            .iter()
            .all(|l| !l.node_up && !l.edge_up && l.to_edge.is_empty() && l.to_node.is_empty())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Connect(usize),
    ToEdge(usize),
    ToNode(usize),
    Cut(usize),
    EdgeEof(usize),
    NodeEof(usize),
    Dispatch,
    DispatchTunnel,
    Command(usize),
    AnswerCommand(usize, usize),
    Complete(usize, usize),
    CallerGone(usize),
    Grant(usize),
    Tick,
}

struct MeshModel {
    bounds: Bounds,
    start: Instant,
}

impl Model for MeshModel {
    type State = Mesh;
    type Action = Action;

    fn init_states(&self) -> Vec<Mesh> {
        let mut m = Mesh::new(self.start);
        // Nodes connected and ready before the exploration starts (their registration is
        // explored when `conns_per_node` lets them dial).
        for n in 0..NODES.len() {
            for _ in 0..self.bounds.ready_at_start[n] {
                m = self.next_state(&m, Action::Connect(n)).expect("connects");
                m.opened[n] -= 1;
                while let Some(a) = [
                    Action::ToEdge(m.links.len() - 1),
                    Action::ToNode(m.links.len() - 1),
                ]
                .into_iter()
                .find(|a| match a {
                    Action::ToEdge(i) => !m.links[*i].to_edge.is_empty(),
                    Action::ToNode(i) => !m.links[*i].to_node.is_empty(),
                    _ => false,
                }) {
                    m = self.next_state(&m, a).expect("settles");
                }
                assert!(m.links.last().expect("a link").session.is_ready());
            }
        }
        vec![m]
    }

    fn actions(&self, m: &Mesh, out: &mut Vec<Action>) {
        if m.broken.is_some() {
            return;
        }
        for n in 0..NODES.len() {
            if m.opened[n] < self.bounds.conns_per_node[n] {
                out.push(Action::Connect(n));
            }
        }
        for (i, l) in m.links.iter().enumerate() {
            if l.edge_up && !l.to_edge.is_empty() {
                out.push(Action::ToEdge(i));
            }
            if l.node_up && !l.to_node.is_empty() {
                out.push(Action::ToNode(i));
            }
            if l.node_up && m.cuts < self.bounds.cuts {
                out.push(Action::Cut(i));
            }
            if l.edge_up && !l.node_up && l.to_edge.is_empty() {
                out.push(Action::EdgeEof(i));
            }
            if l.node_up && !l.edge_up && l.to_node.is_empty() {
                out.push(Action::NodeEof(i));
            }
            if l.node_up && l.session.is_ready() {
                for (r, (_, _, answered, _)) in l.runs.iter().enumerate() {
                    if !answered {
                        out.push(Action::Complete(i, r));
                    }
                }
                for (c, (_, answered)) in l.commands.iter().enumerate() {
                    if !answered {
                        out.push(Action::AnswerCommand(i, c));
                    }
                }
            }
        }
        if m.dispatches < self.bounds.dispatches {
            out.push(Action::Dispatch);
        }
        if m.tunnels < self.bounds.tunnels {
            out.push(Action::DispatchTunnel);
        }
        if m.commands.len() < usize::from(self.bounds.commands) {
            for (n, node) in NODES.iter().enumerate() {
                if m.edge.registry().ready_generation(node).is_some() {
                    out.push(Action::Command(n));
                }
            }
        }
        for (i, s) in m.streams.iter().enumerate() {
            if s.terminals == 0 && !s.caller_gone {
                out.push(Action::CallerGone(i));
            }
            if s.tunnel && !s.caller_gone && m.grants < self.bounds.grants {
                out.push(Action::Grant(i));
            }
        }
        if m.ticks < self.bounds.ticks && self.next_timer(m).is_some() {
            out.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &Mesh, action: Action) -> Option<Mesh> {
        let mut m = last.clone();
        PUSHED.with(|p| p.borrow_mut().clear());
        let now = m.now;
        match action {
            Action::Connect(n) => {
                m.opened[n] += 1;
                let conn = m.edge.accept(now, NODES[n]);
                let register = RegisterRequest {
                    node_id: NODES[n].to_owned(),
                    stream_credit: STREAM_CREDIT[n],
                    ..Default::default()
                };
                let session = NodeSession::new(NodeSessionConfig::default(), register, now);
                m.links.push(Link {
                    node: n,
                    conn,
                    session,
                    to_node: VecDeque::new(),
                    to_edge: VecDeque::new(),
                    node_up: true,
                    edge_up: true,
                    generation: None,
                    runs: Vec::new(),
                    commands: Vec::new(),
                });
            }
            Action::ToEdge(i) => {
                let frame = m.links[i].to_edge.pop_front().expect("in flight");
                let node = NODES[m.links[i].node];
                let conn = m.links[i].conn;
                let reg = m.edge.registry();
                let current = reg.ready_generation(node).is_some_and(|(c, _)| c == conn);
                let owner = current || reg.pending_generation(node).is_some_and(|(c, _)| c == conn);
                let stale_before = (!owner && m.links[i].generation.is_some()).then(|| {
                    (
                        m.edge.snapshot(),
                        m.edge.stream_count(),
                        m.edge.pool_stats(),
                    )
                });
                m.edge.handle_frame(now, conn, frame);
                m.take_pushed(Some((i, current)));
                if let Some(before) = stale_before {
                    let after = (
                        m.edge.snapshot(),
                        m.edge.stream_count(),
                        m.edge.pool_stats(),
                    );
                    if before != after {
                        m.broke("no-stale-generation-routed");
                    }
                }
                // The generation the Edge bound this connection to.
                if m.links[i].generation.is_none() {
                    let reg = m.edge.registry();
                    let bound = reg
                        .pending_generation(node)
                        .into_iter()
                        .chain(reg.ready_generation(node))
                        .find(|(c, _)| *c == conn);
                    if let Some((_, g)) = bound {
                        m.links[i].generation = Some(g);
                    }
                }
            }
            Action::ToNode(i) => {
                let frame = m.links[i].to_node.pop_front().expect("in flight");
                m.links[i].session.handle_frame(now, frame);
            }
            Action::Cut(i) => {
                m.cuts += 1;
                let l = &mut m.links[i];
                l.node_up = false;
                l.to_node.clear();
                l.session.handle_transport_closed();
            }
            Action::EdgeEof(i) => {
                m.links[i].edge_up = false;
                let conn = m.links[i].conn;
                m.edge.handle_close(now, conn);
            }
            Action::NodeEof(i) => {
                let l = &mut m.links[i];
                l.node_up = false;
                l.to_edge.clear();
                l.session.handle_transport_closed();
            }
            Action::Dispatch | Action::DispatchTunnel => {
                let tunnel = action == Action::DispatchTunnel;
                if tunnel {
                    m.tunnels += 1;
                } else {
                    m.dispatches += 1;
                }
                match m.edge.admit(now, "m", ContextSize::Standard, QUEUE_WAIT) {
                    Ok(Admit::Granted(a)) => m.send_on(a.lease, tunnel),
                    Ok(Admit::Queued(id)) => m.queued.push((id, tunnel)),
                    Err(_) => {}
                }
            }
            Action::Command(n) => {
                let generation = m
                    .edge
                    .registry()
                    .ready_generation(NODES[n])
                    .expect("ready")
                    .1;
                let request = NodeCommandRequest {
                    kind: NodeCommandKind::Transport,
                    adapter: String::new(),
                    target: String::new(),
                };
                let ticket = m.edge.command(now, NODES[n], request).expect("ready");
                m.commands.push(Command {
                    ticket,
                    node: n,
                    generation,
                    answers: 0,
                });
            }
            Action::AnswerCommand(i, c) => {
                let (correlation_id, _) = m.links[i].commands[c];
                m.links[i].commands[c].1 = true;
                let response = NodeCommandResponse {
                    ok: true,
                    error: String::new(),
                    capabilities: Vec::new(),
                    result: [("link".to_owned(), i.to_string())].into_iter().collect(),
                };
                let frame = RuntimeFrame::correlated(
                    correlation_id,
                    RuntimeMessage::NodeCommandResponse(response),
                );
                m.links[i].session.send(now, frame).expect("ready");
            }
            Action::Complete(i, r) => {
                let (stream_id, run_id, _, tunnel) = m.links[i].runs[r].clone();
                m.links[i].runs[r].2 = true;
                let frames: Vec<RuntimeMessage> = if tunnel {
                    // The response starts and ends: two frames, each delivered on its own.
                    let mut w = TunnelWriter::new();
                    let start = TunnelPayload::ResponseStart {
                        status: 200,
                        headers: Vec::new(),
                    };
                    [start, TunnelPayload::End]
                        .into_iter()
                        .map(|p| {
                            let mut f = w.frame(p).expect("in order");
                            f.metadata.insert("by".into(), FROM_NODE.into());
                            RuntimeMessage::ProviderTunnelFrame(f)
                        })
                        .collect()
                } else {
                    let mut ev = RunEvent::new(RunEventKind::Complete);
                    ev.delta = FROM_NODE.into();
                    vec![RuntimeMessage::RunEvent(ev)]
                };
                for message in frames {
                    let frame = RuntimeFrame::on_stream(stream_id, message);
                    m.links[i].session.send(now, frame).expect("ready");
                }
                m.links[i].session.run_finished(&run_id);
            }
            Action::CallerGone(s) => {
                m.streams[s].caller_gone = true;
                let id = m.streams[s].stream_id;
                m.edge.end_stream(now, id, "caller went away");
            }
            Action::Grant(s) => {
                m.grants += 1;
                let id = m.streams[s].stream_id;
                m.edge.grant(now, id, 4096);
            }
            Action::Tick => {
                m.ticks += 1;
                let at = self.next_timer(&m).expect("a timer");
                m.now = at;
                m.edge.handle_timeout(at);
                for l in &mut m.links {
                    if l.node_up {
                        l.session.handle_timeout(at);
                    }
                }
            }
        }
        m.take_pushed(None);
        m.drain();
        Some(m)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "every transition keeps the seed 000 rules",
                |_, m: &Mesh| m.broken.is_none(),
            ),
            Property::always("one-terminal at quiescence", |_, m: &Mesh| {
                !m.quiescent() || m.streams.iter().all(|s| s.caller_gone || s.terminals == 1)
            }),
            Property::always("one command answer at quiescence", |_, m: &Mesh| {
                !m.quiescent() || m.commands.iter().all(|c| c.answers == 1)
            }),
            Property::sometimes("a tunnel completed by its Node", |_, m: &Mesh| {
                m.streams
                    .iter()
                    .any(|s| s.tunnel && s.terminals == 1 && !s.caller_gone)
                    && m.links.iter().any(|l| l.runs.iter().any(|r| r.2 && r.3))
            }),
            Property::sometimes("a command answered by its Node", |_, m: &Mesh| {
                m.commands.iter().any(|c| c.answers == 1)
                    && m.links.iter().any(|l| l.commands.iter().any(|c| c.1))
            }),
            Property::sometimes("a command failed by a fence", |_, m: &Mesh| {
                m.commands.iter().any(|c| c.answers == 1)
                    && m.links.iter().all(|l| l.commands.iter().all(|c| !c.1))
            }),
            Property::sometimes("a run completed by its Node", |_, m: &Mesh| {
                m.streams.iter().any(|s| s.terminals == 1 && !s.caller_gone)
                    && m.links.iter().any(|l| l.runs.iter().any(|r| r.2))
            }),
            Property::sometimes("a supersede with a run in flight", |_, m: &Mesh| {
                m.links
                    .iter()
                    .filter(|l| l.node == 0 && l.generation.is_some())
                    .count()
                    == 2
                    && m.streams.iter().any(|s| s.node == 0)
            }),
            Property::sometimes(
                "a supersede with a tunnel or a command in flight",
                |_, m: &Mesh| {
                    m.links
                        .iter()
                        .filter(|l| l.node == 0 && l.generation.is_some())
                        .count()
                        == 2
                        && (m.streams.iter().any(|s| s.node == 0 && s.tunnel)
                            || m.commands.iter().any(|c| c.node == 0))
                },
            ),
            Property::sometimes("a queued request granted", |_, m: &Mesh| {
                m.streams.len() == 2 && m.dispatches + m.tunnels == 2
            }),
            Property::sometimes("a timer fired with a stream open", |_, m: &Mesh| {
                m.ticks > 0 && !m.streams.is_empty()
            }),
        ]
    }
}

impl MeshModel {
    fn next_timer(&self, m: &Mesh) -> Option<Instant> {
        let mut next = m.edge.poll_timeout();
        for l in &m.links {
            if l.node_up
                && let Some(t) = l.session.poll_timeout()
            {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        next
    }
}

/// Runs the checker within `bounds`: every `always` property must hold, and each of
/// `reached` (names of `sometimes` properties) must be reached (what else is reachable
/// depends on the bounds).
fn check(bounds: Bounds, reached: &[&str]) {
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = MeshModel {
        bounds,
        start: Instant::now(),
    };
    let properties = model.properties();
    let checker = model.checker().threads(threads).spawn_bfs().join();
    eprintln!(
        "edge/node model ({bounds:?}): {} unique states, {} generated, {:.2?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    for p in properties {
        match p.expectation {
            stateright::Expectation::Always => checker.assert_no_discovery(p.name),
            _ if reached.contains(&p.name) => {
                checker.assert_any_discovery(p.name);
            }
            _ => {}
        }
    }
}

#[test]
fn every_interleaving_keeps_the_runtime_wire_rules() {
    let large = std::env::var("EDGE_MODEL").is_ok_and(|v| v == "large");
    let mut bounds = if large { Bounds::LARGE } else { Bounds::SMALL };
    // EDGE_MODEL_BOUNDS=r1,r2,c1,c2,dispatches,ticks,cuts explores another size by hand.
    if let Ok(b) = std::env::var("EDGE_MODEL_BOUNDS") {
        let v: Vec<u8> = b.split(',').map(|x| x.parse().expect("a number")).collect();
        bounds = Bounds {
            ready_at_start: [v[0], v[1]],
            conns_per_node: [v[2], v[3]],
            dispatches: v[4],
            ticks: v[5],
            cuts: v[6],
            tunnels: v.get(7).copied().unwrap_or(0),
            commands: v.get(8).copied().unwrap_or(0),
            grants: v.get(9).copied().unwrap_or(0),
        };
    }
    check(
        bounds,
        &[
            "a run completed by its Node",
            "a supersede with a run in flight",
            "a queued request granted",
        ],
    );
}

/// The same rules across one timer jump ([`Bounds::TIMERS`]).
#[test]
fn a_timer_jump_keeps_the_runtime_wire_rules() {
    check(
        Bounds::TIMERS,
        &[
            "a run completed by its Node",
            "a queued request granted",
            "a timer fired with a stream open",
        ],
    );
}

/// Tunnels and commands beside a run, across a timer jump and a cut ([`Bounds::WIRE`]).
#[test]
fn tunnels_and_commands_keep_the_runtime_wire_rules() {
    check(
        Bounds::WIRE,
        &[
            "a run completed by its Node",
            "a tunnel completed by its Node",
            "a command answered by its Node",
            "a command failed by a fence",
            "a timer fired with a stream open",
        ],
    );
}

/// Tunnels and commands across a supersede ([`Bounds::REDIAL`]).
#[test]
fn tunnels_and_commands_across_a_supersede_keep_the_runtime_wire_rules() {
    check(
        Bounds::REDIAL,
        &[
            "a tunnel completed by its Node",
            "a command answered by its Node",
            "a command failed by a fence",
            "a supersede with a tunnel or a command in flight",
        ],
    );
}
