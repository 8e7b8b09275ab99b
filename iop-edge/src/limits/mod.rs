//! Per-key rate limits on the Edge (issue #29): requests per minute, tokens per minute and
//! requests in flight, for each gateway key (legacy mode; keys are named by
//! [`crate::http::ApiKeys`]) and optionally for each key × model.
//!
//! The rule is [`iop_edge_core::ratelimit`]'s (GCRA, pure and property-tested); this module
//! keeps one [`KeyState`] per limited key (and key × model) in process, behind one mutex held
//! for one decision, on tokio's clock (so tests in paused time drive it), or shares the limits
//! with other Edges through Redis (below).
//!
//! Spend budgets per key (per UTC day and month, at per-model prices) are [`budget`]'s:
//! reserved at admission with the tokens, settled to the reported usage, refused for good
//! (`x-should-retry: false`) once used up; with [`LimitsConfig::shared`], shared by the Edges
//! through the same Redis (borrowed ahead like the rate limits).
//!
//! `/v1/messages/count_tokens` and `/v1/models` are not limited (they cost the provider
//! nothing, and Anthropic limits them apart).
//!
//! # A request's life
//!
//! 1. [`Limiter::admit`], after authentication and before the request waits for a provider:
//!    one request and an estimate of its tokens are taken from every limit that applies, or
//!    nothing is taken and the request is refused ([`Refused`], rendered as 429 with
//!    `retry-after`). The estimate is the request's output cap (`max_tokens`,
//!    `max_completion_tokens` or `max_output_tokens`; [`LimitsConfig::output_estimate`] when
//!    it names none) plus the input estimate `count_tokens` uses
//!    (`iop_dialect::request::estimate_tokens`).
//! 2. The returned [`Hold`] rides on the response stream
//!    ([`crate::TunnelStream::watch`], [`crate::RunStream::watch`]) and sees the provider's
//!    usage when the Node reports it.
//! 3. When the stream ends or is dropped, the hold is finished: the reservation is reconciled
//!    to the reported tokens (input + output), or kept whole when no usage was reported (the
//!    estimate is charged: never less than the request may have used when the provider
//!    honours its cap), or given back when the request was never sent to a provider (it failed
//!    before: no tokens were used). The request stops counting as in flight.
//!
//! # What the client is told
//!
//! Every answer to a limited key carries the quota after its admission, in the route's
//! dialect, streamed responses included (the headers go out before the first byte):
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` on OpenAI routes (reset as a
//! duration: `1s`, `6m0s`, `250ms`), `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`
//! on `/v1/messages` (reset as an RFC 3339 time). Where a key and its key × model limit both
//! apply, each quantity shows the one with less remaining. A refusal is 429 with
//! `retry-after` (whole seconds, rounded up) and `retry-after-ms` (both official SDKs read it
//! first): the real time until the request would fit if nothing else were admitted, not a
//! whole window; for a concurrency refusal, which frees when a request ends, 1 s.
//!
//! # Shared by several Edges ([`LimitsConfig::shared`])
//!
//! With `[auth.shared]`, a key's request and token limits hold for all Edges together. The
//! rule stays the same GCRA, kept in Redis ([`shared`]: one Lua script per decision, keys
//! hash-tagged by key id so one key's quantities share a Redis Cluster slot). To keep Redis
//! off the hot path, an Edge **borrows ahead**: when its credit for a key does not cover a
//! request, it asks the store for what is missing plus up to `limit / borrow_divisor` more,
//! the extra at most `1/share` of what remains (so shares shrink as the key nears its limit),
//! and spends that credit on later requests with no round trip. One borrow per key is out at
//! a time on an Edge (a burst waits for it, then spends what it took ahead); a refusal from the
//! store is remembered until its `retry-after` (an abusive client costs one store call per
//! wait, not one per request); an overestimate settled at the end goes back into the Edge's
//! credit, an underestimate beyond the credit is charged to the store in the background; and
//! credit unused for `credit_idle` goes back to the store.
//!
//! **Worst-case overshoot across N Edges: none beyond the single rule's.** Every unit an Edge
//! spends was charged to the store when borrowed, before it was spent, and only never-spent
//! units go back; so the fleet's usage from `t0` to `t` is at most
//! `limit × (t − t0) / period + limit + U` (`U`: underestimates charged since the store's last
//! grant), whatever N is. Property-tested over generated interleavings of several Edges in
//! `iop-edge-core`'s `tests/ratelimit.rs`; measured with two real Edges and Redis in the
//! workspace's `tests/tests/rate_limits.rs` (100 concurrent requests for a limit of 40: exactly
//! 40 admitted). The price of borrowing is the other way: units an Edge holds are not
//! available to the others until spent or given back (at most `limit / borrow_divisor` per
//! Edge and quantity).
//!
//! **Redis Cluster** (`cluster = true`): the same script calls through the redis-rs cluster
//! client, which routes each call to the node serving its slot and follows slot moves and
//! failovers; every key of one call carries the key id as its hash tag, so a call never spans
//! slots. Checked against a real cluster (three masters, three replicas) in
//! `iop-edge/tests/rate_script.rs`.
//!
//! What stays per Edge: the in-flight limit (`concurrent` counts this Edge's requests), and
//! the quota headers, which show what the store last said remained plus this Edge's credit.
//!
//! **When the store cannot decide** (down, slower than `timeout_ms`, unreachable), each such
//! request is counted (`iop_edge_ratelimit_store_errors_total`,
//! `iop_edge_ratelimit_store_unavailable_total{key}`), a warning is logged at most every 10 s,
//! and by `on_unavailable`: `local` (the default) enforces the same limits in this Edge alone
//! (so N Edges may together admit up to N times a limit while the store is away), `closed`
//! answers 503 with `retry-after: 1`. The connection is re-made at most once a second; nothing
//! needs a restart.
//!
//! # Managed mode: principals' limits from the Control Plane
//!
//! With a Control Plane (`credential_plane = true`), the key is the principal a token
//! authenticates as, and its limits and budgets travel in the projection
//! (`ProjectedPrincipal::limits`, set with `iop-cp principal limits` or
//! `PUT /admin/v1/principals/{id}/limits`). The limiter [follows](Limiter::follow) the
//! projection each request authenticated under: a newer generation replaces every principal's
//! limits at once (an older one is ignored), a principal without limits is not limited, and a
//! request keeps the limits it was admitted under until it ends. The per-principal state (its
//! rate so far, requests in flight, spend) carries over a change of limits: the rule's state is
//! a time (GCRA's theoretical arrival time), so past use counts at the rate it was admitted
//! under. A raised limit gives its new steady rate at once and its whole burst once that past
//! use has gone by (at most one period of the old limit). How this Edge
//! enforces them (`[auth.shared]`, `auth.output_estimate`, `[prices]`) stays in its own
//! configuration; a rate above [`shared::MAX_EXACT_RATE`] is clamped to it.
//!
//! # Layout
//!
//! This file: the configuration, the in-process limiter and the request's [`Hold`];
//! `fleet.rs`: the Edge's side of shared limits (borrowing, credit, refusals remembered, idle
//! credit returned, store failures); [`shared`]: the Redis store and its script; [`budget`]:
//! spend budgets; `headers.rs`: what clients are told; `metrics.rs`: the Prometheus series.
//!
//! # Choices where the issue was silent
//!
//! - A key with its own entry ([`LimitsConfig::keys`]) has exactly those limits: the default
//!   ([`LimitsConfig::default`]) is not merged into it field by field.
//! - The estimate is reserved whole even when it exceeds what the provider will use; the
//!   difference comes back at the end. A request whose estimate alone exceeds the token limit
//!   can never fit and is refused without `retry-after`.
//! - A request the Edge could not send (no provider within the wait, a refused lease) keeps
//!   its request unit but gives its tokens back.

pub mod budget;
mod fleet;
mod headers;
mod metrics;
pub mod shared;

pub use headers::{Quota, Shown, go_duration};
use metrics::{KeyLabel, LimiterMetrics, OpLabel, RefusedLabels};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use iop_edge_core::ratelimit::{Admitted, Credit, Exceeded, KeyState, Limits, Rate};
use iop_wire::runtime::Usage;

/// Who a request is for, named by the application that embeds the Edge: with no gateway
/// keys configured ([`crate::http::HttpConfig::api_keys`] is `None`), a request carrying this
/// extension (set by your own authentication middleware, `request.extensions_mut().insert(…)`)
/// is limited and recorded under this id, as a gateway key's id would be. The id goes into
/// metric labels and usage records as is: use a bounded set of names (a team, a plan, an
/// account). The limiter forgets idle ids beyond [`MAX_TRACKED_KEYS`] (their metric series
/// too).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KeyId(pub Arc<str>);

impl KeyId {
    /// The id `id`.
    pub fn new(id: &str) -> Self {
        Self(Arc::from(id))
    }
}

/// Keys the limiter holds state for at most; past it, idle ones are forgotten (their state
/// is at rest: nothing changes), and a request of a new key is refused while none is idle.
pub const MAX_TRACKED_KEYS: usize = 100_000;

/// One key's limits: its own, and per model (the model group a request is routed to).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    /// The key's limits, over all models.
    pub limits: Limits,
    /// Limits of the key on one model, checked as well as the key's own.
    pub models: BTreeMap<String, Limits>,
    /// The key's spend budgets ([`budget`]).
    pub budget: budget::Budget,
}

impl KeyLimits {
    /// Whether a token limit applies to a request for `model`.
    pub fn limits_tokens(&self, model: &str) -> bool {
        self.limits.tokens.is_some() || self.models.get(model).is_some_and(|l| l.tokens.is_some())
    }

    /// Whether nothing is limited.
    pub fn is_unlimited(&self) -> bool {
        self.limits == Limits::default()
            && self.models.values().all(|l| *l == Limits::default())
            && self.budget.is_none()
    }

    /// The limits a Control Plane set for a principal (managed mode; `iop-cp principal
    /// limits`). Zero is "not limited"; a rate above [`shared::MAX_EXACT_RATE`] is clamped to
    /// it (the most the shared store computes exactly; `iop-cp` refuses more).
    pub fn from_principal(p: &iop_wire::control::PrincipalLimits) -> Self {
        let rate = |n: u64| Rate::per_minute(n.min(shared::MAX_EXACT_RATE));
        let concurrent = |n: u32| (n > 0).then_some(n);
        let pusd = |micro: u64| (micro > 0).then(|| micro.saturating_mul(1_000_000));
        Self {
            limits: Limits {
                requests: rate(p.requests_per_minute),
                tokens: rate(p.tokens_per_minute),
                concurrent: concurrent(p.concurrent),
            },
            models: p
                .models
                .iter()
                .map(|m| {
                    (
                        m.model.clone(),
                        Limits {
                            requests: rate(m.requests_per_minute),
                            tokens: rate(m.tokens_per_minute),
                            concurrent: concurrent(m.concurrent),
                        },
                    )
                })
                .filter(|(_, l)| *l != Limits::default())
                .collect(),
            budget: budget::Budget {
                per_day_pusd: pusd(p.budget_per_day_micro_usd),
                per_month_pusd: pusd(p.budget_per_month_micro_usd),
            },
        }
    }
}

