//! The managed binding loop (seed `001`), sans-io: how one admitted request gets its credential
//! lease bound to exactly the Node that will serve it.
//!
//! In managed mode the Edge authenticates a request against the principal projection it holds
//! ([`ProjectionIndex`]), admits it through the pool, and then, for the selected Node, builds a
//! [`CredentialLeaseBinding`], asks the Control Plane for a lease for exactly that binding, and
//! checks the binding once more right before dispatch. Every rule of that loop is decided here;
//! the driver (`iop-edge`'s managed module) only awaits what a [`Step`] asks for and feeds the
//! answer back, with `now` from its clock:
//!
//! ```text
//!            start ──► route? ──► target? ──► Node trusts the issuer? ──► admits? ──► Acquire
//!                         │          │                 │ no                              │
//!                     404/403    502/503          Readmit (once) ─► handle_readmitted ──┘ (round again)
//!
//!   Acquire ─► handle_lease: Granted ─► current projection admits? ─► Dispatch
//!                           │            └ newer, before the deadline ─► re-bind (round again)
//!                           ├ Refused(stale_generation | stale_revision) ─► AwaitProjection
//!                           ├ Refused(other) ─► 403
//!                           └ Unreachable ─► AwaitConnected ─► re-bind under the projection then
//! ```
//!
//! - **No refusal windows.** A mutation anywhere in the store moves the projection generation,
//!   so the Control Plane refuses a binding made from an older projection
//!   (`stale_generation`). The request then waits for the newer projection, resolves its route
//!   again and re-binds; the same happens when the projection changed between the lease grant
//!   and the dispatch. It does so as long as each round brings a newer projection and
//!   [`BindingConfig::stale_wait`] has not passed since the first wait of the round began
//!   (one round is enough for one change; a burst can make a binding stale again before its
//!   lease is asked). Only then is it refused: 503 + `Retry-After` while a change is still
//!   propagating, 403 when the new projection no longer gives this token the route.
//! - **The check right before dispatch.** A granted lease is dispatched only if the current
//!   projection still admits its binding (a token revoked or a slot rotated meanwhile fails
//!   closed with 403, unless a newer projection arrived in time: then it is bound again).
//! - **Issuer trust.** A Node that does not pin the key this projection's leases are signed
//!   with ([`NodeTrust`], decided by the Edge's registry) is never sent a lease: the request is
//!   admitted once more (that Node is no longer a candidate) and, if the new provider takes the
//!   same request, bound again under the projection that found the first Node untrusted.
//!
//! Every refusal is a typed [`Refusal`] with its HTTP status and a stable, low-sensitivity
//! message (no token, key or binding detail).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::registry::Generation;
use iop_wire::runtime::CredentialLeaseBinding;

use crate::pool::ProviderKind;
use crate::projection::ProjectionIndex;

/// How long, by default, a request whose binding went stale waits for newer projections
/// before it is refused with 503 + `Retry-After` ([`BindingConfig::stale_wait`]).
pub const DEFAULT_STALE_WAIT: Duration = Duration::from_secs(1);

/// Settings of the binding loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BindingConfig {
    /// How long, in all, a request whose binding the Control Plane found stale (or whose
    /// session went away) waits for a newer projection or a live session, from the first such
    /// wait of a binding round, before it is refused (503). Default [`DEFAULT_STALE_WAIT`].
    /// A lease ask that finds no session, or no answer, once the bound has passed is refused
    /// at once, not waited on again: a session that is up but answers no lease holds a
    /// request for at most two of the driver's lease timeouts and this wait.
    pub stale_wait: Duration,
}

impl Default for BindingConfig {
    fn default() -> Self {
        Self {
            stale_wait: DEFAULT_STALE_WAIT,
        }
    }
}

impl BindingConfig {
    /// The default settings with `stale_wait`.
    pub fn with_stale_wait(stale_wait: Duration) -> Self {
        Self { stale_wait }
    }
}

/// Whether a Node can verify leases signed with an issuer key: the Edge's issuer-trust rule
/// (`EdgeCore::trusts`), asked for the admitted Node's own generation.
pub trait NodeTrust {
    /// Whether Node `node_id`, in `generation`, pins `issuer_key_id` (an empty key id is
    /// trusted: older Control Planes name none).
    fn trusts(&self, node_id: &str, generation: Generation, issuer_key_id: &str) -> bool;
}

