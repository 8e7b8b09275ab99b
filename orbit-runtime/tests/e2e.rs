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
    let mut missing = pairs.clone();
    missing.retain(|(k, _)| *k != orbit_runtime::signing::H_NONCE);
    assert_eq!(send(missing, body).await.unwrap().status(), 400);
    // Unsigned desired-state: 400 (missing headers), never the configuration.
    assert_eq!(
        client
            .get(format!("{url}/api/v1/edge-runtime/desired-state"))
            .send()
            .await
            .unwrap()
            .status(),
        400
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