/// What the [`Limiter`] enforces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitsConfig {
    /// The limits of every key without an entry in [`LimitsConfig::keys`] (each key limited
    /// on its own: the default is per key, not shared).
    pub default: KeyLimits,
    /// Limits by key id; a key with an entry has exactly these.
    pub keys: BTreeMap<String, KeyLimits>,
    /// Output tokens reserved for a request that names no output cap.
    pub output_estimate: u64,
    /// Share the keys' request and token limits with other Edges through Redis; `None`: this
    /// Edge enforces them alone.
    pub shared: Option<SharedConfig>,
    /// Prices per model group, for budgets and usage records' cost ([`budget`]).
    pub prices: BTreeMap<String, budget::Price>,
}

/// What an Edge does when the shared store cannot decide (down, slow, unreachable).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnUnavailable {
    /// Enforce each key's limits in this Edge alone until the store answers again (the
    /// default): requests keep flowing, and N Edges together may admit up to N times a limit
    /// while the store is away.
    #[default]
    Local,
    /// Refuse every limited request (503, `retry-after: 1`) until the store answers again.
    Closed,
}

/// Limits shared by several Edges through Redis ([`shared`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedConfig {
    /// `redis://host:port/db` (`rediss://` for TLS); with [`SharedConfig::cluster`], the
    /// cluster's seed nodes, comma-separated.
    pub url: String,
    /// Redis Cluster: every call goes to the node serving its key id's slot (all keys of one
    /// call share it: the key id is their hash tag).
    pub cluster: bool,
    /// Prefix of every key (default `iop:rl`).
    pub prefix: String,
    /// When the store cannot decide.
    pub on_unavailable: OnUnavailable,
    /// A borrow takes up to `limit / borrow_divisor` units ahead of need (default 16): the
    /// larger, the more requests an Edge admits without a round trip, and the more quota an
    /// idle Edge holds (until [`SharedConfig::credit_idle`] gives it back).
    pub borrow_divisor: u64,
    /// The units taken ahead are at most `1/share` of what remains (default 4): shares shrink
    /// as a key nears its limit.
    pub share: u64,
    /// Each store call is bounded by this (default 250 ms); past it, the store is unavailable
    /// for that request.
    pub timeout: Duration,
    /// Credit unused this long goes back to the store (default 2 s).
    pub credit_idle: Duration,
}

impl SharedConfig {
    /// The defaults, at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            cluster: false,
            prefix: "iop:rl".into(),
            on_unavailable: OnUnavailable::Local,
            borrow_divisor: 16,
            share: 4,
            timeout: Duration::from_millis(250),
            credit_idle: Duration::from_secs(2),
        }
    }
}

