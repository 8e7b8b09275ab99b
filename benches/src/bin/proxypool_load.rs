//! `proxypool_load`: load on the proxy-pool worker control plane, beside raw EVALSHA of the same
//! Lua script from the same process in the same run.
//!
//! ```text
//! cargo run --release -p iop-benches --bin proxypool_load
//! PROXYPOOL_BENCH_REDIS_URL=redis://127.0.0.1:6379/ cargo run --release -p iop-benches --bin proxypool_load
//! ```
//!
//! Without `PROXYPOOL_BENCH_REDIS_URL` the tool starts its own `redis-server` on a free loopback
//! port (no persistence) and stops it at the end. One process: the controller (tonic, plaintext
//! loopback, Redis store) and the clients (generated tonic client, one HTTP/2 connection per
//! worker, as separate worker hosts have). Workers register once,
//! acknowledge a published snapshot, then:
//!
//! - **report 1k**: `ReportRuntime` with 1000 counters per report (sequence +1 each), 32
//!   concurrent workers for 5 s;
//! - **mix**: 32 workers, each loop 9 × `ReportRuntime` (10 counters) then 1 ×
//!   publish + `AcknowledgeSnapshot`;
//! - **baseline**: the report script itself — `EVALSHA` with the same keys and arguments the
//!   store sends for a 1000-counter report — from 32 concurrent tasks for 5 s on the same kind of
//!   connection.
//!
//! Prints RPC/s, p50 and p99 per part and the ratio to the baseline.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_benches::load::{ms, percentile};
use proxypool_controller::config::File;
use proxypool_controller::domain::{
    ControlStore, Counter, Counters, Report, SnapshotReference, SnapshotTuple,
};
use proxypool_controller::proto::controlplane as pb;
use proxypool_controller::proto::controlplane::worker_control_plane_client::WorkerControlPlaneClient;
use proxypool_controller::redis_store::RedisStore;
use tonic::transport::Channel;

const CONCURRENCY: usize = 32;
const WINDOW: Duration = Duration::from_secs(5);

