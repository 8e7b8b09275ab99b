//! `iop-cp`: the IOP Control Plane binary — the Edge wire server and the admin CLI.
//!
//! ```text
//! iop-cp --data-dir DIR init                                     # store, master and issuer keys
//! iop-cp --data-dir DIR serve --tls-ca ca.pem --tls-cert cp.pem --tls-key cp.key \
//!        --trust-domain iop.local --credential-plane
//! iop-cp --data-dir DIR principal create team-a --name "Team A"
//! iop-cp --data-dir DIR token create --principal team-a          # prints the token once
//! iop-cp --data-dir DIR principal limits team-a --requests-per-minute 60 \
//!        --tokens-per-minute 100000 --budget-usd-per-month 20 --model gpt-4o:concurrent=2
//! IOP_CREDENTIAL=sk-... iop-cp --data-dir DIR slot put openai-prod --profile openai \
//!        --credential-env IOP_CREDENTIAL
//! iop-cp --data-dir DIR route put r1 --principal team-a --model gpt-4o-mini \
//!        --slot openai-prod --target gpt-4o-mini
//! iop-cp --data-dir DIR issuer-key > cp-issuer.pub.pem           # the PEM Nodes pin
//! iop-cp --data-dir DIR issuer-key rotate --overlap-secs 86400 > cp-issuer-next.pub.pem
//! ```
//!
//! The data directory (`--data-dir`, before or after the subcommand; default
//! `$XDG_DATA_HOME/iop-cp` or `~/.local/share/iop-cp`) holds the SQLite store
//! (`iop-cp.sqlite3`, unless `--postgres URL`) and the at-rest master key (`master.key`, mode
//! 0600), created by `init` or `serve`. Every other command refuses a directory without them,
//! so a CLI run from elsewhere never writes to a new, empty store by accident. The lease
//! issuer key lives in the store, sealed with the master key (an older data directory's
//! `issuer.pem` is imported once).
//!
//! Replicas: `serve --postgres URL` on each, on one database; copy `master.key` from the first
//! replica's data directory to the others (a replica without it refuses a store that holds
//! slots or issuer keys). Edges list every replica in `[control_plane] addresses`.
//!
//! The issuer key's id is derived from the key (`iop_lease::issuer_key_id`, `p256:` + 16 hex
//! digits); `issuer-key` prints it, and a Node derives the same id from the PEM it pins.
//! Rotation is staged: `issuer-key rotate --overlap-secs N` publishes the next key, leases
//! stay signed with the current one for N seconds (pin the new key on the Nodes meanwhile),
//! then a running `serve --credential-plane` activates it; `issuer-key activate` switches at
//! once.
//!
//! CLI commands write the store directly; a running server notices at once (SQLite
//! `PRAGMA data_version` every 20 ms, PostgreSQL `LISTEN/NOTIFY`; `--store-poll-ms` is the
//! safety net) and pushes the projection to every Edge. An Edge whose lease is refused as
//! stale meanwhile waits for that projection and re-binds once (`iop_edge::http`), so a
//! mutation never fails a request it does not concern. Credentials are never taken on the
//! command line (other users can read it): use `--credential-env`, `--credential-file` or
//! stdin.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 invalid arguments or configuration.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a CLI prints its answers"
)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use iop_cp::admin::Admin;
use iop_cp::data_dir::{self, Backend, DataDirError, Mode};
use iop_cp::lease::LeaseService;
use iop_cp::server::{self, ServerConfig};
use iop_cp::store::Mutation;
use iop_lease::{DEFAULT_MAX_TTL, IssuerSigningKey};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::sync::CancellationToken;
use workload_identity::WorkloadTls;
use workload_identity::reload::{self as tls_reload, TlsPaths};
use workload_identity::{ExpectedPeer, role};
use zeroize::Zeroizing;

