//! Exhaustive model check of the seed 001 control wire with `stateright`: the real
//! [`EdgeControlSession`] and [`ControlPlaneSession`], a network of two FIFO queues between
//! them (every delivery its own step; every frame encoded and decoded by the real codec on the
//! way, so that a pushed projection, encoded once for all Edges, arrives as parts), the Control Plane driver's decisions as actions, and
//! every lease answered by the real [`LeaseService`] over a real store.
//!
//! **The store and the lease service are the real ones.** Before the check, a SQLite store is
//! set up as an operator would (an issuer key, a principal, a credential slot, a route) and
//! then moved forward by the model's admin changes (each one a new token: a change that
//! touches nothing a lease binding names except the projection generation). At every store
//! state `k` the test records the store's projection ([`iop_cp::projection::build`]) and what
//! [`LeaseService::acquire`] answers to a binding made from each projection the store has had.
//! The model then answers a lease request with exactly that recorded answer: whether a
//! stale binding is granted is decided by `iop-cp`, not by the model. (The answers are
//! recorded once, not recomputed per state, because a grant carries fresh random bytes: the
//! same decision must make the same state.)
//!
//! From a fresh connection the checker applies, in every order, within the bounds:
//!
//! - `ToCp` / `ToEdge`: the next frame in flight arrives;
//! - `Accept(k)`: the driver accepts the hello with the projection of store state `k`, any
//!   state up to the current one (its read of the store may be older than the store: a read
//!   made before a change committed);
//! - `Mutate`: an admin change commits; the store moves forward;
//! - `Push(k)`: the driver pushes the projection of store state `k`, again any state up to the
//!   current one (two changes in a row wake it twice; an older read can be pushed after a
//!   newer one);
//! - `Lease`: the Edge asks for a lease, with the binding it resolves from the projection it
//!   holds (route, slot, profile, upstream, revisions, generation);
//! - `Answer(i)`: the driver answers request `i` with the lease service's answer at the
//!   store's current state;
//! - `Status` / `RespondStatus(i)`: the Control Plane asks for the Edge's status; the Edge
//!   answers;
//! - `Cut(side)`: the transport breaks. `Both` ends see it at once; `CpFirst` / `EdgeFirst`:
//!   only that end sees it now, the link is dead from then on (frames either way are lost)
//!   and the other end is **half-open** until `Late` tells it or its own timers close it;
//! - `Late`: the end that has not seen the break sees it;
//! - `Reconnect`: the Edge, closed, dials again, carrying the projection it holds into the new
//!   session (as its connector does); the Control Plane closes the earlier session of the same
//!   Edge if it is still open (as `iop-cp` does when a connection replaces another);
//! - `Tick`: virtual time jumps to the next timer of either end (pings, silence, handshake).
//!
//! Invariants, each named after the rule it encodes:
//!
//! - **projection-generations-only-move-forward**: the Edge's installed generation never goes
//!   back, across reconnects too, and every projection it is told to install is strictly newer;
//!   the Control Plane never sends a session a generation lower than or equal to one it sent it
//!   (the driver does try: it pushes older reads);
//! - **projection-before-connected**: a managed Edge reports `Connected` only holding a
//!   projection;
//! - **edge-never-ahead-of-the-store**: the Edge never holds a generation the store has not
//!   reached;
//! - **lease-answer-matched-once**: every lease request gets exactly one answer — the Control
//!   Plane's answer to that very request, or `Closed` when the session ends (half-open ends
//!   included) — and never someone else's;
//! - **no-grant-against-a-stale-binding**: a lease the Edge receives as granted was granted for
//!   a binding whose generation was the store's when the lease service answered;
//! - **status-answers-matched-by-kind**: a status answer completes only a status request;
//! - **status-answers-count-every-node**: a status answer lists or counts (`omitted_nodes`)
//!   every Node the Edge has; the Edge's status (`STATUS_NODES`) is more than one frame holds;
//! - **frames-fit-their-reader**: no frame either end sends is larger than the other reads
//!   (`MODEL_FRAME`): a projection goes in parts, a status is cut to whole Nodes;
//! - **projection-installed-whole**: every projection the Edge installs is exactly the store's
//!   projection of that generation. The model's frames are small (`MODEL_FRAME`), so every
//!   projection after the first travels in parts, delivered one step at a time like any frame,
//!   and the checker interleaves breaks, reconnects and older pushes between them.
//!
//! The test command runs two bounds and prints their state counts and times: `SMALL` (2
//! sessions, 2 admin changes, 1 push, 2 lease requests, 1 transport break of any of the three
//! kinds, 1 timer jump): 132,277 unique states in ≈8 s in a debug build on 2 cores; and
//! `STATUS` (the same with 1 admin change, 1 lease request and 1 status request): 34,584
//! states in ≈1 s. (`SMALL` with a status request and 2 pushes is 2.5 million states and
//! 130 s here; status requests are independent of the lease and projection rules, so they get
//! a bound of their own.) `CONTROL_MODEL=large` runs a larger one by hand.
//!
//! Does it catch a bug? Checked against broken code (made, run, reverted):
//! - `EdgeControlSession::offer_projection` made to install any projection, newer or not →
//!   **projection-generations-only-move-forward**: the Edge reconnects holding generation `g`
//!   and the new session's hello brings `g` again, which it installs a second time;
//! - `ControlPlaneSession::push_projection` made to send every projection →
//!   **projection-generations-only-move-forward**: the driver pushes an older read after a
//!   newer one;
//! - the lease service's generation check removed → **no-grant-against-a-stale-binding**: a
//!   binding of the generation before a token was created is granted;
//! - the Edge's session made to install the message completing a projection without the parts
//!   before it → **projection-installed-whole**;
//! - `EdgeControlSession::respond_status` made to send the status as it is, unfitted →
//!   **frames-fit-their-reader**.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::{BTreeMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_cp::admin::Admin;
use iop_cp::lease::{DEFAULT_LEASE_TTL, LeaseService};
use iop_cp::seal::MasterKey;
use iop_cp::store::{SqliteStore, Store};
use iop_lease::RecipientSecretKey;
use iop_wire::codec::FrameCodec;
use iop_wire::control::{
    AcquireLeaseRequest, AcquireLeaseResponse, ControlFrame, ControlMessage, EdgeHelloRequest,
    EdgeHelloResponse, EdgeNodeConfigSummary, EdgeNodeSnapshot, EdgeStatusResponse,
    PrincipalProjection,
};
use iop_wire::control_session::{
    ControlPlaneEvent, ControlPlaneSession, ControlSessionConfig, ControlSessionError,
    EdgeControlEvent, EdgeControlSession,
};
use iop_wire::runtime::CredentialLeaseBinding;
use stateright::{Checker, Model, Property};

