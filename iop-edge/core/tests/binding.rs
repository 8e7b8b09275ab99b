//! The managed binding loop (seed `001`) in virtual time: `ManagedBinding` driven against a
//! small Control Plane whose store changes on a schedule, with projections reaching the Edge
//! after a propagation delay. Nothing here sleeps; the clock is an `Instant` the harness moves.
//!
//! Rules checked (each against a deliberate break, listed in the commit):
//! - a projection change between the lease grant and the dispatch re-binds, then dispatches
//!   under the new projection (never with the old binding);
//! - a stale binding waits for the newer projection at most `stale_wait` from its first wait:
//!   a change that arrives just inside it succeeds, one just outside it is 503 + `Retry-After`;
//!   a burst of changes longer than the wait ends in 503 + `Retry-After`, not 403 or 502;
//! - a route or token revoked while the request is in flight is 403 with its message;
//! - an issuer activation between admission and binding re-admits the request on a Node that
//!   trusts the new key (no 502, no lease signed for an untrusted Node);
//! - a Control Plane replica going away waits for the failover within the same bound;
//! - a session that is up but answers no lease is asked once more after the wait, then the
//!   request is refused (503), never asked again and again.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_edge_core::binding::{
    AdmittedNode, BindingConfig, LeaseOutcome, ManagedBinding, NodeTrust, Refusal, Step,
};
use iop_edge_core::pool::ProviderKind;
use iop_edge_core::projection::ProjectionIndex;
use iop_edge_core::registry::Generation;
use iop_wire::control::{PrincipalProjection, ProjectedPrincipal, ProjectedRoute, ProjectedToken};
use iop_wire::runtime::CredentialLeaseBinding;
use ring::digest::{SHA256, digest};

const TOKEN: &str = "tok-team-a";
const PRINCIPAL: &str = "team-a";
const MODEL: &str = "gpt";
const TARGET: &str = "gpt-4o-mini";
const WAIT: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);
/// The Edge's wait for one lease answer (`iop_edge::control::LEASE_TIMEOUT`).
const LEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// The Control Plane's store: what a projection of generation `generation` says.
#[derive(Clone, Debug)]
struct Store {
    generation: u64,
    route: Option<ProjectedRoute>,
    token_enabled: bool,
    issuer: String,
}

impl Store {
    fn new() -> Self {
        Self {
            generation: 1,
            route: Some(ProjectedRoute {
                route_id: "r1".into(),
                principal_id: PRINCIPAL.into(),
                model: MODEL.into(),
                slot_id: "slot-1".into(),
                profile: "openai".into(),
                upstream_target: TARGET.into(),
                selector: String::new(),
                route_revision: 1,
                credential_revision: 1,
            }),
            token_enabled: true,
            issuer: "p256:old".into(),
        }
    }

    fn projection(&self) -> Arc<ProjectionIndex> {
        let mut d = [0u8; 32];
        d.copy_from_slice(digest(&SHA256, TOKEN.as_bytes()).as_ref());
        Arc::new(ProjectionIndex::new(PrincipalProjection {
            generation: self.generation,
            principals: vec![ProjectedPrincipal {
                principal_id: PRINCIPAL.into(),
                display_name: "Team A".into(),
                enabled: true,
                limits: None,
            }],
            tokens: if self.token_enabled {
                vec![ProjectedToken {
                    token_id: "t1".into(),
                    principal_id: PRINCIPAL.into(),
                    sha256_digest: d,
                }]
            } else {
                vec![]
            },
            routes: self.route.iter().cloned().collect(),
            issuer_key_id: self.issuer.clone(),
            staged_issuer_key_id: String::new(),
            staged_issuer_activates_at_unix_ms: 0,
            parts_before: 0,
        }))
    }

    /// The Control Plane's lease rule: a binding from an older generation is stale.
    fn lease(&self, binding: &CredentialLeaseBinding) -> LeaseOutcome {
        if binding.projection_generation != self.generation {
            LeaseOutcome::Refused("stale_generation".into())
        } else if self.route.is_none() || !self.token_enabled {
            LeaseOutcome::Refused("route_not_found".into())
        } else {
            LeaseOutcome::Granted
        }
    }
}

