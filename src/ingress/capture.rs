//! A checkpoint's copy of the acknowledged samples the ingress holds ([`Ingress::capture`]).
//!
//! Every acknowledged sample not in the backend is in a
//! drainer's round (popped, not yet inserted: the rows after its `done` count) or in a
//! connection's queue. A checkpoint calls `capture` at the backend's snapshot moment (the FIFO
//! ring frozen with every reservation committed; a replay table under its lock), when no
//! drainer can move a sample into the backend, so each acknowledged sample is in exactly one
//! of the two: the snapshot or the capture. A drainer's round and connection list sit behind
//! its `state` lock: the drainer writes them between inserts and holds a read lock while it
//! inserts (also while it waits for room), so `capture` reads them beside it. Queues cannot be
//! read in place, so `capture` moves their samples into the connection's `stash`, which the
//! drainer empties, in order, before it pops the queue again: a connection's order is kept.
//! Each connection also records how many of its queued samples the checkpoint holds
//! (`Connection::captured`): what durable sessions are told is persisted.

use super::{Connection, Ingress, StepMark};
use crate::queued::QueuedSamples;
use crate::source::StepTag;

use std::sync::atomic::Ordering::Relaxed;

impl Ingress {
    /// Copies every acknowledged sample that is not in the backend: each drainer's round past
    /// what the backend took in, then each connection's queued samples, a connection's samples
    /// in the order they arrived. Call it only at a backend's snapshot moment, when no drainer
    /// can move a sample into the backend (see the module docs): the FIFO ring's
    /// `Store::checkpoint_with`, a replay table's `Table::checkpoint_with`. Drainers go on
    /// afterwards, the samples stay queued.
    pub fn capture(&self) -> QueuedSamples {
        let mut out = QueuedSamples::new(self.backend.spec().payload_size());
        for drainer in &self.drainers {
            {
                // `read_recursive`: never waits behind the drainer asking for the write lock
                // while it or we hold a read lock (it does not while it inserts).
                let state = drainer.state.read_recursive();
                // ORDERING: Relaxed — the backend's snapshot moment orders the drainer's count
                // before us: the FIFO commit that follows it (Release) was seen with Acquire
                // before `capture` runs, a replay table counts under the lock we hold.
                let done = drainer.done.load(Relaxed).min(state.bufs.len());
                for i in done..state.bufs.len() {
                    let (mark, conn) = (state.marks[i], &state.conns[state.owners[i]]);
                    let step = StepTag { stream: conn.stream(mark.row), end: mark.end };
                    out.push_step(&state.bufs[i], state.priorities[i], step);
                }
                let incoming = drainer.incoming.lock().clone();
                for conn in state.conns.iter().chain(&incoming) {
                    conn.stash_queued(|buf, priority, mark| {
                        let step = StepTag { stream: conn.stream(mark.row), end: mark.end };
                        out.push_step(buf, priority, step);
                    });
                }
            }
            // It may sleep with nothing in its queues any more: the stash is work too.
            drainer.bell.wake();
        }
        out
    }
}

impl Connection {
    /// For [`Ingress::capture`], under the drainer's `state` lock: moves every queued sample to
    /// the stash and calls `each` with every stashed one, oldest first.
    fn stash_queued(&self, mut each: impl FnMut(&[u8], Option<f64>, StepMark)) {
        let mut stash = self.stash.lock();
        while let Some(item) = self.queue.pop() {
            stash.push_back(item);
        }
        // ORDERING: Relaxed — see `stashed`.
        self.stashed.store(stash.len(), Relaxed);
        // ORDERING: Relaxed — `dequeued` is exact under the `state` lock we hold (the drainer
        // writes it under the write lock); `captured` is read by the checkpoint's thread, which
        // runs this.
        // `inserted_direct` is ordered by the backend's snapshot moment, as the drainer's
        // `done` is.
        let captured =
            self.dequeued.load(Relaxed) + stash.len() as u64 + self.inserted_direct.load(Relaxed);
        self.captured.store(captured, Relaxed);
        for (buf, _, priority, mark, _) in stash.iter() {
            each(buf, *priority, *mark);
        }
        drop(stash);
        // The queue has room again: a transport task may wait for it.
        self.waker.wake();
    }
}
