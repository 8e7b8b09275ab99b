//! Usage records (issue #29): exactly one per request that reached admission with a gateway
//! key (legacy mode), an id your own authentication named ([`crate::limits::KeyId`]), or a
//! principal (managed mode), written to a local SQLite file; in managed mode that file is
//! also the spool of records sent to the Control Plane ([`ship`]: nothing lost while it is
//! away, nothing counted twice).
//!
//! A record names the key by its id (never the key), the model group, the provider and Node
//! that served it, the input and output tokens (the provider's figures, or the reservation
//! when the provider reported none: `estimated`), how it ended ([`Outcome`]) and how long it
//! took. The HTTP surface makes one when a request it admitted ends: its response stream ended
//! (completed, or failed with the provider's error or the Edge's own terminal), its client went
//! away (cancelled), it never reached a provider (failed), or its key's limits refused it
//! (refused).
//!
//! # The store ([`SqliteUsage`])
//!
//! - **Off the request path.** [`UsageSink::record`] never blocks: records go into a bounded
//!   queue ([`UsageConfig::queue`]) that one writer thread drains in batches, each batch one
//!   transaction. **When the queue is full the newest record is dropped**, counted in
//!   [`SqliteUsage::dropped`] (`iop_edge_usage_dropped_total`) and logged at most every 10 s:
//!   requests are never slowed down by a slow disk.
//! - **Idempotent by request id**: a record is inserted once (`INSERT OR IGNORE` on the request
//!   id, unique per Edge process: a random boot prefix and a counter), so a replay never
//!   counts twice.
//! - **Not one fat row per request forever**: each inserted record also adds to a daily
//!   rollup (`usage_daily`: day, key, model → requests, input, output, by outcome), and raw
//!   rows older than [`UsageConfig::retention_days`] are deleted (the rollups stay), once
//!   shipped when they are for a Control Plane.
//! - **The spool** ([`UsageConfig::ship`], managed mode): each record is marked unshipped until
//!   the Control Plane acknowledged a report holding it ([`ship`], whose docs have the rules);
//!   at most [`UsageConfig::spool_max`] wait, then the newest are dropped, counted.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

mod ship;
pub use ship::{ship, wire_record};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The response ended normally (2xx).
    Completed,
    /// The provider answered an error, the stream failed (stall, fence, slow consumer), or no
    /// provider took it.
    Failed,
    /// The client went away before the end.
    Cancelled,
    /// The key's rate limits refused it.
    Refused,
}

impl Outcome {
    /// The outcome named `s` ([`Outcome::as_str`]); an unknown name reads as failed.
    pub fn parse(s: &str) -> Self {
        match s {
            "completed" => Self::Completed,
            "cancelled" => Self::Cancelled,
            "refused" => Self::Refused,
            _ => Self::Failed,
        }
    }

    /// A stable name (the store's `status` column, metric labels).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Refused => "refused",
        }
    }
}

/// One request's usage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageRecord {
    /// Unique per Edge process ([`request_id`]).
    pub request_id: String,
    /// Admission time, Unix milliseconds.
    pub at_ms: u64,
    /// The gateway key's id.
    pub key: String,
    /// The model group.
    pub model: String,
    /// The provider id (`node/provider`), empty when none took it.
    pub provider: String,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Of the input tokens, those read from the provider's prompt cache.
    pub cached_input_tokens: u64,
    /// The tokens are the reservation, not the provider's figures (it reported none).
    pub estimated: bool,
    /// The cost at the model's prices, pico-dollars (0 without a price).
    pub cost_pusd: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// Admission to end, microseconds.
    pub duration_us: u64,
    /// Admission to the answer's first content (time to first byte), microseconds; 0 when
    /// none arrived.
    pub first_byte_us: u64,
    /// What the mesh added: the duration less the provider call's duration as the Node
    /// measured it, microseconds; 0 when the Node did not report it (no provider call, an
    /// older Node).
    pub added_us: u64,
}

