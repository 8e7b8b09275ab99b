//! Limits shared by several Edges through Redis: the store side.
//!
//! Each limited quantity of a key (its requests, its tokens, and the same per model) is one
//! Redis string holding its GCRA state (the TAT, in microseconds on the Redis server's clock,
//! which every Edge then shares), absent when at rest. One Lua script (`rate.lua`, next to
//! this file) makes every decision in one round trip: [`RateStore::borrow`] takes what a
//! request needs from every quantity of the key, or nothing; [`RateStore::charge`] and
//! [`RateStore::refund`] settle units used past a reservation or never used. The rule is the
//! pure one ([`iop_edge_core::ratelimit::Gcra::borrow`], `charge`, `refund`), and a
//! differential test (`iop-edge/tests/rate_script.rs`) runs the script and the pure rule side
//! by side on generated sequences against a real Redis.
//!
//! Keys are `<prefix>:{<key id>}:r` and `:t` (requests, tokens), and
//! `<prefix>:{<key id>}:m:<model>:r` / `:t` per model: every quantity of one key carries the
//! key's hash tag, so one script call touches one slot and the store works on Redis Cluster.
//!
//! The script's arithmetic is in Lua numbers (doubles), exact while `limit × period` (in
//! microseconds) stays below 2^53; [`exact_in_lua`] says whether a rate does, and the Edge
//! refuses a shared limit that does not (at a one-minute period: up to 150 million per
//! minute).

use std::time::Duration;

use iop_edge_core::ratelimit::{Decision, Rate};
use redis::aio::ConnectionManager;

/// The script.
pub const SCRIPT: &str = include_str!("rate.lua");

/// The shared budgets' script (`budget.lua`): take credit, settle spend ([`RateStore::budget_take`]).
pub const BUDGET_SCRIPT: &str = include_str!("budget.lua");

/// A shared budget take's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetTake {
    /// This many nano-dollars were charged to the key (at least what was needed).
    Granted(u64),
    /// The period (`day`, `month`) has spent too much for the need to ever fit.
    Exhausted(&'static str),
    /// It fits only once other Edges give credit back or settle lower.
    Held,
}

/// The Redis keys of key `id`'s budget for UTC `day` (`YYYY-MM-DD`) and `month` (`YYYY-MM`).
fn budget_keys(prefix: &str, id: &str, day: &str, month: &str) -> [String; 2] {
    [
        format!("{prefix}:{{{id}}}:b:d:{day}"),
        format!("{prefix}:{{{id}}}:b:m:{month}"),
    ]
}

/// How long a period's hash outlives its period (a day key 3 days, a month key 40).
const BUDGET_TTL_S: [u64; 2] = [3 * 86_400, 40 * 86_400];

/// The largest per-minute limit the script computes exactly (see [`exact_in_lua`]), rounded
/// down: what a principal's limits from a Control Plane are clamped to.
pub const MAX_EXACT_RATE: u64 = 150_000_000;

/// Whether the script computes `rate` exactly (`limit × period_us < 2^53`).
pub fn exact_in_lua(rate: &Rate) -> bool {
    let period_us = rate.period().as_micros();
    u128::from(rate.limit()).saturating_mul(period_us) < (1u128 << 53)
}

/// Why the store could not decide. Never carries a key or a server's text beyond its kind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No connection, a timeout, or a Redis error.
    #[error("rate limit store unavailable: {0}")]
    Unavailable(String),
    /// The script answered something this Edge does not understand.
    #[error("rate limit store answered an unexpected reply")]
    BadReply,
}

fn unavailable(e: &redis::RedisError) -> StoreError {
    // The kind and the category only: a server's message could echo arguments.
    StoreError::Unavailable(format!("{:?}", e.kind()))
}

/// One quantity in one script call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantity {
    /// Its Redis key ([`RateStore::key`]).
    pub key: String,
    /// Its rate.
    pub rate: Rate,
    /// Units needed (borrow), used (charge) or never used (refund).
    pub units: u64,
    /// Borrow: units to take ahead at most.
    pub ahead: u64,
    /// Borrow: the extra is at most `1/share` of what remains once `units` is taken.
    pub share: u64,
}

/// A borrow's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Borrowed {
    /// Every quantity granted its units (and maybe more); or none was touched.
    pub allowed: bool,
    /// The store's clock at the decision (µs).
    pub now_us: u64,
    /// Per quantity, in the order asked: units granted (0 when refused) and the decision (on
    /// a refusal, each quantity's own: one may fit while another refuses).
    pub quantities: Vec<(u64, Decision)>,
}

/// The Redis side of shared limits: a connection (made on first use and re-made after a
/// failure, at most once per [`RateStore::RECONNECT`]) and the script.
pub struct RateStore {
    client: Client,
    prefix: String,
    linger_ms: u64,
    timeout: Duration,
    script: redis::Script,
    budget_script: redis::Script,
    conn: tokio::sync::Mutex<Connection>,
}

