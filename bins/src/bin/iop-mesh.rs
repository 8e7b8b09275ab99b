//! `iop-mesh`: a whole local IOP mesh in one process on embedded defaults.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use iop_edge::builder::{AdapterSpec, ControlPlaneSpec, EdgeBuilder, EdgeTls, ModelSpec, NodeSpec};
use iop_edge::config::{ConfigError, Limits};
use iop_edge::control::SessionState;
use iop_edge::http::ApiKeys;
use iop_edge::profile::{DEFAULT_PRESET, Profile};
use iop_edge::{Edge, Lifecycle};
use iop_node::credential::LocalKey;
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_wire::runtime::ConcreteProtocolProfile;
use tokio_util::sync::CancellationToken;
use workload_identity::dev_ca::DevCa;
use workload_identity::role;

/// Start a whole local IOP mesh: an Edge with its HTTP API (OpenAI chat completions, the
/// Responses API and the Anthropic Messages API on every model), one or more Nodes connected to
/// it over mTLS (an ephemeral CA is made at startup), and a provider — the built-in demo
/// provider by default, or a real upstream (`--openai-url`, `--anthropic-url`, `--ollama-url`).
/// Prints the base URL and a ready-to-paste curl; Ctrl-C shuts everything down.
///
/// Keys: clients need a key when `--api-key` is given (sent as `Authorization: Bearer` or
/// `x-api-key`); without one the mesh accepts every request and refuses to listen beyond
/// loopback. An upstream that needs a key gets the one in `--upstream-api-key-env`, held by
/// the Nodes only.
///
/// Managed (`--managed`, with --openai-url or --anthropic-url and --upstream-api-key-env): an
/// embedded Control Plane (its store and keys in memory only, gone at exit) holds the upstream
/// key in a credential slot and leases it to the Node of each request, sealed to that Node; the
/// Edge authenticates clients with the Control Plane's tokens. The mesh creates a principal
/// `mesh`, a route for the model and a token, and prints the token with a ready `curl`; the
/// Control Plane's admin API (more principals, tokens, slots, routes) listens on loopback.
#[derive(Debug, Parser)]
#[command(name = "iop-mesh", version, about, long_about)]
struct Args {
    /// Address of the HTTP API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Number of Nodes (each serves the model).
    #[arg(long, default_value_t = 2)]
    nodes: u32,
    /// External model name clients ask for.
    #[arg(long, default_value = "demo")]
    model: String,
    /// Concurrent requests per Node.
    #[arg(long, default_value_t = 4)]
    capacity: u32,
    /// Demo provider: delay before each streamed word, in milliseconds.
    #[arg(long, default_value_t = 30)]
    demo_delay_ms: u32,
    /// Use an OpenAI-compatible upstream instead of the demo (e.g. http://127.0.0.1:8000/v1 for
    /// vLLM, https://api.openai.com/v1). It is asked for models and chat completions; the
    /// Responses and Messages APIs are translated (see --upstream-profile).
    #[arg(long, conflicts_with_all = ["ollama_url", "anthropic_url"])]
    openai_url: Option<String>,
    /// Use an Anthropic-native upstream (e.g. https://api.anthropic.com/v1): messages and
    /// count_tokens pass through with x-api-key and anthropic-version; chat completions and the
    /// Responses API are translated.
    #[arg(long, conflicts_with = "ollama_url")]
    anthropic_url: Option<String>,
    /// Use a local Ollama instead of the demo (e.g. http://127.0.0.1:11434).
    #[arg(long)]
    ollama_url: Option<String>,
    /// The protocol profile of --openai-url: chat_only (default: models and chat completions,
    /// what every OpenAI-compatible server has) or openai (also passes /v1/responses through,
    /// for OpenAI itself).
    #[arg(long, value_parser = ["chat_only", "openai", "anthropic"])]
    upstream_profile: Option<String>,
    /// Upstream model name (target) for --openai-url / --anthropic-url / --ollama-url; defaults
    /// to --model.
    #[arg(long)]
    upstream_model: Option<String>,
    /// The environment variable holding the upstream's API key (read by the Nodes, written in
    /// the profile's auth header: Authorization: Bearer, or x-api-key for --anthropic-url).
    #[arg(long, value_name = "NAME")]
    upstream_api_key_env: Option<String>,
    /// A key clients must present (repeatable, or comma-separated in IOP_MESH_API_KEYS).
    #[arg(
        long = "api-key",
        env = "IOP_MESH_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    api_keys: Vec<String>,
    /// How long a request may wait for a free provider before a 503.
    #[arg(long, default_value_t = 30)]
    queue_wait_sec: u64,
    /// Memory one response's unread events may hold for a slow client; past it the stream is ended and
    /// cancelled upstream.
    #[arg(long, default_value_t = iop_edge::transport::DEFAULT_MAX_STREAM_BUFFER)]
    stream_buffer_bytes: usize,
    /// A tunnel body's credit window: a client slower than the provider slows its own stream
    /// (the Node stops reading the provider) instead of being ended. Default a quarter of
    /// --stream-buffer-bytes, at most half of it; 0 turns credit off.
    #[arg(long)]
    stream_window_bytes: Option<usize>,
    /// The status page's listener (port 0: any free port). Its admin token is made at start
    /// and printed with the address.
    #[arg(long, default_value = "127.0.0.1:0")]
    admin_listen: SocketAddr,
    /// A response with unread bytes whose client reads nothing for this long is ended and
    /// cancelled upstream.
    #[arg(long, default_value_t = iop_edge::transport::DEFAULT_SLOW_CONSUMER_TIMEOUT.as_secs())]
    slow_consumer_timeout_sec: u64,
    /// HTTP connections at most; more are closed at once.
    #[arg(long, default_value_t = 4096)]
    http_max_connections: usize,
    /// Time to send request headers (slowloris); also the idle limit between requests on a
    /// keep-alive connection.
    #[arg(long, default_value_t = 30)]
    http_header_timeout_sec: u64,
    /// Time to send the whole request body (then 408).
    #[arg(long, default_value_t = iop_edge::http::DEFAULT_BODY_TIMEOUT.as_secs())]
    http_body_timeout_sec: u64,
    /// Managed credential plane: an embedded Control Plane leases the upstream key
    /// (--upstream-api-key-env) per request; clients use the token it prints.
    #[arg(long, conflicts_with_all = ["api_keys", "ollama_url"], requires = "upstream_api_key_env")]
    managed: bool,
    /// With --managed: the Control Plane's admin API address (loopback).
    #[arg(long, default_value = "127.0.0.1:0", requires = "managed")]
    cp_admin_listen: SocketAddr,
    /// OpenTelemetry collector base URL: the Edge, every Node and (with --managed) the Control
    /// Plane export their spans there, as services iop-edge, iop-node and iop-cp, one trace
    /// per request. Unset: OTEL_EXPORTER_OTLP_ENDPOINT and the other OTEL_* variables; off when
    /// neither names a collector.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// With --otlp-endpoint: `http/protobuf` (port 4318 by convention) or `grpc` (4317).
    #[arg(long, value_parser = ["http/protobuf", "grpc"], requires = "otlp_endpoint")]
    otlp_protocol: Option<String>,
}

