//! DNS providers for system endpoint records (seed `003`, "Heartbeat").
//!
//! A reported address writes an `A` (IPv4) or `AAAA` (IPv6) record for each eligible endpoint
//! name of the Node, never proxied (`proxied=false` for Cloudflare-style providers), as an
//! idempotent create-or-update. [`MemoryDns`] is the embedded default; the Cloudflare-style REST
//! client and the RFC 2136 client are not written yet (issue #8).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use async_trait::async_trait;

/// The record type for an address.
pub fn record_type(addr: IpAddr) -> &'static str {
    match addr {
        IpAddr::V4(_) => "A",
        IpAddr::V6(_) => "AAAA",
    }
}

/// A DNS failure (no provider detail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DnsError {
    /// The provider refused or failed.
    #[error("dns provider unavailable")]
    Unavailable,
}

/// A place to write endpoint address records.
#[async_trait]
pub trait DnsProvider: Send + Sync + 'static {
    /// Creates or updates the single `A`/`AAAA` record of `name` to `addr` (not proxied).
    async fn upsert_address(&self, name: &str, addr: IpAddr) -> Result<(), DnsError>;
    /// The current address record of `name`, if any.
    async fn address(&self, name: &str) -> Result<Option<IpAddr>, DnsError>;
}

/// In-memory records (the embedded default and the tests' model).
#[derive(Debug, Default)]
pub struct MemoryDns {
    records: Mutex<BTreeMap<String, IpAddr>>,
    writes: Mutex<u64>,
}

impl MemoryDns {
    /// How many writes were made (idempotence checks).
    pub fn writes(&self) -> u64 {
        *self
            .writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl DnsProvider for MemoryDns {
    async fn upsert_address(&self, name: &str, addr: IpAddr) -> Result<(), DnsError> {
        let mut records = self
            .records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if records.get(name) != Some(&addr) {
            records.insert(name.to_owned(), addr);
            *self
                .writes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        }
        Ok(())
    }

    async fn address(&self, name: &str) -> Result<Option<IpAddr>, DnsError> {
        Ok(self
            .records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(name)
            .copied())
    }
}
