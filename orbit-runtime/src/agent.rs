//! The Edge Runtime agent: registers with a deployment token, then heartbeats, pulls desired
//! state with its current version, applies RuntimeConfigurations through an [`Applier`] and
//! reports the results. Every request after registration is signed ([`crate::signing`]).
//!
//! State directory (default `/var/lib/orbitmesh/edge-runtime`): `ed25519.key` (the 32-byte
//! private key seed, created on first start, mode 0600; never leaves the host) and
//! `state.json` (`installation_id`, `node_id`, `edge_runtime_id`, `applied_version`), so a
//! restart neither re-registers nor refetches nor re-applies what was applied. The applied
//! version is persisted only when every configuration of the version applied.
//!
//! [`Agent::tick`] is one heartbeat + pull (+ apply + report) cycle; [`Agent::run`] repeats it on
//! the server's heartbeat interval and retries failures with jittered exponential backoff.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use ed25519_dalek::SigningKey;
use iop_wire::backoff::{Backoff, Retries};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::server::{H_CURRENT_VERSION, RuntimeConfiguration};
use crate::signing::{Identity, sign};
use crate::versions::ApplyStatus;

/// The seed's default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/orbitmesh/edge-runtime";
/// Shortest retry delay.
pub const BACKOFF_MIN: Duration = Duration::from_millis(500);
/// Longest retry delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// Applies RuntimeConfigurations on the host (nginx, WireGuard, certificate files, …).
#[async_trait]
pub trait Applier: Send + Sync + 'static {
    /// Applies `configurations` of `version`; returns one status per configuration id.
    async fn apply(
        &self,
        version: u64,
        configurations: &[RuntimeConfiguration],
    ) -> Vec<(String, ApplyStatus)>;
}

/// Agent settings.
#[derive(Clone)]
pub struct AgentConfig {
    /// Control plane base URL (`http(s)://host:port`).
    pub control_plane_url: String,
    /// Enrolment token (used only to register).
    pub deployment_token: String,
    /// State directory.
    pub state_dir: PathBuf,
    /// Hash of the device fingerprint (never the fingerprint itself).
    pub device_fingerprint_hash: String,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("control_plane_url", &self.control_plane_url)
            .field("state_dir", &self.state_dir)
            .finish_non_exhaustive()
    }
}

/// Why a cycle failed (no secrets, no server text).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// The state directory or key could not be read or written.
    #[error("state directory: {0}")]
    State(String),
    /// The control plane could not be reached.
    #[error("control plane unreachable")]
    Unreachable,
    /// The control plane answered with this status.
    #[error("control plane answered {0}")]
    Status(u16),
    /// The answer was not the expected JSON.
    #[error("malformed answer")]
    Malformed,
}

/// The persisted state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedState {
    /// Chosen once, on first start.
    pub installation_id: String,
    /// From register.
    pub node_id: Option<String>,
    /// From register.
    pub edge_runtime_id: Option<String>,
    /// The last version whose every configuration applied.
    pub applied_version: u64,
}

/// What one cycle did with the desired state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pulled {
    /// `304`: nothing new.
    NotModified,
    /// A version was applied completely and reported.
    Applied(u64),
    /// A version failed (some configuration not applied) and was reported.
    Failed(u64),
}

/// The agent.
#[derive(Debug)]
pub struct Agent {
    config: AgentConfig,
    key: SigningKey,
    state: PersistedState,
    client: reqwest::Client,
    heartbeat: Duration,
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let mut f = opts.open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

fn unix_now() -> i64 {
    iop_wire::time::unix_secs(std::time::SystemTime::now())
}

fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Agent {
    /// Loads or creates the key and state in `config.state_dir`.
    pub fn open(config: AgentConfig) -> Result<Self, AgentError> {
        let st = |e: std::io::Error| AgentError::State(e.kind().to_string());
        std::fs::create_dir_all(&config.state_dir).map_err(st)?;
        let key_path = config.state_dir.join("ed25519.key");
        let key = match std::fs::read(&key_path) {
            Ok(raw) => {
                let seed: [u8; 32] = raw
                    .as_slice()
                    .try_into()
                    .map_err(|_| AgentError::State("ed25519.key is not 32 bytes".into()))?;
                SigningKey::from_bytes(&seed)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut seed = [0u8; 32];
                ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut seed)
                    .map_err(|_| AgentError::State("random generator failed".into()))?;
                write_private(&key_path, &seed).map_err(st)?;
                SigningKey::from_bytes(&seed)
            }
            Err(e) => return Err(st(e)),
        };
        let state_path = config.state_dir.join("state.json");
        let state = match std::fs::read(&state_path) {
            Ok(raw) => serde_json::from_slice(&raw)
                .map_err(|_| AgentError::State("state.json is not valid".into()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let s = PersistedState {
                    installation_id: format!("inst-{}", random_hex(8)),
                    ..PersistedState::default()
                };
                write_private(&state_path, &serde_json::to_vec(&s).unwrap_or_default())
                    .map_err(st)?;
                s
            }
            Err(e) => return Err(st(e)),
        };
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|_| AgentError::State("http client".into()))?;
        Ok(Self {
            config,
            key,
            state,
            client,
            heartbeat: crate::server::DEFAULT_HEARTBEAT,
        })
    }