struct OwnRedis(Option<std::process::Child>);
impl Drop for OwnRedis {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn redis() -> (String, OwnRedis) {
    if let Ok(url) = std::env::var("PROXYPOOL_BENCH_REDIS_URL") {
        return (url, OwnRedis(None));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server is required (apt-get install redis-server) or set PROXYPOOL_BENCH_REDIS_URL");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (format!("redis://127.0.0.1:{port}/"), OwnRedis(Some(child)))
}

fn counters(n: usize) -> Vec<pb::ProxyCounters> {
    (0..n)
        .map(|i| pb::ProxyCounters {
            proxy_id: format!("proxy-{i:05}"),
            in_flight: (i % 7) as i64,
            open_connections: (i % 3) as i64,
        })
        .collect()
}

async fn publish(store: &RedisStore, worker: &str, v: u64) {
    store
        .record_issued_snapshot(
            worker,
            SnapshotReference {
                tuple: SnapshotTuple {
                    ownership_epoch: 1,
                    version: v,
                },
                checksum: [(v % 251) as u8; 32],
            },
            Duration::from_secs(600),
        )
        .await
        .unwrap();
}

/// Registers and acknowledges version 1; returns the session id.
async fn ready_worker(
    c: &mut WorkerControlPlaneClient<Channel>,
    store: &RedisStore,
    id: &str,
) -> bytes::Bytes {
    let sid = c
        .register_worker(pb::RegisterWorkerRequest {
            worker_id: id.into(),
            instance_id: "bench".into(),
            supported_protocol_version: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .session_id;
    publish(store, id, 1).await;
    let r = c
        .acknowledge_snapshot(pb::AcknowledgeSnapshotRequest {
            worker_id: id.into(),
            session_id: sid.clone(),
            snapshot_version: 1,
            ownership_epoch: 1,
            checksum: vec![1; 32].into(),
            applied: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!r.require_full_snapshot);
    sid
}

fn summary(name: &str, mut lat: Vec<Duration>, elapsed: Duration) -> f64 {
    lat.sort();
    let rate = lat.len() as f64 / elapsed.as_secs_f64();
    println!(
        "| {name} | {rate:.0} | {:.3} ms | {:.3} ms |",
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.99))
    );
    rate
}

/// One worker's connection: workers are separate hosts, each with its own HTTP/2 connection
/// (one connection shared by every task would serialise them on one connection task per side).
async fn connect(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(4 * 1024 * 1024)
        .initial_connection_window_size(16 * 1024 * 1024)
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap()
}

#[tokio::main]
async fn main() {
    let (url, _own) = redis();
    let ns = format!("bench-{}", std::process::id());
    let store = Arc::new(RedisStore::connect(&url, &ns).await.unwrap());
    let config = File::parse(
        "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\nsessionTTL = \"120s\"\nmaxStaleAge = \"120s\"\n[redis]\nurl = \"x\"\n",
    )
    .unwrap()
    .validate()
    .unwrap();
    let running =
        proxypool_controller::server::start_with(&config, store.clone(), std::future::pending())
            .await
            .unwrap();
    let channel = connect(running.grpc_addr).await;

    println!("# proxypool_load ({CONCURRENCY} concurrent workers, {WINDOW:?} per part)\n");
    println!("| part | RPC/s | p50 | p99 |\n|---|---:|---:|---:|");

    let only = std::env::var("PROXYPOOL_ONLY").ok();
    // Part 1: 1k-counter reports.
    let body = counters(1000);
    let mut tasks = Vec::new();
    let started = Instant::now();
    for w in 0..CONCURRENCY {
        let (mut c, store, body) = (
            WorkerControlPlaneClient::new(connect(running.grpc_addr).await),
            store.clone(),
            body.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let id = format!("r1k-{w}");
            let sid = ready_worker(&mut c, &store, &id).await;
            let mut lat = Vec::new();
            let mut seq = 0;
            let t0 = Instant::now();
            while t0.elapsed() < WINDOW {
                seq += 1;
                let req = pb::ReportRuntimeRequest {
                    worker_id: id.clone(),
                    session_id: sid.clone(),
                    sequence: seq,
                    snapshot_version: 1,
                    ownership_epoch: 1,
                    observed_at_unix_ms: 1_700_000_000_000 + seq as i64,
                    counters: body.clone(),
                };
                let t = Instant::now();
                let r = c.report_runtime(req).await.unwrap().into_inner();
                lat.push(t.elapsed());
                assert!(!r.require_full_snapshot);
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    let report_rate = summary("ReportRuntime, 1000 counters", lat, started.elapsed());
    if only.as_deref() == Some("report1k") {
        return;
    }

    // Part 2: ACK/report mix.
    let small = counters(10);
    let mut tasks = Vec::new();
    let started = Instant::now();
    for w in 0..CONCURRENCY {
        let (mut c, store, small) = (
            WorkerControlPlaneClient::new(connect(running.grpc_addr).await),
            store.clone(),
            small.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let id = format!("mix-{w}");
            let sid = ready_worker(&mut c, &store, &id).await;
            let (mut lat, mut seq, mut version) = (Vec::new(), 0u64, 1u64);
            let t0 = Instant::now();
            while t0.elapsed() < WINDOW {
                for _ in 0..9 {
                    seq += 1;
                    let req = pb::ReportRuntimeRequest {
                        worker_id: id.clone(),
                        session_id: sid.clone(),
                        sequence: seq,
                        snapshot_version: version,
                        ownership_epoch: 1,
                        observed_at_unix_ms: 1_700_000_000_000 + seq as i64,
                        counters: small.clone(),
                    };
                    let t = Instant::now();
                    assert!(
                        !c.report_runtime(req)
                            .await
                            .unwrap()
                            .into_inner()
                            .require_full_snapshot
                    );
                    lat.push(t.elapsed());
                }
                version += 1;
                publish(&store, &id, version).await;
                let t = Instant::now();
                let r = c
                    .acknowledge_snapshot(pb::AcknowledgeSnapshotRequest {
                        worker_id: id.clone(),
                        session_id: sid.clone(),
                        snapshot_version: version,
                        ownership_epoch: 1,
                        checksum: vec![(version % 251) as u8; 32].into(),
                        applied: true,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                lat.push(t.elapsed());
                assert!(!r.require_full_snapshot);
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    let mix_rate = summary(
        "mix: 9 × ReportRuntime (10 counters) + 1 × AcknowledgeSnapshot",
        lat,
        started.elapsed(),
    );

    let raw_rate = raw(&channel, &store, 1000).await;
    let raw_small = raw(&channel, &store, 10).await;
    let unary = tonic_unary(running.grpc_addr).await;
    println!(
        "\nReportRuntime (1000 counters) ÷ raw EVALSHA (1000 counters): {:.2}×; mix ÷ raw EVALSHA (10 counters): {:.2}×; mix ÷ empty tonic unary: {:.2}×",
        report_rate / raw_rate,
        mix_rate / raw_small,
        mix_rate / unary
    );
}

/// Second baseline: the cheapest unary RPC tonic serves on the same server (gRPC health
/// `Check`: no store, no payload), 32 workers each on its own connection. No RPC of the
/// controller can be answered faster; it bounds the mix from above.
async fn tonic_unary(addr: std::net::SocketAddr) -> f64 {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let mut tasks = Vec::new();
    let started = Instant::now();
    for _ in 0..CONCURRENCY {
        let mut c = HealthClient::new(connect(addr).await);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let t0 = Instant::now();
            while t0.elapsed() < WINDOW {
                let t = Instant::now();
                c.check(HealthCheckRequest::default()).await.unwrap();
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    summary(
        "baseline: empty tonic unary RPC (gRPC health Check)",
        lat,
        started.elapsed(),
    )
}

/// Baseline: EVALSHA of the report script, with the keys and arguments the store sends for an
/// `n`-counter report (digest and encoding included), 32 tasks for the window.
async fn raw(channel: &Channel, store: &Arc<RedisStore>, n: usize) -> f64 {
    let mut tasks = Vec::new();
    let started = Instant::now();
    for w in 0..CONCURRENCY {
        let (mut c, store) = (
            WorkerControlPlaneClient::new(channel.clone()),
            store.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let id = format!("raw{n}-{w}");
            let sid = ready_worker(&mut c, &store, &id).await;
            let mut report = Report {
                worker_id: id.clone(),
                session_id: sid.as_ref().try_into().unwrap(),
                sequence: 0,
                tuple: SnapshotTuple {
                    ownership_epoch: 1,
                    version: 1,
                },
                observed_at_unix_ms: 1_700_000_000_000,
                counters: Counters::new(
                    (0..n)
                        .map(|i| Counter {
                            proxy_id: format!("proxy-{i:05}"),
                            in_flight: (i % 7) as u64,
                            open_connections: (i % 3) as u64,
                        })
                        .collect(),
                )
                .unwrap(),
            };
            let mut conn = store.connection();
            let mut lat = Vec::new();
            let t0 = Instant::now();
            while t0.elapsed() < WINDOW {
                report.sequence += 1;
                report.observed_at_unix_ms += 1;
                let t = Instant::now();
                let inv = store.report_invocation(
                    &report,
                    Duration::from_secs(120),
                    Duration::from_secs(120),
                );
                let s: String = inv.invoke_async(&mut conn).await.unwrap();
                lat.push(t.elapsed());
                assert_eq!(s, "OK");
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    summary(
        &format!("baseline: raw EVALSHA of the report script, {n} counters"),
        lat,
        started.elapsed(),
    )
}
