//! One client connection as the ingress sees it: its queue of filled buffers, its pool of
//! empty ones, the streams its rows feed, and the ways its transport task hands samples over
//! (pushed for a drainer, written in place, or inserted directly from shared memory).
//!
//! A connection and the drainer that owns it point at each other (it rings its drainer's
//! bell; the drainer holds its connections), so the drainer's shared record
//! ([`DrainerShared`], [`DrainerState`]) is defined here too; what the drainer thread does
//! with them is in `drainer.rs`.

use std::collections::{HashSet, VecDeque};

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};

use super::budget::{BudgetHold, ByteBudget, Packed};
use super::stats::IngressStats;
use crate::backend::Backend;
use crate::doorbell::Doorbell;
use crate::metrics::{Counter, Stamp};
use crate::source::{EpisodeEnd, SampleSource, StepTag};
use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// What a transport task waits on when its connection has no free buffer or queue slot.
pub trait SpaceWaker: Send + Sync {
    /// A buffer or queue slot came free.
    fn wake(&self);
}

/// A queued sample: its buffer, push time, priority, step mark, and its compressed leaves as
/// they arrived when the backend keeps them so (see [`Connection::try_push_packed`]).
pub(super) type Queued = (Box<[u8]>, Stamp, Option<f64>, StepMark, Option<Packed>);

/// Which of its connection's streams a sample is a step of, and whether it ends its episode
/// (sequence tables; other backends ignore it). A connection's row `r` is the backend's stream
/// [`Connection::stream`]`(r)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepMark {
    /// The connection's row: row `i` of a client's `send_batch`, 0 otherwise.
    pub row: u32,
    /// Whether the step ends its episode.
    pub end: EpisodeEnd,
}

/// One client connection's queue and buffer pool, shared by its transport task and drainer.
pub struct Connection {
    /// Filled payloads in arrival order, with their push time (zero-sized without
    /// `detailed-metrics`). Producer: the transport task; consumer: the drainer (and
    /// [`Ingress::capture`](super::Ingress::capture), which moves them to `stash`).
    pub(super) queue: ArrayQueue<Queued>,
    /// Samples a checkpoint moved out of `queue` (all older than what `queue` holds now). The
    /// drainer takes them before it pops the queue again. Only touched under the drainer's
    /// `state` lock (read for `capture`, write for the drainer), besides this mutex.
    pub(super) stash: Mutex<VecDeque<Queued>>,
    /// `stash.len()`, exact for whoever holds the drainer's `state` lock (see `stash`).
    pub(super) stashed: AtomicUsize,
    /// Samples the drainer took out of `queue` and `stash` into its rounds, ever. Written
    /// under the drainer's `state` write lock, so exact for a holder of its read lock.
    pub(super) dequeued: AtomicU64,
    /// Samples of this connection the transport inserted into the backend itself (read in
    /// place, or taken from its shared-memory segment), counted as a drainer counts its
    /// round: before the FIFO ring's commit, under a replay table's lock.
    pub(super) inserted_direct: AtomicU64,
    /// At the latest [`Ingress::capture`](super::Ingress::capture): how many of this
    /// connection's samples the checkpoint holds (inserted directly, or taken by the drainer
    /// into a round, so in the backend's snapshot or in the capture, or stashed). A
    /// connection's samples keep their order, so these are its first `captured`.
    pub(super) captured: AtomicU64,
    /// Empty buffers ready for reuse. Producer: the drainer; consumer: the transport task.
    pub(super) free: ArrayQueue<Box<[u8]>>,
    /// Buffers of this connection that exist; never exceeds `free.capacity()`.
    pub(super) allocated: AtomicUsize,
    /// Samples pushed and not yet through the backend's insert (queued, or in a drainer's
    /// round). Zero means every sample this connection queued is in the backend, so one
    /// inserted in place now comes after all of them.
    pub(super) unfinished: AtomicUsize,
    pub(super) backend: Backend,
    pub(super) budget: Arc<ByteBudget>,
    pub(super) payload_size: usize,
    /// Set by the transport task when the socket is done; the drainer prunes the connection
    /// once this is set and the queue is empty.
    pub(super) closed: AtomicBool,
    pub(super) drainer: Arc<DrainerShared>,
    pub(super) waker: Box<dyn SpaceWaker>,
    pub(super) stats: Arc<IngressStats>,
    /// The backend stream of row 0 of this connection: `(connection number + 1) << 32`, so
    /// every connection's streams are apart from each other and from in-process streams
    /// (below 2^32).
    pub(super) stream_base: u64,
    /// One more than the largest row a sample of this connection was a step of (0: none
    /// yet): the streams whose open episodes end when the connection is pruned.
    pub(super) rows_used: AtomicU32,
    /// The rows whose streams this connection holds in the byte budget (a sequence table's),
    /// taken by its transport task before a step of a new row is queued
    /// ([`Connection::hold_stream`]), given back when its streams end.
    pub(super) streams: Mutex<RowStreams>,
    /// What one of its streams costs the table ([`Backend::stream_cost`]): 0 without streams.
    pub(super) stream_cost: usize,
    /// Shared-memory connections only (0 on TCP): samples committed to the connection's
    /// segment and not yet in the backend, as its task last looked
    /// ([`Connection::note_segment_depth`]), less those inserted since. The segment is this
    /// connection's queue, so these count in `queue_depth_*` and `samples_pending`. Written
    /// only by the connection's task.
    pub(super) segment_depth: Counter,
}
/// A connection's rows with a stream in the table, and the byte-budget hold that pays for them.
pub(super) struct RowStreams {
    pub(super) rows: HashSet<u32>,
    pub(super) hold: BudgetHold,
}