const EDGE: &str = "edge-1";
const PRINCIPAL: &str = "team-a";
const MODEL: &str = "gpt";
const NODE_KEY: &str = "node-1-key";

#[derive(Clone, Copy, Debug)]
struct Bounds {
    sessions: u8,
    mutations: u8,
    pushes: u8,
    leases: u8,
    statuses: u8,
    cuts: u8,
    ticks: u8,
}

impl Bounds {
    const SMALL: Self = Self {
        sessions: 2,
        mutations: 2,
        pushes: 1,
        leases: 2,
        statuses: 0,
        cuts: 1,
        ticks: 1,
    };
    /// Status requests beside one lease and one admin change.
    const STATUS: Self = Self {
        sessions: 2,
        mutations: 1,
        pushes: 1,
        leases: 1,
        statuses: 1,
        cuts: 1,
        ticks: 1,
    };
    const LARGE: Self = Self {
        sessions: 3,
        mutations: 3,
        pushes: 3,
        leases: 2,
        statuses: 1,
        cuts: 2,
        ticks: 2,
    };
}

/// A 10 s handshake, 5 s heartbeats.
fn config() -> ControlSessionConfig {
    ControlSessionConfig {
        handshake_timeout: Duration::from_secs(10),
        heartbeat: Duration::from_secs(5),
        max_frame_len: MODEL_FRAME,
    }
}

