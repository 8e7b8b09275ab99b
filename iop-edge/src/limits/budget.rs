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
//! memory (a restart resets it).
//!
//! **Shared by several Edges** (with `[auth.shared]`): a key's budgets hold for all Edges
//! together, kept in Redis next to its rate limits (`budget.lua`: one call per decision, the
//! key id as hash tag; a hash per key and UTC day, one per month, in nano-dollars: `charged`
//! and `spent`). As for rate limits, an Edge **borrows ahead**: when its credit for a key does
//! not cover a reservation it takes what is missing plus up to `budget / borrow_divisor` more
//! (at most `1/share` of what is left), and reserves from that credit with no round trip. At
//! the end a reservation's unspent part goes back into the credit; an underestimate the
//! credit does not cover is charged later. Once a second, in the background, each Edge reports
//! what it spent, charges what it owes and gives back credit unused for `credit_idle`. So
//! every dollar an Edge spends was charged in Redis before it was spent: the Edges together
//! exceed a budget by no more than their requests' underestimates, as one Edge alone; and a
//! restarted Edge finds the day's and month's spend in Redis. A refusal is final
//! (`Exhausted`) when the reported spend alone leaves no room (it lags by up to a second),
//! otherwise `Held` (credit held by other Edges or reservations in flight: retry shortly).
//! When Redis cannot decide: `on_unavailable = "local"` falls back to this Edge's own count
//! (what it spends then is not reported to Redis), `"closed"` refuses with 503.
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
    /// Shared budgets whose store cannot decide, with `on_unavailable = "closed"` (503).
    Unavailable,
}

/// The UTC day and month a time falls in: indexes, and the rollup's day and month strings.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Period {
    day: i64,
    month: i64,
    day_text: String,
    month_text: String,
}

/// The current UTC period, computed (with its texts) once per day and shared: a request
/// reads the clock and compares a day number.
fn period_now() -> Arc<Period> {
    static CACHE: Mutex<Option<Arc<Period>>> = Mutex::new(None);
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let day = secs.div_euclid(86_400);
    let mut cache = lock(&CACHE);
    if let Some(p) = cache.as_ref().filter(|p| p.day == day) {
        return Arc::clone(p);
    }
    let now =
        time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let date = now.date();
    let day_text = date.to_string();
    let month_text = day_text.get(..7).unwrap_or_default().to_owned();
    let p = Arc::new(Period {
        day,
        month: i64::from(date.year()) * 12 + i64::from(u8::from(date.month())),
        day_text,
        month_text,
    });
    *cache = Some(Arc::clone(&p));
    p
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
    /// What was spent in `p`'s day and month, without rolling.
    fn now(&self, p: &Period) -> (u64, u64) {
        (
            if self.day == p.day { self.day_spent } else { 0 },
            if self.month == p.month {
                self.month_spent
            } else {
                0
            },
        )
    }

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
    fleet: Option<Fleet>,
}

/// Shared budgets: the store and this Edge's credit per key (module docs).
struct Fleet {
    store: Arc<super::shared::RateStore>,
    on_unavailable: super::OnUnavailable,
    borrow_divisor: u64,
    share: u64,
    credit_idle: std::time::Duration,
    keys: Mutex<HashMap<String, FleetKey>>,
    flusher: OnceLock<()>,
    /// The limiter's store-call and store-error metrics.
    calls: prometheus_client::metrics::family::Family<
        super::metrics::OpLabel,
        prometheus_client::metrics::counter::Counter,
    >,
    errors: prometheus_client::metrics::counter::Counter,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

/// One key's shared-budget state on this Edge, for one UTC day and month.
#[derive(Debug, Default)]
struct FleetKey {
    day: String,
    month: String,
    /// The budgets last reserved under (nano-dollars; 0: none), for the background calls.
    budgets: [u64; 2],
    /// Borrowed and not reserved (pico-dollars).
    credit: u64,
    /// Spent and not yet reported (pico-dollars).
    spend: u64,
    /// Owed beyond the credit and not yet charged (pico-dollars).
    force: u64,
    last_used: Option<std::time::Instant>,
    borrowing: Arc<tokio::sync::Mutex<()>>,
}

impl FleetKey {
    fn roll(&mut self, p: &Period) {
        if self.day != p.day_text || self.month != p.month_text {
            // A new period: the old one's credit and debts stay with it (its hashes expire).
            *self = Self {
                day: p.day_text.clone(),
                month: p.month_text.clone(),
                borrowing: Arc::clone(&self.borrowing),
                ..Self::default()
            };
        }
    }
}

/// Pico-dollars per nano-dollar (the store counts nano-dollars: exact in Lua up to $9M).
const PICO_PER_NANO: u64 = 1000;

fn nano_budget(pusd: Option<u64>) -> u64 {
    pusd.map_or(0, |v| (v / PICO_PER_NANO).max(1))
}

impl Budgets {
    /// Budgets priced by `prices` (model group → price).
    pub fn new(prices: BTreeMap<String, Price>) -> Self {
        Self {
            prices,
            ..Self::default()
        }
    }

