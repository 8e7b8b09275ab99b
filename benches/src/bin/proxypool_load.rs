//! `proxypool_load`: the proxy-pool worker control plane under load, beside the physical limits
//! of its path, in the same run.
//!
//! ```text
//! cargo build --release -p iop-bins --bin proxypool-controller
//! cargo run --release -p iop-benches --bin proxypool_load
//! PROXYPOOL_BENCH_REDIS_URL=redis://127.0.0.1:6379/ cargo run --release -p iop-benches --bin proxypool_load
//! ```
//!
//! Three processes, as an operator runs them:
//! - a private `redis-server` (no persistence), unless `PROXYPOOL_BENCH_REDIS_URL` is set;
//! - the shipped `proxypool-controller` binary, over plaintext loopback. It is found next to
//!   this tool (`target/release/`), or at `PROXYPOOL_BENCH_CONTROLLER`;
//! - this tool: the workers, each on its own HTTP/2 connection as separate worker hosts are,
//!   and the baselines.
//!
//! Parts, run in `ROUNDS` rounds of `WINDOW` each. The order rotates every round, so the
//! shared machine's drift lands on every part:
//! - **report 1k**: `ReportRuntime` with 1000 counters (≈ 18 KB), 32 workers, sequence +1 each;
//! - **raw 1k**: the physical limit of that path, Redis itself. `EVALSHA` of the report script
//!   with the keys and arguments the controller's store sends for such a report.
//!   - The arguments are built once, except the sequence and the content digest (SHA-256),
//!     which change every call as they do for the controller, so Redis replaces the stored
//!     report every time.
//!   - The calls come from 32 tasks over one multiplexed connection, as the controller's store
//!     has.
//!   - The tool builds these arguments with its own code, so the baseline does not move when
//!     the store's code does.
//!   - The controller runs a variant of the script that also reads the ownership epoch (one
//!     more key, and a GET and PERSIST), so this baseline is a little cheaper than its path;
//! - **mix**: 32 workers, each looping 9 × `ReportRuntime` (10 counters) then publish +
//!   `AcknowledgeSnapshot`;
//! - **raw 10**: the raw baseline for 10 counters;
//! - **empty RPC**: gRPC health `Check` to the controller binary, with no store and no payload.
//!   It is the ceiling of any RPC this server answers.
//! - **floor 1k** and **floor mix**: the same workers' reports and ACKs (sessions registered
//!   with the controller) sent to a **minimal tonic server** on the same proto instead: this
//!   tool re-run as its own process (`PROXYPOOL_FLOOR_SERVE`), whose handlers decode with the
//!   generated server, write the stored blob, digest it and run the controller's own scripts
//!   with the arguments taken from the request, without the domain's checks. The controller ÷
//!   this floor is what the controller's own code costs (issue #33's target: ≥ 0.8×).
//!
//! For each part the tool prints RPC/s, p50 and p99, and the CPU each process spent per
//! operation (`/proc/PID/stat`). The ratios are taken per round (report 1k ÷ raw 1k, mix ÷
//! raw 10) and summarised as their median, with the per-round values. Then comes an **open
//! loop**: `ReportRuntime` with 1000 counters at 80 % of the closed-loop rate, spread over 64
//! workers, for `OPEN_LOOP`. Latency is measured from each request's scheduled time, so a
//! request that waited behind a slow one counts its wait.
//!
//! The workers encode each report's own fields with prost and append the encoding of its 1000
//! counters, made once, as a load generator does with a fixed payload. The controller still
//! decodes, checks and digests every counter of every report. A worker's own encoding runs on
//! the worker's host in production, and here it would take CPU from the controller on the same
//! two cores.
//!
//! Last, **what Redis holds and does per worker** (issue #32's capacity model), with nothing
//! else running: the commands Redis executed, the bytes it read and wrote (`INFO commandstats`,
//! `INFO stats`) per `ReportRuntime` of 1000 and of 10 counters and per publish + ACK, from
//! one worker reporting `REDIS_COST_OPS` times; and Redis's `used_memory` per registered worker
//! that acknowledged a snapshot and reported 1000 counters, over `REDIS_COST_WORKERS` workers.
//!
//! `PROXYPOOL_ONLY=<part>` (`report1k`, `raw1k`, `mix`, `raw10`, `unary`, `floor1k`,
//! `floormix`, `open`, `redis`) runs one part alone, for a profiler.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    reason = "load tool"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf as _, BufMut as _, Bytes};
use iop_benches::load::{Killed, bin, cpu, free_port, ms, percentile, wait_port};
use prost::Message as _;
use proxypool_controller::domain::{ControlStore, Report, SnapshotReference, SnapshotTuple};
use proxypool_controller::proto::controlplane as pb;
use proxypool_controller::proto::controlplane::worker_control_plane_client::WorkerControlPlaneClient;
use proxypool_controller::redis_store::RedisStore;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;