#[derive(Parser, Debug)]
#[command(
    name = "iop-cp",
    version,
    about = "IOP Control Plane: Edge wire server and admin CLI"
)]
struct Cli {
    /// Data directory (the SQLite store and the master key). Default: `$XDG_DATA_HOME/iop-cp`, else
    /// `$HOME/.local/share/iop-cp` — the same directory from wherever the CLI runs. Accepted
    /// before or after the subcommand.
    #[arg(long, env = "IOP_CP_DATA_DIR", global = true)]
    data_dir: Option<PathBuf>,
    /// Use this PostgreSQL database (`postgres://user@host:port/db`) instead of the SQLite file;
    /// for several replicas. Accepted before or after the subcommand.
    #[arg(long, env = "IOP_CP_POSTGRES", global = true, hide_env_values = true)]
    postgres: Option<String>,
    /// With --postgres: keep the tables in this schema (created if needed; lowercase letters,
    /// digits and `_`), so several deployments can share one database.
    #[arg(
        long,
        env = "IOP_CP_POSTGRES_SCHEMA",
        global = true,
        requires = "postgres"
    )]
    postgres_schema: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create the data directory, the store, the master key and the issuer key (idempotent);
    /// every other command but `serve` needs an existing store.
    Init,
    /// Run the Edge wire server and the loopback admin API (creates the store if needed).
    Serve(ServeArgs),
    /// Principals.
    #[command(subcommand)]
    Principal(PrincipalCmd),
    /// IOP API tokens.
    #[command(subcommand)]
    Token(TokenCmd),
    /// Credential slots.
    #[command(subcommand)]
    Slot(SlotCmd),
    /// Routes.
    #[command(subcommand)]
    Route(RouteCmd),
    /// Print the lease issuer's public key (PEM, on stdout) for Nodes to pin; its key id and
    /// a Node config snippet go to stderr. `rotate` stages a new key with an overlap,
    /// `activate` switches to the staged key now, `list` shows both.
    IssuerKey(IssuerKeyArgs),
    /// Print the mutation log.
    Revisions {
        /// Only after this generation.
        #[arg(long, default_value_t = 0)]
        after: u64,
    },
    /// Print the usage managed Edges reported: requests, tokens and cost per UTC day,
    /// principal, model and outcome (the daily rollup; see `iop_cp::usage`).
    Usage {
        /// Only from this UTC day on (`YYYY-MM-DD`).
        #[arg(long)]
        since: Option<String>,
        /// JSON (one object with a `usage` array, as the admin API answers) instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
struct IssuerKeyArgs {
    /// Print the staged key (the one `rotate` published) instead of the active one.
    #[arg(long)]
    staged: bool,
    #[command(subcommand)]
    action: Option<IssuerKeyCmd>,
}

#[derive(Subcommand, Debug)]
enum IssuerKeyCmd {
    /// Stage a new issuer key and print its public key (PEM, stdout). Leases stay signed with
    /// the current key for `--overlap-secs`; pin the new key on every Node meanwhile (Edges
    /// report the Nodes that do not trust it). Then a running `iop-cp serve
    /// --credential-plane` (any replica) activates it: from then on Edges stop selecting Nodes
    /// that do not trust it.
    Rotate {
        /// How long the current key keeps signing before the new one takes over (seconds;
        /// 0 switches at once, for a compromised key).
        #[arg(long)]
        overlap_secs: u64,
    },
    /// Activate the staged key now, without waiting for the end of the overlap.
    Activate,
    /// List the active and the staged key: state, key id, and when it was or will be
    /// activated (Unix ms).
    List,
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// OpenTelemetry collector base URL for the Control Plane's spans (each lease request is a
    /// span of the Edge's trace). Unset: the standard OTEL_EXPORTER_OTLP_ENDPOINT (and the
    /// other OTEL_* variables); tracing is off when neither names one.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// Days the raw usage records of managed Edges are kept; the daily rollup stays for good.
    /// Keep it longer than any Edge may stay cut off (a record replayed after its raw row is
    /// gone would count again).
    #[arg(long, default_value_t = iop_cp::usage::DEFAULT_RETENTION_DAYS)]
    usage_retention_days: u32,
    /// Edge wire listen address.
    #[arg(long, default_value = "127.0.0.1:7600")]
    listen: SocketAddr,
    /// Admin API listen address (loopback unless --admin-allow-remote).
    #[arg(long, default_value = "127.0.0.1:7601")]
    admin_listen: SocketAddr,
    /// Allow a non-loopback admin listen address.
    #[arg(long)]
    admin_allow_remote: bool,
    /// Bearer token the admin API requires (env; recommended with --admin-allow-remote).
    #[arg(long, env = "IOP_CP_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// PEM bundle of the workload CA (verifies Edge certificates in managed mode).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// PEM certificate chain of this Control Plane (URI SAN spiffe://TD/control-plane/NAME).
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// PEM private key of this Control Plane.
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// Trust domain of the workload identities.
    #[arg(long)]
    trust_domain: Option<String>,
    /// Managed mode: re-read --tls-ca, --tls-cert and --tls-key this often, in seconds (0 =
    /// never); a rotated certificate is used by new Edge connections without a restart, an
    /// invalid one is refused with a log line. (Legacy TLS is read once.)
    #[arg(long, default_value_t = 5)]
    tls_reload_sec: u64,
    /// Managed mode (`credential_plane.enabled`): mTLS, projection and leases.
    #[arg(long)]
    credential_plane: bool,
    /// Lease lifetime in seconds (1..=60).
    #[arg(long, default_value_t = 30)]
    lease_ttl_secs: u64,
    /// Heartbeat interval told to Edges, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    heartbeat_ms: u64,
    /// How often the store generation is read at the latest to notice mutations made by the
    /// CLI or another replica, in milliseconds (a safety net: they are noticed at once, see
    /// --store-watch).
    #[arg(long, default_value_t = 500)]
    store_poll_ms: u64,
    /// Notice mutations made by the CLI or another replica at once (SQLite `data_version`
    /// checked every 20 ms, PostgreSQL LISTEN/NOTIFY); `false` leaves only --store-poll-ms.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    store_watch: bool,
}

#[derive(Subcommand, Debug)]
enum PrincipalCmd {
    /// Create an enabled principal.
    Create {
        /// Principal id.
        id: String,
        /// Display name.
        #[arg(long, default_value = "")]
        name: String,
    },
    /// Disable a principal (its tokens and routes leave the projection).
    Disable {
        /// Principal id.
        id: String,
    },
    /// Enable a principal.
    Enable {
        /// Principal id.
        id: String,
    },
    /// Set a principal's rate limits and spend budgets, enforced by every Edge from the next
    /// projection (the rule, headers and refusals are `iop_edge::limits`'s). Each option left
    /// out is not limited; with no option (or `--clear`) the principal is not limited at all.
    /// Prints the limits now in force as JSON.
    Limits(LimitsArgs),
}

#[derive(clap::Args, Debug)]
struct LimitsArgs {
    /// Principal id.
    id: String,
    /// Requests per minute (a GCRA rate: a steady 1/60 of it per second, bursts up to it).
    #[arg(long)]
    requests_per_minute: Option<u64>,
    /// Tokens (input + output) per minute; a request reserves its output cap plus its input
    /// estimate, settled to the provider's reported usage at the end.
    #[arg(long)]
    tokens_per_minute: Option<u64>,
    /// Requests in flight at once, per Edge.
    #[arg(long)]
    concurrent: Option<u32>,
    /// Spend budget per UTC day, US dollars, at each Edge's `[prices.<model>]`.
    #[arg(long)]
    budget_usd_per_day: Option<f64>,
    /// Spend budget per UTC calendar month, US dollars.
    #[arg(long)]
    budget_usd_per_month: Option<f64>,
    /// A limit on one model, checked as well as the principal's own:
    /// `MODEL:requests_per_minute=N,tokens_per_minute=N,concurrent=N` (each part optional;
    /// repeat for several models).
    #[arg(long = "model", value_name = "MODEL:LIMITS")]
    models: Vec<String>,
    /// Remove every limit (the same as giving none).
    #[arg(long, conflicts_with_all = ["requests_per_minute", "tokens_per_minute", "concurrent", "budget_usd_per_day", "budget_usd_per_month", "models"])]
    clear: bool,
    /// Print the limits in force and change nothing.
    #[arg(long, conflicts_with_all = ["requests_per_minute", "tokens_per_minute", "concurrent", "budget_usd_per_day", "budget_usd_per_month", "models", "clear"])]
    show: bool,
}

impl LimitsArgs {
    fn doc(&self) -> Result<iop_cp::store::LimitsDoc, String> {
        let mut doc = iop_cp::store::LimitsDoc {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            concurrent: self.concurrent,
            budget_usd_per_day: self.budget_usd_per_day,
            budget_usd_per_month: self.budget_usd_per_month,
            models: std::collections::BTreeMap::new(),
        };
        for spec in &self.models {
            let (model, parts) = spec.split_once(':').unwrap_or((spec, ""));
            let mut m = iop_cp::store::ModelLimitsDoc::default();
            for part in parts.split(',').filter(|p| !p.is_empty()) {
                let (k, v) = part
                    .split_once('=')
                    .ok_or_else(|| format!("--model {spec}: expected NAME=VALUE, got `{part}`"))?;
                let n: u64 = v
                    .parse()
                    .map_err(|_| format!("--model {spec}: `{v}` is not a whole number"))?;
                match k {
                    "requests_per_minute" => m.requests_per_minute = Some(n),
                    "tokens_per_minute" => m.tokens_per_minute = Some(n),
                    "concurrent" => {
                        m.concurrent = Some(u32::try_from(n).map_err(|_| {
                            format!("--model {spec}: concurrent is at most {}", u32::MAX)
                        })?);
                    }
                    other => {
                        return Err(format!(
                            "--model {spec}: `{other}` is not requests_per_minute, tokens_per_minute or concurrent"
                        ));
                    }
                }
            }
            if doc.models.insert(model.to_owned(), m).is_some() {
                return Err(format!("--model {model} is given twice"));
            }
        }
        Ok(doc)
    }
}

#[derive(Subcommand, Debug)]
enum TokenCmd {
    /// Create a token; it is printed once and only its SHA-256 digest is stored.
    Create {
        /// Owning principal.
        #[arg(long)]
        principal: String,
    },
    /// Revoke a token.
    Revoke {
        /// Token id.
        id: String,
    },
}

#[derive(Subcommand, Debug)]
enum SlotCmd {
    /// Create or rotate a credential slot (sealed at rest with the master key).
    Put {
        /// Slot id.
        id: String,
        /// Protocol profile (e.g. `openai`).
        #[arg(long)]
        profile: String,
        /// Header the Node writes.
        #[arg(long, default_value = "authorization")]
        header: String,
        /// Prefix before the credential in that header.
        #[arg(long, default_value = "Bearer ")]
        prefix: String,
        /// Read the credential from this environment variable.
        #[arg(long, conflicts_with = "credential_file")]
        credential_env: Option<String>,
        /// Read the credential from this file (trailing newline removed); `-` for stdin.
        #[arg(long)]
        credential_file: Option<PathBuf>,
    },
    /// Disable a slot.
    Disable {
        /// Slot id.
        id: String,
    },
}

#[derive(Subcommand, Debug)]
enum RouteCmd {
    /// Create or update a route (principal + model → slot, upstream target).
    Put {
        /// Route id.
        id: String,
        /// Principal.
        #[arg(long)]
        principal: String,
        /// External model name.
        #[arg(long)]
        model: String,
        /// Credential slot.
        #[arg(long)]
        slot: String,
        /// Upstream target (the provider's model).
        #[arg(long)]
        target: String,
        /// Provider selector.
        #[arg(long, default_value = "")]
        selector: String,
    },
    /// Disable a route.
    Disable {
        /// Route id.
        id: String,
    },
}

/// A failure and its exit code.
struct Failure(i32, String);

fn usage(msg: impl Into<String>) -> Failure {
    Failure(2, msg.into())
}

fn runtime(msg: impl Into<String>) -> Failure {
    Failure(1, msg.into())
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    iop_bins::init_process("info");
    if let Err(Failure(code, msg)) = run(cli).await {
        eprintln!("iop-cp: {msg}");
        std::process::exit(code);
    }
}

/// The data directory: `--data-dir`, else `$XDG_DATA_HOME/iop-cp`, else
/// `$HOME/.local/share/iop-cp`.
fn data_dir(cli: &Cli) -> Result<PathBuf, Failure> {
    if let Some(d) = &cli.data_dir {
        return Ok(d.clone());
    }
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
                .map(|h| h.join(".local/share"))
        })
        .ok_or_else(|| usage("no --data-dir given and neither XDG_DATA_HOME nor HOME is set"))?;
    Ok(base.join("iop-cp"))
}