/// Which Nodes pin which issuer keys (the Edge registry's answer).
#[derive(Clone, Debug)]
struct Pins(Vec<(&'static str, &'static str)>);

impl NodeTrust for Pins {
    fn trusts(&self, node_id: &str, _: Generation, issuer_key_id: &str) -> bool {
        self.0
            .iter()
            .any(|&(n, k)| n == node_id && k == issuer_key_id)
    }
}

fn node(id: &str) -> AdmittedNode {
    AdmittedNode {
        node_id: id.into(),
        generation: Generation(1),
        kind: ProviderKind::OpenAiCompat,
        target: TARGET.into(),
        recipient_key_id: Some(format!("{id}-key")),
    }
}

/// A store change at `at` (applied to the Control Plane then, reaching the Edge `lag` later).
type Change = (Duration, fn(&mut Store));

/// The world around one request: the virtual clock, the Control Plane, the Edge's projection.
struct World {
    t0: Instant,
    now: Instant,
    store: Store,
    /// The projection the Edge holds.
    edge: Arc<ProjectionIndex>,
    /// Store changes still to happen, in time order.
    changes: VecDeque<Change>,
    /// Projections on their way to the Edge: (arrival, projection).
    in_flight: VecDeque<(Instant, Arc<ProjectionIndex>)>,
    /// Propagation delay from the store to the Edge.
    lag: Duration,
    /// Lease round trip.
    rtt: Duration,
    /// Whether the session is down until this time.
    down_until: Option<Instant>,
    /// Whether the session is up but its Control Plane answers no lease asked before this
    /// time (overloaded, or reading other frames first): the Edge gives up on each ask after
    /// [`LEASE_TIMEOUT`].
    silent_until: Option<Instant>,
    pins: Pins,
    /// Nodes the pool admits, in order (the first is the original admission).
    admissions: VecDeque<AdmittedNode>,
    /// Every binding a lease was asked for.
    asked: Vec<CredentialLeaseBinding>,
    /// Readmissions done.
    readmits: usize,
}

impl World {
    fn new(changes: Vec<Change>) -> Self {
        let t0 = Instant::now();
        let store = Store::new();
        let edge = store.projection();
        Self {
            t0,
            now: t0,
            store,
            edge,
            changes: changes.into(),
            in_flight: VecDeque::new(),
            lag: 50 * MS,
            rtt: 2 * MS,
            down_until: None,
            silent_until: None,
            pins: Pins(vec![("node-1", "p256:old"), ("node-2", "p256:old")]),
            admissions: VecDeque::from([node("node-1")]),
            asked: Vec::new(),
            readmits: 0,
        }
    }

    /// Moves the clock to `to`, applying store changes and projection arrivals on the way.
    fn advance(&mut self, to: Instant) {
        loop {
            let change = self.changes.front().map(|(at, _)| self.t0 + *at);
            let arrival = self.in_flight.front().map(|(at, _)| *at);
            let next = [change, arrival]
                .into_iter()
                .flatten()
                .filter(|&t| t <= to)
                .min();
            let Some(next) = next else { break };
            self.now = self.now.max(next);
            if change == Some(next) {
                let (_, f) = self.changes.pop_front().expect("a change is due");
                f(&mut self.store);
                self.store.generation += 1;
                self.in_flight
                    .push_back((next + self.lag, self.store.projection()));
            } else {
                let (_, p) = self.in_flight.pop_front().expect("an arrival is due");
                self.edge = p;
            }
        }
        self.now = self.now.max(to);
    }

    /// The next time the Edge's projection changes, if before `until`.
    fn next_arrival(&mut self, after: u64, until: Instant) -> Option<Arc<ProjectionIndex>> {
        loop {
            if self.edge.generation() > after {
                return Some(self.edge.clone());
            }
            let change = self.changes.front().map(|(at, _)| self.t0 + *at);
            let arrival = self.in_flight.front().map(|(at, _)| *at);
            match [change, arrival].into_iter().flatten().min() {
                Some(t) if t <= until => self.advance(t),
                _ => {
                    self.advance(until);
                    return None;
                }
            }
        }
    }

