//! The connection-scoped `health_observation_seq`.
//!
//! Seed 000: it "starts at one per connection and increases uniquely across the connection's
//! normalized and tunnel observations; an unbound session omits it." The Node session owns
//! one counter per connection ([`NodeSession::next_health_observation_seq`]); stall
//! terminals (RunEvent and tunnel ERROR) and CAPABILITIES answers all draw from it, so the
//! Edge can order evidence from one generation by sequence alone.
//!
//! [`NodeSession::next_health_observation_seq`]: crate::node::NodeSession::next_health_observation_seq

/// A strictly increasing counter starting at 1.
#[derive(Clone, Debug)]
pub struct HealthObservationSeq {
    next: u64,
}

impl Default for HealthObservationSeq {
    fn default() -> Self {
        Self::new()
    }
}

impl HealthObservationSeq {
    /// A counter whose first value is 1.
    pub fn new() -> Self {
        Self { next: 1 }
    }

    /// Takes the next value. Saturates at `u64::MAX` (2^64 observations never happen on one
    /// connection, but a wrap to 0 would break the ordering guarantee, so it is ruled out).
    pub fn next_seq(&mut self) -> u64 {
        let v = self.next;
        self.next = self.next.saturating_add(1);
        v
    }

    /// The value the next call to [`HealthObservationSeq::next_seq`] returns.
    pub fn peek(&self) -> u64 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_at_one_and_increases() {
        let mut s = HealthObservationSeq::new();
        assert_eq!(s.peek(), 1);
        let v: Vec<u64> = (0..5).map(|_| s.next_seq()).collect();
        assert_eq!(v, [1, 2, 3, 4, 5]);
    }
}
