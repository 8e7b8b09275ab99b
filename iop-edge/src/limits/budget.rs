//! Spend budgets per key (issue #29): per-model prices, and a budget per key per UTC day and
//! month, charged from the reconciled usage.
//!
//! Money is counted in pico-dollars (10⁻¹² USD): a price of `$X` per million tokens is `X × 10⁶`
//! pico-dollars per token, exact for every published price, and a `u64` holds $18 million.
//!
//! **No overshoot from concurrency.** At admission a request reserves its estimated cost (its
//! input estimate and output cap at the model's prices); it is admitted only if what the
//! period has spent plus every reservation in flight plus its own fits the budget. At its end
//! the reservation is replaced by the cost of the provider's reported usage (or kept whole when
//! none was reported, or dropped when nothing was used). So the budget is exceeded only by
//! requests that used more than their estimate (which a provider honouring `max_tokens` does
//! not).
//!
//! **Refusals.** A request that cannot fit even with nothing in flight (the period has spent
//! its budget, or this request's estimate does not fit what is left) is refused for good:
//! 429 with `x-should-retry: false`, which both official SDKs honour (they do not retry), and
//! OpenAI's `insufficient_quota`. A request that does not fit only because of reservations in
//! flight is a plain 429 with `retry-after: 1` (they settle soon).
//!
//! **Across restarts.** With usage records in SQLite ([`crate::usage::SqliteUsage`]), a key's
//! spend for the current day and month is read back from the daily rollup the first time the
//! key is seen, so a restart does not reset a budget. Without a usage store, spend lives in
//! memory (a restart resets it). Budgets are enforced per Edge: with `[auth.shared]`, each Edge
//! holds the whole budget for itself (sharing spend through Redis is not built yet).
//!
//! Choice: a model without a price costs nothing (its requests pass any budget).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

/// A model's prices, pico-dollars per token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Price {
    /// Per input token.
    pub input_pusd: u64,
    /// Per output token.
    pub output_pusd: u64,
    /// Per input token read from the provider's prompt cache (the input price unless set).
    pub cached_input_pusd: u64,
}

impl Price {
    /// Prices given in USD per million tokens (as providers publish them).
    pub fn per_million_usd(input: f64, output: f64) -> Option<Self> {
        let p = |usd: f64| {
            (0.0..1e6)
                .contains(&usd)
                .then(|| (usd * 1e6).round() as u64)
        };
        let input_pusd = p(input)?;
        Some(Self {
            input_pusd,
            output_pusd: p(output)?,
            cached_input_pusd: input_pusd,
        })
    }

    /// The same prices with cached input at `usd` per million tokens.
    pub fn with_cached_input_usd(self, usd: f64) -> Option<Self> {
        (0.0..1e6).contains(&usd).then(|| Self {
            cached_input_pusd: (usd * 1e6).round() as u64,
            ..self
        })
    }

    /// The cost of `input` and `output` tokens, pico-dollars, all input at the full price (what
    /// a reservation is priced at: the cache hit is not known ahead).
    pub fn cost(&self, input: u64, output: u64) -> u64 {
        self.cost_of(&iop_wire::runtime::Usage::new(input, output))
    }

    /// The cost of `usage`: its cached input at the cached price, the rest at full prices.
    pub fn cost_of(&self, usage: &iop_wire::runtime::Usage) -> u64 {
        let cached = usage.cached_prompt_tokens.min(usage.prompt_tokens);
        (usage.prompt_tokens - cached)
            .saturating_mul(self.input_pusd)
            .saturating_add(cached.saturating_mul(self.cached_input_pusd))
            .saturating_add(usage.completion_tokens.saturating_mul(self.output_pusd))
    }
}

/// USD as pico-dollars (`None` for a negative, non-finite or absurd amount).
pub fn usd(amount: f64) -> Option<u64> {
    (0.0..1e7)
        .contains(&amount)
        .then(|| (amount * 1e12).round() as u64)
}

/// A key's spend budgets (each optional), pico-dollars.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Budget {
    /// Per UTC day.
    pub per_day_pusd: Option<u64>,
    /// Per UTC calendar month.
    pub per_month_pusd: Option<u64>,
}

