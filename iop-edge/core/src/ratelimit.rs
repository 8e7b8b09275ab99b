//! Rate rules (issue #29's first block), pure: the generic cell rate algorithm (GCRA) for
//! requests and tokens per period, with token reservations reconciled to what the provider
//! reports.
//!
//! **Why GCRA.** It is a true rate rule, not a fixed window: one number per limited quantity
//! (the *theoretical arrival time*, TAT) says when the quantity will be fully replenished, so
//! there is no window edge at which twice the limit can pass, and the same rule runs in
//! process or as one Redis script over one key (the TAT is an integer; the later Redis store
//! keeps exactly [`Gcra::tat_us`]). A [`Rate`] of `limit` units per `period` lets `limit` units
//! through at once from a full state, and then one unit every `period / limit`.
//!
//! **Time** is an argument, in microseconds on a clock the caller chooses (the in-process
//! limiter counts from its start; a shared one uses the store's clock), never read here.
//!
//! **Reservations.** A request's tokens are not known at admission, so the limiter
//! [reserves](Gcra::reserve) an estimate (the request's `max_tokens` or `max_output_tokens`
//! plus the input estimate) and [reconciles](Gcra::reconcile) it to the provider's usage at the
//! end: the difference is charged (an underestimate: the key owes it, and later requests wait)
//! or given back (an overestimate). Charges round up and refunds round down, so rounding can only
//! make the limiter stricter.
//!
//! **The bound** (property-tested in `tests/ratelimit.rs` over generated interleavings of
//! reservations, reconciliations and plain takes): counting each admitted request at its
//! actual units once reconciled and at its reservation while in flight, the units admitted
//! from the first use `t0` up to any time `t` are at most
//!
//! ```text
//! limit × (t − t0) / period  +  limit  +  U
//! ```
//!
//! where `U` is the sum of the underestimates (actual − reserved, where positive) of the
//! requests reconciled since the last admission. At every admission `U = 0`: the bound holds
//! with no slack, however concurrent requests interleave. An underestimate is charged in full
//! when it is reconciled, so the overshoot it causes lasts only until the next admission,
//! which waits for it to be paid back. When every estimate is an upper bound (a provider never
//! returns more than `max_tokens`, and the input estimate does not undercount), `U` is always
//! 0.

use std::time::Duration;

/// A limit: at most `limit` units per `period` (and `limit` at once from a full state).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    limit: u64,
    period_us: u64,
}

impl Rate {
    /// `limit` units per `period`; `None` for a zero limit, or a period of zero or too long to
    /// count in microseconds.
    pub fn new(limit: u64, period: Duration) -> Option<Self> {
        let period_us = u64::try_from(period.as_micros()).ok()?;
        (limit > 0 && period_us > 0).then_some(Self { limit, period_us })
    }

    /// `limit` units per minute.
    pub fn per_minute(limit: u64) -> Option<Self> {
        Self::new(limit, Duration::from_secs(60))
    }

    /// The units per period.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_micros(self.period_us)
    }

    /// The time `units` occupy (`units × period / limit`), rounded up: what a charge adds.
    fn span_up(&self, units: u64) -> u64 {
        let n = u128::from(units) * u128::from(self.period_us);
        u64::try_from(n.div_ceil(u128::from(self.limit))).unwrap_or(u64::MAX)
    }

    /// The same, rounded down: what a refund takes back.
    fn span_down(&self, units: u64) -> u64 {
        let n = u128::from(units) * u128::from(self.period_us);
        u64::try_from(n / u128::from(self.limit)).unwrap_or(u64::MAX)
    }

    /// The whole units that fit in `us` microseconds of headroom.
    fn units_in(&self, us: u64) -> u64 {
        let n = u128::from(us) * u128::from(self.limit) / u128::from(self.period_us);
        u64::try_from(n).unwrap_or(u64::MAX)
    }
}

/// What a check decided, with what a client is told (`x-ratelimit-*`, `retry-after`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The units were admitted.
    pub allowed: bool,
    /// Units that could still be admitted right after this decision.
    pub remaining: u64,
    /// Time until the quantity is fully replenished (after this decision).
    pub reset_after: Duration,
    /// Refused: the time until `cost` units fit, if nothing else is admitted meanwhile;
    /// `None` when admitted, or when `cost` exceeds the limit itself (it never fits).
    pub retry_after: Option<Duration>,
}