/// Where usage records go.
pub trait UsageSink: Send + Sync + std::fmt::Debug + 'static {
    /// Takes one record; never blocks.
    fn record(&self, record: UsageRecord);

    /// Waits until every record taken so far is stored (tests, a clean stop).
    fn flush(&self) {}

    /// Appends the sink's metrics to `out`, an OpenMetrics text that may end with `# EOF`.
    fn encode_metrics(&self, out: &mut String) {
        let _ = out;
    }

    /// What `key` spent on UTC day `day` (`YYYY-MM-DD`) and month `month` (`YYYY-MM`), in
    /// pico-dollars, from the stored records (budgets read it back after a restart); `None`
    /// when the sink keeps no such figures.
    fn spent(&self, key: &str, day: &str, month: &str) -> Option<(u64, u64)> {
        let _ = (key, day, month);
        None
    }

    /// A spool for the Control Plane ([`ship`]): up to `limit` of the oldest records it has
    /// not stored yet (blocking; call off the runtime). `None`: this sink keeps no spool.
    fn unshipped(&self, limit: usize) -> Option<Vec<UsageRecord>> {
        let _ = limit;
        None
    }

    /// The Control Plane stored these records (or they cannot be sent): forget them from the
    /// spool (blocking).
    fn shipped(&self, request_ids: &[String]) {
        let _ = request_ids;
    }

    /// Woken when records enter the spool; `None` without a spool.
    fn spool_notify(&self) -> Option<Arc<tokio::sync::Notify>> {
        None
    }

    /// `n` records were acknowledged by the Control Plane (metrics).
    fn acknowledged(&self, n: u64) {
        let _ = n;
    }

    /// `n` records could not be sent (metrics).
    fn unshippable(&self, n: u64) {
        let _ = n;
    }
}

/// A request id unique to this process: a random prefix drawn once, and a counter.
pub fn request_id() -> String {
    static PREFIX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    static N: AtomicU64 = AtomicU64::new(1);
    let prefix = PREFIX.get_or_init(|| {
        let mut b = [0u8; 8];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
        b.iter().map(|x| format!("{x:02x}")).collect()
    });
    format!("req-{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Default [`UsageConfig::spool_max`]: about 250 MB of file at most, hours of a busy Edge.
pub const DEFAULT_SPOOL_MAX: u64 = 1_000_000;

/// [`SqliteUsage`] settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageConfig {
    /// Records waiting for the writer at most (then the newest is dropped, counted).
    pub queue: usize,
    /// Raw rows older than this many days are deleted (daily rollups stay; records not yet
    /// shipped are kept until shipped).
    pub retention_days: u32,
    /// Keep every record in the spool until the Control Plane stored it ([`ship`]): managed
    /// mode. Off: the file is the only place the records go.
    pub ship: bool,
    /// Records waiting in the spool at most; past it a new record is dropped (the newest),
    /// counted in `iop_edge_usage_spool_dropped_total` and logged at most every 10 s.
    pub spool_max: u64,
}

impl Default for UsageConfig {
    fn default() -> Self {
        Self {
            queue: 65_536,
            retention_days: 30,
            ship: false,
            spool_max: DEFAULT_SPOOL_MAX,
        }
    }
}

/// Why the usage store could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// SQLite refused to open or set up the file.
    #[error("usage store {path}: {message}")]
    Open {
        /// The file.
        path: PathBuf,
        /// SQLite's message.
        message: String,
    },
}

/// Usage records in a local SQLite file, written by one thread (module docs).
pub struct SqliteUsage {
    path: PathBuf,
    spool: Arc<SpoolState>,
    /// The shipper's connection (reads the spool, marks records shipped).
    reader: Mutex<Option<rusqlite::Connection>>,
    tx: Mutex<Option<SyncSender<Msg>>>,
    dropped: AtomicU64,
    written: Arc<AtomicU64>,
    warned: Mutex<Option<Instant>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    metrics: UsageMetrics,
}