    /// Budgets shared with other Edges through `store` (`shared`'s borrowing and store-failure
    /// settings apply).
    pub(super) fn shared(
        prices: BTreeMap<String, Price>,
        store: Arc<super::shared::RateStore>,
        shared: &super::SharedConfig,
        metrics: &super::metrics::LimiterMetrics,
    ) -> Self {
        Self {
            prices,
            fleet: Some(Fleet {
                store,
                on_unavailable: shared.on_unavailable,
                borrow_divisor: shared.borrow_divisor.max(1),
                share: shared.share.max(1),
                credit_idle: shared.credit_idle,
                keys: Mutex::new(HashMap::new()),
                flusher: OnceLock::new(),
                calls: metrics.store_calls.clone(),
                errors: metrics.store_errors.clone(),
            }),
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

    /// Reserves the estimated cost of a request of `key` to `model` against `budget` (shared
    /// mode: from this Edge's credit, borrowing from the store when it does not cover it).
    /// `Ok(None)`: nothing to hold (no budget, or the model has no price).
    pub async fn reserve(
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
        if let Some(fleet) = &self.fleet {
            match self.reserve_shared(fleet, key, budget, estimate).await {
                Ok(day) => {
                    return Ok(Some(BudgetHold {
                        budgets: Arc::clone(self),
                        key: key.to_owned(),
                        reserved: estimate,
                        price,
                        settled: false,
                        shared_day: Some(day),
                    }));
                }
                Err(Some(refusal)) => return Err(refusal),
                Err(None) if fleet.on_unavailable == super::OnUnavailable::Closed => {
                    return Err(BudgetRefusal::Unavailable);
                }
                // The store is away: this Edge's own count until it is back.
                Err(None) => {}
            }
        }
        self.reserve_local(key, budget, price, estimate)
    }

    /// Shared mode: `estimate` from the key's credit, borrowing what is missing. The day the
    /// reservation was made for; `Err(None)` when the store cannot decide.
    async fn reserve_shared(
        self: &Arc<Self>,
        fleet: &Fleet,
        key: &str,
        budget: &Budget,
        estimate: u64,
    ) -> Result<String, Option<BudgetRefusal>> {
        let p = period_now();
        let budgets = [
            nano_budget(budget.per_day_pusd),
            nano_budget(budget.per_month_pusd),
        ];
        let from_credit = |e: &mut FleetKey| {
            e.roll(&p);
            e.budgets = budgets;
            e.last_used = Some(std::time::Instant::now());
            (e.credit >= estimate).then(|| e.credit -= estimate)
        };
        let borrowing = {
            let mut keys = lock(&fleet.keys);
            if !keys.contains_key(key) {
                keys.insert(key.to_owned(), FleetKey::default());
            }
            let Some(e) = keys.get_mut(key) else {
                return Err(None);
            };
            if from_credit(e).is_some() {
                return Ok(p.day_text.clone());
            }
            Arc::clone(&e.borrowing)
        };
        // One borrow per key at a time: a burst waits for it, then spends what it took ahead.
        let _borrowing = borrowing.lock().await;
        let need = {
            let mut keys = lock(&fleet.keys);
            let e = keys.entry(key.to_owned()).or_default();
            if from_credit(e).is_some() {
                return Ok(p.day_text.clone());
            }
            estimate - e.credit
        };
        self.start_flusher();
        let ahead = budgets
            .iter()
            .filter(|b| **b > 0)
            .map(|b| b / fleet.borrow_divisor)
            .min()
            .unwrap_or(0);
        fleet
            .calls
            .get_or_create(&super::metrics::OpLabel { op: "budget_take" })
            .inc();
        let answer = fleet
            .store
            .budget_take(
                key,
                &p.day_text,
                &p.month_text,
                need.div_ceil(PICO_PER_NANO),
                estimate.div_ceil(PICO_PER_NANO),
                ahead,
                fleet.share,
                budgets,
            )
            .await;
        match answer {
            Ok(super::shared::BudgetTake::Granted(nano)) => {
                let mut keys = lock(&fleet.keys);
                let e = keys.entry(key.to_owned()).or_default();
                e.roll(&p);
                let credit = e.credit.saturating_add(nano.saturating_mul(PICO_PER_NANO));
                // Credit others took meanwhile leaves a shortfall: owed, charged later.
                e.force = e.force.saturating_add(estimate.saturating_sub(credit));
                e.credit = credit.saturating_sub(estimate);
                Ok(p.day_text.clone())
            }
            Ok(super::shared::BudgetTake::Exhausted(period)) => {
                Err(Some(BudgetRefusal::Exhausted { period }))
            }
            Ok(super::shared::BudgetTake::Held) => Err(Some(BudgetRefusal::Held)),
            Err(e) => {
                fleet.errors.inc();
                tracing::debug!(error = %e, "shared budget store unavailable");
                Err(None)
            }
        }
    }

    /// Starts the background round: once a second, each key's spend is reported, its debts
    /// charged and its idle credit given back.
    fn start_flusher(self: &Arc<Self>) {
        let Some(fleet) = &self.fleet else { return };
        fleet.flusher.get_or_init(|| {
            let weak = Arc::downgrade(self);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let Some(budgets) = weak.upgrade() else {
                        return;
                    };
                    budgets.flush_shared().await;
                }
            });
        });
    }

