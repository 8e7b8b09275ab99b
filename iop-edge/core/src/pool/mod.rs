//! The provider pool and its queue, as a pure state machine (no tokio, time is an argument).
//!
//! Seed 000 ("provider-pool mixed dispatch", "ProviderSnapshot", "disconnect/reconnect"):
//!
//! - A model group maps an external model name to provider candidates (a Node, an adapter
//!   instance, a target, capacities and the effective response-stall timeout). Provider type
//!   never excludes a candidate.
//! - Admission takes a **provider lease** keyed by `(node_id, provider_id)` on one live
//!   candidate with free capacity (the least loaded; ties go to configuration order). When none
//!   has capacity the request waits in a bounded FIFO queue; waiters are pumped as soon as a Node
//!   becomes ready or a lease is released. A full queue or an expired wait is an error the
//!   caller turns into an OpenAI-style 429/503 — never a hang.
//! - Every lease is released exactly once: by [`Pool::release`] (the run's terminal) or by
//!   [`Pool::node_fenced`] (the generation ended), whichever comes first; the other is a no-op.
//! - A fenced Node's providers go offline (excluded) until the Node is ready again, on a new
//!   generation, with its configured capacity; a runtime-unavailable overlay belongs to one
//!   generation and is never inherited.
//! - [`Pool::snapshot`] reports the seed's figures: `in_flight`/`long_in_flight` from leases,
//!   `queued`/`long_queued` as candidate pressure (a waiter counts on every live candidate of its
//!   model), offline providers with status `unavailable`, health `offline` and every figure
//!   zero, overlaid providers with status and health `unavailable` and every figure zero. A
//!   provider excluded because its Node does not pin the current lease issuer key (managed
//!   mode, [`Pool::set_node_excluded`]) shows status and health `unavailable` with its
//!   running requests still counted in `in_flight`.
//!
//! Drive it like the other machines: call the `handle`-style methods, then drain
//! [`Pool::poll_event`] (grants to waiters, wait timeouts) and re-arm [`Pool::poll_timeout`].

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use crate::registry::Generation;
use iop_wire::runtime::ProviderSnapshot;

/// A provider's identity: `(node_id, provider_id)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderKey {
    /// Node.
    pub node_id: String,
    /// Provider id (unique within the Node).
    pub provider_id: String,
}

/// How much context a request needs: a long-context request takes a provider's
/// `long_context_capacity` as well as its capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ContextSize {
    /// Any candidate with room.
    #[default]
    Standard,
    /// Only within a candidate's long-context capacity.
    Long,
}

impl ContextSize {
    /// Whether this is [`ContextSize::Long`].
    pub fn is_long(self) -> bool {
        self == Self::Long
    }
}

/// How requests reach a provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    /// `ProviderTunnelRequest` (raw passthrough).
    OpenAiCompat,
    /// Normalized `RunRequest`.
    Native,
}

/// A configured provider candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderSpec {
    /// Identity.
    pub key: ProviderKey,
    /// Adapter instance on the Node.
    pub adapter: String,
    /// Provider target (the upstream model).
    pub target: String,
    /// Dispatch path.
    pub kind: ProviderKind,
    /// Resource kind for snapshots (`api`, `local_inference`, `cli`).
    pub category: String,
    /// Concurrent leases.
    pub capacity: u32,
    /// Of which long-context.
    pub long_context_capacity: u32,
    /// Effective response-stall timeout copied into dispatched requests.
    pub response_stall_timeout: Duration,
    /// Disabled providers are listed but never selected.
    pub enabled: bool,
}

/// Identifies a queued request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Identifies a granted provider lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// A granted provider lease: where to dispatch, on which generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lease.
    pub id: LeaseId,
    /// The provider.
    pub key: ProviderKey,
    /// The Node generation the lease is valid for.
    pub generation: Generation,
    /// Whether it holds long-context capacity.
    pub long_context: bool,
    /// The provider's adapter instance, target, kind and stall timeout, for the dispatch.
    pub adapter: String,
    /// Target.
    pub target: String,
    /// Kind.
    pub kind: ProviderKind,
    /// Effective stall timeout.
    pub response_stall_timeout: Duration,
}

/// The answer to [`Pool::submit`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// Granted now.
    Granted(Lease),
    /// Waiting; a [`PoolEvent`] will grant or time it out.
    Queued(RequestId),
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// No model group has this name (404).
    #[error("model not found")]
    UnknownModel,
    /// The queue is at its bound (429).
    #[error("queue is full")]
    QueueFull,
}

