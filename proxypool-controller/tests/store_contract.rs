//! The `ControlStore` contract, run unchanged against the in-memory reference store (virtual
//! time) and the Redis store (a real `redis-server` that `scripts/test-all.sh` starts on a free
//! loopback port and names in `PROXYPOOL_TEST_REDIS_URL`; each test uses its own namespace).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use proxypool_controller::domain::{
    ControlStore, Counter, Counters, Report, Session, SnapshotAcknowledgement, SnapshotReference,
    SnapshotTuple, StoreError,
};
use proxypool_controller::memory::{ManualClock, MemoryStore};
use proxypool_controller::redis_store::RedisStore;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A store plus what the contract needs to observe it and move time.
#[async_trait::async_trait]
trait Backend: Send + Sync {
    fn store(&self) -> &dyn ControlStore;
    async fn session(&self, worker: &str) -> Option<(Session, Option<u64>)>;
    async fn runtime(&self, worker: &str) -> Option<(u64, Vec<Counter>)>;
    /// How long the worker's session and runtime report live on (`PTTL` on Redis).
    async fn ttls(&self, worker: &str) -> (Option<Duration>, Option<Duration>);
    /// Expires the worker's session and runtime now, as their TTL running out does (Redis:
    /// the keys deleted; memory: the clock moved past them), without waiting on real time.
    async fn expire(&self, worker: &str);
}

struct Memory {
    store: MemoryStore,
    clock: Arc<ManualClock>,
}

#[async_trait::async_trait]
impl Backend for Memory {
    fn store(&self) -> &dyn ControlStore {
        &self.store
    }
    async fn session(&self, worker: &str) -> Option<(Session, Option<u64>)> {
        self.store.session_with_fence(worker)
    }
    async fn runtime(&self, worker: &str) -> Option<(u64, Vec<Counter>)> {
        self.store
            .runtime(worker)
            .map(|r| (r.sequence, r.counters.to_vec()))
    }
    async fn ttls(&self, worker: &str) -> (Option<Duration>, Option<Duration>) {
        self.store.ttls(worker)
    }
    async fn expire(&self, worker: &str) {
        let (session, runtime) = self.store.ttls(worker);
        let longest = session.max(runtime).unwrap_or_default();
        self.clock.advance(longest + Duration::from_millis(1));
    }
}

struct Redis {
    store: RedisStore,
}

