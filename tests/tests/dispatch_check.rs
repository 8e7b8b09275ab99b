//! Seed 001's check right before Node dispatch, end to end over real sockets: an HTTP client
//! with a token → the managed Edge (projection auth, route, pool admission, lease acquisition,
//! the check) → a real Node that opens the lease and injects the credential → a local upstream
//! that records the `authorization` header it receives; the Control Plane is `iop-cp`'s real
//! server, lease service and SQLite store, in process.
//!
//! The window between a lease's grant and its dispatch is made deterministic with a store
//! wrapper ([`Gate`]): when armed, the lease service's read of the store returns only after
//! the test has committed a mutation through the Control Plane's admin API and the Edge holds
//! the projection that mutation produced. So the lease is granted for the binding's (now
//! older) generation, and the Edge's check sees the newer projection before dispatching:
//!
//! - a change that leaves the binding as it was (another token created): dispatched, 200, with
//!   the credential the lease carried;
//! - the slot rotated (its credential revision moves): the old lease is never dispatched; the
//!   request is bound again under the new projection and the upstream sees only the rotated
//!   credential;
//! - the token revoked: 403 `access to this model was withdrawn`, nothing reaches the upstream;
//! - the token revoked with a stale wait of zero (no time left to bind again): 403
//!   `credentials changed; request refused`, nothing reaches the upstream.
//!
//! Does it catch a bug? With the check right before dispatch removed (`handle_lease`
//! dispatching every granted lease; made, run, reverted), the rotation case sent the old
//! credential and the revocation cases answered 200.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test scaffolding: failed setup should panic"
)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use iop_cp::admin::Admin;
use iop_cp::lease::{DEFAULT_LEASE_TTL, LeaseService};
use iop_cp::seal::MasterKey;
use iop_cp::server::{self, ServerConfig};
use iop_cp::store::{
    IssuerKey, LeaseView, Mutation, Revision, Snapshot, SqliteStore, Store, StoreError,
};
use iop_edge::control::{BindingConfig, ControlConfig, ControlConnector, SessionState};
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{Lifecycle, TransportConfig, bind};
use iop_lease::{OpenPolicy, Recipient, RecipientSecretKey, TrustedIssuers};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_tests::pki::{self, Ca};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, NodeConfigPayload,
    OpenAiCompatSettings, Operation,
};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use workload_identity::role;

const LIMIT: Duration = Duration::from_secs(60);
const MODEL: &str = "gpt-4o-mini";
const SECRET: &str = "sk-dispatch-check-first";
const ROTATED: &str = "sk-dispatch-check-rotated";

/// A lease read in progress, held by an armed [`Gate`]: `read` tells the test the read is
/// done, `resume` lets it return.
struct Held {
    read: oneshot::Sender<()>,
    resume: oneshot::Receiver<()>,
}

/// The SQLite store, with a lease read that can be held open once.
struct Gate {
    inner: SqliteStore,
    armed: Mutex<Option<Held>>,
}

impl Gate {
    /// The next lease read returns only when the returned sender fires (or is dropped); the
    /// receiver fires when that read is done.
    fn arm(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (read_tx, read_rx) = oneshot::channel();
        let (resume_tx, resume_rx) = oneshot::channel();
        *self.armed.lock().unwrap() = Some(Held {
            read: read_tx,
            resume: resume_rx,
        });
        (read_rx, resume_tx)
    }
}

#[async_trait]
impl Store for Gate {
    async fn apply(&self, mutation: Mutation) -> Result<u64, StoreError> {
        self.inner.apply(mutation).await
    }
    async fn generation(&self) -> Result<u64, StoreError> {
        self.inner.generation().await
    }
    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        self.inner.snapshot().await
    }
    async fn lease_view(&self, route_id: &str, slot_id: &str) -> Result<LeaseView, StoreError> {
        let view = self.inner.lease_view(route_id, slot_id).await;
        let held = self.armed.lock().unwrap().take();
        if let Some(Held { read, resume }) = held {
            let _ = read.send(());
            let _ = resume.await;
        }
        view
    }
    async fn issuer_keys(&self) -> Result<Vec<IssuerKey>, StoreError> {
        self.inner.issuer_keys().await
    }
    async fn revisions(
        &self,
        after_generation: u64,
        limit: u32,
    ) -> Result<Vec<Revision>, StoreError> {
        self.inner.revisions(after_generation, limit).await
    }
    async fn record_usage(
        &self,
        edge_id: &str,
        records: &[iop_cp::store::UsageRecord],
    ) -> Result<iop_cp::store::UsageStored, StoreError> {
        self.inner.record_usage(edge_id, records).await
    }
    async fn usage_daily(
        &self,
        since: Option<&str>,
        limit: u32,
    ) -> Result<Vec<iop_cp::store::DailyUsage>, StoreError> {
        self.inner.usage_daily(since, limit).await
    }
    async fn prune_usage(&self, before_unix_ms: i64) -> Result<u64, StoreError> {
        self.inner.prune_usage(before_unix_ms).await
    }
    async fn wait_change(&self, limit: Duration) {
        self.inner.wait_change(limit).await;
    }
}

