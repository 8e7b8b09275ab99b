//! Redis-only store behaviour: the ownership epoch loses any old TTL, and every script keeps
//! working after the script cache is flushed (`NOSCRIPT` after a restart or failover). Its own
//! test binary: `SCRIPT FLUSH` must not race the contract suite's scripts on the shared server.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use std::time::Duration;

use proxypool_controller::domain::{
    ControlStore, Counter, Counters, Report, Session, SnapshotAcknowledgement, SnapshotReference,
    SnapshotTuple,
};
use proxypool_controller::redis_store::RedisStore;

/// Empties Redis's script cache: the store's next call of each script gets `NOSCRIPT`.
async fn flush(conn: &mut impl redis::aio::ConnectionLike) {
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn redis_epoch_is_persistent_even_if_it_had_a_ttl() {
    let url = std::env::var("PROXYPOOL_TEST_REDIS_URL").expect("PROXYPOOL_TEST_REDIS_URL");
    let store = RedisStore::connect(&url, "epoch-ttl").await.unwrap();
    let mut conn = store.connection();
    let key = store.epoch_key();
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("7")
        .arg("PX")
        .arg(100_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(store.current_ownership_epoch().await.unwrap(), 7);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(ttl, -1, "the old TTL is removed");
    // NOSCRIPT after a restart or failover: the script cache is flushed and calls still work.
    flush(&mut conn).await;
    assert_eq!(store.current_ownership_epoch().await.unwrap(), 7);

    // Every other script, each called first after a flush, with its keys and arguments: a
    // worker's whole first cycle, with and without the epoch, and the report stored as sent.
    const TTL: Duration = Duration::from_secs(30);
    let tuple = SnapshotTuple {
        ownership_epoch: 7,
        version: 1,
    };
    let (w, sid) = ("noscript-worker", [3; 16]);
    flush(&mut conn).await;
    let session = Session {
        worker_id: w.into(),
        instance_id: "inst".into(),
        session_id: sid,
        acked: SnapshotTuple::default(),
        acked_checksum: [0; 32],
        runtime_enabled: false,
    };
    store.open_session(&session, TTL).await.unwrap();
    flush(&mut conn).await;
    let reference = SnapshotReference {
        tuple,
        checksum: [9; 32],
    };
    store
        .record_issued_snapshot(w, reference, TTL)
        .await
        .unwrap();
    let ack = SnapshotAcknowledgement {
        worker_id: w.into(),
        session_id: sid,
        tuple,
        checksum: [9; 32],
        applied: true,
    };
    flush(&mut conn).await;
    assert_eq!(
        store.acknowledge_with_epoch(&ack, TTL).await.unwrap(),
        (Ok(()), 7)
    );
    flush(&mut conn).await;
    store.acknowledge_snapshot(&ack, TTL).await.unwrap();
    let mut report = Report {
        worker_id: w.into(),
        session_id: sid,
        sequence: 1,
        tuple,
        observed_at_unix_ms: 1_700_000_000_000,
        counters: Counters::new(vec![Counter {
            proxy_id: "p-1".into(),
            in_flight: 2,
            open_connections: 3,
        }])
        .unwrap(),
    };
    flush(&mut conn).await;
    assert_eq!(
        store
            .replace_runtime_with_epoch(&report, TTL, TTL)
            .await
            .unwrap(),
        (Ok(()), 7)
    );
    report.sequence = 2;
    flush(&mut conn).await;
    store.replace_runtime(&report, TTL, TTL).await.unwrap();
    let record = store.record(w).await.unwrap();
    assert_eq!(
        record.runtime.map(|(seq, _, counters)| (seq, counters)),
        Some((2, report.counters.to_vec()))
    );
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
}
