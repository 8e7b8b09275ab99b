//! Exhaustive model check of the seed 004 ACK and report rules (§5.2, §5.3) with `stateright`.
//!
//! The state is the real reference store, [`StoreState`] (the rules `MemoryStore` runs and the
//! Redis store's Lua scripts are held to by `differential.rs`), plus a virtual clock. From the
//! empty store the checker applies, in every order, every action of a small configuration:
//!
//! - `Register`: a new session of the one worker (a re-registration replaces the old one);
//! - `Publish(e, v, c)`: the controller publishes snapshot `(epoch e, version v)` with
//!   checksum `c`;
//! - `Ack(session, e, v, c, applied)`: a positive or negative ACK, from the current session or
//!   a replaced one, of any tuple and checksum (published or not, stale or not);
//! - `Report(session, seq, e, v, content)`: a runtime report of any sequence, tuple and
//!   content, from any session;
//! - `Expire(entry)`: one key's TTL runs out: the session, the reference or the runtime, one
//!   at a time and in any order (Redis expires keys independently; a session may be gone
//!   while its runtime lives on, and a new session may register beside that runtime).
//!
//! Messages may arrive in any order and be duplicated, which is exactly what a worker on a lossy
//! network with retries and a controller failover can produce. Every transition is checked
//! against the seed's rules, each named after the one it encodes:
//!
//! - **ack-upper-bound-monotonic** (§5.2): a session's acknowledged tuple never moves back;
//! - **report-only-when-enabled-and-bound** (§5.3): a stored runtime changes only on a report of
//!   the current session, with runtime enabled and the report's tuple equal to the bound;
//! - **negative-ack-clears-and-late-report-never-rebuilds** (§5.2, §5.3): once a negative ACK
//!   has been answered OK, and until a positive one is, that session has no runtime and no
//!   fence and no report of it is accepted, whatever arrives late; more generally, while
//!   runtime is disabled there is no runtime and no fence;
//! - **replaced-session-changes-nothing** (§5.1): an ACK or report of a replaced session
//!   leaves the store exactly as it was;
//! - **runtime-agrees-with-fence**: a stored runtime is the fence's sequence and digest, of
//!   the current bound;
//! - **reference-only-forward** (§4): a published reference never moves back nor changes
//!   checksum at the same tuple;
//! - **positive-ack-sets-the-bound**: an accepted positive ACK leaves exactly its tuple as the
//!   bound, runtime enabled.
//!
//! ## Bounds, state space, time
//!
//! The test command runs [`Bounds::SMALL`]: 3 sessions, tuples (1,1) (1,2) (2,1), 2 checksums,
//! sequences 1–3, 2 contents, 2 expiries. It prints the unique state count and the time (see
//! `benches/README.md` and the note of issue #17 for the figures). `PROXYPOOL_MODEL=large`
//! runs [`Bounds::LARGE`] by hand (4 sessions, 4 tuples, sequences 1–4, 3 contents, 3 expiries).
//!
//! ## Does it catch bugs?
//!
//! [`Mutation`] replays known-wrong rules inside the same model, and a test asserts the checker
//! finds each counterexample:
//!
//! - `NegativeAckSkipped`: a negative ACK is answered OK but its effect is lost (the Lua
//!   script's `else` branch missing) → found as
//!   **negative-ack-clears-and-late-report-never-rebuilds**: the worker was told its runtime is
//!   disabled (a property of the answers, not of the store), yet the fence and runtime are
//!   still there, and a late report is accepted;
//! - `ReportIgnoresSession`: a report is checked against whatever session is current, not its
//!   own (a missing `sid` comparison) → found as **replaced-session-changes-nothing**.
//!
//! The same was checked once against the real code (not kept): deleting `*fence = None;` from
//! `AckEffect::Disable` in `StoreState::acknowledge_snapshot` makes the first property fail with
//! a 5-step counterexample (register, publish, positive ACK, report, negative ACK).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::time::{Duration, Instant};

use proxypool_controller::domain::{
    Counter, Counters, Report, Session, SnapshotAcknowledgement, SnapshotReference, SnapshotTuple,
};
use proxypool_controller::memory::{Entry, StoreState};
use stateright::{Checker, Model, Property};

const W: &str = "worker-1";
const TTL: Duration = Duration::from_secs(30);

/// The size of the configuration explored.
#[derive(Clone, Copy, Debug)]
struct Bounds {
    sessions: u8,
    tuples: &'static [(u64, u64)],
    max_seq: u64,
    contents: u8,
    expiries: u8,
}

impl Bounds {
    const SMALL: Self = Self {
        sessions: 3,
        tuples: &[(1, 1), (1, 2), (2, 1)],
        max_seq: 3,
        contents: 2,
        expiries: 2,
    };
    const LARGE: Self = Self {
        sessions: 4,
        tuples: &[(1, 1), (1, 2), (2, 1), (2, 2)],
        max_seq: 4,
        contents: 3,
        expiries: 3,
    };
}

/// A known-wrong rule, to show the checker finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    NegativeAckSkipped,
    ReportIgnoresSession,
}