/// The admitted provider a request is being bound to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmittedNode {
    /// The selected Node.
    pub node_id: String,
    /// Its generation when admitted.
    pub generation: Generation,
    /// How the provider is reached (only raw tunnels carry a credential).
    pub kind: ProviderKind,
    /// The upstream target the provider serves.
    pub target: String,
    /// The Node's credential recipient key id, if it announced one.
    pub recipient_key_id: Option<String>,
}

/// What the Control Plane answered a lease request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// A lease for exactly the binding (the driver keeps it).
    Granted,
    /// Refused, with the Control Plane's reason code.
    Refused(String),
    /// No session, or no answer in time (a replica went away).
    Unreachable,
    /// The connector is not in managed mode.
    Disabled,
}

/// What the driver must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Step {
    /// Ask the Control Plane for a lease for this binding, then
    /// [`ManagedBinding::handle_lease`] with the answer and the projection current then.
    Acquire(CredentialLeaseBinding),
    /// Wait until `until` for a projection newer than generation `after`, then
    /// [`ManagedBinding::handle_projection`] (`None` when none came in time).
    AwaitProjection {
        /// The generation the new projection must exceed.
        after: u64,
        /// When to stop waiting.
        until: Instant,
    },
    /// Wait until `until` for a live Control Plane session, then
    /// [`ManagedBinding::handle_connected`] with the projection then (`None` when none).
    AwaitConnected {
        /// When to stop waiting.
        until: Instant,
    },
    /// Give the admission back and admit the request once more (the admitted Node does not
    /// trust the issuer key), then [`ManagedBinding::handle_readmitted`].
    Readmit,
    /// Dispatch with the granted lease, for this binding.
    Dispatch(CredentialLeaseBinding),
    /// Refuse the request.
    Refuse(Refusal),
}

/// Why a managed request is refused. [`Refusal::status`] and [`Refusal::message`] are what the
/// client sees.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// 404: the caller's principal has no route for this model.
    UnknownModel,
    /// 502: the admitted provider does not serve the route's upstream target (a bound route is
    /// served only by its own target; no fallback), or cannot carry a credential.
    NoProviderForTarget,
    /// 502: the selected Node announced no credential recipient key.
    NoRecipientKey,
    /// 403: before any lease, the request's own projection no longer admits its binding.
    ScopeChanged,
    /// 403: a newer projection no longer gives this token the route (revoked token, disabled
    /// principal or route).
    Withdrawn,
    /// 403: the lease was granted, but the projection current right before dispatch no longer
    /// admits its binding and no newer one came in time.
    CredentialsChanged,
    /// 403: the Control Plane refused the lease for this reason code.
    LeaseRefused(String),
    /// 503 + `Retry-After: 1`: a change is still propagating; the same request will succeed.
    Propagating,
    /// 503: no Control Plane session (or the connector is not managed).
    ControlPlaneUnavailable,
    /// 500: the driver called a `handle_*` method the last [`Step`] did not ask for.
    ApiMisuse,
}

impl Refusal {
    /// The HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            Self::UnknownModel => 404,
            Self::NoProviderForTarget | Self::NoRecipientKey => 502,
            Self::ScopeChanged
            | Self::Withdrawn
            | Self::CredentialsChanged
            | Self::LeaseRefused(_) => 403,
            Self::Propagating | Self::ControlPlaneUnavailable => 503,
            Self::ApiMisuse => 500,
        }
    }

    /// The `Retry-After` seconds to send, if any.
    pub fn retry_after(&self) -> Option<u32> {
        matches!(self, Self::Propagating).then_some(1)
    }

    /// The client-facing message (stable; names no token, key or binding).
    pub fn message(&self) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            Self::UnknownModel => "model not found",
            Self::NoProviderForTarget => "no provider serves this route's upstream target",
            Self::NoRecipientKey => "selected node has no credential recipient key",
            Self::ScopeChanged => "request scope changed",
            Self::Withdrawn => "access to this model was withdrawn",
            Self::CredentialsChanged => "credentials changed; request refused",
            Self::LeaseRefused(reason) => {
                return Cow::Owned(format!("credential lease refused: {reason}"));
            }
            Self::Propagating => "the credential plane is applying a change; retry the request",
            Self::ControlPlaneUnavailable => "control plane unavailable",
            Self::ApiMisuse => "internal error",
        })
    }
}

/// Lease refusals that mean "this Edge's projection is behind the store" (a mutation is
/// propagating), not "this principal lost access".
pub fn is_propagation(reason: &str) -> bool {
    matches!(reason, "stale_generation" | "stale_revision")
}

/// What the machine waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Awaiting {
    /// `start` not called yet.
    Start,
    Lease,
    Projection,
    Connected,
    Readmission,
    /// A `Dispatch` or `Refuse` was returned.
    Done,
}

