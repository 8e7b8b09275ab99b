//! Routes and timers: opening runs and tunnels, admission through the pool, routing by
//! transport identity `(node_id, generation)`, response-wait and slow-consumer timers, cancels.

use std::time::Instant;

use super::*;
use crate::pool::ContextSize;

impl<S: Sinks> EdgeCore<S> {
    /// Opens a stream on the current ready generation of `node_id` (no pool).
    pub fn open(
        &mut self,
        now: Instant,
        node_id: &str,
        open: Open<S>,
    ) -> Result<Opened, DispatchError> {
        let opened = self.open_stream(now, node_id.to_owned(), open);
        self.settle(now);
        opened
    }

    /// Admission through the pool: a live candidate of `model` with capacity, or a place in the
    /// bounded queue for up to `wait`.
    pub fn admit(
        &mut self,
        now: Instant,
        model: &str,
        context: ContextSize,
        wait: Duration,
    ) -> Result<Admit, DispatchError> {
        let Some(pool) = self.pool.as_mut() else {
            return Err(DispatchError::UnknownModel);
        };
        let result = match pool.submit(now, model, context.is_long(), wait) {
            Ok(Submitted::Granted(lease)) => Ok(Admit::Granted(self.admitted(lease))),
            Ok(Submitted::Queued(id)) => Ok(Admit::Queued(id)),
            Err(PoolError::QueueFull) => Err(DispatchError::QueueFull),
            Err(_) => Err(DispatchError::UnknownModel),
        };
        self.settle(now);
        result
    }

    /// Sends a request on an admitted provider: adapter, target and stall timeout come from the
    /// lease, which the stream holds until its terminal (or its generation's fence). Fails with
    /// [`DispatchError::Disconnected`] when the lease is no longer held (its generation was
    /// fenced meanwhile, releasing it); any other failure releases it.
    pub fn send_admitted(
        &mut self,
        now: Instant,
        lease: &Lease,
        open: Open<S>,
    ) -> Result<Opened, DispatchError> {
        let held = self
            .pool
            .as_ref()
            .and_then(|p| p.lease(lease.id))
            .is_some_and(|l| l == lease);
        if !held {
            return Err(DispatchError::Disconnected);
        }
        let open = match open {
            Open::Run { mut request, sink } => {
                request.adapter.clone_from(&lease.adapter);
                request.target.clone_from(&lease.target);
                request.response_stall_timeout = stall(lease.response_stall_timeout);
                Open::Run { request, sink }
            }
            Open::Tunnel {
                mut request,
                sink,
                response_wait,
            } => {
                request.adapter.clone_from(&lease.adapter);
                request.target.clone_from(&lease.target);
                request.response_stall_timeout = stall(lease.response_stall_timeout);
                Open::Tunnel {
                    request,
                    sink,
                    response_wait,
                }
            }
        };
        let opened = self.open_stream(now, lease.key.node_id.clone(), open);
        match &opened {
            Ok(o) => {
                if let Some(route) = self.routes.get_mut(&o.stream_id) {
                    route.lease = Some(lease.id);
                }
            }
            Err(_) => self.release(now, lease.id),
        }
        self.settle(now);
        opened
    }

    /// Releases a provider lease not sent on (an admission dropped). A no-op if it was already
    /// released.
    pub fn release(&mut self, now: Instant, lease: LeaseId) {
        if let Some(pool) = self.pool.as_mut() {
            pool.release(lease);
        }
        self.settle(now);
    }

    /// Ends a stream for its caller (it went away before the terminal) and asks the Node to stop
    /// the provider work.
    pub fn end_stream(&mut self, now: Instant, stream_id: u64, reason: &str) {
        self.end_route(now, stream_id, reason);
        self.settle(now);
    }

    /// Asks `node_id` to cancel `run_id` (its terminal then arrives on the run's stream).
    pub fn cancel(&mut self, now: Instant, node_id: &str, run_id: &str, reason: &str) {
        if let Some((_, generation)) = self.registry.ready_generation(node_id) {
            let cancel = RuntimeMessage::CancelRequest(CancelRequest {
                run_id: run_id.to_owned(),
                reason: reason.to_owned(),
            });
            let _ = self
                .registry
                .send(now, node_id, generation, RuntimeFrame::new(cancel));
        }
        self.settle(now);
    }

