//! The driver of the managed binding loop: runs one request's
//! [`ManagedBinding`](iop_edge_core::binding::ManagedBinding) and awaits what each step asks
//! for (a lease from the Control Plane, a newer projection, a live session, a re-admission).
//! Every rule, and every deadline, is the machine's; this module only reads the clock and
//! waits.

use std::sync::Arc;

use iop_edge_core::binding::{
    AdmittedNode, LeaseOutcome, ManagedBinding, NodeTrust, Refusal, Step,
};
use iop_edge_core::projection::ProjectionIndex;
use iop_edge_core::registry::Generation;
use iop_wire::runtime::{CredentialLease, CredentialLeaseBinding};

use crate::control::{ControlConnector, LeaseError};
use crate::{Admission, EdgeHandle};

impl NodeTrust for EdgeHandle {
    fn trusts(&self, node_id: &str, generation: Generation, issuer_key_id: &str) -> bool {
        self.node_trusts(node_id, generation, issuer_key_id)
    }
}

/// The admitted provider as the binding machine sees it.
pub(crate) fn admitted_node(admission: &Admission) -> AdmittedNode {
    let lease = admission.lease();
    AdmittedNode {
        node_id: lease.key.node_id.clone(),
        generation: lease.generation,
        kind: lease.kind,
        target: lease.target.clone(),
        recipient_key_id: admission.recipient().map(|r| r.key_id.clone()),
    }
}

/// What [`Binder::run`] stopped at.
pub(crate) enum Run {
    /// Bound: the admission it goes to, its binding and the lease for it.
    Bound(Box<(Admission, CredentialLeaseBinding, CredentialLease)>),
    /// The machine asks for a re-admission: give this admission back, admit the request once
    /// more, then [`Binder::readmitted`] and run again.
    Readmit(Admission),
    /// The machine refused the request.
    Refused(Refusal),
}

/// One managed request's binding loop and what it awaits.
pub(crate) struct Binder<'a> {
    control: &'a ControlConnector,
    edge: &'a EdgeHandle,
    machine: ManagedBinding,
    admission: Option<Admission>,
    step: Step,
    /// Where lease acquisition spans go, and their parent (the dispatch attempt's context).
    telemetry: Option<(iop_telemetry::Telemetry, iop_wire::trace::TraceContext)>,
    /// How many times the binding waited for a newer projection (a stale binding re-bound).
    pub(crate) rebinds: u32,
}

impl<'a> Binder<'a> {
    /// Binds `admission` for `token` (authenticated as `principal` under `index`) asking for
    /// `model`.
    pub(crate) fn new(
        control: &'a ControlConnector,
        edge: &'a EdgeHandle,
        index: Arc<ProjectionIndex>,
        principal: &str,
        token: &str,
        model: &str,
        admission: Admission,
    ) -> Self {
        let mut machine = ManagedBinding::new(
            control.binding_config(),
            index,
            principal,
            token,
            model,
            admitted_node(&admission),
        );
        let step = machine.start(edge);
        Self {
            control,
            edge,
            machine,
            admission: Some(admission),
            step,
            telemetry: None,
            rebinds: 0,
        }
    }

    /// Each lease acquisition becomes a span, a child of `attempt` (sent to the Control Plane
    /// on the lease request, so its span joins the trace).
    pub(crate) fn traced(
        mut self,
        telemetry: &iop_telemetry::Telemetry,
        attempt: &iop_telemetry::Span,
    ) -> Self {
        if telemetry.is_on()
            && let Some(parent) = attempt.context()
        {
            self.telemetry = Some((telemetry.clone(), parent));
        }
        self
    }

    /// The new admission after a [`Run::Readmit`], and whether its provider takes the request
    /// as built (same kind, upstream target and protocol profile).
    pub(crate) fn readmitted(&mut self, admission: Admission, same_request: bool) {
        let node = admitted_node(&admission);
        self.admission = Some(admission);
        self.step = self
            .machine
            .handle_readmitted(node, same_request, self.edge);
    }

    /// Drives the machine until it binds, refuses or asks for a re-admission.
    pub(crate) async fn run(&mut self) -> Run {
        let (control, edge) = (self.control, self.edge);
        let mut granted = None;
        loop {
            let step = std::mem::replace(&mut self.step, Step::Refuse(Refusal::ApiMisuse));
            self.step = match step {
                Step::Acquire(binding) => {
                    // The machine refuses an admitted Node without a recipient key before any
                    // lease is asked.
                    let Some(key) = self
                        .admission
                        .as_ref()
                        .and_then(|a| a.recipient().map(|r| r.public_key))
                    else {
                        return Run::Refused(Refusal::ApiMisuse);
                    };
                    granted = None;
                    let mut span = match &self.telemetry {
                        Some((t, parent)) => t.span(
                            "lease acquire",
                            iop_telemetry::SpanKind::Client,
                            Some(parent),
                            vec![
                                iop_telemetry::attr::node_id(binding.node_id.clone()),
                                iop_telemetry::KeyValue::new(
                                    "iop.route.id",
                                    binding.route_id.clone(),
                                ),
                            ],
                        ),
                        None => iop_telemetry::Span::none(),
                    };
                    let trace = span.context().filter(|_| span.is_recording());
                    let outcome = match control.acquire_lease_traced(binding, key, trace).await {
                        Ok(lease) => {
                            granted = Some(lease);
                            LeaseOutcome::Granted
                        }
                        Err(LeaseError::Refused(reason)) => {
                            span.fail("lease_refused");
                            LeaseOutcome::Refused(reason)
                        }
                        Err(LeaseError::NotConnected | LeaseError::NoAnswer) => {
                            span.fail("control_plane_unreachable");
                            LeaseOutcome::Unreachable
                        }
                        Err(LeaseError::Disabled) => LeaseOutcome::Disabled,
                    };
                    drop(span);
                    self.machine
                        .handle_lease(now(), outcome, control.projection(), edge)
                }
                Step::AwaitProjection { after, until } => {
                    self.rebinds += 1;
                    let left = until.saturating_duration_since(now());
                    let newer = control.projection_after(after, left).await;
                    self.machine.handle_projection(newer, edge)
                }
                Step::AwaitConnected { until } => {
                    let left = until.saturating_duration_since(now());
                    let current = if control.connected_within(left).await {
                        control.projection()
                    } else {
                        None
                    };
                    self.machine.handle_connected(current, edge)
                }
                Step::Readmit => {
                    return match self.admission.take() {
                        Some(a) => Run::Readmit(a),
                        None => Run::Refused(Refusal::ApiMisuse),
                    };
                }
                Step::Dispatch(binding) => {
                    return match (self.admission.take(), granted) {
                        (Some(a), Some(lease)) => Run::Bound(Box::new((a, binding, lease))),
                        _ => Run::Refused(Refusal::ApiMisuse),
                    };
                }
                Step::Refuse(refusal) => return Run::Refused(refusal),
            };
        }
    }
}

/// The driver's clock (tokio's, so paused-time tests move it).
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}