#[derive(Clone, Debug)]
struct AckReportModel {
    bounds: Bounds,
    mutation: Option<Mutation>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Register,
    Publish {
        e: u64,
        v: u64,
        c: u8,
    },
    Ack {
        sid: u8,
        e: u64,
        v: u64,
        c: u8,
        applied: bool,
    },
    Report {
        sid: u8,
        seq: u64,
        e: u64,
        v: u64,
        content: u8,
    },
    Expire(Entry),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    store: StoreState,
    now_ms: u64,
    registered: u8,
    expiries: u8,
    /// The session last told (by an accepted negative ACK) that its runtime is disabled, until
    /// a positive ACK is accepted: taken from the answers, not from the store.
    disabled_by: Option<u8>,
    /// The first rule a transition broke (the checker reports the path to it).
    broken: Option<&'static str>,
}

fn tuple(e: u64, v: u64) -> SnapshotTuple {
    SnapshotTuple {
        ownership_epoch: e,
        version: v,
    }
}

fn report(sid: u8, seq: u64, e: u64, v: u64, content: u8) -> Report {
    Report {
        worker_id: W.into(),
        session_id: [sid; 16],
        sequence: seq,
        tuple: tuple(e, v),
        observed_at_unix_ms: 1,
        counters: Counters::new(
            (0..content)
                .map(|i| Counter {
                    proxy_id: format!("p-{i}"),
                    in_flight: u64::from(i),
                    open_connections: 1,
                })
                .collect(),
        )
        .expect("valid counters"),
    }
}

impl Model for AckReportModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            store: StoreState::default(),
            now_ms: 0,
            registered: 0,
            expiries: 0,
            disabled_by: None,
            broken: None,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        if s.broken.is_some() {
            return;
        }
        let b = self.bounds;
        if s.registered < b.sessions {
            out.push(Action::Register);
        }
        if s.expiries < b.expiries {
            for entry in [Entry::Session, Entry::Reference, Entry::Runtime] {
                out.push(Action::Expire(entry));
            }
        }
        for &(e, v) in b.tuples {
            for c in 0..2 {
                out.push(Action::Publish { e, v, c });
            }
        }
        for sid in 1..=s.registered {
            for &(e, v) in b.tuples {
                for c in 0..2 {
                    for applied in [true, false] {
                        out.push(Action::Ack {
                            sid,
                            e,
                            v,
                            c,
                            applied,
                        });
                    }
                }
                for seq in 1..=b.max_seq {
                    for content in 0..b.contents {
                        out.push(Action::Report {
                            sid,
                            seq,
                            e,
                            v,
                            content,
                        });
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        // What the store looks like at this instant before the step (expired keys gone).
        let mut before = last.store.clone();
        before.expire(s.now_ms);
        let now = s.now_ms;
        match action {
            Action::Register => {
                s.registered += 1;
                s.disabled_by = None;
                let session = Session {
                    worker_id: W.into(),
                    instance_id: format!("inst-{}", s.registered),
                    session_id: [s.registered; 16],
                    acked: SnapshotTuple::default(),
                    acked_checksum: [0; 32],
                    runtime_enabled: false,
                };
                s.store.open_session(now, &session, TTL);
            }
            Action::Expire(entry) => {
                s.expiries += 1;
                s.store.evict(W, entry);
            }
            Action::Publish { e, v, c } => {
                let r = SnapshotReference {
                    tuple: tuple(e, v),
                    checksum: [c; 32],
                };
                let _refused_or_not = s.store.record_issued_snapshot(now, W, r, TTL);
            }
            Action::Ack {
                sid,
                e,
                v,
                c,
                applied,
            } => {
                let ack = SnapshotAcknowledgement {
                    worker_id: W.into(),
                    session_id: [sid; 16],
                    tuple: tuple(e, v),
                    checksum: [c; 32],
                    applied,
                };
                let accepted = s.store.acknowledge_snapshot(now, &ack, TTL).is_ok();
                if accepted && !applied && self.mutation == Some(Mutation::NegativeAckSkipped) {
                    // The wrong rule: the negative ACK is answered OK and its effect is lost.
                    s.store = last.store.clone();
                }
                if accepted {
                    // What the worker was told: its runtime is disabled until a positive ACK.
                    s.disabled_by = (!applied).then_some(sid);
                }
                if accepted && applied {
                    let bound = s
                        .store
                        .session(W)
                        .map(|(x, _)| (x.acked, x.runtime_enabled));
                    if bound != Some((tuple(e, v), true)) {
                        s.broken.get_or_insert("positive-ack-sets-the-bound");
                    }
                }
            }
            Action::Report {
                sid,
                seq,
                e,
                v,
                content,
            } => {
                let mut r = report(sid, seq, e, v, content);
                if self.mutation == Some(Mutation::ReportIgnoresSession)
                    && let Some((current, _)) = s.store.session(W)
                {
                    r.session_id = current.session_id;
                }
                let accepted = s.store.replace_runtime(now, &r, TTL, TTL).is_ok();
                if accepted && s.disabled_by == Some(sid) {
                    s.broken
                        .get_or_insert("negative-ack-clears-and-late-report-never-rebuilds");
                }
            }
        }
        check_step(&before, &action, &s.store, &mut s.broken);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "every transition keeps the seed 004 rules",
                |_, s: &State| s.broken.is_none(),
            ),
            Property::always(
                "negative-ack-clears-and-late-report-never-rebuilds",
                |_, s: &State| {
                    let told = s.disabled_by.is_some_and(|sid| {
                        s.store
                            .session(W)
                            .is_some_and(|(x, _)| x.session_id == [sid; 16])
                    });
                    match s.store.session(W) {
                        Some((session, fence)) if told || !session.runtime_enabled => {
                            !session.runtime_enabled
                                && fence.is_none()
                                && s.store.runtime(W).is_none()
                        }
                        _ => true,
                    }
                },
            ),
            Property::always("runtime-agrees-with-fence", |_, s: &State| {
                match (s.store.runtime(W), s.store.session(W)) {
                    (None, _) => true,
                    (Some(_), None) => true, // the session expired first; the runtime follows
                    (Some(r), Some((session, fence))) => {
                        session.runtime_enabled
                            && r.tuple == session.acked
                            && r.session_id == session.session_id
                            && fence == Some((r.sequence, r.digest()))
                    }
                }
            }),
            // The configuration reaches what matters (else the bounds are too small to mean
            // anything).
            Property::sometimes("a report is stored", |_, s: &State| {
                s.store.runtime(W).is_some()
            }),
            Property::sometimes(
                "a negative ACK disabled an acknowledged session",
                |_, s: &State| {
                    s.store.session(W).is_some_and(|(x, _)| {
                        !x.runtime_enabled && x.acked != SnapshotTuple::default()
                    })
                },
            ),
            Property::sometimes("a second session acknowledged", |_, s: &State| {
                s.store
                    .session(W)
                    .is_some_and(|(x, _)| x.session_id[0] >= 2 && x.runtime_enabled)
            }),
        ]
    }
}

