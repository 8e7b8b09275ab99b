//! `proxypool-controller`: the proxy-pool WorkerControlPlane gRPC controller (seed 004).
//!
//! ```text
//! proxypool-controller --config controller.toml
//! proxypool-controller --check-config --config controller.toml
//! ```
//!
//! The file format is `proxypool_controller::config` (the `controlPlane` block with the seed's
//! key names, `[redis]`, `[admin]`). The gRPC listener starts only when
//! `controlPlane.enabled = true`; Redis is then required (and part of `/readyz`). SIGTERM or
//! Ctrl-C: not ready, stop accepting RPCs, graceful stop bounded by
//! `controlPlane.shutdownTimeout`, then hard stop.
//!
//! Exit codes: 0 clean stop (or disabled), 1 runtime failure (Redis unavailable at startup, a
//! listener failed), 2 invalid configuration.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a CLI prints its status"
)]

use std::path::PathBuf;

use clap::Parser;
use proxypool_controller::config::File;
use proxypool_controller::server::{self, StartError};

#[derive(Parser, Debug)]
#[command(
    name = "proxypool-controller",
    version,
    about = "proxy-pool WorkerControlPlane controller (RegisterWorker, AcknowledgeSnapshot, ReportRuntime; WatchSnapshots and ReportOutcomes answer UNIMPLEMENTED)"
)]
struct Cli {
    /// Configuration file (TOML, the seed's key names; durations written 10s, 500ms, 2m). Keys:
    /// [controlPlane] enabled (false: no gRPC listener), listen, protocolVersion,
    /// heartbeatInterval, sessionTTL, maxStaleAge, maxMessageBytes, maxRuntimeCounters,
    /// maxConcurrentStreams, shutdownTimeout, minPingInterval; [controlPlane.tls] mode
    /// (disabled, on loopback only | mtls), serverCert, serverKey, clientCA, trustDomain,
    /// environment, reloadInterval; [redis] (required when enabled) url, namespace, cluster,
    /// waitReplicas, waitTimeout; [admin] listen (/healthz, /readyz, /metrics). An annotated
    /// example with every default: the proxypool_controller::config crate docs.
    #[arg(long)]
    config: PathBuf,
    /// Validate the configuration and exit.
    #[arg(long)]
    check_config: bool,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    iop_bins::init_process("info");
    let text = match std::fs::read_to_string(&cli.config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("proxypool-controller: {}: {e}", cli.config.display());
            std::process::exit(2);
        }
    };
    let config = match File::parse(&text)
        .map_err(|e| e.to_string())
        .and_then(|f| f.validate().map_err(|e| e.to_string()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("proxypool-controller: {}: {e}", cli.config.display());
            std::process::exit(2);
        }
    };
    if cli.check_config {
        println!(
            "proxypool-controller: configuration valid (enabled={})",
            config.enabled
        );
        return;
    }
    let shutdown = iop_bins::shutdown_signal();
    let running = match server::start(&config, shutdown).await {
        Ok(r) => r,
        Err(StartError::Disabled) => {
            println!("proxypool-controller: controlPlane.enabled is false; nothing to run");
            return;
        }
        Err(e @ StartError::Tls(_)) => {
            eprintln!("proxypool-controller: {e}");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("proxypool-controller: {e}");
            std::process::exit(1);
        }
    };
    println!("proxypool-controller: gRPC on {}", running.grpc_addr);
    if let Some(a) = running.admin_addr {
        println!("proxypool-controller: admin on http://{a}");
    }
    match running.wait().await {
        Ok(()) => println!("proxypool-controller: stopped"),
        Err(e) => {
            eprintln!("proxypool-controller: {e}");
            std::process::exit(1);
        }
    }
}
