//! One execution (normalized run or provider tunnel): the adapter's work, the response-stall
//! watchdog, and exactly one terminal.
//!
//! The work is polled by the execution's own task, not spawned into another: its frames reach
//! the supervisor without a task switch, and cancel or deadline drop it on the spot. A panic in
//! an adapter is caught and ends the execution with its terminal like any failure; only an
//! attempt whose fence is unconfirmed after a stall is moved to a task of its own, which holds
//! the admission permit until the provider call really returns.
//!
//! # Outcomes, in precedence order when several are due at once
//!
//! 1. **Cancel** (`CancelRequest`, or the session ending): the work is aborted; terminal
//!    `CANCELLED` (run) or `ERROR "cancelled"` (tunnel). No `ExecutionFailure`.
//! 2. **Hard deadline** (`timeout_sec`): aborted; `ERROR "deadline exceeded"`.
//! 3. **Response stall**: no provider activity (a delta or frame) for the request's
//!    `response_stall_timeout` (0 → 300 s). Time a tunnel spends waiting for the Edge's credit
//!    (its reader is behind) does not count: the provider was not asked for more. The attempt is fenced (the adapter's
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

use std::panic::AssertUnwindSafe;
use std::pin::Pin;

use futures_util::FutureExt as _;
use iop_wire::runtime::{ExecutionFailure, Fence, HealthEvidence, ProviderStatus};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
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

/// The adapter's work panicked.
#[derive(Debug)]
pub(crate) struct Panicked;

/// The adapter's work as the supervisor polls it: boxed (it may have to move to a task of its
/// own after a stall), a panic caught.
pub(crate) type Work<R> = Pin<Box<dyn Future<Output = Result<R, Panicked>> + Send>>;

/// Wraps an adapter's future for [`supervise`].
pub(crate) fn work<R>(fut: impl Future<Output = R> + Send + 'static) -> Work<R> {
    Box::pin(
        AssertUnwindSafe(fut)
            .catch_unwind()
            .map(|r| r.map_err(|_| Panicked)),
    )
}