    /// Runs one request to its end: the binding dispatched, or the refusal.
    fn run(&mut self, config: BindingConfig) -> Result<CredentialLeaseBinding, Refusal> {
        let first = self.admissions.pop_front().expect("an admission");
        let mut m = ManagedBinding::new(config, self.edge.clone(), PRINCIPAL, TOKEN, MODEL, first);
        let mut step = m.start(&self.pins);
        for _ in 0..10_000 {
            step = match step {
                Step::Acquire(binding) => {
                    self.asked.push(binding.clone());
                    let sent = self.now;
                    if self.silent_until.is_some_and(|t| sent < t) {
                        self.advance(sent + LEASE_TIMEOUT);
                        let current = Some(self.edge.clone());
                        step = m.handle_lease(
                            self.now,
                            LeaseOutcome::Unreachable,
                            current,
                            &self.pins,
                        );
                        continue;
                    }
                    // The Control Plane answers half-way through the round trip.
                    self.advance(sent + self.rtt / 2);
                    let outcome = if self.down_until.is_some_and(|d| self.now < d) {
                        LeaseOutcome::Unreachable
                    } else {
                        self.store.lease(&binding)
                    };
                    self.advance(sent + self.rtt);
                    m.handle_lease(self.now, outcome, Some(self.edge.clone()), &self.pins)
                }
                Step::AwaitProjection { after, until } => {
                    let newer = self.next_arrival(after, until);
                    m.handle_projection(newer, &self.pins)
                }
                Step::AwaitConnected { until } => {
                    // As the Edge's driver (`connected_within`): a session already up is
                    // found at once, even when `until` has passed.
                    let up = self.down_until.unwrap_or(self.now).max(self.now);
                    let current = if up <= until.max(self.now) {
                        self.advance(up);
                        Some(self.edge.clone())
                    } else {
                        self.advance(until);
                        None
                    };
                    m.handle_connected(current, &self.pins)
                }
                Step::Readmit => {
                    self.readmits += 1;
                    let next = self.admissions.pop_front().expect("a second candidate");
                    m.handle_readmitted(next, true, &self.pins)
                }
                Step::Dispatch(binding) => {
                    // The machine only dispatches a binding it was granted a lease for.
                    assert_eq!(self.asked.last(), Some(&binding));
                    return Ok(binding);
                }
                Step::Refuse(r) => return Err(r),
            };
        }
        panic!("the binding loop did not end");
    }

    fn elapsed(&self) -> Duration {
        self.now - self.t0
    }
}

fn rotate_slot(s: &mut Store) {
    if let Some(r) = s.route.as_mut() {
        r.credential_revision += 1;
    }
}

fn unrelated(_: &mut Store) {}

#[test]
fn no_change_binds_at_once() {
    let mut w = World::new(vec![]);
    let b = w.run(BindingConfig::default()).expect("bound");
    assert_eq!(b.projection_generation, 1);
    assert_eq!(b.node_id, "node-1");
    assert_eq!(b.recipient_key_id, "node-1-key");
    assert_eq!(w.asked.len(), 1);
}

/// Seed 001: the Edge checks the binding right before dispatch. The slot rotates while the
/// lease is in flight and the rotated projection reaches the Edge before the answer: the
/// granted lease is for the old revision, so the request is bound again under the new
/// projection and dispatched with the new revision.
#[test]
fn projection_change_between_grant_and_dispatch_rebinds() {
    // The Control Plane answers the lease at 1 ms (granting generation 1's binding); the slot
    // rotates at 1.5 ms and its projection reaches the Edge at once, before the answer is
    // handled at 2 ms.
    let mut w = World::new(vec![(Duration::from_micros(1500), rotate_slot)]);
    w.lag = Duration::ZERO;
    let b = w
        .run(BindingConfig::default())
        .expect("re-bound and dispatched");
    assert_eq!(
        w.asked.len(),
        2,
        "granted once under generation 1, bound again"
    );
    assert_eq!(w.asked[0].projection_generation, 1);
    assert_eq!(w.asked[0].credential_revision, 1);
    assert_eq!(b.projection_generation, 2);
    assert_eq!(
        b.credential_revision, 2,
        "dispatched under the new revision"
    );
}

