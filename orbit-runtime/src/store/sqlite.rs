//! SQLite backend (bundled rusqlite): one connection behind a mutex, calls on the blocking pool,
//! writes in `BEGIN IMMEDIATE` transactions. The statements of every signed request (the Node
//! lookup, the nonce, the heartbeat) are prepared once and kept in rusqlite's per-connection
//! statement cache; parsing their SQL again on each call was ≈ 2 % of a heartbeat's CPU.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension as _, TransactionBehavior, params};

use super::{CertRow, NodeRow, OrbitStore, Registration, StoreError, status_str, to_i64, to_u64};
use crate::versions::{ApplyStatus, advance};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS counters (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
INSERT OR IGNORE INTO counters (k, v) VALUES ('node', 0);
CREATE TABLE IF NOT EXISTS tokens (digest BLOB PRIMARY KEY, uses INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
  node_id TEXT PRIMARY KEY, edge_runtime_id TEXT NOT NULL, installation_id TEXT NOT NULL UNIQUE,
  public_key BLOB NOT NULL, fingerprint TEXT NOT NULL, reported_address TEXT, public_address TEXT,
  last_heartbeat INTEGER, current_applied INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS endpoints (node_id TEXT NOT NULL, name TEXT NOT NULL, PRIMARY KEY (node_id, name));
CREATE TABLE IF NOT EXISTS desired (node_id TEXT NOT NULL, version INTEGER NOT NULL, configurations TEXT NOT NULL, PRIMARY KEY (node_id, version));
CREATE TABLE IF NOT EXISTS results (node_id TEXT NOT NULL, version INTEGER NOT NULL, configuration_id TEXT NOT NULL, status TEXT NOT NULL, PRIMARY KEY (node_id, version, configuration_id));
CREATE TABLE IF NOT EXISTS certificates (id TEXT PRIMARY KEY, node_id TEXT NOT NULL, names TEXT NOT NULL, serial TEXT NOT NULL, not_after INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS nonces (node_id TEXT NOT NULL, nonce TEXT NOT NULL, expires_at INTEGER NOT NULL, PRIMARY KEY (node_id, nonce));
CREATE INDEX IF NOT EXISTS nonces_expiry ON nonces (expires_at);
";

/// The SQLite store.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    nonce_writes: Arc<std::sync::atomic::AtomicU64>,
}

fn backend(e: &rusqlite::Error) -> StoreError {
    tracing::debug!(error = %e, "orbit sqlite store error");
    StoreError::Unavailable
}

impl SqliteStore {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::init(Connection::open(path).map_err(|e| backend(&e))?)
    }

    /// An in-memory database (the embedded default).
    pub fn in_memory() -> Result<Self, StoreError> {
        Self::init(Connection::open_in_memory().map_err(|e| backend(&e))?)
    }

    fn init(conn: Connection) -> Result<Self, StoreError> {
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(|e| backend(&e))?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(|e| backend(&e))?;
        conn.execute_batch(SCHEMA).map_err(|e| backend(&e))?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            nonce_writes: Arc::default(),
        })
    }

    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().map_err(|_| StoreError::Unavailable)?;
            f(&mut guard)
        })
        .await
        .map_err(|_| StoreError::Unavailable)?
    }
}

fn node_row(conn: &Connection, node_id: &str) -> Result<Option<NodeRow>, StoreError> {
    let row = conn
        .prepare_cached(
            "SELECT node_id, edge_runtime_id, installation_id, public_key, fingerprint, \
             reported_address, public_address, last_heartbeat, current_applied \
             FROM nodes WHERE node_id = ?1",
        )
        .map_err(|e| backend(&e))?
        .query_row(params![node_id], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Vec<u8>>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, Option<String>>(5)?,
                r.get::<_, Option<String>>(6)?,
                r.get::<_, Option<i64>>(7)?,
                r.get::<_, i64>(8)?,
            ))
        })
        .optional()
        .map_err(|e| backend(&e))?;
    let Some((
        node_id,
        edge_runtime_id,
        installation_id,
        key,
        fingerprint,
        reported,
        public,
        hb,
        current,
    )) = row
    else {
        return Ok(None);
    };
    let mut st = conn
        .prepare_cached("SELECT name FROM endpoints WHERE node_id = ?1 ORDER BY name")
        .map_err(|e| backend(&e))?;
    let endpoints = st
        .query_map(params![node_id], |r| r.get::<_, String>(0))
        .map_err(|e| backend(&e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| backend(&e))?;
    Ok(Some(NodeRow {
        node_id,
        edge_runtime_id,
        installation_id,
        public_key: key.try_into().map_err(|_| StoreError::Unavailable)?,
        device_fingerprint_hash: fingerprint,
        reported_address: reported,
        public_address: public,
        last_heartbeat: hb,
        current_applied: to_u64(current),
        endpoints,
    }))
}