impl Connection {
    /// Makes sure the byte budget holds what row `row`'s stream costs the table (once per row
    /// of this connection) before a step of it is queued, so that the streams every peer
    /// opens count in `max_buffered_bytes`. `false` when the budget is spent, after
    /// registering to be woken when bytes are freed (wait for [`SpaceWaker::wake`], then
    /// retry). Always `true` for backends without streams.
    pub fn hold_stream(self: &Arc<Self>, row: u32) -> bool {
        if self.stream_cost == 0 {
            return true;
        }
        let mut streams = self.streams.lock();
        if streams.rows.contains(&row) {
            return true;
        }
        if !streams.hold.grow_or_wait(self.stream_cost, self) {
            return false;
        }
        streams.rows.insert(row);
        true
    }

    /// The backend stream that row `row` of this connection feeds.
    pub fn stream(&self, row: u32) -> u64 {
        self.stream_base | u64::from(row)
    }

    /// Records that a sample of `row` went (or goes) into the backend, so that the row's open
    /// episode is ended when this connection is gone for good.
    pub fn note_row(&self, row: u32) {
        // ORDERING: Relaxed — read by the drainer that prunes this connection, after the
        // `closed` Release/Acquire pair (`close`, `is_drained`) orders every earlier write.
        self.rows_used.fetch_max(row.saturating_add(1), Relaxed);
    }

    /// Ends the open episode of every stream this connection fed (as truncated: its worker is
    /// gone for good), once its last sample is in. A no-op for backends without episodes.
    pub(super) fn end_streams(&self) {
        if self.backend.sequence().is_none() {
            return;
        }
        // ORDERING: Relaxed — see `note_row`; the caller saw the connection drained.
        let rows = self.rows_used.load(Relaxed);
        if rows > 0 {
            // The streams of rows below `rows` that the table holds, found in the table: the
            // rows in between that were never used cost nothing.
            let ids = self.stream(0)..=self.stream(rows - 1);
            self.backend.end_streams_in(ids, EpisodeEnd::Truncated);
        }
        // The table forgot them: what they held of the byte budget goes back.
        let mut streams = self.streams.lock();
        streams.rows = HashSet::new();
        streams.hold = BudgetHold::new(&self.budget);
    }

