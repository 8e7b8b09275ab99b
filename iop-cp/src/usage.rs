//! Usage records from the Edges (issue #29): what the Control Plane keeps and how to read it.
//!
//! A managed Edge sends the usage record of every request of a principal over its session
//! (`EdgeUsageReport`, seed 001 extended: sent only to a Control Plane whose hello answer says
//! it takes them). The server stores each report in one transaction
//! ([`crate::store::Store::record_usage`]) and only then acknowledges it; the Edge keeps the
//! records in its spool until acknowledged and sends them again after a reconnect, so a record
//! may arrive twice and is stored once (by request id: unique across Edges and restarts).
//!
//! The store keeps the raw records for [`DEFAULT_RETENTION_DAYS`] ([`prune_loop`]) and a
//! rollup by UTC day, principal, model and outcome for good (`usage_daily`): the table the
//! reports read ([`crate::store::Store::usage_daily`]) does not grow with every request. A
//! record replayed after its raw row was pruned would be counted again, so the retention must
//! outlast any Edge's spool (30 days against an outage of hours).
//!
//! Read it with `iop-cp usage` (a table, or `--json`) or `GET /admin/v1/usage?since=DAY`.

use std::sync::Arc;
use std::time::Duration;

use crate::store::{DailyUsage, Store};

/// Raw usage records older than this many days are deleted (the daily rollup stays).
pub const DEFAULT_RETENTION_DAYS: u32 = 30;

/// Deletes raw usage records older than `retention_days` now and then every hour, until
/// `stop`. Failures are logged and tried again at the next round.
pub async fn prune_loop(
    store: Arc<dyn Store>,
    retention_days: u32,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        let cut = crate::store::unix_ms().saturating_sub(i64::from(retention_days) * 86_400_000);
        match store.prune_usage(cut).await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(target: "iop_cp", event = "cp_usage_pruned", records = n, retention_days, "raw usage records pruned (daily rollup kept)")
            }
            Err(e) => tracing::warn!(target: "iop_cp", error = %e, "usage pruning failed"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(3600)) => {}
        }
    }
}

/// The rollup as a fixed-width table, one line per day, principal, model and outcome, costs in
/// US dollars.
pub fn table(rows: &[DailyUsage]) -> String {
    let mut out = format!(
        "{:<10}  {:<20}  {:<24}  {:<9}  {:>9}  {:>12}  {:>12}  {:>12}  {:>12}\n",
        "day", "principal", "model", "outcome", "requests", "input", "output", "cached", "cost_usd"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<10}  {:<20}  {:<24}  {:<9}  {:>9}  {:>12}  {:>12}  {:>12}  {:>12.6}\n",
            r.day,
            r.principal_id,
            r.model,
            r.outcome,
            r.requests,
            r.input_tokens,
            r.output_tokens,
            r.cached_input_tokens,
            r.cost_pico_usd as f64 / 1e12,
        ));
    }
    out
}