const CONCURRENCY: usize = 32;
const ROUNDS: usize = 3;
const WINDOW: Duration = Duration::from_secs(3);
const OPEN_LOOP: Duration = Duration::from_secs(6);
const OPEN_LOOP_WORKERS: usize = 64;
/// Session and report lifetimes: longer than the whole run.
const TTL: Duration = Duration::from_secs(600);
/// Operations per figure of the Redis cost part.
const REDIS_COST_OPS: usize = 500;
/// Workers registered for the Redis memory figure.
const REDIS_COST_WORKERS: usize = 200;
const REPORT_PATH: &str = "/controlplane.v1.WorkerControlPlane/ReportRuntime";

fn redis() -> (String, Option<Killed>) {
    if let Ok(url) = std::env::var("PROXYPOOL_BENCH_REDIS_URL") {
        return (url, None);
    }
    let port = free_port();
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server is required (apt-get install redis-server) or set PROXYPOOL_BENCH_REDIS_URL");
    wait_port(port);
    (format!("redis://127.0.0.1:{port}/"), Some(Killed(child)))
}

/// The controller binary on a free port, over Redis at `url` with keys under `ns`.
fn controller(url: &str, ns: &str, dir: &std::path::Path) -> (Killed, u16) {
    let port = free_port();
    let config = dir.join("controller.toml");
    std::fs::write(
        &config,
        format!(
            "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\nsessionTTL = \"600s\"\nmaxStaleAge = \"600s\"\n[redis]\nurl = \"{url}\"\nnamespace = \"{ns}\"\n"
        ),
    )
    .unwrap();
    let exe = bin("PROXYPOOL_BENCH_CONTROLLER", "proxypool-controller");
    let child = std::process::Command::new(&exe)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (cargo build --release -p iop-bins --bin proxypool-controller, or set PROXYPOOL_BENCH_CONTROLLER)",
                exe.display()
            )
        });
    wait_port(port);
    (Killed(child), port)
}

/// One worker's connection: workers are separate hosts, each with its own HTTP/2 connection.
async fn connect(port: u16) -> Channel {
    Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .initial_stream_window_size(4 * 1024 * 1024)
        .initial_connection_window_size(16 * 1024 * 1024)
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap()
}

/// A report whose counters were encoded once: the fields of this report, then the counters.
struct PreEncoded {
    fields: pb::ReportRuntimeRequest,
    counters: Bytes,
}

/// Sends [`PreEncoded`] reports, reads `ReportRuntimeResponse`s.
#[derive(Clone, Copy, Debug, Default)]
struct ReportCodec;

impl Codec for ReportCodec {
    type Encode = PreEncoded;
    type Decode = pb::ReportRuntimeResponse;
    type Encoder = Self;
    type Decoder = Self;
    fn encoder(&mut self) -> Self {
        Self
    }
    fn decoder(&mut self) -> Self {
        Self
    }
}

impl Encoder for ReportCodec {
    type Item = PreEncoded;
    type Error = tonic::Status;
    fn encode(&mut self, item: PreEncoded, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        item.fields
            .encode(dst)
            .map_err(|e| tonic::Status::internal(e.to_string()))?;
        dst.put_slice(&item.counters);
        Ok(())
    }
}

impl Decoder for ReportCodec {
    type Item = pb::ReportRuntimeResponse;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut DecodeBuf<'_>,
    ) -> Result<Option<pb::ReportRuntimeResponse>, tonic::Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        pb::ReportRuntimeResponse::decode(bytes)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