/// What the pool tells its driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolEvent {
    /// A waiter got a lease.
    Granted {
        /// The waiter.
        request: RequestId,
        /// Its lease.
        lease: Lease,
    },
    /// A waiter's wait timed out (503).
    WaitTimedOut {
        /// The waiter.
        request: RequestId,
    },
}

#[derive(Clone, Debug)]
struct Provider {
    spec: ProviderSpec,
    /// Set while the Node's generation is dispatch-ready.
    generation: Option<Generation>,
    /// Runtime-unavailable overlay, for the generation it was set on.
    overlay: Option<Generation>,
    /// Not selected while its Node cannot verify the current lease issuer key (managed mode);
    /// its leases run to their end.
    excluded: bool,
    in_flight: u32,
    long_in_flight: u32,
}

impl Provider {
    fn live(&self) -> bool {
        self.spec.enabled && self.generation.is_some() && self.overlay.is_none() && !self.excluded
    }

    fn has_room(&self, long: bool) -> bool {
        self.live()
            && self.in_flight < self.spec.capacity
            && (!long || self.long_in_flight < self.spec.long_context_capacity)
    }
}

#[derive(Clone, Debug)]
struct Waiter {
    id: RequestId,
    model: String,
    long: bool,
    deadline: Instant,
    /// When it started waiting.
    since: Instant,
}

/// Pool settings.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Providers, in configuration order (the tie-break of selection).
    pub providers: Vec<ProviderSpec>,
    /// External model name → candidate providers.
    pub models: Vec<(String, Vec<ProviderKey>)>,
    /// Most waiting requests.
    pub max_queue: usize,
}

/// The pool. See the module docs. `Clone` copies it whole (model checkers).
#[derive(Clone, Debug)]
pub struct Pool {
    order: Vec<ProviderKey>,
    providers: BTreeMap<ProviderKey, Provider>,
    models: BTreeMap<String, Vec<ProviderKey>>,
    queue: VecDeque<Waiter>,
    max_queue: usize,
    leases: BTreeMap<LeaseId, Lease>,
    next_request: u64,
    next_lease: u64,
    events: VecDeque<PoolEvent>,
}

impl Pool {
    /// A pool with every provider offline (no Node ready yet).
    pub fn new(config: PoolConfig) -> Self {
        let order = config.providers.iter().map(|p| p.key.clone()).collect();
        let providers = config
            .providers
            .into_iter()
            .map(|spec| {
                let key = spec.key.clone();
                (
                    key,
                    Provider {
                        spec,
                        generation: None,
                        overlay: None,
                        excluded: false,
                        in_flight: 0,
                        long_in_flight: 0,
                    },
                )
            })
            .collect();
        Self {
            order,
            providers,
            models: config.models.into_iter().collect(),
            queue: VecDeque::new(),
            max_queue: config.max_queue,
            leases: BTreeMap::new(),
            next_request: 1,
            next_lease: 1,
            events: VecDeque::new(),
        }
    }

    // === getters ===

    /// Active leases.
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    /// Waiting requests.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// When the longest-waiting request started waiting (waiters are kept in arrival order).
    pub fn oldest_wait_since(&self) -> Option<Instant> {
        self.queue.front().map(|w| w.since)
    }

    /// The lease, if still held.
    pub fn lease(&self, id: LeaseId) -> Option<&Lease> {
        self.leases.get(&id)
    }

    // === input ===

    /// Admits a request for `model` now, or queues it until `now + wait`.
    pub fn submit(
        &mut self,
        now: Instant,
        model: &str,
        long: bool,
        wait: Duration,
    ) -> Result<Submitted, PoolError> {
        if !self.models.contains_key(model) {
            return Err(PoolError::UnknownModel);
        }
        // Earlier waiters go first: grant directly only when nobody waits for this model.
        if !self.queue.iter().any(|w| w.model == model)
            && let Some(lease) = self.grant(model, long)
        {
            return Ok(Submitted::Granted(lease));
        }
        if self.queue.len() >= self.max_queue {
            return Err(PoolError::QueueFull);
        }
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let deadline = now.checked_add(wait).unwrap_or(now);
        self.queue.push_back(Waiter {
            id,
            model: model.to_owned(),
            long,
            deadline,
            since: now,
        });
        // Behind earlier waiters it may still fit (e.g. they need long-context room it doesn't).
        self.pump();
        let granted = self
            .events
            .iter()
            .position(|e| matches!(e, PoolEvent::Granted { request, .. } if *request == id));
        if let Some(i) = granted
            && let Some(PoolEvent::Granted { lease, .. }) = self.events.remove(i)
        {
            return Ok(Submitted::Granted(lease));
        }
        Ok(Submitted::Queued(id))
    }