    /// The reader of tunnel `stream_id` consumed `bytes` credit bytes of its body: the Node may
    /// send that much more ([`RuntimeMessage::StreamWindowUpdate`]). A no-op for a stream that
    /// ended or was opened without a window.
    pub fn grant(&mut self, now: Instant, stream_id: u64, bytes: u64) {
        if let Some(route) = self.routes.get(&stream_id)
            && route.credit
            && bytes > 0
        {
            let update =
                RuntimeFrame::on_stream(stream_id, RuntimeMessage::StreamWindowUpdate(bytes));
            let _ = self
                .registry
                .send(now, &route.node_id, route.generation, update);
        }
        self.settle(now);
    }

    pub(super) fn admitted(&self, lease: Lease) -> Admitted {
        let recipient = self
            .registration(&lease.key.node_id)
            .filter(|r| r.generation == lease.generation)
            .and_then(|r| r.recipient.clone());
        Admitted { lease, recipient }
    }

    /// Ends a route for its caller and cancels the run on the Node.
    pub(super) fn end_route(&mut self, now: Instant, stream_id: u64, reason: &str) {
        if let Some(route) = self.take_route(stream_id) {
            let cancel = RuntimeMessage::CancelRequest(CancelRequest {
                run_id: route.run_id,
                reason: reason.into(),
            });
            let _ = self.registry.send(
                now,
                &route.node_id,
                route.generation,
                RuntimeFrame::new(cancel),
            );
        }
    }

    /// After an event of `size` bytes was queued on `stream_id` leaving `level`: over the byte
    /// bound the stream ends now; with bytes unread, the slow-consumer timer runs.
    ///
    /// An event over the bound on its own ends its stream too, whatever the reader does: the
    /// bound is on what one stream may hold. Our Node never sends one (it cuts deltas and
    /// bodies to `iop_node::MAX_FRAME_PAYLOAD`); the log line names it apart from a reader that
    /// fell behind.
    pub(super) fn watch_level(&mut self, now: Instant, stream_id: u64, level: Level, size: usize) {
        if level.bytes > self.config.max_stream_buffer {
            if level.bytes == size
                && let Some(route) = self.routes.get(&stream_id)
            {
                tracing::warn!(
                    node_id = %route.node_id,
                    run_id = %route.run_id,
                    event_bytes = size,
                    stream_buffer_bytes = self.config.max_stream_buffer,
                    "one event from the Node is larger than a stream's buffer on its own"
                );
            }
            self.slow_consumer(now, stream_id);
        } else if level.bytes > 0 && !self.slow.contains_key(&stream_id) {
            self.look_again(now, stream_id, level.reads, now);
        }
    }

    /// A stream with unread bytes is looked at four times per slow-consumer timeout, so one
    /// whose reader stopped is ended between one timeout and 1.25 timeouts after its last read
    /// (a timer per stream, not per read).
    fn look_again(&mut self, now: Instant, stream_id: u64, reads: u64, quiet_since: Instant) {
        let at = now + self.config.slow_consumer_timeout / 4;
        self.slow.insert(stream_id, (at, reads, quiet_since));
        self.slow_timers.insert((at, stream_id));
    }

    pub(super) fn slow_consumer(&mut self, now: Instant, stream_id: u64) {
        if let Some(route) = self.routes.get(&stream_id) {
            route.sink.slow_consumer();
            self.observer.slow_consumer();
            tracing::info!(
                node_id = %route.node_id,
                run_id = %route.run_id,
                "stream ended: its reader fell behind (slow consumer); cancelling upstream"
            );
            self.end_route(now, stream_id, "slow_consumer");
        }
    }

    /// Looks again at streams that held unread bytes: caught up (timer off), read since the
    /// last look (quiet from now), or unread and quiet for the whole timeout (ended).
    pub(super) fn expire_slow(&mut self, now: Instant) {
        while let Some(&(at, stream_id)) = self.slow_timers.first() {
            if at > now {
                break;
            }
            self.slow_timers.pop_first();
            let Some((_, reads_then, quiet_since)) = self.slow.remove(&stream_id) else {
                continue;
            };
            let Some(level) = self.routes.get(&stream_id).map(|r| r.sink.level()) else {
                continue;
            };
            if level.bytes == 0 {
                continue;
            }
            if level.reads > reads_then {
                self.look_again(now, stream_id, level.reads, now);
            } else if now.duration_since(quiet_since) >= self.config.slow_consumer_timeout {
                self.slow_consumer(now, stream_id);
            } else {
                self.look_again(now, stream_id, reads_then, quiet_since);
            }
        }
    }

