//! Limits shared by several Edges, the Edge's side: borrowing from the store ahead of need,
//! spending from local credit, remembering refusals, giving idle credit back, and what happens
//! when the store cannot decide (the module docs of [`super`] state the rules and the bound).

use std::sync::Arc;
use std::time::Duration;

use iop_edge_core::ratelimit::{Admitted, Decision, Exceeded, Limits, Rate};

use super::{
    Blocked, Hold, KeyEntry, KeyLabel, KeyLimits, LimitError, LimitState, Limiter, OnUnavailable,
    OpLabel, Quota, Refused, SharedConfig, SharedHold, Shown, Slot, shared,
};

/// How often a store outage is logged (it is counted every time).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A quantity one admission asks of the store.
struct Ask {
    slot: Slot,
    rate: Rate,
    cost: u64,
    /// Taken from this Edge's credit already.
    taken: u64,
}

impl Limiter {
    /// Shared through the store: concurrency in this Edge, requests and tokens from this
    /// Edge's credit, the rest borrowed in one store call.
    pub(super) async fn admit_shared(
        self: &Arc<Self>,
        store: &shared::RateStore,
        shared: &SharedConfig,
        limits: Arc<KeyLimits>,
        key: &str,
        model: &str,
        estimate: u64,
    ) -> Result<Hold, LimitError> {
        self.start_returner();
        let model_limits = limits.models.get(model);
        let concurrency = |l: &Limits| Limits {
            requests: None,
            tokens: None,
            concurrent: l.concurrent,
        };
        let now = self.now_us();
        let mut asks = Vec::with_capacity(4);
        let (own, per_model, id, borrowing) = {
            let mut keys = self.lock();
            if !self.make_room(&mut keys, key, now) {
                return Err(LimitError::Refused(Self::no_room()));
            }
            let entry = Self::entry(&mut keys, key, model, model_limits.is_some());
            entry.last_used = now;
            let concurrent_refusal = |per_model| Refused {
                exceeded: Exceeded::Concurrent,
                per_model,
                retry_after: None,
                quota: Quota::default(),
            };
            let Ok(own) = entry.own.rule.admit(&concurrency(&limits.limits), now, 0) else {
                let r = concurrent_refusal(false);
                self.count_refusal(&entry.id, &r);
                return Err(LimitError::Refused(r));
            };
            let per_model = match (model_limits, entry.models.get_mut(model)) {
                (Some(l), Some(s)) => match s.rule.admit(&concurrency(l), now, 0) {
                    Ok(a) => Some(a),
                    Err(_) => {
                        entry.own.rule.finish(&limits.limits, now, own, 0);
                        let r = concurrent_refusal(true);
                        self.count_refusal(&entry.id, &r);
                        return Err(LimitError::Refused(r));
                    }
                },
                _ => None,
            };
            let wanted = [
                (
                    Slot::Requests { per_model: false },
                    limits.limits.requests,
                    1,
                ),
                (
                    Slot::Tokens { per_model: false },
                    limits.limits.tokens,
                    estimate,
                ),
                (
                    Slot::Requests { per_model: true },
                    model_limits.and_then(|l| l.requests),
                    1,
                ),
                (
                    Slot::Tokens { per_model: true },
                    model_limits.and_then(|l| l.tokens),
                    estimate,
                ),
            ];
            for (slot, rate, cost) in wanted {
                if let (Some(rate), Some(_)) = (rate, entry.state(slot, model)) {
                    asks.push(Ask {
                        slot,
                        rate,
                        cost,
                        taken: 0,
                    });
                }
            }
            (
                own,
                per_model,
                Arc::clone(&entry.id),
                Arc::clone(&entry.borrowing),
            )
        };
        let token_slots: Vec<Slot> = asks
            .iter()
            .map(|a| a.slot)
            .filter(|s| matches!(s, Slot::Tokens { .. }))
            .collect();
        // Spends the credit if it covers every quantity; else takes what it has (the rest is
        // borrowed) and says no.
        let from_credit = |asks: &mut [Ask]| -> Result<bool, (Slot, u64)> {
            let mut keys = self.lock();
            let entry = Self::entry(&mut keys, key, model, model_limits.is_some());
            for a in asks.iter_mut() {
                if let Some(s) = entry.state(a.slot, model) {
                    a.taken += s.credit[a.slot.index()].take(a.cost - a.taken);
                }
            }
            if asks.iter().all(|a| a.taken == a.cost) {
                return Ok(true);
            }
            let now = self.now_us();
            for a in asks.iter() {
                let need = a.cost - a.taken;
                if let Some(b) = entry
                    .state(a.slot, model)
                    .and_then(|s| s.blocked[a.slot.index()])
                    && need >= b.need
                    && now < b.until_us
                {
                    return Err((a.slot, b.until_us - now));
                }
            }
            Ok(false)
        };
        // One borrow per key at a time on this Edge: requests that arrive while one is out
        // wait for it and are then usually covered by what it took ahead (without this, a
        // burst sends a borrow per request, and the shares taken ahead sit idle while the
        // requests that asked are refused).
        let mut _borrowing = None;
        let mut covered = from_credit(&mut asks);
        if covered == Ok(false) {
            _borrowing = Some(borrowing.lock_owned().await);
            covered = from_credit(&mut asks);
        }
        let answer = match covered {
            Ok(true) => None,
            Err((slot, wait_us)) => Some(Ok(shared::Borrowed {
                allowed: false,
                now_us: 0,
                quantities: asks
                    .iter()
                    .map(|a| {
                        let refusing = a.slot == slot;
                        (
                            0,
                            Decision {
                                allowed: !refusing,
                                remaining: 0,
                                reset_after: Duration::ZERO,
                                retry_after: refusing.then(|| Duration::from_micros(wait_us)),
                            },
                        )
                    })
                    .collect(),
            })),
            Ok(false) => {
                let q: Vec<shared::Quantity> = asks
                    .iter()
                    .map(|a| shared::Quantity {
                        key: store.key(&id, a.slot.per_model().then_some(model), a.slot.kind()),
                        rate: a.rate,
                        units: a.cost - a.taken,
                        ahead: a.rate.limit() / shared.borrow_divisor.max(1),
                        share: shared.share,
                    })
                    .collect();
                self.metrics
                    .store_calls
                    .get_or_create(&OpLabel { op: "borrow" })
                    .inc();
                Some(store.borrow(&q, None).await)
            }
        };
        let mut keys = self.lock();
        let entry = Self::entry(&mut keys, key, model, model_limits.is_some());
        let give_back = |entry: &mut KeyEntry, asks: &[Ask]| {
            for a in asks {
                if let Some(s) = entry.state(a.slot, model) {
                    s.credit[a.slot.index()].add(a.taken);
                }
            }
        };
        let end_concurrency = |entry: &mut KeyEntry, own, per_model: Option<Admitted>| {
            entry.own.rule.finish(&limits.limits, now, own, 0);
            if let (Some(a), Some(l), Some(s)) =
                (per_model, model_limits, entry.models.get_mut(model))
            {
                s.rule.finish(l, now, a, 0);
            }
        };
        match answer {
            None => {}
            Some(Ok(b)) if b.allowed => {
                for (a, (granted, d)) in asks.iter().zip(&b.quantities) {
                    if let Some(s) = entry.state(a.slot, model) {
                        let need = a.cost - a.taken;
                        s.credit[a.slot.index()].add(granted.saturating_sub(need));
                        s.shown[a.slot.index()] = Some(Shown::of(&a.rate, d));
                        s.blocked[a.slot.index()] = None;
                    }
                }
            }
            Some(Ok(b)) => {
                give_back(entry, &asks);
                end_concurrency(entry, own, per_model);
                // Of the quantities that refused, the longest wait (one that never fits first).
                let mut refusing: Option<(Slot, Option<Duration>)> = None;
                let from_store = b.now_us != 0;
                let now = self.now_us();
                for (a, (_, d)) in asks.iter().zip(&b.quantities) {
                    if let (Some(s), true) = (entry.state(a.slot, model), from_store) {
                        s.shown[a.slot.index()] = Some(Shown::of(&a.rate, d));
                        s.blocked[a.slot.index()] = match (d.allowed, d.retry_after) {
                            (false, Some(w)) => Some(Blocked {
                                until_us: now.saturating_add(
                                    u64::try_from(w.as_micros()).unwrap_or(u64::MAX),
                                ),
                                need: a.cost - a.taken,
                            }),
                            _ => None,
                        };
                    }
                    if d.allowed {
                        continue;
                    }
                    let longer = match refusing {
                        None => true,
                        Some((_, None)) => false,
                        Some((_, Some(w))) => d.retry_after.is_none_or(|x| x > w),
                    };
                    if longer {
                        refusing = Some((a.slot, d.retry_after));
                    }
                }
                let (slot, retry_after) =
                    refusing.unwrap_or((Slot::Requests { per_model: false }, None));
                let refused = Refused {
                    exceeded: slot.exceeded(),
                    per_model: slot.per_model(),
                    retry_after,
                    quota: Self::shared_quota(entry, model),
                };
                self.count_refusal(&entry.id, &refused);
                return Err(LimitError::Refused(refused));
            }
            Some(Err(e)) => {
                give_back(entry, &asks);
                end_concurrency(entry, own, per_model);
                drop(keys);
                self.store_failed(&e, &id);
                return match shared.on_unavailable {
                    OnUnavailable::Local => self.admit_local(limits, key, model, estimate),
                    OnUnavailable::Closed => Err(LimitError::Unavailable),
                };
            }
        }
        let quota = Self::shared_quota(entry, model);
        drop(keys);
        self.count_admission(&id);
        let model = model_limits.map(|_| model.to_owned());
        Ok(Hold {
            limiter: Some(Arc::clone(self)),
            limits: Some(limits),
            key: Some(id),
            model,
            own: Some(own),
            per_model,
            shared: Some(SharedHold {
                reserved: estimate,
                token_slots,
            }),
            usage: None,
            reported: None,
            sent: false,
            upstream_error: false,
            ended: None,
            meter: None,
            budget: None,
            quota,
        })
    }

