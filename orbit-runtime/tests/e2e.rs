//! The agent against the control plane over real HTTP on loopback: register with a single-use
//! deployment token, heartbeat, 304 while nothing changed, a new version applied, a failed
//! version kept being returned until a fix converges, reported address → DNS record (the
//! in-memory provider here), an empty address keeps it, and a restart that neither re-registers
//! nor re-applies. Also: tampered and replayed signed requests are refused over HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use orbit_runtime::agent::{Agent, AgentConfig, AgentError, Applier, Pulled};
use orbit_runtime::dns::{DnsProvider, MemoryDns};
use orbit_runtime::server::{ControlPlane, RuntimeConfiguration, ServerConfig, system_clock};
use orbit_runtime::versions::ApplyStatus;
use serde_json::json;

/// Applies everything except configurations whose spec says `"fail": true`.
#[derive(Default)]
struct Recorder(Mutex<Vec<u64>>);

#[async_trait]
impl Applier for Recorder {
    async fn apply(
        &self,
        version: u64,
        configurations: &[RuntimeConfiguration],
    ) -> Vec<(String, ApplyStatus)> {
        self.0.lock().unwrap().push(version);
        configurations
            .iter()
            .map(|c| {
                let s = if c.spec["fail"] == true {
                    ApplyStatus::Failed
                } else {
                    ApplyStatus::Applied
                };
                (c.id.clone(), s)
            })
            .collect()
    }
}

fn cfg(id: &str, fail: bool) -> RuntimeConfiguration {
    RuntimeConfiguration {
        id: id.into(),
        kind: "nginx".into(),
        spec: json!({ "fail": fail }),
    }
}

async fn serve(cp: &ControlPlane) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = cp.router();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

