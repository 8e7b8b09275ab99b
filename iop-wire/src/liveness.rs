//! Heartbeat and idle-timeout bookkeeping for one connection, shared by both wires.
//!
//! Both peers send a `Ping` when they have sent nothing for `interval`, and close the
//! connection when they have received nothing (of any kind) for `idle_timeout`. Any received
//! frame counts as liveness, so a busy connection never pings.

use std::time::{Duration, Instant};

/// Default heartbeat interval: 10 s.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);

/// Heartbeat settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeartbeatConfig {
    /// Send a ping after this long without sending anything.
    pub interval: Duration,
    /// Close after this long without receiving anything. Should be a few intervals.
    pub idle_timeout: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        Self::from_interval(DEFAULT_HEARTBEAT_INTERVAL)
    }
}

impl HeartbeatConfig {
    /// `interval`, with an idle timeout of three intervals.
    pub fn from_interval(interval: Duration) -> Self {
        Self {
            interval,
            idle_timeout: interval.saturating_mul(3),
        }
    }
}

/// Per-connection liveness state.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Liveness {
    config: HeartbeatConfig,
    last_sent: Instant,
    last_received: Instant,
}

impl Liveness {
    pub(crate) fn new(config: HeartbeatConfig, now: Instant) -> Self {
        Self {
            config,
            last_sent: now,
            last_received: now,
        }
    }

    pub(crate) fn set_config(&mut self, config: HeartbeatConfig) {
        self.config = config;
    }

    pub(crate) fn on_sent(&mut self, now: Instant) {
        self.last_sent = self.last_sent.max(now);
    }

    pub(crate) fn on_received(&mut self, now: Instant) {
        self.last_received = self.last_received.max(now);
    }

    /// When the next ping is due.
    pub(crate) fn ping_at(&self) -> Instant {
        self.last_sent
            .checked_add(self.config.interval)
            .unwrap_or(self.last_sent)
    }

    /// When the connection counts as dead.
    pub(crate) fn idle_deadline(&self) -> Instant {
        self.last_received
            .checked_add(self.config.idle_timeout)
            .unwrap_or(self.last_received)
    }

    pub(crate) fn ping_due(&self, now: Instant) -> bool {
        now >= self.ping_at()
    }

    pub(crate) fn idle_expired(&self, now: Instant) -> bool {
        now >= self.idle_deadline()
    }
}
