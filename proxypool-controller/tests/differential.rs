//! The Redis store's Lua scripts held to the pure rules: random operation sequences applied to
//! the reference store ([`StoreState`], the rules the model checker explores in `model.rs`)
//! and to the Redis store on the real private `redis-server` (`scripts/test-all.sh` names it in
//! `PROXYPOOL_TEST_REDIS_URL`), comparing every answer and, after every step, everything both
//! stores hold for every worker ([`WorkerRecord`]: session, fence and its digest, published
//! reference, runtime) and the ownership epoch.
//!
//! The alphabet is small on purpose (2 workers, 3 session ids, 2 epochs × 4 versions × 2
//! checksums, 4 sequences, 3 counter contents, 2 observation times), so that random sequences
//! keep hitting the interesting collisions: a replaced session's late ACK or report, the same
//! sequence with other content, an ACK of an unpublished or superseded reference, a negative
//! ACK followed by a late report, both `*_with_epoch` forms beside the two-step ones. TTLs are
//! long (no key expires during a case); expiry is the model checker's business, in virtual
//! time.
//!
//! Ops carry hints (use the current session, the published reference, the bound, the next
//! sequence) resolved against the pure store before each step, so that most sequences reach
//! accepted ACKs and reports rather than refusals only.
//!
//! Does it catch a wrong script? With the ACK script's negative branch reduced to
//! `HSET rt 0` (the fence and runtime not cleared; made, run, reverted), it failed after 37
//! sequences and shrank to 5 steps: open, publish, positive ACK, report, negative ACK — the
//! Redis record kept `fence: Some(1)` and the runtime where the pure store had none.
//!
//! `PROXYPOOL_DIFF_CASES` sets the number of sequences (default 2000, each 1–40 steps); a
//! failure prints the shrunk sequence, and proptest keeps its seed in
//! `tests/differential.proptest-regressions` (replayed first on the next run).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use proxypool_controller::domain::{
    ControlStore, Counter, Counters, Report, Session, SnapshotAcknowledgement, SnapshotReference,
    SnapshotTuple, StoreError,
};
use proxypool_controller::memory::StoreState;
use proxypool_controller::redis_store::RedisStore;

const TTL: Duration = Duration::from_secs(120);
const WORKERS: [&str; 2] = ["w-1", "w-2"];
static NEXT: AtomicU32 = AtomicU32::new(0);

#[derive(Clone, Debug)]
enum Op {
    Epoch,
    Open {
        w: usize,
        sid: u8,
    },
    Publish {
        w: usize,
        e: u64,
        v: u64,
        c: u8,
    },
    Ack {
        w: usize,
        sid: u8,
        e: u64,
        v: u64,
        c: u8,
        applied: bool,
        with_epoch: bool,
        /// Bit 0: the current session's id instead of `sid`; bit 1: the published reference
        /// instead of `e`, `v`, `c` (resolved against the pure store before the step, so that
        /// random sequences keep reaching accepted ACKs).
        hint: u8,
    },
    Report {
        w: usize,
        sid: u8,
        seq: u64,
        e: u64,
        v: u64,
        content: u8,
        observed: i64,
        with_epoch: bool,
        /// Bit 0: the current session's id; bit 1: its acknowledged tuple; bits 2–3: sequence
        /// = as given (0), fence + 1 (1), the fence's own (2, a replay or a conflict).
        hint: u8,
    },
}

/// Hints toward the accepted path: mostly all set, sometimes some.
fn hint() -> impl Strategy<Value = u8> {
    prop_oneof![3 => Just(0b0111u8), 1 => Just(0b1011u8), 2 => 0u8..16]
}

