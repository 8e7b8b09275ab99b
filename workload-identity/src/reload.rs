//! Hot reload of TLS files: a task re-reads the CA bundle, certificate and key every interval
//! and hands changed material to [`WorkloadTls::reload_pem`] or [`HostTls::reload_pem`] (which
//! refuse invalid material and keep the old). New connections then use the new files;
//! established ones continue.
//!
//! Each outcome is logged once per distinct content: `tls material reloaded` (INFO) or `new
//! tls material refused; still using the current certificate` (WARN, with the reason). A
//! rotation that writes the three files one after the other may be seen half-done by one poll;
//! that poll is refused and the next one picks up the complete set.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::{HostTls, MaterialError, WorkloadTls};
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

/// Material that [`spawn`] can reload: [`WorkloadTls`] and [`HostTls`].
pub trait Reload: Send + Sync + 'static {
    /// Replaces the material (see the implementors).
    fn reload_pem(&self, ca: &[u8], cert: &[u8], key: &[u8]) -> Result<bool, MaterialError>;
    /// How many times the material changed.
    fn generation(&self) -> u64;
    /// Who presents it, for log lines (a SPIFFE ID; empty for a host certificate).
    fn identity(&self) -> String;
}

impl Reload for WorkloadTls {
    fn reload_pem(&self, ca: &[u8], cert: &[u8], key: &[u8]) -> Result<bool, MaterialError> {
        Self::reload_pem(self, ca, cert, key)
    }
    fn generation(&self) -> u64 {
        Self::generation(self)
    }
    fn identity(&self) -> String {
        Self::identity(self).to_string()
    }
}

impl Reload for HostTls {
    fn reload_pem(&self, ca: &[u8], cert: &[u8], key: &[u8]) -> Result<bool, MaterialError> {
        Self::reload_pem(self, ca, cert, key)
    }
    fn generation(&self) -> u64 {
        Self::generation(self)
    }
    fn identity(&self) -> String {
        String::new()
    }
}

/// Watches `paths` every `interval` until `stop`, reloading `tls` when they change. `what`
/// names the workload in log lines.
pub fn spawn<T: Reload>(
    tls: Arc<T>,
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