/// Default [`LimitsConfig::output_estimate`].
pub const DEFAULT_OUTPUT_ESTIMATE: u64 = 1024;

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            default: KeyLimits::default(),
            keys: BTreeMap::new(),
            output_estimate: DEFAULT_OUTPUT_ESTIMATE,
            shared: None,
            prices: BTreeMap::new(),
        }
    }
}

impl LimitsConfig {
    /// Whether any key is limited at all.
    pub fn is_unlimited(&self) -> bool {
        self.default.is_unlimited() && self.keys.values().all(KeyLimits::is_unlimited)
    }

    /// The limits of key `id`.
    pub fn of(&self, id: &str) -> &KeyLimits {
        self.keys.get(id).unwrap_or(&self.default)
    }
}

/// A request refused by its key's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The limit that refused (of several, the one whose wait is longest).
    pub exceeded: Exceeded,
    /// Whether the refusing limit was the key × model one.
    pub per_model: bool,
    /// When the request would fit if nothing else were admitted; `None` for a concurrency
    /// limit, or when the request's estimate alone exceeds the token limit.
    pub retry_after: Option<Duration>,
    /// The quota as it stands (nothing was taken).
    pub quota: Quota,
}

impl Refused {
    /// The `retry-after` a client is told: the wait rounded up to whole seconds; 1 s for a
    /// concurrency limit; `None` when the request can never fit.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match (self.exceeded, self.retry_after) {
            (_, Some(d)) => {
                Some(u64::try_from(d.as_micros().div_ceil(1_000_000).max(1)).unwrap_or(u64::MAX))
            }
            (Exceeded::Concurrent, None) => Some(1),
            _ => None,
        }
    }

    /// The message the client is shown (no key material: the key is not named).
    pub fn message(&self) -> String {
        let scope = if self.per_model {
            "this key's limit on this model"
        } else {
            "this key's limit"
        };
        match (self.exceeded, self.retry_after) {
            (Exceeded::Concurrent, _) => {
                format!("rate limit reached: {scope} of requests in flight")
            }
            (Exceeded::Tokens, None) => format!(
                "rate limit: the request's token estimate exceeds {scope} of tokens per minute"
            ),
            (e, _) => format!("rate limit reached: {scope} of {} per minute", e.as_str()),
        }
    }
}

/// Which limited quantity: the key's or its per-model limit's, requests or tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Requests { per_model: bool },
    Tokens { per_model: bool },
}

impl Slot {
    fn index(self) -> usize {
        match self {
            Self::Requests { .. } => 0,
            Self::Tokens { .. } => 1,
        }
    }

    fn per_model(self) -> bool {
        match self {
            Self::Requests { per_model } | Self::Tokens { per_model } => per_model,
        }
    }

    fn kind(self) -> char {
        match self {
            Self::Requests { .. } => 'r',
            Self::Tokens { .. } => 't',
        }
    }

    fn exceeded(self) -> Exceeded {
        match self {
            Self::Requests { .. } => Exceeded::Requests,
            Self::Tokens { .. } => Exceeded::Tokens,
        }
    }
}

/// One limit's state on this Edge: the in-process rule (local mode; in shared mode only its
/// in-flight count, and the whole rule again while the store is unavailable and
/// [`OnUnavailable::Local`]), and in shared mode the credit borrowed from the store and what
/// the store last said, per quantity (requests, tokens).
#[derive(Debug, Default)]
struct LimitState {
    rule: KeyState,
    credit: [Credit; 2],
    shown: [Option<Shown>; 2],
    /// The store refused a borrow of `need` units until `until_us` (this limiter's clock): a
    /// request needing as much is refused here until then, without a round trip (the store
    /// could only be less strict if another Edge gave credit back meanwhile).
    blocked: [Option<Blocked>; 2],
}

#[derive(Clone, Copy, Debug)]
struct Blocked {
    until_us: u64,
    need: u64,
}

impl LimitState {
    /// In shared mode, what a client is told for `slot`: what the store last said remained,
    /// plus this Edge's credit.
    fn shown(&self, slot: Slot) -> Option<Shown> {
        let i = slot.index();
        self.shown[i].map(|s| Shown {
            remaining: s.remaining.saturating_add(self.credit[i].units()),
            ..s
        })
    }
}

#[derive(Debug, Default)]
struct KeyEntry {
    id: Arc<str>,
    own: LimitState,
    models: HashMap<String, LimitState>,
    /// Last admission (µs on the limiter's clock), for giving idle credit back.
    last_used: u64,
    /// Held while this Edge borrows for the key.
    borrowing: Arc<tokio::sync::Mutex<()>>,
}

impl KeyEntry {
    fn state(&mut self, slot: Slot, model: &str) -> Option<&mut LimitState> {
        if slot.per_model() {
            self.models.get_mut(model)
        } else {
            Some(&mut self.own)
        }
    }
}

/// Why [`Limiter::admit`] did not admit a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitError {
    /// The key's limits refuse it (429).
    Refused(Refused),
    /// Shared limits with [`OnUnavailable::Closed`], and the store cannot decide (503).
    Unavailable,
}

/// The limiter: in process, or shared through Redis ([`LimitsConfig::shared`]).
#[derive(Debug)]
pub struct Limiter {
    config: LimitsConfig,
    /// [`LimitsConfig::keys`] and [`LimitsConfig::default`], shared with the holds.
    configured: HashMap<String, Arc<KeyLimits>>,
    default: Arc<KeyLimits>,
    /// Managed mode: the principals' limits of the projection last followed.
    principals: std::sync::RwLock<Arc<Principals>>,
    epoch: tokio::time::Instant,
    keys: Mutex<HashMap<String, KeyEntry>>,
    metrics: LimiterMetrics,
    store: Option<Arc<shared::RateStore>>,
    warned: Mutex<Option<tokio::time::Instant>>,
    returner: std::sync::OnceLock<()>,
    budgets: Arc<budget::Budgets>,
}

/// The principals' limits of one projection generation ([`Limiter::follow`]).
#[derive(Debug, Default)]
struct Principals {
    generation: u64,
    limits: HashMap<String, Arc<KeyLimits>>,
}

