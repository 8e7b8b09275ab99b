//! One execution (normalized run or provider tunnel): the adapter's work in its own task, the
//! response-stall watchdog, and exactly one terminal.
//!
//! # Outcomes, in precedence order when several are due at once
//!
//! 1. **Cancel** (`CancelRequest`, or the session ending): the work is aborted; terminal
//!    `CANCELLED` (run) or `ERROR "cancelled"` (tunnel). No `ExecutionFailure`.
//! 2. **Hard deadline** (`timeout_sec`): aborted; `ERROR "deadline exceeded"`.
//! 3. **Response stall**: no provider activity (a delta or frame) for the request's
//!    `response_stall_timeout` (0 → 300 s). The attempt is fenced (the adapter's
//!    `cancelled()` resolves), and then — concurrently, not one after the other — the bounded
//!    close grace waits for the adapter to actually return while an
//!    exact-target health probe runs. Exactly one `ERROR` terminal follows with failure code
//!    `response_stalled` and a typed `ExecutionFailure`: three-way health evidence, idle
//!    duration, run/attempt identity, fence (`confirmed` if the work returned within the grace),
//!    adapter, target, and the session's next `health_observation_seq` (stamped by the session
//!    loop). When the grace expires first, the terminal is still sent, but the admission permit
//!    is kept until the work really returns.
//! 4. **The adapter returned**: `COMPLETE`/`END` on success, `ERROR` with the legacy error string
//!    otherwise (no `ExecutionFailure`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use iop_wire::runtime::{ExecutionFailure, Fence, HealthEvidence, ProviderStatus};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::{JoinError, JoinHandle};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Default bounded close grace after a stall.
pub const DEFAULT_CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Legacy error string of a stall terminal.
pub const RESPONSE_STALLED: &str = "response stalled";

static ATTEMPTS: AtomicU64 = AtomicU64::new(1);

/// A fresh Node-owned attempt id.
pub(crate) fn attempt_id() -> String {
    format!("attempt-{}", ATTEMPTS.fetch_add(1, Ordering::Relaxed))
}

/// Who a stall terminal is about.
pub(crate) struct StallIdentity {
    pub(crate) run_id: String,
    pub(crate) attempt_id: String,
    pub(crate) adapter: String,
    pub(crate) target: String,
}

/// How an execution ended.
pub(crate) enum Ended<R> {
    Returned(Result<R, JoinError>),
    Cancelled,
    Deadline,
    Stalled(Box<ExecutionFailure>),
}

pub(crate) struct Watch<'a> {
    pub(crate) cancel: &'a CancellationToken,
    /// Fences the attempt cooperatively (the adapter sees `cancelled()`).
    pub(crate) fence: CancellationToken,
    pub(crate) deadline: Option<Instant>,
    pub(crate) stall_timeout: Duration,
    pub(crate) close_grace: Duration,
    pub(crate) probe_timeout: Duration,
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Drives `work` to one outcome, sending each item it produces to `out` after `forward` maps it
/// (every item counts as provider activity). `probe` is only started on a stall.
#[expect(
    clippy::too_many_arguments,
    reason = "one call site per execution kind"
)]
pub(crate) async fn supervise<T, R, O, F, Fut>(
    mut work: JoinHandle<R>,
    mut items: mpsc::Receiver<T>,
    mut forward: impl FnMut(T) -> Option<O>,
    out: &mpsc::Sender<O>,
    watch: Watch<'_>,
    permit: OwnedSemaphorePermit,
    probe: F,
    ident: StallIdentity,
) -> Ended<R>
where
    R: Send + 'static,
    O: Send,
    F: FnOnce() -> Fut,
    Fut: Future<Output = ProviderStatus>,
{
    let mut last_activity = Instant::now();
    let stall_at = |last: Instant| last.checked_add(watch.stall_timeout);
    let ended = loop {
        tokio::select! {
            biased;
            () = watch.cancel.cancelled() => break Ended::Cancelled,
            () = sleep_until(watch.deadline) => break Ended::Deadline,
            Some(item) = items.recv() => {
                last_activity = Instant::now();
                if let Some(o) = forward(item) {
                    let _ = out.send(o).await;
                }
            }
            () = sleep_until(stall_at(last_activity)) => {
                let idle = last_activity.elapsed();
                // Fence the attempt and give the provider call the grace to return; it is not
                // dropped, so "returned" means the adapter itself came back.
                watch.fence.cancel();
                let (joined, status) = tokio::join!(
                    tokio::time::timeout(watch.close_grace, &mut work),
                    tokio::time::timeout(watch.probe_timeout, probe()),
                );
                let health = match status {
                    Ok(ProviderStatus::Available) => HealthEvidence::Available,
                    Ok(ProviderStatus::Unavailable) => HealthEvidence::Unavailable,
                    Ok(ProviderStatus::Unknown) | Err(_) => HealthEvidence::Unknown,
                };
                let fence = if joined.is_ok() { Fence::Confirmed } else { Fence::Unconfirmed };
                let failure = ExecutionFailure {
                    health,
                    idle_duration: idle,
                    run_id: ident.run_id,
                    attempt_id: ident.attempt_id,
                    fence,
                    adapter: ident.adapter,
                    target: ident.target,
                    health_observation_seq: None,
                };
                if fence == Fence::Unconfirmed {
                    // Admission and adapter ownership stay until the provider really returns.
                    tokio::spawn(async move {
                        let _ = work.await;
                        drop(permit);
                    });
                    return Ended::Stalled(Box::new(failure));
                }
                break Ended::Stalled(Box::new(failure));
            }
            result = &mut work => {
                while let Ok(item) = items.try_recv() {
                    if let Some(o) = forward(item) {
                        let _ = out.send(o).await;
                    }
                }
                break Ended::Returned(result);
            }
        }
    };
    if matches!(ended, Ended::Cancelled | Ended::Deadline) {
        work.abort();
        let _ = work.await;
    }
    drop(permit);
    ended
}