    fn shared_quota(entry: &KeyEntry, model: &str) -> Quota {
        let own = Quota {
            requests: entry.own.shown(Slot::Requests { per_model: false }),
            tokens: entry.own.shown(Slot::Tokens { per_model: false }),
        };
        let per_model = entry
            .models
            .get(model)
            .map_or_else(Quota::default, |s| Quota {
                requests: s.shown(Slot::Requests { per_model: true }),
                tokens: s.shown(Slot::Tokens { per_model: true }),
            });
        own.tighter(per_model)
    }

    fn store_failed(&self, e: &shared::StoreError, id: &Arc<str>) {
        self.metrics.store_errors.inc();
        self.metrics
            .unavailable
            .get_or_create(&KeyLabel {
                key: Arc::clone(id),
            })
            .inc();
        let mut warned = self
            .warned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if warned.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            *warned = Some(tokio::time::Instant::now());
            let mode = match self.config.shared.as_ref().map(|s| s.on_unavailable) {
                Some(OnUnavailable::Closed) => {
                    "refusing limited requests (on_unavailable = closed)"
                }
                _ => "each Edge enforcing limits alone (on_unavailable = local)",
            };
            tracing::warn!(error = %e, "shared rate limit store unavailable: {mode}; logged at most every {} s, counted in iop_edge_ratelimit_store_errors_total", WARN_EVERY.as_secs());
        }
    }

    /// Starts the task that gives idle credit back to the store (once, on the first shared
    /// admission: the limiter may be made outside a runtime).
    pub(super) fn start_returner(self: &Arc<Self>) {
        let Some(idle) = self.config.shared.as_ref().map(|s| s.credit_idle) else {
            return;
        };
        self.returner.get_or_init(|| {
            let weak = Arc::downgrade(self);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(idle.max(Duration::from_millis(10)));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let Some(limiter) = weak.upgrade() else {
                        return;
                    };
                    limiter.return_idle_credit(idle).await;
                }
            });
        });
    }

    /// Gives back the credit of every key unused for `idle` (one store call per key: its
    /// quantities share a slot).
    async fn return_idle_credit(&self, idle: Duration) {
        let Some(store) = &self.store else { return };
        let now = self.now_us();
        let idle_us = u64::try_from(idle.as_micros()).unwrap_or(u64::MAX);
        let mut returns: Vec<Vec<shared::Quantity>> = Vec::new();
        {
            let mut keys = self.lock();
            for entry in keys.values_mut() {
                if now.saturating_sub(entry.last_used) < idle_us {
                    continue;
                }
                let limits = self.limits_of(&entry.id);
                let mut q = Vec::new();
                let mut take =
                    |state: &mut LimitState, l: &Limits, model: Option<&str>, per_model| {
                        for (slot, rate) in [
                            (Slot::Requests { per_model }, l.requests),
                            (Slot::Tokens { per_model }, l.tokens),
                        ] {
                            let units = state.credit[slot.index()].take_all();
                            if let (Some(rate), true) = (rate, units > 0) {
                                q.push(shared::Quantity {
                                    key: store.key(&entry.id, model, slot.kind()),
                                    rate,
                                    units,
                                    ahead: 0,
                                    share: 1,
                                });
                            }
                        }
                    };
                take(&mut entry.own, &limits.limits, None, false);
                for (m, state) in &mut entry.models {
                    if let Some(l) = limits.models.get(m) {
                        take(state, l, Some(m), true);
                    }
                }
                if !q.is_empty() {
                    returns.push(q);
                }
            }
        }
        for q in returns {
            self.metrics
                .store_calls
                .get_or_create(&OpLabel { op: "refund" })
                .inc();
            // A failed return leaves the units charged: the limit is only stricter for a while.
            if store.refund(&q, None).await.is_err() {
                self.metrics.store_errors.inc();
            }
        }
    }
}
