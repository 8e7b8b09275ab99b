//! `iop-edge`: the IOP Edge as a standalone service — the Node listener (mTLS), the provider
//! pool, the OpenAI-compatible HTTP surface and, optionally, the Control Plane connector
//! (managed credential plane included).
//!
//! ```text
//! iop-edge --config edge.toml
//! iop-edge --check-config --config edge.toml
//! ```
//!
//! ```toml
//! edge_id = "edge-1"                 # the name in the Edge's workload certificate
//!
//! [listen]
//! nodes = "0.0.0.0:7443"             # Node wire (mTLS)
//! http = "127.0.0.1:8080"            # OpenAI-compatible surface
//!
//! [tls]
//! trust_domain = "iop.local"
//! ca = "/etc/iop/ca.pem"             # workload CA (verifies Nodes and the Control Plane)
//! cert = "/etc/iop/edge.pem"         # URI SAN spiffe://<td>/edge/<edge_id>
//! key = "/etc/iop/edge.key"
//!
//! [pool]
//! queue_wait_sec = 30
//! max_queue = 256
//!
//! [[nodes]]
//! node_id = "node-1"
//! [[nodes.adapters]]
//! name = "openai"
//! type = "openai_compat"             # or "ollama", "demo"
//! base_url = "https://api.openai.com/v1"
//! capacity = 8
//! targets = ["gpt-4o-mini"]
//!
//! [[models]]
//! name = "gpt-4o-mini"               # what clients ask for
//! [[models.providers]]
//! node_id = "node-1"
//! provider_id = "openai-mini"
//! adapter = "openai"
//! target = "gpt-4o-mini"
//! capacity = 8
//! response_stall_timeout_sec = 300
//!
//! [control_plane]                    # optional
//! address = "cp.internal:7600"
//! server_name = "cp.internal"
//! name = "cp-1"                      # spiffe://<td>/control-plane/<name>
//! credential_plane = true            # managed mode: projection auth and leases
//! ```
//!
//! Unknown keys are errors; every error names its key. Exit codes: 0 clean stop (Ctrl-C or
//! SIGTERM), 1 runtime failure, 2 invalid configuration.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a CLI prints its status"
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use iop_edge::control::{ControlConfig, ControlConnector};
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{TransportConfig, bind};
use iop_wire::identity::{self, ExpectedPeer, role};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, NativeSettings, NodeConfigPayload,
    OpenAiCompatSettings, Operation,
};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(
    name = "iop-edge",
    version,
    about = "IOP Edge: Node listener, provider pool, OpenAI-compatible API, Control Plane connector"
)]
struct Cli {
    /// Configuration file (TOML; see the crate docs of `iop-edge`'s binary for the keys).
    #[arg(long)]
    config: PathBuf,
    /// Validate the configuration and exit.
    #[arg(long)]
    check_config: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    edge_id: String,
    listen: Listen,
    tls: Tls,
    #[serde(default)]
    pool: Pool,
    #[serde(default)]
    nodes: Vec<Node>,
    #[serde(default)]
    models: Vec<Model>,
    control_plane: Option<ControlPlane>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Listen {
    nodes: SocketAddr,
    http: SocketAddr,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Tls {
    trust_domain: String,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pool {
    #[serde(default = "default_wait")]
    queue_wait_sec: u64,
    #[serde(default = "default_queue")]
    max_queue: usize,
}

impl Default for Pool {
    fn default() -> Self {
        Self {
            queue_wait_sec: default_wait(),
            max_queue: default_queue(),
        }
    }
}

fn default_wait() -> u64 {
    30
}

fn default_queue() -> usize {
    256
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Node {
    node_id: String,
    #[serde(default)]
    adapters: Vec<Adapter>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Adapter {
    name: String,
    #[serde(rename = "type")]
    adapter_type: String,
    #[serde(default)]
    base_url: String,
    #[serde(default = "one")]
    capacity: u32,
    #[serde(default)]
    long_context_capacity: u32,
    #[serde(default)]
    targets: Vec<String>,
    #[serde(default)]
    request_timeout_sec: u32,
    #[serde(default = "profile")]
    profile: String,
}

fn one() -> u32 {
    1
}

fn profile() -> String {
    "openai".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Model {
    name: String,
    providers: Vec<Provider>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Provider {
    node_id: String,
    provider_id: String,
    adapter: String,
    target: String,
    #[serde(default = "one")]
    capacity: u32,
    #[serde(default)]
    long_context_capacity: u32,
    #[serde(default = "stall")]
    response_stall_timeout_sec: u64,
}

fn stall() -> u64 {
    300
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ControlPlane {
    address: String,
    server_name: String,
    name: String,
    #[serde(default)]
    credential_plane: bool,
}

struct Built {
    transport: TransportConfig,
    http_listen: SocketAddr,
    http: HttpConfig,
    control: Option<ControlConfig>,
}

fn bad(key: &str, msg: impl std::fmt::Display) -> String {
    format!("{key}: {msg}")
}

fn build(file: File) -> Result<Built, String> {
    let read = |key: &str, p: &PathBuf| {
        std::fs::read(p).map_err(|e| bad(key, format!("cannot read {}: {e}", p.display())))
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&read("tls.ca", &file.tls.ca)?) {
        roots
            .add(c.map_err(|_| bad("tls.ca", "not a PEM bundle"))?)
            .map_err(|_| bad("tls.ca", "invalid CA certificate"))?;
    }
    let roots = Arc::new(roots);
    let chain = CertificateDer::pem_slice_iter(&read("tls.cert", &file.tls.cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| bad("tls.cert", "not a PEM chain"))?;
    let key_pem = read("tls.key", &file.tls.key)?;
    let key = || {
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| bad("tls.key", "no PEM private key"))
    };
    let leaf = chain
        .first()
        .ok_or_else(|| bad("tls.cert", "no certificate"))?;
    let own = identity::WorkloadId::from_certificate(leaf).map_err(|e| bad("tls.cert", e))?;
    if own.role() != role::EDGE || own.name() != file.edge_id {
        return Err(bad(
            "tls.cert",
            format!(
                "identity {own} is not role `edge` with name `{}` (edge_id)",
                file.edge_id
            ),
        ));
    }
    let node_verifier = identity::client_cert_verifier(
        roots.clone(),
        ExpectedPeer::any_name(&file.tls.trust_domain, role::NODE)
            .map_err(|e| bad("tls.trust_domain", e))?,
    )
    .map_err(|e| bad("tls.ca", e))?;
    let server_tls = identity::server_config(chain.clone(), key()?, node_verifier)
        .map_err(|e| bad("tls.key", e))?;

    let mut node_configs = Vec::new();
    let mut kinds = std::collections::HashMap::new();
    for n in &file.nodes {
        let mut adapters = Vec::new();
        for a in &n.adapters {
            let (settings, kind) = match a.adapter_type.as_str() {
                "openai_compat" => (
                    AdapterSettings::OpenAiCompat(OpenAiCompatSettings {
                        base_url: a.base_url.clone(),
                        protocol_profile: ConcreteProtocolProfile {
                            name: a.profile.clone(),
                            operation_paths: [
                                (Operation::Models, "/models"),
                                (Operation::ChatCompletions, "/chat/completions"),
                                (Operation::Responses, "/responses"),
                                (Operation::Messages, "/messages"),
                                (Operation::CountTokens, "/messages/count_tokens"),
                            ]
                            .into_iter()
                            .map(|(op, p)| (op, p.to_owned()))
                            .collect(),
                            health_path: "/models".into(),
                        },
                        request_timeout_sec: a.request_timeout_sec,
                    }),
                    ProviderKind::OpenAiCompat,
                ),
                "ollama" | "demo" => (
                    AdapterSettings::Native(NativeSettings {
                        base_url: a.base_url.clone(),
                        options: Default::default(),
                    }),
                    ProviderKind::Native,
                ),
                _ => {
                    return Err(bad(
                        "nodes.adapters.type",
                        "must be openai_compat, ollama or demo",
                    ));
                }
            };
            kinds.insert(
                (n.node_id.clone(), a.name.clone()),
                (kind, a.adapter_type.clone()),
            );
            adapters.push(AdapterConfig {
                name: a.name.clone(),
                adapter_type: a.adapter_type.clone(),
                enabled: true,
                capacity: a.capacity,
                long_context_capacity: a.long_context_capacity,
                targets: a.targets.clone(),
                settings,
            });
        }
        node_configs.push((
            n.node_id.clone(),
            NodeConfigPayload {
                adapters,
                ..Default::default()
            },
        ));
    }
    let mut providers = Vec::new();
    let mut models = Vec::new();
    for m in &file.models {
        let mut keys = Vec::new();
        for p in &m.providers {
            let Some((kind, adapter_type)) = kinds.get(&(p.node_id.clone(), p.adapter.clone()))
            else {
                return Err(bad(
                    "models.providers.adapter",
                    format!("no adapter `{}` on node `{}`", p.adapter, p.node_id),
                ));
            };
            let key = ProviderKey {
                node_id: p.node_id.clone(),
                provider_id: p.provider_id.clone(),
            };
            keys.push(key.clone());
            providers.push(ProviderSpec {
                key,
                adapter: p.adapter.clone(),
                target: p.target.clone(),
                kind: *kind,
                category: if adapter_type == "openai_compat" {
                    "api".into()
                } else {
                    "local_inference".into()
                },
                capacity: p.capacity,
                long_context_capacity: p.long_context_capacity,
                response_stall_timeout: Duration::from_secs(p.response_stall_timeout_sec.max(1)),
                enabled: true,
            });
        }
        models.push((m.name.clone(), keys));
    }
    let mut transport = TransportConfig::new(file.listen.nodes, Arc::new(server_tls));
    transport.node_configs = node_configs;
    transport.pool = Some(PoolConfig {
        models: models.clone(),
        providers,
        max_queue: file.pool.max_queue,
    });
    let control = match &file.control_plane {
        None => None,
        Some(cp) => {
            let verifier = identity::server_cert_verifier(
                roots,
                ExpectedPeer::exact(&file.tls.trust_domain, role::CONTROL_PLANE, &cp.name)
                    .map_err(|e| bad("control_plane.name", e))?,
            )
            .map_err(|e| bad("tls.ca", e))?;
            let tls =
                identity::client_config(chain, key()?, verifier).map_err(|e| bad("tls.key", e))?;
            Some(ControlConfig {
                address: cp.address.clone(),
                server_name: rustls_pki_types::ServerName::try_from(cp.server_name.clone())
                    .map_err(|_| bad("control_plane.server_name", "not a DNS name or IP"))?,
                tls: Arc::new(tls),
                edge_id: file.edge_id.clone(),
                managed: cp.credential_plane,
                max_frame_len: iop_wire::codec::DEFAULT_MAX_FRAME_LEN,
            })
        }
    };
    Ok(Built {
        transport,
        http_listen: file.listen.http,
        http: HttpConfig {
            models: models.into_iter().map(|(m, _)| m).collect(),
            queue_wait: Duration::from_secs(file.pool.queue_wait_sec),
            auth: None,
            control: None,
        },
        control,
    })
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let shutdown = iop_bins::shutdown_signal();
    let text = std::fs::read_to_string(&cli.config).unwrap_or_else(|e| {
        eprintln!("iop-edge: {}: {e}", cli.config.display());
        std::process::exit(2);
    });
    let file: File = toml::from_str(&text).unwrap_or_else(|e| {
        eprintln!("iop-edge: {}: {e}", cli.config.display());
        std::process::exit(2);
    });
    let built = build(file).unwrap_or_else(|e| {
        eprintln!("iop-edge: {}: {e}", cli.config.display());
        std::process::exit(2);
    });
    if cli.check_config {
        println!("iop-edge: configuration valid");
        return;
    }
    let Built {
        transport,
        http_listen,
        mut http,
        control,
    } = built;
    let (edge, _accept) = bind(transport).await.unwrap_or_else(|e| {
        eprintln!("iop-edge: node listener: {e}");
        std::process::exit(1);
    });
    let stop = CancellationToken::new();
    if let Some(c) = control {
        match ControlConnector::start(edge.clone(), c, stop.clone()) {
            Ok(connector) => http.control = Some(connector),
            Err(e) => {
                eprintln!("iop-edge: control_plane: {e}");
                std::process::exit(2);
            }
        }
    }
    let listener = tokio::net::TcpListener::bind(http_listen)
        .await
        .unwrap_or_else(|e| {
            eprintln!("iop-edge: http listener {http_listen}: {e}");
            std::process::exit(1);
        });
    println!("iop-edge: nodes on {}", edge.local_addr());
    println!(
        "iop-edge: OpenAI-compatible API on http://{}/v1",
        listener.local_addr().map_or(http_listen, |a| a)
    );
    let app = http::router(edge, http);
    if let Err(e) = http::serve(listener, app, shutdown).await {
        eprintln!("iop-edge: http: {e}");
        std::process::exit(1);
    }
    stop.cancel();
    println!("iop-edge: stopped");
}
