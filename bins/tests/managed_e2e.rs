//! The managed credential plane end to end over real mTLS sockets:
//!
//! `iop-cp` CLI (principal, token, slot, route) → `iop-cp serve` (managed) ⇄ Edge connector
//! (in process) → HTTP client with the token → Edge (projection auth, route, pool admission,
//! lease acquisition) → Node (opens the lease, injects the header) → a local upstream that
//! records the `authorization` header it receives.
//!
//! Also: a token revoked or a slot rotated between projection and dispatch fails closed; a
//! captured lease cannot be replayed; a lease sealed for Node A is refused by Node B; the
//! credential never appears in the CP's or the Edge's/Node's logs, metrics, status view or
//! error bodies.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use iop_edge::pool::ContextSize;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use bytes::Bytes;
use iop_edge::control::{ControlConfig, ControlConnector, SessionState};
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{Lifecycle, TransportConfig, TunnelEvent, bind};
use iop_lease::{
    IssuerPublicKey, IssuerSigningKey, OpenPolicy, Recipient, RecipientSecretKey, TrustedIssuers,
};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::{self, Ca};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, CredentialLeaseBinding, Header,
    ManagedCredential, NodeConfigPayload, OpenAiCompatSettings, Operation, ProviderTunnelRequest,
};
use iop_wire::tunnel_order::Delivery;
use tokio::io::AsyncBufReadExt as _;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(90);
const MODEL: &str = "gpt-4o-mini";

/// Logs of this process (Edge and Node), at debug level.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);
impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Self;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

