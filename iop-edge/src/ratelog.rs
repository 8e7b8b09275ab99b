//! Rate-limited logging: one line per period for a repeated event, with the count of the
//! occurrences it stands for, so a flood (aborted handshakes, an exhausted fd table) never
//! becomes a tight log loop.

use std::time::{Duration, Instant};

/// One repeated event's logging state.
#[derive(Debug)]
pub(crate) struct RateLimited {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimited {
    /// At most one line per `every`.
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// An occurrence: `Some(n)` when it should be logged (`n` occurrences were suppressed since
    /// the last line), `None` when it is counted only.
    pub(crate) fn hit(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last {
            Some(last) if now.duration_since(last) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_period_with_the_count() {
        let mut r = RateLimited::new(Duration::from_secs(3600));
        assert_eq!(r.hit(), Some(0));
        for _ in 0..5 {
            assert_eq!(r.hit(), None);
        }
        let mut r = RateLimited::new(Duration::ZERO);
        assert_eq!(r.hit(), Some(0));
        assert_eq!(r.hit(), Some(0));
    }
}