/// `n` counters, sorted, as the report's repeated field 7 (what prost writes for them).
fn counters(n: usize) -> Bytes {
    pb::ReportRuntimeRequest {
        counters: (0..n)
            .map(|i| pb::ProxyCounters {
                proxy_id: format!("proxy-{i:05}"),
                in_flight: (i % 7) as i64,
                open_connections: (i % 3) as i64,
            })
            .collect(),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

/// A registered worker whose session acknowledged version 1.
struct Worker {
    id: String,
    session: Bytes,
    grpc: tonic::client::Grpc<Channel>,
    client: WorkerControlPlaneClient<Channel>,
    sequence: u64,
    version: u64,
}

impl Worker {
    async fn ready(port: u16, store: &RedisStore, id: String) -> Self {
        let channel = connect(port).await;
        let mut client = WorkerControlPlaneClient::new(channel.clone());
        let session = client
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: id.clone(),
                instance_id: "bench".into(),
                supported_protocol_version: 1,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .session_id;
        let mut w = Self {
            id,
            session,
            grpc: tonic::client::Grpc::new(channel),
            client,
            sequence: 0,
            version: 0,
        };
        w.acknowledge_next(store).await;
        w
    }

    /// The same worker, its reports and ACKs sent to the server on `port` from now on (the
    /// floor: sessions are registered with the controller, over the same Redis).
    async fn via(mut self, port: u16) -> Self {
        let channel = connect(port).await;
        self.client = WorkerControlPlaneClient::new(channel.clone());
        self.grpc = tonic::client::Grpc::new(channel);
        self
    }

    /// Publishes the next snapshot version and acknowledges it.
    async fn acknowledge_next(&mut self, store: &RedisStore) {
        self.version += 1;
        let v = self.version;
        store
            .record_issued_snapshot(
                &self.id,
                SnapshotReference {
                    tuple: SnapshotTuple {
                        ownership_epoch: 1,
                        version: v,
                    },
                    checksum: [(v % 251) as u8; 32],
                },
                TTL,
            )
            .await
            .unwrap();
        let r = self
            .client
            .acknowledge_snapshot(pb::AcknowledgeSnapshotRequest {
                worker_id: self.id.clone(),
                session_id: self.session.clone(),
                snapshot_version: v,
                ownership_epoch: 1,
                checksum: vec![(v % 251) as u8; 32].into(),
                applied: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!r.require_full_snapshot);
    }

    async fn report(&mut self, counters: &Bytes) {
        self.sequence += 1;
        let request = PreEncoded {
            fields: pb::ReportRuntimeRequest {
                worker_id: self.id.clone(),
                session_id: self.session.clone(),
                sequence: self.sequence,
                snapshot_version: self.version,
                ownership_epoch: 1,
                observed_at_unix_ms: 1_700_000_000_000 + self.sequence as i64,
                counters: Vec::new(),
            },
            counters: counters.clone(),
        };
        self.grpc.ready().await.unwrap();
        let r = self
            .grpc
            .unary(
                tonic::Request::new(request),
                http::uri::PathAndQuery::from_static(REPORT_PATH),
                ReportCodec,
            )
            .await
            .unwrap()
            .into_inner();
        assert!(!r.require_full_snapshot);
    }
}

/// What one part did in one round.
#[derive(Default)]
struct Sample {
    ops: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    /// CPU of the controller, Redis, this tool and the floor server over the part.
    cpu: [Duration; 4],
}

/// The processes whose CPU is counted.
struct Pids {
    controller: u32,
    redis: Option<u32>,
    floor: u32,
}

impl Pids {
    /// The CPU so far of the controller, Redis, this tool and the floor server.
    fn now(&self) -> [Duration; 4] {
        [
            cpu(self.controller),
            self.redis.map_or(Duration::ZERO, cpu),
            cpu(std::process::id()),
            cpu(self.floor),
        ]
    }
}

/// Runs `tasks` (each returning its latencies) and measures them.
async fn measure(
    pids: &Pids,
    tasks: Vec<tokio::task::JoinHandle<Vec<Duration>>>,
    started: Instant,
    cpu0: [Duration; 4],
) -> Sample {
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    let cpu1 = pids.now();
    Sample {
        ops: latencies.len(),
        elapsed,
        latencies,
        cpu: [0, 1, 2, 3].map(|i| cpu1[i].saturating_sub(cpu0[i])),
    }
}

type Shared<T> = Arc<tokio::sync::Mutex<Vec<T>>>;

/// `ReportRuntime` from every worker for the window, closed loop.
async fn reports(pids: &Pids, workers: &Shared<Worker>, counters: &Bytes) -> Sample {
    let taken: Vec<Worker> = workers.lock().await.drain(..).collect();
    let (cpu0, started) = (pids.now(), Instant::now());
    let mut tasks = Vec::new();
    for mut w in taken {
        let (counters, workers) = (counters.clone(), workers.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while started.elapsed() < WINDOW {
                let t = Instant::now();
                w.report(&counters).await;
                lat.push(t.elapsed());
            }
            workers.lock().await.push(w);
            lat
        }));
    }
    measure(pids, tasks, started, cpu0).await
}

/// 9 reports of 10 counters, then publish + ACK, from every worker for the window.
async fn mix(pids: &Pids, workers: &Shared<Worker>, store: &Arc<RedisStore>) -> Sample {
    let small = counters(10);
    let taken: Vec<Worker> = workers.lock().await.drain(..).collect();
    let (cpu0, started) = (pids.now(), Instant::now());
    let mut tasks = Vec::new();
    for mut w in taken {
        let (small, workers, store) = (small.clone(), workers.clone(), store.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while started.elapsed() < WINDOW {
                for _ in 0..9 {
                    let t = Instant::now();
                    w.report(&small).await;
                    lat.push(t.elapsed());
                }
                let t = Instant::now();
                w.acknowledge_next(&store).await;
                lat.push(t.elapsed());
            }
            workers.lock().await.push(w);
            lat
        }));
    }
    measure(pids, tasks, started, cpu0).await
}

/// One raw baseline task's arguments, built once: the keys and the report script's `ARGV` for
/// a report of `n` counters of `worker` (what the controller's store sends for it).
struct RawArgs {
    hash: String,
    session_key: String,
    runtime_key: String,
    session_hex: String,
    canonical: Vec<u8>,
    blob: Bytes,
    sequence: u64,
}

/// Lowercase hex, as the store sends ids and digests (by table: it runs once per raw call).
fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    b.iter()
        .flat_map(|x| [DIGITS[usize::from(x >> 4)], DIGITS[usize::from(x & 0x0f)]])
        .map(char::from)
        .collect()
}