/// One managed request's binding loop. Create it after admission with [`ManagedBinding::new`],
/// call [`ManagedBinding::start`], then do what each [`Step`] says and feed the answer to the
/// `handle_*` method it names, until [`Step::Dispatch`] or [`Step::Refuse`]. Only the lease's
/// answer takes `now`: the round's deadline starts at its first wait, and every wait it asks
/// for carries the deadline itself.
#[derive(Debug)]
pub struct ManagedBinding {
    config: BindingConfig,
    principal: String,
    token: String,
    model: String,
    node: AdmittedNode,
    /// The projection this round binds under.
    index: Arc<ProjectionIndex>,
    /// Whether this round has re-bound under a newer projection.
    rebound: bool,
    /// Whether the request was admitted a second time (at most once).
    readmitted: bool,
    /// This round's bound on waiting, set by its first wait.
    deadline: Option<Instant>,
    /// The binding whose lease was asked.
    asked: Option<CredentialLeaseBinding>,
    awaiting: Awaiting,
}

impl ManagedBinding {
    /// A binding loop for `token` (which authenticated as `principal` under `index`) asking for
    /// the external `model`, admitted to `node`.
    pub fn new(
        config: BindingConfig,
        index: Arc<ProjectionIndex>,
        principal: impl Into<String>,
        token: impl Into<String>,
        model: impl Into<String>,
        node: AdmittedNode,
    ) -> Self {
        Self {
            config,
            principal: principal.into(),
            token: token.into(),
            model: model.into(),
            node,
            index,
            rebound: false,
            readmitted: false,
            deadline: None,
            asked: None,
            awaiting: Awaiting::Start,
        }
    }

    /// The Node the request is currently admitted to.
    pub fn node(&self) -> &AdmittedNode {
        &self.node
    }

    /// The projection the current round binds under.
    pub fn projection(&self) -> &Arc<ProjectionIndex> {
        &self.index
    }

    /// The first step.
    pub fn start(&mut self, trust: &impl NodeTrust) -> Step {
        if self.awaiting != Awaiting::Start {
            return self.misuse();
        }
        self.round(trust)
    }

    /// The Control Plane's answer to [`Step::Acquire`], with the projection current now.
    pub fn handle_lease(
        &mut self,
        now: Instant,
        outcome: LeaseOutcome,
        current: Option<Arc<ProjectionIndex>>,
        trust: &impl NodeTrust,
    ) -> Step {
        if self.awaiting != Awaiting::Lease {
            return self.misuse();
        }
        let Some(binding) = self.asked.take() else {
            return self.misuse();
        };
        match outcome {
            LeaseOutcome::Granted => {
                let deadline = self.deadline(now);
                match current {
                    Some(c) if c.admits(&self.token, &self.model, &binding) => {
                        self.done(Step::Dispatch(binding))
                    }
                    Some(c) if c.generation() > self.index.generation() && now < deadline => {
                        self.rebind(c, trust)
                    }
                    _ => self.refuse(Refusal::CredentialsChanged),
                }
            }
            LeaseOutcome::Refused(reason) if is_propagation(&reason) => {
                let until = self.deadline(now);
                self.awaiting = Awaiting::Projection;
                Step::AwaitProjection {
                    after: self.index.generation(),
                    until,
                }
            }
            LeaseOutcome::Refused(reason) => self.refuse(Refusal::LeaseRefused(reason)),
            LeaseOutcome::Unreachable => {
                // No wait begins after the bound: a session that is up but answers no lease
                // would otherwise be asked again, one lease timeout after another.
                if self.deadline.is_some_and(|d| now >= d) {
                    return self.refuse(Refusal::ControlPlaneUnavailable);
                }
                let until = self.deadline(now);
                self.awaiting = Awaiting::Connected;
                Step::AwaitConnected { until }
            }
            LeaseOutcome::Disabled => self.refuse(Refusal::ControlPlaneUnavailable),
        }
    }

    /// The answer to [`Step::AwaitProjection`]: the newer projection, or `None` when none came
    /// before the deadline.
    pub fn handle_projection(
        &mut self,
        newer: Option<Arc<ProjectionIndex>>,
        trust: &impl NodeTrust,
    ) -> Step {
        if self.awaiting != Awaiting::Projection {
            return self.misuse();
        }
        match newer {
            Some(newer) if newer.generation() > self.index.generation() => {
                self.rebind(newer, trust)
            }
            _ => self.refuse(Refusal::Propagating),
        }
    }