fn cli(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_iop-cp"));
    cmd.arg("--data-dir").arg(dir).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "iop-cp {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The local upstream: records every `authorization` header and answers a small SSE stream.
async fn upstream(seen: Arc<Mutex<Vec<String>>>) -> std::net::SocketAddr {
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |headers: HeaderMap| {
            let seen = seen.clone();
            async move {
                let auth = headers
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                seen.lock().unwrap().push(auth);
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(axum::body::Body::from(
                        "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n",
                    ))
                    .unwrap()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn node_config(upstream: std::net::SocketAddr) -> NodeConfigPayload {
    NodeConfigPayload {
        adapters: vec![AdapterConfig {
            name: "openai".into(),
            adapter_type: "openai_compat".into(),
            enabled: true,
            capacity: 8,
            long_context_capacity: 0,
            targets: vec![MODEL.into()],
            settings: AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                base_url: format!("http://{upstream}/v1"),
                protocol_profile: ConcreteProtocolProfile {
                    // Must equal the slot's profile: the Node checks the binding against it.
                    name: "openai".into(),
                    operation_paths: [(Operation::ChatCompletions, "/chat/completions".to_owned())]
                        .into_iter()
                        .collect(),
                    ..Default::default()
                },
                request_timeout_sec: 30,
            }),
        }],
        ..Default::default()
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

struct Cp {
    child: tokio::process::Child,
    wire: String,
    admin: String,
    logs: Arc<Mutex<String>>,
}

/// `iop-cp serve`, managed; `store_watch: false` leaves CLI mutations unseen for
/// `store_poll_ms`.
async fn start_cp(dir: &Path, ca: &Ca, store_poll_ms: u64, store_watch: bool) -> Cp {
    let leaf = ca.workload(role::CONTROL_PLANE, "cp-1", true);
    let ca_pem = write(dir, "ca.pem", &ca.pem());
    let cert = write(dir, "cp.pem", &leaf.cert_pem);
    let key = write(dir, "cp.key", &leaf.key_pem);
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-cp"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--tls-ca")
        .arg(&ca_pem)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .args(["--trust-domain", pki::TRUST_DOMAIN, "--credential-plane"])
        .args(["--store-poll-ms", &store_poll_ms.to_string()])
        .args(["--store-watch", &store_watch.to_string()])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let logs = Arc::new(Mutex::new(String::new()));
    let stderr = child.stderr.take().unwrap();
    let l = logs.clone();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            l.lock().unwrap().push_str(&line);
            l.lock().unwrap().push('\n');
        }
    });
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut wire, mut admin) = (String::new(), String::new());
    while wire.is_empty() || admin.is_empty() {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("iop-cp prints its addresses");
        if let Some(rest) = line.strip_prefix("iop-cp: edge wire on ") {
            wire = rest.split(' ').next().unwrap().to_owned();
        }
        if let Some(rest) = line.strip_prefix("iop-cp: admin API on ") {
            admin = rest.to_owned();
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Cp {
        child,
        wire,
        admin,
        logs,
    }
}

fn provider(node: &str) -> ProviderSpec {
    ProviderSpec {
        key: ProviderKey {
            node_id: node.into(),
            provider_id: "up".into(),
        },
        adapter: "openai".into(),
        target: MODEL.into(),
        kind: ProviderKind::OpenAiCompat,
        category: "api".into(),
        capacity: 8,
        long_context_capacity: 0,
        response_stall_timeout: Duration::from_secs(60),
        enabled: true,
    }
}

fn recipient(issuer_pem: &str, key_id: &str) -> Recipient {
    let issuer = IssuerPublicKey::from_pem_derived(issuer_pem).unwrap();
    let trusted: TrustedIssuers = [issuer].into_iter().collect();
    Recipient::new(
        RecipientSecretKey::generate(key_id).unwrap(),
        trusted,
        OpenPolicy::default(),
    )
}

fn tunnel_request(run_id: &str, credential: Option<ManagedCredential>) -> ProviderTunnelRequest {
    ProviderTunnelRequest {
        run_id: run_id.into(),
        adapter: "openai".into(),
        target: MODEL.into(),
        method: "POST".into(),
        path: String::new(),
        headers: vec![Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body: Bytes::from_static(b"{\"model\":\"gpt-4o-mini\",\"stream\":true}"),
        stream: true,
        operation: Some(Operation::ChatCompletions),
        credential: credential.map(Box::new),
        ..Default::default()
    }
}

/// The last event of a tunnel.
async fn last_event(
    edge: &iop_edge::EdgeHandle,
    node: &str,
    req: ProviderTunnelRequest,
) -> TunnelEvent {
    let mut s = edge.tunnel(node, req).await.unwrap();
    let mut last = None;
    while let Some(ev) = s.next().await {
        last = Some(ev);
    }
    last.unwrap()
}

async fn wait_generation(connector: &ControlConnector, above: u64) -> u64 {
    loop {
        if let Some(g) = connector.projection().map(|p| p.generation())
            && g > above
        {
            return g;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn managed_credentials_end_to_end() {
    let captured = Captured::default();
    // Global: the runtime's worker threads log too. This binary has this one test.
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(captured.clone())
            .with_ansi(false)
            .finish(),
    )
    .unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::time::timeout(LIMIT, async {
        let dir = std::env::temp_dir().join(format!("iop-managed-e2e-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let data = dir.join("data");
        let secret = format!("sk-live-{:016x}", rand_u64());
        let secret2 = format!("sk-rotated-{:016x}", rand_u64());

        // Admin with the CLI, before the server runs (a store that does not exist is refused
        // until `init` creates it).
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_iop-cp"))
            .args(["principal", "create", "team-a", "--data-dir"])
            .arg(&data)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("init"), "{out:?}");
        assert!(!data.exists(), "nothing was created");
        cli(&data, &["init"], &[]);
        cli(&data, &["principal", "create", "team-a", "--name", "Team A"], &[]);
        cli(&data, &["principal", "create", "team-b"], &[]);
        let out = cli(&data, &["token", "create", "--principal", "team-a"], &[]);
        let token = out.lines().find_map(|l| l.strip_prefix("token: ")).unwrap().to_owned();
        let token_id = out.lines().find_map(|l| l.strip_prefix("token_id: ")).unwrap().to_owned();
        let out_b = cli(&data, &["token", "create", "--principal", "team-b"], &[]);
        let token_b = out_b.lines().find_map(|l| l.strip_prefix("token: ")).unwrap().to_owned();
        cli(
            &data,
            &["slot", "put", "openai-prod", "--profile", "openai", "--credential-env", "THE_SECRET"],
            &[("THE_SECRET", &secret)],
        );
        cli(
            &data,
            &["route", "put", "r1", "--principal", "team-a", "--model", MODEL, "--slot", "openai-prod", "--target", MODEL],
            &[],
        );
        let issuer_pem = cli(&data, &["issuer-key"], &[]);
        let store_bytes = std::fs::read(data.join("iop-cp.sqlite3")).unwrap();
        assert!(
            !store_bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "the store holds the credential sealed only"
        );
        assert!(!store_bytes.windows(token.len()).any(|w| w == token.as_bytes()));

        // The Control Plane, managed; no store watch and a long poll so that CLI mutations
        // stay unseen by the Edge until we want them seen (the "between projection and
        // dispatch" window).
        let ca = Ca::new("e2e CA");
        let mut cp = start_cp(&dir, &ca, 60_000, false).await;

        // Edge: Node transport with the pool, Control Plane connector, HTTP surface.
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let up = upstream(seen.clone()).await;
        let mut cfg = TransportConfig::new("127.0.0.1:0".parse().unwrap(), pki::edge_server_tls(&ca, "edge-1"));
        cfg.node_configs = vec![
            ("node-1".into(), node_config(up)),
            ("node-2".into(), node_config(up)),
            ("node-3".into(), node_config(up)),
        ];
        cfg.pool = Some(PoolConfig {
            models: vec![(MODEL.into(), vec![provider("node-1").key])],
            providers: vec![provider("node-1")],
            max_queue: 8,
        });
        let edge = bind(cfg).await.unwrap().0;
        let shutdown = CancellationToken::new();
        let control = ControlConnector::start(
            edge.clone(),
            ControlConfig {
                addresses: vec![cp.wire.clone()],
                server_name: "localhost".try_into().unwrap(),
                tls: pki::client_tls(&ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1"),
                edge_id: "edge-1".into(),
                managed: true,
                max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
                dialer: None,
                jitter_seed: None,
                binding: Default::default(),
            },
            shutdown.clone(),
        )
        .unwrap();
        let mut state = control.state();
        while *state.borrow_and_update() != SessionState::Connected {
            state.changed().await.unwrap();
        }
        let g0 = control.projection().unwrap().generation();

        // Two managed Nodes with their own recipient keys; both pin the CP's issuer key.
        let mut life = edge.subscribe();
        for (name, key_id) in [("node-1", "node-1-key"), ("node-2", "node-2-key")] {
            let opts = NodeOptions::new(
                name,
                &edge.local_addr().to_string(),
                "localhost",
                pki::node_client_tls(&ca, role::NODE, name, "edge-1"),
            )
            .unwrap()
            .with_adapters(AdapterRegistry::with_builtins())
            .with_credential_plane(recipient(&issuer_pem, key_id));
            tokio::spawn(run_node(opts, shutdown.clone()));
        }
        let mut ready = 0;
        while ready < 2 {
            if matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {
                ready += 1;
            }
        }
        // node-3 pins another issuer key than the Control Plane's: refused at registration,
        // never ready, never selected; the status view names the mismatch.
        let other = IssuerSigningKey::generate_derived().unwrap();
        let opts = NodeOptions::new(
            "node-3",
            &edge.local_addr().to_string(),
            "localhost",
            pki::node_client_tls(&ca, role::NODE, "node-3", "edge-1"),
        )
        .unwrap()
        .with_adapters(AdapterRegistry::with_builtins())
        .with_credential_plane(recipient(&other.public_key().to_pem(), "node-3-key"));
        tokio::spawn(run_node(opts, shutdown.clone()));
        tokio::time::timeout(Duration::from_secs(10), async {
            while edge.refused("node-3").is_none() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("node-3 is refused");
        let app = http::router(
            edge.clone(),
            HttpConfig {
                models: vec![MODEL.into()],
                queue_wait: Duration::from_secs(5),
                api_keys: None,
                limiter: None,
                usage: None,
                no_stream_usage: Default::default(),
                control: Some(control.clone()),
                body_timeout: http::DEFAULT_BODY_TIMEOUT,
                telemetry: Default::default(),
                no_trace_propagation: Default::default(),
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/v1", listener.local_addr().unwrap());
        tokio::spawn(http::serve(listener, app, std::future::pending()));
        let client = reqwest::Client::new();
        let body = serde_json::json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        let chat = |tok: &str| {
            client
                .post(format!("{base}/chat/completions"))
                .bearer_auth(tok)
                .json(&body)
                .send()
        };
        let mut error_bodies = String::new();

        // 1. The token works; the upstream receives exactly the slot's credential.
        let r = chat(&token).await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.text().await.unwrap().contains("\"hi\""));
        assert_eq!(seen.lock().unwrap().as_slice(), [format!("Bearer {secret}")]);

        // Unauthenticated, unknown token, and a principal without a route for the model.
        for (tok, want) in [("", 401), ("iop_nope", 401), (token_b.as_str(), 404)] {
            let r = chat(tok).await.unwrap();
            assert_eq!(r.status(), want, "token {tok:?}");
            error_bodies.push_str(&r.text().await.unwrap());
        }
        assert_eq!(seen.lock().unwrap().len(), 1, "refused requests never reach the upstream");

        // 2. A captured lease cannot be replayed; a lease sealed for node-1 is refused by node-2.
        let p = control.projection().unwrap();
        let route = p.route("team-a", MODEL).unwrap().clone();
        // The recipient keys the Nodes announced: node-1's, as the Edge learned it.
        let admission = edge.admit(MODEL, ContextSize::Standard, Duration::from_secs(5)).await.unwrap();
        let node1_key = admission.recipient().unwrap().clone();
        drop(admission);
        let binding = CredentialLeaseBinding {
            principal_id: "team-a".into(),
            slot_id: route.slot_id.clone(),
            route_id: route.route_id.clone(),
            profile: route.profile.clone(),
            upstream_target: route.upstream_target.clone(),
            node_id: "node-1".into(),
            recipient_key_id: node1_key.key_id.clone(),
            credential_revision: route.credential_revision,
            route_revision: route.route_revision,
            projection_generation: p.generation(),
        };
        let lease = control.acquire_lease(binding.clone(), node1_key.public_key).await.unwrap();
        let managed = ManagedCredential { lease, binding };
        let first = last_event(&edge, "node-1", tunnel_request("replay-1", Some(managed.clone()))).await;
        assert!(matches!(first, TunnelEvent::Frame(Delivery::End { .. })), "{first:?}");
        let replay = last_event(&edge, "node-1", tunnel_request("replay-2", Some(managed.clone()))).await;
        assert!(
            matches!(&replay, TunnelEvent::Frame(Delivery::Error { error, .. }) if error == "credential rejected: lease replayed"),
            "{replay:?}"
        );
        let foreign = last_event(&edge, "node-2", tunnel_request("foreign-1", Some(managed.clone()))).await;
        assert!(
            matches!(&foreign, TunnelEvent::Frame(Delivery::Error { error, .. }) if error.starts_with("credential rejected: ")),
            "{foreign:?}"
        );
        let missing = last_event(&edge, "node-1", tunnel_request("missing-1", None)).await;
        assert!(
            matches!(&missing, TunnelEvent::Frame(Delivery::Error { error, .. }) if error == "credential rejected: lease missing"),
            "{missing:?}"
        );
        assert_eq!(seen.lock().unwrap().len(), 2, "only the first use reached the upstream");

        // 3. Between projection and dispatch: the CLI rotates the slot; the Edge still holds
        // the old projection (this server does not watch the store and has not polled), so
        // its binding names a stale generation; the Control Plane re-reads and refuses. The
        // Edge waits for the newer projection, none comes, and it fails closed with 503 +
        // Retry-After (a change is propagating), never with the old credential.
        cli(
            &data,
            &["slot", "put", "openai-prod", "--profile", "openai", "--credential-env", "THE_SECRET"],
            &[("THE_SECRET", &secret2)],
        );
        assert_eq!(control.projection().unwrap().generation(), g0);
        let r = chat(&token).await.unwrap();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers().get("retry-after").unwrap(), "1");
        let text = r.text().await.unwrap();
        assert!(text.contains("applying a change"), "{text}");
        error_bodies.push_str(&text);
        // Revoking the token in that window fails closed the same way.
        cli(&data, &["token", "revoke", &token_id], &[]);
        let r = chat(&token).await.unwrap();
        assert_eq!(r.status(), 503);
        error_bodies.push_str(&r.text().await.unwrap());
        assert_eq!(seen.lock().unwrap().len(), 2, "nothing reached the upstream");

        // 4. An admin API mutation is pushed at once: the new projection drops the revoked
        // token (401 now), and a new token uses the rotated credential.
        let admin = reqwest::Client::new();
        let r: serde_json::Value = admin
            .post(format!("{}/admin/v1/tokens", cp.admin))
            .json(&serde_json::json!({"principal_id": "team-a"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let token2 = r["token"].as_str().unwrap().to_owned();
        wait_generation(&control, g0 + 2).await;
        assert_eq!(chat(&token).await.unwrap().status(), 401);
        let r = chat(&token2).await.unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap();
        assert_eq!(seen.lock().unwrap().last().unwrap(), &format!("Bearer {secret2}"));

        // 5. The status view over the Edge wire lists both Nodes, connected, with no secret.
        let status = admin
            .get(format!("{}/admin/v1/edges/edge-1/status", cp.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(status.contains("\"node-1\"") && status.contains("\"node-2\""), "{status}");
        let view: serde_json::Value = serde_json::from_str(&status).unwrap();
        let node3 = view["nodes"].as_array().unwrap().iter().find(|n| n["node_id"] == "node-3").unwrap();
        assert_eq!(node3["connected"], false, "{status}");
        let refused = node3["refused"].as_str().unwrap();
        assert!(
            refused.starts_with("issuer key not trusted") && refused.contains(other.key_id()),
            "{status}"
        );
        assert!(!edge.ready_nodes().iter().any(|(n, _)| n == "node-3"));
        let edges = admin.get(format!("{}/admin/v1/edges", cp.admin)).send().await.unwrap().text().await.unwrap();
        assert!(edges.contains("edge-1"));
        let metrics = client
            .get(base.replace("/v1", "/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();

        // 6. No secret anywhere we can see.
        shutdown.cancel();
        cp.child.start_kill().unwrap();
        let _ = cp.child.wait().await;
        let cp_logs = cp.logs.lock().unwrap().clone();
        let local_logs = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
        assert!(cp_logs.contains("cp_lease_refused"), "the CP logged the refusal");
        assert!(local_logs.contains("node_credential_rejected"), "the Node logged its refusals");
        assert!(local_logs.contains("edge_node_refused"), "the Edge logged node-3's refusal");
        for (what, text) in [
            ("control plane logs", &cp_logs),
            ("edge and node logs", &local_logs),
            ("metrics", &metrics),
            ("status view", &status),
            ("error bodies", &error_bodies),
        ] {
            for s in [&secret, &secret2, &token, &token2] {
                assert!(!text.contains(s.as_str()), "a secret leaked into the {what}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    })
    .await
    .expect("scenario finishes");
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).unwrap();
    u64::from_le_bytes(b)
}
