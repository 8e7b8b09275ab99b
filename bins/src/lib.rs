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
//! Shared by the mains: [`init_process`] (logging, the open-file limit and no transparent huge
//! pages: [`limit_huge_pages`]) and
//! [`shutdown_signal`]. The workload CA, the in-memory development CA and TLS hot reload are
//! library code in `workload_identity` (features `ca`, `dev-ca`, `reload`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// Every binary allocates with mimalloc rather than the system allocator: on the request path of
/// the Edge and the Node, glibc's malloc/free (and its arena lock under two workers) was 10–12 %
/// of all CPU (`benches/README.md`, proc_load). Libraries leave the choice to their embedders.
/// The `system-alloc` feature keeps glibc's, for heap profilers that see only `malloc`
/// (`heaptrack`; mimalloc maps its own pages).
#[cfg(not(feature = "system-alloc"))]
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
    let huge_pages = limit_huge_pages();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log file or journal gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let HugePages::Unchanged(e) = huge_pages {
        tracing::warn!(error = %e, "could not turn transparent huge pages off");
    }
    raise_fd_limit();
}

/// What [`limit_huge_pages`] did.
#[derive(Debug)]
pub enum HugePages {
    /// This process no longer gets transparent huge pages.
    Off,
    /// Kept on: `MIMALLOC_ALLOW_THP=1` asked for them (on an `always`-mode host; mimalloc is
    /// built never to advise them).
    KeptOn,
    /// The kernel refused; nothing changed.
    Unchanged(std::io::Error),
    /// Not Linux: no transparent huge pages to turn off.
    NotLinux,
}

/// Turns transparent huge pages off for this process (`prctl(PR_SET_THP_DISABLE, 1, 0)`: "THPs
/// disabled completely for the process, irrespective of global THP controls", prctl(2)), unless
/// `MIMALLOC_ALLOW_THP` is set to `1`, `true`, `yes` or `on`. [`init_process`] calls it.
///
/// Why: mimalloc advised its arenas `MADV_HUGEPAGE`, so on a host whose THP mode is `madvise`
/// (the common default) or `always`, each fresh 2 MiB region it touched became resident whole.
/// The binaries' heaps are small and spread over a segment per thread: the Node of
/// `bins/tests/stream_credit.rs` held at most 2.5 MB of heap (heaptrack) while its RSS grew by
/// anything from 0 to 15 MiB from run to run, in 2 MiB steps (`AnonHugePages` 24 MiB of a 45 MiB
/// RSS). With huge pages off the same run's RSS is 28 MB instead of 43–53 MB and grows by
/// 2.3–3.0 MiB, run after run: what an operator sizes a container by is what the process holds.
///
/// Two parts, because a call from `main` comes after the first allocations (and, under
/// `#[tokio::main]`, after the runtime's threads): the workspace builds mimalloc with `no_thp`,
/// so it never advises huge pages and a `madvise`-mode host gives it none from the first
/// allocation on; this call covers `always`-mode hosts from here on (pages already faulted huge
/// stay so). Children inherit the flag.
pub fn limit_huge_pages() -> HugePages {
    let allowed = std::env::var("MIMALLOC_ALLOW_THP").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    });
    if allowed {
        return HugePages::KeptOn;
    }
    #[cfg(target_os = "linux")]
    {
        match rustix::thread::disable_transparent_huge_pages(true) {
            Ok(()) => HugePages::Off,
            Err(e) => HugePages::Unchanged(e.into()),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        HugePages::NotLinux
    }
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