    /// Ends a route: forgets it, closes its tunnel ordering state and releases its provider
    /// lease (a no-op if a fence already released it).
    pub(super) fn take_route(&mut self, stream_id: u64) -> Option<Route<S>> {
        let route = self.routes.remove(&stream_id)?;
        if let Some((at, ..)) = self.slow.remove(&stream_id) {
            self.slow_timers.remove(&(at, stream_id));
        }
        if let Some(at) = self.waiting.remove(&stream_id) {
            self.wait_timers.remove(&(at, stream_id));
        }
        self.tunnels.close(stream_id);
        if let (Some(lease), Some(pool)) = (route.lease, self.pool.as_mut()) {
            pool.release(lease);
        }
        Some(route)
    }

    /// Ends tunnels whose response did not start in time, and cancels them on the Node.
    pub(super) fn expire_waits(&mut self, now: Instant) {
        while let Some(&(at, stream_id)) = self.wait_timers.first() {
            if at > now {
                break;
            }
            self.wait_timers.pop_first();
            self.waiting.remove(&stream_id);
            if let Some(Route {
                sink: Sink::Tunnel(tx),
                ..
            }) = self.routes.get(&stream_id)
            {
                let _ = tx.push(TunnelEvent::WaitTimeout, 0);
                self.end_route(now, stream_id, "caller_disconnected");
            }
        }
    }

    /// Sends a stream's opening frame to the ready generation of `node_id` and routes its
    /// answers to its sink.
    pub(super) fn open_stream(
        &mut self,
        now: Instant,
        node_id: String,
        open: Open<S>,
    ) -> Result<Opened, DispatchError> {
        let (_, generation) = self
            .registry
            .ready_generation(&node_id)
            .ok_or(DispatchError::NotReady)?;
        let stream_id = self.next_stream;
        self.next_stream += 1;
        let (run_id, sink, frame, response_wait, credit_window) = match open {
            Open::Run { request, sink } => (
                request.run_id.clone(),
                Sink::Run(sink),
                RuntimeFrame::on_stream(stream_id, RuntimeMessage::RunRequest(request)),
                None,
                0,
            ),
            Open::Tunnel {
                mut request,
                sink,
                response_wait,
            } => {
                if self.tunnels.open(stream_id).is_err() {
                    return Err(DispatchError::NotReady);
                }
                // Credit only for a Node that said it honours it: an older Node would not know
                // the window update message.
                let credit = self
                    .registration(&node_id)
                    .is_some_and(|r| r.generation == generation && r.stream_credit);
                let credit_window = if credit {
                    self.config.effective_stream_window()
                } else {
                    0
                };
                request.credit_window = credit_window;
                (
                    request.run_id.clone(),
                    Sink::Tunnel(sink),
                    RuntimeFrame::on_stream(
                        stream_id,
                        RuntimeMessage::ProviderTunnelRequest(request),
                    ),
                    response_wait,
                    credit_window,
                )
            }
        };
        if let Err(e) = self.registry.send(now, &node_id, generation, frame) {
            self.tunnels.close(stream_id);
            return Err(match e {
                SendError::Invalid(_) => DispatchError::InvalidRequest,
                SendError::TooLarge { len, max } => DispatchError::TooLarge { len, max },
                _ => DispatchError::NotReady,
            });
        }
        if let Some(wait) = response_wait {
            let at = now + wait;
            self.wait_timers.insert((at, stream_id));
            self.waiting.insert(stream_id, at);
        }
        self.routes.insert(
            stream_id,
            Route {
                node_id,
                generation,
                run_id,
                sink,
                lease: None,
                credit: credit_window > 0,
            },
        );
        Ok(Opened {
            stream_id,
            generation,
            credit_window,
        })
    }