/// The state of one limited quantity (requests, or tokens) of one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Gcra {
    tat_us: u64,
}

/// Tokens reserved by an admitted request, to [reconcile](Gcra::reconcile) at its end.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reservation is reconciled when its request ends"]
pub struct Reservation {
    units: u64,
}

impl Reservation {
    /// The units reserved.
    pub fn units(&self) -> u64 {
        self.units
    }
}

impl Gcra {
    /// The state with theoretical arrival time `tat_us` (as a shared store keeps it).
    pub fn from_tat(tat_us: u64) -> Self {
        Self { tat_us }
    }

    /// The theoretical arrival time: when the quantity is fully replenished.
    pub fn tat_us(&self) -> u64 {
        self.tat_us
    }

    /// Whether `cost` units would be admitted at `now_us`, changing nothing.
    pub fn check(&self, rate: &Rate, now_us: u64, cost: u64) -> Decision {
        let base = self.tat_us.max(now_us);
        let held = base - now_us;
        let new_tat = base.saturating_add(rate.span_up(cost));
        let after = new_tat - now_us;
        if cost <= rate.limit && after <= rate.period_us {
            Decision {
                allowed: true,
                remaining: rate.units_in(rate.period_us - after),
                reset_after: Duration::from_micros(after),
                retry_after: None,
            }
        } else {
            Decision {
                allowed: false,
                remaining: rate.units_in(rate.period_us.saturating_sub(held)),
                reset_after: Duration::from_micros(held),
                retry_after: (cost <= rate.limit)
                    .then(|| Duration::from_micros(after - rate.period_us)),
            }
        }
    }

    /// Admits `cost` units at `now_us` if they fit.
    pub fn take(&mut self, rate: &Rate, now_us: u64, cost: u64) -> Decision {
        let d = self.check(rate, now_us, cost);
        if d.allowed {
            self.tat_us = self.tat_us.max(now_us).saturating_add(rate.span_up(cost));
        }
        d
    }

    /// Reserves `estimate` units at `now_us` if they fit.
    pub fn reserve(
        &mut self,
        rate: &Rate,
        now_us: u64,
        estimate: u64,
    ) -> Result<(Reservation, Decision), Decision> {
        let d = self.take(rate, now_us, estimate);
        if d.allowed {
            Ok((Reservation { units: estimate }, d))
        } else {
            Err(d)
        }
    }

    /// Settles a reservation at `now_us` to the `actual` units used: the difference is
    /// charged (even past the limit: the key owes it) or given back.
    pub fn reconcile(&mut self, rate: &Rate, now_us: u64, reservation: Reservation, actual: u64) {
        let reserved = reservation.units;
        if actual > reserved {
            self.charge(rate, now_us, actual - reserved);
        } else {
            self.refund(rate, reserved - actual);
        }
    }

    /// Charges `units` at `now_us` whatever the state: units already used (an underestimate
    /// settled), which the key owes even past its limit.
    pub fn charge(&mut self, rate: &Rate, now_us: u64, units: u64) {
        self.tat_us = self.tat_us.max(now_us).saturating_add(rate.span_up(units));
    }

    /// Gives back `units` that were charged and never used (rounded down: a refund never
    /// gives back more than was charged).
    pub fn refund(&mut self, rate: &Rate, units: u64) {
        self.tat_us = self.tat_us.saturating_sub(rate.span_down(units));
    }

    /// Borrows for a shared store ([`Credit`]): takes `need` units at `now_us` and up to
    /// `ahead` more, the extra at most `1/share` of what remains once `need` is taken, so the
    /// shares borrowed shrink as the quantity nears its limit. Returns the units granted (at
    /// least `need`) and the decision for them, or the refusal of `need` (nothing taken).
    ///
    /// This is the rule the Edge's Redis script runs (`iop_edge::limits`, checked against this
    /// function by a differential test).
    pub fn borrow(
        &mut self,
        rate: &Rate,
        now_us: u64,
        need: u64,
        ahead: u64,
        share: u64,
    ) -> Result<(u64, Decision), Decision> {
        let d = self.check(rate, now_us, need);
        if !d.allowed {
            return Err(d);
        }
        let extra = ahead.min(d.remaining / share.max(1));
        let with_extra = self.take(rate, now_us, need.saturating_add(extra));
        if with_extra.allowed {
            return Ok((need.saturating_add(extra), with_extra));
        }
        // Rounding can leave `remaining` one unit short of what fits with `need`.
        Ok((need, self.take(rate, now_us, need)))
    }
}

