//! Exhaustive model check of the seed 001 session machines with `stateright`: the real
//! [`EdgeControlSession`] and [`ControlPlaneSession`], a network of two FIFO queues between
//! them (every delivery its own step), and the two drivers' decisions as actions.
//!
//! From a fresh connection the checker applies, in every order, within the bounds:
//!
//! - `ToCp` / `ToEdge`: the next frame in flight arrives;
//! - `Accept`: the Control Plane's driver accepts the hello with the store's current
//!   projection (as `iop-cp` does, managed mode);
//! - `Mutate`: an admin change moves the store's generation forward; the Control Plane pushes
//!   the new projection if connected;
//! - `Lease`: the Edge asks for a credential lease, bound to the projection generation it holds;
//! - `Answer(i)`: the Control Plane answers lease request `i`: granted when the binding's
//!   generation is the store's, refused `stale_generation` otherwise (iop-cp's rule);
//! - `Status` / `RespondStatus(i)`: the Control Plane asks for the Edge's status; the Edge
//!   answers;
//! - `Cut`: the transport breaks (both ends see it); `Reconnect`: the Edge dials again, carrying
//!   the projection generation it holds into the new session (as its connector does);
//! - `Tick`: virtual time jumps to the next timer of either end (pings, silence, handshake).
//!
//! Invariants, each named after the rule it encodes:
//!
//! - **projection-generations-only-move-forward**: the Edge's installed generation never goes
//!   back, across reconnects too, and every projection it is told to install is strictly newer;
//!   the Control Plane never sends a session a generation lower than or equal to one it sent it;
//! - **projection-before-connected**: a managed Edge reports `Connected` only holding a
//!   projection;
//! - **edge-never-ahead-of-the-store**: the Edge never holds a generation the store has not
//!   reached (so a lease request is bound to a generation the Control Plane knows);
//! - **lease-answer-matched-once**: every lease request gets exactly one answer — the Control
//!   Plane's answer to that very request, or `Closed` when the session ends — and never someone
//!   else's;
//! - **no-grant-against-a-stale-binding**: a lease the Edge receives as granted was granted for a
//!   binding whose generation was the store's at that moment;
//! - **status-answers-matched-by-kind**: a status answer completes only a status request.
//!
//! The test command runs the small bound (2 sessions, 2 admin changes, 2 lease requests, 1
//! status request, 1 transport break, 1 timer jump) and prints the state count and time:
//! 320,517 unique states (860,272 generated) in ≈15 s in a debug build on 2 cores.
//! `CONTROL_MODEL=large` runs a larger one by hand (it takes well over ten minutes here).
//!
//! Does it catch a bug? Checked once against a broken machine (made, run, reverted):
//! `EdgeControlSession::offer_projection` made to install any projection, newer or not →
//! **projection-generations-only-move-forward** fails in 10 steps: hello, an admin change,
//! accept, the Edge installs generation 2, a lease, the transport breaks, the Edge reconnects
//! holding 2 and the new session's hello brings 2 again, which it installs a second time.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;
use common::{binding, config, projection};