impl RawArgs {
    fn new(store: &RedisStore, worker: &Worker, n: usize) -> Self {
        // Canonical counters: one `id in_flight open` line per proxy, sorted (the ids are).
        let mut canonical = Vec::new();
        for i in 0..n {
            canonical.extend_from_slice(format!("proxy-{i:05} {} {}\n", i % 7, i % 3).as_bytes());
        }
        // The stored blob is `seq\nobserved_at\n` + counters; the script stores it as given, so
        // one made here serves every call (its first line goes stale, which nothing reads).
        let mut blob = b"0\n1700000000000\n".to_vec();
        blob.extend_from_slice(&canonical);
        Self {
            hash: store.report_script_hash().to_owned(),
            session_key: store.key_of("session", &worker.id),
            runtime_key: store.key_of("runtime", &worker.id),
            session_hex: hex(&worker.session),
            canonical,
            blob: blob.into(),
            sequence: 0,
        }
    }
}

/// The physical limit of the report path: `EVALSHA` of the report script from 32 tasks over
/// the store's own (multiplexed) connection, with the arguments built once. Each call takes the
/// next sequence and the digest of its content (SHA-256, as the store computes it), so Redis
/// replaces the report every time as it does for the controller.
async fn raw(pids: &Pids, store: &Arc<RedisStore>, args: &Shared<RawArgs>) -> Sample {
    let taken: Vec<RawArgs> = args.lock().await.drain(..).collect();
    let (cpu0, started) = (pids.now(), Instant::now());
    let mut tasks = Vec::new();
    for mut a in taken {
        let (store, args) = (store.clone(), args.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = store.connection();
            let ttl = u64::try_from(TTL.as_millis()).unwrap();
            let mut lat = Vec::new();
            while started.elapsed() < WINDOW {
                a.sequence += 1;
                let t = Instant::now();
                let digest = Report::digest_of(1_700_000_000_000 + a.sequence as i64, &a.canonical);
                let s: String = redis::cmd("EVALSHA")
                    .arg(&a.hash)
                    .arg(2)
                    .arg(&a.session_key)
                    .arg(&a.runtime_key)
                    .arg(&a.session_hex)
                    .arg(a.sequence)
                    .arg(1)
                    .arg(1)
                    .arg(hex(&digest))
                    .arg(&a.blob[..])
                    .arg(ttl)
                    .arg(ttl)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                lat.push(t.elapsed());
                assert_eq!(s, "OK");
            }
            args.lock().await.push(a);
            lat
        }));
    }
    measure(pids, tasks, started, cpu0).await
}

/// The cheapest unary RPC the controller answers (gRPC health `Check`), closed loop.
async fn unary(pids: &Pids, port: u16) -> Sample {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let mut clients = Vec::new();
    for _ in 0..CONCURRENCY {
        clients.push(HealthClient::new(connect(port).await));
    }
    let (cpu0, started) = (pids.now(), Instant::now());
    let mut tasks = Vec::new();
    for mut c in clients {
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while started.elapsed() < WINDOW {
                let t = Instant::now();
                c.check(HealthCheckRequest::default()).await.unwrap();
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    measure(pids, tasks, started, cpu0).await
}

/// `ReportRuntime` with 1000 counters at `rate` per second for [`OPEN_LOOP`], spread over the
/// workers in turn; each request's latency counts from its scheduled time.
async fn open_loop(pids: &Pids, workers: Vec<Worker>, counters: &Bytes, rate: f64) -> Sample {
    let mut queues = Vec::new();
    let mut tasks = Vec::new();
    for mut w in workers {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Instant>(1024);
        queues.push(tx);
        let counters = counters.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while let Some(scheduled) = rx.recv().await {
                w.report(&counters).await;
                lat.push(scheduled.elapsed());
            }
            lat
        }));
    }
    let (cpu0, started) = (pids.now(), Instant::now());
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut i = 0usize;
    while started.elapsed() < OPEN_LOOP {
        tick.tick().await;
        // The time this request was due, even if the timer fired late.
        let scheduled = started + interval * u32::try_from(i).unwrap();
        queues[i % queues.len()].send(scheduled).await.unwrap();
        i += 1;
    }
    drop(queues);
    measure(pids, tasks, started, cpu0).await
}

/// All rounds of one part together.
struct Part {
    name: &'static str,
    /// Whose CPU is the server's: the controller's (0) or the floor's (3).
    server: usize,
    rounds: Vec<Sample>,
}

impl Part {
    fn rate(&self, round: usize) -> f64 {
        let s = &self.rounds[round];
        s.ops as f64 / s.elapsed.as_secs_f64()
    }

    fn total_rate(&self) -> f64 {
        let ops: usize = self.rounds.iter().map(|s| s.ops).sum();
        let t: Duration = self.rounds.iter().map(|s| s.elapsed).sum();
        ops as f64 / t.as_secs_f64()
    }