/// How an execution ended.
pub(crate) enum Ended<R> {
    Returned(Result<R, Panicked>),
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
    /// A tunnel's credit: while it waits for the Edge's reader, the provider is not read, and
    /// its silence is not a stall.
    pub(crate) credit: Option<std::sync::Arc<crate::credit::Credit>>,
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
    mut work: Work<R>,
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
    // Two timers for the whole execution, re-armed rather than made anew at every item.
    let deadline = sleep_until(watch.deadline);
    let stall = sleep_until(stall_at(last_activity));
    tokio::pin!(deadline, stall);
    // The stall timer is re-armed lazily: an item only records the time, and the timer, when
    // it fires early, moves itself to the real moment (one timer operation per stall window
    // rather than one per item).
    let ended = loop {
        tokio::select! {
            biased;
            () = watch.cancel.cancelled() => break Ended::Cancelled,
            () = &mut deadline => break Ended::Deadline,
            Some(item) = items.recv() => {
                last_activity = Instant::now();
                if let Some(o) = forward(item) {
                    let _ = out.send(o).await;
                }
            }
            () = &mut stall => {
                if watch.credit.as_ref().is_some_and(|c| c.excuse()) {
                    // Paced by the Edge's reader: the provider was not asked for more.
                    last_activity = Instant::now();
                }
                if let Some(at) = stall_at(last_activity)
                    && at > Instant::now()
                {
                    stall.as_mut().set(sleep_until(Some(at)));
                    continue;
                }
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
    // Cancelled or past the deadline: the work is dropped here, which drops the provider call.
    drop(work);
    drop(permit);
    ended
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::Semaphore;

    use super::*;

    const STALL: Duration = Duration::from_millis(100);

    fn watch(cancel: &CancellationToken) -> Watch<'_> {
        Watch {
            cancel,
            fence: CancellationToken::new(),
            deadline: None,
            stall_timeout: STALL,
            close_grace: Duration::from_millis(50),
            probe_timeout: Duration::from_millis(50),
            credit: None,
        }
    }

    fn ident() -> StallIdentity {
        StallIdentity {
            run_id: "r".into(),
            attempt_id: "a".into(),
            adapter: "ad".into(),
            target: "t".into(),
        }
    }

    async fn permit(gate: &Arc<Semaphore>) -> OwnedSemaphorePermit {
        gate.clone().acquire_owned().await.expect("open gate")
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_adapter_ends_its_execution_and_releases_the_permit() {
        let gate = Arc::new(Semaphore::new(1));
        let (_tx, items) = mpsc::channel::<u32>(4);
        let (out, _rx) = mpsc::channel::<u32>(4);
        let cancel = CancellationToken::new();
        let w = work(async { panic!("an adapter bug") });
        let p = permit(&gate).await;
        let ended = supervise::<u32, (), u32, _, _>(
            w,
            items,
            Some,
            &out,
            watch(&cancel),
            p,
            || async { ProviderStatus::Available },
            ident(),
        )
        .await;
        assert!(matches!(ended, Ended::Returned(Err(Panicked))));
        assert_eq!(gate.available_permits(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn activity_holds_off_the_stall_and_silence_declares_it_once() {
        let gate = Arc::new(Semaphore::new(1));
        let (tx, items) = mpsc::channel::<u32>(4);
        let (out, mut rx) = mpsc::channel::<u32>(16);
        let cancel = CancellationToken::new();
        // An item every 60 ms (under the 100 ms stall timeout) ten times, then silence, and the
        // call never returns.
        let w = work(async move {
            for i in 0..10 {
                tokio::time::sleep(Duration::from_millis(60)).await;
                let _ = tx.send(i).await;
            }
            std::future::pending::<()>().await;
        });
        let start = Instant::now();
        let p = permit(&gate).await;
        let ended = supervise(
            w,
            items,
            Some,
            &out,
            watch(&cancel),
            p,
            || async { ProviderStatus::Unavailable },
            ident(),
        )
        .await;
        let Ended::Stalled(failure) = ended else {
            panic!("a stall")
        };
        // Declared one stall timeout after the last item (at 600 ms), the grace and the probe
        // run concurrently (50 ms), the fence is unconfirmed: the call never returned.
        assert_eq!(failure.idle_duration, STALL);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(600) + STALL + Duration::from_millis(50)
        );
        assert_eq!(failure.fence, Fence::Unconfirmed);
        assert_eq!(failure.health, HealthEvidence::Unavailable);
        let mut forwarded = Vec::new();
        while let Ok(i) = rx.try_recv() {
            forwarded.push(i);
        }
        assert_eq!(forwarded, (0..10).collect::<Vec<_>>());
        // The permit stays with the attempt that has not returned.
        assert_eq!(gate.available_permits(), 0);
    }

    /// Seed 000 precedence: the request's hard deadline (`timeout_sec`) keeps its boundary when
    /// it expires before the stall watchdog: the execution ends `Deadline` at exactly the
    /// deadline, no stall is declared, the health probe never starts, and the permit is free
    /// (the silent work was dropped). When both fall due at the same instant the deadline still
    /// wins.
    #[tokio::test(start_paused = true)]
    async fn a_hard_deadline_that_expires_first_wins_over_the_stall_watchdog() {
        for deadline_after in [STALL - Duration::from_millis(30), STALL] {
            let gate = Arc::new(Semaphore::new(1));
            let (_tx, items) = mpsc::channel::<u32>(4);
            let (out, _rx) = mpsc::channel::<u32>(4);
            let cancel = CancellationToken::new();
            let probed = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let start = Instant::now();
            let mut w = watch(&cancel);
            w.deadline = Some(start + deadline_after);
            let fence = w.fence.clone();
            let p = permit(&gate).await;
            let flag = probed.clone();
            let ended = supervise::<u32, (), u32, _, _>(
                work(std::future::pending()),
                items,
                Some,
                &out,
                w,
                p,
                || async move {
                    flag.store(true, Ordering::SeqCst);
                    ProviderStatus::Unavailable
                },
                ident(),
            )
            .await;
            assert!(
                matches!(ended, Ended::Deadline),
                "deadline after {deadline_after:?}"
            );
            assert_eq!(start.elapsed(), deadline_after);
            assert!(!probed.load(Ordering::SeqCst), "no stall probe");
            assert!(!fence.is_cancelled(), "no stall fence");
            assert_eq!(gate.available_permits(), 1);
        }
    }
}