#[tokio::test]
async fn agent_lifecycle_end_to_end() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dns = Arc::new(MemoryDns::default());
    let cp = ControlPlane::in_memory(
        ServerConfig::new("http://unused"),
        dns.clone(),
        system_clock(),
    )
    .unwrap();
    let url = serve(&cp).await;
    let token = cp.create_deployment_token(1).await.unwrap();
    let dir = std::env::temp_dir().join(format!("orbit-agent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = AgentConfig {
        control_plane_url: url.clone(),
        deployment_token: token.clone(),
        state_dir: dir.clone(),
        device_fingerprint_hash: "fp-sha256-abc".into(),
    };
    let applier = Recorder::default();
    let mut agent = Agent::open(config.clone()).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.join("ed25519.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let a1: IpAddr = "203.0.113.7".parse().unwrap();
    // First cycle registers; nothing published yet.
    assert_eq!(
        agent.tick(&applier, Some(a1)).await.unwrap(),
        Pulled::NotModified
    );
    let node = agent.state().node_id.clone().unwrap();
    assert_eq!(
        cp.node(&node)
            .await
            .unwrap()
            .unwrap()
            .device_fingerprint_hash,
        "fp-sha256-abc"
    );
    // The token was single use.
    let mut other = Agent::open(AgentConfig {
        state_dir: dir.join("other"),
        ..config.clone()
    })
    .unwrap();
    assert_eq!(
        other.register(None).await.unwrap_err(),
        AgentError::Status(401)
    );

    // DNS: the endpoint gets the reported address; an empty one keeps it; a change moves it.
    assert!(cp.add_endpoint(&node, "edge-1.example.net").await.unwrap());
    agent.heartbeat(Some(a1)).await.unwrap();
    assert_eq!(dns.address("edge-1.example.net").await.unwrap(), Some(a1));
    agent.heartbeat(None).await.unwrap();
    assert_eq!(dns.address("edge-1.example.net").await.unwrap(), Some(a1));
    let writes = dns.writes();
    agent.heartbeat(Some(a1)).await.unwrap();
    assert_eq!(dns.writes(), writes, "idempotent");
    let a2: IpAddr = "2001:db8::7".parse().unwrap();
    agent.heartbeat(Some(a2)).await.unwrap();
    assert_eq!(dns.address("edge-1.example.net").await.unwrap(), Some(a2));
    assert_eq!(orbit_runtime::dns::record_type(a2), "AAAA");

    // Version 1 applies.
    assert!(
        cp.publish(&node, 1, &[cfg("web", false), cfg("tls", false)])
            .await
            .unwrap()
    );
    assert_eq!(
        agent.tick(&applier, None).await.unwrap(),
        Pulled::Applied(1)
    );
    assert_eq!(
        agent.tick(&applier, None).await.unwrap(),
        Pulled::NotModified
    );
    assert_eq!(cp.node(&node).await.unwrap().unwrap().current_applied, 1);
    // Version 2 fails: reported, the server keeps returning it, current stays 1.
    assert!(
        cp.publish(&node, 2, &[cfg("web", false), cfg("tls", true)])
            .await
            .unwrap()
    );
    assert_eq!(agent.tick(&applier, None).await.unwrap(), Pulled::Failed(2));
    assert_eq!(agent.tick(&applier, None).await.unwrap(), Pulled::Failed(2));
    assert_eq!(cp.node(&node).await.unwrap().unwrap().current_applied, 1);
    assert_eq!(agent.state().applied_version, 1);
    // A fix (version 3) converges.
    assert!(
        cp.publish(&node, 3, &[cfg("web", false), cfg("tls", false)])
            .await
            .unwrap()
    );
    assert_eq!(
        agent.tick(&applier, None).await.unwrap(),
        Pulled::Applied(3)
    );
    assert_eq!(
        agent.tick(&applier, None).await.unwrap(),
        Pulled::NotModified
    );
    assert_eq!(cp.node(&node).await.unwrap().unwrap().current_applied, 3);
    assert_eq!(applier.0.lock().unwrap().as_slice(), [1, 2, 2, 3]);

    // Restart: same identity and applied version; no re-registration, no refetch.
    drop(agent);
    let mut again = Agent::open(config).unwrap();
    assert_eq!(again.state().node_id.as_deref(), Some(node.as_str()));
    assert_eq!(
        again.tick(&applier, None).await.unwrap(),
        Pulled::NotModified
    );
    assert_eq!(applier.0.lock().unwrap().len(), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn tampered_and_replayed_requests_are_refused_over_http() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cp = ControlPlane::in_memory(
        ServerConfig::new("http://unused"),
        Arc::new(MemoryDns::default()),
        system_clock(),
    )
    .unwrap();
    let url = serve(&cp).await;
    let dir = std::env::temp_dir().join(format!("orbit-tamper-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut agent = Agent::open(AgentConfig {
        control_plane_url: url.clone(),
        deployment_token: cp.create_deployment_token(1).await.unwrap(),
        state_dir: dir.clone(),
        device_fingerprint_hash: String::new(),
    })
    .unwrap();
    agent.register(None).await.unwrap();
    let state = agent.state().clone();
    // Build a signed request by hand, send it twice, then with one header changed.
    let key_seed: [u8; 32] = std::fs::read(dir.join("ed25519.key"))
        .unwrap()
        .try_into()
        .unwrap();
    let key = ed25519_dalek::SigningKey::from_bytes(&key_seed);
    let identity = orbit_runtime::signing::Identity {
        node_id: state.node_id.clone().unwrap(),
        edge_runtime_id: state.edge_runtime_id.clone().unwrap(),
        installation_id: state.installation_id.clone(),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let body = br#"{"reported_address":"198.51.100.1"}"#;
    let h = orbit_runtime::signing::sign(
        &key,
        &identity,
        "POST",
        "/api/v1/edge-runtime/heartbeat",
        body,
        now,
        &"ab".repeat(16),
    );
    let client = reqwest::Client::new();
    let send = |pairs: Vec<(&'static str, String)>, body: &'static [u8]| {
        let mut req = client
            .post(format!("{url}/api/v1/edge-runtime/heartbeat"))
            .body(body);
        for (k, v) in pairs {
            req = req.header(k, v);
        }
        req.send()
    };
    let pairs: Vec<_> = h.to_pairs().into_iter().collect();
    assert_eq!(send(pairs.clone(), body).await.unwrap().status(), 200);
    let replay = send(pairs.clone(), body).await.unwrap();
    assert_eq!(replay.status(), 401);
    assert_eq!(
        replay.text().await.unwrap(),
        r#"{"error":"replayed_nonce"}"#
    );
    let r = send(pairs.clone(), br#"{"reported_address":"198.51.100.2"}"#)
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"body_digest_mismatch"}"#
    );
    // A signature header missing: authentication missing (401), in the JSON error shape.
    let mut missing = pairs.clone();
    missing.retain(|(k, _)| *k != orbit_runtime::signing::H_NONCE);
    let r = send(missing, body).await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"missing_header"}"#);
    // Present but malformed: 400.
    let mut malformed = pairs.clone();
    for (k, v) in &mut malformed {
        if *k == orbit_runtime::signing::H_TIMESTAMP {
            *v = "yesterday".into();
        }
    }
    let r = send(malformed, body).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"malformed_header"}"#);
    // Unsigned desired-state: 401 (no signature headers at all), never the configuration.
    let r = client
        .get(format!("{url}/api/v1/edge-runtime/desired-state"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"missing_header"}"#);
    // Every other refusal in the same shape: a body over the limit, an unknown path, a wrong
    // method.
    let r = client
        .post(format!("{url}/api/v1/edge-runtime/heartbeat"))
        .body(vec![b'x'; orbit_runtime::server::MAX_BODY + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"body_too_large"}"#);
    let r = client
        .get(format!("{url}/api/v1/edge-runtime/nowhere"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"not_found"}"#);
    let r = client
        .get(format!("{url}/api/v1/edge-runtime/heartbeat"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"method_not_allowed"}"#);

    // Seed 003: while the newest version went `failed` and is above what the runtime applied,
    // it is returned — even to a runtime whose X-OrbitMesh-Current-Version names it — until an
    // apply result reports it applied.
    let nonce = std::sync::atomic::AtomicU32::new(0);
    let signed =
        |method: &'static str, path: &'static str, body: &'static [u8], current: Option<u64>| {
            let n = nonce.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let h = orbit_runtime::signing::sign(
                &key,
                &identity,
                method,
                path,
                body,
                now,
                &format!("{n:032x}"),
            );
            let mut req = client
                .request(method.parse().unwrap(), format!("{url}{path}"))
                .body(body);
            for (k, v) in h.to_pairs() {
                req = req.header(k, v);
            }
            if let Some(v) = current {
                req = req.header(orbit_runtime::server::H_CURRENT_VERSION, v.to_string());
            }
            req.send()
        };
    let node = identity.node_id.clone();
    assert!(cp.publish(&node, 1, &[cfg("web", false)]).await.unwrap());
    let failed = br#"{"version":1,"results":[{"configuration_id":"web","status":"failed"}]}"#;
    let applied = br#"{"version":1,"results":[{"configuration_id":"web","status":"applied"}]}"#;
    let apply = "/api/v1/edge-runtime/apply-result";
    let pull = "/api/v1/edge-runtime/desired-state";
    assert!(
        signed("POST", apply, failed, None)
            .await
            .unwrap()
            .status()
            .is_success()
    );
    for header in [Some(1), Some(0), None] {
        let r = signed("GET", pull, b"", header).await.unwrap();
        assert_eq!(r.status(), 200, "current version header {header:?}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["version"], 1);
    }
    assert!(
        signed("POST", apply, applied, None)
            .await
            .unwrap()
            .status()
            .is_success()
    );
    assert_eq!(
        signed("GET", pull, b"", Some(1)).await.unwrap().status(),
        304
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn agent_survives_a_control_plane_restart() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("orbit-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("cp.sqlite3");
    let start = |port: u16| {
        let db = db.clone();
        async move {
            let store = Arc::new(orbit_runtime::store::SqliteStore::open(&db).unwrap());
            let cp = ControlPlane::new(
                ServerConfig::new("http://unused"),
                store,
                Arc::new(MemoryDns::default()),
                system_clock(),
            );
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .unwrap();
            let port = listener.local_addr().unwrap().port();
            let app = cp.router();
            (
                cp,
                port,
                tokio::spawn(async move { axum::serve(listener, app).await.unwrap() }),
            )
        }
    };
    let (cp, port, server) = start(0).await;
    let token = cp.create_deployment_token(1).await.unwrap();
    let mut agent = Agent::open(AgentConfig {
        control_plane_url: format!("http://127.0.0.1:{port}"),
        deployment_token: token,
        state_dir: dir.join("agent"),
        device_fingerprint_hash: "fp".into(),
    })
    .unwrap();
    let applier = Recorder::default();
    assert_eq!(
        agent.tick(&applier, None).await.unwrap(),
        Pulled::NotModified
    );
    let node = agent.state().node_id.clone().unwrap();
    assert!(cp.publish(&node, 1, &[cfg("web", false)]).await.unwrap());
    // The control plane goes away: the agent sees a network error, nothing is lost.
    server.abort();
    let _ = server.await;
    drop(cp);
    assert_eq!(
        agent.tick(&applier, None).await.unwrap_err(),
        AgentError::Unreachable
    );
    // Back on the same address over the same database: the registration, the key and the
    // published version are all still there; the agent neither re-registers nor fails.
    let (cp, _, _server) = start(port).await;
    assert_eq!(
        agent.tick(&applier, None).await.unwrap(),
        Pulled::Applied(1)
    );
    assert_eq!(cp.node(&node).await.unwrap().unwrap().current_applied, 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The admin API refuses in the same JSON shape.
#[tokio::test]
async fn admin_refusals_are_json() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cp = ControlPlane::in_memory(
        ServerConfig::new("http://unused"),
        Arc::new(MemoryDns::default()),
        system_clock(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let admin = cp.admin_router();
    tokio::spawn(async move { axum::serve(listener, admin).await });
    let client = reqwest::Client::new();
    let tokens = format!("{url}/admin/v1/deployment-tokens");
    let r = client.post(&tokens).body("{}").send().await.unwrap();
    assert_eq!(r.status(), 415);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"unsupported_media_type"}"#
    );
    let r = client
        .post(&tokens)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"invalid_body"}"#);
    let r = client
        .get(format!("{url}/admin/v1/elsewhere"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"not_found"}"#);
    let r = client
        .post(&tokens)
        .header("content-type", "application/json")
        .body(r#"{"uses":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "the control: a well-formed request succeeds"
    );
}
