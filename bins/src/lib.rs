//! The reference binaries live in `src/bin/`; each reads its config, builds its library object,
//! runs it and maps the outcome to an exit code (linkerd2-proxy's `main.rs` shape):
//!
//! - `iop-node`: see `iop-node --help` and `iop_node::config` for the file format.
//! - `iop-mesh`: a whole local mesh on embedded defaults (see `iop-mesh --help`).
//! - `iop-edge`: the Edge as a standalone service from a TOML file (Node listener, pool, HTTP
//!   surface, optional Control Plane connector; see `src/bin/iop-edge.rs` for the keys).
//! - `iop-cp`: the Control Plane: Edge wire server, loopback admin API and admin CLI (see
//!   `iop-cp --help` and the crate docs of `iop_cp`).
//! - `proxypool-controller`: the proxy-pool WorkerControlPlane gRPC controller (see
//!   `proxypool-controller --help` and `proxypool_controller::config`).
//! - `orbit-control-plane` and `orbit-agent`: the OrbitMesh Edge Runtime control plane and agent
//!   (see their `--help` and `orbit_runtime`).
//! - `iop-ca`: a small workload CA for real deployments (`init`, `issue`; see
//!   `workload_identity::ca`).
//!
//! Shared by the mains: [`init_process`] (logging and the open-file limit) and
//! [`shutdown_signal`]. The workload CA, the in-memory development CA and TLS hot reload are
//! library code in `workload_identity` (features `ca`, `dev-ca`, `reload`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// Every binary allocates with mimalloc rather than the system allocator: on the request path of
/// the Edge and the Node, glibc's malloc/free (and its arena lock under two workers) was 10–12 %
/// of all CPU (`benches/README.md`, proc_load). Libraries leave the choice to their embedders.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Resolves on SIGTERM or Ctrl-C (SIGINT). Call it before serving: the SIGTERM handler is
/// installed by the call itself, so a SIGTERM that arrives while the binary starts up still
/// means a clean stop rather than the default kill.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        #[cfg(unix)]
        if let Some(mut term) = term {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// What every main does first: logs to stderr, filtered by `RUST_LOG` (else `default_filter`,
/// e.g. `"info"`), and the open-file soft limit raised to the hard limit
/// ([`raise_fd_limit`]).
pub fn init_process(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log file or journal gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    raise_fd_limit();
}

/// Raises this process's open-file soft limit to its hard limit (a gateway holds a socket per
/// client and per Node; distributions often start services at 1024). Returns the new soft
/// limit; on failure the limit stays and a warning is logged.
pub fn raise_fd_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the open-file limit");
            None
        }
    }
}