    /// An empty buffer of `payload_size` bytes, from the pool, or newly allocated while the
    /// pool is below its cap and the ingress's byte budget allows. `None` when every buffer
    /// is in use or the budget is spent (wait for [`SpaceWaker::wake`], then retry).
    pub fn take_buffer(self: &Arc<Self>) -> Option<Box<[u8]>> {
        if let Some(buf) = self.free.pop() {
            return Some(buf);
        }
        // ORDERING: Relaxed — only this connection's transport task adds to the count (the
        // drainer only lowers it), and it just bounds how many buffers exist.
        if self.allocated.load(Relaxed) >= self.free.capacity() {
            return None;
        }
        if !self.budget.take_or_wait(self.payload_size, self) {
            return None;
        }
        // ORDERING: Relaxed — see above.
        self.allocated.fetch_add(1, Relaxed);
        Some(vec![0u8; self.payload_size].into_boxed_slice())
    }

    /// An empty hold on the ingress's byte budget, for a buffer this connection's transport
    /// keeps besides its pooled ones (a compressed frame's body, the compressed leaves a
    /// sample carries): every byte a peer makes the learner hold counts in
    /// `max_buffered_bytes`. Grow it with [`Connection::grow_hold`].
    pub fn hold(&self) -> BudgetHold {
        BudgetHold::new(&self.budget)
    }

    /// Adds `more` bytes of the byte budget to `hold` (from [`Connection::hold`]), or
    /// `false` when the budget is spent, after registering this connection to be woken when
    /// bytes are freed (wait for [`SpaceWaker::wake`], then retry).
    pub fn grow_hold(self: &Arc<Self>, hold: &mut BudgetHold, more: usize) -> bool {
        hold.grow_or_wait(more, self)
    }

    /// Gives back a buffer the transport task did not fill (e.g. a partial sample).
    pub fn return_buffer(&self, buf: Box<[u8]>) {
        self.recycle(buf);
    }

    /// Puts an empty buffer back in the pool, or frees it: when the connection is closed (it
    /// will not need it), or when other connections wait for bytes and this one keeps at
    /// least one buffer.
    pub(super) fn recycle(&self, buf: Box<[u8]>) {
        // ORDERING: Relaxed — a hint: a stale answer pools a buffer that could have been freed
        // (freed later, with the connection) or frees one that could have been pooled.
        let spare = self.allocated.load(Relaxed) > 1;
        // ORDERING: Relaxed — also a hint; `close` frees what is pooled after it anyway.
        let closed = self.closed.load(Relaxed);
        if closed || (spare && self.budget.num_waiting.get() > 0) {
            self.free_buffer(buf);
        } else if let Err(buf) = self.free.push(buf) {
            self.free_buffer(buf);
        }
    }

    pub(super) fn free_buffer(&self, buf: Box<[u8]>) {
        drop(buf);
        // ORDERING: Relaxed — see `take_buffer`.
        self.allocated.fetch_sub(1, Relaxed);
        self.budget.release(self.payload_size);
    }

    /// Whether every sample this connection pushed is through the backend's insert: none
    /// queued, none in a drainer's round. For the transport task (the only one that pushes):
    /// a sample it inserts into the backend itself after seeing `true` goes in after all of
    /// them, so the connection's order holds.
    pub fn is_idle(&self) -> bool {
        // ORDERING: Acquire pairs with the drainer's Release decrement after its insert
        // returned: every sample this connection queued was committed (its ring slot
        // reserved, or its table item added) before the caller inserts the next one.
        self.unfinished.load(Acquire) == 0
    }