impl std::fmt::Debug for SqliteUsage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteUsage")
            .field("written", &self.written())
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StatusLabel {
    status: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TokenLabels {
    key: String,
    model: String,
    direction: &'static str,
}

struct UsageMetrics {
    registry: Registry,
    records: Family<StatusLabel, Counter>,
    dropped: Counter,
    tokens: Family<TokenLabels, Counter>,
}

/// The spool's state, shared by the writer thread and the shipper.
struct SpoolState {
    ship: bool,
    max: u64,
    /// Records in the file not yet stored by the Control Plane: the count itself is the
    /// `iop_edge_usage_spooled` gauge (one value, so no reader sees a copy that lags it).
    unshipped: Gauge<u64, AtomicU64>,
    /// Woken when records enter the spool.
    notify: Arc<tokio::sync::Notify>,
    dropped: Counter,
    shipped: Counter,
    unshippable: Counter,
    warned: Mutex<Option<Instant>>,
}

impl UsageMetrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let records = Family::<StatusLabel, Counter>::default();
        registry.register(
            "iop_edge_usage_records",
            "Usage records taken, by how the request ended",
            records.clone(),
        );
        let dropped = Counter::default();
        registry.register(
            "iop_edge_usage_dropped",
            "Usage records dropped because the store's queue was full (the newest is dropped)",
            dropped.clone(),
        );
        let tokens = Family::<TokenLabels, Counter>::default();
        registry.register(
            "iop_edge_usage_tokens",
            "Tokens used, per key id, model and direction (input, output), estimates included",
            tokens.clone(),
        );
        Self {
            registry,
            records,
            dropped,
            tokens,
        }
    }

    fn spool(&mut self, config: &UsageConfig, unshipped: u64) -> SpoolState {
        let state = SpoolState {
            ship: config.ship,
            max: config.spool_max,
            unshipped: Gauge::default(),
            notify: Arc::new(tokio::sync::Notify::new()),
            dropped: Counter::default(),
            shipped: Counter::default(),
            unshippable: Counter::default(),
            warned: Mutex::new(None),
        };
        state.unshipped.set(unshipped);
        if config.ship {
            self.registry.register(
                "iop_edge_usage_spooled",
                "Usage records in the spool, not yet stored by the Control Plane",
                state.unshipped.clone(),
            );
            self.registry.register(
                "iop_edge_usage_shipped",
                "Usage records the Control Plane stored (acknowledged)",
                state.shipped.clone(),
            );
            self.registry.register(
                "iop_edge_usage_spool_dropped",
                "Usage records dropped because the spool was full (the newest is dropped)",
                state.dropped.clone(),
            );
            self.registry.register(
                "iop_edge_usage_unshippable",
                "Usage records the wire cannot carry (an id or model outside its rules), kept in the file only",
                state.unshippable.clone(),
            );
        }
        state
    }
}

enum Msg {
    Record(UsageRecord),
    Flush(SyncSender<()>),
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY,
    at_ms INTEGER NOT NULL,
    day TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    provider TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    estimated INTEGER NOT NULL,
    cost_pusd INTEGER NOT NULL,
    status TEXT NOT NULL,
    duration_us INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_at ON usage(at_ms);
CREATE TABLE IF NOT EXISTS usage_daily (
    day TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    requests INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cost_pusd INTEGER NOT NULL,
    PRIMARY KEY (day, key_id, model, status)
);
";

fn day_of(at_ms: u64) -> String {
    let secs = i64::try_from(at_ms / 1000).unwrap_or(i64::MAX);
    time::OffsetDateTime::from_unix_timestamp(secs)
        .map(|t| t.date().to_string())
        .unwrap_or_default()
}

impl SqliteUsage {
    /// Runs `f` on the shipper's connection (opened on first use); `None` on an error
    /// (logged: the shipper tries again later).
    fn with_reader<T>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T>,
    ) -> Option<T> {
        self.with_reader_mut(|c| f(c))
    }