#[async_trait::async_trait]
impl Backend for Redis {
    fn store(&self) -> &dyn ControlStore {
        &self.store
    }
    async fn session(&self, worker: &str) -> Option<(Session, Option<u64>)> {
        self.store.session(worker).await.unwrap()
    }
    async fn runtime(&self, worker: &str) -> Option<(u64, Vec<Counter>)> {
        self.store.runtime(worker).await.unwrap()
    }
    async fn ttls(&self, worker: &str) -> (Option<Duration>, Option<Duration>) {
        let mut conn = self.store.connection();
        let mut pttl = async |kind: &str| -> Option<Duration> {
            let ms: i64 = redis::cmd("PTTL")
                .arg(self.store.key_of(kind, worker))
                .query_async(&mut conn)
                .await
                .unwrap();
            // -2: no key; -1: no TTL (never for these keys).
            assert_ne!(ms, -1, "{kind} key without a TTL");
            u64::try_from(ms).ok().map(Duration::from_millis)
        };
        (pttl("session").await, pttl("runtime").await)
    }
    async fn expire(&self, worker: &str) {
        let mut conn = self.store.connection();
        let _: () = redis::cmd("DEL")
            .arg(self.store.key_of("session", worker))
            .arg(self.store.key_of("runtime", worker))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

fn memory() -> Box<dyn Backend> {
    let clock = Arc::new(ManualClock::default());
    Box::new(Memory {
        store: MemoryStore::new(clock.clone()),
        clock,
    })
}

async fn redis() -> Box<dyn Backend> {
    let url = std::env::var("PROXYPOOL_TEST_REDIS_URL").expect(
        "PROXYPOOL_TEST_REDIS_URL is not set: run scripts/test-all.sh (it starts redis-server \
         on a free loopback port), or set it to redis://127.0.0.1:PORT/",
    );
    let ns = format!(
        "contract-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    Box::new(Redis {
        store: RedisStore::connect(&url, &ns).await.unwrap(),
    })
}

/// The same store on the test run's Redis Cluster (3 masters, 3 replicas: scripts/redis-cluster.sh),
/// keys laid out per worker.
async fn redis_cluster() -> Box<dyn Backend> {
    let seeds = std::env::var("IOP_TEST_REDIS_CLUSTER_URL").expect(
        "IOP_TEST_REDIS_CLUSTER_URL is not set: run scripts/test-all.sh (it starts a Redis \
         Cluster on free loopback ports: scripts/redis-cluster.sh)",
    );
    let ns = format!(
        "contract-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let target = bounded_http::redis::Target::parse(&seeds, true);
    let store = RedisStore::connect_to(&target, &ns).await.unwrap();
    assert!(store.is_per_worker());
    Box::new(Redis { store })
}

const TTL: Duration = Duration::from_secs(30);

/// A remaining TTL within (ttl - 10 s, ttl]: generous for a slow machine, and far from the
/// other TTLs a test uses, so it names the step that set it.
fn about(got: Option<Duration>, ttl: Duration) -> bool {
    got.is_some_and(|g| g <= ttl && g > ttl - Duration::from_secs(10))
}
const W: &str = "worker-1";

fn session(id: u8) -> Session {
    Session {
        worker_id: W.into(),
        instance_id: format!("inst-{id}"),
        session_id: [id; 16],
        acked: SnapshotTuple::default(),
        acked_checksum: [0; 32],
        runtime_enabled: false,
    }
}

fn tuple(e: u64, v: u64) -> SnapshotTuple {
    SnapshotTuple {
        ownership_epoch: e,
        version: v,
    }
}

fn reference(e: u64, v: u64, c: u8) -> SnapshotReference {
    SnapshotReference {
        tuple: tuple(e, v),
        checksum: [c; 32],
    }
}

fn ack(sid: u8, e: u64, v: u64, c: u8, applied: bool) -> SnapshotAcknowledgement {
    SnapshotAcknowledgement {
        worker_id: W.into(),
        session_id: [sid; 16],
        tuple: tuple(e, v),
        checksum: [c; 32],
        applied,
    }
}

fn report(sid: u8, seq: u64, e: u64, v: u64, proxies: &[(&str, u64)]) -> Report {
    Report {
        worker_id: W.into(),
        session_id: [sid; 16],
        sequence: seq,
        tuple: tuple(e, v),
        observed_at_unix_ms: 1_700_000_000_000,
        counters: Counters::new(
            proxies
                .iter()
                .map(|(p, n)| Counter {
                    proxy_id: (*p).into(),
                    in_flight: *n,
                    open_connections: 1,
                })
                .collect(),
        )
        .expect("valid counters"),
    }
}

async fn replace(b: &dyn Backend, r: &Report) -> Result<(), StoreError> {
    b.store().replace_runtime(r, TTL, TTL).await
}

async fn epoch_starts_at_one_and_stays(b: Box<dyn Backend>) {
    assert_eq!(b.store().current_ownership_epoch().await.unwrap(), 1);
    assert_eq!(b.store().current_ownership_epoch().await.unwrap(), 1);
}

async fn ack_must_match_the_published_reference(b: Box<dyn Backend>) {
    let s = b.store();
    s.open_session(&session(1), TTL).await.unwrap();
    // Nothing published yet.
    assert_eq!(
        s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL).await,
        Err(StoreError::SnapshotMismatch)
    );
    s.record_issued_snapshot(W, reference(1, 2, 7), TTL)
        .await
        .unwrap();
    let before = b.session(W).await;
    for (a, want) in [
        (ack(9, 1, 2, 7, true), StoreError::StaleSession),
        (ack(1, 1, 2, 8, true), StoreError::SnapshotMismatch), // checksum
        (ack(1, 1, 3, 7, true), StoreError::SnapshotMismatch), // ahead
        (ack(1, 1, 1, 7, true), StoreError::StaleAck),         // behind the published reference
        (ack(1, 2, 1, 7, true), StoreError::SnapshotMismatch), // ahead by epoch
    ] {
        assert_eq!(s.acknowledge_snapshot(&a, TTL).await, Err(want), "{a:?}");
        assert_eq!(b.session(W).await, before, "a refused ACK writes nothing");
    }
    // Not acknowledged yet: no runtime.
    assert_eq!(
        replace(&*b, &report(1, 1, 1, 2, &[])).await,
        Err(StoreError::SnapshotMismatch)
    );
    s.acknowledge_snapshot(&ack(1, 1, 2, 7, true), TTL)
        .await
        .unwrap();
    let (sess, fence) = b.session(W).await.unwrap();
    assert_eq!(
        (sess.acked, sess.acked_checksum, sess.runtime_enabled, fence),
        (tuple(1, 2), [7; 32], true, None)
    );
}

async fn report_sequence_fence(b: Box<dyn Backend>) {
    let s = b.store();
    s.open_session(&session(1), TTL).await.unwrap();
    s.record_issued_snapshot(W, reference(1, 1, 7), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL)
        .await
        .unwrap();
    let r5 = report(1, 5, 1, 1, &[("p1", 3), ("p2", 1)]);
    replace(&*b, &r5).await.unwrap();
    assert_eq!(b.runtime(W).await.unwrap(), (5, r5.counters.to_vec()));
    // Idempotent replay.
    replace(&*b, &r5).await.unwrap();
    let before = (b.session(W).await, b.runtime(W).await);
    for (r, want) in [
        (
            report(1, 5, 1, 1, &[("p1", 4)]),
            StoreError::ConflictingReport,
        ),
        (report(1, 4, 1, 1, &[]), StoreError::StaleReport),
        (report(2, 6, 1, 1, &[]), StoreError::StaleSession),
        (report(1, 6, 1, 2, &[]), StoreError::SnapshotMismatch),
        (report(1, 6, 2, 1, &[]), StoreError::SnapshotMismatch),
    ] {
        assert_eq!(replace(&*b, &r).await, Err(want), "{r:?}");
        assert_eq!(
            (b.session(W).await, b.runtime(W).await),
            before,
            "a refused report writes nothing"
        );
    }
    // An empty report is a heartbeat that replaces everything with zeros.
    replace(&*b, &report(1, 6, 1, 1, &[])).await.unwrap();
    assert_eq!(b.runtime(W).await.unwrap(), (6, vec![]));
    assert_eq!(b.session(W).await.unwrap().1, Some(6));
}

async fn reregistration_replaces_the_session(b: Box<dyn Backend>) {
    let s = b.store();
    s.open_session(&session(1), TTL).await.unwrap();
    s.record_issued_snapshot(W, reference(1, 1, 7), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL)
        .await
        .unwrap();
    replace(&*b, &report(1, 1, 1, 1, &[("p1", 1)]))
        .await
        .unwrap();
    // A new instance registers: the old session's ACK and report fail; the runtime is gone.
    s.open_session(&session(2), TTL).await.unwrap();
    assert!(b.runtime(W).await.is_none());
    assert_eq!(
        s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL).await,
        Err(StoreError::StaleSession)
    );
    assert_eq!(
        replace(&*b, &report(1, 2, 1, 1, &[])).await,
        Err(StoreError::StaleSession)
    );
    let (sess, _) = b.session(W).await.unwrap();
    assert_eq!(
        (sess.session_id, sess.runtime_enabled, sess.acked),
        ([2; 16], false, SnapshotTuple::default())
    );
    // The new session acknowledges the same reference and reports.
    s.acknowledge_snapshot(&ack(2, 1, 1, 7, true), TTL)
        .await
        .unwrap();
    replace(&*b, &report(2, 1, 1, 1, &[])).await.unwrap();
}