    /// The run on `lease` ended (its terminal). Returns whether this call released it: `false`
    /// when it was already released (by an earlier call or a fence).
    pub fn release(&mut self, lease: LeaseId) -> bool {
        let Some(l) = self.leases.remove(&lease) else {
            return false;
        };
        if let Some(p) = self.providers.get_mut(&l.key) {
            p.in_flight = p.in_flight.saturating_sub(1);
            if l.long_context {
                p.long_in_flight = p.long_in_flight.saturating_sub(1);
            }
        }
        self.pump();
        true
    }

    /// A waiter gave up (client disconnect). Returns whether it was waiting.
    pub fn cancel(&mut self, request: RequestId) -> bool {
        let before = self.queue.len();
        self.queue.retain(|w| w.id != request);
        before != self.queue.len()
    }

    /// `node_id` became dispatch-ready on `generation`: its providers come online with their
    /// configured capacity (a previous generation's overlay is not inherited); waiters are pumped.
    pub fn node_ready(&mut self, node_id: &str, generation: Generation) {
        self.node_ready_excluded(node_id, generation, false);
    }

    /// [`Pool::node_ready`] with the exclusion of [`Pool::set_node_excluded`] decided in the
    /// same step, so a Node that is excluded from the start is never granted a waiter.
    pub fn node_ready_excluded(&mut self, node_id: &str, generation: Generation, excluded: bool) {
        for p in self
            .providers
            .values_mut()
            .filter(|p| p.spec.key.node_id == node_id)
        {
            p.generation = Some(generation);
            p.overlay = None;
            p.excluded = excluded;
        }
        self.pump();
    }

    /// Excludes `node_id`'s providers from selection (its Node cannot verify the key leases
    /// are signed with now), or takes them back (and pumps waiters). Leases already granted
    /// run to their end; a new generation ([`Pool::node_ready`]) starts included. Returns
    /// whether anything changed.
    pub fn set_node_excluded(&mut self, node_id: &str, excluded: bool) -> bool {
        let mut changed = false;
        for p in self
            .providers
            .values_mut()
            .filter(|p| p.spec.key.node_id == node_id && p.excluded != excluded)
        {
            p.excluded = excluded;
            changed = true;
        }
        if changed && !excluded {
            self.pump();
        }
        changed
    }

    /// `node_id`'s `generation` was fenced: its leases are released (exactly once: a later
    /// [`Pool::release`] of them is a no-op), its providers go offline, the queue is re-evaluated
    /// against the remaining live candidates. Returns the released leases. A stale generation
    /// changes nothing.
    pub fn node_fenced(&mut self, node_id: &str, generation: Generation) -> Vec<LeaseId> {
        let mut current = false;
        for p in self
            .providers
            .values_mut()
            .filter(|p| p.spec.key.node_id == node_id)
        {
            if p.generation == Some(generation) {
                p.generation = None;
                p.overlay = None;
                p.in_flight = 0;
                p.long_in_flight = 0;
                current = true;
            }
        }
        if !current {
            return Vec::new();
        }
        let mut released: Vec<LeaseId> = self
            .leases
            .values()
            .filter(|l| l.key.node_id == node_id && l.generation == generation)
            .map(|l| l.id)
            .collect();
        released.sort();
        for id in &released {
            self.leases.remove(id);
        }
        self.pump();
        released
    }

    /// `(key, adapter, target)` of every configured provider of `node_id`.
    pub fn bindings(&self, node_id: &str) -> Vec<(ProviderKey, String, String)> {
        self.order
            .iter()
            .filter(|k| k.node_id == node_id)
            .filter_map(|k| self.providers.get(k))
            .map(|p| {
                (
                    p.spec.key.clone(),
                    p.spec.adapter.clone(),
                    p.spec.target.clone(),
                )
            })
            .collect()
    }

    /// Sets the runtime-unavailable overlay on a provider for `generation` (a validated, fresh,
    /// current `unavailable` observation). Ignored for any other generation.
    pub fn set_unavailable(&mut self, key: &ProviderKey, generation: Generation) -> bool {
        match self.providers.get_mut(key) {
            Some(p) if p.generation == Some(generation) => {
                p.overlay = Some(generation);
                true
            }
            _ => false,
        }
    }

    /// Clears the overlay (a validated recovery probe for the same generation); pumps waiters.
    pub fn clear_unavailable(&mut self, key: &ProviderKey, generation: Generation) -> bool {
        let cleared = match self.providers.get_mut(key) {
            Some(p) if p.overlay == Some(generation) && p.generation == Some(generation) => {
                p.overlay = None;
                true
            }
            _ => false,
        };
        if cleared {
            self.pump();
        }
        cleared
    }

