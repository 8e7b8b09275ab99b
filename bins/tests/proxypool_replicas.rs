//! proxy-pool controller replicas sharing one Redis (the private `redis-server` that
//! `scripts/test-all.sh` starts; `PROXYPOOL_TEST_REDIS_URL`):
//!
//! - two in-process instances: register on A, ACK and report on B; a new registration on B
//!   fences the old session on A; TTL expiry;
//! - a crash test: the `proxypool-controller` binary is SIGKILLed at random points under ACK and
//!   report load from several workers and restarted; afterwards Redis is checked against the
//!   model of acknowledged writes: nothing acknowledged is lost, no fence moves backwards.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::collections::HashMap;
use std::io::BufRead as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proxypool_controller::config::File;
use proxypool_controller::domain::{ControlStore, SnapshotReference, SnapshotTuple};
use proxypool_controller::proto::controlplane as pb;
use proxypool_controller::proto::controlplane::worker_control_plane_client::WorkerControlPlaneClient;
use proxypool_controller::redis_store::RedisStore;
use proxypool_controller::server::start_with;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

fn redis_url() -> String {
    std::env::var("PROXYPOOL_TEST_REDIS_URL").expect(
        "PROXYPOOL_TEST_REDIS_URL is not set: run scripts/test-all.sh (it starts redis-server)",
    )
}

fn register(worker: &str, instance: &str) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        worker_id: worker.into(),
        instance_id: instance.into(),
        supported_protocol_version: 1,
        ..Default::default()
    }
}

fn ack(worker: &str, session: &[u8], v: u64) -> pb::AcknowledgeSnapshotRequest {
    pb::AcknowledgeSnapshotRequest {
        worker_id: worker.into(),
        session_id: session.to_vec().into(),
        snapshot_version: v,
        ownership_epoch: 1,
        checksum: vec![(v % 251) as u8; 32].into(),
        applied: true,
        ..Default::default()
    }
}

