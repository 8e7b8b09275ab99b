//! The Node's connectivity supervision policy, as a sans-io machine.
//!
//! Seed 000 ("connectivity supervision", "reconnect.interval_sec, reconnect.max_attempts"):
//! one supervisor serialises the initial dial and every established-session reconnect under the
//! same policy; startup does not require the Edge to be reachable.
//!
//! | `max_attempts` | meaning |
//! |---|---|
//! | omitted | 10 |
//! | `0` (explicit) | unlimited, until local shutdown; `interval_sec` must then be positive |
//! | `n > 0` | exactly `n` consecutive failed attempts, then exhaustion |
//! | `n < 0` | validation error |
//!
//! `interval_sec` omitted means 10; negative is an error; zero is allowed only with a finite
//! attempt limit (an immediate retry loop that cannot run forever).
//!
//! An *attempt* is one dial plus the session that follows it. The count resets whenever a
//! session reaches ready, so a long-lived Node that loses its Edge gets the full budget again.
//! Outcomes: finite exhaustion and non-retryable (local config/credential) errors are
//! [`Exit::Exhausted`] / [`Exit::Fatal`] (process exit code 1); local shutdown is
//! [`Exit::Shutdown`] (exit code 0).
//!
//! Jitter: each wait is drawn from `[interval × (1 − jitter), interval]` with caller-supplied
//! randomness (`random: u32`, uniform), so a fleet that lost its Edge at the same moment does
//! not reconnect in lockstep. The machine itself never reads a clock or an RNG. The wait is
//! the workspace's one retry policy, [`crate::backoff::Backoff`], as a constant interval.

use std::time::{Duration, Instant};

use crate::backoff::Backoff;

/// Default `interval_sec`.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// Default `max_attempts`.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;
/// Default jitter fraction (see the module docs).
pub const DEFAULT_JITTER: f64 = 0.2;

/// The validated policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReconnectPolicy {
    wait: Backoff,
    max_attempts: AttemptLimit,
}

/// How many consecutive failed attempts are allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptLimit {
    /// Until local shutdown.
    Unlimited,
    /// Exactly this many (≥ 1).
    Finite(u32),
}

/// A reconnect setting was invalid. The message names the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReconnectConfigError {
    /// `reconnect.max_attempts` < 0.
    #[error("reconnect.max_attempts must not be negative")]
    NegativeMaxAttempts,
    /// `reconnect.max_attempts` does not fit in 32 bits.
    #[error("reconnect.max_attempts is too large")]
    MaxAttemptsTooLarge,
    /// `reconnect.interval_sec` < 0.
    #[error("reconnect.interval_sec must not be negative")]
    NegativeInterval,
    /// `reconnect.interval_sec` = 0 with unlimited attempts.
    #[error("reconnect.interval_sec must be positive when reconnect.max_attempts is 0 (unlimited)")]
    UnlimitedNeedsPositiveInterval,
    /// The jitter fraction is outside `0.0..=1.0`.
    #[error("reconnect jitter must be within 0.0..=1.0")]
    InvalidJitter,
}

/// The wait of an interval with the default jitter.
fn interval_wait(interval: Duration) -> Backoff {
    Backoff::constant(interval)
        .with_jitter(DEFAULT_JITTER)
        .unwrap_or(Backoff::constant(interval))
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        Self {
            wait: interval_wait(DEFAULT_INTERVAL),
            max_attempts: AttemptLimit::Finite(DEFAULT_MAX_ATTEMPTS),
        }
    }
}

impl ReconnectPolicy {
    /// Validates the two config keys as written (`None` = omitted).
    pub fn from_config(
        interval_sec: Option<i64>,
        max_attempts: Option<i64>,
    ) -> Result<Self, ReconnectConfigError> {
        let max_attempts = match max_attempts {
            None => AttemptLimit::Finite(DEFAULT_MAX_ATTEMPTS),
            Some(0) => AttemptLimit::Unlimited,
            Some(n) if n < 0 => return Err(ReconnectConfigError::NegativeMaxAttempts),
            Some(n) => AttemptLimit::Finite(
                u32::try_from(n).map_err(|_| ReconnectConfigError::MaxAttemptsTooLarge)?,
            ),
        };
        let interval = match interval_sec {
            None => DEFAULT_INTERVAL,
            Some(s) if s < 0 => return Err(ReconnectConfigError::NegativeInterval),
            Some(0) if max_attempts == AttemptLimit::Unlimited => {
                return Err(ReconnectConfigError::UnlimitedNeedsPositiveInterval);
            }
            Some(s) => Duration::from_secs(s.unsigned_abs()),
        };
        Ok(Self {
            wait: interval_wait(interval),
            max_attempts,
        })
    }

    /// Sets the jitter fraction (default [`DEFAULT_JITTER`]; 0 disables jitter).
    pub fn with_jitter(mut self, jitter: f64) -> Result<Self, ReconnectConfigError> {
        self.wait = self
            .wait
            .with_jitter(jitter)
            .map_err(|_| ReconnectConfigError::InvalidJitter)?;
        Ok(self)
    }

    /// The configured interval.
    pub fn interval(&self) -> Duration {
        self.wait.max()
    }

    /// The attempt limit.
    pub fn max_attempts(&self) -> AttemptLimit {
        self.max_attempts
    }

    /// The wait before the next attempt, for a uniform `random` value.
    pub fn backoff(&self, random: u32) -> Duration {
        self.wait.delay(1, random)
    }
}

/// How an attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Failure {
    /// A remote failure (dial refused, TLS failure from the peer, registration refused,
    /// `ready=false`, heartbeat timeout, disconnect): retry under the policy.
    Retryable,
    /// A local config or credential error: stop now.
    Fatal,
}

