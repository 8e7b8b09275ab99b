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
pub struct Liveness {
    config: HeartbeatConfig,
    last_sent: Instant,
    last_received: Instant,
}

impl Liveness {
    /// Fresh state: nothing sent or received yet counts as at `now`.
    pub fn new(config: HeartbeatConfig, now: Instant) -> Self {
        Self {
            config,
            last_sent: now,
            last_received: now,
        }
    }

    /// Replaces the settings (a heartbeat interval the peer announced).
    pub fn set_config(&mut self, config: HeartbeatConfig) {
        self.config = config;
    }

    /// Something was sent at `now`.
    pub fn on_sent(&mut self, now: Instant) {
        self.last_sent = self.last_sent.max(now);
    }

    /// Something was received at `now`.
    pub fn on_received(&mut self, now: Instant) {
        self.last_received = self.last_received.max(now);
    }

    /// When something was last received from the peer (its last heartbeat, or any frame).
    pub fn last_received(&self) -> Instant {
        self.last_received
    }

    /// When the next ping is due.
    pub fn ping_at(&self) -> Instant {
        self.last_sent
            .checked_add(self.config.interval)
            .unwrap_or(self.last_sent)
    }

    /// When the connection counts as dead.
    pub fn idle_deadline(&self) -> Instant {
        self.last_received
            .checked_add(self.config.idle_timeout)
            .unwrap_or(self.last_received)
    }

    /// Whether a ping is due at `now`.
    pub fn ping_due(&self, now: Instant) -> bool {
        now >= self.ping_at()
    }

    /// Whether the peer has been silent too long at `now`.
    pub fn idle_expired(&self, now: Instant) -> bool {
        now >= self.idle_deadline()
    }
}