/// Frames just large enough for the first projection (a principal and a route): every later
/// one, with a token or two more, goes in parts ([`PrincipalProjection::into_parts`]), so the
/// checker delivers parts one step at a time, interleaved with everything else.
const MODEL_FRAME: usize = 1024 + 130;

/// Nodes in the Edge's status: more than one `MODEL_FRAME` holds.
const STATUS_NODES: usize = 48;

fn status() -> EdgeStatusResponse {
    EdgeStatusResponse {
        edge_id: EDGE.into(),
        nodes: (0..STATUS_NODES)
            .map(|i| EdgeNodeSnapshot {
                node_id: format!("node-{i:02}"),
                connected: i % 2 == 0,
                config: EdgeNodeConfigSummary {
                    revision: 1,
                    adapters: vec![("openai-a".into(), "openai_compat".into())],
                },
                ..Default::default()
            })
            .collect(),
        omitted_nodes: 0,
    }
}

/// `frame` as its reader gets it, through the codec both ends use (the Control Plane sends a
/// pushed projection as bytes encoded once, which the Edge decodes as parts and an apply
/// request); `None` when it is larger than the reader takes.
fn wire(frame: &ControlFrame) -> Option<ControlFrame> {
    let codec = FrameCodec::with_max_frame_len(MODEL_FRAME);
    let mut buf = bytes::BytesMut::new();
    codec.encode(frame, &mut buf).ok()?;
    Some(codec.decode(&mut buf).expect("decodes").expect("whole"))
}

fn hello() -> EdgeHelloRequest {
    EdgeHelloRequest {
        edge_id: EDGE.into(),
        version: "model".into(),
        managed: true,
        metadata: BTreeMap::new(),
        ..EdgeHelloRequest::default()
    }
}

/// The binding the Edge resolves for its principal's route under `p` (as `iop-edge`'s binding
/// loop does), for Node 1's recipient key.
fn binding(p: &PrincipalProjection) -> CredentialLeaseBinding {
    let route = p
        .routes
        .iter()
        .find(|r| r.principal_id == PRINCIPAL && r.model == MODEL)
        .expect("the route is in every projection");
    CredentialLeaseBinding {
        principal_id: PRINCIPAL.into(),
        slot_id: route.slot_id.clone(),
        route_id: route.route_id.clone(),
        profile: route.profile.clone(),
        upstream_target: route.upstream_target.clone(),
        node_id: "node-1".into(),
        recipient_key_id: NODE_KEY.into(),
        credential_revision: route.credential_revision,
        route_revision: route.route_revision,
        projection_generation: p.generation,
    }
}

/// The real store's history, recorded before the check: its projection at each state, and
/// the lease service's answer at each state to a binding made from each projection.
struct History {
    projections: Vec<PrincipalProjection>,
    /// `(store state, binding generation)` → the lease service's answer.
    answers: BTreeMap<(usize, u64), AcquireLeaseResponse>,
    recipient_public_key: [u8; 32],
}