/// The store's active issuer key (`iop_cp::data_dir::issuer_key`: a legacy `issuer.pem` is
/// imported once, never replaced), with a note when that file is left over.
async fn issuer_key(admin: &Admin, dir: &Path) -> Result<IssuerSigningKey, Failure> {
    let found = data_dir::issuer_key(admin, dir)
        .await
        .map_err(data_dir_failure)?;
    if let Some(legacy) = found.legacy_file_left {
        eprintln!(
            "iop-cp: note: {} is no longer read (the issuer key lives in the store, sealed with master.key); delete it",
            legacy.display()
        );
    }
    Ok(found.key)
}

/// Usage errors (exit 2) are the operator's to fix; the rest are runtime failures.
fn data_dir_failure(e: DataDirError) -> Failure {
    match e {
        DataDirError::NoData { .. }
        | DataDirError::MissingMasterKey { .. }
        | DataDirError::LegacyIssuerKey { .. } => usage(e.to_string()),
        _ => runtime(e.to_string()),
    }
}

/// The Node config lines pinning `paths` (one `[[credential_plane.issuers]]` each).
fn node_snippet(pins: &[(&str, &str)]) -> String {
    let mut s = String::from(
        "[credential_plane]\nenabled = true\nrecipient_key = \"/var/lib/iop/node.x25519.pem\"\nrecipient_key_id = \"node-key-1\"\n",
    );
    for (path, id) in pins {
        s.push_str(&format!(
            "[[credential_plane.issuers]]\npublic_key = \"{path}\"\n# key_id = \"{id}\"   (optional: derived from the key)\n"
        ));
    }
    s
}

