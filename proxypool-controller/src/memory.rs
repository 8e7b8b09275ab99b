//! The in-memory reference [`ControlStore`]: the model the Redis store is tested against.
//! Expiry follows an injected [`Clock`], so TTL behaviour is tested in virtual time.
//!
//! The rules themselves are [`StoreState`]'s synchronous steps (pure: no clock, no lock), which
//! the model checker (`tests/model.rs`) explores exhaustively and the differential test
//! (`tests/differential.rs`) compares with the Redis store's Lua scripts answer by answer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use crate::domain::{
    AckEffect, ControlStore, Report, ReportEffect, Session, SnapshotAcknowledgement,
    SnapshotReference, StoreError, WorkerRecord, apply_ack, apply_report,
};

/// A millisecond clock.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since an arbitrary origin; never decreasing.
    fn now_ms(&self) -> u64;
}

/// The process's monotonic clock.
#[derive(Debug)]
pub struct SystemClock(std::time::Instant);

impl Default for SystemClock {
    fn default() -> Self {
        Self(std::time::Instant::now())
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A clock moved by hand (tests).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(
            u64::try_from(by.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A value and the time (store milliseconds) it expires at.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Expiring<T> {
    value: T,
    expires_at: u64,
}

/// One of a worker's three entries (three Redis keys, each with its own TTL).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    /// The session and its report fence.
    Session,
    /// The last published snapshot reference.
    Reference,
    /// The last accepted runtime report.
    Runtime,
}

/// A report sequence fence: the last accepted sequence and its content digest.
pub type Fence = (u64, [u8; 32]);

/// The whole state of the reference store, and its rules as plain synchronous steps.
///
/// Each method is one atomic step of [`ControlStore`] at time `now_ms` (entries whose expiry is
/// not after `now_ms` are gone first, as Redis expires keys). [`MemoryStore`] is this behind a
/// mutex and a [`Clock`]; the model checker (`tests/model.rs`) explores it directly: it is
/// `Clone` and `Hash`, and its maps are ordered, so equal states hash equally whatever the
/// history that built them. The fence lives in the session, as in Redis.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct StoreState {
    epoch: Option<u64>,
    sessions: BTreeMap<String, Expiring<(Session, Option<Fence>)>>,
    references: BTreeMap<String, Expiring<SnapshotReference>>,
    runtime: BTreeMap<String, Expiring<Report>>,
}

impl StoreState {
    /// Drops every entry expired at `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        self.sessions.retain(|_, e| e.expires_at > now_ms);
        self.references.retain(|_, e| e.expires_at > now_ms);
        self.runtime.retain(|_, e| e.expires_at > now_ms);
    }

    /// Drops one entry of `worker_id` as if its key's TTL ran out now: Redis expires keys
    /// one at a time, so a session may be gone while its runtime or reference lives on (the
    /// model checker explores every such order).
    pub fn evict(&mut self, worker_id: &str, entry: Entry) {
        match entry {
            Entry::Session => {
                self.sessions.remove(worker_id);
            }
            Entry::Reference => {
                self.references.remove(worker_id);
            }
            Entry::Runtime => {
                self.runtime.remove(worker_id);
            }
        }
    }

    /// The live session of a worker and its report sequence fence (sequence and digest).
    pub fn session(&self, worker_id: &str) -> Option<(&Session, Option<Fence>)> {
        self.sessions
            .get(worker_id)
            .map(|e| (&e.value.0, e.value.1))
    }

    /// The live runtime report of a worker.
    pub fn runtime(&self, worker_id: &str) -> Option<&Report> {
        self.runtime.get(worker_id).map(|e| &e.value)
    }

    /// The snapshot reference last published to a worker.
    pub fn reference(&self, worker_id: &str) -> Option<SnapshotReference> {
        self.references.get(worker_id).map(|e| e.value)
    }

    /// Everything held for `worker_id` (live entries only: call [`StoreState::expire`] first).
    pub fn record(&self, worker_id: &str) -> WorkerRecord {
        WorkerRecord {
            session: self.sessions.get(worker_id).map(|e| e.value.0.clone()),
            fence: self.sessions.get(worker_id).and_then(|e| e.value.1),
            reference: self.reference(worker_id),
            runtime: self
                .runtime(worker_id)
                .map(|r| (r.sequence, r.observed_at_unix_ms, r.counters.to_vec())),
        }
    }

    /// The ownership epoch if it was ever read (it is created on first read, as in Redis).
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }

    /// [`ControlStore::current_ownership_epoch`].
    pub fn current_ownership_epoch(&mut self, now_ms: u64) -> u64 {
        self.expire(now_ms);
        *self.epoch.get_or_insert(1)
    }

    /// [`ControlStore::open_session`].
    pub fn open_session(&mut self, now_ms: u64, session: &Session, ttl: Duration) {
        self.expire(now_ms);
        self.runtime.remove(&session.worker_id);
        self.sessions.insert(
            session.worker_id.clone(),
            Expiring {
                value: (session.clone(), None),
                expires_at: now_ms.saturating_add(ms(ttl)),
            },
        );
    }

    /// [`ControlStore::record_issued_snapshot`].
    pub fn record_issued_snapshot(
        &mut self,
        now_ms: u64,
        worker_id: &str,
        reference: SnapshotReference,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.expire(now_ms);
        if let Some(cur) = self.references.get(worker_id).map(|e| e.value)
            && (reference.tuple < cur.tuple
                || (reference.tuple == cur.tuple && reference.checksum != cur.checksum))
        {
            return Err(StoreError::ReferenceConflict);
        }
        self.references.insert(
            worker_id.to_owned(),
            Expiring {
                value: reference,
                expires_at: now_ms.saturating_add(ms(ttl)),
            },
        );
        Ok(())
    }

