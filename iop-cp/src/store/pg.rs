//! PostgreSQL backend (tokio-postgres) for several Control Plane replicas sharing one
//! database. Every mutation first takes the generation row lock (`UPDATE meta … RETURNING`),
//! so mutations from all replicas serialize and each generation names one committed state;
//! reads run in `REPEATABLE READ` transactions (one snapshot).
//!
//! The connection is plain TCP (`NoTls`): run PostgreSQL on loopback or a private network.
//! TLS to PostgreSQL is not implemented yet.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::{Mutex, Notify};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, IsolationLevel, NoTls, Row, Transaction};

use super::{
    DailyUsage, IssuerKey, LeaseView, Mutation, Principal, Revision, Route, Slot, Snapshot, Store,
    StoreError, Token, UsageRecord, UsageStored, digest_array, to_i64, to_u64, unix_ms,
};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v BIGINT NOT NULL);
INSERT INTO meta (k, v) VALUES ('generation', 1) ON CONFLICT (k) DO NOTHING;
CREATE TABLE IF NOT EXISTS principals (
  id TEXT PRIMARY KEY, display_name TEXT NOT NULL, enabled BOOLEAN NOT NULL, limits TEXT);
-- Migrations of stores made by older releases (each a no-op when already applied).
ALTER TABLE principals ADD COLUMN IF NOT EXISTS limits TEXT;
CREATE TABLE IF NOT EXISTS tokens (
  id TEXT PRIMARY KEY, principal_id TEXT NOT NULL REFERENCES principals(id),
  digest BYTEA NOT NULL UNIQUE, revoked BOOLEAN NOT NULL);
CREATE TABLE IF NOT EXISTS slots (
  id TEXT PRIMARY KEY, profile TEXT NOT NULL, header_name TEXT NOT NULL,
  header_prefix TEXT NOT NULL, sealed BYTEA NOT NULL, revision BIGINT NOT NULL,
  enabled BOOLEAN NOT NULL);
CREATE TABLE IF NOT EXISTS routes (
  id TEXT PRIMARY KEY, principal_id TEXT NOT NULL REFERENCES principals(id),
  model TEXT NOT NULL, slot_id TEXT NOT NULL REFERENCES slots(id), profile TEXT NOT NULL,
  upstream_target TEXT NOT NULL, selector TEXT NOT NULL, revision BIGINT NOT NULL,
  enabled BOOLEAN NOT NULL, UNIQUE (principal_id, model));