impl Limiter {
    /// A limiter enforcing `config`, its clock starting now. With [`LimitsConfig::shared`],
    /// nothing connects until the first request; a URL that does not parse is an error here.
    pub fn new(config: LimitsConfig) -> Result<Self, shared::StoreError> {
        let store = match &config.shared {
            Some(s) if s.cluster => {
                let seeds: Vec<String> = s
                    .url
                    .split(',')
                    .map(str::trim)
                    .filter(|u| !u.is_empty())
                    .map(str::to_owned)
                    .collect();
                Some(Arc::new(shared::RateStore::cluster(
                    &seeds, &s.prefix, s.timeout,
                )?))
            }
            Some(s) => Some(Arc::new(shared::RateStore::new(
                &s.url, &s.prefix, s.timeout,
            )?)),
            None => None,
        };
        let metrics = LimiterMetrics::new();
        // Shared limits share the keys' budgets too, through the same store.
        let budgets = match (&store, &config.shared) {
            (Some(store), Some(s)) => {
                budget::Budgets::shared(config.prices.clone(), Arc::clone(store), s, &metrics)
            }
            _ => budget::Budgets::new(config.prices.clone()),
        };
        Ok(Self {
            epoch: tokio::time::Instant::now(),
            keys: Mutex::new(HashMap::new()),
            metrics,
            store,
            warned: Mutex::new(None),
            returner: std::sync::OnceLock::new(),
            budgets: Arc::new(budgets),
            configured: config
                .keys
                .iter()
                .map(|(k, l)| (k.clone(), Arc::new(l.clone())))
                .collect(),
            default: Arc::new(config.default.clone()),
            principals: std::sync::RwLock::new(Arc::default()),
            config,
        })
    }

    /// The limits of key (or principal) `key` now: a principal's from the projection last
    /// [followed](Limiter::follow), else the configured key's, else the default.
    pub fn limits_of(&self, key: &str) -> Arc<KeyLimits> {
        let principals = self
            .principals
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        principals
            .limits
            .get(key)
            .or_else(|| self.configured.get(key))
            .unwrap_or(&self.default)
            .clone()
    }

    /// Managed mode: takes the principals' limits from `projection` when it is newer than the
    /// one followed last (a no-op otherwise: one atomic read on the request path). A request
    /// admitted before keeps the limits it was admitted under until it ends; the per-key state
    /// (its rate so far, in flight) carries over to the new limits.
    pub fn follow(&self, projection: &iop_wire::control::PrincipalProjection) {
        let held = self
            .principals
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .generation;
        if projection.generation <= held {
            return;
        }
        let limits = projection
            .principals
            .iter()
            .filter_map(|p| {
                let l = KeyLimits::from_principal(p.limits.as_ref()?);
                (!l.is_unlimited()).then(|| (p.principal_id.clone(), Arc::new(l)))
            })
            .collect();
        let mut principals = self
            .principals
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if projection.generation > principals.generation {
            *principals = Arc::new(Principals {
                generation: projection.generation,
                limits,
            });
        }
    }

