//! The tokio driver of one Edge connection around `iop_wire::node::NodeSession`.
//!
//! One loop per connection (quinn's `ConnectionDriver` shape): feed received frames and timer
//! expiries to the machine, drain its transmits into the socket and its events into adapter
//! work, re-arm one timer. Every run is a task holding a child of the session's cancellation
//! token, so a disconnect cancels every active run.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt as _, StreamExt as _};
use iop_wire::codec::{FrameCodec, TokioCodec};
use iop_wire::node::{
    CloseReason, NodeEvent, NodeSession, NodeSessionConfig, RunRefusal, StreamKind,
};
use iop_wire::runtime::{
    Capability, ConfigRefreshOutcome, FailureEvidence, NodeCommandKind, NodeCommandRequest,
    NodeCommandResponse, NodeConfigPayload, NodeConfigRefreshResponse, ProviderStatus,
    ProviderTunnelRequest, RegisterRequest, RunEvent, RunEventKind, RunRequest, RuntimeFrame,
    RuntimeMessage, TunnelFrame, TunnelPayload,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::Instant;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

use crate::NodeOptions;
use crate::adapter::{
    Budgeted, Gates, Injection, Instance, Instances, Piece, RunEvents, TunnelSink, stream_budget,
};
use crate::credit::Credit;
use crate::exec::{self, Ended, StallIdentity, Watch};
use iop_wire::tunnel_order::TunnelWriter;

/// The read buffer a session starts with (and its write buffer); it grows to the largest frame
/// the Edge sends (as at the Edge, where tokio-util's 8 KiB default was most of an idle
/// connection's memory). Frames are still written in batches of up to a TLS record
/// (`iop_wire::codec::framed`): a tunnel's start, body, usage and end in one write.
const READ_BUFFER: usize = 1024;

/// How long one CAPABILITIES probe may take before it counts as `unknown` (fail closed).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Work finished off the loop, reported back to it.
///
/// Frames are boxed: tokio's bounded channel allocates its slots in blocks of 32 when it is
/// made, and an unboxed `RuntimeFrame` (288 bytes; 664 before the managed credential was
/// boxed) made that 9 KiB (then 21 KiB) per session before the first run.
enum Outbound {
    /// A frame to send (only ever produced after ready).
    Frame(Box<RuntimeFrame>),
    /// A stall terminal: the loop stamps its `health_observation_seq`, then sends it.
    Stamped(Box<RuntimeFrame>),
    /// A run or tunnel ended (its run id and stream id); forget its cancel handle and credit.
    RunDone(String, u64),
    /// Probe results; the loop stamps each with the next `health_observation_seq`.
    Capabilities {
        correlation_id: u64,
        entries: Vec<(String, String, ProviderStatus, String)>,
    },
}

/// How a session ended.
#[derive(Debug)]
pub(crate) struct SessionOutcome {
    pub(crate) reason: CloseReason,
    pub(crate) reached_ready: bool,
}

fn now() -> std::time::Instant {
    Instant::now().into_std()
}

/// Runs one session over an established (TLS) stream until it closes.
pub(crate) async fn run_session<S>(
    stream: S,
    opts: &NodeOptions,
    gates: &Gates,
    shutdown: &CancellationToken,
) -> SessionOutcome
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let codec_limits = FrameCodec::with_max_frame_len(opts.max_frame_len);
    let mut framed = iop_wire::codec::framed(stream, codec_limits, READ_BUFFER);
    let register = RegisterRequest {
        node_id: opts.node_id.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        adapter_types: opts.adapters.types(),
        recipient: opts.recipient.clone(),
        issuer_key_ids: opts
            .credentials
            .as_ref()
            .map(|c| c.issuer_key_ids())
            .unwrap_or_default(),
        stream_credit: true,
    };
    // The session makes a run's start or terminal fit the frames the Edge reads.
    let config = NodeSessionConfig {
        max_frame_len: opts.max_frame_len,
        ..opts.session
    };
    let mut session = NodeSession::new(config, register, now());
    let session_token = CancellationToken::new();
    // Cancels every run of this session however the loop exits.
    let _cancel_runs = session_token.clone().drop_guard();
    let (out_tx, mut out_rx) = mpsc::channel::<Outbound>(1024);
    let mut instances = Instances::default();
    let mut runs: HashMap<String, CancellationToken> = HashMap::new();
    // The credit of tunnels the Edge opened with a window, by stream id.
    let mut credits: HashMap<u64, Arc<Credit>> = HashMap::new();
    let mut reached_ready = false;

    loop {
        // Drain the machine until it is quiet: handling an event may queue frames.
        let mut progressed = true;
        while progressed {
            progressed = false;
            while let Some(frame) = session.poll_transmit() {
                progressed = true;
                if send(&mut framed, frame, codec_limits).await.is_err() {
                    session.handle_transport_closed();
                }
            }
            if framed.flush().await.is_err() {
                session.handle_transport_closed();
            }
            while let Some(event) = session.poll_event() {
                progressed = true;
                match event {
                    NodeEvent::ApplyConfig { config, .. } => {
                        match opts
                            .adapters
                            .build(&config.adapters, &opts.local_keys, gates)
                        {
                            Ok(built) => {
                                instances = built;
                                // Handlers are the arms of this loop: installed once it runs.
                                let _ = session.config_applied(now());
                            }
                            Err(reason) => {
                                tracing::warn!(%reason, "node config rejected");
                                let _ = session.config_failed(reason);
                            }
                        }
                    }
                    NodeEvent::Ready => {
                        reached_ready = true;
                        tracing::info!(node_id = %opts.node_id, "dispatch-ready");
                    }
                    NodeEvent::Frame(frame) => handle_frame(
                        frame,
                        &mut instances,
                        &mut runs,
                        &mut credits,
                        &session_token,
                        &out_tx,
                        opts,
                        gates,
                        &mut session,
                    ),
                    NodeEvent::AnswerReplaced { stream_id, reason } => {
                        tracing::warn!(stream_id, %reason, "a run's start or terminal replaced by an error");
                    }
                    NodeEvent::Closed(reason) => {
                        let _ = framed.close().await;
                        return SessionOutcome {
                            reason,
                            reached_ready,
                        };
                    }
                    _ => {}
                }
            }
        }
        let deadline = session.poll_timeout().map(Instant::from_std);
        tokio::select! {
            biased;
            () = shutdown.cancelled() => session.close_local(),
            frame = framed.next() => match frame {
                Some(Ok(frame)) => {
                    let liveness =
                        matches!(frame.message, RuntimeMessage::Ping | RuntimeMessage::Pong);
                    session.handle_frame(now(), frame);
                    if liveness {
                        iop_wire::codec::release_buffers(&mut framed, READ_BUFFER);
                    }
                }
                Some(Err(iop_wire::codec::CodecError::Frame(e))) => {
                    tracing::warn!(error = %e, "invalid frame from edge");
                    session.handle_invalid_frame();
                }
                _ => session.handle_transport_closed(),
            },
            Some(out) = out_rx.recv() => {
                outbound(out, &mut session, &mut runs, &mut credits);
                // Whatever else is already queued goes out with it: one write and one flush for
                // a burst (a tunnel's start, body and end), not one each.
                for _ in 0..OUTBOUND_BURST {
                    match out_rx.try_recv() {
                        Ok(out) => outbound(out, &mut session, &mut runs, &mut credits),
                        Err(_) => break,
                    }
                }
            }
            () = sleep_until(deadline) => session.handle_timeout(now()),
        }
    }
}