fn report(worker: &str, session: &[u8], seq: u64, v: u64) -> pb::ReportRuntimeRequest {
    pb::ReportRuntimeRequest {
        worker_id: worker.into(),
        session_id: session.to_vec().into(),
        sequence: seq,
        snapshot_version: v,
        ownership_epoch: 1,
        observed_at_unix_ms: 1_700_000_000_000 + seq as i64,
        counters: vec![pb::ProxyCounters {
            proxy_id: "p1".into(),
            in_flight: seq as i64,
            open_connections: 1,
        }],
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_sessions_and_fences() {
    let url = redis_url();
    let ns = format!("replicas-{}", std::process::id());
    // Replica A renews sessions for 60 s, replica B for 120 s: which replica renewed a session
    // last shows in its remaining TTL, so renewals are checked by value, never by waiting.
    let config = |ttl: &str| {
        File::parse(&format!(
            "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\nheartbeatInterval = \"1s\"\nsessionTTL = \"{ttl}\"\nmaxStaleAge = \"10s\"\n[redis]\nurl = \"x\"\n"
        ))
        .unwrap()
        .validate()
        .unwrap()
    };
    let stop = CancellationToken::new();
    let mut clients = Vec::new();
    for ttl in ["60s", "120s"] {
        let config = config(ttl);
        let store = RedisStore::connect(&url, &ns).await.unwrap();
        let s = stop.clone();
        let running = start_with(&config, Arc::new(store), async move { s.cancelled().await })
            .await
            .unwrap();
        clients.push(
            WorkerControlPlaneClient::connect(format!("http://{}", running.grpc_addr))
                .await
                .unwrap(),
        );
        std::mem::forget(running);
    }
    let (mut a, mut b) = (clients[0].clone(), clients[1].clone());
    let direct = RedisStore::connect(&url, &ns).await.unwrap();

    let sid = a
        .register_worker(register("w1", "i1"))
        .await
        .unwrap()
        .into_inner()
        .session_id;
    publish(&direct, "w1", 1).await;
    assert!(
        !b.acknowledge_snapshot(ack("w1", &sid, 1))
            .await
            .unwrap()
            .into_inner()
            .require_full_snapshot
    );
    assert!(
        !b.report_runtime(report("w1", &sid, 1, 1))
            .await
            .unwrap()
            .into_inner()
            .require_full_snapshot
    );
    // The fence is shared: the same sequence with other content conflicts on A.
    let mut other = report("w1", &sid, 1, 1);
    other.counters[0].in_flight = 99;
    assert_eq!(
        a.report_runtime(other).await.unwrap_err().code(),
        Code::AlreadyExists
    );
    // The same report again on A: an idempotent replay.
    a.report_runtime(report("w1", &sid, 1, 1)).await.unwrap();

    // A new instance registers on B: the old session fails on A, for ACK and report alike.
    let sid2 = b
        .register_worker(register("w1", "i2"))
        .await
        .unwrap()
        .into_inner()
        .session_id;
    assert_eq!(
        a.acknowledge_snapshot(ack("w1", &sid, 1))
            .await
            .unwrap_err()
            .code(),
        Code::FailedPrecondition
    );
    assert_eq!(
        a.report_runtime(report("w1", &sid, 2, 1))
            .await
            .unwrap_err()
            .code(),
        Code::FailedPrecondition
    );
    assert!(
        direct.runtime("w1").await.unwrap().is_none(),
        "re-registration deleted the report"
    );
    a.acknowledge_snapshot(ack("w1", &sid2, 1)).await.unwrap();
    // Heartbeats through either replica renew the shared session with that replica's TTL.
    let mut conn = direct.connection();
    let session_key = direct.key_of("session", "w1");
    for seq in 1..5 {
        let (c, ttl) = if seq % 2 == 0 {
            (&mut a, 60)
        } else {
            (&mut b, 120)
        };
        c.report_runtime(report("w1", &sid2, seq, 1)).await.unwrap();
        let left: i64 = redis::cmd("PTTL")
            .arg(&session_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(
            left <= ttl * 1000 && left > (ttl - 10) * 1000,
            "report {seq}: session TTL {left} ms, renewed for {ttl} s"
        );
    }
    // Silence past the TTL: the session is gone (its key expires; deleted here, as expiry
    // does, rather than waited for) and the next heartbeat is refused on either replica.
    let _: () = redis::cmd("DEL")
        .arg(&session_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        a.report_runtime(report("w1", &sid2, 8, 1))
            .await
            .unwrap_err()
            .code(),
        Code::FailedPrecondition
    );
    assert_eq!(
        b.report_runtime(report("w1", &sid2, 9, 1))
            .await
            .unwrap_err()
            .code(),
        Code::FailedPrecondition
    );
    stop.cancel();
}

/// What the workers saw acknowledged, per worker: (acked version, report sequence).
type Model = Arc<Mutex<HashMap<String, (u64, u64)>>>;

fn spawn_controller(config: &std::path::Path) -> (std::process::Child, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_proxypool-controller"))
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("controller prints its address")
            .unwrap();
        if let Some(a) = line.strip_prefix("proxypool-controller: gRPC on ") {
            break a.to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

/// One worker's load: publish → ACK → reports, over and over, against whatever controller
/// address is current; records only what was acknowledged.
async fn worker(
    id: String,
    addr: Arc<Mutex<String>>,
    store: Arc<RedisStore>,
    model: Model,
    writes: Arc<std::sync::atomic::AtomicU64>,
    stop: CancellationToken,
) {
    let mut session: Option<bytes::Bytes> = None;
    let (mut version, mut seq) = (0u64, 0u64);
    while !stop.is_cancelled() {
        let target = addr.lock().unwrap().clone();
        let Ok(mut c) =
            WorkerControlPlaneClient::<Channel>::connect(format!("http://{target}")).await
        else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        loop {
            if stop.is_cancelled() {
                return;
            }
            let sid = match &session {
                Some(s) => s.clone(),
                None => match c.register_worker(register(&id, "i1")).await {
                    Ok(r) => {
                        let s = r.into_inner().session_id;
                        session = Some(s.clone());
                        model.lock().unwrap().insert(id.clone(), (0, 0));
                        (version, seq) = (version, 0);
                        s
                    }
                    Err(_) => break,
                },
            };
            if seq % 5 == 0 {
                version += 1;
                publish(&store, &id, version).await;
                match c.acknowledge_snapshot(ack(&id, &sid, version)).await {
                    Ok(r) if !r.get_ref().require_full_snapshot => {
                        model.lock().unwrap().insert(id.clone(), (version, 0));
                        writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(s)
                        if s.code() == Code::Unavailable
                            || s.code() == Code::Unknown
                            || s.code() == Code::Cancelled =>
                    {
                        break;
                    }
                    Err(s) => panic!("unexpected ACK failure: {s:?}"),
                }
            }
            seq += 1;
            match c.report_runtime(report(&id, &sid, seq, version)).await {
                Ok(r) if !r.get_ref().require_full_snapshot => {
                    model.lock().unwrap().insert(id.clone(), (version, seq));
                    writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(_) => {}
                Err(s)
                    if s.code() == Code::Unavailable
                        || s.code() == Code::Unknown
                        || s.code() == Code::Cancelled =>
                {
                    break;
                }
                Err(s) => panic!("unexpected report failure: {s:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_no_acknowledged_write() {
    crash_test(&redis_url(), false, "crash").await;
}

/// The same against the test run's Redis Cluster (3 masters, 3 replicas), the controller
/// configured with `cluster = true` (keys per worker, the epoch in its own slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_no_acknowledged_write_on_a_redis_cluster() {
    let seeds = std::env::var("IOP_TEST_REDIS_CLUSTER_URL").expect(
        "IOP_TEST_REDIS_CLUSTER_URL is not set: run scripts/test-all.sh (it starts a Redis \
         Cluster on free loopback ports: scripts/redis-cluster.sh)",
    );
    crash_test(&seeds, true, "crash-cluster").await;
}

async fn crash_test(url: &str, cluster: bool, tag: &str) {
    let ns = format!("{tag}-{}", std::process::id());
    let dir = std::env::temp_dir().join(format!("proxypool-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("controller.toml");
    std::fs::write(
        &config,
        format!(
            "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\nsessionTTL = \"60s\"\nmaxStaleAge = \"60s\"\n[redis]\nurl = \"{url}\"\nnamespace = \"{ns}\"\ncluster = {cluster}\n"
        ),
    )
    .unwrap();
    let target = bounded_http::redis::Target::parse(url, cluster);
    let store = Arc::new(RedisStore::connect_to(&target, &ns).await.unwrap());
    assert_eq!(store.is_per_worker(), cluster);
    let model: Model = Arc::default();
    let (mut child, first) = spawn_controller(&config);
    let addr = Arc::new(Mutex::new(first));
    let stop = CancellationToken::new();
    let writes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let workers: Vec<_> = (0..6)
        .map(|i| {
            tokio::spawn(worker(
                format!("w{i}"),
                addr.clone(),
                store.clone(),
                model.clone(),
                writes.clone(),
                stop.clone(),
            ))
        })
        .collect();
    // Kill points are counted in acknowledged writes since the last restart (1..=40, from a
    // small deterministic generator), not in time: a slow machine kills at the same points of
    // the load, only later. The seed is printed; PROXYPOOL_CRASH_SEED replays it.
    let mut state: u64 = match std::env::var("PROXYPOOL_CRASH_SEED") {
        Ok(s) => s.parse().expect("PROXYPOOL_CRASH_SEED is a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
            .into(),
    };
    println!("crash test seed {state} (replay: PROXYPOOL_CRASH_SEED={state})");
    let acknowledged = || writes.load(std::sync::atomic::Ordering::Relaxed);
    // Waits (bounded, failing loudly) until `n` more writes were acknowledged.
    let progress = |n: u64, what: String| {
        let target = acknowledged() + n;
        async move {
            let waited = tokio::time::timeout(Duration::from_secs(60), async {
                while acknowledged() < target {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            assert!(
                waited.is_ok(),
                "no progress {what}: {} of {target} writes",
                acknowledged()
            );
        }
    };
    let mut fences: HashMap<String, u64> = HashMap::new();
    for round in 0..4 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let n = 1 + (state >> 33) % 40;
        progress(n, format!("before kill {round}")).await;
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Check Redis against the model now: every acknowledged write is there, and no fence
        // went back since the last check.
        let snapshot = model.lock().unwrap().clone();
        assert!(
            !snapshot.is_empty(),
            "the load made progress before round {round}"
        );
        for (w, (acked_version, acked_seq)) in &snapshot {
            let (session, fence) = store
                .session(w)
                .await
                .unwrap()
                .expect("session survives the crash");
            assert!(
                session.acked.version >= *acked_version,
                "{w}: lost an acknowledged ACK"
            );
            let fence = fence.unwrap_or(0);
            if session.acked.version == *acked_version {
                assert!(fence >= *acked_seq, "{w}: lost an acknowledged report");
            }
            let key = format!("{w}/{}", session.acked.version);
            let last = fences.insert(key, fence).unwrap_or(0);
            assert!(fence >= last, "{w}: the report fence moved backwards");
        }
        let (next, a) = spawn_controller(&config);
        child = next;
        *addr.lock().unwrap() = a;
    }
    // The load goes on after the last restart too.
    progress(10, "after the last restart".into()).await;
    stop.cancel();
    for w in workers {
        w.await.unwrap();
    }
    println!("acknowledged writes across 4 crashes: {}", acknowledged());
    child.kill().unwrap();
    child.wait().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