async fn negative_ack_disables_runtime_until_a_positive_one(b: Box<dyn Backend>) {
    let s = b.store();
    s.open_session(&session(1), TTL).await.unwrap();
    s.record_issued_snapshot(W, reference(1, 1, 7), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL)
        .await
        .unwrap();
    replace(&*b, &report(1, 9, 1, 1, &[("p1", 1)]))
        .await
        .unwrap();
    // A new snapshot is published; the worker rejects it.
    s.record_issued_snapshot(W, reference(1, 2, 8), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 1, 2, 8, false), TTL)
        .await
        .unwrap();
    let (sess, fence) = b.session(W).await.unwrap();
    assert_eq!(
        (sess.acked, sess.runtime_enabled, fence),
        (tuple(1, 1), false, None),
        "bound kept, runtime off"
    );
    assert!(b.runtime(W).await.is_none(), "old runtime not kept");
    // A late report for the old snapshot cannot rebuild the report or its fence.
    assert_eq!(
        replace(&*b, &report(1, 10, 1, 1, &[])).await,
        Err(StoreError::SnapshotMismatch)
    );
    assert!(b.runtime(W).await.is_none());
    // The positive ACK of the new snapshot re-enables runtime, with a fresh fence.
    s.acknowledge_snapshot(&ack(1, 1, 2, 8, true), TTL)
        .await
        .unwrap();
    replace(&*b, &report(1, 1, 1, 2, &[])).await.unwrap();
    assert_eq!(b.runtime(W).await.unwrap().0, 1);
}