    fn row(&self) -> String {
        let mut lat: Vec<Duration> = self
            .rounds
            .iter()
            .flat_map(|s| s.latencies.iter().copied())
            .collect();
        lat.sort();
        let ops: usize = self.rounds.iter().map(|s| s.ops).sum();
        let per_op = |i: usize| {
            let c: Duration = self.rounds.iter().map(|s| s.cpu[i]).sum();
            c.as_secs_f64() * 1e6 / ops.max(1) as f64
        };
        let rates: Vec<String> = (0..self.rounds.len())
            .map(|r| format!("{:.0}", self.rate(r)))
            .collect();
        format!(
            "| {} | {:.0} [{}] | {:.2} ms | {:.2} ms | {:.0} | {:.0} | {:.0} |",
            self.name,
            self.total_rate(),
            rates.join(", "),
            ms(percentile(&lat, 0.5)),
            ms(percentile(&lat, 0.99)),
            per_op(self.server),
            per_op(1),
            per_op(2),
        )
    }
}

/// Per-round ratios of `a` to `b`: their median and the values.
fn ratios(a: &Part, b: &Part) -> String {
    let mut r: Vec<f64> = (0..a.rounds.len().min(b.rounds.len()))
        .map(|i| a.rate(i) / b.rate(i))
        .collect();
    let each: Vec<String> = r.iter().map(|x| format!("{x:.2}")).collect();
    r.sort_by(f64::total_cmp);
    format!("**{:.2}×** [{}]", r[r.len() / 2], each.join(", "))
}