/// `op` with its hints replaced by what the pure store holds now (both stores then get the
/// same concrete operation).
fn resolve(op: &Op, pure: &StoreState) -> Op {
    let mut op = op.clone();
    match &mut op {
        Op::Ack {
            w,
            sid,
            e,
            v,
            c,
            hint,
            ..
        } => {
            if *hint & 1 != 0
                && let Some((session, _)) = pure.session(WORKERS[*w])
            {
                *sid = session.session_id[0];
            }
            if *hint & 2 != 0
                && let Some(r) = pure.reference(WORKERS[*w])
            {
                (*e, *v, *c) = (r.tuple.ownership_epoch, r.tuple.version, r.checksum[0]);
            }
            *hint = 0;
        }
        Op::Report {
            w,
            sid,
            seq,
            e,
            v,
            hint,
            ..
        } => {
            if let Some((session, fence)) = pure.session(WORKERS[*w]) {
                if *hint & 1 != 0 {
                    *sid = session.session_id[0];
                }
                if *hint & 2 != 0 {
                    (*e, *v) = (session.acked.ownership_epoch, session.acked.version);
                }
                match (*hint >> 2) & 3 {
                    1 => *seq = fence.map_or(1, |(s, _)| s + 1),
                    2 => *seq = fence.map_or(*seq, |(s, _)| s),
                    _ => {}
                }
            }
            *hint = 0;
        }
        _ => {}
    }
    op
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..WORKERS.len();
    let sid = 1u8..=3;
    prop_oneof![
        1 => Just(Op::Epoch),
        2 => (w.clone(), sid.clone()).prop_map(|(w, sid)| Op::Open { w, sid }),
        3 => (w.clone(), 1u64..=2, 0u64..=3, 0u8..=1)
            .prop_map(|(w, e, v, c)| Op::Publish { w, e, v, c }),
        4 => (
            (w.clone(), sid.clone(), 1u64..=2, 0u64..=3, 0u8..=1),
            (prop::bool::weighted(0.7), any::<bool>(), hint()),
        )
            .prop_map(|((w, sid, e, v, c), (applied, with_epoch, hint))| Op::Ack {
                w, sid, e, v, c, applied, with_epoch, hint,
            }),
        6 => (
            (w, sid, 0u64..=3, 1u64..=2, 0u64..=3),
            (0u8..=2, 0i64..=1, any::<bool>(), hint()),
        )
            .prop_map(|((w, sid, seq, e, v), (content, observed, with_epoch, hint))| {
                Op::Report { w, sid, seq, e, v, content, observed, with_epoch, hint }
            }),
    ]
}

fn tuple(e: u64, v: u64) -> SnapshotTuple {
    SnapshotTuple {
        ownership_epoch: e,
        version: v,
    }
}

fn session(w: usize, sid: u8) -> Session {
    Session {
        worker_id: WORKERS[w].into(),
        instance_id: format!("inst-{sid}"),
        session_id: [sid; 16],
        acked: SnapshotTuple::default(),
        acked_checksum: [0; 32],
        runtime_enabled: false,
    }
}

fn counters(content: u8) -> Vec<Counter> {
    let c = |id: &str, f, o| Counter {
        proxy_id: id.into(),
        in_flight: f,
        open_connections: o,
    };
    match content {
        0 => vec![],
        1 => vec![c("p-1", 1, 2)],
        _ => vec![c("p-1", 1, 2), c("p-2", u64::MAX, 0)],
    }
}

/// One answer, as both stores give it: the step's outcome and, for the `*_with_epoch` forms
/// and `Epoch`, the epoch.
type Answer = (Result<(), StoreError>, Option<u64>);

fn apply_memory(st: &mut StoreState, op: &Op) -> Answer {
    let now = 0;
    match op {
        Op::Epoch => (Ok(()), Some(st.current_ownership_epoch(now))),
        Op::Open { w, sid } => {
            st.open_session(now, &session(*w, *sid), TTL);
            (Ok(()), None)
        }
        Op::Publish { w, e, v, c } => (
            st.record_issued_snapshot(
                now,
                WORKERS[*w],
                SnapshotReference {
                    tuple: tuple(*e, *v),
                    checksum: [*c; 32],
                },
                TTL,
            ),
            None,
        ),
        Op::Ack {
            w,
            sid,
            e,
            v,
            c,
            applied,
            with_epoch,
            ..
        } => {
            let outcome = st.acknowledge_snapshot(now, &ack(*w, *sid, *e, *v, *c, *applied), TTL);
            let epoch = with_epoch.then(|| st.current_ownership_epoch(now));
            (outcome, epoch)
        }
        Op::Report { with_epoch, .. } => {
            let outcome = st.replace_runtime(now, &report(op), TTL, TTL);
            let epoch = with_epoch.then(|| st.current_ownership_epoch(now));
            (outcome, epoch)
        }
    }
}

fn ack(w: usize, sid: u8, e: u64, v: u64, c: u8, applied: bool) -> SnapshotAcknowledgement {
    SnapshotAcknowledgement {
        worker_id: WORKERS[w].into(),
        session_id: [sid; 16],
        tuple: tuple(e, v),
        checksum: [c; 32],
        applied,
    }
}

fn report(op: &Op) -> Report {
    let Op::Report {
        w,
        sid,
        seq,
        e,
        v,
        content,
        observed,
        ..
    } = op
    else {
        unreachable!("report() of a report op only")
    };
    Report {
        worker_id: WORKERS[*w].into(),
        session_id: [*sid; 16],
        sequence: *seq,
        tuple: tuple(*e, *v),
        observed_at_unix_ms: *observed,
        counters: Counters::new(counters(*content)).expect("valid counters"),
    }
}

