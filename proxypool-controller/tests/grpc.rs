//! gRPC through the generated client over loopback: DTOs, status codes, batch and message
//! limits, the two unimplemented RPCs, gRPC health, readiness and shutdown; and mTLS with
//! certificates made at test time (correct SPIFFE identity, mismatched worker_id, missing client
//! certificate, wrong environment, the loopback-plaintext rule).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::Arc;
use std::time::Duration;

use proxypool_controller::config::{Config, File, TlsMode};
use proxypool_controller::domain::{ControlStore, SnapshotReference, SnapshotTuple};
use proxypool_controller::memory::MemoryStore;
use proxypool_controller::proto::controlplane as pb;
use proxypool_controller::proto::controlplane::worker_control_plane_client::WorkerControlPlaneClient;
use proxypool_controller::server::{Running, StartError, start, start_with};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

fn config(extra: &str) -> Config {
    let text = format!(
        "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\nmaxMessageBytes = 65536\nmaxRuntimeCounters = 50\nshutdownTimeout = \"2s\"\n{extra}\n[redis]\nurl = \"redis://unused\"\n[admin]\nlisten = \"127.0.0.1:0\"\n"
    );
    File::parse(&text).unwrap().validate().unwrap()
}

async fn plaintext() -> (
    Running,
    MemoryStore,
    CancellationToken,
    WorkerControlPlaneClient<Channel>,
) {
    let store = MemoryStore::default();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let running = start_with(&config(""), Arc::new(store.clone()), async move {
        s.cancelled().await
    })
    .await
    .unwrap();
    let client = WorkerControlPlaneClient::connect(format!("http://{}", running.grpc_addr))
        .await
        .unwrap();
    (running, store, stop, client)
}

fn register(worker: &str) -> pb::RegisterWorkerRequest {
    pb::RegisterWorkerRequest {
        worker_id: worker.into(),
        instance_id: "inst-1".into(),
        zone: String::new(),
        labels: [("pool".to_owned(), "dc".to_owned())].into_iter().collect(),
        supported_protocol_version: 1,
    }
}

async fn publish(store: &MemoryStore, worker: &str, v: u64) {
    store
        .record_issued_snapshot(
            worker,
            SnapshotReference {
                tuple: SnapshotTuple {
                    ownership_epoch: 1,
                    version: v,
                },
                checksum: [v as u8; 32],
            },
            Duration::from_secs(60),
        )
        .await
        .unwrap();
}

fn ack(worker: &str, session: &[u8], v: u64) -> pb::AcknowledgeSnapshotRequest {
    pb::AcknowledgeSnapshotRequest {
        worker_id: worker.into(),
        session_id: session.to_vec().into(),
        snapshot_version: v,
        ownership_epoch: 1,
        checksum: vec![v as u8; 32].into(),
        applied: true,
        error_code: String::new(),
        error_message: String::new(),
    }
}

fn report(worker: &str, session: &[u8], seq: u64, v: u64, n: usize) -> pb::ReportRuntimeRequest {
    pb::ReportRuntimeRequest {
        worker_id: worker.into(),
        session_id: session.to_vec().into(),
        sequence: seq,
        snapshot_version: v,
        ownership_epoch: 1,
        observed_at_unix_ms: 1_700_000_000_000,
        counters: (0..n)
            .map(|i| pb::ProxyCounters {
                proxy_id: format!("proxy-{i}"),
                in_flight: 1,
                open_connections: 2,
            })
            .collect(),
    }
}