#[tokio::main]
async fn main() {
    if let Ok(spec) = std::env::var(floor::SERVE) {
        return floor::serve(&spec).await;
    }
    let only = std::env::var("PROXYPOOL_ONLY").ok();
    let wants = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let dir = std::env::temp_dir().join(format!("proxypool_load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (url, redis_child) = redis();
    let ns = format!("bench-{}", std::process::id());
    let (controller_child, port) = controller(&url, &ns, &dir);
    let floor_port = free_port();
    let floor_child = Killed(
        std::process::Command::new(std::env::current_exe().unwrap())
            .env(floor::SERVE, format!("{floor_port} {url} {ns}"))
            .spawn()
            .unwrap(),
    );
    wait_port(floor_port);
    let pids = Pids {
        controller: controller_child.0.id(),
        redis: redis_child.as_ref().map(|c| c.0.id()),
        floor: floor_child.0.id(),
    };
    let store = Arc::new(RedisStore::connect(&url, &ns).await.unwrap());

    let big = counters(1000);
    let mut report_workers = Vec::new();
    let mut mix_workers = Vec::new();
    let (mut raw1k, mut raw10) = (Vec::new(), Vec::new());
    let (mut floor1k, mut floor_mix) = (Vec::new(), Vec::new());
    for w in 0..CONCURRENCY {
        // The floor's workers register with the controller, then report to the floor.
        floor1k.push(
            Worker::ready(port, &store, format!("floor1k-{w}"))
                .await
                .via(floor_port)
                .await,
        );
        floor_mix.push(
            Worker::ready(port, &store, format!("floormix-{w}"))
                .await
                .via(floor_port)
                .await,
        );
        report_workers.push(Worker::ready(port, &store, format!("r1k-{w}")).await);
        mix_workers.push(Worker::ready(port, &store, format!("mix-{w}")).await);
        // The raw baselines use registered, acknowledged sessions of their own.
        raw1k.push(RawArgs::new(
            &store,
            &Worker::ready(port, &store, format!("raw1k-{w}")).await,
            1000,
        ));
        raw10.push(RawArgs::new(
            &store,
            &Worker::ready(port, &store, format!("raw10-{w}")).await,
            10,
        ));
    }
    // The raw baseline sends the plain report script by hash; the controller runs the variant
    // that also reads the epoch, so load the plain one here: a heartbeat of a worker of its own.
    let mut loader = Worker::ready(port, &store, "raw-loader".into()).await;
    // One report through the controller loads its script for the floor, which sends it by hash.
    loader.report(&counters(1)).await;
    let heartbeat = Report {
        worker_id: loader.id.clone(),
        session_id: loader.session.as_ref().try_into().unwrap(),
        sequence: 2,
        tuple: SnapshotTuple {
            ownership_epoch: 1,
            version: 1,
        },
        observed_at_unix_ms: 1_700_000_000_000,
        counters: Default::default(),
    };
    store.replace_runtime(&heartbeat, TTL, TTL).await.unwrap();
    let report_workers: Shared<Worker> = Arc::new(tokio::sync::Mutex::new(report_workers));
    let mix_workers: Shared<Worker> = Arc::new(tokio::sync::Mutex::new(mix_workers));
    let raw1k: Shared<RawArgs> = Arc::new(tokio::sync::Mutex::new(raw1k));
    let raw10: Shared<RawArgs> = Arc::new(tokio::sync::Mutex::new(raw10));
    let floor1k: Shared<Worker> = Arc::new(tokio::sync::Mutex::new(floor1k));
    let floor_mix: Shared<Worker> = Arc::new(tokio::sync::Mutex::new(floor_mix));

    let names = [
        "`ReportRuntime`, 1000 counters",
        "raw EVALSHA, 1000 counters",
        "mix: 9 × `ReportRuntime` (10 counters) + publish + ACK",
        "raw EVALSHA, 10 counters",
        "empty tonic unary RPC (health `Check`)",
        "floor: minimal tonic server, 1000 counters",
        "floor: minimal tonic server, the mix",
    ];
    let keys = [
        "report1k", "raw1k", "mix", "raw10", "unary", "floor1k", "floormix",
    ];
    let mut parts: Vec<Part> = names
        .iter()
        .enumerate()
        .map(|(i, &name)| Part {
            name,
            server: if i >= 5 { 3 } else { 0 },
            rounds: Vec::new(),
        })
        .collect();
    println!(
        "# proxypool_load ({CONCURRENCY} workers, {ROUNDS} rounds of {WINDOW:?} per part, order rotated)\n"
    );
    for round in 0..ROUNDS {
        for k in 0..keys.len() {
            let p = (k + round) % keys.len();
            if !wants(keys[p]) {
                continue;
            }
            let sample = match p {
                0 => reports(&pids, &report_workers, &big).await,
                1 => raw(&pids, &store, &raw1k).await,
                2 => mix(&pids, &mix_workers, &store).await,
                3 => raw(&pids, &store, &raw10).await,
                4 => unary(&pids, port).await,
                5 => reports(&pids, &floor1k, &big).await,
                _ => mix(&pids, &floor_mix, &store).await,
            };
            parts[p].rounds.push(sample);
        }
    }
    let cpu_note = if pids.redis.is_some() {
        ""
    } else {
        " (Redis: external, not measured)"
    };
    println!(
        "| part | op/s, all rounds [per round] | p50 | p99 | server (controller or floor) CPU µs/op | Redis CPU µs/op{cpu_note} | tool CPU µs/op |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for p in parts.iter().filter(|p| !p.rounds.is_empty()) {
        println!("{}", p.row());
    }
    if parts[0].rounds.len() == ROUNDS && parts[1].rounds.len() == ROUNDS {
        println!(
            "\nReportRuntime (1000) ÷ raw EVALSHA (1000), median of rounds: {}",
            ratios(&parts[0], &parts[1])
        );
    }
    if parts[2].rounds.len() == ROUNDS && parts[3].rounds.len() == ROUNDS {
        println!(
            "mix ÷ raw EVALSHA (10), median of rounds: {}",
            ratios(&parts[2], &parts[3])
        );
    }
    let all = |p: usize| parts[p].rounds.len() == ROUNDS;
    if all(0) && all(5) {
        println!(
            "ReportRuntime (1000) ÷ the floor (1000), median of rounds: {}",
            ratios(&parts[0], &parts[5])
        );
    }
    if all(2) && all(6) {
        println!(
            "mix ÷ the floor's mix, median of rounds: {}",
            ratios(&parts[2], &parts[6])
        );
    }
    if all(5) && all(1) {
        println!(
            "the floor (1000) ÷ raw EVALSHA (1000), median of rounds: {}",
            ratios(&parts[5], &parts[1])
        );
    }
    if parts[2].rounds.len() == ROUNDS && parts[4].rounds.len() == ROUNDS {
        println!(
            "mix ÷ empty tonic RPC, median of rounds: {}",
            ratios(&parts[2], &parts[4])
        );
    }

    if wants("open") {
        // 80 % of the closed-loop rate, or of a short closed-loop run when alone.
        let max = if parts[0].rounds.is_empty() {
            reports(&pids, &report_workers, &big).await.ops as f64 / WINDOW.as_secs_f64()
        } else {
            parts[0].total_rate()
        };
        let rate = 0.8 * max;
        let mut workers = report_workers.lock().await.drain(..).collect::<Vec<_>>();
        for w in CONCURRENCY..OPEN_LOOP_WORKERS {
            workers.push(Worker::ready(port, &store, format!("r1k-{w}")).await);
        }
        let s = open_loop(&pids, workers, &big, rate).await;
        let open = Part {
            name: "open loop: `ReportRuntime`, 1000 counters",
            server: 0,
            rounds: vec![s],
        };
        println!(
            "\nOpen loop at 80 % of the closed-loop rate ({rate:.0}/s offered, {OPEN_LOOP_WORKERS} workers, latency from the scheduled time):\n"
        );
        println!(
            "| part | op/s | p50 | p99 | controller CPU µs/op | Redis CPU µs/op | tool CPU µs/op |\n|---|---:|---:|---:|---:|---:|---:|"
        );
        println!("{}", open.row());
    }
    if wants("redis") {
        redis_cost(&url, port, &store, &big).await;
    }
    drop(controller_child);
    drop(floor_child);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Redis's counters that the cost part reads: commands by name, and the totals.
#[derive(Default)]
struct RedisCounters {
    calls: std::collections::BTreeMap<String, u64>,
    commands: u64,
    input: u64,
    output: u64,
    memory: u64,
}

impl RedisCounters {
    async fn read(con: &mut redis::aio::MultiplexedConnection) -> Self {
        let info: String = redis::cmd("INFO")
            .arg("everything")
            .query_async(con)
            .await
            .unwrap();
        let mut c = Self::default();
        for line in info.lines() {
            let Some((key, value)) = line.trim().split_once(':') else {
                continue;
            };
            let num = || value.parse::<u64>().unwrap_or(0);
            match key {
                "total_commands_processed" => c.commands = num(),
                "total_net_input_bytes" => c.input = num(),
                "total_net_output_bytes" => c.output = num(),
                "used_memory" => c.memory = num(),
                _ => {
                    if let Some(name) = key.strip_prefix("cmdstat_") {
                        let calls = value
                            .split(',')
                            .find_map(|f| f.strip_prefix("calls="))
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0);
                        c.calls.insert(name.to_owned(), calls);
                    }
                }
            }
        }
        c
    }

    /// `(commands, bytes in, bytes out, by command)` per operation since `before`, leaving
    /// out the `INFO` calls that read them.
    fn per_op(&self, before: &Self, ops: usize) -> (f64, f64, f64, String) {
        let n = ops as f64;
        let by_name: Vec<String> = self
            .calls
            .iter()
            .filter(|(name, _)| name.as_str() != "info")
            .filter_map(|(name, &calls)| {
                let d = calls - before.calls.get(name).copied().unwrap_or(0);
                (d > 0).then(|| format!("{name} {:.2}", d as f64 / n))
            })
            .collect();
        (
            (self.commands - before.commands - 1) as f64 / n,
            (self.input - before.input) as f64 / n,
            (self.output - before.output) as f64 / n,
            by_name.join(", "),
        )
    }
}

/// What Redis executes, moves and holds per worker (see the module docs).
async fn redis_cost(url: &str, port: u16, store: &RedisStore, big: &Bytes) {
    let client = redis::Client::open(url).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let small = counters(10);
    println!(
        "\nWhat Redis does per operation ({REDIS_COST_OPS} from one worker, nothing else running; commands and bytes from `INFO`):\n"
    );
    println!("| operation | Redis commands | by command | bytes into Redis | bytes out of Redis |");
    println!("|---|---:|---|---:|---:|");
    let mut w = Worker::ready(port, store, "redis-cost".into()).await;
    for (name, payload) in [
        ("`ReportRuntime`, 1000 counters", Some(big)),
        ("`ReportRuntime`, 10 counters", Some(&small)),
        (
            "publish (the issuer's record) + `AcknowledgeSnapshot`",
            None,
        ),
    ] {
        let before = RedisCounters::read(&mut con).await;
        for _ in 0..REDIS_COST_OPS {
            match payload {
                Some(c) => w.report(c).await,
                None => w.acknowledge_next(store).await,
            }
        }
        let after = RedisCounters::read(&mut con).await;
        let (commands, input, output, by) = after.per_op(&before, REDIS_COST_OPS);
        println!("| {name} | {commands:.2} | {by} | {input:.0} B | {output:.0} B |");
    }
    let before = RedisCounters::read(&mut con).await;
    for i in 0..REDIS_COST_WORKERS {
        let mut w = Worker::ready(port, store, format!("redis-mem-{i}")).await;
        w.report(big).await;
    }
    let after = RedisCounters::read(&mut con).await;
    println!(
        "\nRedis `used_memory` per worker registered, acknowledged and reporting 1000 counters ({REDIS_COST_WORKERS} workers): {:.1} KiB",
        (after.memory.saturating_sub(before.memory)) as f64 / 1024.0 / REDIS_COST_WORKERS as f64
    );
}

/// The floor of the controller's own code: a minimal tonic server on the same proto, in its own
/// process like the controller, whose `ReportRuntime` and `AcknowledgeSnapshot` run the
/// controller's scripts with the arguments taken from the request, without the domain's checks.
///
/// It decodes with the generated (prost) server, writes the canonical lines and the stored blob
/// once, digests them once (SHA-256, as the store does, so Redis replaces the report on every
/// call) and sends `EVALSHA` over one multiplexed connection with the controller's own script.
/// What the controller does beyond this is what its checks, its decoder and its store cost.
mod floor {
    use super::{Report, pb};
    use proxypool_controller::proto::controlplane::worker_control_plane_server::{
        WorkerControlPlane, WorkerControlPlaneServer,
    };
    use proxypool_controller::redis_store::RedisStore;
    use tonic::{Request, Response, Status};

    /// The environment variable that makes this tool serve the floor: `port url namespace`.
    pub(crate) const SERVE: &str = "PROXYPOOL_FLOOR_SERVE";

    struct Floor {
        store: RedisStore,
        report: String,
        ack: String,
        epoch_key: String,
    }

    fn decimal(out: &mut Vec<u8>, n: i64) {
        if n < 0 {
            out.push(b'-');
        }
        let (mut u, mut digits, mut i) = (n.unsigned_abs(), [0u8; 20], 20);
        loop {
            i -= 1;
            digits[i] = b'0' + (u % 10) as u8;
            u /= 10;
            if u == 0 {
                break;
            }
        }
        out.extend_from_slice(&digits[i..]);
    }

    /// `"<status> <epoch>"`: an `OK`, a snapshot mismatch, or the status's own words.
    fn answer(s: &str) -> Result<(u64, bool), Status> {
        let (st, epoch) = s
            .split_once(' ')
            .ok_or_else(|| Status::internal("bad answer"))?;
        let epoch = epoch.parse().map_err(|_| Status::internal("bad epoch"))?;
        match st {
            "OK" => Ok((epoch, false)),
            "MISMATCH" | "STALE_ACK" => Ok((epoch, true)),
            other => Err(Status::failed_precondition(other.to_owned())),
        }
    }

    #[tonic::async_trait]
    impl WorkerControlPlane for Floor {
        async fn register_worker(
            &self,
            _: Request<pb::RegisterWorkerRequest>,
        ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
            Err(Status::unimplemented(
                "the floor only reports and acknowledges",
            ))
        }

        async fn acknowledge_snapshot(
            &self,
            request: Request<pb::AcknowledgeSnapshotRequest>,
        ) -> Result<Response<pb::AcknowledgeSnapshotResponse>, Status> {
            let r = request.into_inner();
            let s: String = redis::cmd("EVALSHA")
                .arg(&self.ack)
                .arg(4)
                .arg(self.store.key_of("session", &r.worker_id))
                .arg(self.store.key_of("snapshot", &r.worker_id))
                .arg(self.store.key_of("runtime", &r.worker_id))
                .arg(&self.epoch_key)
                .arg(super::hex(&r.session_id))
                .arg(r.snapshot_version)
                .arg(r.ownership_epoch)
                .arg(super::hex(&r.checksum))
                .arg(if r.applied { "1" } else { "0" })
                .arg(super::TTL.as_millis() as u64)
                .query_async(&mut self.store.connection())
                .await
                .map_err(|_| Status::unavailable("redis"))?;
            let (ownership_epoch, require_full_snapshot) = answer(&s)?;
            Ok(Response::new(pb::AcknowledgeSnapshotResponse {
                ownership_epoch,
                require_full_snapshot,
            }))
        }

        async fn report_runtime(
            &self,
            request: Request<pb::ReportRuntimeRequest>,
        ) -> Result<Response<pb::ReportRuntimeResponse>, Status> {
            let r = request.into_inner();
            let mut blob = Vec::with_capacity(48 + r.counters.len() * 24);
            decimal(&mut blob, r.sequence as i64);
            blob.push(b'\n');
            decimal(&mut blob, r.observed_at_unix_ms);
            blob.push(b'\n');
            let start = blob.len();
            for c in &r.counters {
                blob.extend_from_slice(c.proxy_id.as_bytes());
                blob.push(b' ');
                decimal(&mut blob, c.in_flight);
                blob.push(b' ');
                decimal(&mut blob, c.open_connections);
                blob.push(b'\n');
            }
            let digest = Report::digest_of(r.observed_at_unix_ms, &blob[start..]);
            let ttl = super::TTL.as_millis() as u64;
            let s: String = redis::cmd("EVALSHA")
                .arg(&self.report)
                .arg(3)
                .arg(self.store.key_of("session", &r.worker_id))
                .arg(self.store.key_of("runtime", &r.worker_id))
                .arg(&self.epoch_key)
                .arg(super::hex(&r.session_id))
                .arg(r.sequence)
                .arg(r.snapshot_version)
                .arg(r.ownership_epoch)
                .arg(super::hex(&digest))
                .arg(blob)
                .arg(ttl)
                .arg(ttl)
                .query_async(&mut self.store.connection())
                .await
                .map_err(|_| Status::unavailable("redis"))?;
            let (ownership_epoch, require_full_snapshot) = answer(&s)?;
            Ok(Response::new(pb::ReportRuntimeResponse {
                ownership_epoch,
                require_full_snapshot,
                revoke_proxy_ids: Vec::new(),
            }))
        }

        type WatchSnapshotsStream = futures_util::stream::Empty<Result<pb::Snapshot, Status>>;

        async fn watch_snapshots(
            &self,
            _: Request<pb::WatchSnapshotsRequest>,
        ) -> Result<Response<Self::WatchSnapshotsStream>, Status> {
            Err(Status::unimplemented("not in the floor"))
        }

        async fn report_outcomes(
            &self,
            _: Request<pb::ReportOutcomesRequest>,
        ) -> Result<Response<pb::ReportOutcomesResponse>, Status> {
            Err(Status::unimplemented("not in the floor"))
        }
    }

    /// Serves the floor on `port` over Redis at `url`, keys under `ns`, until killed. The
    /// server's HTTP/2 windows and message limit are the controller's defaults.
    pub(crate) async fn serve(spec: &str) {
        let mut it = spec.split(' ');
        let (port, url, ns) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let store = RedisStore::connect(url, ns).await.unwrap();
        let (report, ack) = store.with_epoch_script_hashes();
        let floor = Floor {
            report: report.to_owned(),
            ack: ack.to_owned(),
            epoch_key: store.epoch_key(),
            store,
        };
        let max = 4 * 1024 * 1024;
        let svc = WorkerControlPlaneServer::new(floor).max_decoding_message_size(max);
        let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}"))
            .await
            .unwrap();
        tonic::transport::Server::builder()
            .initial_stream_window_size(max as u32)
            .initial_connection_window_size(4 * max as u32)
            .tcp_nodelay(true)
            .add_service(svc)
            .serve_with_incoming(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            )
            .await
            .unwrap();
    }
}