/// One Edge's local share of one quantity of a key limited through a shared store: units
/// [borrowed](Gcra::borrow) from the store (charged there already) and not yet spent.
/// Spending from it needs no round trip; a request it does not cover asks the store for the
/// difference.
///
/// **Why this cannot overshoot.** Every unit an Edge spends was charged to the shared
/// [`Gcra`] when it was borrowed, before it was spent, and units go back to the store only if
/// never spent. So the units spent by all Edges together up to any time are at most those the
/// store charged up to then, less what was given back, and the store's own bound applies to
/// the whole fleet: `limit × (t − t0) / period + limit + U`, for any number of Edges. The cost
/// of borrowing is the other way: units an Edge holds are not available to the others until
/// spent or given back (at most `ahead` per Edge and quantity, and less near the limit).
/// Property-tested over generated interleavings of several Edges in `tests/ratelimit.rs`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Credit {
    units: u64,
}

impl Credit {
    /// Units held.
    pub fn units(&self) -> u64 {
        self.units
    }

    /// Takes up to `cost` units from the credit; returns what it took (the rest must be
    /// borrowed).
    pub fn take(&mut self, cost: u64) -> u64 {
        let taken = self.units.min(cost);
        self.units -= taken;
        taken
    }

    /// Adds units: a grant's extra, units taken for a request that was refused, or an
    /// overestimate settled locally.
    pub fn add(&mut self, units: u64) {
        self.units = self.units.saturating_add(units);
    }

    /// Takes everything (to give it back to the store).
    pub fn take_all(&mut self) -> u64 {
        std::mem::take(&mut self.units)
    }
}

/// One key's limits; each may be absent (not limited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Requests per period.
    pub requests: Option<Rate>,
    /// Tokens (input + output) per period.
    pub tokens: Option<Rate>,
    /// Requests in flight at once.
    pub concurrent: Option<u32>,
}

/// Which of a key's limits refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exceeded {
    /// Requests per period.
    Requests,
    /// Tokens per period.
    Tokens,
    /// Requests in flight.
    Concurrent,
}

impl Exceeded {
    /// A stable name (metric label, log field).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
            Self::Concurrent => "concurrent",
        }
    }
}

/// A request refused by its key's limits: which one, and when to retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The limit that refused (of several, the one whose wait is longest).
    pub exceeded: Exceeded,
    /// When the request would fit if nothing else were admitted meanwhile (the longest wait
    /// of the limits that refused); `None` when that is unknown (a concurrency limit frees
    /// when a request ends) or never (the estimate exceeds the token limit itself).
    pub retry_after: Option<Duration>,
    /// The request limit's state, for the response headers.
    pub requests: Option<Decision>,
    /// The token limit's state, for the response headers.
    pub tokens: Option<Decision>,
}

/// An admitted request's hold on its key: give it back with [`KeyState::finish`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an admitted request is finished when it ends"]
pub struct Admitted {
    tokens: Option<Reservation>,
    /// The request limit's state after the admission, for the response headers.
    pub requests: Option<Decision>,
    /// The token limit's state after the reservation, for the response headers.
    pub token_decision: Option<Decision>,
}

impl Admitted {
    /// The tokens reserved at admission (0 without a token limit): what the request is
    /// charged if its usage is never known.
    pub fn reserved(&self) -> u64 {
        self.tokens.as_ref().map_or(0, Reservation::units)
    }
}

/// The in-process state of one key: one [`Gcra`] per rate and the requests in flight. One Edge
/// with no shared store enforces a key's [`Limits`] with this alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KeyState {
    requests: Gcra,
    tokens: Gcra,
    in_flight: u32,
}

