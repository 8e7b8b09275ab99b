//! The one retry-delay policy of the workspace, pure: the Node's reconnect supervisor
//! ([`crate::reconnect`]), the Edge's Control Plane connector and the OrbitMesh agent all wait
//! by it.
//!
//! A delay starts at `min`, doubles with every further retry up to `max` (`min == max` is a
//! constant interval), and is jittered *downwards*: each wait is drawn from
//! `[delay × (1 − jitter), delay]`, so a fleet that failed at the same moment does not retry in
//! lockstep, and no wait is ever longer than the policy says (jitter spreads a storm without
//! stretching it). Randomness is an argument (`random: u32`, uniform) and so is every clock:
//! the policy never reads one.
//!
//! Why our own rather than `backon`: `backon`'s jitter adds up to a whole delay on top (a
//! configured 10 s interval becomes 10–20 s), and its randomness is its own generator; both
//! the seed's `reconnect.interval_sec` and replayable tests need the delay to be a bound and
//! the randomness to come from the caller.

use std::time::Duration;

/// A seeded source of the `random` argument (splitmix64): jitter that replays, for
/// deterministic simulations and seeded tests. Production callers pass OS randomness instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The next 32 bits (the high half), as [`Backoff::delay`] takes them.
    pub fn next_u32(&mut self) -> u32 {
        u32::try_from(self.next_u64() >> 32).unwrap_or(0)
    }

    /// A value below `n` (`n > 0`; slightly biased, fine for workloads).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The jitter fraction is outside `0.0..=1.0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("backoff jitter must be within 0.0..=1.0")]
pub struct InvalidJitter;

/// A retry-delay policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    jitter: f64,
}

impl Backoff {
    /// The same `interval` before every retry, without jitter.
    pub const fn constant(interval: Duration) -> Self {
        Self {
            min: interval,
            max: interval,
            jitter: 0.0,
        }
    }

    /// `min`, doubling per retry up to `max` (a `max` below `min` is `min`), without jitter.
    pub fn exponential(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
            jitter: 0.0,
        }
    }

    /// Each wait drawn from `[delay × (1 − jitter), delay]`.
    pub fn with_jitter(mut self, jitter: f64) -> Result<Self, InvalidJitter> {
        if !(0.0..=1.0).contains(&jitter) {
            return Err(InvalidJitter);
        }
        self.jitter = jitter;
        Ok(self)
    }

    /// The first delay.
    pub fn min(&self) -> Duration {
        self.min
    }

    /// The largest delay.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The jitter fraction.
    pub fn jitter(&self) -> f64 {
        self.jitter
    }

    /// The wait before retry number `retry` (1 for the first) for a uniform `random`.
    pub fn delay(&self, retry: u32, random: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(63);
        let base = self
            .min
            .checked_mul(1u32.checked_shl(doublings).unwrap_or(u32::MAX))
            .unwrap_or(self.max)
            .min(self.max);
        let fraction = f64::from(random) / f64::from(u32::MAX);
        base.saturating_sub(base.mul_f64(self.jitter * fraction))
    }
}

/// A running sequence of retries under a [`Backoff`]: [`Retries::next_delay`] after each
/// failure, [`Retries::reset`] after a success.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Retries {
    policy: Backoff,
    /// Retries since the last success.
    retries: u32,
}

impl Retries {
    /// No retry yet.
    pub fn new(policy: Backoff) -> Self {
        Self { policy, retries: 0 }
    }

    /// The wait before the next attempt, for a uniform `random`.
    pub fn next_delay(&mut self, random: u32) -> Duration {
        self.retries = self.retries.saturating_add(1);
        self.policy.delay(self.retries, random)
    }

    /// A success: the next failure starts from the first delay again.
    pub fn reset(&mut self) {
        self.retries = 0;
    }

    /// Retries since the last success.
    pub fn count(&self) -> u32 {
        self.retries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// The reference splitmix64 sequence from seed 0 (Vigna's `splitmix64.c`).
    #[test]
    fn splitmix64_is_the_reference_sequence() {
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(r.next_u32(), 0x06C4_5D18);
    }

    #[test]
    fn exponential_doubles_to_its_cap_and_jitter_only_shortens() {
        let b = Backoff::exponential(200 * MS, 30_000 * MS)
            .with_jitter(0.5)
            .unwrap();
        let none = 0;
        let all = u32::MAX;
        let expected = [200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000];
        for (i, &want) in expected.iter().enumerate() {
            let retry = u32::try_from(i).unwrap() + 1;
            assert_eq!(b.delay(retry, none), want * MS, "retry {retry}");
            assert_eq!(
                b.delay(retry, all),
                want * MS / 2,
                "retry {retry}, full jitter"
            );
            let mid = b.delay(retry, all / 2);
            assert!(mid < want * MS && mid > want * MS / 2);
        }
        // No overflow at absurd retry counts.
        assert_eq!(b.delay(u32::MAX, none), 30_000 * MS);
        assert_eq!(b.delay(0, none), 200 * MS, "retry 0 is the first delay");
    }

    #[test]
    fn constant_is_constant_and_jitter_is_checked() {
        let c = Backoff::constant(Duration::from_secs(10))
            .with_jitter(0.2)
            .unwrap();
        for retry in [1, 2, 50] {
            assert_eq!(c.delay(retry, 0), Duration::from_secs(10));
            assert_eq!(c.delay(retry, u32::MAX), Duration::from_secs(8));
        }
        assert_eq!(Backoff::constant(MS).with_jitter(1.5), Err(InvalidJitter));
        assert_eq!(Backoff::constant(MS).with_jitter(-0.1), Err(InvalidJitter));
        assert_eq!(
            Backoff::exponential(5 * MS, MS).max(),
            5 * MS,
            "max below min is min"
        );
    }

    #[test]
    fn retries_grow_and_reset() {
        let mut r = Retries::new(Backoff::exponential(500 * MS, 60_000 * MS));
        assert_eq!(r.next_delay(0), 500 * MS);
        assert_eq!(r.next_delay(0), 1000 * MS);
        assert_eq!(r.next_delay(0), 2000 * MS);
        assert_eq!(r.count(), 3);
        r.reset();
        assert_eq!(r.next_delay(0), 500 * MS);
    }
}
