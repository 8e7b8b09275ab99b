//! `orbit-control-plane`: the OrbitMesh Edge Runtime control plane (seed 003).
//!
//! ```text
//! orbit-control-plane --listen 0.0.0.0:8480 --public-url https://cp.example.net
//! orbit-control-plane --dns rfc2136 --dns-server 10.0.0.53:53 --dns-zone edge.example.net \
//!     --tsig-key-name orbit --tsig-secret-file /etc/orbit/tsig.b64 \
//!     --acme-directory https://acme-v02.api.letsencrypt.org/directory
//! ```
//!
//! The runtime API (register, heartbeat, desired state, apply results, certificates) listens
//! on `--listen`; the admin API (deployment tokens, endpoints, desired state publishing) on
//! `--admin-listen`, loopback only unless `--admin-allow-remote`. DNS providers: `memory`
//! (default), `rfc2136` (TSIG hmac-sha256), `cloudflare` (token from a file). Certificates need
//! `--acme-directory` and a provider that can write TXT records. State: `--sqlite FILE`,
//! `--postgres URL` (several replicas), or in memory by default.
//!
//! Exit codes: 0 clean stop, 1 runtime failure, 2 invalid arguments.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a CLI prints its status"
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use clap::{Parser, ValueEnum};
use orbit_runtime::certs::AcmeIssuer;
use orbit_runtime::dns::{CloudflareDns, DnsProvider, MemoryDns, Rfc2136Dns, TxtProvider};
use orbit_runtime::server::{ControlPlane, ServerConfig, system_clock};
use orbit_runtime::store::{OrbitStore, PgStore, SqliteStore};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dns {
    Memory,
    Rfc2136,
    Cloudflare,
}

#[derive(Parser, Debug)]
#[command(
    name = "orbit-control-plane",
    version,
    about = "OrbitMesh Edge Runtime control plane"
)]
struct Cli {
    /// Runtime API listen address.
    #[arg(long, default_value = "127.0.0.1:8480")]
    listen: SocketAddr,
    /// Admin API listen address (loopback unless --admin-allow-remote).
    #[arg(long, default_value = "127.0.0.1:8481")]
    admin_listen: SocketAddr,
    /// Allow a non-loopback admin address.
    #[arg(long)]
    admin_allow_remote: bool,
    /// The URL runtimes are told to use (register's `control_plane_url`).
    #[arg(long)]
    public_url: Option<String>,
    /// Heartbeat interval told to runtimes, seconds.
    #[arg(long, default_value_t = 15)]
    heartbeat_secs: u64,
    /// Signed-request timestamp window, seconds each way.
    #[arg(long, default_value_t = 300)]
    window_secs: i64,
    /// DNS provider for endpoint records.
    #[arg(long, value_enum, default_value = "memory")]
    dns: Dns,
    /// RFC 2136: authoritative server `ip:port`.
    #[arg(long)]
    dns_server: Option<SocketAddr>,
    /// RFC 2136: zone.
    #[arg(long)]
    dns_zone: Option<String>,
    /// RFC 2136: TSIG key name.
    #[arg(long)]
    tsig_key_name: Option<String>,
    /// RFC 2136: file holding the base64 TSIG secret.
    #[arg(long)]
    tsig_secret_file: Option<PathBuf>,
    /// Cloudflare: API base URL.
    #[arg(long, default_value = "https://api.cloudflare.com/client/v4")]
    cloudflare_url: String,
    /// Cloudflare: zone id.
    #[arg(long)]
    cloudflare_zone_id: Option<String>,
    /// Cloudflare: file holding the API token.
    #[arg(long)]
    cloudflare_token_file: Option<PathBuf>,
    /// Record TTL, seconds.
    #[arg(long, default_value_t = 60)]
    dns_ttl: u32,
    /// SQLite database file (default: in memory, nothing survives a restart).
    #[arg(long)]
    sqlite: Option<PathBuf>,
    /// PostgreSQL URL, for several replicas sharing state (takes precedence over --sqlite).
    #[arg(long, env = "ORBIT_POSTGRES_URL", hide_env_values = true)]
    postgres: Option<String>,
    /// PostgreSQL schema for the tables.
    #[arg(long, default_value = "orbit")]
    postgres_schema: String,
    /// ACME directory URL (enables certificates).
    #[arg(long)]
    acme_directory: Option<String>,
    /// Extra PEM trust root for the ACME server's HTTPS certificate (test CAs).
    #[arg(long)]
    acme_root: Option<PathBuf>,
}

fn usage(msg: impl std::fmt::Display) -> ! {
    eprintln!("orbit-control-plane: {msg}");
    std::process::exit(2);
}