    /// [`ControlStore::acknowledge_snapshot`] (seed 004 §5.2, the rules in [`apply_ack`]).
    pub fn acknowledge_snapshot(
        &mut self,
        now_ms: u64,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.expire(now_ms);
        let reference = self.references.get(&ack.worker_id).map(|e| e.value);
        let Some(entry) = self.sessions.get(&ack.worker_id) else {
            return Err(StoreError::StaleSession);
        };
        if entry.value.0.session_id != ack.session_id {
            return Err(StoreError::StaleSession);
        }
        let effect = apply_ack(&entry.value.0, reference, ack)?;
        let clear_runtime = !matches!(effect, AckEffect::Renew);
        if clear_runtime {
            self.runtime.remove(&ack.worker_id);
        }
        let Some(entry) = self.sessions.get_mut(&ack.worker_id) else {
            return Err(StoreError::StaleSession);
        };
        let (session, fence) = &mut entry.value;
        match effect {
            AckEffect::Advance => {
                session.acked = ack.tuple;
                session.acked_checksum = ack.checksum;
                session.runtime_enabled = true;
                *fence = None;
            }
            AckEffect::Renew => {}
            AckEffect::Reenable => {
                session.runtime_enabled = true;
                *fence = None;
            }
            AckEffect::Disable => {
                session.runtime_enabled = false;
                *fence = None;
            }
        }
        entry.expires_at = now_ms.saturating_add(ms(ttl));
        Ok(())
    }

    /// [`ControlStore::replace_runtime`] (seed 004 §5.3, the rules in [`apply_report`]).
    pub fn replace_runtime(
        &mut self,
        now_ms: u64,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
    ) -> Result<(), StoreError> {
        self.expire(now_ms);
        let Some(entry) = self.sessions.get_mut(&report.worker_id) else {
            return Err(StoreError::StaleSession);
        };
        if entry.value.0.session_id != report.session_id {
            return Err(StoreError::StaleSession);
        }
        let effect = apply_report(&entry.value.0, entry.value.1, report)?;
        entry.expires_at = now_ms.saturating_add(ms(session_ttl));
        if effect == ReportEffect::Replace {
            entry.value.1 = Some((report.sequence, report.digest()));
            self.runtime.insert(
                report.worker_id.clone(),
                Expiring {
                    value: report.clone(),
                    expires_at: now_ms.saturating_add(ms(report_ttl)),
                },
            );
        } else if let Some(r) = self.runtime.get_mut(&report.worker_id) {
            r.expires_at = now_ms.saturating_add(ms(report_ttl));
        }
        Ok(())
    }
}

/// The reference store: a [`StoreState`] behind a mutex, expiring by a [`Clock`].
#[derive(Clone)]
pub struct MemoryStore {
    state: Arc<Mutex<StoreState>>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock::default()))
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl MemoryStore {
    /// A store expiring entries by `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            state: Arc::default(),
            clock,
        }
    }

    fn lock(&self) -> (std::sync::MutexGuard<'_, StoreState>, u64) {
        let now = self.clock.now_ms();
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.expire(now);
        (st, now)
    }

    /// A copy of the whole state as of now (tests, the differential test against Redis).
    pub fn state(&self) -> StoreState {
        self.lock().0.clone()
    }

    /// Everything held for `worker_id` now.
    pub fn record(&self, worker_id: &str) -> WorkerRecord {
        self.lock().0.record(worker_id)
    }

    /// The live session of a worker (tests, the model of the crash test).
    pub fn session(&self, worker_id: &str) -> Option<Session> {
        let (st, _) = self.lock();
        st.session(worker_id).map(|(s, _)| s.clone())
    }

    /// The live session of a worker and its report sequence fence.
    pub fn session_with_fence(&self, worker_id: &str) -> Option<(Session, Option<u64>)> {
        let (st, _) = self.lock();
        st.session(worker_id)
            .map(|(s, fence)| (s.clone(), fence.map(|(seq, _)| seq)))
    }

    /// The live runtime report of a worker.
    pub fn runtime(&self, worker_id: &str) -> Option<Report> {
        let (st, _) = self.lock();
        st.runtime(worker_id).cloned()
    }

    /// How long the worker's session and runtime report live on, if present (Redis `PTTL`;
    /// tests check TTL renewals by the value instead of by waiting).
    pub fn ttls(&self, worker_id: &str) -> (Option<Duration>, Option<Duration>) {
        let (st, now) = self.lock();
        let left = |at: u64| Duration::from_millis(at.saturating_sub(now));
        (
            st.sessions.get(worker_id).map(|e| left(e.expires_at)),
            st.runtime.get(worker_id).map(|e| left(e.expires_at)),
        )
    }
}

#[async_trait]
impl ControlStore for MemoryStore {
    async fn current_ownership_epoch(&self) -> Result<u64, StoreError> {
        let (mut st, now) = self.lock();
        Ok(st.current_ownership_epoch(now))
    }

    async fn open_session(&self, session: &Session, ttl: Duration) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        st.open_session(now, session, ttl);
        Ok(())
    }

    async fn record_issued_snapshot(
        &self,
        worker_id: &str,
        reference: SnapshotReference,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        st.record_issued_snapshot(now, worker_id, reference, ttl)
    }

    async fn acknowledge_snapshot(
        &self,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        st.acknowledge_snapshot(now, ack, ttl)
    }

    async fn replace_runtime(
        &self,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
    ) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        st.replace_runtime(now, report, session_ttl, report_ttl)
    }
}