async fn same_ack_renews_without_clearing(b: Box<dyn Backend>) {
    let s = b.store();
    s.open_session(&session(1), TTL).await.unwrap();
    s.record_issued_snapshot(W, reference(3, 4, 7), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 3, 4, 7, true), TTL)
        .await
        .unwrap();
    replace(&*b, &report(1, 2, 3, 4, &[("p", 5)]))
        .await
        .unwrap();
    // The identical ACK again: renew only, the runtime and its fence stay.
    s.acknowledge_snapshot(&ack(1, 3, 4, 7, true), TTL)
        .await
        .unwrap();
    assert_eq!(b.runtime(W).await.unwrap().0, 2);
    assert_eq!(
        replace(&*b, &report(1, 1, 3, 4, &[])).await,
        Err(StoreError::StaleReport)
    );
    // After a negative ACK of the same tuple, the same positive ACK re-enables and clears.
    s.acknowledge_snapshot(&ack(1, 3, 4, 7, false), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 3, 4, 7, true), TTL)
        .await
        .unwrap();
    assert!(b.runtime(W).await.is_none());
    replace(&*b, &report(1, 1, 3, 4, &[])).await.unwrap();
}

async fn references_only_move_forward(b: Box<dyn Backend>) {
    let s = b.store();
    s.record_issued_snapshot(W, reference(2, 5, 1), TTL)
        .await
        .unwrap();
    s.record_issued_snapshot(W, reference(2, 5, 1), TTL)
        .await
        .unwrap(); // idempotent renewal
    for r in [reference(2, 5, 2), reference(2, 4, 1), reference(1, 9, 1)] {
        assert_eq!(
            s.record_issued_snapshot(W, r, TTL).await,
            Err(StoreError::ReferenceConflict),
            "{r:?}"
        );
    }
    s.record_issued_snapshot(W, reference(2, 6, 2), TTL)
        .await
        .unwrap();
    s.record_issued_snapshot(W, reference(3, 1, 3), TTL)
        .await
        .unwrap();
    // An ACK of an older published reference fails, as stale (seed 004 §3.3).
    s.open_session(&session(1), TTL).await.unwrap();
    assert_eq!(
        s.acknowledge_snapshot(&ack(1, 2, 6, 2, true), TTL).await,
        Err(StoreError::StaleAck)
    );
    s.acknowledge_snapshot(&ack(1, 3, 1, 3, true), TTL)
        .await
        .unwrap();
    // Values beyond 2^53 compare exactly.
    let big = u64::MAX - 1;
    s.record_issued_snapshot("w2", reference(big, big, 1), TTL)
        .await
        .unwrap();
    assert_eq!(
        s.record_issued_snapshot("w2", reference(big, big - 1, 1), TTL)
            .await,
        Err(StoreError::ReferenceConflict)
    );
    s.record_issued_snapshot("w2", reference(big, big + 1, 1), TTL)
        .await
        .unwrap();
}

/// Session and report TTLs, checked by their values (no race against real expiry): each step
/// uses its own TTL, so which step last renewed the session shows in its remaining time; then
/// the keys expire (deleted on Redis, the clock moved on memory) and the old instance's ACK and
/// report fail as stale.
async fn sessions_expire(b: Box<dyn Backend>) {
    let s = b.store();
    let (open, acked, renewed, report_ttl) = (
        Duration::from_secs(100),
        Duration::from_secs(200),
        Duration::from_secs(400),
        Duration::from_secs(800),
    );
    s.open_session(&session(1), open).await.unwrap();
    assert!(about(b.ttls(W).await.0, open), "{:?}", b.ttls(W).await);
    s.record_issued_snapshot(W, reference(1, 1, 7), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), acked)
        .await
        .unwrap();
    assert!(
        about(b.ttls(W).await.0, acked),
        "the ACK renews the session: {:?}",
        b.ttls(W).await
    );
    // A report renews the session with its session TTL and stores the runtime with its own.
    s.replace_runtime(&report(1, 1, 1, 1, &[]), renewed, report_ttl)
        .await
        .unwrap();
    let (session_left, runtime_left) = b.ttls(W).await;
    assert!(about(session_left, renewed), "{session_left:?}");
    assert!(about(runtime_left, report_ttl), "{runtime_left:?}");
    // Silence past the TTL: the old instance's ACK and report fail.
    b.expire(W).await;
    assert!(b.session(W).await.is_none());
    assert!(b.runtime(W).await.is_none());
    assert_eq!(b.ttls(W).await, (None, None));
    assert_eq!(
        s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL).await,
        Err(StoreError::StaleSession)
    );
    assert_eq!(
        replace(&*b, &report(1, 3, 1, 1, &[])).await,
        Err(StoreError::StaleSession)
    );
}

