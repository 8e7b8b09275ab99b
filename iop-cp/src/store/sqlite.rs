//! SQLite backend (bundled SQLite through rusqlite): one file, WAL journal, one connection
//! behind a mutex, every call on the blocking pool. Mutations use `BEGIN IMMEDIATE`, so
//! writers serialize on the database lock and the generation bump is atomic with the change.

use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rusqlite::{Connection, ErrorCode, OptionalExtension as _, TransactionBehavior, params};

use super::{
    DailyUsage, IssuerKey, LeaseView, Mutation, Principal, Revision, Route, Slot, Snapshot, Store,
    StoreError, Token, UsageRecord, UsageStored, digest_array, to_i64, to_u64, unix_ms,
};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (k, v) VALUES ('generation', 1);
CREATE TABLE IF NOT EXISTS principals (
  id TEXT PRIMARY KEY, display_name TEXT NOT NULL, enabled INTEGER NOT NULL, limits TEXT);
CREATE TABLE IF NOT EXISTS tokens (
  id TEXT PRIMARY KEY, principal_id TEXT NOT NULL REFERENCES principals(id),
  digest BLOB NOT NULL UNIQUE, revoked INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS slots (
  id TEXT PRIMARY KEY, profile TEXT NOT NULL, header_name TEXT NOT NULL,
  header_prefix TEXT NOT NULL, sealed BLOB NOT NULL, revision INTEGER NOT NULL,
  enabled INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS routes (
  id TEXT PRIMARY KEY, principal_id TEXT NOT NULL REFERENCES principals(id),
  model TEXT NOT NULL, slot_id TEXT NOT NULL REFERENCES slots(id), profile TEXT NOT NULL,
  upstream_target TEXT NOT NULL, selector TEXT NOT NULL, revision INTEGER NOT NULL,
  enabled INTEGER NOT NULL, UNIQUE (principal_id, model));
CREATE TABLE IF NOT EXISTS issuer_keys (
  id TEXT PRIMARY KEY, sealed BLOB NOT NULL, active INTEGER NOT NULL,
  activates_at_unix_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS revisions (
  generation INTEGER PRIMARY KEY, kind TEXT NOT NULL, object_id TEXT NOT NULL,
  at_unix_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS revisions_object ON revisions(kind, object_id, generation);
CREATE TABLE IF NOT EXISTS usage_records (
  request_id TEXT PRIMARY KEY, at_unix_ms INTEGER NOT NULL, day TEXT NOT NULL,
  edge_id TEXT NOT NULL, principal_id TEXT NOT NULL, model TEXT NOT NULL,
  provider TEXT NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
  cached_input_tokens INTEGER NOT NULL, estimated INTEGER NOT NULL,
  cost_pico_usd INTEGER NOT NULL, outcome TEXT NOT NULL, duration_us INTEGER NOT NULL,
  first_byte_us INTEGER NOT NULL, added_us INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS usage_records_at ON usage_records(at_unix_ms);
CREATE TABLE IF NOT EXISTS usage_daily (
  day TEXT NOT NULL, principal_id TEXT NOT NULL, model TEXT NOT NULL, outcome TEXT NOT NULL,
  requests INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
  cached_input_tokens INTEGER NOT NULL, cost_pico_usd INTEGER NOT NULL,
  PRIMARY KEY (day, principal_id, model, outcome));
";

/// How often [`Store::wait_change`] reads `PRAGMA data_version`: a mutation made by the CLI
/// reaches the Edges within about this long.
const CHANGE_CHECK: std::time::Duration = std::time::Duration::from_millis(20);

/// The SQLite store.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    /// The `data_version` [`Store::wait_change`] last returned on (`i64::MIN`: none yet), so
    /// a commit between two waits is not missed.
    seen_version: Arc<AtomicI64>,
    /// Run each call on the caller's thread instead of the blocking pool
    /// ([`SqliteStore::in_memory_inline`]).
    inline: bool,
}

fn backend(e: &rusqlite::Error) -> StoreError {
    tracing::debug!(error = %e, "sqlite store error");
    StoreError::Unavailable
}

fn unique(e: rusqlite::Error, what: &'static str) -> StoreError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _) if f.code == ErrorCode::ConstraintViolation => {
            StoreError::Conflict(what)
        }
        _ => backend(&e),
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path` and its schema.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path).map_err(|e| backend(&e))?;
        Self::init(conn)
    }

    /// An in-memory database (tests, demos).
    pub fn in_memory() -> Result<Self, StoreError> {
        let conn = Connection::open_in_memory().map_err(|e| backend(&e))?;
        Self::init(conn)
    }

    /// An in-memory database whose calls run on the calling task's thread, not the blocking
    /// pool: for deterministic simulations (`turmoil`), where a result arriving from another
    /// thread at a moment of its own would make a seed replay differently. Each call blocks
    /// its runtime thread for as long as SQLite takes (microseconds in memory).
    pub fn in_memory_inline() -> Result<Self, StoreError> {
        let mut store = Self::in_memory()?;
        store.inline = true;
        Ok(store)
    }

    fn init(conn: Connection) -> Result<Self, StoreError> {
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(|e| backend(&e))?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(|e| backend(&e))?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(|e| backend(&e))?;
        conn.execute_batch(SCHEMA).map_err(|e| backend(&e))?;
        migrate(&conn)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            seen_version: Arc::new(AtomicI64::new(i64::MIN)),
            inline: false,
        })
    }

    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = self.conn.clone();
        if self.inline {
            let mut guard = conn.lock().map_err(|_| StoreError::Unavailable)?;
            return f(&mut guard);
        }
        tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().map_err(|_| StoreError::Unavailable)?;
            f(&mut guard)
        })
        .await
        .map_err(|_| StoreError::Unavailable)?
    }
}

/// Brings a store made by an older release up to [`SCHEMA`]: each step checks whether it is
/// needed, so running it again (or on a new store) changes nothing.
fn migrate(conn: &Connection) -> Result<(), StoreError> {
    // Principal limits (issue #29).
    let has_limits: bool = conn
        .query_row(
            "SELECT COUNT(*) > 0 FROM pragma_table_info('principals') WHERE name = 'limits'",
            [],
            |r| r.get(0),
        )
        .map_err(|e| backend(&e))?;
    if !has_limits {
        conn.execute_batch("ALTER TABLE principals ADD COLUMN limits TEXT")
            .map_err(|e| backend(&e))?;
    }
    Ok(())
}

fn revision(r: &rusqlite::Row<'_>) -> rusqlite::Result<Revision> {
    Ok(Revision {
        generation: to_u64(r.get(0)?),
        kind: r.get(1)?,
        object_id: r.get(2)?,
        at_unix_ms: r.get(3)?,
    })
}

fn exists(tx: &rusqlite::Transaction<'_>, sql: &str, id: &str) -> Result<bool, StoreError> {
    tx.query_row(sql, params![id], |_| Ok(()))
        .optional()
        .map(|r| r.is_some())
        .map_err(|e| backend(&e))
}

fn changed(n: usize, what: &'static str) -> Result<(), StoreError> {
    if n == 0 {
        Err(StoreError::NotFound(what))
    } else {
        Ok(())
    }
}

fn apply_one(tx: &rusqlite::Transaction<'_>, m: &Mutation) -> Result<(), StoreError> {
    match m {
        Mutation::CreatePrincipal { id, display_name } => {
            tx.execute(
                "INSERT INTO principals (id, display_name, enabled) VALUES (?1, ?2, 1)",
                params![id, display_name],
            )
            .map_err(|e| unique(e, "principal"))?;
        }
        Mutation::SetPrincipalEnabled { id, enabled } => {
            let n = tx
                .execute(
                    "UPDATE principals SET enabled = ?1 WHERE id = ?2",
                    params![enabled, id],
                )
                .map_err(|e| backend(&e))?;
            changed(n, "principal")?;
        }
        Mutation::SetPrincipalLimits { id, limits } => {
            let n = tx
                .execute(
                    "UPDATE principals SET limits = ?1 WHERE id = ?2",
                    params![super::limits_text(limits.as_ref()), id],
                )
                .map_err(|e| backend(&e))?;
            changed(n, "principal")?;
        }
        Mutation::CreateToken {
            id,
            principal_id,
            digest,
        } => {
            if !exists(tx, "SELECT 1 FROM principals WHERE id = ?1", principal_id)? {
                return Err(StoreError::NotFound("principal"));
            }
            tx.execute(
                "INSERT INTO tokens (id, principal_id, digest, revoked) VALUES (?1, ?2, ?3, 0)",
                params![id, principal_id, &digest[..]],
            )
            .map_err(|e| unique(e, "token"))?;
        }
        Mutation::RevokeToken { id } => {
            let n = tx
                .execute("UPDATE tokens SET revoked = 1 WHERE id = ?1", params![id])
                .map_err(|e| backend(&e))?;
            changed(n, "token")?;
        }
        Mutation::PutSlot {
            id,
            profile,
            header_name,
            header_prefix,
            sealed,
        } => {
            let other_profile: i64 = tx
                .query_row(
                    "SELECT COUNT(*) FROM routes WHERE slot_id = ?1 AND profile <> ?2",
                    params![id, profile],
                    |r| r.get(0),
                )
                .map_err(|e| backend(&e))?;
            if other_profile > 0 {
                return Err(StoreError::ProfileMismatch);
            }
            let n = tx
                .execute(
                    "UPDATE slots SET profile = ?2, header_name = ?3, header_prefix = ?4, \
                     sealed = ?5, revision = revision + 1 WHERE id = ?1",
                    params![id, profile, header_name, header_prefix, sealed],
                )
                .map_err(|e| backend(&e))?;
            if n == 0 {
                tx.execute(
                    "INSERT INTO slots (id, profile, header_name, header_prefix, sealed, \
                     revision, enabled) VALUES (?1, ?2, ?3, ?4, ?5, 1, 1)",
                    params![id, profile, header_name, header_prefix, sealed],
                )
                .map_err(|e| unique(e, "slot"))?;
            }
        }
        Mutation::SetSlotEnabled { id, enabled } => {
            let n = tx
                .execute(
                    "UPDATE slots SET enabled = ?1 WHERE id = ?2",
                    params![enabled, id],
                )
                .map_err(|e| backend(&e))?;
            changed(n, "slot")?;
        }
        Mutation::PutRoute {
            id,
            principal_id,
            model,
            slot_id,
            upstream_target,
            selector,
        } => {
            if !exists(tx, "SELECT 1 FROM principals WHERE id = ?1", principal_id)? {
                return Err(StoreError::NotFound("principal"));
            }
            let profile: String = tx
                .query_row(
                    "SELECT profile FROM slots WHERE id = ?1",
                    params![slot_id],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| backend(&e))?
                .ok_or(StoreError::NotFound("slot"))?;
            let n = tx
                .execute(
                    "UPDATE routes SET principal_id = ?2, model = ?3, slot_id = ?4, profile = ?5, \
                     upstream_target = ?6, selector = ?7, revision = revision + 1 WHERE id = ?1",
                    params![
                        id,
                        principal_id,
                        model,
                        slot_id,
                        profile,
                        upstream_target,
                        selector
                    ],
                )
                .map_err(|e| unique(e, "route for this principal and model"))?;
            if n == 0 {
                tx.execute(
                    "INSERT INTO routes (id, principal_id, model, slot_id, profile, \
                     upstream_target, selector, revision, enabled) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 1, 1)",
                    params![
                        id,
                        principal_id,
                        model,
                        slot_id,
                        profile,
                        upstream_target,
                        selector
                    ],
                )
                .map_err(|e| unique(e, "route for this principal and model"))?;
            }
        }
        Mutation::SetRouteEnabled { id, enabled } => {
            let n = tx
                .execute(
                    "UPDATE routes SET enabled = ?1 WHERE id = ?2",
                    params![enabled, id],
                )
                .map_err(|e| backend(&e))?;
            changed(n, "route")?;
        }
        Mutation::InstallIssuerKey { id, sealed } => {
            if exists(tx, "SELECT 1 FROM issuer_keys WHERE id = ?1", id)? {
                return Err(StoreError::Conflict("issuer key"));
            }
            if issuer_slots(tx)?.0 {
                return Err(StoreError::Conflict("active issuer key"));
            }
            insert_issuer_key(tx, id, sealed, true, unix_ms())?;
        }
        Mutation::StageIssuerKey {
            id,
            sealed,
            activates_at_unix_ms,
        } => {
            if exists(tx, "SELECT 1 FROM issuer_keys WHERE id = ?1", id)? {
                return Err(StoreError::Conflict("issuer key"));
            }
            match issuer_slots(tx)? {
                (false, _) => return Err(StoreError::NotFound("active issuer key")),
                (_, true) => return Err(StoreError::Conflict("staged issuer key")),
                (true, false) => insert_issuer_key(tx, id, sealed, false, *activates_at_unix_ms)?,
            }
        }
        Mutation::ActivateIssuerKey { id } => {
            if !exists(
                tx,
                "SELECT 1 FROM issuer_keys WHERE id = ?1 AND active = 0",
                id,
            )? {
                return Err(StoreError::NotFound("staged issuer key"));
            }
            tx.execute("DELETE FROM issuer_keys WHERE active = 1", [])
                .map_err(|e| backend(&e))?;
            tx.execute(
                "UPDATE issuer_keys SET active = 1, activates_at_unix_ms = ?2 WHERE id = ?1",
                params![id, unix_ms()],
            )
            .map_err(|e| backend(&e))?;
        }
    }
    Ok(())
}

/// Whether an active and whether a staged issuer key exist.
fn issuer_slots(tx: &rusqlite::Transaction<'_>) -> Result<(bool, bool), StoreError> {
    tx.query_row(
        "SELECT COALESCE(MAX(active = 1), 0), COALESCE(MAX(active = 0), 0) FROM issuer_keys",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .map_err(|e| backend(&e))
}

fn insert_issuer_key(
    tx: &rusqlite::Transaction<'_>,
    id: &str,
    sealed: &[u8],
    active: bool,
    at_unix_ms: i64,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO issuer_keys (id, sealed, active, activates_at_unix_ms) VALUES (?1, ?2, ?3, ?4)",
        params![id, sealed, active, at_unix_ms],
    )
    .map(drop)
    .map_err(|e| unique(e, "issuer key"))
}

fn issuer_keys(conn: &Connection, sealed: bool) -> Result<Vec<IssuerKey>, StoreError> {
    let sql = if sealed {
        "SELECT id, sealed, active, activates_at_unix_ms FROM issuer_keys ORDER BY active DESC, id"
    } else {
        "SELECT id, x'', active, activates_at_unix_ms FROM issuer_keys ORDER BY active DESC, id"
    };
    let mut st = conn.prepare(sql).map_err(|e| backend(&e))?;
    st.query_map([], |r| {
        Ok(IssuerKey {
            id: r.get(0)?,
            sealed: r.get(1)?,
            active: r.get(2)?,
            activates_at_unix_ms: r.get(3)?,
        })
    })
    .map_err(|e| backend(&e))?
    .collect::<Result<Vec<_>, _>>()
    .map_err(|e| backend(&e))
}

fn principal(r: &rusqlite::Row<'_>) -> rusqlite::Result<Principal> {
    Ok(Principal {
        id: r.get(0)?,
        display_name: r.get(1)?,
        enabled: r.get(2)?,
        limits: super::limits_from_text(r.get(3)?),
    })
}

fn route(r: &rusqlite::Row<'_>) -> rusqlite::Result<Route> {
    Ok(Route {
        id: r.get(0)?,
        principal_id: r.get(1)?,
        model: r.get(2)?,
        slot_id: r.get(3)?,
        profile: r.get(4)?,
        upstream_target: r.get(5)?,
        selector: r.get(6)?,
        revision: to_u64(r.get(7)?),
        enabled: r.get(8)?,
    })
}

fn slot(r: &rusqlite::Row<'_>) -> rusqlite::Result<Slot> {
    Ok(Slot {
        id: r.get(0)?,
        profile: r.get(1)?,
        header_name: r.get(2)?,
        header_prefix: r.get(3)?,
        sealed: r.get(4)?,
        revision: to_u64(r.get(5)?),
        enabled: r.get(6)?,
    })
}

const ROUTE_COLS: &str =
    "id, principal_id, model, slot_id, profile, upstream_target, selector, revision, enabled";

fn generation(conn: &Connection) -> Result<u64, StoreError> {
    conn.query_row("SELECT v FROM meta WHERE k = 'generation'", [], |r| {
        r.get::<_, i64>(0)
    })
    .map(to_u64)
    .map_err(|e| backend(&e))
}

#[async_trait]
impl Store for SqliteStore {
    async fn apply(&self, mutation: Mutation) -> Result<u64, StoreError> {
        mutation.validate()?;
        self.with(move |conn| {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| backend(&e))?;
            apply_one(&tx, &mutation)?;
            let generation: i64 = tx
                .query_row(
                    "UPDATE meta SET v = v + 1 WHERE k = 'generation' RETURNING v",
                    [],
                    |r| r.get(0),
                )
                .map_err(|e| backend(&e))?;
            let (kind, object_id) = mutation.describe();
            tx.execute(
                "INSERT INTO revisions (generation, kind, object_id, at_unix_ms) \
                 VALUES (?1, ?2, ?3, ?4)",
                params![generation, kind, object_id, unix_ms()],
            )
            .map_err(|e| backend(&e))?;
            tx.commit().map_err(|e| backend(&e))?;
            Ok(to_u64(generation))
        })
        .await
    }

    async fn generation(&self) -> Result<u64, StoreError> {
        self.with(|conn| generation(conn)).await
    }

    /// `PRAGMA data_version` (it changes when another connection, e.g. the CLI, commits) read
    /// every 20 ms (`CHANGE_CHECK`): a few microseconds each, on the blocking pool.
    async fn wait_change(&self, limit: std::time::Duration) {
        let version = || {
            self.with(|conn| {
                conn.query_row("PRAGMA data_version", [], |r| r.get::<_, i64>(0))
                    .map_err(|e| backend(&e))
            })
        };
        let deadline = tokio::time::Instant::now() + limit;
        let mut seen = self.seen_version.load(Ordering::Relaxed);
        loop {
            if let Ok(v) = version().await {
                if seen == i64::MIN {
                    seen = v;
                    self.seen_version.store(v, Ordering::Relaxed);
                } else if v != seen {
                    self.seen_version.store(v, Ordering::Relaxed);
                    return;
                }
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline.min(now + CHANGE_CHECK)).await;
        }
    }

    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        self.with(|conn| {
            let tx = conn.transaction().map_err(|e| backend(&e))?;
            let generation = generation(&tx)?;
            let collect = |sql: &str| -> Result<Vec<_>, StoreError> {
                let mut st = tx.prepare(sql).map_err(|e| backend(&e))?;
                let rows = st.query_map([], principal).map_err(|e| backend(&e))?;
                rows.collect::<Result<Vec<_>, _>>().map_err(|e| backend(&e))
            };
            let principals =
                collect("SELECT id, display_name, enabled, limits FROM principals ORDER BY id")?;
            let mut st = tx
                .prepare("SELECT id, principal_id, digest, revoked FROM tokens ORDER BY id")
                .map_err(|e| backend(&e))?;
            let tokens = st
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, Vec<u8>>(2)?,
                        r.get::<_, bool>(3)?,
                    ))
                })
                .map_err(|e| backend(&e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| backend(&e))?
                .into_iter()
                .map(|(id, principal_id, digest, revoked)| {
                    Ok(Token {
                        id,
                        principal_id,
                        digest: digest_array(&digest)?,
                        revoked,
                    })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            drop(st);
            let mut st = tx
                .prepare(
                    "SELECT id, profile, header_name, header_prefix, x'', revision, enabled \
                     FROM slots ORDER BY id",
                )
                .map_err(|e| backend(&e))?;
            let slots = st
                .query_map([], slot)
                .map_err(|e| backend(&e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| backend(&e))?;
            drop(st);
            let mut st = tx
                .prepare(&format!("SELECT {ROUTE_COLS} FROM routes ORDER BY id"))
                .map_err(|e| backend(&e))?;
            let routes = st
                .query_map([], route)
                .map_err(|e| backend(&e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| backend(&e))?;
            drop(st);
            let issuer_keys = issuer_keys(&tx, false)?;
            tx.commit().map_err(|e| backend(&e))?;
            Ok(Snapshot {
                generation,
                principals,
                tokens,
                slots,
                routes,
                issuer_keys,
            })
        })
        .await
    }

    async fn lease_view(&self, route_id: &str, slot_id: &str) -> Result<LeaseView, StoreError> {
        let (route_id, slot_id) = (route_id.to_owned(), slot_id.to_owned());
        self.with(move |conn| {
            let tx = conn.transaction().map_err(|e| backend(&e))?;
            let generation = generation(&tx)?;
            let route = tx
                .query_row(
                    &format!("SELECT {ROUTE_COLS} FROM routes WHERE id = ?1"),
                    params![route_id],
                    route,
                )
                .optional()
                .map_err(|e| backend(&e))?;
            let slot = tx
                .query_row(
                    "SELECT id, profile, header_name, header_prefix, sealed, revision, enabled \
                     FROM slots WHERE id = ?1",
                    params![slot_id],
                    slot,
                )
                .optional()
                .map_err(|e| backend(&e))?;
            let principal = match &route {
                Some(r) => tx
                    .query_row(
                        "SELECT id, display_name, enabled, limits FROM principals WHERE id = ?1",
                        params![r.principal_id],
                        principal,
                    )
                    .optional()
                    .map_err(|e| backend(&e))?,
                None => None,
            };
            let issuer = issuer_keys(&tx, true)?.into_iter().find(|k| k.active);
            tx.commit().map_err(|e| backend(&e))?;
            Ok(LeaseView {
                generation,
                route,
                slot,
                principal,
                issuer,
            })
        })
        .await
    }

    async fn issuer_keys(&self) -> Result<Vec<IssuerKey>, StoreError> {
        self.with(|conn| issuer_keys(conn, true)).await
    }

    async fn record_usage(
        &self,
        edge_id: &str,
        records: &[UsageRecord],
    ) -> Result<UsageStored, StoreError> {
        let (edge_id, records) = (edge_id.to_owned(), records.to_vec());
        self.with(move |conn| {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| backend(&e))?;
            let mut done = UsageStored::default();
            {
                let mut row = tx
                    .prepare_cached(
                        "INSERT OR IGNORE INTO usage_records (request_id, at_unix_ms, day, \
                         edge_id, principal_id, model, provider, input_tokens, output_tokens, \
                         cached_input_tokens, estimated, cost_pico_usd, outcome, duration_us, \
                         first_byte_us, added_us) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, \
                         ?16)",
                    )
                    .map_err(|e| backend(&e))?;
                let mut daily = tx
                    .prepare_cached(
                        "INSERT INTO usage_daily (day, principal_id, model, outcome, requests, \
                         input_tokens, output_tokens, cached_input_tokens, cost_pico_usd) \
                         VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7, ?8) \
                         ON CONFLICT (day, principal_id, model, outcome) DO UPDATE SET \
                         requests = requests + 1, \
                         input_tokens = input_tokens + excluded.input_tokens, \
                         output_tokens = output_tokens + excluded.output_tokens, \
                         cached_input_tokens = cached_input_tokens + excluded.cached_input_tokens, \
                         cost_pico_usd = cost_pico_usd + excluded.cost_pico_usd",
                    )
                    .map_err(|e| backend(&e))?;
                for r in &records {
                    let day = super::day_of(r.at_unix_ms);
                    let n = row
                        .execute(params![
                            r.request_id,
                            r.at_unix_ms,
                            day,
                            edge_id,
                            r.principal_id,
                            r.model,
                            r.provider,
                            to_i64(r.input_tokens),
                            to_i64(r.output_tokens),
                            to_i64(r.cached_input_tokens),
                            r.estimated,
                            to_i64(r.cost_pico_usd),
                            r.outcome,
                            to_i64(r.duration_us),
                            to_i64(r.first_byte_us),
                            to_i64(r.added_us),
                        ])
                        .map_err(|e| backend(&e))?;
                    if n == 0 {
                        done.duplicates += 1;
                        continue;
                    }
                    done.stored += 1;
                    daily
                        .execute(params![
                            day,
                            r.principal_id,
                            r.model,
                            r.outcome,
                            to_i64(r.input_tokens),
                            to_i64(r.output_tokens),
                            to_i64(r.cached_input_tokens),
                            to_i64(r.cost_pico_usd),
                        ])
                        .map_err(|e| backend(&e))?;
                }
            }
            tx.commit().map_err(|e| backend(&e))?;
            Ok(done)
        })
        .await
    }

    async fn usage_daily(
        &self,
        since: Option<&str>,
        limit: u32,
    ) -> Result<Vec<DailyUsage>, StoreError> {
        let since = since.unwrap_or("").to_owned();
        self.with(move |conn| {
            let mut st = conn
                .prepare(
                    "SELECT day, principal_id, model, outcome, requests, input_tokens, \
                     output_tokens, cached_input_tokens, cost_pico_usd FROM usage_daily \
                     WHERE day >= ?1 ORDER BY day, principal_id, model, outcome LIMIT ?2",
                )
                .map_err(|e| backend(&e))?;
            st.query_map(params![since, limit], |r| {
                Ok(DailyUsage {
                    day: r.get(0)?,
                    principal_id: r.get(1)?,
                    model: r.get(2)?,
                    outcome: r.get(3)?,
                    requests: to_u64(r.get(4)?),
                    input_tokens: to_u64(r.get(5)?),
                    output_tokens: to_u64(r.get(6)?),
                    cached_input_tokens: to_u64(r.get(7)?),
                    cost_pico_usd: to_u64(r.get(8)?),
                })
            })
            .map_err(|e| backend(&e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn prune_usage(&self, before_unix_ms: i64) -> Result<u64, StoreError> {
        self.with(move |conn| {
            conn.execute(
                "DELETE FROM usage_records WHERE at_unix_ms < ?1",
                params![before_unix_ms],
            )
            .map(|n| n as u64)
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn revisions(
        &self,
        after_generation: u64,
        limit: u32,
    ) -> Result<Vec<Revision>, StoreError> {
        self.with(move |conn| {
            let mut st = conn
                .prepare(
                    "SELECT generation, kind, object_id, at_unix_ms FROM revisions \
                     WHERE generation > ?1 ORDER BY generation LIMIT ?2",
                )
                .map_err(|e| backend(&e))?;
            st.query_map(params![to_i64(after_generation), limit], revision)
                .map_err(|e| backend(&e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| backend(&e))
        })
        .await
    }

    async fn last_revisions(&self, kind: &str, limit: u32) -> Result<Vec<Revision>, StoreError> {
        let kind = kind.to_owned();
        self.with(move |conn| {
            // SQLite takes the bare columns of an aggregate query from the row holding the
            // MAX: the latest revision of each object.
            let mut st = conn
                .prepare(
                    "SELECT MAX(generation), kind, object_id, at_unix_ms FROM revisions \
                     WHERE kind = ?1 GROUP BY object_id ORDER BY object_id LIMIT ?2",
                )
                .map_err(|e| backend(&e))?;
            st.query_map(params![kind, limit], revision)
                .map_err(|e| backend(&e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| backend(&e))
        })
        .await
    }
}