/// The tracing settings of one of the mesh's services.
fn telemetry(args: &Args, service: &str) -> iop_telemetry::TelemetryConfig {
    let mut c = iop_telemetry::TelemetryConfig::default();
    c.endpoint.clone_from(&args.otlp_endpoint);
    c.protocol = args
        .otlp_protocol
        .as_deref()
        .and_then(iop_telemetry::Protocol::parse);
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        c.service_name = Some(service.to_owned());
    }
    c
}

/// The upstream of `--openai-url` / `--anthropic-url` and its profile, if one is given.
fn upstream(args: &Args) -> Result<Option<(String, ConcreteProtocolProfile)>, String> {
    let upstream = args
        .openai_url
        .as_ref()
        .map(|u| {
            (
                u,
                args.upstream_profile.as_deref().unwrap_or(DEFAULT_PRESET),
            )
        })
        .or_else(|| {
            args.anthropic_url
                .as_ref()
                .map(|u| (u, args.upstream_profile.as_deref().unwrap_or("anthropic")))
        });
    upstream
        .map(|(url, preset)| {
            let profile =
                Profile::preset(preset).map_err(|e| format!("--upstream-profile: {e}"))?;
            Ok((url.clone(), profile))
        })
        .transpose()
}

/// The one adapter every Node runs (named `provider`), serving the model.
fn adapter(args: &Args, target: &str) -> Result<AdapterSpec, String> {
    let spec = if let Some((url, profile)) = upstream(args)? {
        AdapterSpec::openai_compat(ADAPTER, url).profile(profile.name)
    } else if let Some(url) = &args.ollama_url {
        AdapterSpec::ollama(ADAPTER, url)
    } else {
        AdapterSpec::demo(ADAPTER).option("delay_ms", args.demo_delay_ms.to_string())
    };
    Ok(spec
        .capacity(args.capacity)
        .serves(ModelSpec::new(&args.model).target(target)))
}

