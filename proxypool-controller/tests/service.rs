//! `domain::Service` unit tests over the in-memory store in virtual time: registration
//! replacement, protocol and bounds, identity, negative ACK, ACK idempotence / regression /
//! checksum errors, runtime heartbeats, the snapshot-mismatch recovery instruction and store
//! failure.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use proxypool_controller::domain::{
    AcknowledgeCommand, ControlStore, Decision, RegisterCommand, Report, ReportCommand, Service,
    ServiceConfig, ServiceError, Session, SnapshotAcknowledgement, SnapshotReference,
    SnapshotTuple, StoreError,
};
use proxypool_controller::memory::{ManualClock, MemoryStore};

struct World {
    service: Service,
    store: MemoryStore,
    clock: Arc<ManualClock>,
}

fn world() -> World {
    let clock = Arc::new(ManualClock::default());
    let store = MemoryStore::new(clock.clone());
    let service = Service::new(Arc::new(store.clone()), ServiceConfig::default());
    World {
        service,
        store,
        clock,
    }
}

fn register_cmd(worker: &str, instance: &str) -> RegisterCommand {
    RegisterCommand {
        worker_id: worker.into(),
        instance_id: instance.into(),
        zone: "zone-a".into(),
        labels: [("pool".to_owned(), "residential".to_owned())]
            .into_iter()
            .collect(),
        supported_protocol_version: 1,
    }
}

fn ack_cmd(session: [u8; 16], v: u64, c: u8, applied: bool) -> AcknowledgeCommand {
    AcknowledgeCommand {
        worker_id: "w1".into(),
        session_id: session.to_vec(),
        snapshot_version: v,
        ownership_epoch: 1,
        checksum: vec![c; 32],
        applied,
        error_code: if applied {
            String::new()
        } else {
            "APPLY_FAILED".into()
        },
        error_message: if applied {
            String::new()
        } else {
            "disk full".into()
        },
    }
}

fn report_cmd(
    session: [u8; 16],
    seq: u64,
    v: u64,
    counters: Vec<(&str, i64, i64)>,
) -> ReportCommand {
    ReportCommand {
        worker_id: "w1".into(),
        session_id: session.to_vec(),
        sequence: seq,
        snapshot_version: v,
        ownership_epoch: 1,
        observed_at_unix_ms: 1_700_000_000_000,
        counters: counters
            .into_iter()
            .map(|(p, a, b)| (p.to_owned(), a, b))
            .collect(),
    }
}

