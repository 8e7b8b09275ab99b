//! Hot reload of TLS files: a task re-reads the CA bundle, certificate and key every interval
//! and hands changed material to [`WorkloadTls::reload_pem`] (which refuses invalid material
//! and keeps the old). New connections then use the new files; established ones continue.
//!
//! Each outcome is logged once per distinct content: `tls material reloaded` (INFO) or `new
//! tls material refused; still using the current certificate` (WARN, with the reason). A
//! rotation that writes the three files one after the other may be seen half-done by one poll;
//! that poll is refused and the next one picks up the complete set.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::WorkloadTls;
use tokio_util::sync::CancellationToken;

/// The three files.
#[derive(Clone, Debug)]
pub struct TlsPaths {
    /// CA bundle.
    pub ca: PathBuf,
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
}

impl TlsPaths {
    fn read(&self) -> std::io::Result<[Vec<u8>; 3]> {
        Ok([
            std::fs::read(&self.ca)?,
            std::fs::read(&self.cert)?,
            std::fs::read(&self.key)?,
        ])
    }
}

/// Watches `paths` every `interval` until `stop`, reloading `tls` when they change. `what`
/// names the workload in log lines.
pub fn spawn(
    tls: Arc<WorkloadTls>,
    paths: TlsPaths,
    interval: Duration,
    what: &'static str,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = paths.read().ok();
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        let mut last_error = String::new();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let files = match paths.read() {
                Ok(f) => f,
                Err(e) => {
                    let e = e.to_string();
                    if e != last_error {
                        tracing::warn!(workload = what, error = %e, "tls files unreadable; still using the current certificate");
                        last_error = e;
                    }
                    continue;
                }
            };
            if last.as_ref() == Some(&files) {
                continue;
            }
            match tls.reload_pem(&files[0], &files[1], &files[2]) {
                Ok(true) => {
                    tracing::info!(
                        workload = what,
                        identity = %tls.identity(),
                        generation = tls.generation(),
                        "tls material reloaded"
                    );
                    last_error.clear();
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(workload = what, reason = %e, "new tls material refused; still using the current certificate");
                    last_error = e.to_string();
                }
            }
            last = Some(files);
        }
    })
}