/// Seed 004 §3.3 "旧版本 ACK 必须失败" and §5.2.2: an ACK of an older snapshot than the
/// session's acknowledged bound, or than the one published now, is a stale ACK: it fails and
/// writes nothing (the worker is told to resync with a full snapshot, see `grpc.rs`).
async fn an_old_version_ack_fails_as_stale(b: Box<dyn Backend>) {
    let s = b.store();
    s.open_session(&session(1), TTL).await.unwrap();
    s.record_issued_snapshot(W, reference(1, 2, 7), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 1, 2, 7, true), TTL)
        .await
        .unwrap();
    replace(&*b, &report(1, 1, 1, 2, &[("p1", 1)]))
        .await
        .unwrap();
    let before = (b.session(W).await, b.runtime(W).await);
    // Behind the acknowledged bound.
    assert_eq!(
        s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL).await,
        Err(StoreError::StaleAck)
    );
    assert_eq!(
        s.acknowledge_snapshot(&ack(1, 1, 1, 7, false), TTL).await,
        Err(StoreError::StaleAck),
        "a negative ACK of an old version is stale too"
    );
    assert_eq!((b.session(W).await, b.runtime(W).await), before);
    // A newer version published: the acknowledged one is now old.
    s.record_issued_snapshot(W, reference(1, 3, 9), TTL)
        .await
        .unwrap();
    assert_eq!(
        s.acknowledge_snapshot(&ack(1, 1, 2, 7, true), TTL).await,
        Err(StoreError::StaleAck)
    );
    assert_eq!(
        (b.session(W).await, b.runtime(W).await),
        before,
        "nothing written"
    );
    // The current version is accepted.
    s.acknowledge_snapshot(&ack(1, 1, 3, 9, true), TTL)
        .await
        .unwrap();
}

/// Seed 004 §5.3.3: an identical replayed report is idempotent *and* renews the session and the
/// report TTLs (checked by value: the replay's TTLs replace the first report's).
async fn a_replayed_report_renews_both_ttls(b: Box<dyn Backend>) {
    let s = b.store();
    s.open_session(&session(1), TTL).await.unwrap();
    s.record_issued_snapshot(W, reference(1, 1, 7), TTL)
        .await
        .unwrap();
    s.acknowledge_snapshot(&ack(1, 1, 1, 7, true), TTL)
        .await
        .unwrap();
    let r = report(1, 1, 1, 1, &[("p1", 2)]);
    let (first, replay) = (Duration::from_secs(100), Duration::from_secs(400));
    s.replace_runtime(&r, first, first * 2).await.unwrap();
    s.replace_runtime(&r, replay, replay * 2).await.unwrap();
    let (session_left, runtime_left) = b.ttls(W).await;
    assert!(about(session_left, replay), "{session_left:?}");
    assert!(about(runtime_left, replay * 2), "{runtime_left:?}");
    assert_eq!(b.runtime(W).await.unwrap(), (1, r.counters.to_vec()));
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod memory_store {
            $(#[tokio::test]
            async fn $name() { super::$name(super::memory()).await })*
        }
        mod redis_store {
            $(#[tokio::test]
            async fn $name() { super::$name(super::redis().await).await })*
        }
        mod redis_cluster_store {
            $(#[tokio::test]
            async fn $name() { super::$name(super::redis_cluster().await).await })*
        }
    };
}

contract!(
    epoch_starts_at_one_and_stays,
    ack_must_match_the_published_reference,
    report_sequence_fence,
    reregistration_replaces_the_session,
    negative_ack_disables_runtime_until_a_positive_one,
    same_ack_renews_without_clearing,
    references_only_move_forward,
    sessions_expire,
    an_old_version_ack_fails_as_stale,
    a_replayed_report_renews_both_ttls,
);