    /// The persisted state.
    pub fn state(&self) -> &PersistedState {
        &self.state
    }

    /// The public key (base64), as registered.
    pub fn public_key(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.key.verifying_key().to_bytes())
    }

    fn persist(&self) -> Result<(), AgentError> {
        let bytes =
            serde_json::to_vec(&self.state).map_err(|_| AgentError::State("encode".into()))?;
        write_private(&self.config.state_dir.join("state.json"), &bytes)
            .map_err(|e| AgentError::State(e.kind().to_string()))
    }

    fn identity(&self) -> Option<Identity> {
        Some(Identity {
            node_id: self.state.node_id.clone()?,
            edge_runtime_id: self.state.edge_runtime_id.clone()?,
            installation_id: self.state.installation_id.clone(),
        })
    }

    /// Registers (or refreshes the registration) with the deployment token.
    pub async fn register(&mut self, reported_address: Option<IpAddr>) -> Result<(), AgentError> {
        let body = json!({
            "installation_id": self.state.installation_id,
            "public_key": self.public_key(),
            "device_fingerprint_hash": self.config.device_fingerprint_hash,
            "reported_address": reported_address.map(|a| a.to_string()),
        });
        let r = self
            .client
            .post(format!(
                "{}/api/v1/edge-runtime/register",
                self.config.control_plane_url
            ))
            .bearer_auth(&self.config.deployment_token)
            .json(&body)
            .send()
            .await
            .map_err(|_| AgentError::Unreachable)?;
        if !r.status().is_success() {
            return Err(AgentError::Status(r.status().as_u16()));
        }
        let v: serde_json::Value = r.json().await.map_err(|_| AgentError::Malformed)?;
        let (Some(node), Some(er)) = (v["node_id"].as_str(), v["edge_runtime_id"].as_str()) else {
            return Err(AgentError::Malformed);
        };
        self.state.node_id = Some(node.to_owned());
        self.state.edge_runtime_id = Some(er.to_owned());
        if let Some(s) = v["heartbeat_interval_seconds"].as_u64().filter(|s| *s > 0) {
            self.heartbeat = Duration::from_secs(s);
        }
        self.persist()
    }

    async fn signed(
        &self,
        method: reqwest::Method,
        target: &str,
        body: Vec<u8>,
        extra: Option<(&str, String)>,
    ) -> Result<reqwest::Response, AgentError> {
        let identity = self.identity().ok_or(AgentError::Status(401))?;
        let headers = sign(
            &self.key,
            &identity,
            method.as_str(),
            target,
            &body,
            unix_now(),
            &random_hex(16),
        );
        let mut req = self
            .client
            .request(method, format!("{}{target}", self.config.control_plane_url))
            .body(body);
        for (name, value) in headers.to_pairs() {
            req = req.header(name, value);
        }
        if let Some((name, value)) = extra {
            req = req.header(name, value);
        }
        req.header("content-type", "application/json")
            .send()
            .await
            .map_err(|_| AgentError::Unreachable)
    }

    /// One heartbeat, carrying `reported_address` when known.
    pub async fn heartbeat(&self, reported_address: Option<IpAddr>) -> Result<(), AgentError> {
        let body = serde_json::to_vec(
            &json!({ "reported_address": reported_address.map(|a| a.to_string()) }),
        )
        .unwrap_or_default();
        let r = self
            .signed(
                reqwest::Method::POST,
                "/api/v1/edge-runtime/heartbeat",
                body,
                None,
            )
            .await?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(AgentError::Status(r.status().as_u16()))
        }
    }

    /// Pulls desired state; applies and reports a new version.
    pub async fn pull(&mut self, applier: &dyn Applier) -> Result<Pulled, AgentError> {
        let current = self.state.applied_version.to_string();
        let r = self
            .signed(
                reqwest::Method::GET,
                "/api/v1/edge-runtime/desired-state",
                Vec::new(),
                Some((H_CURRENT_VERSION, current)),
            )
            .await?;
        if r.status() == reqwest::StatusCode::NOT_MODIFIED {
            return Ok(Pulled::NotModified);
        }
        if !r.status().is_success() {
            return Err(AgentError::Status(r.status().as_u16()));
        }
        #[derive(Deserialize)]
        struct Desired {
            version: u64,
            configurations: Vec<RuntimeConfiguration>,
        }
        let d: Desired = r.json().await.map_err(|_| AgentError::Malformed)?;
        let results = applier.apply(d.version, &d.configurations).await;
        let all_applied = d.configurations.iter().all(|c| {
            results
                .iter()
                .any(|(id, s)| *id == c.id && *s == ApplyStatus::Applied)
        });
        let body = serde_json::to_vec(&json!({
            "version": d.version,
            "results": results.iter().map(|(id, s)| json!({"configuration_id": id, "status": s.as_str()})).collect::<Vec<_>>(),
        }))
        .unwrap_or_default();
        let r = self
            .signed(
                reqwest::Method::POST,
                "/api/v1/edge-runtime/apply-result",
                body,
                None,
            )
            .await?;
        if !r.status().is_success() {
            return Err(AgentError::Status(r.status().as_u16()));
        }
        if all_applied {
            self.state.applied_version = d.version;
            self.persist()?;
            Ok(Pulled::Applied(d.version))
        } else {
            Ok(Pulled::Failed(d.version))
        }
    }

    /// Submits a CSR (PEM) for this Node's endpoints; writes the issued chain to `out` (mode
    /// 0600) for the runtime adapters, and returns the certificate id.
    pub async fn request_certificate(
        &self,
        csr_pem: &str,
        out: &Path,
    ) -> Result<String, AgentError> {
        let body = serde_json::to_vec(&json!({ "csr": csr_pem })).unwrap_or_default();
        let r = self
            .signed(
                reqwest::Method::POST,
                "/api/v1/edge-runtime/certificates/csr",
                body,
                None,
            )
            .await?;
        if !r.status().is_success() {
            return Err(AgentError::Status(r.status().as_u16()));
        }
        let v: serde_json::Value = r.json().await.map_err(|_| AgentError::Malformed)?;
        let (Some(id), Some(chain)) = (v["certificate_id"].as_str(), v["chain_pem"].as_str())
        else {
            return Err(AgentError::Malformed);
        };
        write_private(out, chain.as_bytes())
            .map_err(|e| AgentError::State(e.kind().to_string()))?;
        Ok(id.to_owned())
    }

    /// The certificate metadata the control plane holds for this Node.
    pub async fn certificates(&self) -> Result<serde_json::Value, AgentError> {
        let r = self
            .signed(
                reqwest::Method::GET,
                "/api/v1/edge-runtime/certificates",
                Vec::new(),
                None,
            )
            .await?;
        if !r.status().is_success() {
            return Err(AgentError::Status(r.status().as_u16()));
        }
        r.json().await.map_err(|_| AgentError::Malformed)
    }

    /// One cycle: register if needed, heartbeat, pull.
    pub async fn tick(
        &mut self,
        applier: &dyn Applier,
        reported_address: Option<IpAddr>,
    ) -> Result<Pulled, AgentError> {
        if self.state.node_id.is_none() {
            self.register(reported_address).await?;
        }
        self.heartbeat(reported_address).await?;
        self.pull(applier).await
    }

    /// Runs cycles every heartbeat interval until `shutdown`; failures back off with jitter.
    pub async fn run(
        mut self,
        applier: &dyn Applier,
        reported_address: tokio::sync::watch::Receiver<Option<IpAddr>>,
        shutdown: impl Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut retries = Retries::new(
            Backoff::exponential(BACKOFF_MIN, BACKOFF_MAX)
                .with_jitter(0.5)
                .unwrap_or(Backoff::exponential(BACKOFF_MIN, BACKOFF_MAX)),
        );
        loop {
            let addr = *reported_address.borrow();
            let wait = match self.tick(applier, addr).await {
                Ok(_) => {
                    retries.reset();
                    self.heartbeat
                }
                Err(e) => {
                    tracing::warn!(target: "orbit_runtime", event = "orbit_agent_cycle_failed", error = %e, "agent cycle failed");
                    let mut b = [0u8; 4];
                    let _ =
                        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
                    retries.next_delay(u32::from_le_bytes(b))
                }
            };
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}