/// A tunnel body at least this long is written from its own buffer, after its frame's head,
/// instead of being copied into the frame buffer first ([`FrameCodec::encode_split`]).
const SPLIT_BODY: usize = 16 * 1024;

/// Queues `frame` for writing, as `SinkExt::feed` does (the frame buffer is flushed first once
/// it holds tokio-util's backpressure boundary). A tunnel body of [`SPLIT_BODY`] or more is
/// not copied into the frame buffer: the buffer is flushed through its head, then the body is
/// written to the stream as it is. On a bulk tunnel that copy was one of the two the Node
/// made of each byte (issue #33); rustls copies it once more as it encrypts.
async fn send<S>(
    framed: &mut Framed<S, TokioCodec<RuntimeFrame>>,
    frame: RuntimeFrame,
    codec: FrameCodec,
) -> Result<(), iop_wire::codec::CodecError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    use futures_util::Sink as _;
    use tokio::io::AsyncWriteExt as _;
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *framed).poll_ready(cx)).await?;
    let mut body = codec.encode_split(frame, SPLIT_BODY, framed.write_buffer_mut())?;
    if !body.is_empty() {
        framed.flush().await?;
        framed.get_mut().write_all_buf(&mut body).await?;
    }
    Ok(())
}

/// Frames and notices from the run and probe tasks, taken at most this many at a time.
const OUTBOUND_BURST: usize = 64;

