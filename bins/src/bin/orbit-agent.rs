//! `orbit-agent`: the OrbitMesh Edge Runtime agent (seed 003).
//!
//! ```text
//! orbit-agent --control-plane https://cp.example.net --deployment-token-file /etc/orbit/token \
//!     --reported-address 203.0.113.7
//! ```
//!
//! First start: generates the Ed25519 key into the state directory (mode 0600; default the
//! seed's `/var/lib/orbitmesh/edge-runtime`), registers with the deployment token, then
//! heartbeats on the server's interval, pulls desired state with its current version, applies
//! and reports. The reference applier writes each RuntimeConfiguration's spec to
//! `<state-dir>/configurations/<version>/<id>.json` and reports `applied`; embed
//! `orbit_runtime::agent::Agent` with your own `Applier` for real adapters. Failures back off with
//! jitter; a restart neither re-registers nor re-applies.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a CLI prints its status"
)]

use std::net::IpAddr;
use std::path::PathBuf;

use async_trait::async_trait;
use clap::Parser;
use orbit_runtime::agent::{Agent, AgentConfig, Applier, DEFAULT_STATE_DIR};
use orbit_runtime::server::RuntimeConfiguration;
use orbit_runtime::versions::ApplyStatus;

#[derive(Parser, Debug)]
#[command(name = "orbit-agent", version, about = "OrbitMesh Edge Runtime agent")]
struct Cli {
    /// Control plane base URL.
    #[arg(long)]
    control_plane: String,
    /// File holding the deployment token (enrolment only).
    #[arg(long)]
    deployment_token_file: PathBuf,
    /// State directory (key, identity, applied version).
    #[arg(long, default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// The address to report (public, private or mesh; syntax-checked by the server only).
    #[arg(long)]
    reported_address: Option<IpAddr>,
    /// Hash of this device's fingerprint.
    #[arg(long, default_value = "")]
    device_fingerprint_hash: String,
}

/// Writes each configuration's spec to a file.
struct FileApplier(PathBuf);

#[async_trait]
impl Applier for FileApplier {
    async fn apply(
        &self,
        version: u64,
        configurations: &[RuntimeConfiguration],
    ) -> Vec<(String, ApplyStatus)> {
        let dir = self.0.join("configurations").join(version.to_string());
        let mut out = Vec::new();
        for c in configurations {
            let safe = !c.id.is_empty()
                && c.id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
                && !c.id.starts_with('.');
            let status = if safe
                && std::fs::create_dir_all(&dir).is_ok()
                && std::fs::write(dir.join(format!("{}.json", c.id)), c.spec.to_string()).is_ok()
            {
                ApplyStatus::Applied
            } else {
                ApplyStatus::Failed
            };
            out.push((c.id.clone(), status));
        }
        out
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    iop_bins::init_process("info");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let token = match std::fs::read_to_string(&cli.deployment_token_file) {
        Ok(t) => t.trim().to_owned(),
        Err(e) => {
            eprintln!("orbit-agent: {}: {e}", cli.deployment_token_file.display());
            std::process::exit(2);
        }
    };
    let agent = match Agent::open(AgentConfig {
        control_plane_url: cli.control_plane.trim_end_matches('/').to_owned(),
        deployment_token: token,
        state_dir: cli.state_dir.clone(),
        device_fingerprint_hash: cli.device_fingerprint_hash.clone(),
    }) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("orbit-agent: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "orbit-agent: state in {}, applied version {}",
        cli.state_dir.display(),
        agent.state().applied_version
    );
    let (_tx, addr) = tokio::sync::watch::channel(cli.reported_address);
    let applier = FileApplier(cli.state_dir.clone());
    agent.run(&applier, addr, iop_bins::shutdown_signal()).await;
    println!("orbit-agent: stopped");
}
