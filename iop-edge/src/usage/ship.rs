//! Usage records to the Control Plane (managed mode): the spool and its shipper.
//!
//! The spool is the Edge's usage file ([`super::SqliteUsage`] opened with
//! [`super::UsageConfig::ship`]): every record is written there first, marked not shipped, off
//! the request path. [`ship`] sends the oldest ones in reports of at most
//! [`MAX_USAGE_RECORDS`] on the Control Plane session, one report at a time, and marks them
//! shipped only once the Control Plane acknowledged the report (it acknowledges after its
//! commit). So:
//!
//! - **Nothing lost while the Control Plane is away**: records wait in the file, across Edge
//!   restarts too, and go when a session that takes usage comes back (a Control Plane from
//!   before usage records never says so, and then the records just wait).
//! - **Nothing counted twice**: a report whose acknowledgement was lost (the session ended,
//!   the Edge was killed) is sent again, and the Control Plane stores each request id once.
//! - **Reports fit the Control Plane's frame**: a report larger than the frame the Control
//!   Plane reads (its hello answer says how large) is not sent; the shipper sends as many
//!   records as fit (`ControlSessionError::UsageReportTooLarge`), and doubles the count again
//!   after each acknowledgement, up to [`MAX_USAGE_RECORDS`]. A record that alone does not fit
//!   (a Control Plane reading frames under a kilobyte; `iop-cp serve` reads 8 MiB) waits for
//!   another session once, then stays in the local file only, counted as unshippable, so
//!   that the records behind it go.
//! - **Bounded**: at most [`super::UsageConfig::spool_max`] records wait; past it the newest
//!   are dropped, counted (`iop_edge_usage_spool_dropped_total`) and logged every 10 s at most.
//!   Records the wire cannot carry (an id or model outside its rules: not possible from the
//!   Edge's own keys and models) stay in the file only, counted
//!   (`iop_edge_usage_unshippable_total`).

use std::sync::Arc;
use std::time::Duration;

use iop_wire::control::{EdgeUsageReport, MAX_USAGE_RECORDS, UsageRecord as WireRecord};
use tokio_util::sync::CancellationToken;

use super::{UsageRecord, UsageSink};
use crate::control::{ControlConnector, UsageReportError};

/// The wire form of a record (the key is the principal in managed mode).
pub fn wire_record(r: &UsageRecord) -> WireRecord {
    WireRecord {
        request_id: r.request_id.clone(),
        at_unix_ms: i64::try_from(r.at_ms).unwrap_or(i64::MAX),
        principal_id: r.key.clone(),
        model: r.model.clone(),
        provider: r.provider.clone(),
        input_tokens: r.input_tokens,
        output_tokens: r.output_tokens,
        cached_input_tokens: r.cached_input_tokens.min(r.input_tokens),
        estimated: r.estimated,
        cost_pico_usd: r.cost_pusd,
        outcome: r.outcome.as_str().to_owned(),
        duration_us: r.duration_us,
        first_byte_us: r.first_byte_us,
        added_us: r.added_us,
    }
}

/// Sends `sink`'s spool to the Control Plane through `control` until `stop` (module docs).
/// Returns at once when the sink keeps no spool.
pub async fn ship(sink: Arc<dyn UsageSink>, control: ControlConnector, stop: CancellationToken) {
    let Some(notify) = sink.spool_notify() else {
        return;
    };
    let mut state = control.state();
    // Fewer when the Control Plane reads smaller frames than a full report takes.
    let mut batch_max = MAX_USAGE_RECORDS;
    // The oldest record, when it alone did not fit the Control Plane's frame.
    let mut stuck: Option<String> = None;
    loop {
        if stop.is_cancelled() {
            return;
        }
        if !control.accepts_usage() {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = state.changed() => {}
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            continue;
        }
        let s = Arc::clone(&sink);
        let batch = tokio::task::spawn_blocking(move || s.unshipped(batch_max))
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        if batch.is_empty() {
            tokio::select! {
                () = stop.cancelled() => return,
                () = notify.notified() => {}
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
            continue;
        }
        let (records, unshippable): (Vec<WireRecord>, Vec<WireRecord>) = batch
            .iter()
            .map(wire_record)
            .partition(|r| r.check().is_ok());
        if !unshippable.is_empty() {
            tracing::warn!(
                records = unshippable.len(),
                "usage records the control wire cannot carry are kept in the local file only"
            );
            sink.unshippable(unshippable.len() as u64);
            let ids: Vec<String> = unshippable.into_iter().map(|r| r.request_id).collect();
            let s = Arc::clone(&sink);
            let _ = tokio::task::spawn_blocking(move || s.shipped(&ids)).await;
        }
        if records.is_empty() {
            continue;
        }
        let ids: Vec<String> = records.iter().map(|r| r.request_id.clone()).collect();
        match control.report_usage(EdgeUsageReport { records }).await {
            Err(UsageReportError::TooLarge { fit: 0 }) if stuck.as_deref() == Some(&ids[0]) => {
                // Still too large for the Control Plane's frame after a wait (its limit is
                // under a kilobyte; `iop-cp serve` reads 8 MiB): kept in the local file only,
                // so that the records behind it go.
                tracing::warn!(
                    "a usage record larger than the control plane's frame is kept in the local file only"
                );
                sink.unshippable(1);
                let first = vec![ids[0].clone()];
                let s = Arc::clone(&sink);
                let _ = tokio::task::spawn_blocking(move || s.shipped(&first)).await;
                stuck = None;
            }
            Err(UsageReportError::TooLarge { fit: 0 }) => {
                // The oldest record alone does not fit: wait once for another session (a
                // Control Plane restarted with a larger frame) before giving up on it.
                stuck = Some(ids[0].clone());
                batch_max = MAX_USAGE_RECORDS;
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = state.changed() => {}
                    () = tokio::time::sleep(Duration::from_secs(30)) => {}
                }
            }
            Err(UsageReportError::TooLarge { fit }) => {
                tracing::debug!(fit, "usage reports cut to fit the control plane's frame");
                batch_max = fit;
            }
            Ok(ack) => {
                stuck = None;
                // Grows back after a cut (another session, smaller records).
                batch_max = (batch_max * 2).min(MAX_USAGE_RECORDS);
                tracing::debug!(
                    stored = ack.stored,
                    duplicates = ack.duplicates,
                    "usage records stored by the control plane"
                );
                sink.acknowledged(ids.len() as u64);
                let s = Arc::clone(&sink);
                let _ = tokio::task::spawn_blocking(move || s.shipped(&ids)).await;
            }
            Err(e) => {
                tracing::debug!(error = %e, "usage report not acknowledged; sending again later");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
}