async fn open(cli: &Cli, dir: &Path) -> Result<Admin, Failure> {
    let mode = match cli.command {
        Command::Init | Command::Serve(_) => Mode::Create,
        _ => Mode::Existing,
    };
    let backend = match &cli.postgres {
        Some(url) => Backend::Postgres {
            url: url.clone(),
            schema: cli.postgres_schema.clone(),
        },
        None => Backend::Sqlite,
    };
    data_dir::open(dir, &backend, mode)
        .await
        .map_err(data_dir_failure)
}

fn read_credential(env: Option<&str>, file: Option<&Path>) -> Result<Zeroizing<Vec<u8>>, Failure> {
    let raw = match (env, file) {
        (Some(var), None) => std::env::var(var)
            .map_err(|_| usage(format!("--credential-env: {var} is not set")))?
            .into_bytes(),
        (None, Some(p)) if p == Path::new("-") => {
            let mut s = String::new();
            std::io::stdin()
                .read_line(&mut s)
                .map_err(|e| runtime(format!("stdin: {e}")))?;
            s.into_bytes()
        }
        (None, Some(p)) => std::fs::read(p)
            .map_err(|e| usage(format!("--credential-file {}: {e}", p.display())))?,
        _ => {
            return Err(usage(
                "give the credential with --credential-env or --credential-file",
            ));
        }
    };
    let mut raw = Zeroizing::new(raw);
    while raw.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        raw.pop();
    }
    Ok(raw)
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let dir = data_dir(&cli)?;
    let admin = open(&cli, &dir).await?;
    let fail = |e: iop_cp::admin::AdminError| runtime(e.to_string());
    match &cli.command {
        Command::Init => {
            let key = issuer_key(&admin, &dir).await?;
            println!(
                "iop-cp: data in {} (generation {}); issuer key id {}",
                dir.display(),
                admin
                    .store()
                    .generation()
                    .await
                    .map_err(|e| runtime(e.to_string()))?,
                key.key_id()
            );
            Ok(())
        }
        Command::Serve(args) => serve(&dir, admin, args).await,
        Command::Principal(PrincipalCmd::Create { id, name }) => {
            let g = admin.create_principal(id, name).await.map_err(fail)?;
            println!("principal {id} created (generation {g})");
            Ok(())
        }
        Command::Principal(PrincipalCmd::Disable { id } | PrincipalCmd::Enable { id }) => {
            let enabled = matches!(cli.command, Command::Principal(PrincipalCmd::Enable { .. }));
            let g = admin
                .apply(Mutation::SetPrincipalEnabled {
                    id: id.clone(),
                    enabled,
                })
                .await
                .map_err(fail)?;
            println!("principal {id} enabled={enabled} (generation {g})");
            Ok(())
        }
        Command::Principal(PrincipalCmd::Limits(args)) => {
            let show = |limits: Option<&iop_cp::store::PrincipalLimits>| {
                let doc = limits.map(iop_cp::store::LimitsDoc::of).unwrap_or_default();
                serde_json::to_string(&doc).unwrap_or_default()
            };
            if args.show {
                let snap = admin
                    .store()
                    .snapshot()
                    .await
                    .map_err(|e| runtime(e.to_string()))?;
                let p = snap
                    .principals
                    .iter()
                    .find(|p| p.id == args.id)
                    .ok_or_else(|| runtime(format!("principal {} not found", args.id)))?;
                println!("{}", show(p.limits.as_ref()));
                return Ok(());
            }
            let doc = args.doc().map_err(usage)?;
            let g = admin
                .set_principal_limits(&args.id, &doc)
                .await
                .map_err(fail)?;
            let limits = doc.to_limits().ok().filter(|l| *l != Default::default());
            println!("{}", show(limits.as_ref()));
            eprintln!("principal {} limits set (generation {g})", args.id);
            Ok(())
        }
        Command::Token(TokenCmd::Create { principal }) => {
            let t = admin.create_token(principal).await.map_err(fail)?;
            println!("token_id: {}", t.token_id);
            println!("token: {}", t.token.as_str());
            eprintln!("(the token is shown once; only its SHA-256 digest is stored)");
            Ok(())
        }
        Command::Token(TokenCmd::Revoke { id }) => {
            let g = admin.revoke_token(id).await.map_err(fail)?;
            println!("token {id} revoked (generation {g})");
            Ok(())
        }
        Command::Slot(SlotCmd::Put {
            id,
            profile,
            header,
            prefix,
            credential_env,
            credential_file,
        }) => {
            let credential =
                read_credential(credential_env.as_deref(), credential_file.as_deref())?;
            let g = admin
                .put_slot(id, profile, header, prefix, &credential)
                .await
                .map_err(fail)?;
            println!("slot {id} stored, sealed (generation {g})");
            Ok(())
        }
        Command::Slot(SlotCmd::Disable { id }) => {
            let g = admin
                .apply(Mutation::SetSlotEnabled {
                    id: id.clone(),
                    enabled: false,
                })
                .await
                .map_err(fail)?;
            println!("slot {id} disabled (generation {g})");
            Ok(())
        }
        Command::Route(RouteCmd::Put {
            id,
            principal,
            model,
            slot,
            target,
            selector,
        }) => {
            let g = admin
                .put_route(id, principal, model, slot, target, selector)
                .await
                .map_err(fail)?;
            println!("route {id} stored (generation {g})");
            Ok(())
        }
        Command::Route(RouteCmd::Disable { id }) => {
            let g = admin
                .apply(Mutation::SetRouteEnabled {
                    id: id.clone(),
                    enabled: false,
                })
                .await
                .map_err(fail)?;
            println!("route {id} disabled (generation {g})");
            Ok(())
        }
        Command::IssuerKey(args) => issuer_key_cmd(&admin, &dir, args).await,
        Command::Usage { since, json } => {
            if since.as_deref().is_some_and(|d| !iop_cp::store::is_day(d)) {
                return Err(usage("--since must be YYYY-MM-DD"));
            }
            let rows = admin
                .store()
                .usage_daily(since.as_deref(), u32::MAX)
                .await
                .map_err(|e| runtime(e.to_string()))?;
            if *json {
                println!("{}", serde_json::json!({ "usage": rows }));
            } else {
                print!("{}", iop_cp::usage::table(&rows));
            }
            Ok(())
        }
        Command::Revisions { after } => {
            let rows = admin
                .store()
                .revisions(*after, 1000)
                .await
                .map_err(|e| runtime(e.to_string()))?;
            for r in rows {
                println!("{}\t{}\t{}", r.generation, r.kind, r.object_id);
            }
            Ok(())
        }
    }
}