    /// Queues a filled buffer for the drainer, waking it if it sleeps. Gives the buffer back if
    /// the queue is full (wait for [`SpaceWaker::wake`], then retry).
    pub fn try_push(&self, buf: Box<[u8]>) -> Result<(), Box<[u8]>> {
        self.try_push_with(buf, None)
    }

    /// [`Connection::try_push`] for a sample with its own priority (replay backends; check it
    /// with [`Backend::check_priority`] first: an invalid one fails the drainer's whole round).
    pub fn try_push_with(&self, buf: Box<[u8]>, priority: Option<f64>) -> Result<(), Box<[u8]>> {
        self.try_push_step(buf, priority, StepMark::default())
    }

    /// [`Connection::try_push_with`] for a step of row `mark.row` of this connection (a
    /// sequence table's stream [`Connection::stream`]`(mark.row)`).
    pub fn try_push_step(
        &self,
        buf: Box<[u8]>,
        priority: Option<f64>,
        mark: StepMark,
    ) -> Result<(), Box<[u8]>> {
        self.try_push_packed(buf, None, priority, mark).map_err(|(buf, _)| buf)
    }

    /// [`Connection::try_push_step`] for a sample that arrived with compressed leaves: `buf`
    /// holds it decompressed, `packed` those leaves as they arrived, packed as the backend
    /// stores them ([`crate::codec::LeafCodecs`], checked to decompress to `buf`'s bytes), so
    /// that a table that stores them compressed keeps them as they are. Gives both back if
    /// the queue is full.
    #[allow(clippy::type_complexity)]
    pub fn try_push_packed(
        &self,
        buf: Box<[u8]>,
        packed: Option<Packed>,
        priority: Option<f64>,
        mark: StepMark,
    ) -> Result<(), (Box<[u8]>, Option<Packed>)> {
        debug_assert_eq!(buf.len(), self.payload_size);
        // ORDERING: Relaxed — only this task increments, and `try_insert_in_place` (the one
        // reader that acts on it) runs on this task too, after this.
        self.unfinished.fetch_add(1, Relaxed);
        if let Err((buf, _, _, _, packed)) =
            self.queue.push((buf, Stamp::now(), priority, mark, packed))
        {
            // ORDERING: Relaxed — undoes the increment above; the drainer never saw the sample.
            self.unfinished.fetch_sub(1, Relaxed);
            return Err((buf, packed));
        }
        self.note_row(mark.row);
        self.stats.pending.add(1);
        self.drainer.bell.wake_if_sleeping();
        Ok(())
    }

    /// Writes one sample straight into the backend, bypassing the queue and the drainer's
    /// copy, when that keeps this connection's order and costs no wait: nothing this
    /// connection pushed is still on its way to the backend, and the backend is the FIFO
    /// ring with a free slot now ([`Backend::try_insert_in_place`]; `fill` must write every
    /// byte, see there). Counted like a drainer's insert. `false`, nothing called, otherwise:
    /// push a buffer as usual.
    pub fn try_insert_in_place(&self, fill: impl FnOnce(&mut [&mut [u8]])) -> bool {
        if !self.is_idle() {
            return false;
        }
        // Counted inside `fill`, which the store calls only with a slot reserved and commits
        // right after: before the commit that can wake the consumer, as a drainer counts
        // (`Round::inserted`), so `samples_inserted_total` never lags a handed-out batch.
        self.backend.try_insert_in_place(|leaves| {
            fill(leaves);
            self.stats.in_place.add(1);
            self.drainer.inserted.add(1);
            // ORDERING: Relaxed — as `dequeued` for a checkpoint: its capture runs at the
            // ring's snapshot moment, which this reservation's commit (Release, right after)
            // precedes or follows as a whole.
            self.inserted_direct.fetch_add(1, Relaxed);
        })
    }