    /// The keys nearest their limits now, at most `max` of them, for the status page: each
    /// limited key this Edge holds state for, each configured key and each principal with
    /// limits, and each key with spend this period, ranked by the largest share of any of
    /// its limits it has used (requests, tokens, in flight, day and month budget), then by
    /// id. In shared mode the rates are what the store last said plus this Edge's credit, and
    /// in flight and spend are this Edge's own. Costs one pass over the tracked keys (at most
    /// [`MAX_TRACKED_KEYS`]) under the limiter's lock, keeping only the top `max`.
    pub fn usage(&self, max: usize) -> UsageView {
        let spend: HashMap<String, (u64, u64)> = self
            .budgets
            .spenders()
            .into_iter()
            .map(|(k, d, m)| (k, (d, m)))
            .collect();
        let budget = |key: &str, limits: &KeyLimits| {
            let (day, month) = spend.get(key).copied().unwrap_or_default();
            (
                limits.budget.per_day_pusd.map(|l| (day, l)),
                limits.budget.per_month_pusd.map(|l| (month, l)),
            )
        };
        let mut top = TopKeys::new(max);
        let mut seen = std::collections::HashSet::new();
        let now = self.now_us();
        {
            let keys = self.lock();
            for (id, entry) in keys.iter() {
                let limits = self.limits_of(id);
                let used = |quantity: Option<u64>, slot: Slot, rate: Option<Rate>| {
                    let rate = rate?;
                    let shown = entry.own.shown(slot).filter(|_| self.store.is_some());
                    let (limit, remaining) = match shown {
                        Some(s) => (s.limit, s.remaining),
                        None => (rate.limit(), quantity.unwrap_or(rate.limit())),
                    };
                    Some((limit.saturating_sub(remaining), limit))
                };
                let (requests, tokens) = entry.own.rule.remaining(&limits.limits, now);
                let (budget_day, budget_month) = budget(id, &limits);
                top.push(KeyUsage {
                    key: id.clone(),
                    requests: used(
                        requests,
                        Slot::Requests { per_model: false },
                        limits.limits.requests,
                    ),
                    tokens: used(
                        tokens,
                        Slot::Tokens { per_model: false },
                        limits.limits.tokens,
                    ),
                    in_flight: entry.own.rule.in_flight(),
                    concurrent: limits.limits.concurrent,
                    budget_day,
                    budget_month,
                });
                seen.insert(id.clone());
            }
        }
        let principals = Arc::clone(
            &self
                .principals
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let others = self
            .configured
            .keys()
            .chain(principals.limits.keys())
            .chain(spend.keys());
        for id in others {
            if !seen.insert(id.clone()) {
                continue;
            }
            let limits = self.limits_of(id);
            if limits.is_unlimited() {
                continue;
            }
            let (budget_day, budget_month) = budget(id, &limits);
            let unused = |r: Option<Rate>| r.map(|r| (0, r.limit()));
            top.push(KeyUsage {
                key: id.clone(),
                requests: unused(limits.limits.requests),
                tokens: unused(limits.limits.tokens),
                in_flight: 0,
                concurrent: limits.limits.concurrent,
                budget_day,
                budget_month,
            });
        }
        top.finish()
    }

    /// What it enforces.
    pub fn config(&self) -> &LimitsConfig {
        &self.config
    }

    /// The keys' spend budgets.
    pub fn budgets(&self) -> &Arc<budget::Budgets> {
        &self.budgets
    }

    /// Where usage records go: budgets read a key's spend back from it after a restart.
    pub fn set_usage(&self, usage: Arc<dyn crate::usage::UsageSink>) {
        self.budgets.set_usage(usage);
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, KeyEntry>> {
        self.keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `key` has (or can be given) an entry: past [`MAX_TRACKED_KEYS`], the idle
    /// entries are forgotten (state at rest, no credit, nothing in flight), with their metric
    /// series.
    fn make_room(&self, keys: &mut HashMap<String, KeyEntry>, key: &str, now: u64) -> bool {
        if keys.len() < MAX_TRACKED_KEYS || keys.contains_key(key) {
            return true;
        }
        let idle = |s: &LimitState| s.rule.is_idle(now) && s.credit.iter().all(|c| c.units() == 0);
        let mut forgotten = Vec::new();
        keys.retain(|_, e| {
            let keep = !(idle(&e.own) && e.models.values().all(idle));
            if !keep {
                forgotten.push(Arc::clone(&e.id));
            }
            keep
        });
        for id in forgotten {
            let label = KeyLabel {
                key: Arc::clone(&id),
            };
            self.metrics.admitted.remove(&label);
            self.metrics.in_flight.remove(&label);
            for limit in ["requests", "tokens", "concurrent"] {
                self.metrics.refused.remove(&RefusedLabels {
                    key: Arc::clone(&id),
                    limit,
                });
            }
        }
        keys.len() < MAX_TRACKED_KEYS
    }

    /// The entry of `key` (and its state for `model` when `per_model`), made on first use.
    fn entry<'a>(
        keys: &'a mut HashMap<String, KeyEntry>,
        key: &str,
        model: &str,
        per_model: bool,
    ) -> &'a mut KeyEntry {
        if !keys.contains_key(key) {
            keys.insert(
                key.to_owned(),
                KeyEntry {
                    id: Arc::from(key),
                    ..KeyEntry::default()
                },
            );
        }
        #[expect(
            clippy::unwrap_used,
            reason = "inserted just above, under the same lock"
        )]
        let entry = keys.get_mut(key).unwrap();
        if per_model && !entry.models.contains_key(model) {
            entry.models.insert(model.to_owned(), LimitState::default());
        }
        entry
    }

    /// Admits one request of key `key` to model group `model`, reserving `estimate` tokens,
    /// or refuses it having taken nothing. A key without limits gets an empty [`Hold`].
    pub async fn admit(
        self: &Arc<Self>,
        key: &str,
        model: &str,
        estimate: u64,
    ) -> Result<Hold, LimitError> {
        let limits = self.limits_of(key);
        if limits.limits == Limits::default() && !limits.models.contains_key(model) {
            return Ok(Hold::default());
        }
        match (&self.store, &self.config.shared) {
            (Some(store), Some(shared)) => {
                self.admit_shared(store, shared, limits, key, model, estimate)
                    .await
            }
            _ => self.admit_local(limits, key, model, estimate),
        }
    }

    /// The in-process rule: this Edge alone.
    fn admit_local(
        self: &Arc<Self>,
        limits: Arc<KeyLimits>,
        key: &str,
        model: &str,
        estimate: u64,
    ) -> Result<Hold, LimitError> {
        let model_limits = limits.models.get(model);
        let now = self.now_us();
        let mut keys = self.lock();
        if !self.make_room(&mut keys, key, now) {
            return Err(LimitError::Refused(Self::no_room()));
        }
        let entry = Self::entry(&mut keys, key, model, model_limits.is_some());
        entry.last_used = now;
        let own = entry.own.rule.check(&limits.limits, now, estimate);
        let per_model = match (model_limits, entry.models.get(model)) {
            (Some(l), Some(s)) => s.rule.check(l, now, estimate),
            _ => Ok(()),
        };
        // Every limit is checked before any is charged.
        let refusal = match (own, per_model) {
            (Ok(()), Ok(())) => None,
            (Err(r), Ok(())) => Some((r, false)),
            (Ok(()), Err(r)) => Some((r, true)),
            (Err(a), Err(b)) => Some(
                if b.retry_after > a.retry_after && a.retry_after.is_some() {
                    (b, true)
                } else {
                    (a, false)
                },
            ),
        };
        if let Some((r, per_model)) = refusal {
            let quota = Quota::of(&limits.limits, r.requests.as_ref(), r.tokens.as_ref());
            let refused = Refused {
                exceeded: r.exceeded,
                per_model,
                retry_after: r.retry_after,
                quota,
            };
            self.count_refusal(&entry.id, &refused);
            return Err(LimitError::Refused(refused));
        }
        let (model_admitted, model_quota) = match (model_limits, entry.models.get_mut(model)) {
            (Some(l), Some(s)) => match s.rule.admit(l, now, estimate) {
                Ok(a) => {
                    let q = Quota::of(l, a.requests.as_ref(), a.token_decision.as_ref());
                    (Some(a), q)
                }
                Err(_) => (None, Quota::default()),
            },
            _ => (None, Quota::default()),
        };
        let (own_admitted, own_quota) = match entry.own.rule.admit(&limits.limits, now, estimate) {
            Ok(a) => {
                let q = Quota::of(
                    &limits.limits,
                    a.requests.as_ref(),
                    a.token_decision.as_ref(),
                );
                (Some(a), q)
            }
            Err(_) => (None, Quota::default()),
        };
        let id = Arc::clone(&entry.id);
        self.count_admission(&id);
        let quota = own_quota.tighter(model_quota);
        drop(keys);
        Ok(Hold {
            limiter: Some(Arc::clone(self)),
            limits: Some(limits),
            key: Some(id),
            model: model_admitted.as_ref().map(|_| model.to_owned()),
            own: own_admitted,
            per_model: model_admitted,
            shared: None,
            usage: None,
            reported: None,
            sent: false,
            upstream_error: false,
            ended: None,
            meter: None,
            budget: None,
            quota,
        })
    }

    /// The refusal of a new key while [`MAX_TRACKED_KEYS`] are all busy (retry in a second).
    fn no_room() -> Refused {
        Refused {
            exceeded: Exceeded::Concurrent,
            per_model: false,
            retry_after: None,
            quota: Quota::default(),
        }
    }

    fn count_admission(&self, id: &Arc<str>) {
        let label = KeyLabel {
            key: Arc::clone(id),
        };
        self.metrics.admitted.get_or_create(&label).inc();
        self.metrics.in_flight.get_or_create(&label).inc();
    }

    fn count_refusal(&self, id: &Arc<str>, r: &Refused) {
        self.metrics
            .refused
            .get_or_create(&RefusedLabels {
                key: Arc::clone(id),
                limit: r.exceeded.as_str(),
            })
            .inc();
    }

    fn finish(self: &Arc<Self>, hold: &mut Hold) {
        let Some(key) = hold.key.take() else { return };
        // The limits the request was admitted under (a newer projection may have changed the
        // key's since).
        let limits = hold.limits.take().unwrap_or_else(|| self.limits_of(&key));
        let now = self.now_us();
        let mut charges = Vec::new();
        {
            let mut keys = self.lock();
            let Some(entry) = keys.get_mut(&*key) else {
                return;
            };
            let actual = |reserved: u64| match (hold.sent, hold.usage) {
                (false, _) => 0,
                (true, Some(u)) => u,
                (true, None) => reserved,
            };
            if let Some(a) = hold.own.take() {
                let n = actual(a.reserved());
                entry.own.rule.finish(&limits.limits, now, a, n);
            }
            if let (Some(a), Some(model)) = (hold.per_model.take(), hold.model.as_deref())
                && let (Some(l), Some(s)) = (limits.models.get(model), entry.models.get_mut(model))
            {
                let n = actual(a.reserved());
                s.rule.finish(l, now, a, n);
            }
            if let Some(sh) = hold.shared.take() {
                let used = actual(sh.reserved);
                let model = hold.model.as_deref().unwrap_or_default();
                for slot in sh.token_slots {
                    let rate = if slot.per_model() {
                        limits.models.get(model).and_then(|l| l.tokens)
                    } else {
                        limits.limits.tokens
                    };
                    let Some(state) = entry.state(slot, model) else {
                        continue;
                    };
                    let credit = &mut state.credit[slot.index()];
                    if used <= sh.reserved {
                        credit.add(sh.reserved - used);
                    } else {
                        let owed = used - sh.reserved;
                        let from_credit = credit.take(owed);
                        if let (Some(rate), true) = (rate, owed > from_credit) {
                            charges.push(shared::Quantity {
                                key: String::new(),
                                rate,
                                units: owed - from_credit,
                                ahead: 0,
                                share: 1,
                            });
                            if let (Some(store), Some(q)) = (&self.store, charges.last_mut()) {
                                q.key =
                                    store.key(&key, slot.per_model().then_some(model), slot.kind());
                            }
                        }
                    }
                }
            }
            self.metrics
                .in_flight
                .get_or_create(&KeyLabel {
                    key: Arc::clone(&entry.id),
                })
                .dec();
        }
        // An underestimate the credit did not cover: charged to the store in the background
        // (the key owes it; a failure only makes the limit looser by that much, counted).
        if !charges.is_empty()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let limiter = Arc::clone(self);
            rt.spawn(async move {
                let Some(store) = &limiter.store else { return };
                limiter
                    .metrics
                    .store_calls
                    .get_or_create(&OpLabel { op: "charge" })
                    .inc();
                if store.charge(&charges, None).await.is_err() {
                    limiter.metrics.store_errors.inc();
                }
            });
        }
    }

    /// Appends the limiter's metrics to `out`, an OpenMetrics text that may already end with
    /// `# EOF` (the Edge's own metrics): admissions and refusals (by limit) and requests in
    /// flight, per key id; in shared mode, store calls, errors and requests decided without
    /// the store.
    pub fn encode_metrics(&self, out: &mut String) {
        if out.ends_with("# EOF\n") {
            out.truncate(out.len() - "# EOF\n".len());
        }
        // Writing to a String does not fail.
        let _ = prometheus_client::encoding::text::encode(out, &self.metrics.registry);
    }
}