fn read_secret(path: &PathBuf, what: &str) -> String {
    match std::fs::read_to_string(path) {
        Ok(s) => s.trim().to_owned(),
        Err(e) => usage(format!("{what} {}: {e}", path.display())),
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    iop_bins::init_process("info");
    let _ = rustls::crypto::ring::default_provider().install_default();
    if !cli.admin_listen.ip().is_loopback() && !cli.admin_allow_remote {
        usage("--admin-listen must be a loopback address (or pass --admin-allow-remote)");
    }
    let (dns, txt): (Arc<dyn DnsProvider>, Option<Arc<dyn TxtProvider>>) = match cli.dns {
        Dns::Memory => (Arc::new(MemoryDns::default()), None),
        Dns::Rfc2136 => {
            let (Some(server), Some(zone), Some(key), Some(secret)) = (
                cli.dns_server,
                &cli.dns_zone,
                &cli.tsig_key_name,
                &cli.tsig_secret_file,
            ) else {
                usage(
                    "--dns rfc2136 needs --dns-server, --dns-zone, --tsig-key-name and --tsig-secret-file",
                );
            };
            let secret = base64::engine::general_purpose::STANDARD
                .decode(read_secret(secret, "--tsig-secret-file"))
                .unwrap_or_else(|_| usage("--tsig-secret-file: not base64"));
            let p = Arc::new(
                Rfc2136Dns::new(server, zone, key, secret, cli.dns_ttl)
                    .unwrap_or_else(|_| usage("--dns-zone and --tsig-key-name must be DNS names")),
            );
            (p.clone(), Some(p))
        }
        Dns::Cloudflare => {
            let (Some(zone), Some(token)) = (&cli.cloudflare_zone_id, &cli.cloudflare_token_file)
            else {
                usage("--dns cloudflare needs --cloudflare-zone-id and --cloudflare-token-file");
            };
            let token = read_secret(token, "--cloudflare-token-file");
            let p = Arc::new(
                CloudflareDns::new(&cli.cloudflare_url, zone, &token, cli.dns_ttl)
                    .unwrap_or_else(|e| usage(e)),
            );
            (p.clone(), Some(p))
        }
    };
    let public_url = cli
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{}", cli.listen));
    let mut config = ServerConfig::new(&public_url);
    config.heartbeat_interval = Duration::from_secs(cli.heartbeat_secs.max(1));
    config.window_secs = cli.window_secs.max(1);
    let store: Arc<dyn OrbitStore> = match (&cli.postgres, &cli.sqlite) {
        (Some(url), _) => match PgStore::connect(url, &cli.postgres_schema).await {
            Ok(s) => Arc::new(s),
            Err(e) => {
                eprintln!("orbit-control-plane: postgres: {e}");
                std::process::exit(1);
            }
        },
        (None, Some(path)) => match SqliteStore::open(path) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                eprintln!("orbit-control-plane: sqlite {}: {e}", path.display());
                std::process::exit(1);
            }
        },
        (None, None) => match SqliteStore::in_memory() {
            Ok(s) => Arc::new(s),
            Err(e) => {
                eprintln!("orbit-control-plane: {e}");
                std::process::exit(1);
            }
        },
    };
    let mut cp = ControlPlane::new(config, store, dns, system_clock());
    if let Some(directory) = &cli.acme_directory {
        let Some(txt) = txt else {
            usage(
                "--acme-directory needs a DNS provider that writes TXT records (rfc2136 or cloudflare)",
            );
        };
        match AcmeIssuer::new(directory, cli.acme_root.as_deref(), txt).await {
            Ok(issuer) => cp = cp.with_acme(Arc::new(issuer)),
            Err(e) => {
                eprintln!("orbit-control-plane: {e}");
                std::process::exit(1);
            }
        }
    }
    let api = match tokio::net::TcpListener::bind(cli.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("orbit-control-plane: listen {}: {e}", cli.listen);
            std::process::exit(1);
        }
    };
    let admin = match tokio::net::TcpListener::bind(cli.admin_listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "orbit-control-plane: admin listen {}: {e}",
                cli.admin_listen
            );
            std::process::exit(1);
        }
    };
    println!(
        "orbit-control-plane: runtime API on http://{}",
        api.local_addr().map_or(cli.listen, |a| a)
    );
    println!(
        "orbit-control-plane: admin API on http://{}",
        admin.local_addr().map_or(cli.admin_listen, |a| a)
    );
    let (api_app, admin_app) = (cp.router(), cp.admin_router());
    let stop = iop_bins::shutdown_signal();
    // The runtime API faces the agents' network: served with the Edge's bounded HTTP server
    // (connection cap, header-read and keep-alive idle timeout, accept back-off), which only
    // needs an axum Router (the two systems share no code beyond it).
    let limits = bounded_http::ServeLimits::default();
    let never = std::future::pending::<()>;
    tokio::select! {
        r = bounded_http::serve_with(api, api_app, limits, None, never()) => if let Err(e) = r { eprintln!("orbit-control-plane: {e}"); std::process::exit(1) },
        r = bounded_http::serve_with(admin, admin_app, limits, None, never()) => if let Err(e) = r { eprintln!("orbit-control-plane: {e}"); std::process::exit(1) },
        () = stop => println!("orbit-control-plane: stopped"),
    }
}