    /// One background round: each key's spend reported, its debts charged, credit unused for
    /// `credit_idle` given back (the Edge runs it once a second; tests may call it).
    pub async fn flush_shared(&self) {
        let Some(fleet) = &self.fleet else { return };
        let p = period_now();
        let mut calls = Vec::new();
        {
            let mut keys = lock(&fleet.keys);
            // A key is forgotten once it holds nothing and has been idle an hour (or its day
            // is over): the map holds the keys in use, not every key ever seen.
            keys.retain(|_, e| {
                let pending = e.credit + e.spend + e.force > 0;
                let recent = e
                    .last_used
                    .is_some_and(|t| t.elapsed() < std::time::Duration::from_secs(3600));
                pending || (e.day == p.day_text && recent)
            });
            for (key, e) in keys.iter_mut() {
                let idle = e.last_used.is_none_or(|t| t.elapsed() >= fleet.credit_idle);
                let give = if idle { e.credit / PICO_PER_NANO } else { 0 };
                let spend = e.spend / PICO_PER_NANO;
                let force = e.force.div_ceil(PICO_PER_NANO);
                if give + spend + force == 0 {
                    continue;
                }
                e.credit -= give * PICO_PER_NANO;
                e.spend -= spend * PICO_PER_NANO;
                e.force = 0;
                calls.push((
                    key.clone(),
                    e.day.clone(),
                    e.month.clone(),
                    e.budgets,
                    give,
                    spend,
                    force,
                ));
            }
        }
        for (key, day, month, budgets, give, spend, force) in calls {
            fleet
                .calls
                .get_or_create(&super::metrics::OpLabel {
                    op: "budget_settle",
                })
                .inc();
            let r = fleet
                .store
                .budget_settle(&key, &day, &month, give, spend, force, budgets)
                .await;
            if r.is_err() {
                fleet.errors.inc();
                // Kept for the next round (given-back credit stays usable meanwhile).
                let mut keys = lock(&fleet.keys);
                if let Some(e) = keys.get_mut(&key).filter(|e| e.day == day) {
                    e.credit += give * PICO_PER_NANO;
                    e.spend += spend * PICO_PER_NANO;
                    e.force += force * PICO_PER_NANO;
                }
            }
        }
    }

