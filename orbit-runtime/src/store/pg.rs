//! PostgreSQL backend (tokio-postgres) for several control plane replicas. Registrations
//! serialize on the node counter's row lock; apply results run in one transaction with the
//! advance of the current version. Plain TCP (`NoTls`): loopback or a private network.

use std::collections::BTreeMap;

use async_trait::async_trait;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls, Row};

use super::{CertRow, NodeRow, OrbitStore, Registration, StoreError, status_str, to_i64, to_u64};
use crate::versions::{ApplyStatus, advance};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS counters (k TEXT PRIMARY KEY, v BIGINT NOT NULL);
INSERT INTO counters (k, v) VALUES ('node', 0) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS tokens (digest BYTEA PRIMARY KEY, uses BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
  node_id TEXT PRIMARY KEY, edge_runtime_id TEXT NOT NULL, installation_id TEXT NOT NULL UNIQUE,
  public_key BYTEA NOT NULL, fingerprint TEXT NOT NULL, reported_address TEXT, public_address TEXT,
  last_heartbeat BIGINT, current_applied BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS endpoints (node_id TEXT NOT NULL, name TEXT NOT NULL, PRIMARY KEY (node_id, name));
CREATE TABLE IF NOT EXISTS desired (node_id TEXT NOT NULL, version BIGINT NOT NULL, configurations TEXT NOT NULL, PRIMARY KEY (node_id, version));
CREATE TABLE IF NOT EXISTS results (node_id TEXT NOT NULL, version BIGINT NOT NULL, configuration_id TEXT NOT NULL, status TEXT NOT NULL, PRIMARY KEY (node_id, version, configuration_id));
CREATE TABLE IF NOT EXISTS certificates (id TEXT PRIMARY KEY, node_id TEXT NOT NULL, names TEXT NOT NULL, serial TEXT NOT NULL, not_after BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS nonces (node_id TEXT NOT NULL, nonce TEXT NOT NULL, expires_at BIGINT NOT NULL, PRIMARY KEY (node_id, nonce));
CREATE INDEX IF NOT EXISTS nonces_expiry ON nonces (expires_at);
";

const SCHEMA_LOCK: i64 = 0x004f_5242_4954; // "ORBIT"

/// The PostgreSQL store.
#[derive(Debug)]
pub struct PgStore {
    client: Mutex<Client>,
    nonce_writes: std::sync::atomic::AtomicU64,
}

fn backend(e: &tokio_postgres::Error) -> StoreError {
    tracing::debug!(error = %e, "orbit postgres store error");
    StoreError::Unavailable
}

impl PgStore {
    /// Connects; tables go in `schema` (lowercase letters, digits, `_`), created if needed.
    pub async fn connect(url: &str, schema: &str) -> Result<Self, StoreError> {
        let ok = !schema.is_empty()
            && schema.len() <= 63
            && schema
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !schema.as_bytes()[0].is_ascii_digit();
        if !ok {
            return Err(StoreError::Unavailable);
        }
        let (mut client, connection) = tokio_postgres::connect(url, NoTls)
            .await
            .map_err(|e| backend(&e))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "orbit postgres connection closed");
            }
        });
        let tx = client.transaction().await.map_err(|e| backend(&e))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
            .await
            .map_err(|e| backend(&e))?;
        tx.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {schema}; SET search_path TO {schema}"
        ))
        .await
        .map_err(|e| backend(&e))?;
        tx.batch_execute(SCHEMA).await.map_err(|e| backend(&e))?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(Self {
            client: Mutex::new(client),
            nonce_writes: std::sync::atomic::AtomicU64::new(0),
        })
    }
}

fn row_to_node(r: &Row, endpoints: Vec<String>) -> Result<NodeRow, StoreError> {
    let key: Vec<u8> = r.get(3);
    Ok(NodeRow {
        node_id: r.get(0),
        edge_runtime_id: r.get(1),
        installation_id: r.get(2),
        public_key: key.try_into().map_err(|_| StoreError::Unavailable)?,
        device_fingerprint_hash: r.get(4),
        reported_address: r.get(5),
        public_address: r.get(6),
        last_heartbeat: r.get(7),
        current_applied: to_u64(r.get(8)),
        endpoints,
    })
}

