//! The per-stream buffer between the Edge's machine and a stream's reader ([`RunStream`],
//! [`TunnelStream`]): a queue whose unread events are counted by the memory they hold (the
//! machine's `run_event_size`/`tunnel_event_size`: queue slot and heap blocks, not only the
//! payload), so that a reader that falls behind costs at most a bounded amount of memory.
//!
//! The writer never waits (it is the connection task that read the frame, holding the machine's
//! lock: waiting for one slow reader would stall every stream of that Node and the machine); instead it sees how many bytes are
//! unread after each push and how many reads happened, and decides (see `transport`): over the
//! byte bound, or no read progress for the slow-consumer timeout while bytes are unread, the
//! stream is ended — the queue is emptied and replaced by one terminal — and cancelled
//! upstream. The reader counts its reads; it never reads a clock.
//!
//! [`RunStream`]: crate::RunStream
//! [`TunnelStream`]: crate::TunnelStream

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

#[derive(Debug)]
struct Inner<T> {
    queue: VecDeque<(T, usize)>,
    bytes: usize,
    reads: u64,
    writer_gone: bool,
    reader_gone: bool,
}

#[derive(Debug)]
struct Shared<T> {
    inner: Mutex<Inner<T>>,
    readable: Notify,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The writing half.
#[derive(Debug)]
pub(crate) struct StreamTx<T> {
    shared: Arc<Shared<T>>,
}

/// The reading half.
#[derive(Debug)]
pub(crate) struct StreamRx<T> {
    shared: Arc<Shared<T>>,
}

/// A new buffer.
pub(crate) fn channel<T>() -> (StreamTx<T>, StreamRx<T>) {
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner {
            queue: VecDeque::new(),
            bytes: 0,
            reads: 0,
            writer_gone: false,
            reader_gone: false,
        }),
        readable: Notify::new(),
    });
    (
        StreamTx {
            shared: shared.clone(),
        },
        StreamRx { shared },
    )
}

pub(crate) use iop_edge_core::Level;

impl<T> StreamTx<T> {
    /// Queues `item` counted as `size` bytes. `None` when the reader is gone.
    pub(crate) fn push(&self, item: T, size: usize) -> Option<Level> {
        let mut inner = self.shared.lock();
        if inner.reader_gone {
            return None;
        }
        inner.queue.push_back((item, size));
        inner.bytes += size;
        let level = Level {
            bytes: inner.bytes,
            reads: inner.reads,
        };
        drop(inner);
        self.shared.readable.notify_one();
        Some(level)
    }

    /// Drops everything unread and queues `terminal` alone: the reader's next item ends the
    /// stream, and the memory of what it did not read is freed now.
    pub(crate) fn replace_with(&self, terminal: T) {
        let mut inner = self.shared.lock();
        inner.queue.clear();
        inner.queue.push_back((terminal, 0));
        inner.bytes = 0;
        drop(inner);
        self.shared.readable.notify_one();
    }

    /// The current level.
    pub(crate) fn level(&self) -> Level {
        let inner = self.shared.lock();
        Level {
            bytes: inner.bytes,
            reads: inner.reads,
        }
    }
}

impl<T> Drop for StreamTx<T> {
    fn drop(&mut self) {
        self.shared.lock().writer_gone = true;
        self.shared.readable.notify_one();
    }
}

impl<T> StreamRx<T> {
    /// The next item; `None` once the writer is gone and everything was read.
    pub(crate) async fn recv(&mut self) -> Option<T> {
        loop {
            let notified = self.shared.readable.notified();
            tokio::pin!(notified);
            // Registered before looking, so a push in between is not missed.
            notified.as_mut().enable();
            {
                let mut inner = self.shared.lock();
                if let Some((item, size)) = inner.queue.pop_front() {
                    inner.bytes -= size;
                    inner.reads += 1;
                    return Some(item);
                }
                if inner.writer_gone {
                    return None;
                }
            }
            notified.await;
        }
    }
}

impl<T> Drop for StreamRx<T> {
    fn drop(&mut self) {
        let mut inner = self.shared.lock();
        inner.reader_gone = true;
        inner.queue.clear();
        inner.bytes = 0;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_and_reads_are_counted_and_a_replacement_frees_the_backlog() {
        let (tx, mut rx) = channel::<&str>();
        assert_eq!(
            tx.push("a", 10),
            Some(Level {
                bytes: 10,
                reads: 0
            })
        );
        assert_eq!(
            tx.push("b", 5),
            Some(Level {
                bytes: 15,
                reads: 0
            })
        );
        assert_eq!(rx.recv().await, Some("a"));
        assert_eq!(tx.level(), Level { bytes: 5, reads: 1 });
        tx.push("c", 7);
        tx.replace_with("end");
        assert_eq!(tx.level().bytes, 0);
        assert_eq!(rx.recv().await, Some("end"));
        drop(tx);
        assert_eq!(rx.recv().await, None);
    }

    #[tokio::test]
    async fn a_waiting_reader_wakes_and_a_gone_reader_refuses_pushes() {
        let (tx, mut rx) = channel::<u32>();
        let reader = tokio::spawn(async move {
            let first = rx.recv().await;
            (first, rx)
        });
        tokio::task::yield_now().await;
        tx.push(7, 1);
        let (first, rx) = reader.await.unwrap();
        assert_eq!(first, Some(7));
        drop(rx);
        assert_eq!(tx.push(8, 1), None);
    }
}