impl Budget {
    /// Whether no budget is set.
    pub fn is_none(&self) -> bool {
        self.per_day_pusd.is_none() && self.per_month_pusd.is_none()
    }
}

/// Why a budget refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetRefusal {
    /// The period's budget cannot take it even with nothing in flight: do not retry.
    Exhausted {
        /// `day` or `month`.
        period: &'static str,
    },
    /// It fits only once reservations in flight settle: retry shortly.
    Held,
}

/// The UTC day and month a time falls in: indexes, and the rollup's day and month strings.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Period {
    day: i64,
    month: i64,
    day_text: String,
    month_text: String,
}

fn period_now() -> Period {
    let now = time::OffsetDateTime::now_utc();
    let date = now.date();
    let day_text = date.to_string();
    let month_text = day_text.get(..7).unwrap_or_default().to_owned();
    Period {
        day: now.unix_timestamp().div_euclid(86_400),
        month: i64::from(date.year()) * 12 + i64::from(u8::from(date.month())),
        day_text,
        month_text,
    }
}

#[derive(Debug, Default)]
struct Spend {
    day: i64,
    day_spent: u64,
    month: i64,
    month_spent: u64,
    reserved: u64,
}

impl Spend {
    fn roll(&mut self, p: &Period) {
        if self.day != p.day {
            self.day = p.day;
            self.day_spent = 0;
        }
        if self.month != p.month {
            self.month = p.month;
            self.month_spent = 0;
        }
    }
}

/// The Edge's budget state (one per [`super::Limiter`]).
#[derive(Debug, Default)]
pub struct Budgets {
    prices: BTreeMap<String, Price>,
    spend: Mutex<HashMap<String, Spend>>,
    usage: OnceLock<Arc<dyn crate::usage::UsageSink>>,
}

impl Budgets {
    /// Budgets priced by `prices` (model group → price).
    pub fn new(prices: BTreeMap<String, Price>) -> Self {
        Self {
            prices,
            ..Self::default()
        }
    }

    /// Reads spend back from (and prices records for) this usage store.
    pub fn set_usage(&self, usage: Arc<dyn crate::usage::UsageSink>) {
        let _ = self.usage.set(usage);
    }

    /// The price of `model`, if it has one.
    pub fn price(&self, model: &str) -> Option<Price> {
        self.prices.get(model).copied()
    }

    /// Reserves the estimated cost of a request of `key` to `model` against `budget`.
    /// `Ok(None)`: nothing to hold (no budget, or the model has no price).
    pub fn reserve(
        self: &Arc<Self>,
        key: &str,
        budget: &Budget,
        model: &str,
        input: u64,
        output: u64,
    ) -> Result<Option<BudgetHold>, BudgetRefusal> {
        if budget.is_none() {
            return Ok(None);
        }
        let Some(price) = self.price(model) else {
            return Ok(None);
        };
        let estimate = price.cost(input, output);
        let p = period_now();
        let mut all = self
            .spend
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !all.contains_key(key) {
            let mut s = Spend::default();
            s.roll(&p);
            if let Some((day, month)) = self
                .usage
                .get()
                .and_then(|u| u.spent(key, &p.day_text, &p.month_text))
            {
                s.day_spent = day;
                s.month_spent = month;
            }
            all.insert(key.to_owned(), s);
        }
        let Some(s) = all.get_mut(key) else {
            return Ok(None);
        };
        s.roll(&p);
        for (period, limit, spent) in [
            ("day", budget.per_day_pusd, s.day_spent),
            ("month", budget.per_month_pusd, s.month_spent),
        ] {
            let Some(limit) = limit else { continue };
            if spent.saturating_add(estimate) > limit {
                return Err(BudgetRefusal::Exhausted { period });
            }
            if spent.saturating_add(s.reserved).saturating_add(estimate) > limit {
                return Err(BudgetRefusal::Held);
            }
        }
        s.reserved = s.reserved.saturating_add(estimate);
        Ok(Some(BudgetHold {
            budgets: Arc::clone(self),
            key: key.to_owned(),
            reserved: estimate,
            price,
            settled: false,
        }))
    }