fn tls_config(args: &ServeArgs) -> Result<Arc<rustls::ServerConfig>, Failure> {
    let (Some(cert_path), Some(key_path)) = (&args.tls_cert, &args.tls_key) else {
        return Err(usage(if args.credential_plane {
            "--credential-plane requires mTLS: give --tls-ca, --tls-cert, --tls-key and --trust-domain"
        } else {
            "the Edge wire is TLS: give --tls-cert and --tls-key"
        }));
    };
    let read = |p: &PathBuf, what: &str| {
        std::fs::read(p).map_err(|e| usage(format!("{what} {}: {e}", p.display())))
    };
    if !args.credential_plane {
        let chain = CertificateDer::pem_slice_iter(&read(cert_path, "--tls-cert")?)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| usage("--tls-cert: not a PEM certificate chain"))?;
        let key = PrivateKeyDer::from_pem_slice(&read(key_path, "--tls-key")?)
            .map_err(|_| usage("--tls-key: no PEM private key"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| usage(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| usage(format!("--tls-cert/--tls-key: {e}")))?;
        return Ok(Arc::new(config));
    }
    let (Some(ca_path), Some(td)) = (&args.tls_ca, &args.trust_domain) else {
        return Err(usage(
            "--credential-plane requires mTLS: give --tls-ca and --trust-domain as well",
        ));
    };
    let material = WorkloadTls::from_pem(
        &read(ca_path, "--tls-ca")?,
        &read(cert_path, "--tls-cert")?,
        &read(key_path, "--tls-key")?,
    )
    .map_err(|e| usage(format!("--tls-ca/--tls-cert/--tls-key: {e}")))?;
    let expected = ExpectedPeer::any_name(td, role::EDGE)
        .map_err(|e| usage(format!("--trust-domain: {e}")))?;
    let config = material
        .server_config(expected)
        .map_err(|e| usage(format!("--tls-ca: {e}")))?;
    if args.tls_reload_sec > 0 {
        let paths = TlsPaths {
            ca: ca_path.clone(),
            cert: cert_path.clone(),
            key: key_path.clone(),
        };
        let every = Duration::from_secs(args.tls_reload_sec);
        tls_reload::spawn(
            material,
            paths,
            every,
            "control-plane",
            CancellationToken::new(),
        );
    }
    Ok(Arc::new(config))
}

async fn issuer_key_cmd(admin: &Admin, dir: &Path, args: &IssuerKeyArgs) -> Result<(), Failure> {
    let active = issuer_key(admin, dir).await?;
    let fail = |e: iop_cp::admin::AdminError| runtime(e.to_string());
    let keys = admin.issuer_keys().await.map_err(fail)?;
    let staged = keys.iter().find(|(k, _)| !k.active);
    let in_secs =
        |at_ms: i64| (at_ms - iop_wire::time::unix_ms(std::time::SystemTime::now())).max(0) / 1000;
    match &args.action {
        None if args.staged => {
            let (meta, key) = staged.ok_or_else(|| {
                usage("no issuer key is staged (stage one with `iop-cp issuer-key rotate`)")
            })?;
            print!("{}", key.to_pem());
            eprintln!(
                "staged key id: {} (activates in {} s; the active key is {})",
                meta.id,
                in_secs(meta.activates_at_unix_ms),
                active.key_id()
            );
            Ok(())
        }
        None => {
            print!("{}", active.public_key().to_pem());
            eprintln!("key id: {}", active.key_id());
            eprintln!(
                "Save the PEM above on each Node (e.g. `iop-cp issuer-key > /etc/iop/cp-issuer.pub.pem`) and pin it in the Node's config:\n\n{}",
                node_snippet(&[("/etc/iop/cp-issuer.pub.pem", active.key_id())])
            );
            if let Some((meta, _)) = staged {
                eprintln!(
                    "A new key {} is staged and activates in {} s: print it with `iop-cp issuer-key --staged` and pin it too.",
                    meta.id,
                    in_secs(meta.activates_at_unix_ms)
                );
            }
            Ok(())
        }
        Some(IssuerKeyCmd::List) => {
            for (meta, _) in &keys {
                println!(
                    "{}\t{}\t{}",
                    if meta.active { "active" } else { "staged" },
                    meta.id,
                    meta.activates_at_unix_ms
                );
            }
            Ok(())
        }
        Some(IssuerKeyCmd::Rotate { overlap_secs }) => {
            if let Some((meta, _)) = staged {
                return Err(usage(format!(
                    "key {} is already staged (activates in {} s); `iop-cp issuer-key activate` switches to it now",
                    meta.id,
                    in_secs(meta.activates_at_unix_ms)
                )));
            }
            let overlap_ms = i64::try_from(overlap_secs.saturating_mul(1000))
                .map_err(|_| usage("--overlap-secs is too large"))?;
            let at =
                iop_wire::time::unix_ms(std::time::SystemTime::now()).saturating_add(overlap_ms);
            let (key, generation) = admin.stage_issuer_key(at.max(1)).await.map_err(fail)?;
            if *overlap_secs == 0 {
                // A running `serve` may activate the key (due at once) before this does.
                let g = match admin.activate_issuer_key(key.key_id()).await {
                    Ok(g) => g,
                    Err(iop_cp::admin::AdminError::Store(iop_cp::store::StoreError::NotFound(
                        _,
                    ))) if admin
                        .issuer_keys()
                        .await
                        .map_err(fail)?
                        .iter()
                        .any(|(k, _)| k.active && k.id == key.key_id()) =>
                    {
                        admin
                            .store()
                            .generation()
                            .await
                            .map_err(|e| runtime(e.to_string()))?
                    }
                    Err(e) => return Err(fail(e)),
                };
                print!("{}", key.to_pem());
                eprintln!(
                    "issuer key {} is active now (generation {g}); {} no longer signs. Edges stop selecting Nodes that do not pin the new key: pin it on every Node (config below) and restart them.\n\n{}",
                    key.key_id(),
                    active.key_id(),
                    node_snippet(&[("/etc/iop/cp-issuer.pub.pem", key.key_id())])
                );
                return Ok(());
            }
            print!("{}", key.to_pem());
            eprintln!(
                "staged issuer key {} (generation {generation}); leases stay signed with {} for {overlap_secs} s, then a running `iop-cp serve --credential-plane` activates the new key.\n\
                 Now: save the PEM above on every Node (e.g. as /etc/iop/cp-issuer-next.pub.pem), pin it beside the current key, and restart the Node:\n\n{}\n\
                 Edges log `edge_node_issuer_staged_untrusted` for the Nodes that do not trust it yet; after activation they are not selected. Remove the old key from the Nodes once the new one is active.",
                key.key_id(),
                active.key_id(),
                node_snippet(&[
                    ("/etc/iop/cp-issuer.pub.pem", active.key_id()),
                    ("/etc/iop/cp-issuer-next.pub.pem", key.key_id()),
                ])
            );
            Ok(())
        }
        Some(IssuerKeyCmd::Activate) => {
            let (meta, _) = staged.ok_or_else(|| usage("no issuer key is staged"))?;
            let g = admin.activate_issuer_key(&meta.id).await.map_err(fail)?;
            println!(
                "issuer key {} is active (generation {g}); {} no longer signs",
                meta.id,
                active.key_id()
            );
            Ok(())
        }
    }
}

async fn serve(dir: &Path, admin: Admin, args: &ServeArgs) -> Result<(), Failure> {
    if !args.admin_listen.ip().is_loopback() && !args.admin_allow_remote {
        return Err(usage(
            "--admin-listen must be a loopback address (or pass --admin-allow-remote)",
        ));
    }
    let ttl = Duration::from_secs(args.lease_ttl_secs);
    if ttl.is_zero() || ttl > DEFAULT_MAX_TTL {
        return Err(usage(format!(
            "--lease-ttl-secs must be 1..={}",
            DEFAULT_MAX_TTL.as_secs()
        )));
    }
    let tls = tls_config(args)?;
    let (leases, issuer_id) = if args.credential_plane {
        let issuer = issuer_key(&admin, dir).await?;
        (
            Some(Arc::new(LeaseService::new(
                admin.store().clone(),
                admin.master_key().clone(),
                ttl,
            ))),
            issuer.key_id().to_owned(),
        )
    } else {
        (None, String::new())
    };
    let mut config = ServerConfig::new(args.listen, tls, args.credential_plane);
    let mut telemetry = iop_telemetry::TelemetryConfig::default();
    telemetry.endpoint.clone_from(&args.otlp_endpoint);
    config.telemetry = iop_telemetry::Telemetry::start(&telemetry, "iop-cp")
        .map_err(|e| usage(format!("telemetry: {e}")))?;
    if config.telemetry.is_on() {
        println!("iop-cp: exporting spans over OTLP");
    }
    let telemetry = config.telemetry.clone();
    config.heartbeat = Duration::from_millis(args.heartbeat_ms.max(100));
    config.store_poll = Duration::from_millis(args.store_poll_ms.max(10));
    config.store_watch = args.store_watch;
    let (cp, task) = server::serve(config, admin.clone(), leases)
        .await
        .map_err(|e| runtime(format!("listen {}: {e}", args.listen)))?;
    let admin_listener = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .map_err(|e| runtime(format!("admin listen {}: {e}", args.admin_listen)))?;
    let admin_addr = admin_listener
        .local_addr()
        .map_err(|e| runtime(e.to_string()))?;
    println!(
        "iop-cp: edge wire on {} (managed={})",
        cp.local_addr(),
        args.credential_plane
    );
    println!("iop-cp: admin API on http://{admin_addr}");
    if args.credential_plane {
        println!(
            "iop-cp: lease issuer key id {issuer_id} (`iop-cp issuer-key` prints its public key)"
        );
    }
    let prune_stop = CancellationToken::new();
    tokio::spawn(iop_cp::usage::prune_loop(
        admin.store().clone(),
        args.usage_retention_days,
        prune_stop.clone(),
    ));
    let mut app =
        iop_cp::admin_http::router(admin.clone(), Some(cp.clone()), args.admin_token.clone());
    // The status page needs the admin token (it is never served open, even on loopback).
    match args
        .admin_token
        .as_deref()
        .and_then(bounded_http::admin::AdminToken::new)
    {
        Some(token) => {
            app = app.merge(iop_cp::status_page::router(admin, Some(cp.clone()), token));
            println!(
                "iop-cp: status page on http://{admin_addr}/status/ (the admin token as the password)"
            );
        }
        None => println!(
            "iop-cp: status page off: it needs --admin-token / IOP_CP_ADMIN_TOKEN (at least 16 characters)"
        ),
    }
    let shutdown = iop_bins::shutdown_signal();
    // The hardened server: connection cap, header deadline, rate-limited refusal logs.
    bounded_http::serve_with(
        admin_listener,
        app,
        bounded_http::ServeLimits::default(),
        None,
        shutdown,
    )
    .await
    .map_err(|e| runtime(format!("admin API: {e}")))?;
    prune_stop.cancel();
    cp.shutdown();
    let _ = task.await;
    telemetry.flush().await;
    println!("iop-cp: stopped");
    Ok(())
}