CREATE TABLE IF NOT EXISTS issuer_keys (
  id TEXT PRIMARY KEY, sealed BYTEA NOT NULL, active BOOLEAN NOT NULL,
  activates_at_unix_ms BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS revisions (
  generation BIGINT PRIMARY KEY, kind TEXT NOT NULL, object_id TEXT NOT NULL,
  at_unix_ms BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS usage_records (
  request_id TEXT PRIMARY KEY, at_unix_ms BIGINT NOT NULL, day TEXT NOT NULL,
  edge_id TEXT NOT NULL, principal_id TEXT NOT NULL, model TEXT NOT NULL,
  provider TEXT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  cached_input_tokens BIGINT NOT NULL, estimated BOOLEAN NOT NULL,
  cost_pico_usd BIGINT NOT NULL, outcome TEXT NOT NULL, duration_us BIGINT NOT NULL,
  first_byte_us BIGINT NOT NULL, added_us BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS usage_records_at ON usage_records(at_unix_ms);
CREATE INDEX IF NOT EXISTS revisions_object ON revisions(kind, object_id, generation);
CREATE TABLE IF NOT EXISTS usage_daily (
  day TEXT NOT NULL, principal_id TEXT NOT NULL, model TEXT NOT NULL, outcome TEXT NOT NULL,
  requests BIGINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
  cached_input_tokens BIGINT NOT NULL, cost_pico_usd BIGINT NOT NULL,
  PRIMARY KEY (day, principal_id, model, outcome));
";

/// Advisory lock key serializing schema creation across replicas.
const SCHEMA_LOCK: i64 = 0x494f_505f_4350; // "IOP_CP"

/// The PostgreSQL store.
#[derive(Debug)]
pub struct PgStore {
    client: Mutex<Client>,
    /// Woken by the `NOTIFY` of every committed mutation, from any replica or the CLI (one
    /// waiter, the server's poller: `notify_one` keeps a wake-up that came between waits).
    changed: Arc<Notify>,
    /// `NOTIFY <channel>`, sent inside every mutation's transaction (delivered on commit).
    notify: String,
    /// The `LISTEN` connection's task (aborted with the store).
    _listener: AbortOnDrop,
}

/// Aborts the task when dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The notification channel of a deployment: one per schema, so deployments sharing a
/// database do not wake each other.
fn channel(schema: Option<&str>) -> String {
    format!("iop_cp_{}", schema.unwrap_or("public"))
}

/// Keeps a `LISTEN` connection open (reconnecting every second after a failure) and wakes
/// `changed` on each notification, and once after every reconnect (a change may have been
/// missed meanwhile).
async fn listen(url: String, channel: String, changed: Arc<Notify>) {
    loop {
        if let Ok((client, mut connection)) = tokio_postgres::connect(&url, NoTls).await {
            let messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            let wake = changed.clone();
            let reader = tokio::spawn(async move {
                futures_util::pin_mut!(messages);
                while let Some(Ok(m)) = futures_util::StreamExt::next(&mut messages).await {
                    if matches!(m, tokio_postgres::AsyncMessage::Notification(_)) {
                        wake.notify_one();
                    }
                }
            });
            let mut reader = AbortOnDrop(reader);
            // `channel` is `iop_cp_` + a checked lowercase identifier.
            if client
                .batch_execute(&format!("LISTEN {channel}"))
                .await
                .is_ok()
            {
                changed.notify_one();
                let _ = (&mut reader.0).await;
            }
            tracing::info!("postgres change listener lost its connection; reconnecting");
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

fn backend(e: &tokio_postgres::Error) -> StoreError {
    tracing::debug!(error = %e, "postgres store error");
    StoreError::Unavailable
}

fn unique(e: &tokio_postgres::Error, what: &'static str) -> StoreError {
    if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
        StoreError::Conflict(what)
    } else {
        backend(e)
    }
}

impl PgStore {
    /// Connects with a libpq-style URL (`postgres://user@127.0.0.1:5432/db`) and creates the
    /// schema if needed.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::open(url, None).await
    }

    /// As [`PgStore::connect`], with every table in `schema` (created if needed; lowercase
    /// letters, digits and `_`, at most 63 bytes). Several deployments, or tests, can share
    /// one database this way.
    pub async fn connect_with_schema(url: &str, schema: &str) -> Result<Self, StoreError> {
        let ok = !schema.is_empty()
            && schema.len() <= 63
            && schema
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !schema.as_bytes()[0].is_ascii_digit();
        if !ok {
            return Err(StoreError::Invalid("schema"));
        }
        Self::open(url, Some(schema)).await
    }

    async fn open(url: &str, schema: Option<&str>) -> Result<Self, StoreError> {
        let (mut client, connection) = tokio_postgres::connect(url, NoTls)
            .await
            .map_err(|e| backend(&e))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "postgres connection closed");
            }
        });
        let tx = client.transaction().await.map_err(|e| backend(&e))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
            .await
            .map_err(|e| backend(&e))?;
        if let Some(schema) = schema {
            // `schema` was checked to be a plain lowercase identifier above.
            tx.batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema}; SET search_path TO {schema}"
            ))
            .await
            .map_err(|e| backend(&e))?;
        }
        tx.batch_execute(SCHEMA).await.map_err(|e| backend(&e))?;
        tx.commit().await.map_err(|e| backend(&e))?;
        let changed = Arc::new(Notify::new());
        let channel = channel(schema);
        let listener = tokio::spawn(listen(url.to_owned(), channel.clone(), changed.clone()));
        Ok(Self {
            client: Mutex::new(client),
            notify: format!("NOTIFY {channel}"),
            changed,
            _listener: AbortOnDrop(listener),
        })
    }
}