    /// The answer to [`Step::AwaitConnected`]: the projection held once a session is live, or
    /// `None` when no session came before the deadline (or it has no projection).
    pub fn handle_connected(
        &mut self,
        current: Option<Arc<ProjectionIndex>>,
        trust: &impl NodeTrust,
    ) -> Step {
        if self.awaiting != Awaiting::Connected {
            return self.misuse();
        }
        match current {
            Some(current) => self.rebind(current, trust),
            None => self.refuse(Refusal::ControlPlaneUnavailable),
        }
    }

    /// The answer to [`Step::Readmit`]: the newly admitted provider, and whether it takes the
    /// request as built (same kind, upstream target and protocol profile); if not, a retry is
    /// admitted afresh (503 + `Retry-After`).
    pub fn handle_readmitted(
        &mut self,
        node: AdmittedNode,
        same_request: bool,
        trust: &impl NodeTrust,
    ) -> Step {
        if self.awaiting != Awaiting::Readmission {
            return self.misuse();
        }
        if !same_request {
            return self.refuse(Refusal::Propagating);
        }
        self.node = node;
        self.readmitted = true;
        self.rebound = false;
        self.deadline = None;
        self.round(trust)
    }

    // === internals ===

    /// A binding round against the Node as admitted: checks that hold for the whole round,
    /// then the first bind.
    fn round(&mut self, trust: &impl NodeTrust) -> Step {
        if self.node.kind != ProviderKind::OpenAiCompat {
            return self.refuse(Refusal::NoProviderForTarget);
        }
        if self.node.recipient_key_id.is_none() {
            return self.refuse(Refusal::NoRecipientKey);
        }
        self.bind(trust)
    }

    /// Binds under `newer`, which must still authenticate the token as the same principal (a
    /// revoked token or a disabled principal is refused as at the door).
    fn rebind(&mut self, newer: Arc<ProjectionIndex>, trust: &impl NodeTrust) -> Step {
        if newer.authenticate(&self.token) != Some(self.principal.as_str()) {
            return self.refuse(Refusal::Withdrawn);
        }
        self.index = newer;
        self.rebound = true;
        self.bind(trust)
    }

    /// Resolves the route under the round's projection and asks for the lease.
    fn bind(&mut self, trust: &impl NodeTrust) -> Step {
        let Some(route) = self.index.route(&self.principal, &self.model) else {
            return self.refuse(if self.rebound {
                Refusal::Withdrawn
            } else {
                Refusal::UnknownModel
            });
        };
        if self.node.target != route.upstream_target {
            // After a re-bind this is a route moved to another target: a retry is admitted
            // afresh.
            return self.refuse(if self.rebound {
                Refusal::Propagating
            } else {
                Refusal::NoProviderForTarget
            });
        }
        let binding = CredentialLeaseBinding {
            principal_id: self.principal.clone(),
            slot_id: route.slot_id.clone(),
            route_id: route.route_id.clone(),
            profile: route.profile.clone(),
            upstream_target: route.upstream_target.clone(),
            node_id: self.node.node_id.clone(),
            recipient_key_id: self.node.recipient_key_id.clone().unwrap_or_default(),
            credential_revision: route.credential_revision,
            route_revision: route.route_revision,
            projection_generation: self.index.generation(),
        };
        if !trust.trusts(
            &self.node.node_id,
            self.node.generation,
            self.index.issuer_key_id(),
        ) {
            // Its lease would be signed with a key the Node cannot verify.
            if self.readmitted {
                return self.refuse(Refusal::Propagating);
            }
            self.awaiting = Awaiting::Readmission;
            return Step::Readmit;
        }
        if !self.index.admits(&self.token, &self.model, &binding) {
            return self.refuse(if self.rebound {
                Refusal::Withdrawn
            } else {
                Refusal::ScopeChanged
            });
        }
        self.asked = Some(binding.clone());
        self.awaiting = Awaiting::Lease;
        Step::Acquire(binding)
    }

    /// The round's deadline, set by its first wait.
    fn deadline(&mut self, now: Instant) -> Instant {
        *self
            .deadline
            .get_or_insert_with(|| now + self.config.stale_wait)
    }

    fn refuse(&mut self, refusal: Refusal) -> Step {
        self.done(Step::Refuse(refusal))
    }

    fn done(&mut self, step: Step) -> Step {
        self.awaiting = Awaiting::Done;
        step
    }

    fn misuse(&mut self) -> Step {
        self.refuse(Refusal::ApiMisuse)
    }
}