/// One change after the request's snapshot: the Control Plane refuses the stale binding; the
/// request waits for the newer projection and binds again.
#[test]
fn a_stale_binding_waits_for_the_newer_projection() {
    let mut w = World::new(vec![(Duration::ZERO, unrelated)]);
    w.advance(w.t0);
    let b = w.run(BindingConfig::default()).expect("bound");
    assert_eq!(b.projection_generation, 2);
    assert_eq!(w.asked.len(), 2);
    assert!(w.elapsed() >= w.lag, "it waited for the projection");
}

/// The 1 s rule, exactly: the wait counts from the first refusal (at `rtt`); a projection
/// that arrives 1 ms before the deadline is used, one that arrives 1 ms after is not.
#[test]
fn the_stale_wait_bound_is_exact() {
    let inside = {
        let mut w = World::new(vec![(Duration::ZERO, unrelated)]);
        w.advance(w.t0);
        // Refused at rtt (2 ms): the deadline is 1002 ms; the projection arrives at 1001 ms.
        w.in_flight.clear();
        w.in_flight
            .push_back((w.t0 + WAIT + w.rtt - MS, w.store.projection()));
        let r = w.run(BindingConfig::with_stale_wait(WAIT));
        (r, w.elapsed())
    };
    assert_eq!(inside.0.map(|b| b.projection_generation), Ok(2));
    let outside = {
        let mut w = World::new(vec![(Duration::ZERO, unrelated)]);
        w.advance(w.t0);
        w.in_flight.clear();
        w.in_flight
            .push_back((w.t0 + WAIT + w.rtt + MS, w.store.projection()));
        let r = w.run(BindingConfig::with_stale_wait(WAIT));
        (r, w.elapsed())
    };
    assert_eq!(outside.0, Err(Refusal::Propagating));
    assert_eq!(outside.1, WAIT + 2 * MS, "refused exactly at the deadline");
    // A configured wait moves the bound with it.
    let mut w = World::new(vec![(Duration::ZERO, unrelated)]);
    w.advance(w.t0);
    w.in_flight.clear();
    w.in_flight
        .push_back((w.t0 + WAIT + w.rtt + MS, w.store.projection()));
    let r = w.run(BindingConfig::with_stale_wait(5 * WAIT));
    assert_eq!(r.map(|b| b.projection_generation), Ok(2));
}

/// A burst of changes, each landing before the previous binding's lease is asked, for longer
/// than the wait: the request is refused 503 + `Retry-After` (the change is still
/// propagating), not 403 (nobody lost access) and not 502.
#[test]
fn a_burst_longer_than_the_wait_is_503_with_retry_after() {
    let changes: Vec<Change> = (0..200u64)
        .map(|i| (Duration::from_millis(i * 10), unrelated as fn(&mut Store)))
        .collect();
    let mut w = World::new(changes);
    // The first change lands before the request binds.
    w.advance(w.t0);
    let r = w.run(BindingConfig::default());
    assert_eq!(r, Err(Refusal::Propagating));
    let refusal = Refusal::Propagating;
    assert_eq!(refusal.status(), 503);
    assert_eq!(refusal.retry_after(), Some(1));
    assert!(w.asked.len() > 2, "it re-bound while the burst went on");
    assert!(
        w.elapsed() <= WAIT + 20 * MS,
        "bounded by the wait: {:?}",
        w.elapsed()
    );
    // The same burst with a wait longer than it: bound after the burst ends.
    let changes: Vec<Change> = (0..20u64)
        .map(|i| (Duration::from_millis(i * 10), unrelated as fn(&mut Store)))
        .collect();
    let mut w = World::new(changes);
    w.advance(w.t0);
    let b = w
        .run(BindingConfig::default())
        .expect("bound after the burst");
    assert_eq!(b.projection_generation, 21);
}