/// The transition rules (see the module docs).
fn check_step(
    before: &StoreState,
    action: &Action,
    after: &StoreState,
    broken: &mut Option<&'static str>,
) {
    let b = before.session(W);
    let a = after.session(W);
    if let (Some((bs, _)), Some((as_, _))) = (b, a)
        && bs.session_id == as_.session_id
        && as_.acked < bs.acked
    {
        broken.get_or_insert("ack-upper-bound-monotonic");
    }
    if let (Some(br), Some(ar)) = (before.reference(W), after.reference(W))
        && (ar.tuple < br.tuple || (ar.tuple == br.tuple && ar.checksum != br.checksum))
    {
        broken.get_or_insert("reference-only-forward");
    }
    if let Action::Ack { sid, .. } | Action::Report { sid, .. } = action
        && b.is_none_or(|(x, _)| x.session_id != [*sid; 16])
        && before != after
    {
        broken.get_or_insert("replaced-session-changes-nothing");
    }
    if let Action::Report { sid, e, v, .. } = action
        && before.runtime(W) != after.runtime(W)
    {
        let allowed = b.is_some_and(|(x, _)| {
            x.session_id == [*sid; 16] && x.runtime_enabled && x.acked == tuple(*e, *v)
        });
        if !allowed {
            broken.get_or_insert("report-only-when-enabled-and-bound");
        }
    }
}

fn check(bounds: Bounds, mutation: Option<Mutation>) -> impl Checker<AckReportModel> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    AckReportModel { bounds, mutation }
        .checker()
        .threads(threads)
        .spawn_bfs()
        .join()
}

#[test]
fn every_interleaving_keeps_the_ack_and_report_rules() {
    let large = std::env::var("PROXYPOOL_MODEL").is_ok_and(|v| v == "large");
    let bounds = if large { Bounds::LARGE } else { Bounds::SMALL };
    let started = Instant::now();
    let checker = check(bounds, None);
    eprintln!(
        "proxy-pool ACK/report model ({}): {} unique states, {} generated, {:.2?}",
        if large { "large" } else { "small" },
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    checker.assert_properties();
}

#[test]
fn the_checker_finds_a_negative_ack_whose_effect_is_lost() {
    let checker = check(Bounds::SMALL, Some(Mutation::NegativeAckSkipped));
    let path = checker
        .discovery("negative-ack-clears-and-late-report-never-rebuilds")
        .expect("the mutated rule is found");
    eprintln!("counterexample: {:?}", path.into_actions());
}

#[test]
fn the_checker_finds_a_report_checked_against_the_wrong_session() {
    let checker = check(Bounds::SMALL, Some(Mutation::ReportIgnoresSession));
    let path = checker
        .discovery("every transition keeps the seed 004 rules")
        .expect("the mutated rule is found");
    assert_eq!(
        checker
            .discovery("every transition keeps the seed 004 rules")
            .map(|p| p.last_state().broken),
        Some(Some("replaced-session-changes-nothing"))
    );
    eprintln!("counterexample: {:?}", path.into_actions());
}
