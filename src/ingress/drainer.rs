//! The drainer pool's threads: each owns a subset of the connections, pops their queues in
//! rounds and inserts every round into the backend with one call, then hands the buffers
//! back and prunes connections that are closed and drained.

use super::budget::Packed;
use super::connection::{Connection, DrainerShared, DrainerState, StepMark};
use super::stats::IngressStats;
use super::Ingress;
use crate::error::EchoError;
use crate::metrics::Stamp;
use crate::source::{Payloads, SampleSource, StepTag};
use crate::sync::Arc;

use super::config::LOG_TARGET;
use std::sync::atomic::Ordering::{Relaxed, Release};

/// One drainer round's samples, counted as the backend takes them in (so the counters are
/// right also while the rest of the round waits for room).
struct Round<'a> {
    payloads: Payloads<'a, Box<[u8]>>,
    priorities: &'a [Option<f64>],
    packed: &'a [Option<Packed>],
    /// Per sample: its connection (an index into `conns`) and its row and episode flag.
    owners: &'a [usize],
    marks: &'a [StepMark],
    conns: &'a [Arc<Connection>],
    drainer: &'a DrainerShared,
    stats: &'a IngressStats,
}

impl SampleSource for Round<'_> {
    fn num_samples(&self) -> usize {
        self.payloads.num_samples()
    }
    fn num_leaves(&self, sample: usize) -> usize {
        self.payloads.num_leaves(sample)
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        self.payloads.leaf(sample, leaf)
    }
    fn priority(&self, sample: usize) -> Option<f64> {
        self.priorities[sample]
    }
    fn packed(&self, sample: usize) -> Option<&[u8]> {
        self.packed[sample].as_deref()
    }
    fn shared(&self) -> Option<&(dyn SampleSource + Sync)> {
        self.payloads.shared()
    }
    fn step(&self, sample: usize) -> StepTag {
        let mark = self.marks[sample];
        StepTag { stream: self.conns[self.owners[sample]].stream(mark.row), end: mark.end }
    }
    fn inserted(&self, count: usize) {
        // ORDERING: Relaxed — a checkpoint reads it at the backend's snapshot moment, which
        // orders this after-the-fact: the FIFO store calls us before its Release commit, a
        // replay table under its lock (see `Ingress::capture`).
        self.drainer.done.fetch_add(count, Relaxed);
        self.drainer.inserted.add(count as u64);
        self.stats.pending.sub(count as u64);
    }
}

/// One drainer thread.
pub(super) struct Drainer {
    pub(super) ingress: Arc<Ingress>,
    pub(super) shared: Arc<DrainerShared>,
}

impl Drainer {
    pub(super) fn new(ingress: Arc<Ingress>, shared: Arc<DrainerShared>) -> Self {
        Self { ingress, shared }
    }

    pub(super) fn run(self) {
        while !self.ingress.is_shutting_down() {
            let round_started = Stamp::now();
            let popped = {
                let mut state = self.shared.state.write();
                state.adopt_incoming(&self.shared);
                // ORDERING: Relaxed — under the `state` write lock, which orders it for
                // `capture` (a read lock holder).
                self.shared.done.store(0, Relaxed);
                state.pop_round(&self.shared, &self.ingress)
            };
            if popped == 0 {
                self.shared.state.write().prune(&self.shared);
                self.sleep();
                continue;
            }
            let backend = &self.ingress.backend;
            let inserted = {
                let state = self.shared.state.read();
                // Every buffer is `payload_size` long: connections allocate them so.
                Payloads::new(backend.spec(), &state.bufs).map_err(Into::into).and_then(
                    |payloads| {
                        let round = Round {
                            payloads,
                            priorities: &state.priorities,
                            packed: &state.packed,
                            owners: &state.owners,
                            marks: &state.marks,
                            conns: &state.conns,
                            drainer: &self.shared,
                            stats: &self.ingress.stats,
                        };
                        backend.insert(&round, None, None)
                    },
                )
            };
            match inserted {
                Ok(()) => {}
                Err(err) if matches!(err.error, EchoError::Closed) => return,
                Err(err) => {
                    let dropped = popped - err.inserted;
                    self.ingress.stats.pending.sub(dropped as u64);
                    log::error!(target: LOG_TARGET, "echo drainer: dropping {dropped} samples: {err}");
                }
            }
            {
                let mut state = self.shared.state.write();
                state.recycle();
                state.prune(&self.shared);
            }
            self.ingress.drain_round.record_since(round_started);
        }
    }