async fn apply_redis(store: &RedisStore, op: &Op) -> Answer {
    let with = |r: Result<(Result<(), StoreError>, u64), StoreError>| match r {
        Ok((outcome, epoch)) => (outcome, Some(epoch)),
        Err(e) => (Err(e), None),
    };
    match op {
        Op::Epoch => match store.current_ownership_epoch().await {
            Ok(e) => (Ok(()), Some(e)),
            Err(e) => (Err(e), None),
        },
        Op::Open { w, sid } => (store.open_session(&session(*w, *sid), TTL).await, None),
        Op::Publish { w, e, v, c } => (
            store
                .record_issued_snapshot(
                    WORKERS[*w],
                    SnapshotReference {
                        tuple: tuple(*e, *v),
                        checksum: [*c; 32],
                    },
                    TTL,
                )
                .await,
            None,
        ),
        Op::Ack {
            w,
            sid,
            e,
            v,
            c,
            applied,
            with_epoch,
            ..
        } => {
            let a = ack(*w, *sid, *e, *v, *c, *applied);
            if *with_epoch {
                with(store.acknowledge_with_epoch(&a, TTL).await)
            } else {
                (store.acknowledge_snapshot(&a, TTL).await, None)
            }
        }
        Op::Report { with_epoch, .. } => {
            let r = report(op);
            if *with_epoch {
                with(store.replace_runtime_with_epoch(&r, TTL, TTL).await)
            } else {
                (store.replace_runtime(&r, TTL, TTL).await, None)
            }
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROXYPOOL_DIFF_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

#[test]
fn redis_scripts_answer_and_store_exactly_what_the_pure_rules_do() {
    let url = std::env::var("PROXYPOOL_TEST_REDIS_URL").expect(
        "PROXYPOOL_TEST_REDIS_URL is not set: run scripts/test-all.sh (it starts redis-server \
         on a free loopback port), or set it to redis://127.0.0.1:PORT/",
    );
    differential(&bounded_http::redis::Target::Single(url), cases());
}

/// The same on the test run's Redis Cluster (keys per worker, the epoch in its own slot), with
/// a quarter of the cases (each step is a few more round trips there).
#[test]
fn on_a_redis_cluster_too() {
    let seeds = std::env::var("IOP_TEST_REDIS_CLUSTER_URL").expect(
        "IOP_TEST_REDIS_CLUSTER_URL is not set: run scripts/test-all.sh (it starts a Redis \
         Cluster on free loopback ports: scripts/redis-cluster.sh)",
    );
    differential(
        &bounded_http::redis::Target::parse(&seeds, true),
        (cases() / 4).max(50),
    );
}

fn differential(target: &bounded_http::redis::Target, cases: u32) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let config = ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/differential.proptest-regressions",
        ))),
        ..ProptestConfig::default()
    };
    let steps = std::sync::atomic::AtomicU64::new(0);
    let accepted = std::sync::atomic::AtomicU64::new(0);
    proptest!(config, |(ops in prop::collection::vec(op(), 1..40))| {
        let ns = format!("diff-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let redis = rt.block_on(RedisStore::connect_to(target, &ns)).unwrap();
        let mut pure = StoreState::default();
        for (i, op) in ops.iter().enumerate() {
            steps.fetch_add(1, Ordering::Relaxed);
            let op = &resolve(op, &pure);
            let want = apply_memory(&mut pure, op);
            if want.0.is_ok() && matches!(op, Op::Ack { .. } | Op::Report { .. }) {
                accepted.fetch_add(1, Ordering::Relaxed);
            }
            let got = rt.block_on(apply_redis(&redis, op));
            prop_assert_eq!(&got, &want, "answer of step {} ({:?})", i, op);
            for w in WORKERS {
                let got = rt.block_on(redis.record(w)).unwrap();
                prop_assert_eq!(&got, &pure.record(w), "state of {} after step {} ({:?})", w, i, op);
            }
        }
        // The epoch is created on first read in both, and never moves here.
        let want = pure.current_ownership_epoch(0);
        prop_assert_eq!(rt.block_on(redis.current_ownership_epoch()).unwrap(), want);
    });
    let (steps, accepted) = (steps.into_inner(), accepted.into_inner());
    eprintln!(
        "differential ({target:?}): {cases} sequences, {steps} steps ({accepted} accepted ACKs \
         and reports), every answer and state equal",
    );
    // The comparison means something only if the sequences reach the accepted path: a broken
    // hint generator would make every step a refusal, and refusals alone agree trivially.
    // About 9.5 % of steps are accepted ACKs or reports (3804 of 40062 at 2000 cases); 3 % is
    // far below any run's spread and far above a generator that never hits.
    assert!(
        accepted * 100 >= steps * 3,
        "only {accepted} of {steps} steps were accepted ACKs or reports: the hints no longer \
         reach the accepted path"
    );
}
