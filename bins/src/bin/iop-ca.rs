//! `iop-ca`: a small workload CA for a real deployment.
//!
//! ```text
//! iop-ca init  --dir /etc/iop/ca --trust-domain iop.example
//! iop-ca issue --dir /etc/iop/ca --role edge --name edge-1 --dns edge.example --out /etc/iop/edge
//! iop-ca issue --dir /etc/iop/ca --role node --name node-1 --out /etc/iop/node-1
//! iop-ca issue --dir /etc/iop/ca --role control-plane --name cp-1 --dns cp.example --out /etc/iop/cp
//! ```
//!
//! `init` writes `ca.pem` (the bundle every workload trusts) and `ca.key`; `issue` writes
//! `<out>.pem` and `<out>.key`. Every file is written 0600 through a temporary file renamed
//! into place (a process watching it never reads half a file), and an existing file is never
//! replaced without `--force` — which is how a certificate is rotated: `issue --force` over the
//! running workload's files, which the Edge, Nodes and Control Plane reload by themselves.
//! Exit codes: 0 done, 1 failed, 2 invalid arguments.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a CLI prints its status"
)]

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use workload_identity::ca::{CaError, WorkloadCa, write_private};

#[derive(Debug, Parser)]
#[command(
    name = "iop-ca",
    version,
    about = "A small workload CA: a CA and SPIFFE certificates for the Edge, Nodes and Control Plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a CA: <dir>/ca.pem (trusted by every workload) and <dir>/ca.key.
    Init {
        /// Directory for the CA's files (created if missing).
        #[arg(long)]
        dir: PathBuf,
        /// The SPIFFE trust domain of every certificate this CA issues (e.g. iop.example).
        #[arg(long)]
        trust_domain: String,
        /// Validity in days.
        #[arg(long, default_value_t = 3650)]
        days: u32,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
    },
    /// Issue a workload certificate: spiffe://<trust domain>/<role>/<name>.
    Issue {
        /// The CA's directory (from `init`).
        #[arg(long)]
        dir: PathBuf,
        /// edge, node or control-plane.
        #[arg(long, value_parser = ["edge", "node", "control-plane"])]
        role: String,
        /// The workload's name: the Edge's edge_id, the Node's node_id, the Control Plane's name.
        #[arg(long)]
        name: String,
        /// A DNS name clients dial (servers: the Edge for Nodes, the Control Plane for Edges).
        /// Repeatable.
        #[arg(long)]
        dns: Vec<String>,
        /// An IP address clients dial. Repeatable.
        #[arg(long)]
        ip: Vec<IpAddr>,
        /// Validity in days.
        #[arg(long, default_value_t = 90)]
        days: u32,
        /// Output path without extension: writes <out>.pem and <out>.key
        /// [default: <dir>/<role>-<name>].
        #[arg(long)]
        out: Option<PathBuf>,
        /// Replace existing files (certificate rotation).
        #[arg(long)]
        force: bool,
    },
}

fn run(cli: Cli) -> Result<(), CaError> {
    match cli.command {
        Command::Init {
            dir,
            trust_domain,
            days,
            force,
        } => {
            std::fs::create_dir_all(&dir).map_err(|source| CaError::Io {
                path: dir.display().to_string(),
                source,
            })?;
            let (cert, key) = (dir.join("ca.pem"), dir.join("ca.key"));
            if !force {
                for p in [&cert, &key] {
                    if p.exists() {
                        return Err(CaError::Exists(p.display().to_string()));
                    }
                }
            }
            let ca = WorkloadCa::generate(&trust_domain, days)?;
            write_private(&key, ca.key_pem().as_bytes(), force)?;
            write_private(&cert, ca.cert_pem().as_bytes(), force)?;
            println!("iop-ca: CA for trust domain {trust_domain}");
            println!("iop-ca: wrote {} and {}", cert.display(), key.display());
        }
        Command::Issue {
            dir,
            role,
            name,
            dns,
            ip,
            days,
            out,
            force,
        } => {
            let ca = WorkloadCa::load(&dir)?;
            let out = out.unwrap_or_else(|| dir.join(format!("{role}-{name}")));
            let with = |ext: &str| {
                let mut p = out.clone().into_os_string();
                p.push(ext);
                PathBuf::from(p)
            };
            let (cert, key) = (with(".pem"), with(".key"));
            if !force {
                for p in [&cert, &key] {
                    if p.exists() {
                        return Err(CaError::Exists(p.display().to_string()));
                    }
                }
            }
            let issued = ca.issue(&role, &name, &dns, &ip, days)?;
            // Key first: a watcher that sees the new certificate finds its key already there.
            write_private(&key, issued.key_pem.as_bytes(), force)?;
            write_private(&cert, issued.cert_pem.as_bytes(), force)?;
            println!(
                "iop-ca: spiffe://{}/{role}/{name}, valid {days} days",
                ca.trust_domain()
            );
            println!("iop-ca: wrote {} and {}", cert.display(), key.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("iop-ca: {e}");
            ExitCode::from(1)
        }
    }
}