#[tokio::test]
async fn rpcs_dtos_and_status_codes() {
    let (running, store, stop, mut c) = plaintext().await;
    let r = c
        .register_worker(register("w1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (r.session_id.len(), r.ownership_epoch, r.protocol_version),
        (16, 1, 1)
    );
    assert_eq!(
        (r.heartbeat_interval_ms, r.max_stale_age_ms),
        (10_000, 30_000)
    );
    let sid = r.session_id.to_vec();

    // Validation and protocol.
    let mut bad = register("w1");
    bad.worker_id = "bad id".into();
    let e = c.register_worker(bad).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "invalid worker_id")
    );
    let mut old = register("w1");
    old.supported_protocol_version = 2;
    assert_eq!(
        c.register_worker(old).await.unwrap_err().code(),
        Code::FailedPrecondition
    );

    // Not yet acknowledged: a report asks for a full snapshot.
    let resp = c
        .report_runtime(report("w1", &sid, 1, 1, 0))
        .await
        .unwrap()
        .into_inner();
    assert!(resp.require_full_snapshot && resp.revoke_proxy_ids.is_empty());
    publish(&store, "w1", 1).await;
    let a = c
        .acknowledge_snapshot(ack("w1", &sid, 1))
        .await
        .unwrap()
        .into_inner();
    assert!(!a.require_full_snapshot);
    assert_eq!(a.ownership_epoch, 1);
    let mut wrong = ack("w1", &sid, 1);
    wrong.checksum = vec![9; 32].into();
    assert!(
        c.acknowledge_snapshot(wrong)
            .await
            .unwrap()
            .into_inner()
            .require_full_snapshot
    );

    let ok = c
        .report_runtime(report("w1", &sid, 5, 1, 3))
        .await
        .unwrap()
        .into_inner();
    assert!(!ok.require_full_snapshot);
    assert_eq!(store.runtime("w1").unwrap().counters.len(), 3);
    let e = c
        .report_runtime(report("w1", &sid, 4, 1, 0))
        .await
        .unwrap_err();
    assert_eq!((e.code(), e.message()), (Code::Aborted, "stale report"));
    let e = c
        .report_runtime(report("w1", &sid, 5, 1, 1))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::AlreadyExists, "conflicting report")
    );
    // Batch limit (maxRuntimeCounters = 50) and message size (maxMessageBytes = 64 KiB).
    let e = c
        .report_runtime(report("w1", &sid, 6, 1, 51))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "invalid counters")
    );
    // Over maxMessageBytes: refused before decoding, RESOURCE_EXHAUSTED (the gRPC status
    // table's code for a message over the configured limit); at the limit it is decoded and
    // judged by the domain (its proxy id is too long: INVALID_ARGUMENT).
    let sized = |n: usize| {
        let mut r = report("w1", &sid, 6, 1, 1);
        r.counters[0].proxy_id = "p".repeat(n);
        r
    };
    let limit = 65_536;
    let mut n = limit;
    while prost::Message::encoded_len(&sized(n)) > limit {
        n -= 1;
    }
    assert_eq!(
        prost::Message::encoded_len(&sized(n)),
        limit,
        "a request of exactly the limit"
    );
    let at = c.report_runtime(sized(n)).await.unwrap_err();
    assert_eq!(at.code(), Code::InvalidArgument, "{at:?}");
    let over = c.report_runtime(sized(n + 1)).await.unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
    let mut neg = report("w1", &sid, 6, 1, 1);
    neg.counters[0].in_flight = -1;
    assert_eq!(
        c.report_runtime(neg).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    // A new registration makes the old session stale.
    c.register_worker(register("w1")).await.unwrap();
    let e = c
        .report_runtime(report("w1", &sid, 7, 1, 0))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::FailedPrecondition, "stale session")
    );

    // The two unimplemented RPCs.
    let e = c
        .watch_snapshots(pb::WatchSnapshotsRequest {
            worker_id: "w1".into(),
            session_id: sid.clone().into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    let e = c
        .report_outcomes(pb::ReportOutcomesRequest {
            worker_id: "w1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);

    // Messages never carry session ids or backend text.
    let hex_sid: String = sid.iter().map(|b| format!("{b:02x}")).collect();
    let stale = c
        .report_runtime(report("w1", &sid, 7, 1, 0))
        .await
        .unwrap_err();
    let unknown = c
        .acknowledge_snapshot(ack("w1", &[0; 16], 1))
        .await
        .unwrap_err();
    for status in [stale, unknown, e] {
        let m = status.message();
        assert!(
            !m.contains("redis") && !m.contains("activity") && !m.contains(&hex_sid),
            "{m}"
        );
    }
    // Metrics: bounded labels only.
    let metrics = running.metrics.render();
    assert!(metrics.contains(
        "proxypool_controlplane_requests_total{rpc=\"report_runtime\",outcome=\"aborted\"} 1"
    ));
    assert!(!metrics.contains("w1") && !metrics.contains("inst-1"));
    stop.cancel();
    running.wait().await.unwrap();
}

#[tokio::test]
async fn health_readiness_and_shutdown() {
    let (running, _store, stop, _c) = plaintext().await;
    let channel = Channel::from_shared(format!("http://{}", running.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "controlplane.v1.WorkerControlPlane".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let admin = format!("http://{}", running.admin_addr.unwrap());
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    assert_eq!(
        http.get(format!("{admin}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        http.get(format!("{admin}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(running.is_ready());
    let addr = running.grpc_addr;
    stop.cancel();
    // The lifecycle group ends (graceful stop bounded by shutdownTimeout) and the port closes.
    tokio::time::timeout(Duration::from_secs(10), running.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(
        WorkerControlPlaneClient::connect(format!("http://{addr}"))
            .await
            .is_err()
    );
}

/// Seed 004: shutdown is graceful for `shutdownTimeout` (2 s here), then hard. A gRPC health
/// `Watch` stream never ends by itself, so it holds the graceful stop: the controller stops
/// only after the timeout, and the stream is cut then.
#[tokio::test]
async fn shutdown_escalates_to_a_hard_stop_with_a_stream_still_open() {
    let (running, _store, stop, _c) = plaintext().await;
    let channel = Channel::from_shared(format!("http://{}", running.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut watch = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        watch.message().await.unwrap().is_some(),
        "the stream is open"
    );
    let stopping = std::time::Instant::now();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), running.wait())
        .await
        .expect("the hard stop ends the server")
        .unwrap();
    assert!(
        stopping.elapsed() >= Duration::from_secs(2),
        "the graceful stop waited for the open stream: {:?}",
        stopping.elapsed()
    );
    // The open stream sees NOT_SERVING during the graceful stop, then is cut.
    let mut ended = false;
    for _ in 0..10 {
        match tokio::time::timeout(Duration::from_secs(5), watch.message()).await {
            Ok(Ok(Some(_))) => continue,
            Ok(Ok(None) | Err(_)) => {
                ended = true;
                break;
            }
            Err(_) => break,
        }
    }
    assert!(ended, "the stream was cut by the hard stop");
}

/// A Redis store whose server dies under a running controller: workers get `UNAVAILABLE`
/// with the fixed message, never the backend's own text (its address, port or error). The
/// test runs its own `redis-server` (it must die without disturbing the shared one).
#[tokio::test]
async fn a_store_failure_reaches_workers_as_unavailable_without_backend_text() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _ = rustls::crypto::ring::default_provider().install_default();
    /// Kills the private server however the test ends (a panic included).
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let redis = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server is required (scripts/test-all.sh installs it: apt-get install redis-server)");
    let mut redis = Killed(redis);
    let url = format!("redis://127.0.0.1:{port}/");
    let store = loop {
        match proxypool_controller::redis_store::RedisStore::connect(&url, "grpc-failure").await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let stop = CancellationToken::new();
    let s = stop.clone();
    let running = start_with(
        &config(""),
        Arc::new(store),
        async move { s.cancelled().await },
    )
    .await
    .unwrap();
    let mut c = WorkerControlPlaneClient::connect(format!("http://{}", running.grpc_addr))
        .await
        .unwrap();
    let sid = c
        .register_worker(register("w1"))
        .await
        .unwrap()
        .into_inner()
        .session_id;
    let readyz = format!("http://{}/readyz", running.admin_addr.unwrap());
    let http = reqwest::Client::new();
    assert_eq!(http.get(&readyz).send().await.unwrap().status(), 200);
    redis.0.kill().unwrap();
    redis.0.wait().unwrap();
    // Readiness follows Redis after startup too (seed 004: ready = serving and the store).
    let r = http.get(&readyz).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.text().await.unwrap(), "redis unavailable");
    let failures = [
        c.register_worker(register("w2")).await.unwrap_err(),
        c.acknowledge_snapshot(ack("w1", &sid, 1))
            .await
            .unwrap_err(),
        c.report_runtime(report("w1", &sid, 1, 1, 0))
            .await
            .unwrap_err(),
    ];
    for status in failures {
        assert_eq!(
            (status.code(), status.message()),
            (Code::Unavailable, "store unavailable"),
            "{status:?}"
        );
        let details = format!("{status:?}");
        for leak in [
            "redis",
            "127.0.0.1",
            &port.to_string(),
            "refused",
            "onnection",
        ] {
            assert!(
                !details.contains(leak),
                "backend text {leak:?} in {details}"
            );
        }
    }
    let metrics = running.metrics.render();
    assert!(!metrics.contains("127.0.0.1") && !metrics.contains(&port.to_string()));
    stop.cancel();
    running.wait().await.unwrap();
}

#[tokio::test]
async fn bootstrap_refusals() {
    // Disabled by default: nothing starts.
    let disabled = File::parse("").unwrap().validate().unwrap();
    assert_eq!(
        start(&disabled, std::future::pending()).await.unwrap_err(),
        StartError::Disabled
    );
    // Redis unavailable at startup: refused.
    let text = "[controlPlane]\nenabled = true\nlisten = \"127.0.0.1:0\"\n[redis]\nurl = \"redis://127.0.0.1:1/\"\n";
    let c = File::parse(text).unwrap().validate().unwrap();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(20), start(&c, std::future::pending()))
            .await
            .unwrap()
            .unwrap_err(),
        StartError::RedisUnavailable
    );
    // Plaintext on a non-loopback address is a configuration error.
    let text =
        "[controlPlane]\nenabled = true\nlisten = \"0.0.0.0:0\"\n[redis]\nurl = \"redis://x\"\n";
    assert_eq!(
        File::parse(text).unwrap().validate().unwrap_err().key,
        "controlPlane.tls.mode"
    );
}

mod mtls {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};

    struct Pki {
        ca_pem: String,
        ca: rcgen::Issuer<'static, KeyPair>,
    }

    fn pki() -> Pki {
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "proxypool test CA");
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Pki {
            ca_pem: cert.pem(),
            ca: rcgen::Issuer::new(params, key),
        }
    }

    fn leaf(pki: &Pki, uri: Option<&str>, server: bool) -> (String, String) {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, "leaf");
        if let Some(uri) = uri {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().unwrap()));
        }
        if server {
            params
                .subject_alt_names
                .push(SanType::DnsName("localhost".try_into().unwrap()));
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &pki.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A worker certificate with two URI SANs (both well-formed): refused, the identity must be
    /// unambiguous.
    fn two_uris(pki: &Pki) -> (String, String) {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, "leaf");
        for uri in [
            "spiffe://proxypool.test/staging/worker/w1",
            "spiffe://proxypool.test/staging/worker/w2",
        ] {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().unwrap()));
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &pki.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Writes the server's three files for `pki` into `dir`.
    fn write_files(dir: &std::path::Path, pki: &Pki) {
        let (cert, key) = leaf(pki, None, true);
        std::fs::write(dir.join("server.pem"), cert).unwrap();
        std::fs::write(dir.join("server.key"), key).unwrap();
        std::fs::write(dir.join("ca.pem"), &pki.ca_pem).unwrap();
    }

    async fn server(dir: &std::path::Path, pki: &Pki) -> (Running, CancellationToken) {
        server_with(dir, pki, "").await
    }

    async fn server_with(
        dir: &std::path::Path,
        pki: &Pki,
        extra: &str,
    ) -> (Running, CancellationToken) {
        write_files(dir, pki);
        let tls = format!(
            "[controlPlane.tls]\nmode = \"mtls\"\nserverCert = {:?}\nserverKey = {:?}\nclientCA = {:?}\ntrustDomain = \"proxypool.test\"\nenvironment = \"staging\"\n{extra}",
            dir.join("server.pem").display().to_string(),
            dir.join("server.key").display().to_string(),
            dir.join("ca.pem").display().to_string()
        );
        let config = config(&tls);
        assert!(matches!(config.tls, TlsMode::Mtls { .. }));
        let stop = CancellationToken::new();
        let s = stop.clone();
        let running = start_with(&config, Arc::new(MemoryStore::default()), async move {
            s.cancelled().await
        })
        .await
        .unwrap();
        (running, stop)
    }

    async fn client(
        addr: std::net::SocketAddr,
        pki: &Pki,
        identity: Option<(String, String)>,
    ) -> Result<WorkerControlPlaneClient<Channel>, tonic::transport::Error> {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&pki.ca_pem))
            .domain_name("localhost");
        if let Some((cert, key)) = identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        let channel = Channel::from_shared(format!("https://localhost:{}", addr.port()))
            .unwrap()
            .tls_config(tls)?
            .connect()
            .await?;
        Ok(WorkerControlPlaneClient::new(channel))
    }

    #[tokio::test]
    async fn worker_identity_is_the_certificate() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = std::env::temp_dir().join(format!("proxypool-mtls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pki = pki();
        let (running, stop) = server(&dir, &pki).await;
        let addr = running.grpc_addr;

        let good = leaf(
            &pki,
            Some("spiffe://proxypool.test/staging/worker/w1"),
            false,
        );
        let mut c = client(addr, &pki, Some(good)).await.unwrap();
        let r = c
            .register_worker(register("w1"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.session_id.len(), 16);
        // The request names another worker than the certificate.
        let e = c.register_worker(register("w2")).await.unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (Code::PermissionDenied, "worker identity mismatch")
        );
        let e = c
            .report_runtime(report("w2", &r.session_id, 1, 1, 0))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);

        // No client certificate, another environment, two URIs: not served.
        let refused = [
            None,
            Some(leaf(
                &pki,
                Some("spiffe://proxypool.test/prod/worker/w1"),
                false,
            )),
            Some(leaf(
                &pki,
                Some("spiffe://other.test/staging/worker/w1"),
                false,
            )),
            Some(leaf(
                &pki,
                Some("spiffe://proxypool.test/staging/gateway/w1"),
                false,
            )),
            Some(two_uris(&pki)),
        ];
        for (i, identity) in refused.into_iter().enumerate() {
            let result = match client(addr, &pki, identity).await {
                Ok(mut c) => c.register_worker(register("w1")).await.map(|_| ()),
                Err(e) => Err(tonic::Status::unavailable(e.to_string())),
            };
            // Refused at the connection, before any RPC is served: a transport error (the
            // server alerts CertificateRequired, or closes after checking the identity), never
            // an application status such as PermissionDenied from a handler.
            let e = result.expect_err("an unauthenticated worker was served");
            let details = format!("{e:?}");
            assert!(
                matches!(e.code(), Code::Unknown | Code::Unavailable)
                    && details.contains("Transport"),
                "case {i}: {details}"
            );
            if i == 0 {
                assert!(details.contains("CertificateRequired"), "{details}");
            }
        }
        stop.cancel();
        running.wait().await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The controller re-reads its three files (`reloadInterval`): after a rotation to a new CA,
    /// new connections get the new server certificate and only the new CA's workers are served;
    /// no restart.
    #[tokio::test]
    async fn rewritten_certificates_are_used_without_a_restart() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir =
            std::env::temp_dir().join(format!("proxypool-mtls-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (old, new) = (pki(), pki());
        let (running, stop) = server_with(&dir, &old, "reloadInterval = \"50ms\"\n").await;
        let addr = running.grpc_addr;
        let worker = |pki: &Pki| {
            leaf(
                pki,
                Some("spiffe://proxypool.test/staging/worker/w1"),
                false,
            )
        };
        let mut c = client(addr, &old, Some(worker(&old))).await.unwrap();
        c.register_worker(register("w1")).await.unwrap();

        write_files(&dir, &new);
        // Waits for the reload (no time window: up to 30 s for the poll to see the files).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut c) = client(addr, &new, Some(worker(&new))).await
                && c.register_worker(register("w1")).await.is_ok()
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the new files were never used"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The old CA's workers are no longer served (the client no longer trusts the server's
        // certificate either way; a worker trusting both CAs is refused for its own).
        let both = Pki {
            ca_pem: format!("{}{}", old.ca_pem, new.ca_pem),
            ca: pki().ca,
        };
        let refused = match client(addr, &both, Some(worker(&old))).await {
            Ok(mut c) => c.register_worker(register("w1")).await.is_err(),
            Err(_) => true,
        };
        assert!(refused, "a worker of the replaced CA was served");
        stop.cancel();
        running.wait().await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