#[async_trait]
impl OrbitStore for SqliteStore {
    async fn create_token(&self, digest: [u8; 32], uses: u32) -> Result<(), StoreError> {
        self.with(move |c| {
            c.execute(
                "INSERT INTO tokens (digest, uses) VALUES (?1, ?2) \
                 ON CONFLICT (digest) DO UPDATE SET uses = excluded.uses",
                params![&digest[..], uses],
            )
            .map(|_| ())
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn consume_token(&self, digest: [u8; 32]) -> Result<bool, StoreError> {
        self.with(move |c| {
            c.execute(
                "UPDATE tokens SET uses = uses - 1 WHERE digest = ?1 AND uses > 0",
                params![&digest[..]],
            )
            .map(|n| n == 1)
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn register(&self, r: &Registration) -> Result<NodeRow, StoreError> {
        let r = r.clone();
        self.with(move |c| {
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| backend(&e))?;
            let existing: Option<String> = tx
                .query_row(
                    "SELECT node_id FROM nodes WHERE installation_id = ?1",
                    params![r.installation_id],
                    |row| row.get(0),
                )
                .optional()
                .map_err(|e| backend(&e))?;
            let node_id = match existing {
                Some(id) => {
                    tx.execute(
                        "UPDATE nodes SET public_key = ?2, fingerprint = ?3, \
                         reported_address = COALESCE(?4, reported_address), \
                         public_address = COALESCE(?5, public_address) WHERE node_id = ?1",
                        params![id, &r.public_key[..], r.device_fingerprint_hash, r.reported_address, r.public_address],
                    )
                    .map_err(|e| backend(&e))?;
                    id
                }
                None => {
                    let n: i64 = tx
                        .query_row("UPDATE counters SET v = v + 1 WHERE k = 'node' RETURNING v", [], |row| row.get(0))
                        .map_err(|e| backend(&e))?;
                    let id = format!("node-{n}");
                    tx.execute(
                        "INSERT INTO nodes (node_id, edge_runtime_id, installation_id, public_key, \
                         fingerprint, reported_address, public_address, last_heartbeat, current_applied) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, NULL, 0)",
                        params![id, format!("er-{id}"), r.installation_id, &r.public_key[..], r.device_fingerprint_hash, r.reported_address, r.public_address],
                    )
                    .map_err(|e| backend(&e))?;
                    id
                }
            };
            let row = node_row(&tx, &node_id)?.ok_or(StoreError::Unavailable)?;
            tx.commit().map_err(|e| backend(&e))?;
            Ok(row)
        })
        .await
    }

    async fn node(&self, node_id: &str) -> Result<Option<NodeRow>, StoreError> {
        let node_id = node_id.to_owned();
        self.with(move |c| node_row(c, &node_id)).await
    }

    async fn heartbeat(
        &self,
        node_id: &str,
        at: i64,
        reported: Option<&str>,
        public: Option<&str>,
    ) -> Result<Option<bool>, StoreError> {
        let (node_id, reported, public) = (
            node_id.to_owned(),
            reported.map(str::to_owned),
            public.map(str::to_owned),
        );
        self.with(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| backend(&e))?;
            let old: Option<Option<String>> = tx
                .prepare_cached("SELECT reported_address FROM nodes WHERE node_id = ?1")
                .and_then(|mut st| st.query_row(params![node_id], |r| r.get(0)))
                .optional()
                .map_err(|e| backend(&e))?;
            let Some(old) = old else { return Ok(None) };
            let changed = reported.as_ref().is_some_and(|r| old.as_ref() != Some(r));
            tx.prepare_cached(
                "UPDATE nodes SET last_heartbeat = ?2, reported_address = COALESCE(?3, reported_address), \
                 public_address = COALESCE(?4, public_address) WHERE node_id = ?1",
            )
            .and_then(|mut st| st.execute(params![node_id, at, reported, public]))
            .map_err(|e| backend(&e))?;
            tx.commit().map_err(|e| backend(&e))?;
            Ok(Some(changed))
        })
        .await
    }

    async fn add_endpoint(&self, node_id: &str, name: &str) -> Result<bool, StoreError> {
        let (node_id, name) = (node_id.to_owned(), name.to_owned());
        self.with(move |c| {
            let exists = c
                .query_row(
                    "SELECT 1 FROM nodes WHERE node_id = ?1",
                    params![node_id],
                    |_| Ok(()),
                )
                .optional()
                .map_err(|e| backend(&e))?
                .is_some();
            if !exists {
                return Ok(false);
            }
            c.execute(
                "INSERT INTO endpoints (node_id, name) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                params![node_id, name],
            )
            .map_err(|e| backend(&e))?;
            Ok(true)
        })
        .await
    }

    async fn publish(
        &self,
        node_id: &str,
        version: u64,
        configurations: &str,
    ) -> Result<bool, StoreError> {
        let (node_id, configurations) = (node_id.to_owned(), configurations.to_owned());
        self.with(move |c| {
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| backend(&e))?;
            let exists = tx
                .query_row(
                    "SELECT 1 FROM nodes WHERE node_id = ?1",
                    params![node_id],
                    |_| Ok(()),
                )
                .optional()
                .map_err(|e| backend(&e))?
                .is_some();
            let latest: Option<i64> = tx
                .query_row(
                    "SELECT MAX(version) FROM desired WHERE node_id = ?1",
                    params![node_id],
                    |r| r.get(0),
                )
                .map_err(|e| backend(&e))?;
            if !exists || latest.is_some_and(|l| l >= to_i64(version)) {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO desired (node_id, version, configurations) VALUES (?1, ?2, ?3)",
                params![node_id, to_i64(version), configurations],
            )
            .map_err(|e| backend(&e))?;
            tx.commit().map_err(|e| backend(&e))?;
            Ok(true)
        })
        .await
    }

    async fn latest(&self, node_id: &str) -> Result<Option<(u64, String)>, StoreError> {
        let node_id = node_id.to_owned();
        self.with(move |c| {
            c.query_row(
                "SELECT version, configurations FROM desired WHERE node_id = ?1 ORDER BY version DESC LIMIT 1",
                params![node_id],
                |r| Ok((to_u64(r.get::<_, i64>(0)?), r.get::<_, String>(1)?)),
            )
            .optional()
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn configurations(
        &self,
        node_id: &str,
        version: u64,
    ) -> Result<Option<String>, StoreError> {
        let node_id = node_id.to_owned();
        self.with(move |c| {
            c.query_row(
                "SELECT configurations FROM desired WHERE node_id = ?1 AND version = ?2",
                params![node_id, to_i64(version)],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn apply_results(
        &self,
        node_id: &str,
        version: u64,
        ids: &[String],
        results: &[(String, ApplyStatus)],
    ) -> Result<Option<u64>, StoreError> {
        let (node_id, ids, results) = (node_id.to_owned(), ids.to_vec(), results.to_vec());
        self.with(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).map_err(|e| backend(&e))?;
            let known = tx
                .query_row("SELECT 1 FROM desired WHERE node_id = ?1 AND version = ?2", params![node_id, to_i64(version)], |_| Ok(()))
                .optional()
                .map_err(|e| backend(&e))?
                .is_some();
            if !known {
                return Ok(None);
            }
            for (id, status) in results.iter().filter(|(id, _)| ids.contains(id)) {
                tx.execute(
                    "INSERT INTO results (node_id, version, configuration_id, status) VALUES (?1, ?2, ?3, ?4) \
                     ON CONFLICT (node_id, version, configuration_id) DO UPDATE SET status = excluded.status",
                    params![node_id, to_i64(version), id, status_str(*status)],
                )
                .map_err(|e| backend(&e))?;
            }
            let mut st = tx
                .prepare("SELECT configuration_id, status FROM results WHERE node_id = ?1 AND version = ?2")
                .map_err(|e| backend(&e))?;
            let recorded: BTreeMap<String, ApplyStatus> = st
                .query_map(params![node_id, to_i64(version)], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                .map_err(|e| backend(&e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| backend(&e))?
                .into_iter()
                .filter_map(|(id, s)| ApplyStatus::parse(&s).map(|s| (id, s)))
                .collect();
            drop(st);
            let current: i64 = tx
                .query_row("SELECT current_applied FROM nodes WHERE node_id = ?1", params![node_id], |r| r.get(0))
                .map_err(|e| backend(&e))?;
            let next = advance(to_u64(current), version, &ids, &recorded);
            tx.execute("UPDATE nodes SET current_applied = ?2 WHERE node_id = ?1", params![node_id, to_i64(next)])
                .map_err(|e| backend(&e))?;
            tx.commit().map_err(|e| backend(&e))?;
            Ok(Some(next))
        })
        .await
    }

    async fn add_certificate(&self, node_id: &str, cert: &CertRow) -> Result<(), StoreError> {
        let (node_id, cert) = (node_id.to_owned(), cert.clone());
        self.with(move |c| {
            c.execute(
                "INSERT INTO certificates (id, node_id, names, serial, not_after) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![cert.id, node_id, cert.names.join(","), cert.serial, cert.not_after],
            )
            .map(|_| ())
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn certificates(&self, node_id: &str) -> Result<Vec<CertRow>, StoreError> {
        let node_id = node_id.to_owned();
        self.with(move |c| {
            let mut st = c
                .prepare("SELECT id, names, serial, not_after FROM certificates WHERE node_id = ?1 ORDER BY id")
                .map_err(|e| backend(&e))?;
            st.query_map(params![node_id], |r| {
                Ok(CertRow {
                    id: r.get(0)?,
                    names: r.get::<_, String>(1)?.split(',').map(str::to_owned).collect(),
                    serial: r.get(2)?,
                    not_after: r.get(3)?,
                })
            })
            .map_err(|e| backend(&e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| backend(&e))
        })
        .await
    }

    async fn heartbeat_with_nonce(
        &self,
        h: &super::SignedHeartbeat<'_>,
    ) -> Result<Option<super::HeartbeatOutcome>, StoreError> {
        let (node_id, nonce, reported, public) = (
            h.node_id.to_owned(),
            h.nonce.to_owned(),
            h.reported_address.map(str::to_owned),
            h.public_address.map(str::to_owned),
        );
        let (expires_at, now, at) = (h.nonce_expires_at, h.now, h.at);
        let purge = super::purge_due(&self.nonce_writes);
        self.with(move |c| {
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| backend(&e))?;
            if purge {
                tx.execute("DELETE FROM nonces WHERE expires_at < ?1", params![now])
                    .map_err(|e| backend(&e))?;
            }
            let fresh = tx
                .prepare_cached(super::RECORD_NONCE_SQLITE)
                .and_then(|mut st| st.execute(params![node_id, nonce, expires_at, now]))
                .map_err(|e| backend(&e))?
                == 1;
            if !fresh {
                tx.commit().map_err(|e| backend(&e))?;
                return Ok(Some(super::HeartbeatOutcome::Replayed));
            }
            let old: Option<Option<String>> = tx
                .prepare_cached("SELECT reported_address FROM nodes WHERE node_id = ?1")
                .and_then(|mut st| st.query_row(params![node_id], |r| r.get(0)))
                .optional()
                .map_err(|e| backend(&e))?;
            let Some(old) = old else {
                // Unknown Node: the nonce is not kept either.
                return Ok(None);
            };
            let changed = reported.as_ref().is_some_and(|r| old.as_ref() != Some(r));
            tx.prepare_cached(
                "UPDATE nodes SET last_heartbeat = ?2, reported_address = COALESCE(?3, reported_address), \
                 public_address = COALESCE(?4, public_address) WHERE node_id = ?1",
            )
            .and_then(|mut st| st.execute(params![node_id, at, reported, public]))
            .map_err(|e| backend(&e))?;
            tx.commit().map_err(|e| backend(&e))?;
            Ok(Some(super::HeartbeatOutcome::Recorded { changed }))
        })
        .await
    }

    async fn record_nonce(
        &self,
        node_id: &str,
        nonce: &str,
        expires_at: i64,
        now: i64,
    ) -> Result<bool, StoreError> {
        let (node_id, nonce) = (node_id.to_owned(), nonce.to_owned());
        let purge = super::purge_due(&self.nonce_writes);
        self.with(move |c| {
            if purge {
                c.execute("DELETE FROM nonces WHERE expires_at < ?1", params![now])
                    .map_err(|e| backend(&e))?;
            }
            c.prepare_cached(super::RECORD_NONCE_SQLITE)
                .and_then(|mut st| st.execute(params![node_id, nonce, expires_at, now]))
                .map(|n| n == 1)
                .map_err(|e| backend(&e))
        })
        .await
    }
}