    fn with_reader_mut<T>(
        &self,
        f: impl FnOnce(&mut rusqlite::Connection) -> rusqlite::Result<T>,
    ) -> Option<T> {
        let mut guard = self
            .reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if guard.is_none() {
            let conn = rusqlite::Connection::open(&self.path).and_then(|c| {
                c.busy_timeout(Duration::from_secs(5))?;
                Ok(c)
            });
            match conn {
                Ok(c) => *guard = Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "usage spool: cannot open the file");
                    return None;
                }
            }
        }
        let conn = guard.as_mut()?;
        match f(conn) {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!(error = %e, "usage spool: read or update failed");
                *guard = None;
                None
            }
        }
    }

    /// Records in the spool (not yet stored by the Control Plane).
    pub fn spooled(&self) -> u64 {
        self.spool.unshipped.get()
    }

    /// Opens (or creates) the file and starts the writer.
    pub fn open(path: &Path, config: UsageConfig) -> Result<Arc<Self>, UsageError> {
        let fail = |e: rusqlite::Error| UsageError::Open {
            path: path.to_owned(),
            message: e.to_string(),
        };
        let conn = rusqlite::Connection::open(path).map_err(fail)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(fail)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(fail)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(fail)?;
        conn.execute_batch(SCHEMA).map_err(fail)?;
        migrate(&conn).map_err(fail)?;
        let unshipped: i64 = conn
            .query_row("SELECT count(*) FROM usage WHERE shipped = 0", [], |r| {
                r.get(0)
            })
            .map_err(fail)?;
        let mut metrics = UsageMetrics::new();
        let spool = Arc::new(metrics.spool(&config, u64::try_from(unshipped).unwrap_or(0)));
        let (tx, rx) = std::sync::mpsc::sync_channel(config.queue.max(1));
        let written = Arc::new(AtomicU64::new(0));
        let w = Arc::clone(&written);
        let retention = config.retention_days;
        let sp = Arc::clone(&spool);
        let writer = std::thread::Builder::new()
            .name("iop-usage-writer".into())
            .spawn(move || write_loop(conn, rx, retention, &w, &sp))
            .map_err(|e| UsageError::Open {
                path: path.to_owned(),
                message: e.to_string(),
            })?;
        Ok(Arc::new(Self {
            path: path.to_owned(),
            spool,
            reader: Mutex::new(None),
            tx: Mutex::new(Some(tx)),
            dropped: AtomicU64::new(0),
            written,
            warned: Mutex::new(None),
            writer: Mutex::new(Some(writer)),
            metrics,
        }))
    }

    /// Records dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Records written (inserted; a replayed request id is not counted).
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Waits until every record queued before this call is in the file.
    fn flush_queue(&self) {
        let (done, wait) = std::sync::mpsc::sync_channel(1);
        let sent = self
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_some_and(|tx| tx.send(Msg::Flush(done)).is_ok());
        if sent {
            let _ = wait.recv();
        }
    }

    /// Writes what is queued and stops the writer (records after this are dropped).
    pub fn close(&self) {
        drop(
            self.tx
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
        if let Some(h) = self
            .writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            let _ = h.join();
        }
    }
}

impl UsageSink for SqliteUsage {
    fn flush(&self) {
        self.flush_queue();
    }

    fn spent(&self, key: &str, day: &str, month: &str) -> Option<(u64, u64)> {
        self.flush_queue();
        let conn = rusqlite::Connection::open_with_flags(
            &self.path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .ok()?;
        let sum = |sql: &str, arg: &str| -> Option<u64> {
            let v: i64 = conn
                .query_row(sql, rusqlite::params![key, arg], |r| r.get(0))
                .ok()?;
            u64::try_from(v).ok()
        };
        let day_spent = sum(
            "SELECT coalesce(sum(cost_pusd), 0) FROM usage_daily WHERE key_id = ?1 AND day = ?2",
            day,
        )?;
        let month_spent = sum(
            "SELECT coalesce(sum(cost_pusd), 0) FROM usage_daily WHERE key_id = ?1 AND substr(day, 1, 7) = ?2",
            month,
        )?;
        Some((day_spent, month_spent))
    }

    fn encode_metrics(&self, out: &mut String) {
        if out.ends_with("# EOF\n") {
            out.truncate(out.len() - "# EOF\n".len());
        }
        let _ = prometheus_client::encoding::text::encode(out, &self.metrics.registry);
    }

    fn unshipped(&self, limit: usize) -> Option<Vec<UsageRecord>> {
        if !self.spool.ship {
            return None;
        }
        let read = |conn: &rusqlite::Connection| -> rusqlite::Result<Vec<UsageRecord>> {
            let mut st = conn.prepare_cached(
                "SELECT request_id, at_ms, key_id, model, provider, input_tokens, output_tokens, estimated, cost_pusd, status, duration_us, cached_input_tokens, first_byte_us, added_us FROM usage WHERE shipped = 0 ORDER BY at_ms, request_id LIMIT ?1",
            )?;
            let rows = st.query_map([i64::try_from(limit).unwrap_or(i64::MAX)], |r| {
                let u = |i: usize| -> rusqlite::Result<u64> {
                    Ok(u64::try_from(r.get::<_, i64>(i)?).unwrap_or(0))
                };
                Ok(UsageRecord {
                    request_id: r.get(0)?,
                    at_ms: u(1)?,
                    key: r.get(2)?,
                    model: r.get(3)?,
                    provider: r.get(4)?,
                    input_tokens: u(5)?,
                    output_tokens: u(6)?,
                    estimated: r.get(7)?,
                    cost_pusd: u(8)?,
                    outcome: Outcome::parse(&r.get::<_, String>(9)?),
                    duration_us: u(10)?,
                    cached_input_tokens: u(11)?,
                    first_byte_us: u(12)?,
                    added_us: u(13)?,
                })
            })?;
            rows.collect()
        };
        self.with_reader(|conn| read(conn)).or(Some(Vec::new()))
    }

    fn shipped(&self, request_ids: &[String]) {
        let mark = |conn: &mut rusqlite::Connection| -> rusqlite::Result<u64> {
            let tx = conn.transaction()?;
            let mut n = 0;
            {
                let mut st = tx.prepare_cached(
                    "UPDATE usage SET shipped = 1 WHERE request_id = ?1 AND shipped = 0",
                )?;
                for id in request_ids {
                    n += st.execute([id])? as u64;
                }
            }
            tx.commit()?;
            Ok(n)
        };
        if let Some(n) = self.with_reader_mut(mark) {
            let _ = self.spool.unshipped.inner().fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |v| Some(v.saturating_sub(n)),
            );
        }
    }

