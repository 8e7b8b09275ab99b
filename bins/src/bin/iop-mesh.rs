//! `iop-mesh`: a whole local IOP mesh in one process on embedded defaults.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use iop_bins::devca::DevCa;
use iop_edge::http::{self, HttpConfig};
use iop_edge::pool::{PoolConfig, ProviderKey, ProviderKind, ProviderSpec};
use iop_edge::{Lifecycle, TransportConfig};
use iop_node::{AdapterRegistry, NodeOptions, run_node};
use iop_wire::runtime::{
    AdapterConfig, AdapterSettings, ConcreteProtocolProfile, NativeSettings, NodeConfigPayload,
    OpenAiCompatSettings, Operation,
};
use tokio_util::sync::CancellationToken;

/// Start a whole local IOP mesh: an Edge with its OpenAI-compatible HTTP surface, one or more
/// Nodes connected to it over mTLS (an ephemeral CA is made at startup), and a provider — the
/// built-in demo provider by default, or a real upstream (`--openai-url`, `--ollama-url`).
/// Prints the base URL and a ready-to-paste curl; Ctrl-C shuts everything down.
#[derive(Debug, Parser)]
#[command(name = "iop-mesh", version, about, long_about)]
struct Args {
    /// Address of the OpenAI-compatible HTTP surface.
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
    /// Use an OpenAI-compatible upstream instead of the demo (e.g. http://127.0.0.1:8000/v1).
    #[arg(long, conflicts_with = "ollama_url")]
    openai_url: Option<String>,
    /// Use a local Ollama instead of the demo (e.g. http://127.0.0.1:11434).
    #[arg(long)]
    ollama_url: Option<String>,
    /// Upstream model name (target) for --openai-url / --ollama-url; defaults to --model.
    #[arg(long)]
    upstream_model: Option<String>,
    /// How long a request may wait for a free provider before a 503.
    #[arg(long, default_value_t = 30)]
    queue_wait_sec: u64,
}

fn adapter(args: &Args, target: &str) -> (AdapterConfig, ProviderKind) {
    let (adapter_type, settings, kind) = if let Some(url) = &args.openai_url {
        let profile = ConcreteProtocolProfile {
            name: "openai".into(),
            operation_paths: [
                (Operation::ChatCompletions, "/chat/completions".to_owned()),
                (Operation::Models, "/models".to_owned()),
            ]
            .into_iter()
            .collect(),
            health_path: String::new(),
        };
        let s = OpenAiCompatSettings {
            base_url: url.clone(),
            protocol_profile: profile,
            request_timeout_sec: 0,
        };
        (
            "openai_compat",
            AdapterSettings::OpenAiCompat(s),
            ProviderKind::OpenAiCompat,
        )
    } else if let Some(url) = &args.ollama_url {
        let s = NativeSettings {
            base_url: url.clone(),
            options: Default::default(),
        };
        ("ollama", AdapterSettings::Native(s), ProviderKind::Native)
    } else {
        let options = [("delay_ms".to_owned(), args.demo_delay_ms.to_string())]
            .into_iter()
            .collect();
        (
            "demo",
            AdapterSettings::Native(NativeSettings {
                base_url: String::new(),
                options,
            }),
            ProviderKind::Native,
        )
    };
    let config = AdapterConfig {
        name: "provider".into(),
        adapter_type: adapter_type.into(),
        enabled: true,
        capacity: args.capacity,
        long_context_capacity: args.capacity,
        targets: vec![target.to_owned()],
        settings,
    };
    (config, kind)
}

async fn run(args: Args) -> Result<(), String> {
    let ca = DevCa::new().map_err(|e| e.to_string())?;
    let target = args
        .upstream_model
        .clone()
        .unwrap_or_else(|| args.model.clone());
    let (adapter, kind) = adapter(&args, &target);
    let names: Vec<String> = (1..=args.nodes).map(|i| format!("node-{i}")).collect();
    let providers: Vec<ProviderSpec> = names
        .iter()
        .map(|n| ProviderSpec {
            key: ProviderKey {
                node_id: n.clone(),
                provider_id: format!("{n}-provider"),
            },
            adapter: adapter.name.clone(),
            target: target.clone(),
            kind,
            category: if kind == ProviderKind::OpenAiCompat {
                "api".into()
            } else {
                "local_inference".into()
            },
            capacity: args.capacity,
            long_context_capacity: args.capacity,
            response_stall_timeout: Duration::from_secs(300),
            enabled: true,
        })
        .collect();
    let mut transport = TransportConfig::new(
        "127.0.0.1:0".parse().map_err(|_| "address")?,
        ca.edge_tls("edge-1").map_err(|e| e.to_string())?,
    );
    transport.node_configs = names
        .iter()
        .map(|n| {
            (
                n.clone(),
                NodeConfigPayload {
                    adapters: vec![adapter.clone()],
                    revision: 1,
                    ..Default::default()
                },
            )
        })
        .collect();
    transport.pool = Some(PoolConfig {
        models: vec![(
            args.model.clone(),
            providers.iter().map(|p| p.key.clone()).collect(),
        )],
        providers,
        max_queue: 1024,
    });
    let (edge, _accept) = iop_edge::bind(transport)
        .await
        .map_err(|e| format!("edge listener: {e}"))?;
    let mut life = edge.subscribe();

    let shutdown = CancellationToken::new();
    let mut node_tasks = Vec::new();
    for name in &names {
        let tls = ca.node_tls(name, "edge-1").map_err(|e| e.to_string())?;
        let opts = NodeOptions::new(name, &edge.local_addr().to_string(), "localhost", tls)
            .map_err(|e| e.to_string())?
            .with_adapters(AdapterRegistry::with_builtins());
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

    let app = http::router(
        edge.clone(),
        HttpConfig {
            models: vec![args.model.clone()],
            queue_wait: Duration::from_secs(args.queue_wait_sec),
            auth: None,
            control: None,
        },
    );
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
        "\n  curl -N {base}/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hello mesh\"}}]}}'\n",
        args.model
    );
    println!("iop-mesh: Ctrl-C to stop");
    let stop = shutdown.clone();
    let signal = iop_bins::shutdown_signal();
    http::serve(listener, app, async move {
        signal.await;
        stop.cancel();
    })
    .await
    .map_err(|e| format!("http server: {e}"))?;
    shutdown.cancel();
    for t in node_tasks {
        let _ = t.await;
    }
    println!("iop-mesh: stopped");
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
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