async fn publish(w: &World, v: u64, c: u8) {
    w.store
        .record_issued_snapshot(
            "w1",
            SnapshotReference {
                tuple: SnapshotTuple {
                    ownership_epoch: 1,
                    version: v,
                },
                checksum: [c; 32],
            },
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
}

const ACCEPTED: Decision = Decision::Accepted { ownership_epoch: 1 };
const RESYNC: Decision = Decision::RequireFullSnapshot { ownership_epoch: 1 };

#[tokio::test]
async fn registration_issues_a_new_session_every_time_and_replaces_the_old() {
    let w = world();
    let a = w
        .service
        .register(&register_cmd("w1", "i1"), None)
        .await
        .unwrap();
    assert_eq!((a.ownership_epoch, a.protocol_version), (1, 1));
    assert_eq!(a.heartbeat_interval, Duration::from_secs(10));
    // The same instance again: a new session; the first one is dead.
    let b = w
        .service
        .register(&register_cmd("w1", "i1"), None)
        .await
        .unwrap();
    assert_ne!(a.session_id, b.session_id);
    publish(&w, 1, 7).await;
    assert_eq!(
        w.service
            .acknowledge(&ack_cmd(a.session_id, 1, 7, true), None)
            .await,
        Err(ServiceError::StaleSession)
    );
    assert_eq!(
        w.service
            .acknowledge(&ack_cmd(b.session_id, 1, 7, true), None)
            .await,
        Ok(ACCEPTED)
    );
    // Registered but not acknowledged: no runtime yet.
    let c = w
        .service
        .register(&register_cmd("w1", "i2"), None)
        .await
        .unwrap();
    assert_eq!(
        w.service
            .report_runtime(report_cmd(c.session_id, 1, 1, vec![]), None)
            .await,
        Ok(RESYNC)
    );
    assert_eq!(w.store.session("w1").unwrap().session_id, c.session_id);
}

#[tokio::test]
async fn protocol_bounds_and_identity() {
    let w = world();
    let mut cmd = register_cmd("w1", "i1");
    cmd.supported_protocol_version = 2;
    assert_eq!(
        w.service.register(&cmd, None).await.unwrap_err(),
        ServiceError::UnsupportedProtocol
    );
    let long = "x".repeat(129);
    let too_many: BTreeMap<String, String> =
        (0..33).map(|i| (format!("k{i}"), "v".to_owned())).collect();
    let huge: BTreeMap<String, String> = (0..20)
        .map(|i| (format!("k{i}"), "v".repeat(250)))
        .collect();
    type Mutate = Box<dyn Fn(&mut RegisterCommand)>;
    let cases: Vec<(Mutate, &str)> = vec![
        (Box::new(|c| c.worker_id = String::new()), "worker_id"),
        (Box::new(|c| c.worker_id = "-bad".into()), "worker_id"),
        (Box::new(move |c| c.worker_id = long.clone()), "worker_id"),
        (Box::new(|c| c.instance_id = "a b".into()), "instance_id"),
        (Box::new(|c| c.zone = "zone/1".into()), "zone"),
        (Box::new(move |c| c.labels = too_many.clone()), "labels"),
        (Box::new(move |c| c.labels = huge.clone()), "labels"),
        (
            Box::new(|c| c.labels = [(String::new(), "v".into())].into_iter().collect()),
            "label key",
        ),
        (
            Box::new(|c| c.labels = [(" k".into(), "v".into())].into_iter().collect()),
            "label key",
        ),
        (
            Box::new(|c| c.labels = [("k".into(), "v ".into())].into_iter().collect()),
            "label value",
        ),
        (
            Box::new(|c| c.labels = [("k".into(), "v".repeat(257))].into_iter().collect()),
            "label value",
        ),
    ];
    for (mutate, field) in cases {
        let mut cmd = register_cmd("w1", "i1");
        mutate(&mut cmd);
        assert_eq!(
            w.service.register(&cmd, None).await.unwrap_err(),
            ServiceError::Invalid(field)
        );
    }
    // Seed 004 bounds at their edges: a label key of 64 bytes and a zone of 128 are accepted,
    // one byte more is refused naming the field.
    let at_limit: Vec<(Mutate, Mutate, &str)> = vec![
        (
            Box::new(|c| c.labels = [("k".repeat(64), "v".into())].into_iter().collect()),
            Box::new(|c| c.labels = [("k".repeat(65), "v".into())].into_iter().collect()),
            "label key",
        ),
        (
            Box::new(|c| c.zone = "z".repeat(128)),
            Box::new(|c| c.zone = "z".repeat(129)),
            "zone",
        ),
    ];
    for (ok, over, field) in at_limit {
        let mut cmd = register_cmd("w1", "i1");
        ok(&mut cmd);
        w.service.register(&cmd, None).await.unwrap();
        let mut cmd = register_cmd("w1", "i1");
        over(&mut cmd);
        assert_eq!(
            w.service.register(&cmd, None).await.unwrap_err(),
            ServiceError::Invalid(field)
        );
    }
    // Empty zone is allowed.
    let mut cmd = register_cmd("w1", "i1");
    cmd.zone = String::new();
    w.service.register(&cmd, None).await.unwrap();
    // The mTLS identity must be the request's worker.
    assert_eq!(
        w.service
            .register(&register_cmd("w1", "i1"), Some("w2"))
            .await
            .unwrap_err(),
        ServiceError::IdentityMismatch
    );
    w.service
        .register(&register_cmd("w1", "i1"), Some("w1"))
        .await
        .unwrap();
}

#[tokio::test]
async fn ack_rules_and_bounds() {
    let w = world();
    let s = w
        .service
        .register(&register_cmd("w1", "i1"), None)
        .await
        .unwrap()
        .session_id;
    publish(&w, 2, 7).await;
    // Wrong checksum, ahead, behind: nothing written, resynchronise.
    for cmd in [
        ack_cmd(s, 2, 8, true),
        ack_cmd(s, 3, 7, true),
        ack_cmd(s, 1, 7, true),
    ] {
        assert_eq!(
            w.service.acknowledge(&cmd, None).await,
            Ok(RESYNC),
            "{cmd:?}"
        );
    }
    assert!(!w.store.session("w1").unwrap().runtime_enabled);
    assert_eq!(
        w.service.acknowledge(&ack_cmd(s, 2, 7, true), None).await,
        Ok(ACCEPTED)
    );
    // Idempotent replay.
    assert_eq!(
        w.service.acknowledge(&ack_cmd(s, 2, 7, true), None).await,
        Ok(ACCEPTED)
    );
    // Bounds.
    let mut bad = ack_cmd(s, 2, 7, true);
    bad.checksum = vec![7; 31];
    assert_eq!(
        w.service.acknowledge(&bad, None).await,
        Err(ServiceError::Invalid("checksum"))
    );
    let mut bad = ack_cmd(s, 2, 7, true);
    bad.checksum = b"a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7".to_vec();
    assert_eq!(
        w.service.acknowledge(&bad, None).await,
        Err(ServiceError::Invalid("checksum"))
    );
    let mut bad = ack_cmd(s, 2, 7, false);
    bad.error_code = "lower".into();
    assert_eq!(
        w.service.acknowledge(&bad, None).await,
        Err(ServiceError::Invalid("error_code"))
    );
    let mut bad = ack_cmd(s, 2, 7, false);
    bad.error_message = "x".repeat(513);
    assert_eq!(
        w.service.acknowledge(&bad, None).await,
        Err(ServiceError::Invalid("error_message"))
    );
    let mut bad = ack_cmd(s, 2, 7, true);
    bad.session_id = vec![1; 15];
    assert_eq!(
        w.service.acknowledge(&bad, None).await,
        Err(ServiceError::Invalid("session_id"))
    );
    assert_eq!(
        w.service
            .acknowledge(&ack_cmd(s, 2, 7, true), Some("other"))
            .await,
        Err(ServiceError::IdentityMismatch)
    );
}

#[tokio::test]
async fn negative_ack_heartbeats_and_reports() {
    let w = world();
    let s = w
        .service
        .register(&register_cmd("w1", "i1"), None)
        .await
        .unwrap()
        .session_id;
    publish(&w, 1, 7).await;
    w.service
        .acknowledge(&ack_cmd(s, 1, 7, true), None)
        .await
        .unwrap();
    let report = |seq, counters| report_cmd(s, seq, 1, counters);
    assert_eq!(
        w.service
            .report_runtime(report(1, vec![("p2", 1, 0), ("p1", 2, 3)]), None)
            .await,
        Ok(ACCEPTED)
    );
    let stored = w.store.runtime("w1").unwrap();
    assert_eq!(
        stored.counters.iter().next().map(|c| c.proxy_id),
        Some("p1"),
        "canonical order"
    );
    // An observation time must be positive (seed 004 §5.3.1); nothing is written.
    for at in [0, -1, i64::MIN] {
        let mut r = report(9, vec![]);
        r.observed_at_unix_ms = at;
        assert_eq!(
            w.service.report_runtime(r, None).await,
            Err(ServiceError::Invalid("observed_at")),
            "{at}"
        );
    }
    assert_eq!(w.store.runtime("w1").unwrap(), stored);
    // Heartbeats (empty reports) keep the 35 s session alive across 30 s gaps.
    for seq in 2..5 {
        w.clock.advance(Duration::from_secs(30));
        assert_eq!(
            w.service.report_runtime(report(seq, vec![]), None).await,
            Ok(ACCEPTED)
        );
    }
    // Sequence errors are distinct.
    assert_eq!(
        w.service.report_runtime(report(3, vec![]), None).await,
        Err(ServiceError::StaleReport)
    );
    assert_eq!(
        w.service
            .report_runtime(report(4, vec![("p1", 1, 1)]), None)
            .await,
        Err(ServiceError::ConflictingReport)
    );
    assert_eq!(
        w.service.report_runtime(report(4, vec![]), None).await,
        Ok(ACCEPTED),
        "replay"
    );
    // Bounds: negative counts, duplicates, too many counters, bad proxy ids.
    for (cmd, field) in [
        (report(5, vec![("p1", -1, 0)]), "counter"),
        (report(5, vec![("p1", 0, -1)]), "counter"),
        (
            report(5, vec![("p1", 1, 0), ("p1", 2, 0)]),
            "duplicate proxy_id",
        ),
        (report(5, vec![("bad id", 1, 0)]), "proxy_id"),
        (report(0, vec![]), "sequence"),
    ] {
        assert_eq!(
            w.service.report_runtime(cmd, None).await,
            Err(ServiceError::Invalid(field))
        );
    }
    let small = Service::new(
        Arc::new(w.store.clone()),
        ServiceConfig {
            max_runtime_counters: 2,
            ..ServiceConfig::default()
        },
    );
    assert_eq!(
        small
            .report_runtime(report(5, vec![("a", 1, 0), ("b", 1, 0), ("c", 1, 0)]), None)
            .await,
        Err(ServiceError::Invalid("counters"))
    );
    // A new snapshot, rejected: runtime off, reports ask for a resync.
    publish(&w, 2, 8).await;
    assert_eq!(
        w.service.acknowledge(&ack_cmd(s, 2, 8, false), None).await,
        Ok(ACCEPTED)
    );
    assert!(w.store.runtime("w1").is_none());
    assert_eq!(
        w.service.report_runtime(report(6, vec![]), None).await,
        Ok(RESYNC)
    );
    // Silence past the TTL: the session is gone.
    w.clock.advance(Duration::from_secs(36));
    assert_eq!(
        w.service.acknowledge(&ack_cmd(s, 2, 8, true), None).await,
        Err(ServiceError::StaleSession)
    );
}

/// A store whose backend is down.
struct Down;

#[async_trait]
impl ControlStore for Down {
    async fn current_ownership_epoch(&self) -> Result<u64, StoreError> {
        Err(StoreError::Unavailable)
    }
    async fn open_session(&self, _: &Session, _: Duration) -> Result<(), StoreError> {
        Err(StoreError::Unavailable)
    }
    async fn record_issued_snapshot(
        &self,
        _: &str,
        _: SnapshotReference,
        _: Duration,
    ) -> Result<(), StoreError> {
        Err(StoreError::Unavailable)
    }
    async fn acknowledge_snapshot(
        &self,
        _: &SnapshotAcknowledgement,
        _: Duration,
    ) -> Result<(), StoreError> {
        Err(StoreError::Unavailable)
    }
    async fn replace_runtime(
        &self,
        _: &Report,
        _: Duration,
        _: Duration,
    ) -> Result<(), StoreError> {
        Err(StoreError::Unavailable)
    }
}

#[tokio::test]
async fn store_failure_is_unavailable() {
    let service = Service::new(Arc::new(Down), ServiceConfig::default());
    assert_eq!(
        service
            .register(&register_cmd("w1", "i1"), None)
            .await
            .unwrap_err(),
        ServiceError::Unavailable
    );
    assert_eq!(
        service
            .acknowledge(&ack_cmd([1; 16], 1, 1, true), None)
            .await,
        Err(ServiceError::Unavailable)
    );
    assert_eq!(
        service
            .report_runtime(report_cmd([1; 16], 1, 1, vec![]), None)
            .await,
        Err(ServiceError::Unavailable)
    );
}