async fn exists(tx: &Transaction<'_>, sql: &str, id: &str) -> Result<bool, StoreError> {
    tx.query_opt(sql, &[&id])
        .await
        .map(|r| r.is_some())
        .map_err(|e| backend(&e))
}

fn changed(n: u64, what: &'static str) -> Result<(), StoreError> {
    if n == 0 {
        Err(StoreError::NotFound(what))
    } else {
        Ok(())
    }
}

async fn apply_one(tx: &Transaction<'_>, m: &Mutation) -> Result<(), StoreError> {
    match m {
        Mutation::CreatePrincipal { id, display_name } => {
            tx.execute(
                "INSERT INTO principals (id, display_name, enabled) VALUES ($1, $2, TRUE)",
                &[id, display_name],
            )
            .await
            .map_err(|e| unique(&e, "principal"))?;
        }
        Mutation::SetPrincipalEnabled { id, enabled } => {
            let n = tx
                .execute(
                    "UPDATE principals SET enabled = $1 WHERE id = $2",
                    &[enabled, id],
                )
                .await
                .map_err(|e| backend(&e))?;
            changed(n, "principal")?;
        }
        Mutation::SetPrincipalLimits { id, limits } => {
            let text = super::limits_text(limits.as_ref());
            let n = tx
                .execute(
                    "UPDATE principals SET limits = $1 WHERE id = $2",
                    &[&text, id],
                )
                .await
                .map_err(|e| backend(&e))?;
            changed(n, "principal")?;
        }
        Mutation::CreateToken {
            id,
            principal_id,
            digest,
        } => {
            if !exists(tx, "SELECT 1 FROM principals WHERE id = $1", principal_id).await? {
                return Err(StoreError::NotFound("principal"));
            }
            tx.execute(
                "INSERT INTO tokens (id, principal_id, digest, revoked) VALUES ($1, $2, $3, FALSE)",
                &[id, principal_id, &&digest[..]],
            )
            .await
            .map_err(|e| unique(&e, "token"))?;
        }
        Mutation::RevokeToken { id } => {
            let n = tx
                .execute("UPDATE tokens SET revoked = TRUE WHERE id = $1", &[id])
                .await
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
            let other = tx
                .query_one(
                    "SELECT COUNT(*) FROM routes WHERE slot_id = $1 AND profile <> $2",
                    &[id, profile],
                )
                .await
                .map_err(|e| backend(&e))?;
            if other.get::<_, i64>(0) > 0 {
                return Err(StoreError::ProfileMismatch);
            }
            let n = tx
                .execute(
                    "UPDATE slots SET profile = $2, header_name = $3, header_prefix = $4, \
                     sealed = $5, revision = revision + 1 WHERE id = $1",
                    &[id, profile, header_name, header_prefix, sealed],
                )
                .await
                .map_err(|e| backend(&e))?;
            if n == 0 {
                tx.execute(
                    "INSERT INTO slots (id, profile, header_name, header_prefix, sealed, \
                     revision, enabled) VALUES ($1, $2, $3, $4, $5, 1, TRUE)",
                    &[id, profile, header_name, header_prefix, sealed],
                )
                .await
                .map_err(|e| unique(&e, "slot"))?;
            }
        }
        Mutation::SetSlotEnabled { id, enabled } => {
            let n = tx
                .execute(
                    "UPDATE slots SET enabled = $1 WHERE id = $2",
                    &[enabled, id],
                )
                .await
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
            if !exists(tx, "SELECT 1 FROM principals WHERE id = $1", principal_id).await? {
                return Err(StoreError::NotFound("principal"));
            }
            let profile: String = tx
                .query_opt("SELECT profile FROM slots WHERE id = $1", &[slot_id])
                .await
                .map_err(|e| backend(&e))?
                .ok_or(StoreError::NotFound("slot"))?
                .get(0);
            let n = tx
                .execute(
                    "UPDATE routes SET principal_id = $2, model = $3, slot_id = $4, profile = $5, \
                     upstream_target = $6, selector = $7, revision = revision + 1 WHERE id = $1",
                    &[
                        id,
                        principal_id,
                        model,
                        slot_id,
                        &profile,
                        upstream_target,
                        selector,
                    ],
                )
                .await
                .map_err(|e| unique(&e, "route for this principal and model"))?;
            if n == 0 {
                tx.execute(
                    "INSERT INTO routes (id, principal_id, model, slot_id, profile, \
                     upstream_target, selector, revision, enabled) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, 1, TRUE)",
                    &[
                        id,
                        principal_id,
                        model,
                        slot_id,
                        &profile,
                        upstream_target,
                        selector,
                    ],
                )
                .await
                .map_err(|e| unique(&e, "route for this principal and model"))?;
            }
        }
        Mutation::SetRouteEnabled { id, enabled } => {
            let n = tx
                .execute(
                    "UPDATE routes SET enabled = $1 WHERE id = $2",
                    &[enabled, id],
                )
                .await
                .map_err(|e| backend(&e))?;
            changed(n, "route")?;
        }
        // Serialized with every other mutation by the generation row lock taken first.
        Mutation::InstallIssuerKey { id, sealed } => {
            if exists(tx, "SELECT 1 FROM issuer_keys WHERE id = $1", id).await? {
                return Err(StoreError::Conflict("issuer key"));
            }
            if issuer_slots(tx).await?.0 {
                return Err(StoreError::Conflict("active issuer key"));
            }
            insert_issuer_key(tx, id, sealed, true, unix_ms()).await?;
        }
        Mutation::StageIssuerKey {
            id,
            sealed,
            activates_at_unix_ms,
        } => {
            if exists(tx, "SELECT 1 FROM issuer_keys WHERE id = $1", id).await? {
                return Err(StoreError::Conflict("issuer key"));
            }
            match issuer_slots(tx).await? {
                (false, _) => return Err(StoreError::NotFound("active issuer key")),
                (_, true) => return Err(StoreError::Conflict("staged issuer key")),
                (true, false) => {
                    insert_issuer_key(tx, id, sealed, false, *activates_at_unix_ms).await?;
                }
            }
        }
        Mutation::ActivateIssuerKey { id } => {
            if !exists(
                tx,
                "SELECT 1 FROM issuer_keys WHERE id = $1 AND NOT active",
                id,
            )
            .await?
            {
                return Err(StoreError::NotFound("staged issuer key"));
            }
            tx.execute("DELETE FROM issuer_keys WHERE active", &[])
                .await
                .map_err(|e| backend(&e))?;
            tx.execute(
                "UPDATE issuer_keys SET active = TRUE, activates_at_unix_ms = $2 WHERE id = $1",
                &[id, &unix_ms()],
            )
            .await
            .map_err(|e| backend(&e))?;
        }
    }
    Ok(())
}