impl KeyState {
    /// Requests of this key in flight.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Whether [`KeyState::admit`] would admit the request now, changing nothing: a caller
    /// that must admit against several states at once (a key and a key × model) checks every
    /// one before it admits any.
    pub fn check(&self, limits: &Limits, now_us: u64, estimate: u64) -> Result<(), Refused> {
        let mut copy = *self;
        copy.admit(limits, now_us, estimate).map(|_| ())
    }

    /// What could still be admitted at `now_us`, changing nothing: requests and tokens
    /// (`None` for a quantity `limits` does not limit).
    pub fn remaining(&self, limits: &Limits, now_us: u64) -> (Option<u64>, Option<u64>) {
        (
            limits
                .requests
                .map(|r| self.requests.check(&r, now_us, 0).remaining),
            limits
                .tokens
                .map(|r| self.tokens.check(&r, now_us, 0).remaining),
        )
    }

    /// Whether this state is at rest: nothing in flight and every rate fully replenished at
    /// `now_us`, so forgetting it changes no later decision.
    pub fn is_idle(&self, now_us: u64) -> bool {
        self.in_flight == 0 && self.requests.tat_us <= now_us && self.tokens.tat_us <= now_us
    }

    /// Admits one request reserving `estimate` tokens at `now_us`, or refuses it. All limits
    /// are checked before any is charged: a refusal changes nothing.
    pub fn admit(
        &mut self,
        limits: &Limits,
        now_us: u64,
        estimate: u64,
    ) -> Result<Admitted, Refused> {
        let requests = limits
            .requests
            .map(|r| (r, self.requests.check(&r, now_us, 1)));
        let tokens = limits
            .tokens
            .map(|r| (r, self.tokens.check(&r, now_us, estimate)));
        // Of several refusals, the one whose wait is longest: a cost that never fits, then
        // the longest known wait, then a concurrency limit (its wait is unknown).
        let rank = |d: Option<&Decision>| match d {
            Some(Decision {
                retry_after: Some(wait),
                ..
            }) => (1, *wait),
            Some(_) => (2, Duration::ZERO),
            None => (0, Duration::ZERO),
        };
        let mut refused: Option<(Exceeded, (u8, Duration))> = None;
        let mut consider = |exceeded, wait: (u8, Duration)| {
            if refused.is_none_or(|(_, w)| wait > w) {
                refused = Some((exceeded, wait));
            }
        };
        if let Some((_, d)) = requests.filter(|(_, d)| !d.allowed) {
            consider(Exceeded::Requests, rank(Some(&d)));
        }
        if let Some((_, d)) = tokens.filter(|(_, d)| !d.allowed) {
            consider(Exceeded::Tokens, rank(Some(&d)));
        }
        if limits.concurrent.is_some_and(|c| self.in_flight >= c) {
            consider(Exceeded::Concurrent, rank(None));
        }
        let refused = refused.map(|(exceeded, (kind, wait))| Refused {
            exceeded,
            retry_after: (kind == 1).then_some(wait),
            requests: requests.map(|(_, d)| d),
            tokens: tokens.map(|(_, d)| d),
        });
        if let Some(r) = refused {
            return Err(r);
        }
        let requests = requests.map(|(r, _)| self.requests.take(&r, now_us, 1));
        let (reservation, token_decision) = match tokens {
            Some((r, _)) => match self.tokens.reserve(&r, now_us, estimate) {
                Ok((res, d)) => (Some(res), Some(d)),
                // Checked above at the same instant: it fits.
                Err(d) => (None, Some(d)),
            },
            None => (None, None),
        };
        self.in_flight = self.in_flight.saturating_add(1);
        Ok(Admitted {
            tokens: reservation,
            requests,
            token_decision,
        })
    }