    /// Expires waiters whose deadline passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut kept = VecDeque::with_capacity(self.queue.len());
        for w in self.queue.drain(..) {
            if w.deadline <= now {
                self.events
                    .push_back(PoolEvent::WaitTimedOut { request: w.id });
            } else {
                kept.push_back(w);
            }
        }
        self.queue = kept;
    }

    // === output ===

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<PoolEvent> {
        self.events.pop_front()
    }

    /// The earliest waiter deadline.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.queue.iter().map(|w| w.deadline).min()
    }

    /// Snapshots of every configured provider, in configuration order.
    pub fn snapshot(&self) -> Vec<ProviderSnapshot> {
        let mut pressure: BTreeMap<&ProviderKey, (u32, u32)> = BTreeMap::new();
        for w in &self.queue {
            for key in self.models.get(&w.model).into_iter().flatten() {
                if self.providers.get(key).is_some_and(Provider::live) {
                    let e = pressure.entry(key).or_default();
                    e.0 += 1;
                    e.1 += u32::from(w.long);
                }
            }
        }
        self.order
            .iter()
            .filter_map(|key| self.providers.get(key))
            .map(|p| {
                let mut s = ProviderSnapshot {
                    provider_id: p.spec.key.provider_id.clone(),
                    node_id: p.spec.key.node_id.clone(),
                    adapter: p.spec.adapter.clone(),
                    target: p.spec.target.clone(),
                    category: p.spec.category.clone(),
                    enabled: p.spec.enabled,
                    ..Default::default()
                };
                if p.generation.is_none() {
                    s.status = "unavailable".into();
                    s.health = "offline".into();
                } else if p.overlay.is_some() {
                    s.status = "unavailable".into();
                    s.health = "unavailable".into();
                } else if p.excluded {
                    // Not selected, but its running requests are still counted, so an operator
                    // can see when it has drained.
                    s.status = "unavailable".into();
                    s.health = "unavailable".into();
                    s.in_flight = p.in_flight;
                    s.long_in_flight = p.long_in_flight;
                } else {
                    let (queued, long_queued) =
                        pressure.get(&p.spec.key).copied().unwrap_or_default();
                    s.status = if p.spec.enabled {
                        "available".into()
                    } else {
                        "unavailable".into()
                    };
                    s.health = "healthy".into();
                    s.capacity = p.spec.capacity;
                    s.long_context_capacity = p.spec.long_context_capacity;
                    s.in_flight = p.in_flight;
                    s.long_in_flight = p.long_in_flight;
                    s.queued = queued;
                    s.long_queued = long_queued;
                }
                s
            })
            .collect()
    }

    // === internals ===

    fn grant(&mut self, model: &str, long: bool) -> Option<Lease> {
        let candidates = self.models.get(model)?;
        let best = candidates
            .iter()
            .enumerate()
            .filter_map(|(i, k)| {
                self.providers
                    .get(k)
                    .filter(|p| p.has_room(long))
                    .map(|p| (i, p))
            })
            // Least loaded by in_flight / capacity (cross-multiplied), then configuration order.
            .min_by(|(ia, a), (ib, b)| {
                (u64::from(a.in_flight) * u64::from(b.spec.capacity))
                    .cmp(&(u64::from(b.in_flight) * u64::from(a.spec.capacity)))
                    .then(ia.cmp(ib))
            })
            .map(|(_, p)| p.spec.key.clone())?;
        let p = self.providers.get_mut(&best)?;
        let generation = p.generation?;
        p.in_flight += 1;
        if long {
            p.long_in_flight += 1;
        }
        let lease = Lease {
            id: LeaseId(self.next_lease),
            key: best,
            generation,
            long_context: long,
            adapter: p.spec.adapter.clone(),
            target: p.spec.target.clone(),
            kind: p.spec.kind,
            response_stall_timeout: p.spec.response_stall_timeout,
        };
        self.next_lease += 1;
        self.leases.insert(lease.id, lease.clone());
        Some(lease)
    }

    /// Grants every waiter that can be granted, in FIFO order.
    fn pump(&mut self) {
        let mut i = 0;
        while i < self.queue.len() {
            let (model, long) = (self.queue[i].model.clone(), self.queue[i].long);
            match self.grant(&model, long) {
                Some(lease) => {
                    let w = self.queue.remove(i).expect("index in bounds");
                    self.events.push_back(PoolEvent::Granted {
                        request: w.id,
                        lease,
                    });
                }
                None => i += 1,
            }
        }
    }
}

#[cfg(test)]
mod tests;