    pub(super) fn route(
        &mut self,
        now: Instant,
        node_id: &str,
        generation: Generation,
        frame: RuntimeFrame,
    ) {
        let stream_id = frame.stream_id;
        match frame.message {
            RuntimeMessage::RunEvent(mut ev) => {
                let Some(route) = self.routes.get(&stream_id) else {
                    return;
                };
                // Transport identity, not payload identity, decides where a frame belongs.
                if route.node_id != node_id || route.generation != generation {
                    return;
                }
                let Sink::Run(_) = &route.sink else { return };
                let lease = route.lease;
                if ev.kind == RunEventKind::Error
                    && let Some(evidence) = ev.execution_failure.clone()
                {
                    self.handoff(now, lease, generation, &evidence, &mut ev.metadata);
                }
                let Some(Route {
                    sink: Sink::Run(tx),
                    ..
                }) = self.routes.get(&stream_id)
                else {
                    return;
                };
                let terminal = ev.kind.is_terminal();
                let size = run_event_size(&ev);
                let delivered = tx.push(ev, size);
                if terminal {
                    self.take_route(stream_id);
                } else {
                    match delivered {
                        Some(level) => self.watch_level(now, stream_id, level, size),
                        None => self.end_route(now, stream_id, "caller_disconnected"),
                    }
                }
            }
            RuntimeMessage::ProviderTunnelFrame(tf) => {
                let Some(route) = self.routes.get(&stream_id) else {
                    return;
                };
                if route.node_id != node_id || route.generation != generation {
                    return;
                }
                let Sink::Tunnel(_) = &route.sink else {
                    return;
                };
                // The response has started arriving: its wait timer is done.
                if let Some(at) = self.waiting.remove(&stream_id) {
                    self.wait_timers.remove(&(at, stream_id));
                }
                let lease = route.lease;
                let mut event = match self.tunnels.handle_frame(stream_id, tf) {
                    Ok(delivery) => TunnelEvent::Frame(delivery),
                    Err(TunnelError::Violation(v)) => TunnelEvent::Violation(v),
                    Err(_) => return,
                };
                if let TunnelEvent::Frame(Delivery::Error {
                    execution_failure: Some(evidence),
                    metadata,
                    ..
                }) = &mut event
                {
                    let evidence = evidence.clone();
                    self.handoff(now, lease, generation, &evidence, metadata);
                }
                let Some(Route {
                    sink: Sink::Tunnel(tx),
                    ..
                }) = self.routes.get(&stream_id)
                else {
                    return;
                };
                let terminal = event.is_terminal();
                let violation = matches!(event, TunnelEvent::Violation(_));
                // A body is a view of the frame that carried it, which shares its allocation
                // with the connection's read buffer: held in a backlog, one small body could
                // keep a much larger block alive. When the reader is already behind, the body
                // is copied out into a block of its own, so the backlog holds what it counts.
                // A reader that keeps up never pays the copy.
                if let TunnelEvent::Frame(Delivery::Body(body)) = &mut event
                    && tx.level().bytes > 0
                {
                    *body = bytes::Bytes::copy_from_slice(body);
                }
                let size = tunnel_event_size(&event);
                let delivered = tx.push(event, size);
                match delivered {
                    // Stop the provider work: the stream is over for the caller.
                    None => self.end_route(now, stream_id, "caller_disconnected"),
                    Some(_) if violation => self.end_route(now, stream_id, "protocol_violation"),
                    Some(_) if terminal => {
                        self.take_route(stream_id);
                    }
                    Some(level) => self.watch_level(now, stream_id, level, size),
                }
            }
            RuntimeMessage::NodeCommandResponse(resp) => {
                let ticket = frame.correlation_id;
                match self.take_pending(ticket, node_id, generation, |p| p != Pending::Refresh) {
                    Some(Pending::Command) => self.events.push_back(Event::Answered {
                        ticket,
                        answer: Answer::Command(Ok(resp)),
                    }),
                    Some(Pending::Recovery) => {
                        let cleared = self.apply_recovery(now, node_id, generation, &resp);
                        self.events.push_back(Event::Answered {
                            ticket,
                            answer: Answer::Recovered(Ok(cleared)),
                        });
                    }
                    Some(Pending::Refresh) | None => {}
                }
            }
            RuntimeMessage::NodeConfigRefreshResponse(resp) => {
                let ticket = frame.correlation_id;
                if self
                    .take_pending(ticket, node_id, generation, |p| p == Pending::Refresh)
                    .is_some()
                {
                    self.events.push_back(Event::Answered {
                        ticket,
                        answer: Answer::Refresh(Ok(resp)),
                    });
                }
            }
            _ => {}
        }
    }
}