impl History {
    fn record(mutations: u8) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let store: Arc<dyn Store> = Arc::new(SqliteStore::in_memory_inline().unwrap());
            let master = Arc::new(MasterKey::generate().unwrap().0);
            let admin = Admin::new(
                store.clone(),
                master.clone(),
                store.generation().await.unwrap(),
            );
            admin
                .ensure_issuer_key(|| Ok(iop_lease::IssuerSigningKey::generate_derived().unwrap()))
                .await
                .unwrap();
            admin.create_principal(PRINCIPAL, "Team A").await.unwrap();
            admin
                .put_slot("slot-1", "openai", "authorization", "Bearer ", b"sk-model")
                .await
                .unwrap();
            admin
                .put_route("r1", PRINCIPAL, MODEL, "slot-1", "gpt-upstream", "")
                .await
                .unwrap();
            let leases = LeaseService::new(store.clone(), master, DEFAULT_LEASE_TTL);
            let recipient = RecipientSecretKey::generate(NODE_KEY).unwrap();
            let recipient_public_key = *recipient.public_key().as_bytes();
            let mut projections = Vec::new();
            let mut answers = BTreeMap::new();
            for k in 0..=usize::from(mutations) {
                if k > 0 {
                    admin.create_token(PRINCIPAL).await.unwrap();
                }
                projections.push(iop_cp::projection::build(&store.snapshot().await.unwrap()));
                for p in &projections {
                    let request = AcquireLeaseRequest {
                        binding: binding(p),
                        recipient_public_key,
                        trace: None,
                    };
                    let answer = match leases.acquire(&request, 0).await {
                        Ok(lease) => AcquireLeaseResponse::Granted(lease),
                        Err(refusal) => AcquireLeaseResponse::Refused {
                            reason: refusal.as_str().into(),
                        },
                    };
                    answers.insert((k, p.generation), answer);
                }
            }
            Self {
                projections,
                answers,
                recipient_public_key,
            }
        })
    }

    fn generation(&self, k: usize) -> u64 {
        self.projections[k].generation
    }

    fn projection_of(&self, generation: u64) -> Option<&PrincipalProjection> {
        self.projections.iter().find(|p| p.generation == generation)
    }
}

/// One lease request, as the model saw it: the generation it was bound to, the Control
/// Plane's answer with the store's generation when it was given, and how many answers the
/// Edge got.
#[derive(Clone, Debug)]
struct LeaseGhost {
    generation: u64,
    answer: Option<(AcquireLeaseResponse, u64)>,
    answered: u8,
    /// Asked while the link was already dead (the Edge half-open).
    lost: bool,
}

/// Which end saw a transport break first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Side {
    Both,
    CpFirst,
    EdgeFirst,
}

#[derive(Clone, Debug)]
struct Wire {
    now: Instant,
    edge: EdgeControlSession,
    cp: ControlPlaneSession,
    to_cp: VecDeque<ControlFrame>,
    to_edge: VecDeque<ControlFrame>,
    /// The transport broke: frames either way are lost.
    link_dead: bool,
    edge_closed: bool,
    cp_closed: bool,
    /// The hello the Control Plane's driver has to decide on.
    hello_pending: bool,
    /// The store's state: how many admin changes committed.
    store: usize,
    /// The highest generation the Control Plane sent on this session.
    sent_generation: u64,
    held_max: u64,
    leases: BTreeMap<(u8, u64), LeaseGhost>,
    /// Lease requests the Control Plane's driver has not answered: (session, id, generation).
    lease_requests: Vec<(u8, u64, u64)>,
    /// Status requests the Edge has to answer.
    status_requests: Vec<u64>,
    status_tickets: Vec<u64>,
    session: u8,
    mutations: u8,
    pushes: u8,
    lease_count: u8,
    statuses: u8,
    cuts: u8,
    ticks: u8,
    /// A pushed projection reached the Edge and was installed.
    push_installed: bool,
    /// The Edge installed a projection that came in parts (any after the first).
    parts_installed: bool,
    /// The driver pushed a read no newer than what the session had sent, and nothing went.
    stale_push_dropped: bool,
    /// A status answer listing some of the Edge's Nodes and counting the rest arrived.
    status_cut: bool,
    broken: Option<&'static str>,
}