fn revoke_route(s: &mut Store) {
    s.route = None;
}

fn revoke_token(s: &mut Store) {
    s.token_enabled = false;
}

fn move_target(s: &mut Store) {
    if let Some(r) = s.route.as_mut() {
        r.upstream_target = "another-model".into();
        r.route_revision += 1;
    }
}

/// A route revoked while the request is in flight: 403 "access to this model was withdrawn".
#[test]
fn a_revoked_route_is_403_with_its_message() {
    for revoke in [revoke_route as fn(&mut Store), revoke_token] {
        let mut w = World::new(vec![(Duration::ZERO, revoke)]);
        w.advance(w.t0);
        let r = w.run(BindingConfig::default());
        assert_eq!(r, Err(Refusal::Withdrawn));
        let refusal = Refusal::Withdrawn;
        assert_eq!(refusal.status(), 403);
        assert_eq!(refusal.message(), "access to this model was withdrawn");
        assert_eq!(refusal.retry_after(), None);
    }
    // Moved to another upstream target than the admitted provider serves: a retry is
    // admitted afresh (503), never dispatched to the old target.
    let mut w = World::new(vec![(Duration::ZERO, move_target)]);
    w.advance(w.t0);
    assert_eq!(w.run(BindingConfig::default()), Err(Refusal::Propagating));
}

/// The other 403s and 502s, each with its message.
#[test]
fn every_refusal_has_its_status_and_message() {
    let cases = [
        (Refusal::ScopeChanged, 403, "request scope changed"),
        (
            Refusal::CredentialsChanged,
            403,
            "credentials changed; request refused",
        ),
        (
            Refusal::LeaseRefused("principal_disabled".into()),
            403,
            "credential lease refused: principal_disabled",
        ),
        (
            Refusal::NoProviderForTarget,
            502,
            "no provider serves this route's upstream target",
        ),
        (
            Refusal::NoRecipientKey,
            502,
            "selected node has no credential recipient key",
        ),
        (
            Refusal::ControlPlaneUnavailable,
            503,
            "control plane unavailable",
        ),
    ];
    for (r, status, message) in cases {
        assert_eq!(r.status(), status, "{r:?}");
        assert_eq!(r.message(), message, "{r:?}");
        assert_eq!(r.retry_after(), None, "{r:?}");
    }
    // A non-propagation lease refusal is 403 with the Control Plane's reason.
    let mut w = World::new(vec![]);
    w.store.token_enabled = false;
    assert_eq!(
        w.run(BindingConfig::default()),
        Err(Refusal::LeaseRefused("route_not_found".into()))
    );
    // The granted lease, then a projection that no longer admits the binding and is no newer
    // (the check right before dispatch fails closed).
    let mut w = World::new(vec![]);
    let mut revoked = w.store.clone();
    revoked.token_enabled = false;
    let stale_revoked = revoked.projection();
    w.in_flight.push_back((w.t0 + MS, stale_revoked));
    assert_eq!(
        w.run(BindingConfig::default()),
        Err(Refusal::CredentialsChanged)
    );
    // A native provider cannot carry a credential; a Node without a recipient key cannot
    // open one.
    let mut w = World::new(vec![]);
    w.admissions[0].kind = ProviderKind::Native;
    assert_eq!(
        w.run(BindingConfig::default()),
        Err(Refusal::NoProviderForTarget)
    );
    let mut w = World::new(vec![]);
    w.admissions[0].recipient_key_id = None;
    assert_eq!(
        w.run(BindingConfig::default()),
        Err(Refusal::NoRecipientKey)
    );
    assert!(w.asked.is_empty(), "no lease asked for an unusable Node");
    // A route the principal never had: 404.
    let mut w = World::new(vec![]);
    w.store.route = None;
    w.edge = w.store.projection();
    assert_eq!(w.run(BindingConfig::default()), Err(Refusal::UnknownModel));
}

fn activate_new_issuer(s: &mut Store) {
    s.issuer = "p256:new".into();
}

