//! Benchmarks and load tools for the workspace. Criterion benches live in `benches/benches/`,
//! load tools in `src/bin/` (`mesh_load`, `http_load`); see `benches/README.md` for how to run
//! them and the numbers measured so far. This library holds the load tools' shared harness.
#![forbid(unsafe_code)]

/// Shared pieces of the load tools: mTLS configs with SPIFFE identities, fixed-rate drivers and
/// percentiles.
#[allow(
    clippy::unwrap_used,
    missing_docs,
    reason = "load-tool harness: failed setup should panic"
)]
pub mod load {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use iop_tests::pki::{Ca, TRUST_DOMAIN};
    use iop_wire::identity::{
        self, ExpectedPeer, client_cert_verifier, role, server_cert_verifier,
    };

    pub fn edge_tls(ca: &Ca) -> Arc<rustls::ServerConfig> {
        let leaf = ca.workload(role::EDGE, "edge-1", true);
        let verifier = client_cert_verifier(
            ca.roots(),
            ExpectedPeer::any_name(TRUST_DOMAIN, role::NODE).unwrap(),
        )
        .unwrap();
        Arc::new(identity::server_config(leaf.chain.clone(), leaf.key(), verifier).unwrap())
    }

    pub fn node_tls(ca: &Ca, name: &str) -> Arc<rustls::ClientConfig> {
        let leaf = ca.workload(role::NODE, name, false);
        let verifier = server_cert_verifier(
            ca.roots(),
            ExpectedPeer::exact(TRUST_DOMAIN, role::EDGE, "edge-1").unwrap(),
        )
        .unwrap();
        Arc::new(identity::client_config(leaf.chain.clone(), leaf.key(), verifier).unwrap())
    }

    pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
        let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted[i.min(sorted.len() - 1)]
    }

    pub async fn at_rate<F, Fut>(rate: u32, count: u32, f: F) -> Vec<Duration>
    where
        F: Fn(u64) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut tasks = Vec::with_capacity(count as usize);
        for i in 0..count {
            tick.tick().await;
            let fut = f(u64::from(i));
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                fut.await;
                t.elapsed()
            }));
        }
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out.sort();
        out
    }

    pub fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }

    /// A binary next to this one (`target/release/NAME`), or the path in env `var`.
    pub fn bin(var: &str, name: &str) -> std::path::PathBuf {
        std::env::var_os(var).map_or_else(
            || {
                std::env::current_exe()
                    .unwrap()
                    .parent()
                    .unwrap()
                    .join(name)
            },
            std::path::PathBuf::from,
        )
    }

    /// A port free on 127.0.0.1 just now.
    pub fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A child process killed (and reaped) on drop.
    #[derive(Debug)]
    pub struct Killed(pub std::process::Child);

    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