impl Wire {
    fn new(now: Instant) -> Self {
        let mut w = Self {
            now,
            edge: EdgeControlSession::new(config(), hello(), 0, now),
            cp: ControlPlaneSession::new(config(), Some(EDGE.into()), now),
            to_cp: VecDeque::new(),
            to_edge: VecDeque::new(),
            link_dead: false,
            edge_closed: false,
            cp_closed: false,
            hello_pending: false,
            store: 0,
            sent_generation: 0,
            held_max: 0,
            leases: BTreeMap::new(),
            lease_requests: Vec::new(),
            status_requests: Vec::new(),
            status_tickets: Vec::new(),
            session: 1,
            mutations: 0,
            pushes: 0,
            lease_count: 0,
            statuses: 0,
            cuts: 0,
            ticks: 0,
            push_installed: false,
            parts_installed: false,
            stale_push_dropped: false,
            status_cut: false,
            broken: None,
        };
        w.drain_unchecked();
        w
    }

    fn key(&self) -> String {
        format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{}|{}|{}|{}|{}|{}|{}|{:?}|{:?}|{:?}|{:?}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{:?}",
            self.now,
            self.edge,
            self.cp,
            self.to_cp,
            self.to_edge,
            self.link_dead,
            self.edge_closed,
            self.cp_closed,
            self.hello_pending,
            self.store,
            self.sent_generation,
            self.held_max,
            self.leases,
            self.lease_requests,
            self.status_requests,
            self.status_tickets,
            self.session,
            self.mutations,
            self.pushes,
            self.lease_count,
            self.statuses,
            self.cuts,
            self.ticks,
            self.push_installed,
            self.parts_installed,
            self.stale_push_dropped,
            self.status_cut,
            self.broken
        )
    }

    fn broke(&mut self, rule: &'static str) {
        self.broken.get_or_insert(rule);
    }

    fn drain_unchecked(&mut self) {
        while let Some(f) = self.edge.poll_transmit() {
            self.to_cp.push_back(f);
        }
    }

    fn drain(&mut self, h: &History) {
        loop {
            let mut moved = false;
            while let Some(f) = self.edge.poll_transmit() {
                moved = true;
                let Some(f) = wire(&f) else {
                    self.broke("frames-fit-their-reader");
                    continue;
                };
                if !self.link_dead {
                    self.to_cp.push_back(f);
                }
            }
            while let Some(f) = self.cp.poll_transmit() {
                moved = true;
                let Some(f) = wire(&f) else {
                    self.broke("frames-fit-their-reader");
                    continue;
                };
                let sent = match &f.message {
                    ControlMessage::PrincipalProjectionApplyRequest(p) => Some(p.generation),
                    ControlMessage::EdgeHelloResponse(EdgeHelloResponse::Accepted {
                        projection: Some(p),
                        ..
                    }) => Some(p.generation),
                    _ => None,
                };
                if let Some(g) = sent {
                    if g <= self.sent_generation {
                        self.broke("projection-generations-only-move-forward");
                    }
                    self.sent_generation = g;
                }
                if !self.link_dead {
                    self.to_edge.push_back(f);
                }
            }
            while let Some(ev) = self.edge.poll_event() {
                moved = true;
                self.edge_event(h, ev);
            }
            while let Some(ev) = self.cp.poll_event() {
                moved = true;
                match ev {
                    ControlPlaneEvent::Hello(_) => self.hello_pending = true,
                    ControlPlaneEvent::LeaseRequested { id, request } => self
                        .lease_requests
                        .push((self.session, id, request.binding.projection_generation)),
                    ControlPlaneEvent::StatusAnswered { ticket, result } => {
                        let known = self.status_tickets.contains(&ticket);
                        if result.is_ok() && !known {
                            self.broke("status-answers-matched-by-kind");
                        }
                        if let Ok(r) = &result {
                            if r.nodes.len() + r.omitted_nodes as usize != STATUS_NODES {
                                self.broke("status-answers-count-every-node");
                            }
                            self.status_cut |= r.omitted_nodes > 0 && !r.nodes.is_empty();
                        }
                        self.status_tickets.retain(|t| *t != ticket);
                    }
                    ControlPlaneEvent::CommandAnswered { .. } => {
                        self.broke("status-answers-matched-by-kind");
                    }
                    ControlPlaneEvent::Closed(_) => {
                        self.cp_closed = true;
                        self.hello_pending = false;
                    }
                    _ => {}
                }
            }
            if !moved {
                break;
            }
        }
        let held = self.edge.projection_generation();
        if held < self.held_max {
            self.broke("projection-generations-only-move-forward");
        }
        self.held_max = self.held_max.max(held);
        if held > h.generation(self.store) {
            self.broke("edge-never-ahead-of-the-store");
        }
    }

    fn edge_event(&mut self, h: &History, ev: EdgeControlEvent) {
        match ev {
            EdgeControlEvent::Projection(p) => {
                if p.generation <= self.held_max {
                    self.broke("projection-generations-only-move-forward");
                }
                if h.projection_of(p.generation) != Some(&p) {
                    self.broke("projection-installed-whole");
                }
                if p.generation > h.generation(0) {
                    self.parts_installed = true;
                }
                self.held_max = p.generation;
            }
            EdgeControlEvent::Connected { .. } if self.edge.projection_generation() == 0 => {
                self.broke("projection-before-connected");
            }
            EdgeControlEvent::StatusRequested { id } => self.status_requests.push(id),
            EdgeControlEvent::LeaseAnswered { ticket, result } => {
                let session = self.session;
                let Some(ghost) = self.leases.get_mut(&(session, ticket)) else {
                    return self.broke("lease-answer-matched-once");
                };
                ghost.answered += 1;
                let ok = match &result {
                    Ok(answer) => ghost.answer.as_ref().map(|(a, _)| a) == Some(answer),
                    Err(ControlSessionError::Closed) => true,
                    Err(_) => false,
                };
                let twice = ghost.answered > 1;
                let granted_stale = matches!(
                    (&result, &ghost.answer),
                    (Ok(AcquireLeaseResponse::Granted(_)), Some((_, store)))
                        if *store != ghost.generation
                );
                if !ok || twice {
                    self.broke("lease-answer-matched-once");
                }
                if granted_stale {
                    self.broke("no-grant-against-a-stale-binding");
                }
            }
            EdgeControlEvent::Closed(_) => {
                self.edge_closed = true;
                // Every request of this session has its one answer by now.
                let session = self.session;
                if self
                    .leases
                    .iter()
                    .any(|((s, _), g)| *s == session && g.answered != 1)
                {
                    self.broke("lease-answer-matched-once");
                }
            }
            _ => {}
        }
    }
}

