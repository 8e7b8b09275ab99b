//! Per-stream credit for a tunnel's body (the Edge's `ProviderTunnelRequest.credit_window` and
//! its `StreamWindowUpdate` frames).
//!
//! The tunnel's [`crate::TunnelSink::body`] takes credit before it hands body bytes on: a body
//! larger than the credit left is split (the parts are views of the same buffer), and with no
//! credit left it waits, so the adapter stops reading its provider and TCP pushes back on the
//! provider. Each frame costs its body length plus
//! [`iop_wire::runtime::TUNNEL_FRAME_CREDIT`], as the Edge counts it.
//!
//! Waiting for credit is not provider silence: the execution's stall watchdog asks
//! [`Credit::excuse`] before it declares a stall, and re-arms instead while the tunnel waits (or
//! waited since it last looked).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use iop_wire::runtime::TUNNEL_FRAME_CREDIT;
use tokio::sync::Notify;

/// One tunnel's credit: what the Edge granted and the tunnel has not used yet.
#[derive(Debug)]
pub(crate) struct Credit {
    available: AtomicU64,
    granted: Notify,
    waiting: AtomicBool,
    waited: AtomicBool,
}

impl Credit {
    /// Credit of `window` bytes (the tunnel request's window).
    pub(crate) fn new(window: u64) -> Self {
        Self {
            available: AtomicU64::new(window),
            granted: Notify::new(),
            waiting: AtomicBool::new(false),
            waited: AtomicBool::new(false),
        }
    }

    /// The Edge gave `bytes` back.
    pub(crate) fn grant(&self, bytes: u64) {
        let _ = self
            .available
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| {
                Some(a.saturating_add(bytes))
            });
        self.granted.notify_one();
    }

    /// Takes the credit for the next frame of a body of `len` bytes: how many of them it may
    /// carry (all, or fewer when the credit left is smaller; `0` only for an empty body),
    /// waiting while there is not enough credit for a frame.
    pub(crate) async fn take(&self, len: usize) -> usize {
        let len = len as u64;
        loop {
            let available = self.available.load(Ordering::Acquire);
            if available > TUNNEL_FRAME_CREDIT || (len == 0 && available >= TUNNEL_FRAME_CREDIT) {
                let n = len.min(available - TUNNEL_FRAME_CREDIT);
                if self
                    .available
                    .compare_exchange(
                        available,
                        available - n - TUNNEL_FRAME_CREDIT,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    return usize::try_from(n).unwrap_or(usize::MAX);
                }
                continue;
            }
            self.waiting.store(true, Ordering::Release);
            // A grant between the load above and this wait left a permit in the Notify: the
            // wait then returns at once and the loop looks again.
            self.granted.notified().await;
            self.waiting.store(false, Ordering::Release);
            self.waited.store(true, Ordering::Release);
        }
    }

    /// Whether the tunnel is waiting for credit, or waited since the last call: the provider
    /// was not read meanwhile, so its silence is not a stall.
    pub(crate) fn excuse(&self) -> bool {
        self.waiting.load(Ordering::Acquire) | self.waited.swap(false, Ordering::AcqRel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_body_is_split_to_the_credit_and_waits_for_more() {
        let credit = Credit::new(TUNNEL_FRAME_CREDIT + 100);
        assert_eq!(credit.take(1000).await, 100, "split to the credit left");
        assert!(!credit.excuse());
        let waiter = async { credit.take(900).await };
        tokio::pin!(waiter);
        assert!(
            futures_util::poll!(waiter.as_mut()).is_pending(),
            "no credit left: waits"
        );
        assert!(credit.excuse(), "waiting excuses the provider's silence");
        credit.grant(TUNNEL_FRAME_CREDIT + 900);
        assert_eq!(waiter.await, 900);
        assert!(credit.excuse(), "it waited since the last look");
        assert!(!credit.excuse(), "once");
        assert_eq!(credit.available.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn an_empty_body_costs_one_frame() {
        let credit = Credit::new(TUNNEL_FRAME_CREDIT);
        assert_eq!(credit.take(0).await, 0);
        assert_eq!(credit.available.load(Ordering::Acquire), 0);
    }
}