/// An OpenAI-compatible upstream that records the `authorization` header of each call.
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
                    .header("content-type", "application/json")
                    .body(axum::body::Body::from(
                        "{\"id\":\"x\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\
                         \"message\":{\"role\":\"assistant\",\"content\":\"hi\"},\
                         \"finish_reason\":\"stop\"}]}",
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

fn provider() -> ProviderSpec {
    ProviderSpec {
        key: ProviderKey {
            node_id: "node-1".into(),
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

/// The mesh: the Control Plane over a [`Gate`] store, a managed Edge with its HTTP surface,
/// one Node, the upstream.
struct Mesh {
    gate: Arc<Gate>,
    admin: Admin,
    control: ControlConnector,
    base: String,
    token: String,
    token_id: String,
    seen: Arc<Mutex<Vec<String>>>,
    shutdown: CancellationToken,
}

async fn mesh(stale_wait: Duration) -> Mesh {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = Ca::new("dispatch check CA");
    let gate = Arc::new(Gate {
        inner: SqliteStore::in_memory().unwrap(),
        armed: Mutex::new(None),
    });
    let store: Arc<dyn Store> = gate.clone();
    let master = Arc::new(MasterKey::generate().unwrap().0);
    let admin = Admin::new(
        store.clone(),
        master.clone(),
        store.generation().await.unwrap(),
    );
    let issuer = admin
        .ensure_issuer_key(|| Ok(iop_lease::IssuerSigningKey::generate_derived().unwrap()))
        .await
        .unwrap();
    admin.create_principal("team-a", "Team A").await.unwrap();
    let token = admin.create_token("team-a").await.unwrap();
    admin
        .put_slot(
            "slot-1",
            "openai",
            "authorization",
            "Bearer ",
            SECRET.as_bytes(),
        )
        .await
        .unwrap();
    admin
        .put_route("r1", "team-a", MODEL, "slot-1", MODEL, "")
        .await
        .unwrap();
    let leases = Arc::new(LeaseService::new(store, master, DEFAULT_LEASE_TTL));
    let tls = pki::server_tls(&ca, role::CONTROL_PLANE, "cp-1", role::EDGE);
    let config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), tls, true);
    let (cp, _task) = server::serve(config, admin.clone(), Some(leases))
        .await
        .unwrap();

    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let up = upstream(seen.clone()).await;
    let mut cfg = TransportConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        pki::edge_server_tls(&ca, "edge-1"),
    );
    cfg.node_configs = vec![("node-1".into(), node_config(up))];
    cfg.pool = Some(PoolConfig {
        models: vec![(MODEL.into(), vec![provider().key])],
        providers: vec![provider()],
        max_queue: 8,
    });
    let edge = bind(cfg).await.unwrap().0;
    let shutdown = CancellationToken::new();
    let control = ControlConnector::start(
        edge.clone(),
        ControlConfig {
            addresses: vec![cp.local_addr().to_string()],
            server_name: "localhost".try_into().unwrap(),
            tls: pki::client_tls(&ca, role::EDGE, "edge-1", role::CONTROL_PLANE, "cp-1"),
            edge_id: "edge-1".into(),
            managed: true,
            max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
            dialer: None,
            jitter_seed: None,
            binding: BindingConfig::with_stale_wait(stale_wait),
        },
        shutdown.clone(),
    )
    .unwrap();
    let mut state = control.state();
    while *state.borrow_and_update() != SessionState::Connected {
        state.changed().await.unwrap();
    }
    let mut life = edge.subscribe();
    let trusted: TrustedIssuers = [issuer.public_key()].into_iter().collect();
    let recipient = Recipient::new(
        RecipientSecretKey::generate("node-1-key").unwrap(),
        trusted,
        OpenPolicy::default(),
    );
    let opts = NodeOptions::new(
        "node-1",
        &edge.local_addr().to_string(),
        "localhost",
        pki::node_client_tls(&ca, role::NODE, "node-1", "edge-1"),
    )
    .unwrap()
    .with_adapters(AdapterRegistry::with_builtins())
    .with_credential_plane(recipient);
    tokio::spawn(run_node(opts, shutdown.clone()));
    while !matches!(life.recv().await.unwrap(), Lifecycle::Connected { .. }) {}
    let mut http_config = HttpConfig::new(vec![MODEL.into()], Duration::from_secs(5));
    http_config.control = Some(control.clone());
    let app = http::router(edge.clone(), http_config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(http::serve(listener, app, std::future::pending()));
    Mesh {
        gate,
        admin,
        control,
        base,
        token: token.token.to_string(),
        token_id: token.token_id,
        seen,
        shutdown,
    }
}

impl Mesh {
    fn generation(&self) -> u64 {
        self.control.projection().unwrap().generation()
    }

    async fn chat(&self) -> (u16, String) {
        let r = reqwest::Client::new()
            .post(format!("{}/chat/completions", self.base))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// One request whose lease is granted for the projection it was bound under, while
    /// `change` (an admin mutation) has already reached the Edge.
    async fn chat_across<F, Fut>(&self, change: F) -> (u16, String)
    where
        F: FnOnce(Admin) -> Fut,
        Fut: Future<Output = ()>,
    {
        let before = self.generation();
        let (read, resume) = self.gate.arm();
        let request = self.chat();
        tokio::pin!(request);
        // Drive the request until the lease service has read the store.
        tokio::select! {
            r = &mut request => panic!("answered before its lease was read: {r:?}"),
            r = read => r.unwrap(),
        }
        let (answer, ()) = tokio::join!(&mut request, async {
            change(self.admin.clone()).await;
            while self.generation() <= before {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            resume.send(()).unwrap();
        });
        answer
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_right_before_dispatch_sees_changes_made_after_the_grant() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh(BindingConfig::default().stale_wait).await;
        let (status, body) = m.chat().await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            m.seen.lock().unwrap().as_slice(),
            [format!("Bearer {SECRET}")]
        );

        // Another token: the binding is as it was, so the granted lease is dispatched.
        let (status, body) = m
            .chat_across(|admin| async move {
                admin.create_token("team-a").await.unwrap();
            })
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(m.seen.lock().unwrap().len(), 2);
        assert_eq!(m.seen.lock().unwrap()[1], format!("Bearer {SECRET}"));

        // The slot rotated: the lease for the old credential is never dispatched; the request
        // is bound again and the upstream sees only the rotated one.
        let (status, body) = m
            .chat_across(|admin| async move {
                admin
                    .put_slot(
                        "slot-1",
                        "openai",
                        "authorization",
                        "Bearer ",
                        ROTATED.as_bytes(),
                    )
                    .await
                    .unwrap();
            })
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            m.seen.lock().unwrap()[2..],
            [format!("Bearer {ROTATED}")],
            "one call, with the rotated credential"
        );

        // The token revoked: refused, nothing reaches the upstream.
        let token_id = m.token_id.clone();
        let (status, body) = m
            .chat_across(|admin| async move {
                admin.revoke_token(&token_id).await.unwrap();
            })
            .await;
        assert_eq!(status, 403, "{body}");
        assert!(
            body.contains("access to this model was withdrawn"),
            "{body}"
        );
        assert_eq!(m.seen.lock().unwrap().len(), 3);
        assert!(!body.contains(&m.token), "no token in the error");
        m.shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_time_left_to_bind_again_a_changed_binding_fails_closed() {
    tokio::time::timeout(LIMIT, async {
        let m = mesh(Duration::ZERO).await;
        let token_id = m.token_id.clone();
        let (status, body) = m
            .chat_across(|admin| async move {
                admin.revoke_token(&token_id).await.unwrap();
            })
            .await;
        assert_eq!(status, 403, "{body}");
        assert!(
            body.contains("credentials changed; request refused"),
            "{body}"
        );
        assert!(
            m.seen.lock().unwrap().is_empty(),
            "nothing reached the upstream"
        );
        m.shutdown.cancel();
    })
    .await
    .expect("scenario finishes");
}