    fn settle(&self, key: &str, reserved: u64, cost: u64) {
        let p = period_now();
        let mut all = self
            .spend
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(s) = all.get_mut(key) {
            s.roll(&p);
            s.reserved = s.reserved.saturating_sub(reserved);
            s.day_spent = s.day_spent.saturating_add(cost);
            s.month_spent = s.month_spent.saturating_add(cost);
        }
    }

    /// What `key` has spent this UTC day and month (pico-dollars), as this Edge counts it.
    pub fn spent(&self, key: &str) -> (u64, u64) {
        let all = self
            .spend
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.get(key)
            .map_or((0, 0), |s| (s.day_spent, s.month_spent))
    }
}

/// A request's reservation against its key's budget; settled by the request's [`super::Hold`]
/// (or released unspent if dropped unsettled: the request was refused by a rate limit).
#[derive(Debug)]
pub struct BudgetHold {
    budgets: Arc<Budgets>,
    key: String,
    reserved: u64,
    price: Price,
    settled: bool,
}

impl BudgetHold {
    /// Settles to the tokens used: the provider's figures, or `None` for "unknown" (the
    /// reservation is kept whole).
    pub fn settle(mut self, used: Option<iop_wire::runtime::Usage>) {
        let cost = used.map_or(self.reserved, |u| self.price.cost_of(&u));
        self.budgets.settle(&self.key, self.reserved, cost);
        self.settled = true;
    }

    /// The price the request was reserved at.
    pub fn price(&self) -> Price {
        self.price
    }
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        if !self.settled {
            self.budgets.settle(&self.key, self.reserved, 0);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn concurrent_reservations_cannot_overshoot_and_exhaustion_is_final() {
        let mut prices = BTreeMap::new();
        prices.insert("m".to_owned(), Price::per_million_usd(1.0, 2.0).unwrap());
        let b = Arc::new(Budgets::new(prices));
        // $0.0001 a day; each request estimated at 10 in + 40 out = $0.00009, uses $0.000023.
        let budget = Budget {
            per_day_pusd: usd(0.0001),
            per_month_pusd: None,
        };
        let first = b.reserve("k", &budget, "m", 10, 40).unwrap().unwrap();
        // In flight, the second does not fit: held (retry), not exhausted.
        assert_eq!(
            b.reserve("k", &budget, "m", 10, 40).unwrap_err(),
            BudgetRefusal::Held
        );
        first.settle(Some(iop_wire::runtime::Usage::new(13, 5)));
        assert_eq!(b.spent("k").0, 23_000_000);
        // Now spent + estimate > budget with nothing in flight: exhausted.
        assert_eq!(
            b.reserve("k", &budget, "m", 10, 40).unwrap_err(),
            BudgetRefusal::Exhausted { period: "day" }
        );
        // A smaller request still fits; dropped unsettled, it costs nothing.
        drop(b.reserve("k", &budget, "m", 10, 10).unwrap().unwrap());
        assert_eq!(b.spent("k").0, 23_000_000);
        // No price: no budget applies.
        assert!(
            b.reserve("k", &budget, "free", 10, 1_000_000)
                .unwrap()
                .is_none()
        );
        assert_eq!(
            Price::per_million_usd(0.15, 0.6)
                .unwrap()
                .cost(1_000_000, 0),
            usd(0.15).unwrap()
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod price_tests {
    use super::*;

    #[test]
    fn cached_input_is_charged_at_its_own_price() {
        let p = Price::per_million_usd(2.5, 10.0)
            .unwrap()
            .with_cached_input_usd(1.25)
            .unwrap();
        let mut u = iop_wire::runtime::Usage::new(1_000_000, 100_000);
        assert_eq!(p.cost_of(&u), 3_500_000_000_000, "$2.50 + $1.00");
        u.cached_prompt_tokens = 800_000;
        assert_eq!(
            p.cost_of(&u),
            2_500_000_000_000,
            "$0.50 + $1.00 cached + $1.00"
        );
        assert_eq!(
            Price::per_million_usd(2.5, 10.0).unwrap().cost_of(&u),
            3_500_000_000_000,
            "no cached price: the input price"
        );
        assert!(p.with_cached_input_usd(-1.0).is_none());
    }
}
