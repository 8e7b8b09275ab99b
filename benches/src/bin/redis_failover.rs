//! The proxy-pool store on a Redis Cluster when a master dies (issue #32): how many writes the
//! store had acknowledged are gone after the failover, with plain (asynchronous) replication
//! and with the durability setting (`WAIT 1` on the master after each write), and what that
//! setting costs per write while nothing fails.
//!
//! Each trial starts its own cluster (3 masters, 3 replicas, `cluster-node-timeout 1000`, on
//! free loopback ports, nothing on disk), runs 16 writers over 48 workers
//! (`record_issued_snapshot` with a version that only grows, each acknowledged version
//! remembered), SIGKILLs the master that holds worker `w0`'s slot after 2 s, the writers
//! stopping with the kill (a later write would overwrite a lost version and hide the loss),
//! waits for the failover, then reads every worker's stored version back: a worker whose
//! stored version is below the last one the store acknowledged lost that many acknowledged
//! writes. Two scenarios: a healthy replica (on loopback it has every write within
//! microseconds), and a **lagging** one (`DEBUG SLEEP 2` on the victim's replica 1 s before the
//! kill: it stops reading its replication stream, as a replica behind a slow link or a long
//! fork does, and the master's backlog of writes it acknowledged dies with it). Modes
//! alternate within each round.
//!
//! ```sh
//! cargo run --release -p iop-benches --bin redis_failover [-- ROUNDS]   # default 3
//! ```
//! Needs `redis-server` and `redis-cli` (Debian's `redis-server`).

#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    reason = "a measurement tool"
)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use iop_tests::redis_cluster::{Cluster, cli};
use proxypool_controller::domain::{ControlStore, SnapshotReference, SnapshotTuple};
use proxypool_controller::redis_store::{Durability, RedisStore, Target};

const WORKERS: usize = 48;
const WRITERS: usize = 16;
const TTL: Duration = Duration::from_secs(600);

fn reference(version: u64) -> SnapshotReference {
    SnapshotReference {
        tuple: SnapshotTuple {
            ownership_epoch: 1,
            version,
        },
        checksum: [7; 32],
    }
}

struct Trial {
    lost: u64,
    workers_hit: usize,
    acked: u64,
    failed_calls: u64,
    p50_us: u64,
    p99_us: u64,
}