/// Whether an active and whether a staged issuer key exist.
async fn issuer_slots(tx: &Transaction<'_>) -> Result<(bool, bool), StoreError> {
    let row = tx
        .query_one(
            "SELECT COALESCE(BOOL_OR(active), FALSE), COALESCE(BOOL_OR(NOT active), FALSE) \
             FROM issuer_keys",
            &[],
        )
        .await
        .map_err(|e| backend(&e))?;
    Ok((row.get(0), row.get(1)))
}

async fn insert_issuer_key(
    tx: &Transaction<'_>,
    id: &str,
    sealed: &[u8],
    active: bool,
    at_unix_ms: i64,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO issuer_keys (id, sealed, active, activates_at_unix_ms) VALUES ($1, $2, $3, $4)",
        &[&id, &sealed, &active, &at_unix_ms],
    )
    .await
    .map(drop)
    .map_err(|e| unique(&e, "issuer key"))
}

async fn issuer_keys(tx: &Transaction<'_>, sealed: bool) -> Result<Vec<IssuerKey>, StoreError> {
    let sql = if sealed {
        "SELECT id, sealed, active, activates_at_unix_ms FROM issuer_keys ORDER BY active DESC, id"
    } else {
        "SELECT id, ''::bytea, active, activates_at_unix_ms FROM issuer_keys \
         ORDER BY active DESC, id"
    };
    Ok(tx
        .query(sql, &[])
        .await
        .map_err(|e| backend(&e))?
        .iter()
        .map(|r| IssuerKey {
            id: r.get(0),
            sealed: r.get(1),
            active: r.get(2),
            activates_at_unix_ms: r.get(3),
        })
        .collect())
}