async fn node_row(
    c: &impl tokio_postgres::GenericClient,
    node_id: &str,
) -> Result<Option<NodeRow>, StoreError> {
    let Some(row) = c
        .query_opt(
            "SELECT node_id, edge_runtime_id, installation_id, public_key, fingerprint, \
             reported_address, public_address, last_heartbeat, current_applied FROM nodes WHERE node_id = $1",
            &[&node_id],
        )
        .await
        .map_err(|e| backend(&e))?
    else {
        return Ok(None);
    };
    let endpoints = c
        .query(
            "SELECT name FROM endpoints WHERE node_id = $1 ORDER BY name",
            &[&node_id],
        )
        .await
        .map_err(|e| backend(&e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    row_to_node(&row, endpoints).map(Some)
}

#[async_trait]
impl OrbitStore for PgStore {
    async fn create_token(&self, digest: [u8; 32], uses: u32) -> Result<(), StoreError> {
        let c = self.client.lock().await;
        c.execute(
            "INSERT INTO tokens (digest, uses) VALUES ($1, $2) ON CONFLICT (digest) DO UPDATE SET uses = excluded.uses",
            &[&&digest[..], &i64::from(uses)],
        )
        .await
        .map(|_| ())
        .map_err(|e| backend(&e))
    }

    async fn consume_token(&self, digest: [u8; 32]) -> Result<bool, StoreError> {
        let c = self.client.lock().await;
        c.execute(
            "UPDATE tokens SET uses = uses - 1 WHERE digest = $1 AND uses > 0",
            &[&&digest[..]],
        )
        .await
        .map(|n| n == 1)
        .map_err(|e| backend(&e))
    }

    async fn register(&self, r: &Registration) -> Result<NodeRow, StoreError> {
        let mut c = self.client.lock().await;
        let tx = c.transaction().await.map_err(|e| backend(&e))?;
        // The counter's row lock serializes registrations across replicas.
        let counter: i64 = tx
            .query_one(
                "UPDATE counters SET v = v WHERE k = 'node' RETURNING v",
                &[],
            )
            .await
            .map_err(|e| backend(&e))?
            .get(0);
        let existing = tx
            .query_opt(
                "SELECT node_id FROM nodes WHERE installation_id = $1",
                &[&r.installation_id],
            )
            .await
            .map_err(|e| backend(&e))?;
        let key = &r.public_key[..];
        let node_id: String = match existing {
            Some(row) => {
                let id: String = row.get(0);
                tx.execute(
                    "UPDATE nodes SET public_key = $2, fingerprint = $3, \
                     reported_address = COALESCE($4, reported_address), \
                     public_address = COALESCE($5, public_address) WHERE node_id = $1",
                    &[
                        &id,
                        &key,
                        &r.device_fingerprint_hash,
                        &r.reported_address,
                        &r.public_address,
                    ],
                )
                .await
                .map_err(|e| backend(&e))?;
                id
            }
            None => {
                let n = counter + 1;
                tx.execute("UPDATE counters SET v = $1 WHERE k = 'node'", &[&n])
                    .await
                    .map_err(|e| backend(&e))?;
                let id = format!("node-{n}");
                tx.execute(
                    "INSERT INTO nodes (node_id, edge_runtime_id, installation_id, public_key, fingerprint, \
                     reported_address, public_address, last_heartbeat, current_applied) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, 0)",
                    &[&id, &format!("er-{id}"), &r.installation_id, &key, &r.device_fingerprint_hash, &r.reported_address, &r.public_address],
                )
                .await
                .map_err(|e| backend(&e))?;
                id
            }
        };
        let row = node_row(&tx, &node_id)
            .await?
            .ok_or(StoreError::Unavailable)?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(row)
    }

    async fn node(&self, node_id: &str) -> Result<Option<NodeRow>, StoreError> {
        let c = self.client.lock().await;
        node_row(&*c, node_id).await
    }

    async fn heartbeat(
        &self,
        node_id: &str,
        at: i64,
        reported: Option<&str>,
        public: Option<&str>,
    ) -> Result<Option<bool>, StoreError> {
        let mut c = self.client.lock().await;
        let tx = c.transaction().await.map_err(|e| backend(&e))?;
        let Some(old) = tx
            .query_opt(
                "SELECT reported_address FROM nodes WHERE node_id = $1 FOR UPDATE",
                &[&node_id],
            )
            .await
            .map_err(|e| backend(&e))?
        else {
            return Ok(None);
        };
        let old: Option<String> = old.get(0);
        let changed = reported.is_some_and(|r| old.as_deref() != Some(r));
        tx.execute(
            "UPDATE nodes SET last_heartbeat = $2, reported_address = COALESCE($3, reported_address), \
             public_address = COALESCE($4, public_address) WHERE node_id = $1",
            &[&node_id, &at, &reported, &public],
        )
        .await
        .map_err(|e| backend(&e))?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(Some(changed))
    }

    async fn add_endpoint(&self, node_id: &str, name: &str) -> Result<bool, StoreError> {
        let c = self.client.lock().await;
        if c.query_opt("SELECT 1 FROM nodes WHERE node_id = $1", &[&node_id])
            .await
            .map_err(|e| backend(&e))?
            .is_none()
        {
            return Ok(false);
        }
        c.execute(
            "INSERT INTO endpoints (node_id, name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&node_id, &name],
        )
        .await
        .map_err(|e| backend(&e))?;
        Ok(true)
    }

    async fn publish(
        &self,
        node_id: &str,
        version: u64,
        configurations: &str,
    ) -> Result<bool, StoreError> {
        let mut c = self.client.lock().await;
        let tx = c.transaction().await.map_err(|e| backend(&e))?;
        if tx
            .query_opt(
                "SELECT 1 FROM nodes WHERE node_id = $1 FOR UPDATE",
                &[&node_id],
            )
            .await
            .map_err(|e| backend(&e))?
            .is_none()
        {
            return Ok(false);
        }
        let latest: Option<i64> = tx
            .query_one(
                "SELECT MAX(version) FROM desired WHERE node_id = $1",
                &[&node_id],
            )
            .await
            .map_err(|e| backend(&e))?
            .get(0);
        if latest.is_some_and(|l| l >= to_i64(version)) {
            return Ok(false);
        }
        tx.execute(
            "INSERT INTO desired (node_id, version, configurations) VALUES ($1, $2, $3)",
            &[&node_id, &to_i64(version), &configurations],
        )
        .await
        .map_err(|e| backend(&e))?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(true)
    }

    async fn latest(&self, node_id: &str) -> Result<Option<(u64, String)>, StoreError> {
        let c = self.client.lock().await;
        Ok(c
            .query_opt(
                "SELECT version, configurations FROM desired WHERE node_id = $1 ORDER BY version DESC LIMIT 1",
                &[&node_id],
            )
            .await
            .map_err(|e| backend(&e))?
            .map(|r| (to_u64(r.get(0)), r.get(1))))
    }

    async fn configurations(
        &self,
        node_id: &str,
        version: u64,
    ) -> Result<Option<String>, StoreError> {
        let c = self.client.lock().await;
        Ok(c.query_opt(
            "SELECT configurations FROM desired WHERE node_id = $1 AND version = $2",
            &[&node_id, &to_i64(version)],
        )
        .await
        .map_err(|e| backend(&e))?
        .map(|r| r.get(0)))
    }

    async fn apply_results(
        &self,
        node_id: &str,
        version: u64,
        ids: &[String],
        results: &[(String, ApplyStatus)],
    ) -> Result<Option<u64>, StoreError> {
        let mut c = self.client.lock().await;
        let tx = c.transaction().await.map_err(|e| backend(&e))?;
        let v = to_i64(version);
        if tx
            .query_opt(
                "SELECT 1 FROM desired WHERE node_id = $1 AND version = $2",
                &[&node_id, &v],
            )
            .await
            .map_err(|e| backend(&e))?
            .is_none()
        {
            return Ok(None);
        }
        let current: i64 = tx
            .query_one(
                "SELECT current_applied FROM nodes WHERE node_id = $1 FOR UPDATE",
                &[&node_id],
            )
            .await
            .map_err(|e| backend(&e))?
            .get(0);
        for (id, status) in results.iter().filter(|(id, _)| ids.contains(id)) {
            tx.execute(
                "INSERT INTO results (node_id, version, configuration_id, status) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (node_id, version, configuration_id) DO UPDATE SET status = excluded.status",
                &[&node_id, &v, id, &status_str(*status)],
            )
            .await
            .map_err(|e| backend(&e))?;
        }
        let recorded: BTreeMap<String, ApplyStatus> = tx
            .query(
                "SELECT configuration_id, status FROM results WHERE node_id = $1 AND version = $2",
                &[&node_id, &v],
            )
            .await
            .map_err(|e| backend(&e))?
            .iter()
            .filter_map(|r| {
                ApplyStatus::parse(r.get::<_, &str>(1)).map(|s| (r.get::<_, String>(0), s))
            })
            .collect();
        let next = advance(to_u64(current), version, ids, &recorded);
        tx.execute(
            "UPDATE nodes SET current_applied = $2 WHERE node_id = $1",
            &[&node_id, &to_i64(next)],
        )
        .await
        .map_err(|e| backend(&e))?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(Some(next))
    }

    async fn add_certificate(&self, node_id: &str, cert: &CertRow) -> Result<(), StoreError> {
        let c = self.client.lock().await;
        c.execute(
            "INSERT INTO certificates (id, node_id, names, serial, not_after) VALUES ($1, $2, $3, $4, $5)",
            &[&cert.id, &node_id, &cert.names.join(","), &cert.serial, &cert.not_after],
        )
        .await
        .map(|_| ())
        .map_err(|e| backend(&e))
    }

    async fn certificates(&self, node_id: &str) -> Result<Vec<CertRow>, StoreError> {
        let c = self.client.lock().await;
        Ok(c.query(
            "SELECT id, names, serial, not_after FROM certificates WHERE node_id = $1 ORDER BY id",
            &[&node_id],
        )
        .await
        .map_err(|e| backend(&e))?
        .iter()
        .map(|r| CertRow {
            id: r.get(0),
            names: r
                .get::<_, String>(1)
                .split(',')
                .map(str::to_owned)
                .collect(),
            serial: r.get(2),
            not_after: r.get(3),
        })
        .collect())
    }

    async fn heartbeat_with_nonce(
        &self,
        h: &super::SignedHeartbeat<'_>,
    ) -> Result<Option<super::HeartbeatOutcome>, StoreError> {
        let mut c = self.client.lock().await;
        let purge = super::purge_due(&self.nonce_writes);
        let tx = c.transaction().await.map_err(|e| backend(&e))?;
        if purge {
            tx.execute("DELETE FROM nonces WHERE expires_at < $1", &[&h.now])
                .await
                .map_err(|e| backend(&e))?;
        }
        let fresh = tx
            .execute(
                super::RECORD_NONCE_PG,
                &[&h.node_id, &h.nonce, &h.nonce_expires_at, &h.now],
            )
            .await
            .map_err(|e| backend(&e))?
            == 1;
        if !fresh {
            tx.commit().await.map_err(|e| backend(&e))?;
            return Ok(Some(super::HeartbeatOutcome::Replayed));
        }
        let Some(old) = tx
            .query_opt(
                "SELECT reported_address FROM nodes WHERE node_id = $1 FOR UPDATE",
                &[&h.node_id],
            )
            .await
            .map_err(|e| backend(&e))?
        else {
            // Unknown Node: the nonce is not kept either (the transaction rolls back).
            return Ok(None);
        };
        let old: Option<String> = old.get(0);
        let changed = h
            .reported_address
            .is_some_and(|r| old.as_deref() != Some(r));
        tx.execute(
            "UPDATE nodes SET last_heartbeat = $2, reported_address = COALESCE($3, reported_address), \
             public_address = COALESCE($4, public_address) WHERE node_id = $1",
            &[&h.node_id, &h.at, &h.reported_address, &h.public_address],
        )
        .await
        .map_err(|e| backend(&e))?;
        tx.commit().await.map_err(|e| backend(&e))?;
        Ok(Some(super::HeartbeatOutcome::Recorded { changed }))
    }

    async fn record_nonce(
        &self,
        node_id: &str,
        nonce: &str,
        expires_at: i64,
        now: i64,
    ) -> Result<bool, StoreError> {
        let c = self.client.lock().await;
        if super::purge_due(&self.nonce_writes) {
            c.execute("DELETE FROM nonces WHERE expires_at < $1", &[&now])
                .await
                .map_err(|e| backend(&e))?;
        }
        c.execute(
            super::RECORD_NONCE_PG,
            &[&node_id, &nonce, &expires_at, &now],
        )
        .await
        .map(|n| n == 1)
        .map_err(|e| backend(&e))
    }
}
