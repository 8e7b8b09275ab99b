//! `iop-node`: run an IOP Node from a config file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use iop_node::config::NodeConfigFile;
use iop_node::{AdapterRegistry, Node};

/// Run an IOP Node: dial the Edge over mutually authenticated TLS, register, apply the adapter
/// configuration the Edge sends, report ready, and execute runs and provider tunnels.
///
/// Exit codes: 0 after SIGTERM/SIGINT (local shutdown); 1 for an invalid configuration or
/// credentials, or when a finite reconnect budget (`reconnect.max_attempts`) is exhausted.
/// The Edge need not be reachable at startup: the initial dial and every reconnect follow the
/// same `[reconnect]` policy.
///
/// Environment: RUST_LOG (log filter, default info); TOKIO_WORKER_THREADS (runtime worker
/// threads, default one per core); OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL,
/// OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER(_ARG) and the other OTEL_* variables (tracing, off
/// unless a collector is named).
#[derive(Debug, Parser)]
#[command(name = "iop-node", version, about, long_about)]
struct Args {
    /// Path to the TOML config file. Keys: node_id; [edge] address, server_name, name (or,
    /// to serve several Edges at once, one session each: [[edges]] with the same keys);
    /// [tls] trust_domain, ca, cert, key, reload_sec (the files are re-read this often, 5 by
    /// default, so a rotated certificate needs no restart); [reconnect] interval_sec,
    /// max_attempts; [runtime] close_grace_ms; [credential_plane] enabled, recipient_key,
    /// recipient_key_id, [[credential_plane.issuers]] public_key (the PEM `iop-cp issuer-key`
    /// prints) and key_id (optional: derived from the key) (managed mode: the Control Plane
    /// leases the upstream keys);
    /// [[credentials]] adapter, api_key_env | api_key_file, header, prefix (legacy mode: the
    /// upstream keys this Node holds itself); [telemetry] otlp_endpoint, otlp_protocol,
    /// service_name, sample_ratio, queue_max (OpenTelemetry tracing; the OTEL_* variables fill
    /// what is left out). See the iop_node::config docs for their meaning.
    #[arg(long, short = 'c', value_name = "FILE")]
    config: PathBuf,

    /// Validate the config (including the TLS files) and exit without connecting.
    #[arg(long)]
    check: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    iop_bins::init_process("info");
    let built = match NodeConfigFile::load(&args.config)
        .and_then(|file| file.build(AdapterRegistry::with_builtins()))
    {
        Ok(built) => built,
        Err(e) => {
            eprintln!("iop-node: invalid configuration: {e}");
            return ExitCode::from(1);
        }
    };
    if args.check {
        println!("iop-node: configuration is valid");
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("iop-node: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let mut built = built;
    let exit = runtime.block_on(async {
        let signal = iop_bins::shutdown_signal();
        let telemetry = match iop_telemetry::Telemetry::start(&built.telemetry, "iop-node") {
            Ok(t) => t,
            Err(e) => {
                eprintln!("iop-node: invalid configuration: telemetry: {e}");
                return None;
            }
        };
        if telemetry.is_on() {
            tracing::info!("exporting spans over OTLP");
        }
        built.options.telemetry = telemetry.clone();
        // The supervisor runs on a worker thread, not the thread blocked in `block_on`: the
        // session loop then shares the workers' wake-ups instead of being woken across threads
        // for every frame.
        let exit = Node::from_config(built)
            .run_until(async {
                signal.await;
                tracing::info!("shutdown requested");
            })
            .await;
        telemetry.flush().await;
        Some(exit)
    });
    let Some(exit) = exit else {
        return ExitCode::from(1);
    };
    tracing::info!(?exit, "iop-node stopped");
    ExitCode::from(u8::try_from(exit.exit_code()).unwrap_or(1))
}