/// One Redis server, or a Redis Cluster (the client routes each script call by its keys' hash
/// tag: every key of one call shares the key id's slot).
#[derive(Clone)]
enum Client {
    Single(redis::Client),
    Cluster(Box<redis::cluster::ClusterClient>),
}

// A connection to either (`bounded_http::redis`, shared with the proxy-pool store).
use bounded_http::redis::Connection as Conn;

#[derive(Default)]
struct Connection {
    manager: Option<Conn>,
    last_attempt: Option<tokio::time::Instant>,
}

impl std::fmt::Debug for RateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RateStore {
    /// How often a failed connection is tried again (calls in between fail at once).
    pub const RECONNECT: Duration = Duration::from_secs(1);

    /// A store at `url` (`redis://host:port/db`; `rediss://` for TLS) with keys under
    /// `prefix`, each call bounded by `timeout`. Nothing connects until the first call.
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = Client::Single(redis::Client::open(url).map_err(|e| unavailable(&e))?);
        Ok(Self::with_client(client, prefix, timeout))
    }

    /// A store on a Redis Cluster reached through any of `seeds` (the client learns the rest
    /// and follows slot moves and failovers). Nothing connects until the first call.
    pub fn cluster(seeds: &[String], prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClient::builder(seeds.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .build()
            .map_err(|e| unavailable(&e))?;
        Ok(Self::with_client(
            Client::Cluster(Box::new(client)),
            prefix,
            timeout,
        ))
    }

    fn with_client(client: Client, prefix: &str, timeout: Duration) -> Self {
        Self {
            client,
            prefix: prefix.to_owned(),
            linger_ms: 1000,
            timeout,
            script: redis::Script::new(SCRIPT),
            budget_script: redis::Script::new(BUDGET_SCRIPT),
            conn: tokio::sync::Mutex::new(Connection::default()),
        }
    }

    /// Keys live this long past their TAT (default 1 s); tests deciding on their own clock set
    /// it long, so that the server's clock never expires a key their clock still needs.
    pub fn with_linger(mut self, linger: Duration) -> Self {
        self.linger_ms = u64::try_from(linger.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// The Redis key of a quantity: `kind` is `r` (requests) or `t` (tokens), `model` the
    /// model group for a per-model limit.
    pub fn key(&self, id: &str, model: Option<&str>, kind: char) -> String {
        match model {
            None => format!("{}:{{{id}}}:{kind}", self.prefix),
            Some(m) => format!("{}:{{{id}}}:m:{m}:{kind}", self.prefix),
        }
    }

    async fn connection(&self) -> Result<Conn, StoreError> {
        let mut c = self.conn.lock().await;
        if let Some(m) = &c.manager {
            return Ok(m.clone());
        }
        if c.last_attempt
            .is_some_and(|t| t.elapsed() < Self::RECONNECT)
        {
            return Err(StoreError::Unavailable("reconnecting".into()));
        }
        c.last_attempt = Some(tokio::time::Instant::now());
        let m = match &self.client {
            Client::Single(client) => {
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(200))
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout));
                Conn::Single(
                    tokio::time::timeout(
                        self.timeout,
                        ConnectionManager::new_with_config(client.clone(), config),
                    )
                    .await
                    .map_err(|_| StoreError::Unavailable("connect timeout".into()))?
                    .map_err(|e| unavailable(&e))?,
                )
            }
            Client::Cluster(client) => Conn::Cluster(
                tokio::time::timeout(self.timeout, client.get_async_connection())
                    .await
                    .map_err(|_| StoreError::Unavailable("connect timeout".into()))?
                    .map_err(|e| unavailable(&e))?,
            ),
        };
        c.manager = Some(m.clone());
        Ok(m)
    }

    async fn run(
        &self,
        op: &str,
        now_us: Option<u64>,
        q: &[Quantity],
    ) -> Result<Vec<i64>, StoreError> {
        let mut conn = self.connection().await?;
        let mut inv = self.script.prepare_invoke();
        inv.arg(op).arg(now_us.unwrap_or(0)).arg(self.linger_ms);
        for x in q {
            let period = u64::try_from(x.rate.period().as_micros()).unwrap_or(u64::MAX);
            inv.key(&x.key)
                .arg(x.rate.limit())
                .arg(period)
                .arg(x.units)
                .arg(x.ahead)
                .arg(x.share);
        }
        Self::invoke(self.timeout, &inv, &mut conn).await
    }

    /// One script call, each attempt bounded by `timeout`.
    async fn invoke(
        timeout: Duration,
        inv: &redis::ScriptInvocation<'_>,
        conn: &mut Conn,
    ) -> Result<Vec<i64>, StoreError> {
        let mut attempts = 0;
        loop {
            let call = tokio::time::timeout(timeout, inv.invoke_async::<Vec<i64>>(conn));
            match call.await {
                Ok(Ok(v)) => return Ok(v),
                // The script cache was flushed (a restart, a failover): redis-rs reloads once;
                // once more here.
                Ok(Err(e))
                    if attempts < 2
                        && e.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    attempts += 1;
                }
                Ok(Err(e)) => return Err(unavailable(&e)),
                Err(_) => return Err(StoreError::Unavailable("timeout".into())),
            }
        }
    }

    /// Runs the budget script once (`op`, then its arguments after the budgets and TTLs).
    async fn budget_call(
        &self,
        op: &str,
        keys: &[String; 2],
        args: [u64; 3],
        budgets: [u64; 2],
        whole: u64,
    ) -> Result<Vec<i64>, StoreError> {
        let mut conn = self.connection().await?;
        let mut inv = self.budget_script.prepare_invoke();
        inv.key(&keys[0]).key(&keys[1]).arg(op);
        for a in args {
            inv.arg(a);
        }
        inv.arg(budgets[0])
            .arg(budgets[1])
            .arg(BUDGET_TTL_S[0])
            .arg(BUDGET_TTL_S[1])
            .arg(whole);
        Self::invoke(self.timeout, &inv, &mut conn).await
    }

    /// Takes `need` nano-dollars of key `id`'s budgets for `day` and `month` (and up to
    /// `ahead` more, at most `1/share` of what is left), or nothing; `whole` is the request's
    /// whole reservation (the caller's credit covers the rest), refused for good when the
    /// period's spend leaves no room for it. A budget of 0 is none.
    #[expect(clippy::too_many_arguments, reason = "one script call's arguments")]
    pub async fn budget_take(
        &self,
        id: &str,
        day: &str,
        month: &str,
        need: u64,
        whole: u64,
        ahead: u64,
        share: u64,
        budgets: [u64; 2],
    ) -> Result<BudgetTake, StoreError> {
        let keys = budget_keys(&self.prefix, id, day, month);
        let v = self
            .budget_call("take", &keys, [need, ahead, share.max(1)], budgets, whole)
            .await?;
        match v.as_slice() {
            [1, g] => Ok(BudgetTake::Granted(u64::try_from(*g).unwrap_or(0))),
            [0, 1] => Ok(BudgetTake::Exhausted("day")),
            [0, 2] => Ok(BudgetTake::Exhausted("month")),
            [0, 3] => Ok(BudgetTake::Held),
            _ => Err(StoreError::BadReply),
        }
    }

    /// Gives back `give` nano-dollars of credit, reports `spend` spent and charges `force` more
    /// (an underestimate the credit did not cover), for key `id`'s `day` and `month`.
    #[expect(clippy::too_many_arguments, reason = "one script call's arguments")]
    pub async fn budget_settle(
        &self,
        id: &str,
        day: &str,
        month: &str,
        give: u64,
        spend: u64,
        force: u64,
        budgets: [u64; 2],
    ) -> Result<(), StoreError> {
        let keys = budget_keys(&self.prefix, id, day, month);
        self.budget_call("settle", &keys, [give, spend, force], budgets, 0)
            .await
            .map(|_| ())
    }

    /// Takes `units` from every quantity (and up to `ahead` more each), or nothing. `now_us`:
    /// the clock to decide on (tests), `None` for the server's.
    pub async fn borrow(
        &self,
        q: &[Quantity],
        now_us: Option<u64>,
    ) -> Result<Borrowed, StoreError> {
        let v = self.run("borrow", now_us, q).await?;
        let n = |i: usize| v.get(i).copied().ok_or(StoreError::BadReply);
        let us = |i: usize| -> Result<u64, StoreError> {
            u64::try_from(n(i)?).map_err(|_| StoreError::BadReply)
        };
        if v.len() != 2 + 5 * q.len() {
            return Err(StoreError::BadReply);
        }
        let allowed = n(0)? == 1;
        let mut quantities = Vec::with_capacity(q.len());
        for i in 0..q.len() {
            let b = 2 + 5 * i;
            let retry = n(b + 4)?;
            quantities.push((
                us(b + 1)?,
                Decision {
                    allowed: n(b)? == 1,
                    remaining: us(b + 2)?,
                    reset_after: Duration::from_micros(us(b + 3)?),
                    retry_after: (retry >= 0)
                        .then(|| Duration::from_micros(u64::try_from(retry).unwrap_or(0))),
                },
            ));
        }
        Ok(Borrowed {
            allowed,
            now_us: us(1)?,
            quantities,
        })
    }

    /// Charges each quantity its `units` (used past a reservation; taken even past the limit).
    pub async fn charge(&self, q: &[Quantity], now_us: Option<u64>) -> Result<(), StoreError> {
        self.run("charge", now_us, q).await.map(|_| ())
    }

    /// Gives each quantity back its `units` (borrowed or reserved, never used).
    pub async fn refund(&self, q: &[Quantity], now_us: Option<u64>) -> Result<(), StoreError> {
        self.run("refund", now_us, q).await.map(|_| ())
    }

    /// The stored TAT of a quantity (0: at rest), for tests and operators.
    pub async fn tat(&self, key: &str) -> Result<u64, StoreError> {
        let mut conn = self.connection().await?;
        let v: Option<u64> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(v.unwrap_or(0))
    }
}