fn principal(r: &Row) -> Principal {
    Principal {
        id: r.get(0),
        display_name: r.get(1),
        enabled: r.get(2),
        limits: super::limits_from_text(r.get(3)),
    }
}

fn route(r: &Row) -> Route {
    Route {
        id: r.get(0),
        principal_id: r.get(1),
        model: r.get(2),
        slot_id: r.get(3),
        profile: r.get(4),
        upstream_target: r.get(5),
        selector: r.get(6),
        revision: to_u64(r.get(7)),
        enabled: r.get(8),
    }
}

fn slot(r: &Row) -> Slot {
    Slot {
        id: r.get(0),
        profile: r.get(1),
        header_name: r.get(2),
        header_prefix: r.get(3),
        sealed: r.get(4),
        revision: to_u64(r.get(5)),
        enabled: r.get(6),
    }
}

const ROUTE_COLS: &str =
    "id, principal_id, model, slot_id, profile, upstream_target, selector, revision, enabled";

async fn generation(tx: &Transaction<'_>) -> Result<u64, StoreError> {
    tx.query_one("SELECT v FROM meta WHERE k = 'generation'", &[])
        .await
        .map(|r| to_u64(r.get(0)))
        .map_err(|e| backend(&e))
}

fn revision(r: &Row) -> Revision {
    Revision {
        generation: to_u64(r.get(0)),
        kind: r.get(1),
        object_id: r.get(2),
        at_unix_ms: r.get(3),
    }
}

#[async_trait]
impl Store for PgStore {
    async fn apply(&self, mutation: Mutation) -> Result<u64, StoreError> {
        mutation.validate()?;
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.map_err(|e| backend(&e))?;
        // The row lock on the generation serializes mutations across replicas.
        let generation: i64 = tx
            .query_one(
                "UPDATE meta SET v = v + 1 WHERE k = 'generation' RETURNING v",
                &[],
            )
            .await
            .map_err(|e| backend(&e))?
            .get(0);
        apply_one(&tx, &mutation).await?;
        let (kind, object_id) = mutation.describe();
        tx.execute(
            "INSERT INTO revisions (generation, kind, object_id, at_unix_ms) VALUES ($1, $2, $3, $4)",
            &[&generation, &kind, &object_id, &unix_ms()],
        )
        .await
        .map_err(|e| backend(&e))?;
        tx.batch_execute(&self.notify)
            .await
            .map_err(|e| backend(&e))?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(to_u64(generation))
    }

    async fn wait_change(&self, limit: std::time::Duration) {
        let _ = tokio::time::timeout(limit, self.changed.notified()).await;
    }

