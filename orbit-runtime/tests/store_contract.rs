//! The OrbitMesh store contract, run unchanged against SQLite (a temporary file, two handles)
//! and PostgreSQL (`IOP_TEST_PG_URL`, provided by `scripts/test-all.sh`; a schema per test, two
//! connections as two replicas).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use orbit_runtime::store::{
    CertRow, HeartbeatOutcome, OrbitStore, PgStore, Registration, SignedHeartbeat, SqliteStore,
};
use orbit_runtime::versions::ApplyStatus;

static NEXT: AtomicU32 = AtomicU32::new(0);

trait Backend {
    async fn pair() -> (Arc<dyn OrbitStore>, Arc<dyn OrbitStore>);
}

struct Sqlite;
impl Backend for Sqlite {
    async fn pair() -> (Arc<dyn OrbitStore>, Arc<dyn OrbitStore>) {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("orbit-store-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("orbit.sqlite3");
        (
            Arc::new(SqliteStore::open(&path).unwrap()),
            Arc::new(SqliteStore::open(&path).unwrap()),
        )
    }
}

struct Postgres;
impl Backend for Postgres {
    async fn pair() -> (Arc<dyn OrbitStore>, Arc<dyn OrbitStore>) {
        let url = std::env::var("IOP_TEST_PG_URL").expect(
            "IOP_TEST_PG_URL is not set: run scripts/test-all.sh (it creates a PostgreSQL database for the run)",
        );
        let schema = format!(
            "orbit_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        (
            Arc::new(PgStore::connect(&url, &schema).await.unwrap()),
            Arc::new(PgStore::connect(&url, &schema).await.unwrap()),
        )
    }
}

fn reg(installation: &str, key: u8, reported: Option<&str>) -> Registration {
    Registration {
        installation_id: installation.into(),
        public_key: [key; 32],
        device_fingerprint_hash: "fp".into(),
        reported_address: reported.map(str::to_owned),
        public_address: None,
    }
}

async fn tokens_are_counted<B: Backend>() {
    let (a, b) = B::pair().await;
    a.create_token([1; 32], 2).await.unwrap();
    assert!(b.consume_token([1; 32]).await.unwrap());
    assert!(a.consume_token([1; 32]).await.unwrap());
    assert!(!b.consume_token([1; 32]).await.unwrap(), "used up");
    assert!(!a.consume_token([2; 32]).await.unwrap(), "unknown");
}

async fn registration_binds_and_refreshes<B: Backend>() {
    let (a, b) = B::pair().await;
    let n1 = a
        .register(&reg("inst-a", 1, Some("192.0.2.1")))
        .await
        .unwrap();
    let n2 = b.register(&reg("inst-b", 2, None)).await.unwrap();
    assert_ne!(n1.node_id, n2.node_id);
    assert_eq!(n1.edge_runtime_id, format!("er-{}", n1.node_id));
    // The same installation again: same node, new key, address kept when not given.
    let again = b.register(&reg("inst-a", 3, None)).await.unwrap();
    assert_eq!(again.node_id, n1.node_id);
    assert_eq!(again.public_key, [3; 32]);
    assert_eq!(again.reported_address.as_deref(), Some("192.0.2.1"));
    assert!(a.node("node-999").await.unwrap().is_none());
}

async fn heartbeats_keep_the_last_address<B: Backend>() {
    let (a, b) = B::pair().await;
    let n = a.register(&reg("inst", 1, None)).await.unwrap().node_id;
    assert_eq!(
        a.heartbeat(&n, 10, Some("198.51.100.1"), None)
            .await
            .unwrap(),
        Some(true)
    );
    assert_eq!(b.heartbeat(&n, 20, None, None).await.unwrap(), Some(false));
    assert_eq!(
        a.heartbeat(&n, 30, Some("198.51.100.1"), Some("203.0.113.5"))
            .await
            .unwrap(),
        Some(false)
    );
    let row = b.node(&n).await.unwrap().unwrap();
    assert_eq!(row.reported_address.as_deref(), Some("198.51.100.1"));
    assert_eq!(row.public_address.as_deref(), Some("203.0.113.5"));
    assert_eq!(row.last_heartbeat, Some(30));
    assert_eq!(a.heartbeat("node-999", 1, None, None).await.unwrap(), None);
    assert!(a.add_endpoint(&n, "e1.example.net").await.unwrap());
    assert!(
        b.add_endpoint(&n, "e1.example.net").await.unwrap(),
        "idempotent"
    );
    assert!(!a.add_endpoint("node-999", "x").await.unwrap());
    assert_eq!(
        b.node(&n).await.unwrap().unwrap().endpoints,
        ["e1.example.net"]
    );
}

async fn versions_and_results<B: Backend>() {
    let (a, b) = B::pair().await;
    let n = a.register(&reg("inst", 1, None)).await.unwrap().node_id;
    assert!(a.latest(&n).await.unwrap().is_none());
    assert!(a.publish(&n, 1, r#"[{"id":"x"}]"#).await.unwrap());
    assert!(!b.publish(&n, 1, "[]").await.unwrap(), "not newer");
    assert!(
        b.publish(&n, 2, r#"[{"id":"x"},{"id":"y"}]"#)
            .await
            .unwrap()
    );
    assert_eq!(a.latest(&n).await.unwrap().unwrap().0, 2);
    let ids = vec!["x".to_owned(), "y".to_owned()];
    // Partial, then a failure: no advance.
    assert_eq!(
        a.apply_results(&n, 2, &ids, &[("x".into(), ApplyStatus::Applied)])
            .await
            .unwrap(),
        Some(0)
    );
    assert_eq!(
        b.apply_results(&n, 2, &ids, &[("y".into(), ApplyStatus::Failed)])
            .await
            .unwrap(),
        Some(0)
    );
    // The failed one re-applied: both applied now, advance (results from two replicas combine).
    assert_eq!(
        a.apply_results(&n, 2, &ids, &[("y".into(), ApplyStatus::Applied)])
            .await
            .unwrap(),
        Some(2)
    );
    assert_eq!(b.node(&n).await.unwrap().unwrap().current_applied, 2);
    // Never back; unknown versions refused; results for ids outside the version ignored.
    assert_eq!(
        b.apply_results(
            &n,
            1,
            &["x".to_owned()],
            &[("x".into(), ApplyStatus::Applied)]
        )
        .await
        .unwrap(),
        Some(2)
    );
    assert_eq!(a.apply_results(&n, 9, &[], &[]).await.unwrap(), None);
    assert_eq!(
        a.configurations(&n, 1).await.unwrap().as_deref(),
        Some(r#"[{"id":"x"}]"#)
    );
}

async fn certificates_and_nonces<B: Backend>() {
    let (a, b) = B::pair().await;
    let n = a.register(&reg("inst", 1, None)).await.unwrap().node_id;
    let cert = CertRow {
        id: "cert-1".into(),
        names: vec!["e1.example.net".into()],
        serial: "0a".into(),
        not_after: 99,
    };
    a.add_certificate(&n, &cert).await.unwrap();
    assert_eq!(b.certificates(&n).await.unwrap(), [cert]);
    // A nonce is refused by the other replica while live; expired ones go.
    assert!(a.record_nonce(&n, "nonce-1", 100, 50).await.unwrap());
    assert!(
        !b.record_nonce(&n, "nonce-1", 100, 60).await.unwrap(),
        "replay on another replica"
    );
    assert!(
        b.record_nonce("other-node", "nonce-1", 100, 60)
            .await
            .unwrap()
    );
    assert!(
        a.record_nonce(&n, "nonce-1", 300, 101).await.unwrap(),
        "after expiry"
    );
}

/// A signed heartbeat's nonce and write are one step: across two replicas a replay writes
/// nothing, an unknown Node keeps no nonce, an expired nonce is revived.
async fn signed_heartbeats_record_their_nonce_in_the_same_step<B: Backend>() {
    let (a, b) = B::pair().await;
    let n = a.register(&reg("inst", 1, None)).await.unwrap().node_id;
    let hb =
        |nonce: &'static str, now: i64, at: i64, reported: Option<&'static str>| SignedHeartbeat {
            node_id: "",
            nonce,
            nonce_expires_at: now + 300,
            now,
            at,
            reported_address: reported,
            public_address: None,
        };
    let first = SignedHeartbeat {
        node_id: &n,
        ..hb("n-1", 100, 100, Some("198.51.100.7"))
    };
    assert_eq!(
        a.heartbeat_with_nonce(&first).await.unwrap(),
        Some(HeartbeatOutcome::Recorded { changed: true })
    );
    // The same nonce at the other replica, with another address: refused, nothing written.
    let replay = SignedHeartbeat {
        node_id: &n,
        ..hb("n-1", 101, 101, Some("198.51.100.8"))
    };
    assert_eq!(
        b.heartbeat_with_nonce(&replay).await.unwrap(),
        Some(HeartbeatOutcome::Replayed)
    );
    let row = a.node(&n).await.unwrap().unwrap();
    assert_eq!(row.reported_address.as_deref(), Some("198.51.100.7"));
    assert_eq!(row.last_heartbeat, Some(100));
    let next = SignedHeartbeat {
        node_id: &n,
        ..hb("n-2", 102, 102, Some("198.51.100.7"))
    };
    assert_eq!(
        b.heartbeat_with_nonce(&next).await.unwrap(),
        Some(HeartbeatOutcome::Recorded { changed: false })
    );
    // Unknown Node: no heartbeat, and its nonce is not kept (a later use is fresh).
    let unknown = SignedHeartbeat {
        node_id: "node-999",
        ..hb("n-3", 103, 103, None)
    };
    assert_eq!(a.heartbeat_with_nonce(&unknown).await.unwrap(), None);
    assert!(a.record_nonce("node-999", "n-3", 400, 103).await.unwrap());
    // After the window the nonce may be used again.
    let later = SignedHeartbeat {
        node_id: &n,
        ..hb("n-1", 401, 401, None)
    };
    assert_eq!(
        a.heartbeat_with_nonce(&later).await.unwrap(),
        Some(HeartbeatOutcome::Recorded { changed: false })
    );
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<Sqlite>().await })*
        }
        mod postgres {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<Postgres>().await })*
        }
    };
}

contract!(
    tokens_are_counted,
    registration_binds_and_refreshes,
    heartbeats_keep_the_last_address,
    versions_and_results,
    certificates_and_nonces,
    signed_heartbeats_record_their_nonce_in_the_same_step,
);