    /// Ends an admitted request at `now_us`: its reservation is reconciled to the `actual`
    /// tokens it used, and it no longer counts as in flight.
    pub fn finish(&mut self, limits: &Limits, now_us: u64, admitted: Admitted, actual: u64) {
        if let (Some(rate), Some(reservation)) = (limits.tokens, admitted.tokens) {
            self.tokens.reconcile(&rate, now_us, reservation, actual);
        }
        self.in_flight = self.in_flight.saturating_sub(1);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn a_full_minute_passes_at_once_then_one_per_interval() {
        let rate = Rate::per_minute(60).unwrap();
        let mut g = Gcra::default();
        let t0 = 1_000_000_000;
        for i in 0..60 {
            let d = g.take(&rate, t0, 1);
            assert!(d.allowed, "request {i}");
            assert_eq!(d.remaining, 59 - i);
        }
        let refused = g.take(&rate, t0, 1);
        assert!(!refused.allowed);
        // One request per second comes back: the next fits in exactly one second.
        assert_eq!(refused.retry_after, Some(Duration::from_secs(1)));
        assert_eq!(refused.reset_after, Duration::from_secs(60));
        assert!(!g.take(&rate, t0 + 999_999, 1).allowed);
        assert!(g.take(&rate, t0 + 1_000_000, 1).allowed);
    }

    #[test]
    fn a_cost_above_the_limit_never_fits() {
        let rate = Rate::per_minute(100).unwrap();
        let d = Gcra::default().check(&rate, 0, 101);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, None);
        assert_eq!(d.remaining, 100);
    }

    #[test]
    fn an_overestimate_is_given_back_and_an_underestimate_owed() {
        let rate = Rate::per_minute(1000).unwrap();
        let mut g = Gcra::default();
        let (r, _) = g.reserve(&rate, 0, 800).unwrap();
        assert!(g.reserve(&rate, 0, 300).is_err(), "800 + 300 is over 1000");
        g.reconcile(&rate, 0, r, 100);
        let (r, _) = g.reserve(&rate, 0, 900).unwrap();
        g.reconcile(&rate, 0, r, 1900);
        // 100 + 1900 used: the key owes a whole minute; nothing fits until it is paid.
        let d = g.check(&rate, 0, 1);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 0);
        assert_eq!(d.retry_after, Some(Duration::from_micros(60_060_000)));
    }

    #[test]
    fn zero_limits_and_periods_are_refused() {
        assert_eq!(Rate::per_minute(0), None);
        assert_eq!(Rate::new(1, Duration::ZERO), None);
        assert_eq!(Rate::new(1, Duration::MAX), None);
    }

    #[test]
    fn a_refusal_charges_nothing_and_names_the_longest_wait() {
        let limits = Limits {
            requests: Rate::per_minute(2),
            tokens: Rate::per_minute(600),
            concurrent: Some(2),
        };
        let mut k = KeyState::default();
        let a = k.admit(&limits, 0, 500).unwrap();
        // Tokens: 100 left, 200 asked: 10 s until 100 more (10 per second). Requests: 1 left.
        let r = k.admit(&limits, 0, 200).unwrap_err();
        assert_eq!(r.exceeded, Exceeded::Tokens);
        assert_eq!(r.retry_after, Some(Duration::from_secs(10)));
        let before = k;
        let b = k.admit(&limits, 0, 100).unwrap();
        // Both limits refuse now: requests free in 30 s, tokens in 60 s; the longer is named.
        let r = k.admit(&limits, 0, 600).unwrap_err();
        assert_eq!(
            (r.exceeded, r.retry_after),
            (Exceeded::Tokens, Some(Duration::from_secs(60)))
        );
        let r = k.admit(&limits, 0, 1).unwrap_err();
        assert_eq!(
            (r.exceeded, r.retry_after),
            (Exceeded::Requests, Some(Duration::from_secs(30)))
        );
        assert_ne!(before, k, "the admission charged");
        let after = k;
        let _ = k.admit(&limits, 0, 1);
        assert_eq!(after, k, "a refusal charges nothing");
        k.finish(&limits, 0, a, 50);
        k.finish(&limits, 0, b, 100);
        assert_eq!(k.in_flight(), 0);
        // 450 tokens given back: 150 used of 600.
        let d = k.tokens.check(&limits.tokens.unwrap(), 0, 0);
        assert_eq!(d.remaining, 450);
    }

    #[test]
    fn the_concurrency_limit_frees_when_a_request_ends() {
        let limits = Limits {
            concurrent: Some(1),
            ..Limits::default()
        };
        let mut k = KeyState::default();
        let a = k.admit(&limits, 0, 0).unwrap();
        let r = k.admit(&limits, 0, 0).unwrap_err();
        assert_eq!((r.exceeded, r.retry_after), (Exceeded::Concurrent, None));
        k.finish(&limits, 0, a, 0);
        let _ = k.admit(&limits, 0, 0).unwrap();
    }
}