/// One key's use of its limits ([`Limiter::usage`]). Rates are `(used, limit)` over the
/// rate's period (a minute); budgets `(spent, limit)` in pico-dollars.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyUsage {
    /// Key (or principal) id.
    pub key: String,
    /// Requests per minute.
    pub requests: Option<(u64, u64)>,
    /// Tokens per minute.
    pub tokens: Option<(u64, u64)>,
    /// Requests in flight.
    pub in_flight: u32,
    /// The most requests in flight at once.
    pub concurrent: Option<u32>,
    /// This UTC day's budget.
    pub budget_day: Option<(u64, u64)>,
    /// This UTC month's budget.
    pub budget_month: Option<(u64, u64)>,
}

impl KeyUsage {
    /// The largest share of any of its limits used, in `[0, ∞)` (over 1: past a budget by what
    /// requests in flight settled to).
    pub fn share(&self) -> f64 {
        #[allow(
            clippy::cast_precision_loss,
            reason = "a ratio for ranking and display"
        )]
        let ratio = |(used, limit): (u64, u64)| {
            if limit == 0 {
                0.0
            } else {
                used as f64 / limit as f64
            }
        };
        [
            self.requests,
            self.tokens,
            self.concurrent
                .map(|c| (u64::from(self.in_flight), u64::from(c))),
            self.budget_day,
            self.budget_month,
        ]
        .into_iter()
        .flatten()
        .map(ratio)
        .fold(0.0, f64::max)
    }
}

/// The keys nearest their limits ([`Limiter::usage`]).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct UsageView {
    /// At most the asked number, the highest [`KeyUsage::share`] first.
    pub keys: Vec<KeyUsage>,
    /// Keys with limits looked at (the rows left out are those using less).
    pub total: usize,
}

/// The `max` highest shares seen, kept in a buffer of at most `2 × max` that is cut back
/// when full (so a pass over many keys holds little and sorts rarely).
struct TopKeys {
    max: usize,
    keys: Vec<(f64, KeyUsage)>,
    total: usize,
}

impl TopKeys {
    fn new(max: usize) -> Self {
        Self {
            max,
            keys: Vec::new(),
            total: 0,
        }
    }

    fn push(&mut self, usage: KeyUsage) {
        self.total += 1;
        if self.max == 0 {
            return;
        }
        self.keys.push((usage.share(), usage));
        if self.keys.len() >= 2 * self.max {
            self.cut();
        }
    }

    fn cut(&mut self) {
        self.keys
            .sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.key.cmp(&b.1.key)));
        self.keys.truncate(self.max);
    }

    fn finish(mut self) -> UsageView {
        self.cut();
        UsageView {
            keys: self.keys.into_iter().map(|(_, k)| k).collect(),
            total: self.total,
        }
    }
}

/// The shared part of a hold: the tokens reserved, and which token quantities they came from.
#[derive(Debug)]
struct SharedHold {
    reserved: u64,
    token_slots: Vec<Slot>,
}

/// An admitted request's hold on its key's limits. It is finished when dropped: reconciled
/// to the usage it [saw](Hold::usage), given back if it was never [sent](Hold::sent).
#[derive(Debug, Default)]
#[must_use = "a hold is finished when dropped; drop it when the request ends"]
pub struct Hold {
    limiter: Option<Arc<Limiter>>,
    limits: Option<Arc<KeyLimits>>,
    key: Option<Arc<str>>,
    model: Option<String>,
    own: Option<Admitted>,
    per_model: Option<Admitted>,
    shared: Option<SharedHold>,
    usage: Option<u64>,
    reported: Option<Usage>,
    sent: bool,
    upstream_error: bool,
    ended: Option<crate::transport::StreamEnd>,
    quota: Quota,
    meter: Option<crate::usage::Meter>,
    budget: Option<budget::BudgetHold>,
}

impl Hold {
    /// Whether this hold holds nothing (the key has no limits, no budget reservation and no
    /// usage is recorded): it need not ride on the stream.
    pub fn is_empty(&self) -> bool {
        self.limiter.is_none() && self.meter.is_none() && self.budget.is_none()
    }

    /// Settles `budget` (the request's reservation against its key's spend budget) when the
    /// request ends.
    pub fn with_budget(mut self, budget: Option<budget::BudgetHold>) -> Self {
        self.budget = budget;
        self
    }