    fn spool_notify(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.spool.ship.then(|| Arc::clone(&self.spool.notify))
    }

    fn acknowledged(&self, n: u64) {
        self.spool.shipped.inc_by(n);
    }

    fn unshippable(&self, n: u64) {
        self.spool.unshippable.inc_by(n);
    }

    fn record(&self, record: UsageRecord) {
        self.metrics
            .records
            .get_or_create(&StatusLabel {
                status: record.outcome.as_str(),
            })
            .inc();
        for (direction, n) in [
            ("input", record.input_tokens),
            ("output", record.output_tokens),
        ] {
            if n > 0 {
                self.metrics
                    .tokens
                    .get_or_create(&TokenLabels {
                        key: record.key.clone(),
                        model: record.model.clone(),
                        direction,
                    })
                    .inc_by(n);
            }
        }
        let full = match self
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            Some(tx) => matches!(
                tx.try_send(Msg::Record(record)),
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_))
            ),
            None => true,
        };
        if full {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            self.metrics.dropped.inc();
            let mut warned = self
                .warned
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                *warned = Some(Instant::now());
                tracing::warn!(
                    dropped = self.dropped(),
                    "usage store queue full: newest records dropped (iop_edge_usage_dropped_total)"
                );
            }
        }
    }
}

fn write_loop(
    mut conn: rusqlite::Connection,
    rx: Receiver<Msg>,
    retention_days: u32,
    written: &AtomicU64,
    spool: &SpoolState,
) {
    let mut last_prune: Option<Instant> = None;
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < 512 {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let mut flushes = Vec::new();
        let mut records = Vec::new();
        for m in batch {
            match m {
                Msg::Record(r) => records.push(r),
                Msg::Flush(done) => flushes.push(done),
            }
        }
        if !records.is_empty() {
            match insert(&mut conn, &records, spool) {
                Ok(n) => {
                    written.fetch_add(n, Ordering::Relaxed);
                    if spool.ship && n > 0 {
                        spool.notify.notify_one();
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, records = records.len(), "usage store write failed");
                }
            }
        }
        if last_prune.is_none_or(|t| t.elapsed() >= Duration::from_secs(3600)) {
            last_prune = Some(Instant::now());
            let now_ms = u64::try_from(
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_millis(),
            )
            .unwrap_or(u64::MAX);
            let cutoff = now_ms.saturating_sub(u64::from(retention_days) * 86_400_000);
            // Records the Control Plane has not stored yet stay (the spool bounds them).
            let _ = conn.execute(
                "DELETE FROM usage WHERE at_ms < ?1 AND shipped = 1",
                [i64::try_from(cutoff).unwrap_or(i64::MAX)],
            );
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

fn insert(
    conn: &mut rusqlite::Connection,
    records: &[UsageRecord],
    spool: &SpoolState,
) -> rusqlite::Result<u64> {
    let tx = conn.transaction()?;
    let mut n = 0;
    let mut spooled = 0;
    let mut dropped = 0;
    {
        let mut row = tx.prepare_cached(
            "INSERT OR IGNORE INTO usage (request_id, at_ms, day, key_id, model, provider, input_tokens, output_tokens, estimated, status, duration_us, cost_pusd, shipped, cached_input_tokens, first_byte_us, added_us) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
        )?;
        let mut daily = tx.prepare_cached(
            "INSERT INTO usage_daily (day, key_id, model, status, requests, input_tokens, output_tokens, cost_pusd) VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7)
             ON CONFLICT (day, key_id, model, status) DO UPDATE SET requests = requests + 1, input_tokens = input_tokens + excluded.input_tokens, output_tokens = output_tokens + excluded.output_tokens, cost_pusd = cost_pusd + excluded.cost_pusd",
        )?;
        let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for r in records {
            if spool.ship && spool.unshipped.get() + spooled >= spool.max {
                dropped += 1;
                continue;
            }
            let day = day_of(r.at_ms);
            let inserted = row.execute(rusqlite::params![
                r.request_id,
                int(r.at_ms),
                day,
                r.key,
                r.model,
                r.provider,
                int(r.input_tokens),
                int(r.output_tokens),
                r.estimated,
                r.outcome.as_str(),
                int(r.duration_us),
                int(r.cost_pusd),
                !spool.ship,
                int(r.cached_input_tokens),
                int(r.first_byte_us),
                int(r.added_us),
            ])?;
            if inserted == 1 {
                n += 1;
                if spool.ship {
                    spooled += 1;
                }
                daily.execute(rusqlite::params![
                    day,
                    r.key,
                    r.model,
                    r.outcome.as_str(),
                    int(r.input_tokens),
                    int(r.output_tokens),
                    int(r.cost_pusd),
                ])?;
            }
        }
    }
    // Counted before the rows become visible: the shipper may read, ship and subtract them
    // the moment the commit lands, and a subtraction that came first was clamped at zero, so
    // the count (`iop_edge_usage_spooled`) stayed above zero with nothing left to ship.
    spool.unshipped.inc_by(spooled);
    if let Err(e) = tx.commit() {
        spool.unshipped.dec_by(spooled);
        return Err(e);
    }
    if dropped > 0 {
        spool.dropped.inc_by(dropped);
        let mut warned = spool
            .warned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            *warned = Some(Instant::now());
            tracing::warn!(
                dropped,
                max = spool.max,
                "usage spool full (the Control Plane has been unreachable a long time): newest records dropped (iop_edge_usage_spool_dropped_total)"
            );
        }
    }
    Ok(n)
}

/// Brings a file made by an older release up to [`SCHEMA`] (each step checks first).
fn migrate(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    let has_shipped: bool = conn.query_row(
        "SELECT count(*) > 0 FROM pragma_table_info('usage') WHERE name = 'shipped'",
        [],
        |r| r.get(0),
    )?;
    if !has_shipped {
        // Rows of an older release were never meant for a Control Plane.
        conn.execute_batch("ALTER TABLE usage ADD COLUMN shipped INTEGER NOT NULL DEFAULT 1")?;
    }
    for column in ["cached_input_tokens", "first_byte_us", "added_us"] {
        let has: bool = conn.query_row(
            "SELECT count(*) > 0 FROM pragma_table_info('usage') WHERE name = ?1",
            [column],
            |r| r.get(0),
        )?;
        if !has {
            conn.execute_batch(&format!(
                "ALTER TABLE usage ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0"
            ))?;
        }
    }
    conn.execute_batch(
        "CREATE INDEX IF NOT EXISTS usage_unshipped ON usage(at_ms) WHERE shipped = 0",
    )
}

/// One row of the daily rollup: a day, a key id, a model and an outcome.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DailyUsage {
    /// `YYYY-MM-DD`, UTC.
    pub day: String,
    /// The key id.
    pub key: String,
    /// The model group.
    pub model: String,
    /// `completed`, `failed`, `cancelled` or `refused`.
    pub status: String,
    /// Requests.
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Cost at the prices of the time, pico-dollars.
    pub cost_pusd: u64,
}

/// The daily rollup of the usage file at `path` (opened read-only, while an Edge writes it),
/// from day `since` (`YYYY-MM-DD`) on, ordered by day, key, model and outcome.
pub fn daily(path: &Path, since: Option<&str>) -> Result<Vec<DailyUsage>, UsageError> {
    let fail = |e: rusqlite::Error| UsageError::Open {
        path: path.to_owned(),
        message: e.to_string(),
    };
    let conn =
        rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(fail)?;
    let mut st = conn
        .prepare(
            "SELECT day, key_id, model, status, requests, input_tokens, output_tokens, cost_pusd
             FROM usage_daily WHERE day >= ?1 ORDER BY day, key_id, model, status",
        )
        .map_err(fail)?;
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let rows = st
        .query_map([since.unwrap_or("")], |r| {
            Ok(DailyUsage {
                day: r.get(0)?,
                key: r.get(1)?,
                model: r.get(2)?,
                status: r.get(3)?,
                requests: n(r.get(4)?),
                input_tokens: n(r.get(5)?),
                output_tokens: n(r.get(6)?),
                cost_pusd: n(r.get(7)?),
            })
        })
        .map_err(fail)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(fail)?;
    Ok(rows)
}

/// What a request's hold needs to write its record when it ends
/// ([`crate::limits::Hold::with_meter`]).
#[derive(Debug)]
pub struct Meter {
    sink: Arc<dyn UsageSink>,
    request_id: String,
    at_ms: u64,
    started: Instant,
    key: String,
    model: String,
    pub(crate) provider: String,
    input_estimate: u64,
    output_estimate: u64,
    price: Option<crate::limits::budget::Price>,
    first_byte_us: u64,
    /// The provider call's duration at the Node, when its terminal said.
    pub(crate) provider_us: Option<u64>,
}

fn unix_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

impl Meter {
    /// A request of `key` to `model` admitted now; the estimates are recorded (marked) when the
    /// provider reports no usage.
    pub fn new(
        sink: Arc<dyn UsageSink>,
        key: &str,
        model: &str,
        input_estimate: u64,
        output_estimate: u64,
    ) -> Self {
        Self {
            sink,
            request_id: request_id(),
            at_ms: unix_ms(),
            started: Instant::now(),
            key: key.to_owned(),
            model: model.to_owned(),
            provider: String::new(),
            input_estimate,
            output_estimate,
            price: None,
            first_byte_us: 0,
            provider_us: None,
        }
    }

    /// The answer's first content arrived now (kept once).
    pub fn first_data(&mut self) {
        if self.first_byte_us == 0 {
            self.first_byte_us = u64::try_from(self.started.elapsed().as_micros())
                .unwrap_or(u64::MAX)
                .max(1);
        }
    }

    /// Prices the record at `price` (its `cost_pusd`).
    pub fn with_price(mut self, price: Option<crate::limits::budget::Price>) -> Self {
        self.price = price;
        self
    }

    /// The record of a request the key's limits refused.
    pub fn refused(sink: &Arc<dyn UsageSink>, key: &str, model: &str) {
        sink.record(UsageRecord {
            request_id: request_id(),
            at_ms: unix_ms(),
            key: key.to_owned(),
            model: model.to_owned(),
            provider: String::new(),
            input_tokens: 0,
            output_tokens: 0,
            cached_input_tokens: 0,
            estimated: false,
            cost_pusd: 0,
            outcome: Outcome::Refused,
            duration_us: 0,
            first_byte_us: 0,
            added_us: 0,
        });
    }

    /// Writes the record: the provider's figures, else (when the provider may have used
    /// tokens: `charged`) the estimates, marked.
    pub(crate) fn emit(
        self,
        outcome: Outcome,
        charged: bool,
        reported: Option<iop_wire::runtime::Usage>,
    ) {
        let (usage, estimated) = match reported {
            Some(u) => (u, false),
            None if charged => (
                iop_wire::runtime::Usage::new(self.input_estimate, self.output_estimate),
                true,
            ),
            None => (iop_wire::runtime::Usage::default(), false),
        };
        let duration_us = u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.sink.record(UsageRecord {
            request_id: self.request_id,
            at_ms: self.at_ms,
            key: self.key,
            model: self.model,
            provider: self.provider,
            input_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            cached_input_tokens: usage.cached_prompt_tokens.min(usage.prompt_tokens),
            estimated,
            cost_pusd: self.price.map_or(0, |p| p.cost_of(&usage)),
            outcome,
            duration_us,
            first_byte_us: self.first_byte_us,
            added_us: self
                .provider_us
                .map_or(0, |p| duration_us.saturating_sub(p).max(1)),
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn record(id: &str, outcome: Outcome, tokens: (u64, u64)) -> UsageRecord {
        UsageRecord {
            request_id: id.into(),
            at_ms: unix_ms(),
            key: "team-a".into(),
            model: "m".into(),
            provider: "node-1/p".into(),
            input_tokens: tokens.0,
            output_tokens: tokens.1,
            cached_input_tokens: 0,
            estimated: false,
            cost_pusd: tokens.0 + tokens.1,
            outcome,
            duration_us: 10,
            first_byte_us: 5,
            added_us: 2,
        }
    }

    #[test]
    fn a_record_is_written_once_and_rolled_up_by_day() {
        let dir = std::env::temp_dir().join(format!("iop-usage-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("usage.db");
        let _ = std::fs::remove_file(&path);
        let store = SqliteUsage::open(&path, UsageConfig::default()).unwrap();
        store.record(record("r1", Outcome::Completed, (3, 5)));
        store.record(record("r1", Outcome::Completed, (3, 5)));
        store.record(record("r2", Outcome::Completed, (1, 1)));
        store.record(record("r3", Outcome::Refused, (0, 0)));
        UsageSink::flush(&*store);
        assert_eq!(
            store.written(),
            3,
            "a replayed request id is not written twice"
        );
        let conn = rusqlite::Connection::open(&path).unwrap();
        let (rows, input, output): (i64, i64, i64) = conn
            .query_row(
                "SELECT requests, input_tokens, output_tokens FROM usage_daily WHERE day = ?1 AND status = 'completed'",
                [day_of(unix_ms())],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!((rows, input, output), (2, 4, 6));
        let n: i64 = conn
            .query_row("SELECT count(*) FROM usage", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 3);
        let rows = daily(&path, None).unwrap();
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(
            (rows[0].status.as_str(), rows[0].requests, rows[0].cost_pusd),
            ("completed", 2, 10)
        );
        assert!(daily(&path, Some("9999-01-01")).unwrap().is_empty());
        // Full queue: the newest is dropped, counted.
        let small = SqliteUsage::open(
            &dir.join("small.db"),
            UsageConfig {
                queue: 1,
                ..UsageConfig::default()
            },
        )
        .unwrap();
        for i in 0..1000 {
            small.record(record(&format!("s{i}"), Outcome::Completed, (1, 1)));
        }
        UsageSink::flush(&*small);
        assert_eq!(small.written() + small.dropped(), 1000);
        small.close();
        store.close();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_spool_keeps_records_until_shipped_across_a_restart_and_is_bounded() {
        let dir = std::env::temp_dir().join(format!("iop-usage-spool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("usage.db");
        let config = UsageConfig {
            ship: true,
            spool_max: 3,
            retention_days: 0,
            ..UsageConfig::default()
        };
        let store = SqliteUsage::open(&path, config.clone()).unwrap();
        for i in 0..5 {
            let mut r = record(&format!("r{i}"), Outcome::Completed, (1, 1));
            r.at_ms = 1_000 + i;
            store.record(r);
        }
        UsageSink::flush(&*store);
        assert_eq!(store.spooled(), 3, "bounded: the newest two are dropped");
        let mut m = String::new();
        UsageSink::encode_metrics(&*store, &mut m);
        assert!(m.contains("iop_edge_usage_spool_dropped_total 2"), "{m}");
        let oldest: Vec<String> = store
            .unshipped(2)
            .unwrap()
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        assert_eq!(oldest, ["r0", "r1"], "oldest first");
        store.shipped(&oldest);
        store.shipped(&oldest); // twice: counted once
        assert_eq!(store.spooled(), 1);
        let mut m = String::new();
        UsageSink::encode_metrics(&*store, &mut m);
        assert!(
            m.contains("iop_edge_usage_spooled 1\n"),
            "the gauge is the count: {m}"
        );
        store.close();
        // A restart finds what is left; pruning (retention 0 here) keeps it until shipped.
        let store = SqliteUsage::open(&path, config).unwrap();
        assert_eq!(store.spooled(), 1);
        store.record(record("r9", Outcome::Completed, (1, 1)));
        UsageSink::flush(&*store);
        let left: Vec<String> = store
            .unshipped(10)
            .unwrap()
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        assert_eq!(left, ["r2", "r9"]);
        // Without shipping, no spool at all.
        let plain = SqliteUsage::open(&dir.join("plain.db"), UsageConfig::default()).unwrap();
        plain.record(record("x", Outcome::Completed, (1, 1)));
        UsageSink::flush(&*plain);
        assert!(plain.unshipped(10).is_none());
        assert!(plain.spool_notify().is_none());
    }
}
