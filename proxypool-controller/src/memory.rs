//! The in-memory reference [`ControlStore`]: the model the Redis store is tested against.
//! Expiry follows an injected [`Clock`], so TTL behaviour is tested in virtual time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use crate::domain::{
    AckEffect, ControlStore, Report, ReportEffect, Session, SnapshotAcknowledgement,
    SnapshotReference, StoreError, apply_ack, apply_report,
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

struct Expiring<T> {
    value: T,
    expires_at: u64,
}

/// A report sequence fence: the last accepted sequence and its content digest.
type Fence = (u64, [u8; 32]);

/// The stored runtime of a worker: the fence lives in the session, as in Redis.
#[derive(Default)]
struct State {
    epoch: Option<u64>,
    sessions: HashMap<String, Expiring<(Session, Option<Fence>)>>,
    references: HashMap<String, Expiring<SnapshotReference>>,
    runtime: HashMap<String, Expiring<Report>>,
}

/// The reference store.
#[derive(Clone)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
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

    fn lock(&self) -> (std::sync::MutexGuard<'_, State>, u64) {
        let now = self.clock.now_ms();
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.sessions.retain(|_, e| e.expires_at > now);
        st.references.retain(|_, e| e.expires_at > now);
        st.runtime.retain(|_, e| e.expires_at > now);
        (st, now)
    }

    /// The live session of a worker (tests, the model of the crash test).
    pub fn session(&self, worker_id: &str) -> Option<Session> {
        let (st, _) = self.lock();
        st.sessions.get(worker_id).map(|e| e.value.0.clone())
    }

    /// The live session of a worker and its report sequence fence.
    pub fn session_with_fence(&self, worker_id: &str) -> Option<(Session, Option<u64>)> {
        let (st, _) = self.lock();
        st.sessions
            .get(worker_id)
            .map(|e| (e.value.0.clone(), e.value.1.map(|(seq, _)| seq)))
    }

    /// The live runtime report of a worker.
    pub fn runtime(&self, worker_id: &str) -> Option<Report> {
        let (st, _) = self.lock();
        st.runtime.get(worker_id).map(|e| e.value.clone())
    }
}

#[async_trait]
impl ControlStore for MemoryStore {
    async fn current_ownership_epoch(&self) -> Result<u64, StoreError> {
        let (mut st, _) = self.lock();
        Ok(*st.epoch.get_or_insert(1))
    }

    async fn open_session(&self, session: &Session, ttl: Duration) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        st.runtime.remove(&session.worker_id);
        st.sessions.insert(
            session.worker_id.clone(),
            Expiring {
                value: (session.clone(), None),
                expires_at: now.saturating_add(ms(ttl)),
            },
        );
        Ok(())
    }

    async fn record_issued_snapshot(
        &self,
        worker_id: &str,
        reference: SnapshotReference,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        if let Some(cur) = st.references.get(worker_id).map(|e| e.value)
            && (reference.tuple < cur.tuple
                || (reference.tuple == cur.tuple && reference.checksum != cur.checksum))
        {
            return Err(StoreError::ReferenceConflict);
        }
        st.references.insert(
            worker_id.to_owned(),
            Expiring {
                value: reference,
                expires_at: now.saturating_add(ms(ttl)),
            },
        );
        Ok(())
    }

    async fn acknowledge_snapshot(
        &self,
        ack: &SnapshotAcknowledgement,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        let reference = st.references.get(&ack.worker_id).map(|e| e.value);
        let Some(entry) = st.sessions.get(&ack.worker_id) else {
            return Err(StoreError::StaleSession);
        };
        if entry.value.0.session_id != ack.session_id {
            return Err(StoreError::StaleSession);
        }
        let effect = apply_ack(&entry.value.0, reference, ack)?;
        let clear_runtime = !matches!(effect, AckEffect::Renew);
        if clear_runtime {
            st.runtime.remove(&ack.worker_id);
        }
        let Some(entry) = st.sessions.get_mut(&ack.worker_id) else {
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
        entry.expires_at = now.saturating_add(ms(ttl));
        Ok(())
    }

    async fn replace_runtime(
        &self,
        report: &Report,
        session_ttl: Duration,
        report_ttl: Duration,
    ) -> Result<(), StoreError> {
        let (mut st, now) = self.lock();
        let Some(entry) = st.sessions.get_mut(&report.worker_id) else {
            return Err(StoreError::StaleSession);
        };
        if entry.value.0.session_id != report.session_id {
            return Err(StoreError::StaleSession);
        }
        let effect = apply_report(&entry.value.0, entry.value.1, report)?;
        entry.expires_at = now.saturating_add(ms(session_ttl));
        if effect == ReportEffect::Replace {
            entry.value.1 = Some((report.sequence, report.digest()));
            st.runtime.insert(
                report.worker_id.clone(),
                Expiring {
                    value: report.clone(),
                    expires_at: now.saturating_add(ms(report_ttl)),
                },
            );
        } else if let Some(r) = st.runtime.get_mut(&report.worker_id) {
            r.expires_at = now.saturating_add(ms(report_ttl));
        }
        Ok(())
    }
}