    /// Sleeps until a producer pushes, a connection arrives or closes, or shutdown (or, if
    /// set, `idle_park` passes). The last look for work covers every wake source: a push
    /// (`wake_if_sleeping`, the Dekker pair in `doorbell.rs`), a connection to prune, one in
    /// `incoming`, and the shutdown flag.
    fn sleep(&self) {
        let (shared, ingress) = (&self.shared, &self.ingress);
        shared.bell.sleep_unless(
            || {
                shared.state.read().conns.iter().any(|c| c.has_queued() || c.is_drained())
                    || !shared.incoming.lock().is_empty()
                    || ingress.is_shutting_down()
            },
            ingress.config.idle_park,
        );
    }
}

impl DrainerState {
    fn adopt_incoming(&mut self, shared: &DrainerShared) {
        let mut incoming = shared.incoming.lock();
        if !incoming.is_empty() {
            self.conns.append(&mut incoming);
        }
    }

    /// Pops, from every owned connection starting one further than last round, what a
    /// checkpoint stashed and then at most the depth the queue had when the round reached it.
    /// Returns the number popped.
    fn pop_round(&mut self, shared: &DrainerShared, ingress: &Ingress) -> usize {
        let n = self.conns.len();
        let (mut sum, mut max) = (0u64, 0u64);
        if n > 0 {
            self.round = (self.round + 1) % n;
            for k in 0..n {
                let index = (self.round + k) % n;
                let conn = &self.conns[index];
                let mut taken = 0u64;
                if conn.stashed() > 0 {
                    let mut stash = conn.stash.lock();
                    taken += stash.len() as u64;
                    for (buf, pushed, priority, mark, packed) in stash.drain(..) {
                        ingress.queue_dwell.record_since(pushed);
                        self.bufs.push(buf);
                        self.packed.push(packed);
                        self.priorities.push(priority);
                        self.marks.push(mark);
                        self.owners.push(index);
                    }
                    // ORDERING: Relaxed — see `Connection::stashed`.
                    conn.stashed.store(0, Relaxed);
                }
                let depth = conn.queue.len();
                sum += depth as u64;
                max = max.max(depth as u64);
                for _ in 0..depth {
                    let Some((buf, pushed, priority, mark, packed)) = conn.queue.pop() else {
                        break;
                    };
                    ingress.queue_dwell.record_since(pushed);
                    self.bufs.push(buf);
                    self.packed.push(packed);
                    self.priorities.push(priority);
                    self.marks.push(mark);
                    self.owners.push(index);
                    taken += 1;
                }
                // ORDERING: Relaxed — under the `state` write lock, which orders it for
                // `capture` (a read lock holder).
                conn.dequeued.fetch_add(taken, Relaxed);
            }
        }
        shared.depth_sum.set(sum);
        shared.depth_max.set(max);
        self.bufs.len()
    }

    /// Gives this round's buffers back to their connections and wakes each connection once.
    fn recycle(&mut self) {
        let mut last = usize::MAX;
        self.priorities.clear();
        self.marks.clear();
        self.packed.clear();
        for (buf, owner) in self.bufs.drain(..).zip(self.owners.drain(..)) {
            let conn = &self.conns[owner];
            // ORDERING: Release pairs with the Acquire in `Connection::is_idle`: this round's
            // insert (its ring reservations) is done before the count says so.
            conn.unfinished.fetch_sub(1, Release);
            conn.recycle(buf);
            if owner != last {
                if last != usize::MAX {
                    self.conns[last].waker.wake();
                }
                last = owner;
            }
        }
        if last != usize::MAX {
            self.conns[last].waker.wake();
        }
    }

    /// Forgets connections that are closed and fully drained, ending their streams' open
    /// episodes (a sequence table).
    fn prune(&mut self, shared: &DrainerShared) {
        let before = self.conns.len();
        self.conns.retain(|c| {
            let drained = c.is_drained();
            if drained {
                c.end_streams();
            }
            !drained
        });
        let pruned = before - self.conns.len();
        if pruned > 0 {
            shared.load.sub(pruned as u64);
        }
    }
}