    /// Records this request's usage in `meter`'s sink when it ends.
    pub fn with_meter(mut self, meter: crate::usage::Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// The provider that took the request (`node/provider`), for its usage record.
    pub fn provider(&mut self, provider: &crate::pool::ProviderKey) {
        if let Some(m) = self.meter.as_mut() {
            m.provider = format!("{}/{}", provider.node_id, provider.provider_id);
        }
    }

    /// The quota after this admission, for the response headers (empty for a key without
    /// limits).
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The request was sent to a provider: from now on its tokens are charged (the usage it
    /// sees, else its whole reservation).
    pub fn sent(&mut self) {
        self.sent = true;
    }

    /// The provider's usage for the request (the last report counts).
    pub fn usage(&mut self, usage: &Usage) {
        let total = if usage.total_tokens > 0 {
            usage.total_tokens
        } else {
            usage.prompt_tokens.saturating_add(usage.completion_tokens)
        };
        self.usage = Some(total);
        self.reported = Some(*usage);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(limiter) = self.limiter.take() {
            limiter.finish(self);
        }
        if let Some(b) = self.budget.take() {
            let used = match (self.reported, self.sent && !self.upstream_error) {
                (Some(u), _) => Some(u),
                (None, true) => None,
                (None, false) => Some(Usage::default()),
            };
            b.settle(used);
        }
        if let Some(meter) = self.meter.take() {
            let outcome = match (self.ended, self.sent) {
                (Some(crate::transport::StreamEnd::Completed), _) if !self.upstream_error => {
                    crate::usage::Outcome::Completed
                }
                (Some(crate::transport::StreamEnd::Cancelled), _) | (None, true) => {
                    crate::usage::Outcome::Cancelled
                }
                _ => crate::usage::Outcome::Failed,
            };
            meter.emit(outcome, self.sent && !self.upstream_error, self.reported);
        }
    }
}

impl crate::transport::StreamWatch for Hold {
    fn usage(&mut self, usage: &Usage) {
        Self::usage(self, usage);
    }

    /// An upstream error status: the provider used (and bills) nothing, unless it reports
    /// usage after all.
    fn status(&mut self, status: u16) {
        if !(200..300).contains(&status) {
            self.upstream_error = true;
            if self.usage.is_none() {
                self.usage = Some(0);
            }
        }
    }

    fn end(&mut self, end: crate::transport::StreamEnd) {
        self.ended = Some(end);
    }

    fn first_data(&mut self) {
        if let Some(m) = self.meter.as_mut() {
            m.first_data();
        }
    }

    fn provider_time(&mut self, us: u64) {
        if let Some(m) = self.meter.as_mut() {
            m.provider_us = Some(us);
        }
    }
}

/// The output tokens a request may use: its cap (`max_tokens`, `max_completion_tokens` or
/// `max_output_tokens`), else `default`.
pub fn output_cap(request: &serde_json::Value, default: u64) -> u64 {
    ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| request[*k].as_u64())
        .unwrap_or(default)
}

/// The tokens to reserve for `request` (a JSON request body in any route's form; `chat` its
/// chat form): its output cap, else `output_estimate`, plus the input estimate.
pub fn estimate(
    request: &serde_json::Value,
    chat: &serde_json::Value,
    output_estimate: u64,
) -> u64 {
    let cap = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| request[*k].as_u64())
        .unwrap_or(output_estimate);
    cap.saturating_add(iop_dialect::request::estimate_tokens(chat))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use headers::rfc3339;
    use iop_edge_core::ratelimit::Rate;