impl Hash for Wire {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.key().hash(h);
    }
}

impl PartialEq for Wire {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    ToCp,
    ToEdge,
    Accept(usize),
    Mutate,
    Push(usize),
    Lease,
    Answer(usize),
    Status,
    RespondStatus(usize),
    Cut(Side),
    Late,
    Reconnect,
    Tick,
}

struct ControlModel {
    bounds: Bounds,
    start: Instant,
    history: History,
}

impl ControlModel {
    fn next_timer(w: &Wire) -> Option<Instant> {
        match (w.edge.poll_timeout(), w.cp.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Model for ControlModel {
    type State = Wire;
    type Action = Action;

    fn init_states(&self) -> Vec<Wire> {
        vec![Wire::new(self.start)]
    }

    fn actions(&self, w: &Wire, out: &mut Vec<Action>) {
        if w.broken.is_some() {
            return;
        }
        let b = self.bounds;
        if !w.to_cp.is_empty() {
            out.push(Action::ToCp);
        }
        if !w.to_edge.is_empty() {
            out.push(Action::ToEdge);
        }
        if w.hello_pending {
            out.extend((0..=w.store).map(Action::Accept));
        }
        if w.mutations < b.mutations {
            out.push(Action::Mutate);
        }
        if w.pushes < b.pushes && w.cp.is_connected() {
            out.extend((0..=w.store).map(Action::Push));
        }
        if w.lease_count < b.leases && w.edge.is_connected() {
            out.push(Action::Lease);
        }
        for (i, (s, _, _)) in w.lease_requests.iter().enumerate() {
            if *s == w.session {
                out.push(Action::Answer(i));
            }
        }
        if w.statuses < b.statuses && w.cp.is_connected() {
            out.push(Action::Status);
        }
        for i in 0..w.status_requests.len() {
            out.push(Action::RespondStatus(i));
        }
        if w.cuts < b.cuts && !w.link_dead && !w.edge_closed && !w.cp_closed {
            out.extend([Side::Both, Side::CpFirst, Side::EdgeFirst].map(Action::Cut));
        }
        if w.link_dead && (w.edge_closed != w.cp_closed) {
            out.push(Action::Late);
        }
        if w.edge_closed && w.session < b.sessions {
            out.push(Action::Reconnect);
        }
        if w.ticks < b.ticks && Self::next_timer(w).is_some() {
            out.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &Wire, action: Action) -> Option<Wire> {
        let h = &self.history;
        let mut w = last.clone();
        let now = w.now;
        match action {
            Action::ToCp => {
                let f = w.to_cp.pop_front().expect("in flight");
                w.cp.handle_frame(now, f);
            }
            Action::ToEdge => {
                let f = w.to_edge.pop_front().expect("in flight");
                let pushed = match &f.message {
                    ControlMessage::PrincipalProjectionApplyRequest(p) => Some(p.generation),
                    _ => None,
                };
                w.edge.handle_frame(now, f);
                if pushed.is_some_and(|g| g == w.edge.projection_generation()) {
                    w.push_installed = true;
                }
            }
            Action::Accept(k) => {
                w.hello_pending = false;
                w.cp.accept(now, Some(h.projections[k].clone()))
                    .expect("the model's projections fit a frame");
            }
            Action::Mutate => {
                w.mutations += 1;
                w.store += 1;
            }
            Action::Push(k) => {
                w.pushes += 1;
                if let Ok(None) = w.cp.push_projection(now, h.projections[k].clone()) {
                    w.stale_push_dropped = true;
                }
            }
            Action::Lease => {
                w.lease_count += 1;
                let generation = w.edge.projection_generation();
                let projection = h
                    .projection_of(generation)
                    .expect("the Edge holds a projection the store had");
                let request = AcquireLeaseRequest {
                    binding: binding(projection),
                    recipient_public_key: h.recipient_public_key,
                    trace: None,
                };
                let ticket = w.edge.acquire_lease(now, request).expect("connected");
                w.leases.insert(
                    (w.session, ticket),
                    LeaseGhost {
                        generation,
                        answer: None,
                        answered: 0,
                        lost: w.link_dead,
                    },
                );
            }
            Action::Answer(i) => {
                let (session, id, generation) = w.lease_requests.remove(i);
                let store_generation = h.generation(w.store);
                let Some(answer) = h.answers.get(&(w.store, generation)).cloned() else {
                    // A binding of a generation the store never had at or before this state.
                    w.broke("edge-never-ahead-of-the-store");
                    return Some(w);
                };
                if let Some(g) = w.leases.get_mut(&(session, id)) {
                    g.answer = Some((answer.clone(), store_generation));
                }
                let _ = w.cp.respond_lease(now, id, answer);
            }
            Action::Status => {
                w.statuses += 1;
                let t = w.cp.status(now).expect("connected");
                w.status_tickets.push(t);
            }
            Action::RespondStatus(i) => {
                let id = w.status_requests.remove(i);
                let _ = w.edge.respond_status(now, id, status());
            }
            Action::Cut(side) => {
                w.cuts += 1;
                w.link_dead = true;
                w.to_cp.clear();
                w.to_edge.clear();
                if side != Side::CpFirst {
                    w.edge.handle_transport_closed();
                }
                if side != Side::EdgeFirst {
                    w.cp.handle_transport_closed();
                }
            }
            Action::Late => {
                w.edge.handle_transport_closed();
                w.cp.handle_transport_closed();
            }
            Action::Reconnect => {
                w.session += 1;
                let held = w.edge.projection_generation();
                // The new connection replaces the earlier one, still open if half-open.
                w.cp.close_local();
                w.edge = EdgeControlSession::new(config(), hello(), held, now);
                w.cp = ControlPlaneSession::new(config(), Some(EDGE.into()), now);
                w.to_cp.clear();
                w.to_edge.clear();
                w.link_dead = false;
                w.edge_closed = false;
                w.cp_closed = false;
                w.hello_pending = false;
                w.sent_generation = 0;
                w.lease_requests.clear();
                w.status_requests.clear();
                w.status_tickets.clear();
            }
            Action::Tick => {
                w.ticks += 1;
                let at = Self::next_timer(&w).expect("a timer");
                w.now = at;
                w.edge.handle_timeout(at);
                w.cp.handle_timeout(at);
            }
        }
        w.drain(h);
        Some(w)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("every step keeps the seed 001 rules", |_, w: &Wire| {
                w.broken.is_none()
            }),
            Property::sometimes("a lease granted", |_, w: &Wire| {
                w.leases.values().any(|g| {
                    g.answered == 1
                        && matches!(g.answer, Some((AcquireLeaseResponse::Granted(_), _)))
                })
            }),
            Property::sometimes("a lease refused as stale", |_, w: &Wire| {
                w.leases.values().any(|g| {
                    g.answered == 1
                        && matches!(&g.answer, Some((AcquireLeaseResponse::Refused { reason }, _))
                            if reason == "stale_generation")
                })
            }),
            Property::sometimes("a projection pushed and installed", |_, w: &Wire| {
                w.push_installed
            }),
            Property::sometimes("a projection sent in parts installed", |_, w: &Wire| {
                w.parts_installed
            }),
            Property::sometimes("an older read pushed and not sent", |_, w: &Wire| {
                w.stale_push_dropped
            }),
            Property::sometimes(
                "a lease request lost on a half-open session, answered Closed",
                |_, w: &Wire| w.leases.values().any(|g| g.lost && g.answered == 1),
            ),
            Property::sometimes(
                "a status answered with some Nodes listed and the rest counted",
                |m: &Self, w: &Wire| w.status_cut || m.bounds.statuses == 0,
            ),
            Property::sometimes("reconnected holding a projection", |_, w: &Wire| {
                w.session == 2 && w.edge.is_connected() && w.edge.projection_generation() >= 1
            }),
        ]
    }
}

#[test]
fn every_interleaving_keeps_the_control_wire_rules() {
    let large = std::env::var("CONTROL_MODEL").is_ok_and(|v| v == "large");
    let bounds: &[Bounds] = if large {
        &[Bounds::LARGE]
    } else {
        &[Bounds::SMALL, Bounds::STATUS]
    };
    for b in bounds {
        check(*b);
    }
}

fn check(bounds: Bounds) {
    let history = History::record(bounds.mutations);
    // The binding of the store's current projection is granted at every state (else the
    // model below would have no grant to check); whether older ones are is the model's
    // question.
    for k in 0..history.projections.len() {
        let current = history.generation(k);
        assert!(
            matches!(
                history.answers[&(k, current)],
                AcquireLeaseResponse::Granted(_)
            ),
            "state {k}: {:?}",
            history.answers[&(k, current)]
        );
    }
    // The first projection fits one frame; every later one is sent in parts.
    for (k, p) in history.projections.iter().enumerate() {
        let parts = p.clone().into_parts(MODEL_FRAME).unwrap().len();
        assert_eq!(parts > 1, k > 0, "state {k}: {parts} parts");
    }
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let checker = ControlModel {
        bounds,
        start: Instant::now(),
        history,
    }
    .checker()
    .threads(threads)
    .spawn_bfs()
    .join();
    eprintln!(
        "control wire model ({bounds:?}): {} unique states, {} generated, {:.2?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    checker.assert_properties();
}