    /// Shared-memory connections: the connection's task looked at its segment and found
    /// `committed` samples committed and not yet in the backend. They count as queued
    /// (`queue_depth_*`) and pending (`samples_pending`) until [`Connection::direct`]'s
    /// source takes them in. Call it before inserting them (and with 0 when the channel
    /// ends, for samples that will never go in).
    pub fn note_segment_depth(&self, committed: u64) {
        let before = self.segment_depth.get();
        if committed >= before {
            self.stats.pending.add(committed - before);
            self.stats.segment_queued.add(committed - before);
        } else {
            self.stats.pending.sub(before - committed);
            self.stats.segment_queued.sub(before - committed);
        }
        self.segment_depth.set(committed);
    }

    /// `src` as a source this connection's task inserts into the backend itself (shared
    /// memory): counted as a drainer's samples are, as the backend takes them in, right
    /// before the commit that makes them visible to the consumer. Its samples must have been
    /// counted by [`Connection::note_segment_depth`] first.
    pub fn direct<S: SampleSource>(&self, src: S) -> Direct<'_, S> {
        Direct { src, conn: self }
    }

    /// Records that the transport task had to wait for space (backpressure).
    pub fn note_blocked(&self) {
        self.stats.push_blocked.add(1);
    }

    /// Records how long such a wait took (backpressure time: the connection was not read).
    pub fn note_blocked_for(&self, waited: std::time::Duration) {
        self.stats.push_blocked_ns.add(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX));
    }

    /// The transport task is done with this connection. Its queued samples are still
    /// inserted; its empty buffers are freed now (and those the drainer hands back later).
    pub fn close(&self) {
        // ORDERING: Release pairs with the drainer's Acquire in `is_drained`: every push this
        // task made is visible to the drainer once it sees `closed`.
        if !self.closed.swap(true, Release) {
            while let Some(buf) = self.free.pop() {
                self.free_buffer(buf);
            }
            self.drainer.bell.wake();
        }
    }

    /// The peer went away but may come back (a v2 session): the connection stays open (what
    /// it queued stays queued, in order) and frees its pooled empty buffers.
    pub fn detach(&self) {
        while let Some(buf) = self.free.pop() {
            self.free_buffer(buf);
        }
    }

    /// Bytes of each of this connection's samples.
    pub fn payload_size(&self) -> usize {
        self.payload_size
    }

    /// Samples waiting in this connection's queue (and stash).
    pub fn queue_len(&self) -> usize {
        self.queue.len() + self.stashed()
    }

    /// How many of this connection's samples the latest checkpoint holds: its first so many
    /// (see `captured`), whichever way each went in.
    pub fn captured(&self) -> u64 {
        // ORDERING: Relaxed — read after the checkpoint's capture returned, on the thread that
        // ran it (the checkpoint's), or after its completion was published to this reader.
        self.captured.load(Relaxed)
    }

    pub(super) fn stashed(&self) -> usize {
        // ORDERING: Relaxed — exact under the drainer's `state` lock, whose acquisition orders
        // it (see `stash`); elsewhere a statistic.
        self.stashed.load(Relaxed)
    }

    /// Whether there is something to pop.
    pub(super) fn has_queued(&self) -> bool {
        !self.queue.is_empty() || self.stashed() > 0
    }

    /// Closed and nothing left to insert.
    pub(super) fn is_drained(&self) -> bool {
        // ORDERING: Acquire pairs with the Release in `close`: pushes made before the close are
        // visible, so an empty queue here really is the end.
        self.closed.load(Acquire) && !self.has_queued()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Whatever buffers are left (pooled, queued at shutdown) go with the connection.
        let left = *self.allocated.get_mut();
        self.budget.release(left * self.payload_size);
    }
}

/// Samples a connection's task inserts into the backend itself ([`Connection::direct`]):
/// the source's samples, counted as the backend takes them in.
pub struct Direct<'a, S> {
    src: S,
    conn: &'a Connection,
}