/// How the supervisor ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exit {
    /// Local shutdown: exit code 0.
    Shutdown,
    /// The finite attempt budget ran out: exit code 1.
    Exhausted {
        /// Attempts made since the last ready session.
        attempts: u32,
    },
    /// A non-retryable error: exit code 1.
    Fatal,
}

impl Exit {
    /// The process exit code for this outcome.
    pub fn exit_code(self) -> i32 {
        match self {
            Self::Shutdown => 0,
            Self::Exhausted { .. } | Self::Fatal => 1,
        }
    }
}

/// What the driver must do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Dial the Edge; this is attempt number `attempt` (from 1) since the last ready session.
    Dial {
        /// Attempt number.
        attempt: u32,
    },
    /// Stop with this outcome.
    Exit(Exit),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// A dial or session is in progress.
    Running,
    /// Waiting until the instant, then dial.
    Waiting(Instant),
    /// Finished.
    Done(Exit),
}

/// The supervisor machine. Start with [`Supervisor::new`], which yields the first dial.
#[derive(Debug)]
pub struct Supervisor {
    policy: ReconnectPolicy,
    state: State,
    /// Attempts started since the last ready session.
    attempts: u32,
    action: Option<Action>,
}

impl Supervisor {
    /// A supervisor whose first [`Supervisor::poll_action`] is `Dial { attempt: 1 }`.
    pub fn new(policy: ReconnectPolicy) -> Self {
        Self {
            policy,
            state: State::Running,
            attempts: 1,
            action: Some(Action::Dial { attempt: 1 }),
        }
    }

    /// Attempts started since the last ready session.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The outcome, once finished.
    pub fn exit(&self) -> Option<Exit> {
        match self.state {
            State::Done(e) => Some(e),
            _ => None,
        }
    }

    /// The current attempt's session reached ready: the attempt budget resets.
    pub fn handle_ready(&mut self) {
        if self.state == State::Running {
            self.attempts = 0;
        }
    }

    /// The current attempt (dial or the session after it) ended with `failure`.
    /// `random` feeds the jitter.
    pub fn handle_failure(&mut self, now: Instant, failure: Failure, random: u32) {
        if self.state != State::Running {
            return;
        }
        if failure == Failure::Fatal {
            return self.finish(Exit::Fatal);
        }
        if let AttemptLimit::Finite(max) = self.policy.max_attempts
            && self.attempts >= max
        {
            return self.finish(Exit::Exhausted {
                attempts: self.attempts,
            });
        }
        let wait = self.policy.backoff(random);
        self.state = State::Waiting(now.checked_add(wait).unwrap_or(now));
    }

    /// Local shutdown: finish cleanly whatever the state.
    pub fn handle_shutdown(&mut self) {
        if !matches!(self.state, State::Done(_)) {
            self.finish(Exit::Shutdown);
        }
    }

    /// Handles the expiry of [`Supervisor::poll_timeout`].
    pub fn handle_timeout(&mut self, now: Instant) {
        if let State::Waiting(at) = self.state
            && now >= at
        {
            self.attempts = self.attempts.saturating_add(1);
            self.state = State::Running;
            self.action = Some(Action::Dial {
                attempt: self.attempts,
            });
        }
    }

    /// The next action, if any.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.action.take()
    }

    /// When [`Supervisor::handle_timeout`] must be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Waiting(at) => Some(at),
            _ => None,
        }
    }

    fn finish(&mut self, exit: Exit) {
        self.state = State::Done(exit);
        self.action = Some(Action::Exit(exit));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_table() {
        let p = ReconnectPolicy::from_config(None, None).unwrap();
        assert_eq!(p.interval(), Duration::from_secs(10));
        assert_eq!(p.max_attempts(), AttemptLimit::Finite(10));
        let p = ReconnectPolicy::from_config(None, Some(0)).unwrap();
        assert_eq!(p.max_attempts(), AttemptLimit::Unlimited);
        assert_eq!(
            p.interval(),
            Duration::from_secs(10),
            "unlimited with omitted interval = 10"
        );
        assert_eq!(
            ReconnectPolicy::from_config(Some(3), Some(7))
                .unwrap()
                .max_attempts(),
            AttemptLimit::Finite(7)
        );
        assert_eq!(
            ReconnectPolicy::from_config(None, Some(-1)),
            Err(ReconnectConfigError::NegativeMaxAttempts)
        );
        assert_eq!(
            ReconnectPolicy::from_config(Some(-1), None),
            Err(ReconnectConfigError::NegativeInterval)
        );
        assert_eq!(
            ReconnectPolicy::from_config(Some(0), Some(0)),
            Err(ReconnectConfigError::UnlimitedNeedsPositiveInterval)
        );
        assert!(ReconnectPolicy::from_config(Some(0), Some(2)).is_ok());
        assert_eq!(
            ReconnectPolicy::from_config(None, Some(i64::from(u32::MAX) + 1)),
            Err(ReconnectConfigError::MaxAttemptsTooLarge)
        );
    }

    #[test]
    fn backoff_stays_in_the_jitter_window() {
        let p = ReconnectPolicy::from_config(Some(10), None).unwrap();
        assert_eq!(p.backoff(0), Duration::from_secs(10));
        let low = p.backoff(u32::MAX);
        assert!(
            low >= Duration::from_secs(8)
                && low <= Duration::from_secs(8) + Duration::from_millis(1)
        );
        let none = p.with_jitter(0.0).unwrap();
        assert_eq!(none.backoff(u32::MAX), Duration::from_secs(10));
        assert!(p.with_jitter(1.5).is_err());
    }
}
