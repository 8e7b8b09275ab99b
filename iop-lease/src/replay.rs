//! Replay protection: a lease id opens at most once.
//!
//! An entry is needed only while its lease could still pass the validity check, i.e. until
//! `not_after + clock_skew`; after that the window check rejects the lease anyway, so the entry
//! is dropped. Memory is therefore bounded by the number of leases opened within one maximum
//! TTL, and additionally by a hard cap.
//!
//! **When full** (the cap is reached and nothing has expired), the guard fails closed: it
//! refuses the new lease with [`ReplayError::Full`] rather than forgetting an entry that might
//! still be replayed. Size the cap above the peak number of leases a Node opens per
//! `max_ttl + skew`.

use std::collections::{BTreeSet, HashMap};

/// Default hard cap of [`MemoryReplayGuard`].
pub const DEFAULT_REPLAY_CAPACITY: usize = 100_000;

/// Why the guard refused a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The lease id was already opened.
    #[error("lease was already used")]
    Replayed,
    /// The guard is at capacity with nothing expired: fail closed.
    #[error("replay guard is full")]
    Full,
    /// A persistent guard could not read or write its store: fail closed.
    #[error("replay guard store unavailable")]
    Unavailable,
}

/// Remembers opened lease ids. Implement it over durable storage to survive Node restarts
/// (otherwise a lease could be replayed across a restart within its short TTL).
pub trait ReplayGuard {
    /// Records `lease_id` as used until `keep_until_unix_ms`, or refuses it if it was used.
    /// Must be atomic with respect to concurrent calls for the same id.
    fn check_and_record(
        &mut self,
        lease_id: [u8; 16],
        keep_until_unix_ms: i64,
        now_unix_ms: i64,
    ) -> Result<(), ReplayError>;
}

/// An in-memory [`ReplayGuard`] with a hard cap.
#[derive(Debug)]
pub struct MemoryReplayGuard {
    capacity: usize,
    entries: HashMap<[u8; 16], i64>,
    by_expiry: BTreeSet<(i64, [u8; 16])>,
}

impl Default for MemoryReplayGuard {
    fn default() -> Self {
        Self::with_capacity(DEFAULT_REPLAY_CAPACITY)
    }
}

impl MemoryReplayGuard {
    /// A guard holding at most `capacity` live entries.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            capacity,
            entries: HashMap::new(),
            by_expiry: BTreeSet::new(),
        }
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no live entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn prune(&mut self, now_unix_ms: i64) {
        while let Some(&(until, id)) = self.by_expiry.first() {
            if until > now_unix_ms {
                break;
            }
            self.by_expiry.pop_first();
            self.entries.remove(&id);
        }
    }
}

impl ReplayGuard for MemoryReplayGuard {
    fn check_and_record(
        &mut self,
        lease_id: [u8; 16],
        keep_until_unix_ms: i64,
        now_unix_ms: i64,
    ) -> Result<(), ReplayError> {
        self.prune(now_unix_ms);
        if self.entries.contains_key(&lease_id) {
            return Err(ReplayError::Replayed);
        }
        if self.entries.len() >= self.capacity {
            return Err(ReplayError::Full);
        }
        self.entries.insert(lease_id, keep_until_unix_ms);
        self.by_expiry.insert((keep_until_unix_ms, lease_id));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_expiry_and_fail_closed_cap() {
        let mut g = MemoryReplayGuard::with_capacity(2);
        g.check_and_record([1; 16], 1_000, 0).unwrap();
        assert_eq!(
            g.check_and_record([1; 16], 1_000, 10),
            Err(ReplayError::Replayed)
        );
        g.check_and_record([2; 16], 2_000, 10).unwrap();
        // Full, nothing expired: refuse, and remember nothing new.
        assert_eq!(
            g.check_and_record([3; 16], 2_000, 999),
            Err(ReplayError::Full)
        );
        assert_eq!(g.len(), 2);
        // At 1000 the first entry expires and frees a slot.
        g.check_and_record([3; 16], 3_000, 1_000).unwrap();
        assert_eq!(g.len(), 2);
        // Still remembered until its own expiry.
        assert_eq!(
            g.check_and_record([2; 16], 2_000, 1_999),
            Err(ReplayError::Replayed)
        );
    }
}