/// The adapter instance name (a Node's local key is held for it).
const ADAPTER: &str = "provider";

/// A configuration error, named by the flag it comes from (`limits.http_max_connections` is
/// `--http-max-connections`).
fn flag_error(e: &ConfigError) -> String {
    match e {
        ConfigError::Invalid { key, message } if key.starts_with("limits.") => {
            format!("--{}: {message}", key["limits.".len()..].replace('_', "-"))
        }
        other => other.to_string(),
    }
}

async fn run(args: Args) -> Result<(), String> {
    if args.api_keys.is_empty() && !args.managed && !args.listen.ip().is_loopback() {
        return Err(format!(
            "refusing to listen on {} without a key: anyone who can reach it could use the upstream; give --api-key (or IOP_MESH_API_KEYS), or listen on 127.0.0.1",
            args.listen
        ));
    }
    if args.managed && args.openai_url.is_none() && args.anthropic_url.is_none() {
        return Err(
            "--managed leases an upstream key: give --openai-url or --anthropic-url with --upstream-api-key-env".into(),
        );
    }
    let local_key = match &args.upstream_api_key_env {
        Some(var) if !args.managed => {
            Some(LocalKey::from_env(var).map_err(|e| format!("--upstream-api-key-env: {e}"))?)
        }
        _ => None,
    };
    let ca = DevCa::new().map_err(|e| e.to_string())?;
    let target = args
        .upstream_model
        .clone()
        .unwrap_or_else(|| args.model.clone());
    let adapter = adapter(&args, &target)?;
    let names: Vec<String> = (1..=args.nodes).map(|i| format!("node-{i}")).collect();

    let shutdown = CancellationToken::new();
    // Managed: the Control Plane first, so that the Edge's connector has its address.
    let managed = match upstream(&args)? {
        Some((_, profile)) if args.managed => {
            Some(managed::start(&args, &ca, &profile, &target, shutdown.clone()).await?)
        }
        _ => None,
    };
    let mut builder = EdgeBuilder::new("edge-1")
        .listen_nodes(SocketAddr::from(([127, 0, 0, 1], 0)))
        .listen_http(args.listen)
        .queue(Duration::from_secs(args.queue_wait_sec), 1024)
        .limits(Limits {
            stream_buffer_bytes: args.stream_buffer_bytes.max(1),
            slow_consumer_timeout_sec: args.slow_consumer_timeout_sec.max(1),
            stream_window_bytes: args.stream_window_bytes,
            http_max_connections: args.http_max_connections.max(1),
            http_header_timeout_sec: args.http_header_timeout_sec.max(1),
            http_body_timeout_sec: args.http_body_timeout_sec.max(1),
            ..Limits::default()
        });
    for name in &names {
        builder = builder.node(NodeSpec::new(name).adapter(adapter.clone()));
    }
    if !args.api_keys.is_empty() {
        builder = builder.api_keys(ApiKeys::new(&args.api_keys));
    }
    if let Some(m) = &managed {
        builder = builder.control_plane(
            ControlPlaneSpec::new([m.cp.local_addr().to_string()], "localhost", "cp-1").managed(),
        );
    }
    let tls = ca
        .material(role::EDGE, "edge-1")
        .map_err(|e| e.to_string())?;
    let config = builder
        .telemetry(telemetry(&args, "iop-edge"))
        .build(EdgeTls::Material(tls))
        .map_err(|e| flag_error(&e))?;
    let edge = Edge::start(config)
        .await
        .map_err(|e| format!("edge: {e}"))?;
    if let Some(control) = edge.control() {
        // The hello's projection is installed before the session reports `Connected`.
        let mut state = control.state();
        tokio::time::timeout(
            Duration::from_secs(10),
            state.wait_for(|s| *s == SessionState::Connected),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| "the Edge did not connect to the embedded Control Plane".to_owned())?;
    }
    let mut life = edge.handle().subscribe();

    let node_telemetry = iop_telemetry::Telemetry::start(&telemetry(&args, "iop-node"), "iop-node")
        .map_err(|e| format!("telemetry: {e}"))?;
    if node_telemetry.is_on() {
        println!("iop-mesh: exporting spans over OTLP");
    }
    let mut node_tasks = Vec::new();
    for name in &names {
        let tls = ca.node_tls(name, "edge-1").map_err(|e| e.to_string())?;
        let mut opts = NodeOptions::new(name, &edge.node_addr().to_string(), "localhost", tls)
            .map_err(|e| e.to_string())?
            .with_adapters(AdapterRegistry::with_builtins())
            .with_telemetry(node_telemetry.clone());
        if let Some(key) = &local_key {
            opts = opts.with_local_key(ADAPTER, key.clone());
        }
        if let Some(m) = &managed {
            opts = opts.with_credential_plane(m.recipient(name)?);
        }
        node_tasks.push(tokio::spawn(run_node(opts, shutdown.clone())));
    }
    let mut ready = 0;
    let wait = tokio::time::timeout(Duration::from_secs(30), async {
        while ready < names.len() {
            if let Ok(Lifecycle::Connected { .. }) = life.recv().await {
                ready += 1;
            }
        }
    });
    if wait.await.is_err() {
        return Err(format!(
            "only {ready} of {} nodes became ready",
            names.len()
        ));
    }

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let base = format!(
        "http://{}/v1",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    println!(
        "iop-mesh: edge + {} node(s) ready over mTLS, model `{}`",
        names.len(),
        args.model
    );
    println!("iop-mesh: OpenAI-compatible base URL: {base}");
    println!(
        "iop-mesh: routes: /v1/models, /v1/chat/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens"
    );
    let auth = if let Some(m) = &managed {
        println!(
            "iop-mesh: managed: an embedded Control Plane leases the upstream key; principal `mesh`, token (shown once):"
        );
        println!("iop-mesh: token: {}", m.token.as_str());
        println!(
            "iop-mesh: Control Plane admin API on http://{} (POST /admin/v1/tokens, …; see iop_cp::admin_http)",
            m.admin_addr
        );
        format!(" -H 'authorization: Bearer {}'", m.token.as_str())
    } else if args.api_keys.is_empty() {
        String::new()
    } else {
        " -H 'authorization: Bearer <your --api-key>'".to_owned()
    };
    println!(
        "\n  curl -N {base}/chat/completions -H 'content-type: application/json'{auth} \\\n    -d '{{\"model\":\"{}\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hello mesh\"}}]}}'\n",
        args.model
    );
    let admin_token = {
        let mut raw = [0u8; 18];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut raw)
            .map_err(|_| "no randomness for the admin token".to_owned())?;
        raw.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let admin_listener = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .map_err(|e| format!("--admin-listen {}: {e}", args.admin_listen))?;
    let admin_addr = admin_listener.local_addr().map_err(|e| e.to_string())?;
    let page = edge.status_page(
        iop_edge::admin::AdminToken::new(&admin_token)
            .ok_or_else(|| "the admin token is malformed".to_owned())?,
    );
    let admin_task = tokio::spawn(async move {
        let _ = axum::serve(admin_listener, page).await;
    });
    println!(
        "iop-mesh: status page on http://{admin_addr}/ (user: anything, password: the admin token {admin_token})"
    );
    println!("iop-mesh: Ctrl-C to stop");
    let stop = shutdown.clone();
    let signal = iop_bins::shutdown_signal();
    edge.serve(listener, edge.router(), async move {
        signal.await;
        stop.cancel();
    })
    .await
    .map_err(|e| format!("http server: {e}"))?;
    shutdown.cancel();
    admin_task.abort();
    for t in node_tasks {
        let _ = t.await;
    }
    node_telemetry.flush().await;
    edge.shutdown().await;
    if let Some(m) = &managed {
        m.telemetry.flush().await;
    }
    drop(managed);
    println!("iop-mesh: stopped");
    Ok(())
}

mod managed {
    //! `--managed`: the embedded Control Plane and what the mesh needs from it.

    use std::net::SocketAddr;
    use std::sync::Arc;

    use iop_cp::admin::Admin;
    use iop_cp::lease::LeaseService;
    use iop_cp::seal::MasterKey;
    use iop_cp::server::{self, ServerConfig};
    use iop_cp::store::{SqliteStore, Store};
    use iop_lease::{
        IssuerPublicKey, IssuerSigningKey, OpenPolicy, Recipient, RecipientSecretKey,
        TrustedIssuers,
    };
    use iop_wire::runtime::ConcreteProtocolProfile;
    use tokio_util::sync::CancellationToken;
    use workload_identity::dev_ca::DevCa;
    use zeroize::Zeroizing;

    use super::Args;

    /// The running Control Plane (store, master key and issuer key in memory only) and the
    /// token printed for the user.
    pub(super) struct Managed {
        pub(super) token: Zeroizing<String>,
        pub(super) admin_addr: SocketAddr,
        pub(super) cp: server::ControlPlane,
        issuer: IssuerPublicKey,
        /// The Control Plane's tracer (flushed before the mesh exits).
        pub(super) telemetry: iop_telemetry::Telemetry,
    }

    impl Drop for Managed {
        fn drop(&mut self) {
            self.cp.shutdown();
        }
    }

    impl Managed {
        /// A fresh recipient key for Node `name`, trusting this Control Plane's issuer key.
        pub(super) fn recipient(&self, name: &str) -> Result<Recipient, String> {
            let key = RecipientSecretKey::generate(&format!("{name}-key"))
                .map_err(|e| format!("recipient key: {e}"))?;
            let trusted: TrustedIssuers = [self.issuer.clone()].into_iter().collect();
            Ok(Recipient::new(key, trusted, OpenPolicy::default()))
        }
    }

    /// Starts the Control Plane (an in-memory SQLite store and master key), stores the upstream key
    /// in slot `upstream` with the upstream's profile and auth header, and creates principal
    /// `mesh` with a route for the model and a token. The Edge connects to it as `cp-1`.
    pub(super) async fn start(
        args: &Args,
        ca: &DevCa,
        profile: &ConcreteProtocolProfile,
        target: &str,
        shutdown: CancellationToken,
    ) -> Result<Managed, String> {
        let var = args.upstream_api_key_env.as_deref().unwrap_or_default();
        let credential = Zeroizing::new(
            std::env::var(var)
                .ok()
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("--upstream-api-key-env: {var} is not set or empty"))?,
        );
        let (header, prefix) = if profile.auth_header.is_empty() {
            ("authorization", "Bearer ")
        } else {
            (profile.auth_header.as_str(), profile.auth_prefix.as_str())
        };
        let fail = |what: &str, e: &dyn std::fmt::Display| format!("control plane {what}: {e}");
        let store: Arc<dyn Store> =
            Arc::new(SqliteStore::in_memory().map_err(|e| fail("store", &e))?);
        let (master, raw) = MasterKey::generate().map_err(|e| fail("key", &e))?;
        drop(raw);
        let generation = store.generation().await.map_err(|e| fail("store", &e))?;
        let admin = Admin::new(store.clone(), Arc::new(master), generation);
        let issuer = admin
            .ensure_issuer_key(|| {
                IssuerSigningKey::generate_derived()
                    .map_err(|_| iop_cp::admin::AdminError::KeyGeneration)
            })
            .await
            .map_err(|e| fail("issuer", &e))?
            .public_key();
        let leases = LeaseService::new(
            store,
            admin.master_key().clone(),
            iop_cp::lease::DEFAULT_LEASE_TTL,
        );
        let admin_err = |e: iop_cp::admin::AdminError| fail("setup", &e);
        admin
            .put_slot(
                "upstream",
                &profile.name,
                header,
                prefix,
                credential.as_bytes(),
            )
            .await
            .map_err(admin_err)?;
        drop(credential);
        admin
            .create_principal("mesh", "iop-mesh")
            .await
            .map_err(admin_err)?;
        admin
            .put_route("mesh-route", "mesh", &args.model, "upstream", target, "")
            .await
            .map_err(admin_err)?;
        let token = admin.create_token("mesh").await.map_err(admin_err)?.token;
        let tls = ca.control_plane_tls("cp-1").map_err(|e| e.to_string())?;
        let mut config =
            ServerConfig::new("127.0.0.1:0".parse().map_err(|_| "address")?, tls, true);
        config.telemetry =
            iop_telemetry::Telemetry::start(&super::telemetry(args, "iop-cp"), "iop-cp")
                .map_err(|e| format!("telemetry: {e}"))?;
        let telemetry = config.telemetry.clone();
        let (cp, _task) = server::serve(config, admin.clone(), Some(Arc::new(leases)))
            .await
            .map_err(|e| fail("listener", &e))?;
        let listener = tokio::net::TcpListener::bind(args.cp_admin_listen)
            .await
            .map_err(|e| format!("--cp-admin-listen {}: {e}", args.cp_admin_listen))?;
        if !args.cp_admin_listen.ip().is_loopback() {
            return Err("--cp-admin-listen must be a loopback address".into());
        }
        let admin_addr = listener.local_addr().map_err(|e| e.to_string())?;
        let app = iop_cp::admin_http::router(admin, Some(cp.clone()), None);
        let stop = shutdown;
        tokio::spawn(async move {
            let _ = bounded_http::serve_with(
                listener,
                app,
                bounded_http::ServeLimits::default(),
                None,
                async move { stop.cancelled().await },
            )
            .await;
        });
        Ok(Managed {
            token: Zeroizing::new(token.as_str().to_owned()),
            admin_addr,
            cp,
            issuer,
            telemetry,
        })
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    iop_bins::init_process("warn");
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("iop-mesh: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("iop-mesh: {e}");
            ExitCode::from(1)
        }
    }
}