impl<S: SampleSource> SampleSource for Direct<'_, S> {
    fn num_samples(&self) -> usize {
        self.src.num_samples()
    }
    fn num_leaves(&self, sample: usize) -> usize {
        self.src.num_leaves(sample)
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        self.src.leaf(sample, leaf)
    }
    fn priority(&self, sample: usize) -> Option<f64> {
        self.src.priority(sample)
    }
    fn leaf_len(&self, sample: usize, leaf: usize) -> usize {
        self.src.leaf_len(sample, leaf)
    }
    fn copy_leaf(&self, sample: usize, leaf: usize, dst: &mut [u8]) {
        self.src.copy_leaf(sample, leaf, dst);
    }
    fn packed(&self, sample: usize) -> Option<&[u8]> {
        self.src.packed(sample)
    }
    fn shared(&self) -> Option<&(dyn SampleSource + Sync)> {
        self.src.shared()
    }
    fn step(&self, sample: usize) -> StepTag {
        self.src.step(sample)
    }
    fn inserted(&self, count: usize) {
        // Called by the backend before the commit that can wake the consumer (FIFO), or under
        // the lock the consumer takes (replay): a batch handed out is always counted.
        let (conn, n) = (self.conn, count as u64);
        conn.stats.direct_inserted.add(n);
        // ORDERING: Relaxed — ordered for a checkpoint's capture by the backend's snapshot
        // moment, as the drainer's count (`Round::inserted`).
        conn.inserted_direct.fetch_add(n, Relaxed);
        conn.segment_depth.sub(n);
        conn.stats.segment_queued.sub(n);
        conn.stats.pending.sub(n);
        self.src.inserted(count);
    }
}

/// What a drainer shares with the connections it owns and with the ingress.
pub(super) struct DrainerShared {
    /// The drainer's connections and current round. Written by the drainer between inserts;
    /// read by it while it inserts and by [`Ingress::capture`](super::Ingress::capture) (see
    /// `capture.rs`).
    pub(super) state: RwLock<DrainerState>,
    /// Samples of the current round the backend has taken in: `state.bufs[..done]`. Reset by
    /// the drainer under the `state` write lock when a round starts.
    pub(super) done: AtomicUsize,
    /// Connections handed to this drainer and not yet adopted by it.
    pub(super) incoming: Mutex<Vec<Arc<Connection>>>,
    /// Connections assigned (adopted or incoming) and not pruned: for load balancing.
    pub(super) load: Counter,
    /// Where the drainer sleeps when it has nothing to do. Rung after every push
    /// (`wake_if_sleeping`) and by `register`, `close` and `shutdown` (`wake`).
    pub(super) bell: Doorbell,
    /// Samples in this drainer's queues at its last round (sum, largest).
    pub(super) depth_sum: CachePadded<Counter>,
    pub(super) depth_max: Counter,
    pub(super) inserted: CachePadded<Counter>,
}

impl DrainerShared {
    pub(super) fn new() -> Self {
        Self {
            state: RwLock::new(DrainerState::default()),
            done: AtomicUsize::new(0),
            incoming: Mutex::new(Vec::new()),
            load: Counter::default(),
            bell: Doorbell::new(),
            depth_sum: CachePadded::default(),
            depth_max: Counter::default(),
            inserted: CachePadded::default(),
        }
    }
}

/// One drainer's connections and round, behind [`DrainerShared::state`].
#[derive(Default)]
pub(super) struct DrainerState {
    pub(super) conns: Vec<Arc<Connection>>,
    /// Buffers popped this round and, in parallel, the index of the connection each came from
    /// and its priority. All keep their capacity across rounds.
    pub(super) bufs: Vec<Box<[u8]>>,
    pub(super) owners: Vec<usize>,
    pub(super) priorities: Vec<Option<f64>>,
    pub(super) marks: Vec<StepMark>,
    /// Each buffer's compressed leaves as they arrived, if the backend keeps them so.
    pub(super) packed: Vec<Option<Packed>>,
    pub(super) round: usize,
}
