//! `iop-edge`: the IOP Edge as a standalone service — the Node listener (mTLS), the provider
//! pool, the HTTP API (OpenAI chat, Responses, Anthropic Messages) and, optionally, the Control
//! Plane connector (managed credential plane included).
//!
//! ```text
//! iop-edge --config edge.toml
//! iop-edge --check-config --config edge.toml
//! iop-edge usage --db usage.db [--since 2026-12-01] [--json]
//! ```
//!
//! `usage` prints the daily usage rollup of the `[usage] sqlite` file (per day, key id, model
//! and outcome: requests, tokens, cost), as a table or JSON; it reads the file while the Edge
//! writes it.
//!
//! The file format is `iop_edge::config` (every key, with an example). The TLS files are
//! re-read every `tls.reload_sec` seconds: a rotated certificate is used by new connections
//! without a restart, and an invalid one is refused with a log line while the old stays.
//! Exit codes: 0 clean stop (Ctrl-C or SIGTERM), 1 runtime failure, 2 invalid configuration.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a CLI prints its status"
)]

use std::path::PathBuf;

use clap::Parser;
use iop_edge::config::EdgeConfigFile;
use iop_edge::{Edge, StartError};

#[derive(Parser, Debug)]
#[command(
    name = "iop-edge",
    version,
    about = "IOP Edge: Node listener, provider pool, OpenAI/Anthropic-compatible API, Control Plane connector",
    long_about = "IOP Edge: Node listener (mTLS), provider pool, an HTTP API serving OpenAI chat \
completions, the Responses API and the Anthropic Messages API on every model (passed through or \
translated, per each adapter's protocol profile), and an optional Control Plane connector.\n\n\
The configuration file is TOML; its keys are documented in the iop_edge::config crate docs \
(edge_id, [listen], [tls] with reload_sec, [auth] gateway keys (a key file line may name its \
key: `<key or sha256:hex> <id>`), [auth.limits] and [auth.key_limits.<id>] per-key rate limits \
(requests_per_minute, tokens_per_minute, concurrent, budget_usd_per_day, budget_usd_per_month, \
and per model under .models.<model>), [prices.<model>] input, output and cached_input USD per million tokens, \
auth.output_estimate (tokens reserved for a request that names no cap, 1024), [auth.shared] \
limits and budgets shared by several Edges through Redis (redis or redis_env; cluster = true: \
Redis Cluster seed URLs, comma-separated; on_unavailable = local | \
closed, borrow_divisor 16, share 4, timeout_ms 250, credit_idle_ms 2000), [usage] one record \
per keyed request or principal in a SQLite file (sqlite, queue 65536, retention_days 30; managed \
mode: also the spool of records sent to the Control Plane, spool_max 1000000), in managed mode \
auth.output_estimate and [auth.shared] only (principals' limits come from the Control Plane), \
[pool], [[nodes]] with \
[[nodes.adapters]] and their profile = chat_only | openai | anthropic, stream_usage (true: ask \
for usage on chat streams) and trace_propagation (true: the Node sends the upstream a \
traceparent header), [[models]], [telemetry] otlp_endpoint, otlp_protocol (http/protobuf | \
grpc), service_name, sample_ratio, queue_max (OpenTelemetry tracing, off unless a collector is \
named here or in OTEL_EXPORTER_OTLP_ENDPOINT), \
[admin] listen, token_file (the status page for operators on its own listener: live Nodes, \
providers, queue, traffic and the Control Plane; every request needs the token, as Bearer or \
as the Basic password a browser asks for), \
[control_plane], and [limits]: tls_handshake_timeout_sec (10), register_timeout_sec (10), \
max_unauthenticated (256), max_unauthenticated_per_ip (32), stream_buffer_bytes (4 MiB), \
slow_consumer_timeout_sec (30), http_max_connections (4096), http_header_timeout_sec (30, also \
the keep-alive idle limit), http_body_timeout_sec (60), drain_notice_sec (0: on SIGTERM, /readyz \
answers 503 this long while the Edge still serves, so a load balancer stops sending), \
drain_timeout_sec (30: then what is in flight may finish this long)).\n\n\
Environment: RUST_LOG (log filter, default info); TOKIO_WORKER_THREADS (runtime worker threads, \
default one per core); OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL, \
OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG, OTEL_BSP_* and the other \
standard OTEL_* variables (tracing; the file's [telemetry] wins where both set a value)."
)]
#[command(subcommand_negates_reqs = true)]
struct Cli {
    /// Configuration file (TOML; keys in the iop_edge::config docs).
    #[arg(long, required = true)]
    config: Option<PathBuf>,
    /// Validate the configuration (and read the files it names) and exit.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Usage per day, key id, model and outcome from the `[usage] sqlite` file: requests,
    /// input and output tokens, cost at [prices].
    Usage {
        /// The usage file (`[usage] sqlite` in the Edge's config).
        #[arg(long)]
        db: PathBuf,
        /// From this UTC day on (`YYYY-MM-DD`).
        #[arg(long)]
        since: Option<String>,
        /// One JSON array of rows instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// `iop-edge usage`: the daily rollup as a table or JSON; exit 2 when the file cannot be read.
fn usage_report(db: &std::path::Path, since: Option<&str>, json: bool) {
    let rows = iop_edge::usage::daily(db, since).unwrap_or_else(|e| {
        eprintln!("iop-edge: {e}");
        std::process::exit(2);
    });
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).unwrap_or_default()
        );
        return;
    }
    println!(
        "{:<10}  {:<20}  {:<24}  {:<9}  {:>9}  {:>12}  {:>12}  {:>12}",
        "day", "key", "model", "status", "requests", "input", "output", "cost_usd"
    );
    for r in rows {
        #[allow(clippy::cast_precision_loss, reason = "a cost shown to six decimals")]
        let usd = r.cost_pusd as f64 / 1e12;
        println!(
            "{:<10}  {:<20}  {:<24}  {:<9}  {:>9}  {:>12}  {:>12}  {:>12.6}",
            r.day, r.key, r.model, r.status, r.requests, r.input_tokens, r.output_tokens, usd
        );
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Some(Command::Usage { db, since, json }) = &cli.command {
        return usage_report(db, since.as_deref(), *json);
    }
    let Some(config) = cli.config.clone() else {
        eprintln!("iop-edge: --config is required");
        std::process::exit(2);
    };
    iop_bins::init_process("info");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let shutdown = iop_bins::shutdown_signal();
    let built = EdgeConfigFile::load(&config).and_then(EdgeConfigFile::build);
    let built = built.unwrap_or_else(|e| {
        eprintln!("iop-edge: {}: {e}", config.display());
        std::process::exit(2);
    });
    if cli.check_config {
        println!("iop-edge: configuration valid");
        return;
    }
    let http_listen = built.http_listen;
    let admin = built.admin.clone();
    let edge = Edge::start(built).await.unwrap_or_else(|e| {
        eprintln!("iop-edge: {e}");
        std::process::exit(match e {
            StartError::Listen(_) => 1,
            _ => 2,
        });
    });
    let listener = tokio::net::TcpListener::bind(http_listen)
        .await
        .unwrap_or_else(|e| {
            eprintln!("iop-edge: http listener {http_listen}: {e}");
            std::process::exit(1);
        });
    println!("iop-edge: nodes on {}", edge.node_addr());
    println!(
        "iop-edge: HTTP API on http://{}/v1",
        listener.local_addr().map_or(http_listen, |a| a)
    );
    let admin_task = match admin {
        None => None,
        Some(a) => {
            let listener = tokio::net::TcpListener::bind(a.listen)
                .await
                .unwrap_or_else(|e| {
                    eprintln!("iop-edge: admin listener {}: {e}", a.listen);
                    std::process::exit(1);
                });
            println!(
                "iop-edge: status page on http://{}/ (the admin token from admin.token_file)",
                listener.local_addr().map_or(a.listen, |l| l)
            );
            let page = edge.status_page(a.token);
            Some(tokio::spawn(async move {
                let _ = axum::serve(listener, page).await;
            }))
        }
    };
    let http = edge.http_config();
    if http.telemetry.is_on() {
        println!("iop-edge: exporting spans over OTLP");
    }
    if http.api_keys.is_none() && http.control.is_none() {
        eprintln!("iop-edge: no [auth] section: every request is accepted without a key");
    }
    if let Some(limiter) = &http.limiter {
        let c = limiter.config();
        let shared = match &c.shared {
            Some(s) => format!(
                "shared through Redis (on_unavailable = {})",
                match s.on_unavailable {
                    iop_edge::limits::OnUnavailable::Closed => "closed",
                    _ => "local",
                }
            ),
            None => "enforced by this Edge alone".to_owned(),
        };
        println!(
            "iop-edge: rate limits on {} key(s) and the default, {shared}",
            c.keys.len()
        );
    }
    // On SIGTERM / Ctrl-C: /readyz turns 503 for [limits] drain_notice_sec while the Edge
    // still serves, then the listener closes and what is in flight finishes within
    // drain_timeout_sec.
    if let Err(e) = edge
        .serve(listener, edge.router(), edge.draining(shutdown))
        .await
    {
        eprintln!("iop-edge: http: {e}");
        std::process::exit(1);
    }
    if let Some(t) = admin_task {
        t.abort();
    }
    edge.shutdown().await;
    println!("iop-edge: stopped");
}
