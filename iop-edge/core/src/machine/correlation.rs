//! Commands, config refreshes and recovery probes, paired with their answers by correlation id
//! (a fence fails the pending ones of its generation).

use std::time::Instant;

use super::*;

impl<S: Sinks> EdgeCore<S> {
    /// Sends a command to a ready Node; its answer comes as [`Event::Answered`] with the
    /// returned ticket.
    pub fn command(
        &mut self,
        now: Instant,
        node_id: &str,
        request: NodeCommandRequest,
    ) -> Result<u64, DispatchError> {
        self.correlated(
            now,
            node_id,
            RuntimeMessage::NodeCommandRequest(request),
            Pending::Command,
        )
    }

    /// Pushes a config refresh to a ready Node; its outcome comes as [`Event::Answered`].
    pub fn refresh(
        &mut self,
        now: Instant,
        node_id: &str,
        config: NodeConfigPayload,
    ) -> Result<u64, DispatchError> {
        self.correlated(
            now,
            node_id,
            RuntimeMessage::NodeConfigRefreshRequest(config),
            Pending::Refresh,
        )
    }

    /// CAPABILITIES recovery probe of `node_id`: each runtime-unavailable overlay of the Node's
    /// current generation is cleared only by a higher-sequence `available` answer naming exactly
    /// one provider binding. The count of cleared overlays comes as [`Event::Answered`].
    pub fn recover(&mut self, now: Instant, node_id: &str) -> Result<u64, DispatchError> {
        let probe = NodeCommandRequest {
            kind: NodeCommandKind::Capabilities,
            adapter: String::new(),
            target: String::new(),
        };
        self.correlated(
            now,
            node_id,
            RuntimeMessage::NodeCommandRequest(probe),
            Pending::Recovery,
        )
    }

    pub(super) fn correlated(
        &mut self,
        now: Instant,
        node_id: &str,
        message: RuntimeMessage,
        pending: Pending,
    ) -> Result<u64, DispatchError> {
        let (_, generation) = self
            .registry
            .ready_generation(node_id)
            .ok_or(DispatchError::NotReady)?;
        let id = self.next_correlation;
        self.next_correlation += 1;
        self.registry
            .send(
                now,
                node_id,
                generation,
                RuntimeFrame::correlated(id, message),
            )
            .map_err(|_| DispatchError::NotReady)?;
        self.pending
            .insert(id, (node_id.to_owned(), generation, pending));
        self.settle(now);
        Ok(id)
    }

    /// Takes the pending request `id` if the frame came from the generation it was sent to and
    /// answers its kind; anything else is not its answer (it stays, until its answer or fence).
    pub(super) fn take_pending(
        &mut self,
        id: u64,
        node_id: &str,
        generation: Generation,
        answers: impl Fn(Pending) -> bool,
    ) -> Option<Pending> {
        let matches = self
            .pending
            .get(&id)
            .is_some_and(|(n, g, p)| n == node_id && *g == generation && answers(*p));
        if matches {
            self.pending.remove(&id).map(|(_, _, p)| p)
        } else {
            None
        }
    }
}