    /// This Edge alone: the in-process count.
    fn reserve_local(
        self: &Arc<Self>,
        key: &str,
        budget: &Budget,
        price: Price,
        estimate: u64,
    ) -> Result<Option<BudgetHold>, BudgetRefusal> {
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
            shared_day: None,
        }))
    }

    /// Shared mode: a reservation made for `day` ends having cost `cost`.
    fn settle_shared(&self, key: &str, day: &str, reserved: u64, cost: u64) {
        let Some(fleet) = &self.fleet else { return };
        let mut keys = lock(&fleet.keys);
        let Some(e) = keys.get_mut(key).filter(|e| e.day == day) else {
            return;
        };
        if cost <= reserved {
            e.credit += reserved - cost;
        } else {
            let owed = cost - reserved;
            let from_credit = owed.min(e.credit);
            e.credit -= from_credit;
            e.force += owed - from_credit;
        }
        e.spend += cost;
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

    /// What `key` has spent this UTC day and month (pico-dollars), as this Edge counts it
    /// (a period that has ended since its last request counts as nothing spent).
    pub fn spent(&self, key: &str) -> (u64, u64) {
        let p = period_now();
        let all = self
            .spend
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.get(key).map_or((0, 0), |s| s.now(&p))
    }

    /// Every key with spend this UTC day or month: `(key, day, month)` in pico-dollars.
    pub fn spenders(&self) -> Vec<(String, u64, u64)> {
        let p = period_now();
        let all = self
            .spend
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.iter()
            .map(|(k, s)| {
                let (day, month) = s.now(&p);
                (k.clone(), day, month)
            })
            .filter(|(_, d, m)| *d > 0 || *m > 0)
            .collect()
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
    /// Shared mode: the UTC day the reservation was taken from the key's credit for.
    shared_day: Option<String>,
}

impl BudgetHold {
    /// Settles to the tokens used: the provider's figures, or `None` for "unknown" (the
    /// reservation is kept whole).
    pub fn settle(mut self, used: Option<iop_wire::runtime::Usage>) {
        let cost = used.map_or(self.reserved, |u| self.price.cost_of(&u));
        self.end(cost);
    }

    fn end(&mut self, cost: u64) {
        match &self.shared_day {
            Some(day) => self
                .budgets
                .settle_shared(&self.key, day, self.reserved, cost),
            None => self.budgets.settle(&self.key, self.reserved, cost),
        }
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
            self.end(0);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[tokio::test]
    async fn concurrent_reservations_cannot_overshoot_and_exhaustion_is_final() {
        let mut prices = BTreeMap::new();
        prices.insert("m".to_owned(), Price::per_million_usd(1.0, 2.0).unwrap());
        let b = Arc::new(Budgets::new(prices));
        // $0.0001 a day; each request estimated at 10 in + 40 out = $0.00009, uses $0.000023.
        let budget = Budget {
            per_day_pusd: usd(0.0001),
            per_month_pusd: None,
        };
        let first = b.reserve("k", &budget, "m", 10, 40).await.unwrap().unwrap();
        // In flight, the second does not fit: held (retry), not exhausted.
        assert_eq!(
            b.reserve("k", &budget, "m", 10, 40).await.unwrap_err(),
            BudgetRefusal::Held
        );
        first.settle(Some(iop_wire::runtime::Usage::new(13, 5)));
        assert_eq!(b.spent("k").0, 23_000_000);
        // Now spent + estimate > budget with nothing in flight: exhausted.
        assert_eq!(
            b.reserve("k", &budget, "m", 10, 40).await.unwrap_err(),
            BudgetRefusal::Exhausted { period: "day" }
        );
        // A smaller request still fits; dropped unsettled, it costs nothing.
        drop(b.reserve("k", &budget, "m", 10, 10).await.unwrap().unwrap());
        assert_eq!(b.spent("k").0, 23_000_000);
        // No price: no budget applies.
        assert!(
            b.reserve("k", &budget, "free", 10, 1_000_000)
                .await
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