/// Issuer activation between admission and binding: the request was admitted to node-1, which
/// pins only the old key; the projection it binds under signs with the new key. It is
/// re-admitted (node-2 pins both) and bound there, never leased for node-1.
#[test]
fn an_issuer_activation_readmits_on_a_trusting_node() {
    let mut w = World::new(vec![(Duration::ZERO, activate_new_issuer)]);
    w.pins = Pins(vec![
        ("node-1", "p256:old"),
        ("node-2", "p256:old"),
        ("node-2", "p256:new"),
    ]);
    w.admissions.push_back(node("node-2"));
    w.advance(w.t0);
    // The request authenticated under generation 1 (old key), then learns of generation 2.
    let b = w.run(BindingConfig::default()).expect("bound on node-2");
    assert_eq!(b.node_id, "node-2");
    assert_eq!(b.recipient_key_id, "node-2-key");
    assert_eq!(w.readmits, 1);
    assert!(
        w.asked
            .iter()
            .all(|a| a.node_id != "node-1" || a.projection_generation == 1),
        "node-1 was never asked a lease under the new key: {:?}",
        w.asked
    );
    // No trusting Node: re-admitted once, then 503 (the Edge stops selecting it soon).
    let mut w = World::new(vec![(Duration::ZERO, activate_new_issuer)]);
    w.admissions.push_back(node("node-2"));
    w.advance(w.t0);
    assert_eq!(w.run(BindingConfig::default()), Err(Refusal::Propagating));
    assert_eq!(w.readmits, 1, "re-admitted at most once");
}

/// A Control Plane replica goes away: the lease finds no session, the request waits for the
/// failover within the same bound and binds under the projection held then.
#[test]
fn a_failover_within_the_wait_binds() {
    let mut w = World::new(vec![]);
    w.down_until = Some(w.t0 + 600 * MS);
    let b = w
        .run(BindingConfig::default())
        .expect("bound after failover");
    assert_eq!(b.projection_generation, 1);
    assert!(w.elapsed() >= 600 * MS);
    let mut w = World::new(vec![]);
    w.down_until = Some(w.t0 + 2 * WAIT);
    assert_eq!(
        w.run(BindingConfig::default()),
        Err(Refusal::ControlPlaneUnavailable)
    );
    assert_eq!(w.elapsed(), WAIT + 2 * MS, "refused at the deadline");
}

/// A session that is up but whose Control Plane answers no lease (overloaded, or reading a
/// usage backlog first): the first ask times out, the request waits for a session within the
/// bound (one is up), asks once more, and is refused when that times out too, rather than ask
/// again for as long as the Control Plane stays silent. Before this rule a request was held
/// one lease timeout after another (seen as an HTTP client's 30 s read timeout in CI).
#[test]
fn a_silent_control_plane_is_refused_after_the_wait_not_asked_forever() {
    let mut w = World::new(vec![]);
    w.silent_until = Some(w.t0 + 60 * LEASE_TIMEOUT);
    assert_eq!(
        w.run(BindingConfig::default()),
        Err(Refusal::ControlPlaneUnavailable)
    );
    assert_eq!(
        w.asked.len(),
        2,
        "asked once more after the session wait, no more"
    );
    assert_eq!(w.elapsed(), 2 * LEASE_TIMEOUT);
    // Silent only for the first ask: the second is answered and binds.
    let mut w = World::new(vec![]);
    w.silent_until = Some(w.t0 + MS);
    let b = w
        .run(BindingConfig::default())
        .expect("bound on the second ask");
    assert_eq!(b.projection_generation, 1);
    assert_eq!(w.asked.len(), 2);
}

/// Calling a `handle_*` the last step did not ask for is refused as misuse, not panicked on.
#[test]
fn api_misuse_is_a_refusal() {
    let w = World::new(vec![]);
    let mut m = ManagedBinding::new(
        BindingConfig::default(),
        w.edge.clone(),
        PRINCIPAL,
        TOKEN,
        MODEL,
        node("node-1"),
    );
    assert_eq!(
        m.handle_projection(None, &w.pins),
        Step::Refuse(Refusal::ApiMisuse)
    );
}