use std::collections::{BTreeMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::time::Instant;

use bytes::Bytes;
use iop_wire::control::{
    AcquireLeaseRequest, AcquireLeaseResponse, ControlFrame, ControlMessage, EdgeHelloRequest,
    EdgeStatusResponse,
};
use iop_wire::control_session::{
    ControlPlaneEvent, ControlPlaneSession, ControlSessionError, EdgeControlEvent,
    EdgeControlSession,
};
use iop_wire::runtime::CredentialLease;
use stateright::{Checker, Model, Property};

const EDGE: &str = "edge-1";

#[derive(Clone, Copy, Debug)]
struct Bounds {
    sessions: u8,
    mutations: u8,
    leases: u8,
    statuses: u8,
    cuts: u8,
    ticks: u8,
}

impl Bounds {
    const SMALL: Self = Self {
        sessions: 2,
        mutations: 2,
        leases: 2,
        statuses: 1,
        cuts: 1,
        ticks: 1,
    };
    const LARGE: Self = Self {
        sessions: 3,
        mutations: 3,
        leases: 2,
        statuses: 1,
        cuts: 2,
        ticks: 2,
    };
}

fn hello() -> EdgeHelloRequest {
    EdgeHelloRequest {
        edge_id: EDGE.into(),
        version: "model".into(),
        managed: true,
        metadata: BTreeMap::new(),
    }
}

fn lease(ticket: u64, generation: u64) -> CredentialLease {
    CredentialLease {
        version: 1,
        lease_id: [u8::try_from(ticket).unwrap_or(u8::MAX); 16],
        issuer_key_id: format!("granted-at-generation-{generation}"),
        issued_at_unix_ms: 0,
        not_after_unix_ms: 1,
        enc: Bytes::new(),
        recipient_public_key: Bytes::new(),
        ciphertext: Bytes::new(),
        signature: Bytes::new(),
    }
}

/// One lease request, as the model saw it: the generation it was bound to, the Control
/// Plane's answer (when it gave one) and how many answers the Edge got.
#[derive(Clone, Debug)]
struct LeaseGhost {
    generation: u64,
    answer: Option<AcquireLeaseResponse>,
    answered: u8,
}

#[derive(Clone, Debug)]
struct Wire {
    now: Instant,
    edge: EdgeControlSession,
    cp: ControlPlaneSession,
    to_cp: VecDeque<ControlFrame>,
    to_edge: VecDeque<ControlFrame>,
    edge_closed: bool,
    /// The hello the Control Plane's driver has to decide on.
    hello_pending: bool,
    store_generation: u64,
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
    lease_count: u8,
    statuses: u8,
    cuts: u8,
    ticks: u8,
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
            edge_closed: false,
            hello_pending: false,
            store_generation: 1,
            sent_generation: 0,
            held_max: 0,
            leases: BTreeMap::new(),
            lease_requests: Vec::new(),
            status_requests: Vec::new(),
            status_tickets: Vec::new(),
            session: 1,
            mutations: 0,
            lease_count: 0,
            statuses: 0,
            cuts: 0,
            ticks: 0,
            broken: None,
        };
        w.drain();
        w
    }

    fn key(&self) -> String {
        format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{}|{}|{}|{}|{}|{:?}|{:?}|{:?}|{:?}|{}|{}|{}|{}|{}|{}|{:?}",
            self.now,
            self.edge,
            self.cp,
            self.to_cp,
            self.to_edge,
            self.edge_closed,
            self.hello_pending,
            self.store_generation,
            self.sent_generation,
            self.held_max,
            self.leases,
            self.lease_requests,
            self.status_requests,
            self.status_tickets,
            self.session,
            self.mutations,
            self.lease_count,
            self.statuses,
            self.cuts,
            self.ticks,
            self.broken
        )
    }

    fn broke(&mut self, rule: &'static str) {
        self.broken.get_or_insert(rule);
    }

    fn drain(&mut self) {
        loop {
            let mut moved = false;
            while let Some(f) = self.edge.poll_transmit() {
                moved = true;
                self.to_cp.push_back(f);
            }
            while let Some(f) = self.cp.poll_transmit() {
                moved = true;
                let sent = match &f.message {
                    ControlMessage::PrincipalProjectionApplyRequest(p) => Some(p.generation),
                    ControlMessage::EdgeHelloResponse(
                        iop_wire::control::EdgeHelloResponse::Accepted {
                            projection: Some(p),
                            ..
                        },
                    ) => Some(p.generation),
                    _ => None,
                };
                if let Some(g) = sent {
                    if g <= self.sent_generation {
                        self.broke("projection-generations-only-move-forward");
                    }
                    self.sent_generation = g;
                }
                self.to_edge.push_back(f);
            }
            while let Some(ev) = self.edge.poll_event() {
                moved = true;
                self.edge_event(ev);
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
                        self.status_tickets.retain(|t| *t != ticket);
                    }
                    ControlPlaneEvent::CommandAnswered { .. } => {
                        self.broke("status-answers-matched-by-kind");
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
        if held > self.store_generation {
            self.broke("edge-never-ahead-of-the-store");
        }
    }

    fn edge_event(&mut self, ev: EdgeControlEvent) {
        match ev {
            EdgeControlEvent::Projection(p) => {
                if p.generation <= self.held_max {
                    self.broke("projection-generations-only-move-forward");
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
                    Ok(answer) => ghost.answer.as_ref() == Some(answer),
                    Err(ControlSessionError::Closed) => true,
                    Err(_) => false,
                };
                let twice = ghost.answered > 1;
                let granted_stale = matches!(&result, Ok(AcquireLeaseResponse::Granted(l))
                    if l.issuer_key_id != format!("granted-at-generation-{}", ghost.generation));
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
    Accept,
    Mutate,
    Lease,
    Answer(usize),
    Status,
    RespondStatus(usize),
    Cut,
    Reconnect,
    Tick,
}

struct ControlModel {
    bounds: Bounds,
    start: Instant,
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
            out.push(Action::Accept);
        }
        if w.mutations < b.mutations {
            out.push(Action::Mutate);
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
        if w.cuts < b.cuts && !w.edge_closed {
            out.push(Action::Cut);
        }
        if w.edge_closed && w.session < b.sessions {
            out.push(Action::Reconnect);
        }
        if w.ticks < b.ticks && Self::next_timer(w).is_some() {
            out.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &Wire, action: Action) -> Option<Wire> {
        let mut w = last.clone();
        let now = w.now;
        match action {
            Action::ToCp => {
                let f = w.to_cp.pop_front().expect("in flight");
                w.cp.handle_frame(now, f);
            }
            Action::ToEdge => {
                let f = w.to_edge.pop_front().expect("in flight");
                w.edge.handle_frame(now, f);
            }
            Action::Accept => {
                w.hello_pending = false;
                let generation = w.store_generation;
                w.cp.accept(now, Some(projection(generation)));
            }
            Action::Mutate => {
                w.mutations += 1;
                w.store_generation += 1;
                if w.cp.is_connected() {
                    let generation = w.store_generation;
                    let _ = w.cp.push_projection(now, projection(generation));
                }
            }
            Action::Lease => {
                w.lease_count += 1;
                let generation = w.edge.projection_generation();
                let request = AcquireLeaseRequest {
                    binding: binding(generation),
                    recipient_public_key: [7; 32],
                };
                let ticket = w.edge.acquire_lease(now, request).expect("connected");
                w.leases.insert(
                    (w.session, ticket),
                    LeaseGhost {
                        generation,
                        answer: None,
                        answered: 0,
                    },
                );
            }
            Action::Answer(i) => {
                let (session, id, generation) = w.lease_requests.remove(i);
                let answer = if generation == w.store_generation {
                    AcquireLeaseResponse::Granted(lease(id, generation))
                } else {
                    AcquireLeaseResponse::Refused {
                        reason: "stale_generation".into(),
                    }
                };
                if let Some(g) = w.leases.get_mut(&(session, id)) {
                    g.answer = Some(answer.clone());
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
                let _ = w.edge.respond_status(
                    now,
                    id,
                    EdgeStatusResponse {
                        edge_id: EDGE.into(),
                        nodes: Vec::new(),
                    },
                );
            }
            Action::Cut => {
                w.cuts += 1;
                w.to_cp.clear();
                w.to_edge.clear();
                w.edge.handle_transport_closed();
                w.cp.handle_transport_closed();
            }
            Action::Reconnect => {
                w.session += 1;
                let held = w.edge.projection_generation();
                w.edge = EdgeControlSession::new(config(), hello(), held, now);
                w.cp = ControlPlaneSession::new(config(), Some(EDGE.into()), now);
                w.to_cp.clear();
                w.to_edge.clear();
                w.edge_closed = false;
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
        w.drain();
        Some(w)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("every step keeps the seed 001 rules", |_, w: &Wire| {
                w.broken.is_none()
            }),
            Property::sometimes("a lease granted", |_, w: &Wire| {
                w.leases.values().any(|g| {
                    g.answered == 1 && matches!(g.answer, Some(AcquireLeaseResponse::Granted(_)))
                })
            }),
            Property::sometimes("a lease refused as stale", |_, w: &Wire| {
                w.leases.values().any(|g| {
                    g.answered == 1
                        && matches!(g.answer, Some(AcquireLeaseResponse::Refused { .. }))
                })
            }),
            Property::sometimes("a projection pushed and installed", |_, w: &Wire| {
                w.edge.projection_generation() >= 2
            }),
            Property::sometimes("reconnected holding a projection", |_, w: &Wire| {
                w.session == 2 && w.edge.is_connected() && w.edge.projection_generation() >= 1
            }),
        ]
    }
}

#[test]
fn every_interleaving_keeps_the_control_wire_rules() {
    let large = std::env::var("CONTROL_MODEL").is_ok_and(|v| v == "large");
    let bounds = if large { Bounds::LARGE } else { Bounds::SMALL };
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let checker = ControlModel {
        bounds,
        start: Instant::now(),
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