    async fn generation(&self) -> Result<u64, StoreError> {
        let client = self.client.lock().await;
        client
            .query_one("SELECT v FROM meta WHERE k = 'generation'", &[])
            .await
            .map(|r| to_u64(r.get(0)))
            .map_err(|e| backend(&e))
    }

    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        let mut client = self.client.lock().await;
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(|e| backend(&e))?;
        let generation = generation(&tx).await?;
        let q = |sql: String| {
            let tx = &tx;
            async move { tx.query(&sql, &[]).await.map_err(|e| backend(&e)) }
        };
        let principals =
            q("SELECT id, display_name, enabled, limits FROM principals ORDER BY id".into())
                .await?
                .iter()
                .map(principal)
                .collect();
        let tokens = q("SELECT id, principal_id, digest, revoked FROM tokens ORDER BY id".into())
            .await?
            .iter()
            .map(|r| {
                Ok(Token {
                    id: r.get(0),
                    principal_id: r.get(1),
                    digest: digest_array(r.get::<_, &[u8]>(2))?,
                    revoked: r.get(3),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let slots = q(
            "SELECT id, profile, header_name, header_prefix, ''::bytea, revision, enabled \
                       FROM slots ORDER BY id"
                .into(),
        )
        .await?
        .iter()
        .map(slot)
        .collect();
        let routes = q(format!("SELECT {ROUTE_COLS} FROM routes ORDER BY id"))
            .await?
            .iter()
            .map(route)
            .collect();
        let issuer_keys = issuer_keys(&tx, false).await?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(Snapshot {
            generation,
            principals,
            tokens,
            slots,
            routes,
            issuer_keys,
        })
    }

    async fn lease_view(&self, route_id: &str, slot_id: &str) -> Result<LeaseView, StoreError> {
        let mut client = self.client.lock().await;
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(|e| backend(&e))?;
        let generation = generation(&tx).await?;
        let route = tx
            .query_opt(
                &format!("SELECT {ROUTE_COLS} FROM routes WHERE id = $1"),
                &[&route_id],
            )
            .await
            .map_err(|e| backend(&e))?
            .as_ref()
            .map(route);
        let slot = tx
            .query_opt(
                "SELECT id, profile, header_name, header_prefix, sealed, revision, enabled \
                 FROM slots WHERE id = $1",
                &[&slot_id],
            )
            .await
            .map_err(|e| backend(&e))?
            .as_ref()
            .map(slot);
        let principal = match &route {
            Some(r) => tx
                .query_opt(
                    "SELECT id, display_name, enabled, limits FROM principals WHERE id = $1",
                    &[&r.principal_id],
                )
                .await
                .map_err(|e| backend(&e))?
                .as_ref()
                .map(principal),
            None => None,
        };
        let issuer = issuer_keys(&tx, true).await?.into_iter().find(|k| k.active);
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(LeaseView {
            generation,
            route,
            slot,
            principal,
            issuer,
        })
    }

    async fn issuer_keys(&self) -> Result<Vec<IssuerKey>, StoreError> {
        let mut client = self.client.lock().await;
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(|e| backend(&e))?;
        let keys = issuer_keys(&tx, true).await?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(keys)
    }

    async fn record_usage(
        &self,
        edge_id: &str,
        records: &[UsageRecord],
    ) -> Result<UsageStored, StoreError> {
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.map_err(|e| backend(&e))?;
        let row = tx
            .prepare(
                "INSERT INTO usage_records (request_id, at_unix_ms, day, edge_id, principal_id, \
                 model, provider, input_tokens, output_tokens, cached_input_tokens, estimated, \
                 cost_pico_usd, outcome, duration_us, first_byte_us, added_us) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
                 ON CONFLICT (request_id) DO NOTHING",
            )
            .await
            .map_err(|e| backend(&e))?;
        let daily = tx
            .prepare(
                "INSERT INTO usage_daily (day, principal_id, model, outcome, requests, \
                 input_tokens, output_tokens, cached_input_tokens, cost_pico_usd) \
                 VALUES ($1, $2, $3, $4, 1, $5, $6, $7, $8) \
                 ON CONFLICT (day, principal_id, model, outcome) DO UPDATE SET \
                 requests = usage_daily.requests + 1, \
                 input_tokens = usage_daily.input_tokens + excluded.input_tokens, \
                 output_tokens = usage_daily.output_tokens + excluded.output_tokens, \
                 cached_input_tokens = usage_daily.cached_input_tokens + excluded.cached_input_tokens, \
                 cost_pico_usd = usage_daily.cost_pico_usd + excluded.cost_pico_usd",
            )
            .await
            .map_err(|e| backend(&e))?;
        let mut done = UsageStored::default();
        for r in records {
            let day = super::day_of(r.at_unix_ms);
            let (input, output, cached, cost) = (
                to_i64(r.input_tokens),
                to_i64(r.output_tokens),
                to_i64(r.cached_input_tokens),
                to_i64(r.cost_pico_usd),
            );
            let n = tx
                .execute(
                    &row,
                    &[
                        &r.request_id,
                        &r.at_unix_ms,
                        &day,
                        &edge_id,
                        &r.principal_id,
                        &r.model,
                        &r.provider,
                        &input,
                        &output,
                        &cached,
                        &r.estimated,
                        &cost,
                        &r.outcome,
                        &to_i64(r.duration_us),
                        &to_i64(r.first_byte_us),
                        &to_i64(r.added_us),
                    ],
                )
                .await
                .map_err(|e| backend(&e))?;
            if n == 0 {
                done.duplicates += 1;
                continue;
            }
            done.stored += 1;
            tx.execute(
                &daily,
                &[
                    &day,
                    &r.principal_id,
                    &r.model,
                    &r.outcome,
                    &input,
                    &output,
                    &cached,
                    &cost,
                ],
            )
            .await
            .map_err(|e| backend(&e))?;
        }
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(done)
    }

    async fn usage_daily(
        &self,
        since: Option<&str>,
        limit: u32,
    ) -> Result<Vec<DailyUsage>, StoreError> {
        let client = self.client.lock().await;
        let rows = client
            .query(
                "SELECT day, principal_id, model, outcome, requests, input_tokens, \
                 output_tokens, cached_input_tokens, cost_pico_usd FROM usage_daily \
                 WHERE day >= $1 ORDER BY day, principal_id, model, outcome LIMIT $2",
                &[&since.unwrap_or(""), &i64::from(limit)],
            )
            .await
            .map_err(|e| backend(&e))?;
        Ok(rows
            .iter()
            .map(|r| DailyUsage {
                day: r.get(0),
                principal_id: r.get(1),
                model: r.get(2),
                outcome: r.get(3),
                requests: to_u64(r.get(4)),
                input_tokens: to_u64(r.get(5)),
                output_tokens: to_u64(r.get(6)),
                cached_input_tokens: to_u64(r.get(7)),
                cost_pico_usd: to_u64(r.get(8)),
            })
            .collect())
    }

    async fn prune_usage(&self, before_unix_ms: i64) -> Result<u64, StoreError> {
        let client = self.client.lock().await;
        client
            .execute(
                "DELETE FROM usage_records WHERE at_unix_ms < $1",
                &[&before_unix_ms],
            )
            .await
            .map_err(|e| backend(&e))
    }

    async fn revisions(
        &self,
        after_generation: u64,
        limit: u32,
    ) -> Result<Vec<Revision>, StoreError> {
        let client = self.client.lock().await;
        let rows = client
            .query(
                "SELECT generation, kind, object_id, at_unix_ms FROM revisions \
                 WHERE generation > $1 ORDER BY generation LIMIT $2",
                &[&to_i64(after_generation), &i64::from(limit)],
            )
            .await
            .map_err(|e| backend(&e))?;
        Ok(rows.iter().map(revision).collect())
    }

    async fn last_revisions(&self, kind: &str, limit: u32) -> Result<Vec<Revision>, StoreError> {
        let client = self.client.lock().await;
        let rows = client
            .query(
                "SELECT DISTINCT ON (object_id) generation, kind, object_id, at_unix_ms \
                 FROM revisions WHERE kind = $1 ORDER BY object_id, generation DESC LIMIT $2",
                &[&kind, &i64::from(limit)],
            )
            .await
            .map_err(|e| backend(&e))?;
        Ok(rows.iter().map(revision).collect())
    }
}