    #[test]
    fn resets_read_like_openai_writes_them() {
        assert_eq!(go_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_secs(60)), "1m0s");
        assert_eq!(go_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(go_duration(Duration::from_millis(3_723_040)), "1h2m3.04s");
        assert_eq!(
            rfc3339(std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            "2023-11-14T22:13:20Z"
        );
    }

    fn per_minute(requests: u64, tokens: u64) -> Limits {
        Limits {
            requests: Rate::per_minute(requests),
            tokens: Rate::per_minute(tokens),
            concurrent: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_is_charged_its_usage_its_reservation_or_nothing() {
        let config = LimitsConfig {
            default: KeyLimits {
                limits: per_minute(100, 1000),
                ..KeyLimits::default()
            },
            ..LimitsConfig::default()
        };
        let l = Arc::new(Limiter::new(config).unwrap());
        // Sent with usage: 400 reserved, 100 charged.
        let mut h = l.admit("k", "m", 400).await.unwrap();
        assert_eq!(h.quota().tokens.unwrap().remaining, 600);
        h.sent();
        h.usage(&Usage {
            prompt_tokens: 60,
            completion_tokens: 40,
            total_tokens: 100,
            cached_prompt_tokens: 0,
        });
        drop(h);
        // Never sent: nothing charged.
        drop(l.admit("k", "m", 500).await.unwrap());
        // Sent, no usage: the reservation stands.
        let mut h = l.admit("k", "m", 300).await.unwrap();
        h.sent();
        drop(h);
        let h = l.admit("k", "m", 0).await.unwrap();
        assert_eq!(h.quota().tokens.unwrap().remaining, 600);
        assert_eq!(h.quota().requests.unwrap().remaining, 96);
    }

    /// The status page's view: keys ranked by the largest share of a limit used, configured
    /// keys shown before their first request, the top `max` kept of many.
    #[tokio::test(start_paused = true)]
    async fn usage_ranks_keys_by_the_largest_share_of_a_limit_used() {
        let mut keys = BTreeMap::new();
        keys.insert(
            "quiet".to_owned(),
            KeyLimits {
                limits: Limits {
                    concurrent: Some(4),
                    ..per_minute(10, 1000)
                },
                ..KeyLimits::default()
            },
        );
        let config = LimitsConfig {
            default: KeyLimits {
                limits: per_minute(100, 1000),
                ..KeyLimits::default()
            },
            keys,
            ..LimitsConfig::default()
        };
        let l = Arc::new(Limiter::new(config).unwrap());
        let view = l.usage(10);
        assert_eq!(view.total, 1);
        assert_eq!(view.keys[0].key, "quiet");
        assert_eq!(view.keys[0].requests, Some((0, 10)));
        assert_eq!(view.keys[0].concurrent, Some(4));
        // "busy": 3 requests of 100, 600 tokens of 1000 reserved (held in flight).
        let mut holds = Vec::new();
        for _ in 0..3 {
            holds.push(l.admit("busy", "m", 200).await.unwrap());
        }
        // "light": 1 request, 10 tokens.
        drop(l.admit("light", "m", 10).await.unwrap());
        let held = l.admit("quiet", "m", 1).await.unwrap();
        let view = l.usage(10);
        let keys: Vec<&str> = view.keys.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(keys, ["busy", "quiet", "light"], "{view:?}");
        let busy = &view.keys[0];
        assert_eq!(busy.requests, Some((3, 100)));
        assert_eq!(busy.tokens, Some((600, 1000)));
        assert_eq!(busy.in_flight, 3);
        assert!((busy.share() - 0.6).abs() < 1e-9, "{}", busy.share());
        assert_eq!(view.keys[1].in_flight, 1);
        // Half a minute later 500 of the 600 tokens are back (the rule refills at 1000 a
        // minute), and "quiet" (1 of 4 in flight) is nearer a limit than "busy".
        tokio::time::advance(Duration::from_secs(30)).await;
        let view = l.usage(10);
        assert_eq!(view.keys[0].key, "quiet");
        assert_eq!(view.keys[1].tokens, Some((100, 1000)));
        // Only the top ones are kept, and all are counted.
        for i in 0..50_u64 {
            drop(l.admit(&format!("k{i:02}"), "m", i).await.unwrap());
        }
        let view = l.usage(2);
        assert_eq!(view.total, 53);
        let keys: Vec<&str> = view.keys.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(keys, ["quiet", "busy"]);
        drop((holds, held));
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_model_limit_is_checked_with_the_key_and_refusal_takes_nothing() {
        let mut models = BTreeMap::new();
        models.insert("big".to_owned(), per_minute(2, 1_000_000));
        let config = LimitsConfig {
            default: KeyLimits {
                limits: per_minute(10, 1_000_000),
                models,
                ..KeyLimits::default()
            },
            ..LimitsConfig::default()
        };
        let l = Arc::new(Limiter::new(config).unwrap());
        let a = l.admit("k", "big", 1).await.unwrap();
        assert_eq!(
            a.quota().requests.unwrap().remaining,
            1,
            "the tighter shown"
        );
        let _b = l.admit("k", "big", 1).await.unwrap();
        let Err(LimitError::Refused(r)) = l.admit("k", "big", 1).await else {
            panic!("refused")
        };
        assert!(r.per_model);
        assert_eq!(r.exceeded, Exceeded::Requests);
        assert_eq!(r.retry_after_secs(), Some(30));
        // The refusal took nothing from the key: 8 left on another model.
        let c = l.admit("k", "small", 1).await.unwrap();
        assert_eq!(c.quota().requests.unwrap().remaining, 7);
        // Another key is limited on its own.
        let d = l.admit("other", "big", 1).await.unwrap();
        assert_eq!(d.quota().requests.unwrap().remaining, 1);
        let mut m = String::from("# EOF\n");
        l.encode_metrics(&mut m);
        assert!(
            m.contains("iop_edge_ratelimit_refused_total{key=\"k\",limit=\"requests\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("iop_edge_ratelimit_in_flight{key=\"k\"} 3"),
            "{m}"
        );
        assert_eq!(m.matches("# EOF").count(), 1, "{m}");
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_tracked_keys_idle_ones_are_forgotten_and_busy_ones_kept() {
        let config = LimitsConfig {
            default: KeyLimits {
                limits: Limits {
                    requests: Rate::per_minute(10),
                    tokens: None,
                    concurrent: Some(1),
                },
                models: BTreeMap::new(),
                budget: Default::default(),
            },
            ..LimitsConfig::default()
        };
        let l = Arc::new(Limiter::new(config).unwrap());
        // Every tracked key busy (a request in flight): a new key is refused.
        let mut holds = Vec::new();
        for i in 0..MAX_TRACKED_KEYS {
            holds.push(l.admit(&format!("k{i}"), "m", 0).await.unwrap());
        }
        assert!(matches!(
            l.admit("new", "m", 0).await,
            Err(LimitError::Refused(Refused {
                exceeded: Exceeded::Concurrent,
                ..
            }))
        ));
        // A known key is still served (refused here only by its own in-flight limit).
        drop(holds.pop());
        let again = l
            .admit(&format!("k{}", MAX_TRACKED_KEYS - 1), "m", 0)
            .await
            .unwrap();
        drop(again);
        drop(holds);
        // A minute later every key is at rest: a new key makes room, and the forgotten keys'
        // metric series go with them.
        tokio::time::advance(Duration::from_secs(61)).await;
        let _new = l.admit("new", "m", 0).await.unwrap();
        assert_eq!(l.lock().len(), 1);
        let mut m = String::new();
        l.encode_metrics(&mut m);
        assert!(!m.contains("key=\"k1\""), "forgotten series are removed");
    }

    fn projection(
        generation: u64,
        rpm: u64,
        concurrent: u32,
    ) -> iop_wire::control::PrincipalProjection {
        use iop_wire::control::{ModelLimits, PrincipalLimits, ProjectedPrincipal};
        iop_wire::control::PrincipalProjection {
            generation,
            principals: vec![
                ProjectedPrincipal {
                    principal_id: "team-a".into(),
                    enabled: true,
                    limits: Some(PrincipalLimits {
                        requests_per_minute: rpm,
                        tokens_per_minute: u64::MAX,
                        concurrent,
                        budget_per_day_micro_usd: 2_000_000,
                        models: vec![ModelLimits {
                            model: "big".into(),
                            requests_per_minute: 1,
                            ..ModelLimits::default()
                        }],
                        ..PrincipalLimits::default()
                    }),
                    ..ProjectedPrincipal::default()
                },
                ProjectedPrincipal {
                    principal_id: "team-b".into(),
                    enabled: true,
                    limits: Some(PrincipalLimits::default()),
                    ..ProjectedPrincipal::default()
                },
            ],
            ..Default::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn principals_take_their_limits_from_the_newest_projection() {
        let l = Arc::new(Limiter::new(LimitsConfig::default()).unwrap());
        assert!(l.admit("team-a", "m", 1).await.unwrap().is_empty());
        l.follow(&projection(5, 10, 1));
        let a = l.limits_of("team-a");
        assert_eq!(a.limits.requests, Rate::per_minute(10));
        assert_eq!(
            a.limits.tokens,
            Rate::per_minute(shared::MAX_EXACT_RATE),
            "clamped to what the shared store computes exactly"
        );
        assert_eq!(
            a.budget.per_day_pusd,
            Some(2_000_000_000_000),
            "two dollars"
        );
        assert_eq!(a.models["big"].requests, Rate::per_minute(1));
        assert!(
            l.limits_of("team-b").is_unlimited(),
            "all zero: not limited"
        );
        // Concurrency 1: a second request waits for the first.
        let held = l.admit("team-a", "m", 1).await.unwrap();
        assert!(matches!(
            l.admit("team-a", "m", 1).await,
            Err(LimitError::Refused(Refused {
                exceeded: Exceeded::Concurrent,
                ..
            }))
        ));
        // An older or equal generation changes nothing.
        l.follow(&projection(4, 10, 5));
        l.follow(&projection(5, 10, 5));
        assert_eq!(l.limits_of("team-a").limits.concurrent, Some(1));
        // A newer one does; the request admitted before ends under its own limits, and its
        // end is counted (in flight back to zero: two fit under the new limit of 2).
        l.follow(&projection(6, 10, 2));
        drop(held);
        let _x = l.admit("team-a", "m", 1).await.unwrap();
        let _y = l.admit("team-a", "m", 1).await.unwrap();
        // The per-model limit applies on its model only.
        drop((_x, _y));
        let _big = l.admit("team-a", "big", 1).await.unwrap();
        assert!(l.admit("team-a", "big", 1).await.is_err());
    }
}