async fn trial(durability: Option<Durability>, lagging: bool, tag: &str) -> Trial {
    let mut cluster = Cluster::start(tag);
    let seeds = cluster.seeds(None);
    let store = Arc::new(
        RedisStore::connect_to(&Target::Cluster(seeds), "failover")
            .await
            .unwrap()
            .with_durability(durability),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..WRITERS {
        let (store, stop, killed) = (store.clone(), stop.clone(), killed.clone());
        tasks.push(tokio::spawn(async move {
            let mine: Vec<String> = (t..WORKERS)
                .step_by(WRITERS)
                .map(|w| format!("w{w}"))
                .collect();
            let mut version: HashMap<String, u64> = HashMap::new();
            let mut acked: HashMap<String, u64> = HashMap::new();
            let mut steady = Vec::new();
            let mut failed = 0u64;
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let w = &mine[i % mine.len()];
                i += 1;
                let v = version.entry(w.clone()).or_insert(0);
                *v += 1;
                let started = Instant::now();
                match store.record_issued_snapshot(w, reference(*v), TTL).await {
                    Ok(()) => {
                        acked.insert(w.clone(), *v);
                        if !killed.load(Ordering::Relaxed) {
                            steady.push(u64::try_from(started.elapsed().as_micros()).unwrap());
                        }
                    }
                    Err(_) => {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            (acked, steady, failed)
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let victim = cluster.master_of(&store.key_of("snapshot", "w0"));
    if lagging {
        let replica = cluster.replica_of(victim);
        std::thread::spawn(move || cli(replica, &["debug", "sleep", "2"]));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let seeds_alive = cluster.seeds(Some(victim));
    // The writers stop with the kill: what was acknowledged by then is what must survive (a
    // write after the failover would overwrite a lost version and hide the loss).
    stop.store(true, Ordering::Relaxed);
    killed.store(true, Ordering::Relaxed);
    cluster.kill(victim);
    let mut acked = HashMap::new();
    let mut steady = Vec::new();
    let mut failed_calls = 0;
    for t in tasks {
        let (a, s, f) = t.await.unwrap();
        acked.extend(a);
        steady.extend(s);
        failed_calls += f;
    }
    // After the failover (a replica promoted): every worker's version read back, over the
    // store's own connection (the controller's, which must follow the failover).
    let mut lost = 0;
    let mut workers_hit = 0;
    for (w, v) in &acked {
        let started = Instant::now();
        let stored = loop {
            match store.record(w).await {
                Ok(r) => break r.reference.map_or(0, |r| r.tuple.version),
                Err(_) if started.elapsed() < Duration::from_secs(30) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    let fresh =
                        RedisStore::connect_to(&Target::Cluster(seeds_alive.clone()), "failover")
                            .await
                            .map(|s| s.is_per_worker());
                    let fresh_read = match RedisStore::connect_to(
                        &Target::Cluster(seeds_alive.clone()),
                        "failover",
                    )
                    .await
                    {
                        Ok(s) => format!("{:?}", s.record(w).await.map(|r| r.reference)),
                        Err(e) => format!("{e:?}"),
                    };
                    panic!(
                        "{w} unreadable after the failover: {e:?} (a fresh client: {fresh:?}, reads {fresh_read})\n{}",
                        cli(
                            cluster
                                .servers
                                .iter()
                                .find(|(p, _)| *p != victim)
                                .unwrap()
                                .0,
                            &["cluster", "nodes"]
                        )
                    )
                }
            }
        };
        if stored < *v {
            lost += v - stored;
            workers_hit += 1;
        }
    }
    steady.sort_unstable();
    let at = |q: usize| steady[(steady.len() * q / 100).min(steady.len() - 1)];
    Trial {
        lost,
        workers_hit,
        acked: acked.values().sum(),
        failed_calls,
        p50_us: at(50),
        p99_us: at(99),
    }
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let modes = [
        ("plain replication", None),
        (
            "WAIT 1 (waitReplicas = 1, waitTimeout = 100ms)",
            Some(Durability {
                replicas: 1,
                timeout: Duration::from_millis(100),
            }),
        ),
    ];
    let scenarios = [("healthy replica", false), ("lagging replica", true)];
    let mut results: Vec<Vec<Trial>> = (0..4).map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (j, (scenario, lagging)) in scenarios.iter().enumerate() {
            for (i, (name, d)) in modes.iter().enumerate() {
                let t = trial(*d, *lagging, &format!("{round}-{j}-{i}")).await;
                println!(
                    "round {round}, {scenario}, {name}: {} acknowledged writes lost ({} workers), {} acknowledged, {} calls failed during the failover; steady write p50 {} µs, p99 {} µs",
                    t.lost, t.workers_hit, t.acked, t.failed_calls, t.p50_us, t.p99_us
                );
                results[j * 2 + i].push(t);
            }
        }
    }
    for k in 0..4 {
        let (scenario, _) = scenarios[k / 2];
        let (mode, _) = modes[k % 2];
        let name = format!("{scenario}, {mode}");
        let r = &results[k];
        let mut lost: Vec<u64> = r.iter().map(|t| t.lost).collect();
        let mut p50: Vec<u64> = r.iter().map(|t| t.p50_us).collect();
        let mut p99: Vec<u64> = r.iter().map(|t| t.p99_us).collect();
        println!(
            "{name}: lost acknowledged writes per failover {:?} (median {}); steady write p50 {:?} µs (median {}), p99 {:?} µs (median {})",
            r.iter().map(|t| t.lost).collect::<Vec<_>>(),
            median(&mut lost),
            r.iter().map(|t| t.p50_us).collect::<Vec<_>>(),
            median(&mut p50),
            r.iter().map(|t| t.p99_us).collect::<Vec<_>>(),
            median(&mut p99),
        );
    }
}
