//! The proxy-pool store on a Redis Cluster follows a failover (issue #32): on a private
//! cluster (`iop_tests::redis_cluster`, 3 masters and 3 replicas), the master holding a
//! worker's slot is SIGKILLed; once a replica is promoted, the store's own connection reads
//! the worker's last acknowledged write back and writes again. (redis-rs's cluster connection,
//! idle through the failover, did not within 30 s; the store rebuilds it after a failed call.)

#![allow(clippy::unwrap_used, reason = "tests")]

use std::time::{Duration, Instant};

use iop_tests::redis_cluster::Cluster;
use proxypool_controller::domain::{ControlStore, SnapshotReference, SnapshotTuple};
use proxypool_controller::redis_store::{Durability, RedisStore, Target};

const TTL: Duration = Duration::from_secs(600);
const LIMIT: Duration = Duration::from_secs(30);

fn reference(version: u64) -> SnapshotReference {
    SnapshotReference {
        tuple: SnapshotTuple {
            ownership_epoch: 1,
            version,
        },
        checksum: [7; 32],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_the_failover_of_a_master() {
    let mut cluster = tokio::task::spawn_blocking(|| Cluster::start("store-failover"))
        .await
        .unwrap();
    let store = RedisStore::connect_to(&Target::Cluster(cluster.seeds(None)), "failover")
        .await
        .unwrap();
    for v in 1..20 {
        store
            .record_issued_snapshot("w0", reference(v), TTL)
            .await
            .unwrap();
    }
    // The last write waits for the replica (the durability setting, on the same connection):
    // it is acknowledged only once the replica that will be promoted has it.
    let durable = store.clone().with_durability(Some(Durability {
        replicas: 1,
        timeout: Duration::from_secs(10),
    }));
    durable
        .record_issued_snapshot("w0", reference(20), TTL)
        .await
        .unwrap();
    let victim = cluster.master_of(&store.key_of("snapshot", "w0"));
    cluster.kill(victim);
    let started = Instant::now();
    let version = loop {
        match store.record("w0").await {
            Ok(r) => break r.reference.map(|r| r.tuple.version),
            Err(e) => {
                assert!(
                    started.elapsed() < LIMIT,
                    "the store did not read again within {LIMIT:?} of the failover: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    println!(
        "the store read again {:.2} s after its master was killed",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(version, Some(20), "the last acknowledged write survived");
    store
        .record_issued_snapshot("w0", reference(21), TTL)
        .await
        .unwrap();
    assert_eq!(
        store
            .record("w0")
            .await
            .unwrap()
            .reference
            .unwrap()
            .tuple
            .version,
        21
    );
    drop(cluster);
}