/// One message from a run, tunnel or probe task.
fn outbound(
    out: Outbound,
    session: &mut NodeSession,
    runs: &mut HashMap<String, CancellationToken>,
    credits: &mut HashMap<u64, Arc<Credit>>,
) {
    match out {
        Outbound::Frame(frame) => {
            // Refused only after the session closed, when the frame has nowhere to go.
            let _ = session.send(now(), *frame);
        }
        Outbound::Stamped(frame) => {
            let _ = session.send_stamped(now(), *frame);
        }
        Outbound::RunDone(run_id, stream_id) => {
            runs.remove(&run_id);
            credits.remove(&stream_id);
            session.run_finished(&run_id);
        }
        Outbound::Capabilities {
            correlation_id,
            entries,
        } => {
            let capabilities = entries
                .into_iter()
                .map(
                    |(adapter_key, target, provider_status, adapter)| Capability {
                        instance_key: adapter_key.clone(),
                        adapter_key,
                        target,
                        provider_status,
                        health_observation_seq: 0, // stamped by the session
                        adapter,
                    },
                )
                .collect();
            let _ = session.send_capabilities(now(), correlation_id, capabilities);
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[allow(
    clippy::too_many_arguments,
    reason = "the session loop's state, borrowed apart"
)]
fn handle_frame(
    frame: RuntimeFrame,
    instances: &mut Instances,
    runs: &mut HashMap<String, CancellationToken>,
    credits: &mut HashMap<u64, Arc<Credit>>,
    session_token: &CancellationToken,
    out_tx: &mpsc::Sender<Outbound>,
    opts: &NodeOptions,
    gates: &Gates,
    session: &mut NodeSession,
) {
    let RuntimeFrame {
        correlation_id,
        stream_id,
        message,
    } = frame;
    match message {
        RuntimeMessage::RunRequest(req) => {
            let settings = ExecSettings::from(opts);
            match admit(
                instances,
                runs,
                session_token,
                session,
                &req.adapter,
                &req.run_id,
            ) {
                Ok((instance, permit, token)) => {
                    let out = out_tx.clone();
                    // Boxed: the execution's state is several KiB, moved once into the heap
                    // rather than copied into the task cell and again out of it.
                    tokio::spawn(Box::pin(run_task(
                        stream_id, req, instance, permit, token, out, settings,
                    )));
                }
                Err(error) => {
                    let _ = session.refuse(now(), stream_id, StreamKind::Run, error);
                }
            }
        }
        RuntimeMessage::StreamWindowUpdate(bytes) => {
            // An update may cross the tunnel's terminal: an unknown stream is no error.
            if let Some(credit) = credits.get(&stream_id) {
                credit.grant(bytes);
            }
        }
        RuntimeMessage::CancelRequest(cancel) => {
            if let Some(token) = runs.get(&cancel.run_id) {
                token.cancel();
            }
        }
        RuntimeMessage::NodeCommandRequest(cmd) => {
            command(
                correlation_id,
                cmd,
                instances,
                runs.len(),
                out_tx,
                opts,
                session,
            );
        }
        RuntimeMessage::NodeConfigRefreshRequest(config) => {
            let resp = refresh(&config, instances, opts, gates);
            let _ = session.send(
                now(),
                RuntimeFrame::correlated(
                    correlation_id,
                    RuntimeMessage::NodeConfigRefreshResponse(resp),
                ),
            );
        }
        RuntimeMessage::ProviderTunnelRequest(req) => {
            let settings = ExecSettings::from(opts);
            match admit(
                instances,
                runs,
                session_token,
                session,
                &req.adapter,
                &req.run_id,
            ) {
                Ok((instance, permit, token)) => {
                    let out = out_tx.clone();
                    let credit = (req.credit_window > 0).then(|| {
                        let credit = Arc::new(Credit::new(req.credit_window));
                        credits.insert(stream_id, credit.clone());
                        credit
                    });
                    tokio::spawn(Box::pin(tunnel_task(
                        stream_id, req, instance, permit, token, out, settings, credit,
                    )));
                }
                Err(error) => {
                    let _ = session.refuse(now(), stream_id, StreamKind::Tunnel, error);
                }
            }
        }
        _ => {}
    }
}

impl From<&NodeOptions> for ExecSettings {
    fn from(opts: &NodeOptions) -> Self {
        Self {
            close_grace: opts.close_grace,
            node_id: opts.node_id.clone(),
            credentials: opts.credentials.clone(),
            telemetry: opts.telemetry.clone(),
        }
    }
}

/// Admission shared by runs and tunnels: the run id (by the session: unique among the runs in
/// progress on this connection), the adapter instance, a permit of its capacity gate, and a
/// fresh cancel token registered under the run id — or the stable refusal text.
fn admit(
    instances: &Instances,
    runs: &mut HashMap<String, CancellationToken>,
    session_token: &CancellationToken,
    session: &mut NodeSession,
    adapter: &str,
    run_id: &str,
) -> Result<(Arc<Instance>, OwnedSemaphorePermit, CancellationToken), &'static str> {
    let instance = instances.resolve(adapter).ok_or("unknown adapter")?;
    session.admit_run(run_id).map_err(|e| match e {
        RunRefusal::DuplicateRunId => "duplicate run id",
        _ => "session not ready",
    })?;
    let Some(permit) = instance.gate.try_admit() else {
        session.run_finished(run_id);
        return Err(iop_wire::runtime::REFUSED_CAPACITY_EXHAUSTED);
    };
    let token = session_token.child_token();
    runs.insert(run_id.to_owned(), token.clone());
    Ok((instance, permit, token))
}

/// Applies a refresh by rebuilding every adapter instance: `Applied`, or `Failed` with the old
/// instances kept. Nothing in a `NodeConfigPayload` needs a restart here (see the crate docs),
/// so this Node never answers `RestartRequired`.
fn refresh(
    config: &NodeConfigPayload,
    instances: &mut Instances,
    opts: &NodeOptions,
    gates: &Gates,
) -> NodeConfigRefreshResponse {
    match opts
        .adapters
        .build(&config.adapters, &opts.local_keys, gates)
    {
        Ok(built) => {
            // Runs in flight keep their `Arc<Instance>` until they finish.
            *instances = built;
            NodeConfigRefreshResponse {
                outcome: ConfigRefreshOutcome::Applied,
                reason: String::new(),
                revision: config.revision,
            }
        }
        Err(reason) => NodeConfigRefreshResponse {
            outcome: ConfigRefreshOutcome::Failed,
            reason,
            revision: config.revision,
        },
    }
}

fn command(
    correlation_id: u64,
    cmd: NodeCommandRequest,
    instances: &Instances,
    active_runs: usize,
    out_tx: &mpsc::Sender<Outbound>,
    opts: &NodeOptions,
    session: &mut NodeSession,
) {
    match cmd.kind {
        NodeCommandKind::Capabilities => {
            let mut probes = Vec::new();
            for (key, inst) in &instances.by_key {
                if !cmd.adapter.is_empty() && cmd.adapter != *key {
                    continue;
                }
                for target in &inst.config.targets {
                    if cmd.target.is_empty() || cmd.target == *target {
                        probes.push((key.clone(), target.clone(), inst.clone()));
                    }
                }
            }
            let out_tx = out_tx.clone();
            tokio::spawn(async move {
                let mut entries = Vec::with_capacity(probes.len());
                for (key, target, inst) in probes {
                    let status = tokio::time::timeout(
                        PROBE_TIMEOUT,
                        inst.adapter.probe(&target, inst.credential.as_ref()),
                    )
                    .await
                    .unwrap_or(ProviderStatus::Unknown);
                    entries.push((key, target, status, inst.config.adapter_type.clone()));
                }
                let _ = out_tx
                    .send(Outbound::Capabilities {
                        correlation_id,
                        entries,
                    })
                    .await;
            });
        }
        NodeCommandKind::Transport => {
            let result = [
                ("node_id".to_owned(), opts.node_id.clone()),
                ("state".to_owned(), "ready".to_owned()),
                ("active_runs".to_owned(), active_runs.to_string()),
            ]
            .into_iter()
            .collect();
            let resp = NodeCommandResponse {
                ok: true,
                result,
                ..Default::default()
            };
            let _ = session.send(
                now(),
                RuntimeFrame::correlated(correlation_id, RuntimeMessage::NodeCommandResponse(resp)),
            );
        }
        NodeCommandKind::ProviderLifecycle => {
            let result = instances
                .by_key
                .iter()
                .map(|(k, i)| {
                    (
                        k.clone(),
                        format!(
                            "in_flight={} capacity={}",
                            i.gate.in_flight(),
                            i.gate.capacity()
                        ),
                    )
                })
                .collect();
            let resp = NodeCommandResponse {
                ok: true,
                result,
                ..Default::default()
            };
            let _ = session.send(
                now(),
                RuntimeFrame::correlated(correlation_id, RuntimeMessage::NodeCommandResponse(resp)),
            );
        }
    }
}

/// Settings every execution task needs.
#[derive(Clone, Debug)]
pub(crate) struct ExecSettings {
    pub(crate) close_grace: Duration,
    /// This Node's id and, in managed mode, its credential plane.
    pub(crate) node_id: String,
    pub(crate) credentials: Option<Arc<crate::credential::CredentialPlane>>,
    pub(crate) telemetry: iop_telemetry::Telemetry,
}

/// A run's or tunnel's `execute` span (a child of the Edge's attempt on the wire) and its
/// provider call span (a child of that); the request's trace becomes the provider span's
/// context, which the adapter sends as `traceparent`.
fn node_spans(
    t: &iop_telemetry::Telemetry,
    parent: Option<&iop_wire::trace::TraceContext>,
    run_id: &str,
    instance: &Instance,
    target: &str,
    operation: &'static str,
) -> (iop_telemetry::Span, iop_telemetry::Span) {
    use iop_telemetry::{SpanKind, attr};
    if !t.is_on() {
        let exec = t.span("execute", SpanKind::Server, parent, Vec::new());
        let provider = t.child(&exec, "provider", SpanKind::Client, Vec::new());
        return (exec, provider);
    }
    // Shared by both spans: one allocation for the name.
    let model = iop_telemetry::KeyValue::new(
        "gen_ai.request.model",
        iop_telemetry::StringValue::from(Arc::<str>::from(target)),
    );
    let exec = t.span(
        "execute",
        SpanKind::Server,
        parent,
        iop_telemetry::attributes([
            attr::run_id(run_id.to_owned()),
            instance.trace.adapter.clone(),
            model.clone(),
        ]),
    );
    let mut attributes = Vec::with_capacity(7 + instance.trace.server.len());
    attributes.extend([
        attr::operation(operation),
        instance.trace.provider.clone(),
        model,
    ]);
    attributes.extend(instance.trace.server.iter().cloned());
    let provider = t.child(
        &exec,
        format!("{operation} {target}"),
        SpanKind::Client,
        attributes,
    );
    (exec, provider)
}

/// The context the adapter sends to the provider: the provider span's, keeping the Edge's
/// per-adapter `to_provider` choice.
fn provider_trace(
    provider: &iop_telemetry::Span,
    incoming: Option<&iop_wire::trace::TraceContext>,
) -> Option<Box<iop_wire::trace::TraceContext>> {
    let mut c = provider.context()?;
    c.to_provider = incoming.is_none_or(|i| i.to_provider);
    Some(Box::new(c))
}

/// What a tunnel's spans show: the provider's status and (input, output) tokens.
type Seen = (Option<u16>, Option<(u64, u64)>);

/// The GenAI operation name of a tunnel operation.
fn genai_operation(op: iop_wire::runtime::Operation) -> &'static str {
    use iop_wire::runtime::Operation as O;
    match op {
        O::ChatCompletions | O::Messages | O::Responses => "chat",
        O::CountTokens => "count_tokens",
        O::Models => "models",
    }
}

/// How an execution ended, on its spans.
fn end_spans<T, E>(
    exec: &mut iop_telemetry::Span,
    provider: &mut iop_telemetry::Span,
    ended: &Ended<Result<T, E>>,
) {
    match ended {
        Ended::Stalled(_) => {
            exec.event("response_stalled", Vec::new());
            exec.fail("response_stalled");
            provider.fail("response_stalled");
        }
        Ended::Cancelled => {
            exec.event("cancelled", Vec::new());
            exec.fail("cancelled");
            provider.fail("cancelled");
        }
        Ended::Deadline => {
            exec.fail("deadline_exceeded");
            provider.fail("deadline_exceeded");
        }
        Ended::Returned(Ok(Ok(_))) => {}
        Ended::Returned(_) => {
            exec.fail("provider_error");
            provider.fail("provider_error");
        }
    }
}

fn stamped(frame: RuntimeFrame) -> Outbound {
    Outbound::Stamped(Box::new(frame))
}

impl Outbound {
    fn frame(frame: RuntimeFrame) -> Self {
        Self::Frame(Box::new(frame))
    }
}

/// One normalized run: START, the adapter's deltas, exactly one terminal.
async fn run_task(
    stream_id: u64,
    req: RunRequest,
    instance: Arc<Instance>,
    permit: OwnedSemaphorePermit,
    cancel: CancellationToken,
    out: mpsc::Sender<Outbound>,
    settings: ExecSettings,
) {
    let run_id = req.run_id.clone();
    let ident = StallIdentity {
        run_id: run_id.clone(),
        attempt_id: exec::attempt_id(),
        adapter: instance.config.instance_key().to_owned(),
        target: req.target.clone(),
    };
    let fence = CancellationToken::new();
    let watch = Watch {
        cancel: &cancel,
        fence: fence.clone(),
        deadline: req.timeout.map(|t| Instant::now() + t),
        stall_timeout: req.response_stall_timeout.effective(),
        close_grace: settings.close_grace,
        probe_timeout: PROBE_TIMEOUT,
        credit: None,
    };
    let event = |ev: RunEvent| RuntimeFrame::on_stream(stream_id, RuntimeMessage::RunEvent(ev));
    let _ = out
        .send(Outbound::frame(event(RunEvent::new(RunEventKind::Start))))
        .await;
    let (dtx, drx) = mpsc::channel::<Budgeted<String>>(64);
    let budget = stream_budget();
    let (mut exec_span, mut provider_span) = node_spans(
        &settings.telemetry,
        req.trace.as_deref(),
        &run_id,
        &instance,
        &req.target,
        "chat",
    );
    let mut req = req;
    req.trace = provider_trace(&provider_span, req.trace.as_deref());
    let provider_started = Instant::now();
    let work = {
        let instance = instance.clone();
        exec::work(async move {
            instance
                .adapter
                .run(req, RunEvents::new(dtx, budget, fence))
                .await
        })
    };
    let target = ident.target.clone();
    let probe = || async move {
        instance
            .adapter
            .probe(&target, instance.credential.as_ref())
            .await
    };
    // The byte budget is given back as the delta moves on to the connection writer.
    let forward = |(text, _budget): Budgeted<String>| {
        let mut ev = RunEvent::new(RunEventKind::Delta);
        ev.delta = text;
        Some(Outbound::frame(event(ev)))
    };
    let ended = exec::supervise(work, drx, forward, &out, watch, permit, probe, ident).await;
    end_spans(&mut exec_span, &mut provider_span, &ended);
    if let Ended::Returned(Ok(Ok(done))) = &ended
        && let Some(u) = &done.usage
    {
        for span in [&mut provider_span, &mut exec_span] {
            span.set(iop_telemetry::attr::input_tokens(u.prompt_tokens));
            span.set(iop_telemetry::attr::output_tokens(u.completion_tokens));
        }
    }
    drop(provider_span);
    drop(exec_span);
    let terminal = match ended {
        Ended::Cancelled => Outbound::frame(event(RunEvent::new(RunEventKind::Cancelled))),
        Ended::Deadline => {
            let mut ev = RunEvent::new(RunEventKind::Error);
            ev.error = "deadline exceeded".into();
            Outbound::frame(event(ev))
        }
        Ended::Stalled(failure) => {
            let mut ev = RunEvent::new(RunEventKind::Error);
            ev.error = exec::RESPONSE_STALLED.into();
            ev.execution_failure = Some(FailureEvidence::Valid(*failure));
            stamped(event(ev))
        }
        Ended::Returned(Ok(Ok(done))) => {
            let mut ev = RunEvent::new(RunEventKind::Complete);
            ev.metadata = done.metadata;
            ev.metadata.insert(
                iop_wire::runtime::METADATA_PROVIDER_US.to_owned(),
                provider_started.elapsed().as_micros().to_string(),
            );
            ev.usage = done.usage;
            Outbound::frame(event(ev))
        }
        Ended::Returned(Ok(Err(e))) => {
            let mut ev = RunEvent::new(RunEventKind::Error);
            ev.error = e.to_string();
            Outbound::frame(event(ev))
        }
        Ended::Returned(Err(_)) => {
            let mut ev = RunEvent::new(RunEventKind::Error);
            ev.error = "adapter failed".into();
            Outbound::frame(event(ev))
        }
    };
    let _ = out.send(terminal).await;
    let _ = out.send(Outbound::RunDone(run_id, stream_id)).await;
}

/// One provider tunnel: the adapter's frames, numbered, then exactly one terminal.
#[expect(
    clippy::too_many_arguments,
    reason = "one call site: what the session loop hands each tunnel"
)]
async fn tunnel_task(
    stream_id: u64,
    req: ProviderTunnelRequest,
    instance: Arc<Instance>,
    permit: OwnedSemaphorePermit,
    cancel: CancellationToken,
    out: mpsc::Sender<Outbound>,
    settings: ExecSettings,
    credit: Option<Arc<Credit>>,
) {
    let run_id = req.run_id.clone();
    let ident = StallIdentity {
        run_id: run_id.clone(),
        attempt_id: exec::attempt_id(),
        adapter: instance.config.instance_key().to_owned(),
        target: req.target.clone(),
    };
    let fence = CancellationToken::new();
    let watch = Watch {
        cancel: &cancel,
        fence: fence.clone(),
        deadline: req.timeout.map(|t| Instant::now() + t),
        stall_timeout: req.response_stall_timeout.effective(),
        close_grace: settings.close_grace,
        probe_timeout: PROBE_TIMEOUT,
        credit: credit.clone(),
    };
    let frame =
        |f: TunnelFrame| RuntimeFrame::on_stream(stream_id, RuntimeMessage::ProviderTunnelFrame(f));
    // Shared by the forwarding closure and the terminal below; never contended.
    let writer = std::sync::Mutex::new(TunnelWriter::new());
    let numbered = |payload: TunnelPayload| {
        writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .frame(payload)
    };
    // Managed mode: open the lease now — after capacity admission (the permit is held),
    // immediately before the provider call — or end the tunnel without calling the provider.
    let mut req = req;
    let credential = match &settings.credentials {
        None => instance.credential.clone().map(Injection::Local),
        Some(plane) => {
            let profile = match &instance.config.settings {
                iop_wire::runtime::AdapterSettings::OpenAiCompat(s) => {
                    s.protocol_profile.name.as_str()
                }
                _ => "",
            };
            match plane.open(
                &settings.node_id,
                profile,
                &req,
                iop_wire::time::unix_ms(std::time::SystemTime::now()),
            ) {
                Ok(c) => Some(Injection::Lease(c)),
                Err(rejected) => {
                    tracing::info!(target: "iop_node", event = "node_credential_rejected", run_id = %run_id, trace_id = %req.trace.as_deref().map(iop_wire::trace::TraceContext::trace_id_hex).unwrap_or_default(), reason = %rejected, "managed tunnel refused");
                    drop(permit);
                    let terminal = TunnelPayload::Error {
                        error: rejected.to_string(),
                        execution_failure: None,
                    };
                    if let Some(f) = numbered(terminal) {
                        let _ = out.send(Outbound::frame(frame(f))).await;
                    }
                    let _ = out.send(Outbound::RunDone(run_id, stream_id)).await;
                    return;
                }
            }
        }
    };
    // The envelope has served its purpose; the adapter never sees it.
    req.credential = None;
    let (mut exec_span, mut provider_span) = node_spans(
        &settings.telemetry,
        req.trace.as_deref(),
        &run_id,
        &instance,
        &req.target,
        req.operation.map_or("http", genai_operation),
    );
    req.trace = provider_trace(&provider_span, req.trace.as_deref());
    let (ftx, frx) = mpsc::channel::<Budgeted<Piece>>(64);
    let budget = stream_budget();
    let provider_started = Instant::now();
    let work = {
        let instance = instance.clone();
        exec::work(async move {
            instance
                .adapter
                .tunnel(req, TunnelSink::new(ftx, budget, fence, credential, credit))
                .await
        })
    };
    let target = ident.target.clone();
    let probe = || async move {
        instance
            .adapter
            .probe(&target, instance.credential.as_ref())
            .await
    };
    // The writer refuses out-of-order payloads from a misbehaving adapter.
    // The byte budget is given back as the payload moves on to the connection writer.
    // The status and usage the spans show; like `writer`, never contended.
    let seen: std::sync::Mutex<Seen> = std::sync::Mutex::default();
    let forward = |(piece, _budget): Budgeted<Piece>| {
        if settings.telemetry.is_on() {
            let mut seen = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match &piece {
                Piece::Start { status, .. } => seen.0 = Some(*status),
                Piece::Usage(u) => seen.1 = Some((u.prompt_tokens, u.completion_tokens)),
                Piece::Body(_) => {}
            }
        }
        numbered(piece.into()).map(|f| Outbound::frame(frame(f)))
    };
    let ended = exec::supervise(work, frx, forward, &out, watch, permit, probe, ident).await;
    end_spans(&mut exec_span, &mut provider_span, &ended);
    let (status, usage) = *seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for span in [&mut provider_span, &mut exec_span] {
        if let Some(status) = status {
            span.set(iop_telemetry::attr::http_status(status));
            if status >= 400 {
                span.fail("provider_status");
            }
        }
        if let Some((input, output)) = usage {
            span.set(iop_telemetry::attr::input_tokens(input));
            span.set(iop_telemetry::attr::output_tokens(output));
        }
    }
    drop(provider_span);
    drop(exec_span);
    let error = |text: &str, execution_failure| TunnelPayload::Error {
        error: text.to_owned(),
        execution_failure,
    };
    let started = writer
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .is_started();
    let (terminal, stamp) = match ended {
        Ended::Cancelled => (error("cancelled", None), false),
        Ended::Deadline => (error("deadline exceeded", None), false),
        Ended::Stalled(failure) => (
            error(
                exec::RESPONSE_STALLED,
                Some(FailureEvidence::Valid(*failure)),
            ),
            true,
        ),
        Ended::Returned(Ok(Ok(()))) if started => (TunnelPayload::End, false),
        Ended::Returned(Ok(Ok(()))) => (error("provider sent no response", None), false),
        Ended::Returned(Ok(Err(e))) => (error(&e.to_string(), None), false),
        Ended::Returned(Err(_)) => (error("adapter failed", None), false),
    };
    let provider_us = provider_started.elapsed().as_micros().to_string();
    let last = numbered(terminal).map(|mut f| {
        f.metadata.insert(
            iop_wire::runtime::METADATA_PROVIDER_US.to_owned(),
            provider_us,
        );
        f
    });
    if let Some(f) = last {
        let f = frame(f);
        let _ = out
            .send(if stamp {
                stamped(f)
            } else {
                Outbound::frame(f)
            })
            .await;
    }
    let _ = out.send(Outbound::RunDone(run_id, stream_id)).await;
}
