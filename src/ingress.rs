//! Ingress: per-connection queues and the drainer pool that moves their samples into the
//! backend (the FIFO store or a replay table).
//!
//! ```text
//!  transport task (one per connection)         drainer thread (fixed pool, owns a subset)
//!  ───────────────────────────────────         ──────────────────────────────────────────
//!  buf = conn.free.pop() (or allocate,         every round, starting one queue further:
//!        up to the pool cap; else wait)          pop at most each queue's depth on arrival
//!  read exactly payload_size bytes into buf      backend.insert(all popped) (one call)
//!  conn.queue.push(buf)   (full: wait)           give buffers back to conn.free, wake conns
//!  ack once queued                               prune closed connections once drained
//!  wake the drainer if it sleeps                 nothing popped: sleep until woken
//! ```
//!
//! - Each queue has exactly one producer (its connection's task) and one consumer (its
//!   drainer), so producers never contend with each other.
//! - Buffers cycle between `free` and `queue`; a connection allocates at most
//!   `2 * queue_size + 1` of them over its life (queue + one drainer round + the one being
//!   filled), so the steady state allocates nothing.
//! - Per-connection order is kept: one drainer owns a connection, pops in FIFO order and inserts
//!   what it popped in order.
//! - A sample acknowledged to the client is in its queue; a closed connection is pruned only
//!   once its queue is empty, so acknowledged samples reach the backend even if the client
//!   disconnects right after.
//!
//! Checkpoints ([`Ingress::capture`]): every acknowledged sample not in the backend is in a
//! drainer's round (popped, not yet inserted: the rows after its `done` count) or in a
//! connection's queue. A checkpoint calls `capture` at the backend's snapshot moment (the FIFO
//! ring frozen with every reservation committed; a replay table under its lock), when no
//! drainer can move a sample into the backend, so each acknowledged sample is in exactly one
//! of the two: the snapshot or the capture. A drainer's round and connection list sit behind
//! its `state` lock: the drainer writes them between inserts and holds a read lock while it
//! inserts (also while it waits for room), so `capture` reads them beside it. Queues cannot be
//! read in place, so `capture` moves their samples into the connection's `stash`, which the
//! drainer empties, in order, before it pops the queue again: a connection's order is kept.

use std::thread::{self, JoinHandle};
use std::time::Duration;

use std::collections::VecDeque;

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};

use crate::backend::Backend;
use crate::doorbell::Doorbell;
use crate::error::EchoError;
use crate::metrics::{Counter, HistSummary, Histo, Stamp};
use crate::queued::QueuedSamples;
use crate::source::{EpisodeEnd, Payloads, SampleSource, StepTag};
use std::sync::Weak;

use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// Ingress settings. Build them with [`IngressConfig::new`], then change fields as needed.
#[derive(Debug, Clone, Copy)]
pub struct IngressConfig {
    /// The most drainer threads to run. [`Ingress::start`] runs at most one per available
    /// CPU: more drainers than cores only race each other for ring space and serve
    /// connections unevenly (measured: same throughput, 3x the spread between connections).
    pub num_drainers: usize,
    /// Capacity of each connection's queue, in samples.
    pub queue_size: usize,
    /// How long an idle drainer sleeps before looking again on its own; `None`: until woken.
    /// Wake-ups are explicit, so this only bounds the cost of a lost one (a bug). Tests set
    /// `None` so that a lost wake-up hangs and their watchdog catches it.
    pub idle_park: Option<Duration>,
    /// The most bytes of sample buffers all connections together may hold: samples queued
    /// (acknowledged, not yet in the backend), in a drainer's round, being read, and each
    /// connection's pool of empty buffers. At the bound a connection that needs a new buffer
    /// waits (it stops reading, so it stops acknowledging) until buffers are freed; nothing
    /// acknowledged is ever dropped. At least one sample's bytes.
    pub max_buffered_bytes: usize,
}

impl IngressConfig {
    /// The default [`IngressConfig::idle_park`]: 100 ms.
    pub const DEFAULT_IDLE_PARK: Duration = Duration::from_millis(100);

    /// The largest [`IngressConfig::queue_size`]: every connection allocates its queue and
    /// pool (`2 * queue_size + 1` pointers) up front, so an absurd size must fail here.
    pub const MAX_QUEUE_SIZE: usize = 1 << 16;

    /// The default [`IngressConfig::max_buffered_bytes`]: 1 GiB.
    pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 1 << 30;

    /// Bytes of samples [`IngressConfig::queue_size_for`] lets one connection queue.
    pub const AUTO_QUEUE_BYTES: usize = 64 << 10;

    /// The queue size used when none is given: enough samples for [`Self::AUTO_QUEUE_BYTES`],
    /// at least 8 and at most 256. A connection's task stops reading when its queue is full,
    /// until its drainer has popped it; a queue of 8 small samples makes that round trip (a
    /// drainer wake-up) the limit of one connection (measured: `send_batch` of 64 ~120-byte
    /// rows went 2.4x per-row `send` with 8, 13.6x with 256). Large samples keep 8: their
    /// copy, not the wake-up, is the limit, and 8 of them already hold ~1.6 MB at 200 KB.
    pub fn queue_size_for(payload_size: usize) -> usize {
        (Self::AUTO_QUEUE_BYTES / payload_size.max(1)).clamp(8, 256)
    }

    /// `num_drainers` drainers, queues of `queue_size`, the default `idle_park` and
    /// `max_buffered_bytes`.
    pub fn new(num_drainers: usize, queue_size: usize) -> Self {
        Self {
            num_drainers,
            queue_size,
            idle_park: Some(Self::DEFAULT_IDLE_PARK),
            max_buffered_bytes: Self::DEFAULT_MAX_BUFFERED_BYTES,
        }
    }

    /// Drainer threads actually started: `num_drainers`, capped at the available CPUs.
    pub fn effective_drainers(&self) -> usize {
        let cpus = thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        self.num_drainers.min(cpus).max(1)
    }

    /// Checks the values for samples of `payload_size` bytes.
    ///
    /// # Errors
    /// [`EchoError::Config`] if a count is zero or the byte bound holds no sample.
    pub fn validate(&self, payload_size: usize) -> Result<(), EchoError> {
        if self.num_drainers == 0 {
            return Err(EchoError::Config("the ingress needs at least 1 drainer, got 0".into()));
        }
        if self.queue_size == 0 || self.queue_size > Self::MAX_QUEUE_SIZE {
            return Err(EchoError::Config(format!(
                "a connection queue holds 1 to {} samples, got {}",
                Self::MAX_QUEUE_SIZE,
                self.queue_size
            )));
        }
        if self.max_buffered_bytes < payload_size {
            return Err(EchoError::Config(format!(
                "max_buffered_bytes ({}) must hold at least one sample ({payload_size} bytes)",
                self.max_buffered_bytes
            )));
        }
        Ok(())
    }
}

/// What a transport task waits on when its connection has no free buffer or queue slot.
pub trait SpaceWaker: Send + Sync {
    /// A buffer or queue slot came free.
    fn wake(&self);
}

/// The bound on the bytes of sample buffers every connection together holds
/// ([`IngressConfig::max_buffered_bytes`]), and the connections waiting for some to be freed.
struct ByteBudget {
    limit: usize,
    /// Bytes of buffers that exist now.
    allocated: AtomicUsize,
    /// Connections that found the budget spent, each once: woken on every release. A
    /// connection registers and makes its last try under this lock; a release returns its
    /// bytes and then always takes the lock to wake. So either the release's lock comes after
    /// the registration (the connection is woken), or before it, and then the last try, which
    /// the lock orders after the returned bytes, sees them. No lost wake-up.
    waiting: Mutex<Vec<Weak<Connection>>>,
    /// `waiting.len()`, readable without the lock: a hint for recycling drainers, which free
    /// buffers instead of pooling them while somebody waits.
    num_waiting: Counter,
    /// Of `allocated`, the bytes of shared-memory segments ([`Ingress::reserve_segment`]): at
    /// most half of `limit`, so pooled buffers for TCP connections always have the rest.
    segments: AtomicUsize,
}

impl ByteBudget {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            allocated: AtomicUsize::new(0),
            waiting: Mutex::new(Vec::new()),
            num_waiting: Counter::default(),
            segments: AtomicUsize::new(0),
        }
    }

    /// The most bytes shared-memory segments may hold together.
    fn segment_limit(&self) -> usize {
        self.limit / 2
    }

    /// Takes `bytes` for a segment if they fit under both limits.
    fn try_take_segment(&self, bytes: usize) -> bool {
        let limit = self.segment_limit();
        // ORDERING: Relaxed — as in `try_take`: a bound on allocation that publishes nothing.
        let fits = self
            .segments
            .fetch_update(Relaxed, Relaxed, |a| a.checked_add(bytes).filter(|&n| n <= limit))
            .is_ok();
        if fits && !self.try_take(bytes) {
            // ORDERING: Relaxed — as above.
            self.segments.fetch_sub(bytes, Relaxed);
            return false;
        }
        fits
    }

    fn segments(&self) -> usize {
        // ORDERING: Relaxed — a statistics read.
        self.segments.load(Relaxed)
    }

    /// Takes `bytes` if they fit under the limit.
    fn try_take(&self, bytes: usize) -> bool {
        // ORDERING: Relaxed — the count only bounds allocation (every read-modify-write sees
        // the latest value, so the bound holds); it publishes no memory. The wake-up protocol
        // relies on the `waiting` lock, not on this.
        self.allocated
            .fetch_update(Relaxed, Relaxed, |a| a.checked_add(bytes).filter(|&n| n <= self.limit))
            .is_ok()
    }

    /// Gives `bytes` back and wakes every waiting connection. Not on the steady-state path:
    /// buffers are pooled, and only freed when a connection closes or others wait for bytes.
    fn release(&self, bytes: usize) {
        // ORDERING: Relaxed — see `try_take`; the `waiting` lock below orders it before a
        // registered connection's last try.
        self.allocated.fetch_sub(bytes, Relaxed);
        let waiting = {
            let mut guard = self.waiting.lock();
            self.num_waiting.set(0);
            std::mem::take(&mut *guard)
        };
        for conn in waiting.iter().filter_map(Weak::upgrade) {
            conn.waker.wake();
        }
    }

    /// `bytes`, or `false` after registering `conn` to be woken by the next release.
    fn take_or_wait(&self, bytes: usize, conn: &Arc<Connection>) -> bool {
        if self.try_take(bytes) {
            return true;
        }
        let mut waiting = self.waiting.lock();
        if !waiting.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(conn))) {
            waiting.push(Arc::downgrade(conn));
            self.num_waiting.set(waiting.len() as u64);
        }
        // Under the lock (see `waiting`): a release before the registration woke nobody, but
        // its bytes are seen here.
        self.try_take(bytes)
    }

    fn allocated(&self) -> usize {
        // ORDERING: Relaxed — a statistics read.
        self.allocated.load(Relaxed)
    }
}

/// Bytes of the ingress's byte budget held by one shared-memory segment, from
/// [`Ingress::reserve_segment`]; given back (waking connections that wait for bytes) when
/// dropped, with the segment.
pub struct SegmentReservation {
    budget: Arc<ByteBudget>,
    bytes: usize,
}

impl Drop for SegmentReservation {
    fn drop(&mut self) {
        // ORDERING: Relaxed — see `ByteBudget::try_take`.
        self.budget.segments.fetch_sub(self.bytes, Relaxed);
        self.budget.release(self.bytes);
    }
}

impl std::fmt::Debug for SegmentReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentReservation").field("bytes", &self.bytes).finish()
    }
}

/// A queued sample: its payload, its push time, and the priority it was sent with (wire v2).
/// A queued sample: its buffer, push time, priority, step mark, and its compressed leaves as
/// they arrived when the backend keeps them so (see [`Connection::try_push_packed`]).
type Queued = (Box<[u8]>, Stamp, Option<f64>, StepMark, Option<Box<[u8]>>);

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
    /// [`Ingress::capture`], which moves them to `stash`).
    queue: ArrayQueue<Queued>,
    /// Samples a checkpoint moved out of `queue` (all older than what `queue` holds now). The
    /// drainer takes them before it pops the queue again. Only touched under the drainer's
    /// `state` lock (read for `capture`, write for the drainer), besides this mutex.
    stash: Mutex<VecDeque<Queued>>,
    /// `stash.len()`, exact for whoever holds the drainer's `state` lock (see `stash`).
    stashed: AtomicUsize,
    /// Empty buffers ready for reuse. Producer: the drainer; consumer: the transport task.
    free: ArrayQueue<Box<[u8]>>,
    /// Buffers of this connection that exist; never exceeds `free.capacity()`.
    allocated: AtomicUsize,
    /// Samples pushed and not yet through the backend's insert (queued, or in a drainer's
    /// round). Zero means every sample this connection queued is in the backend, so one
    /// inserted in place now comes after all of them.
    unfinished: AtomicUsize,
    backend: Backend,
    budget: Arc<ByteBudget>,
    payload_size: usize,
    /// Set by the transport task when the socket is done; the drainer prunes the connection
    /// once this is set and the queue is empty.
    closed: AtomicBool,
    drainer: Arc<DrainerShared>,
    waker: Box<dyn SpaceWaker>,
    stats: Arc<IngressStats>,
    /// The backend stream of row 0 of this connection: `(connection number + 1) << 32`, so
    /// every connection's streams are apart from each other and from in-process streams
    /// (below 2^32).
    stream_base: u64,
    /// One more than the largest row a sample of this connection was a step of (0: none
    /// yet): the streams whose open episodes end when the connection is pruned.
    rows_used: AtomicU32,
    /// Shared-memory connections only (0 on TCP): samples committed to the connection's
    /// segment and not yet in the backend, as its task last looked
    /// ([`Connection::note_segment_depth`]), less those inserted since. The segment is this
    /// connection's queue, so these count in `queue_depth_*` and `samples_pending`. Written
    /// only by the connection's task.
    segment_depth: Counter,
}

impl Connection {
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
    fn end_streams(&self) {
        if self.backend.sequence().is_none() {
            return;
        }
        // ORDERING: Relaxed — see `note_row`; the caller saw the connection drained.
        let rows = self.rows_used.load(Relaxed);
        for row in 0..rows {
            self.backend.end_stream(self.stream(row), EpisodeEnd::Truncated);
        }
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

    /// Gives back a buffer the transport task did not fill (e.g. a partial sample).
    pub fn return_buffer(&self, buf: Box<[u8]>) {
        self.recycle(buf);
    }

    /// Puts an empty buffer back in the pool, or frees it: when the connection is closed (it
    /// will not need it), or when other connections wait for bytes and this one keeps at
    /// least one buffer.
    fn recycle(&self, buf: Box<[u8]>) {
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

    fn free_buffer(&self, buf: Box<[u8]>) {
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
        packed: Option<Box<[u8]>>,
        priority: Option<f64>,
        mark: StepMark,
    ) -> Result<(), (Box<[u8]>, Option<Box<[u8]>>)> {
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
        } else {
            self.stats.pending.sub(before - committed);
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

    fn stashed(&self) -> usize {
        // ORDERING: Relaxed — exact under the drainer's `state` lock, whose acquisition orders
        // it (see `stash`); elsewhere a statistic.
        self.stashed.load(Relaxed)
    }

    /// Whether there is something to pop.
    fn has_queued(&self) -> bool {
        !self.queue.is_empty() || self.stashed() > 0
    }

    /// Closed and nothing left to insert.
    fn is_drained(&self) -> bool {
        // ORDERING: Acquire pairs with the Release in `close`: pushes made before the close are
        // visible, so an empty queue here really is the end.
        self.closed.load(Acquire) && !self.has_queued()
    }

    /// For [`Ingress::capture`], under the drainer's `state` lock: moves every queued sample to
    /// the stash and calls `each` with every stashed one, oldest first.
    fn stash_queued(&self, mut each: impl FnMut(&[u8], Option<f64>, StepMark)) {
        let mut stash = self.stash.lock();
        while let Some(item) = self.queue.pop() {
            stash.push_back(item);
        }
        // ORDERING: Relaxed — see `stashed`.
        self.stashed.store(stash.len(), Relaxed);
        for (buf, _, priority, mark, _) in stash.iter() {
            each(buf, *priority, *mark);
        }
        drop(stash);
        // The queue has room again: a transport task may wait for it.
        self.waker.wake();
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Whatever buffers are left (pooled, queued at shutdown) go with the connection.
        let left = *self.allocated.get_mut();
        self.budget.release(left * self.payload_size);
    }
}

/// What a drainer shares with the connections it owns and with the ingress.
struct DrainerShared {
    /// The drainer's connections and current round. Written by the drainer between inserts;
    /// read by it while it inserts and by [`Ingress::capture`] (see the module docs).
    state: RwLock<DrainerState>,
    /// Samples of the current round the backend has taken in: `state.bufs[..done]`. Reset by
    /// the drainer under the `state` write lock when a round starts.
    done: AtomicUsize,
    /// Connections handed to this drainer and not yet adopted by it.
    incoming: Mutex<Vec<Arc<Connection>>>,
    /// Connections assigned (adopted or incoming) and not pruned: for load balancing.
    load: Counter,
    /// Where the drainer sleeps when it has nothing to do. Rung after every push
    /// (`wake_if_sleeping`) and by `register`, `close` and `shutdown` (`wake`).
    bell: Doorbell,
    /// Samples in this drainer's queues at its last round (sum, largest).
    depth_sum: CachePadded<Counter>,
    depth_max: Counter,
    inserted: CachePadded<Counter>,
}

impl DrainerShared {
    fn new() -> Self {
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

/// Counters shared by connections and drainers.
#[derive(Debug, Default)]
pub struct IngressStats {
    active_connections: CachePadded<Counter>,
    push_blocked: CachePadded<Counter>,
    /// Nanoseconds transport tasks spent in those waits.
    push_blocked_ns: Counter,
    /// Connections a transport refused (every slot taken by a working connection).
    refused: Counter,
    /// Idle connections a transport closed to admit new ones.
    evicted: Counter,
    /// Samples that reached the ingress and are not yet in the backend: +1 on every push, -n
    /// as a drainer's insert puts them in (or drops them); for shared-memory connections the
    /// change of each one's `segment_depth`.
    pending: CachePadded<Counter>,
    /// Samples a transport wrote straight into the backend (`Connection::try_insert_in_place`).
    in_place: Counter,
    /// [`TransportEvent`] counts, in the order of [`IngressSnapshot`]'s fields.
    v1: Counter,
    v2: Counter,
    resumed: Counter,
    deduplicated: Counter,
    refused_protocol: Counter,
    refused_auth: Counter,
    refused_layout: Counter,
    shm: Counter,
    shm_fallback: Counter,
    /// Samples that arrived in compressed frames, and the bytes of those frames' bodies.
    compressed: Counter,
    compressed_bytes: Counter,
    /// Samples a connection's task inserted into the backend itself (shared memory,
    /// [`Connection::direct`]), not through a drainer; part of `samples_inserted_total`.
    direct_inserted: Counter,
}

/// A snapshot of the ingress counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngressSnapshot {
    /// Connections whose socket is open.
    pub active_connections: u64,
    /// Samples waiting in all queues, as of each drainer's last round; a shared-memory
    /// connection's segment is its queue (as of its task's last look).
    pub queue_depth_sum: u64,
    /// Samples waiting in the fullest queue (or shared-memory segment), as above.
    pub queue_depth_max: u64,
    /// Times a transport task waited for a free buffer or queue slot.
    pub push_blocked_count: u64,
    /// Nanoseconds transport tasks spent in those waits, summed over connections.
    pub push_blocked_ns_total: u64,
    /// Samples the drainers moved into the backend, and those a transport inserted itself
    /// (shared-memory connections copy straight from their ring into the backend).
    pub samples_inserted_total: u64,
    /// Bytes of sample buffers the connections hold now (at most `max_buffered_bytes`).
    pub buffered_bytes: u64,
    /// Connections refused because every slot was taken by a working connection.
    pub connections_refused_total: u64,
    /// Idle connections closed to admit new ones.
    pub connections_evicted_total: u64,
    /// Samples that reached the ingress and are not yet in the backend: acknowledged TCP
    /// samples (queued, or in a drainer's round), and samples committed to a shared-memory
    /// segment and not yet copied in (not acknowledged yet: a shared-memory worker's
    /// acknowledgement is the copy).
    pub samples_pending: u64,
    /// Of `samples_inserted_total`, those a transport read from its socket straight into the
    /// ring (large samples already complete in the kernel's buffer), skipping one copy.
    pub samples_received_in_place_total: u64,
    /// Connections that spoke wire protocol v1.
    pub v1_connections_total: u64,
    /// Connections that spoke wire protocol v2.
    pub v2_connections_total: u64,
    /// v2 connections that resumed a session (a client reconnecting).
    pub sessions_resumed_total: u64,
    /// Samples a resuming client did not resend because they were already queued.
    pub samples_deduplicated_total: u64,
    /// Handshakes refused as malformed or unsupported (a v1 client at a server with a token).
    pub handshakes_refused_protocol_total: u64,
    /// Handshakes refused for a missing or wrong token.
    pub handshakes_refused_auth_total: u64,
    /// Handshakes refused because the client's samples have another layout.
    pub handshakes_refused_layout_total: u64,
    /// v2 connections whose samples came through same-host shared memory.
    pub shm_connections_total: u64,
    /// v2 connections that wanted shared memory and sent over TCP instead (another host,
    /// turned off on the server, or the attach failed).
    pub shm_fallbacks_total: u64,
    /// Samples that arrived compressed (wire v2 compressed frames).
    pub samples_received_compressed_total: u64,
    /// Bytes those samples took on the wire (their frames' bodies): against their raw size,
    /// the wire's compression ratio.
    pub compressed_bytes_received_total: u64,
}

/// What a transport reports about its connections, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportEvent {
    /// A connection negotiated wire protocol v1.
    V1,
    /// A connection negotiated wire protocol v2.
    V2,
    /// A v2 connection resumed a session, skipping this many already queued samples.
    Resumed {
        /// Samples the client had sent before that were already queued.
        deduplicated: u64,
    },
    /// A handshake was refused as malformed or unsupported.
    RefusedProtocol,
    /// A handshake was refused for a missing or wrong token.
    RefusedAuth,
    /// A handshake was refused for another layout.
    RefusedLayout,
    /// A v2 connection attached a shared-memory channel.
    Shm,
    /// A v2 connection wanted shared memory and uses TCP instead.
    ShmFallback,
}

/// The drainer pool and connection registry.
pub struct Ingress {
    backend: Backend,
    config: IngressConfig,
    drainers: Vec<Arc<DrainerShared>>,
    handles: Mutex<Vec<JoinHandle<()>>>,
    shutdown: AtomicBool,
    stats: Arc<IngressStats>,
    /// Bytes of sample buffers all connections hold, bounded by `max_buffered_bytes`.
    budget: Arc<ByteBudget>,
    /// Shared by all drainers (zero-sized without `detailed-metrics`).
    drain_round: Histo,
    queue_dwell: Histo,
    /// Connections registered so far: numbers each one's streams.
    connections: AtomicU64,
}

impl Ingress {
    /// Starts `min(config.num_drainers, available CPUs)` drainer threads inserting into
    /// `backend`.
    ///
    /// # Errors
    /// [`EchoError::Config`] for bad settings, [`EchoError::Io`] if a thread cannot start.
    pub fn start(backend: Backend, config: IngressConfig) -> Result<Arc<Self>, EchoError> {
        config.validate(backend.spec().payload_size())?;
        let drainers: Vec<_> =
            (0..config.effective_drainers()).map(|_| Arc::new(DrainerShared::new())).collect();
        let ingress = Arc::new(Self {
            backend,
            config,
            drainers,
            handles: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            stats: Arc::new(IngressStats::default()),
            budget: Arc::new(ByteBudget::new(config.max_buffered_bytes)),
            drain_round: Histo::new(),
            queue_dwell: Histo::new(),
            connections: AtomicU64::new(0),
        });
        for (index, shared) in ingress.drainers.iter().enumerate() {
            let (ingress_ref, shared_ref) = (Arc::clone(&ingress), Arc::clone(shared));
            let spawned = thread::Builder::new()
                .name(format!("echo-drainer-{index}"))
                .spawn(move || Drainer::new(ingress_ref, shared_ref).run());
            match spawned {
                Ok(handle) => {
                    shared.bell.set_sleeper(handle.thread().clone());
                    ingress.handles.lock().push(handle);
                }
                Err(err) => {
                    ingress.shutdown();
                    return Err(EchoError::Io(err));
                }
            }
        }
        Ok(ingress)
    }

    /// Reserves `bytes` of the byte budget (`max_buffered_bytes`) for a shared-memory
    /// segment, which holds its samples as pooled buffers hold TCP's. Segments together get
    /// at most half of the budget, so TCP connections always have the other half; beyond
    /// that (or when the budget is spent) the connection uses TCP, and the error says why.
    ///
    /// # Errors
    /// Why the bytes are not available, for the client's log and `SharedMemoryError`.
    pub fn reserve_segment(&self, bytes: usize) -> Result<SegmentReservation, String> {
        if self.budget.try_take_segment(bytes) {
            return Ok(SegmentReservation { budget: Arc::clone(&self.budget), bytes });
        }
        Err(self
            .segment_shortfall(bytes)
            .unwrap_or_else(|| "the byte budget was just spent".into()))
    }

    /// Whether a segment of `bytes` would fit now ([`Ingress::reserve_segment`] without
    /// reserving): `None`, or why not.
    pub fn segment_shortfall(&self, bytes: usize) -> Option<String> {
        let (used, limit) = (self.budget.segments(), self.budget.segment_limit());
        if used.saturating_add(bytes) > limit {
            return Some(format!(
                "the learner's shared-memory segments already hold {used} of the {limit} bytes \
                 they may (half of max_buffered_bytes); a segment needs {bytes}"
            ));
        }
        let allocated = self.budget.allocated();
        (allocated.saturating_add(bytes) > self.budget.limit).then(|| {
            format!(
                "the learner's ingress buffers hold {allocated} of max_buffered_bytes ({}); a \
                 segment needs {bytes}",
                self.budget.limit
            )
        })
    }

    /// A new connection, assigned to the least-loaded drainer. `waker` is called whenever a
    /// buffer or queue slot of this connection comes free.
    pub fn register(&self, waker: Box<dyn SpaceWaker>) -> Arc<Connection> {
        let drainer =
            self.drainers.iter().min_by_key(|d| d.load.get()).expect("at least one drainer");
        drainer.load.add(1);
        let payload_size = self.backend.spec().payload_size();
        // ORDERING: Relaxed — only numbers connections; nothing else is published with it.
        let number = self.connections.fetch_add(1, Relaxed);
        let conn = Arc::new(Connection {
            stream_base: (number + 1) << 32,
            rows_used: AtomicU32::new(0),
            queue: ArrayQueue::new(self.config.queue_size),
            stash: Mutex::new(VecDeque::new()),
            stashed: AtomicUsize::new(0),
            free: ArrayQueue::new(2 * self.config.queue_size + 1),
            allocated: AtomicUsize::new(0),
            unfinished: AtomicUsize::new(0),
            backend: self.backend.clone(),
            budget: Arc::clone(&self.budget),
            payload_size,
            closed: AtomicBool::new(false),
            drainer: Arc::clone(drainer),
            waker,
            stats: Arc::clone(&self.stats),
            segment_depth: Counter::default(),
        });
        drainer.incoming.lock().push(Arc::clone(&conn));
        drainer.bell.wake();
        conn
    }

    /// A transport accepted a connection; [`Ingress::connection_ended`] when it ends. Counted
    /// as `active_connections` (connections open, whether or not they have sent anything).
    pub fn connection_opened(&self) {
        self.stats.active_connections.add(1);
    }

    /// A connection counted by [`Ingress::connection_opened`] ended.
    pub fn connection_ended(&self) {
        self.stats.active_connections.sub(1);
    }

    /// A transport refused a connection (counted for the statistics).
    pub fn note_refused(&self) {
        self.stats.refused.add(1);
    }

    /// A transport closed an idle connection to admit a new one (counted).
    pub fn note_evicted(&self) {
        self.stats.evicted.add(1);
    }

    /// Counts a transport's event for the statistics.
    pub fn note(&self, event: TransportEvent) {
        let stats = &self.stats;
        match event {
            TransportEvent::V1 => stats.v1.add(1),
            TransportEvent::V2 => stats.v2.add(1),
            TransportEvent::Resumed { deduplicated } => {
                stats.resumed.add(1);
                stats.deduplicated.add(deduplicated);
            }
            TransportEvent::RefusedProtocol => stats.refused_protocol.add(1),
            TransportEvent::RefusedAuth => stats.refused_auth.add(1),
            TransportEvent::RefusedLayout => stats.refused_layout.add(1),
            TransportEvent::Shm => stats.shm.add(1),
            TransportEvent::ShmFallback => stats.shm_fallback.add(1),
        }
    }

    /// Counts a sample that arrived compressed, in a frame body of `bytes`.
    pub fn note_compressed(&self, bytes: usize) {
        self.stats.compressed.add(1);
        self.stats.compressed_bytes.add(bytes as u64);
    }

    /// Number of drainer threads running.
    pub fn num_drainers(&self) -> usize {
        self.drainers.len()
    }

    /// The backend (FIFO store or replay table) the drainers insert into.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// A snapshot of the counters.
    pub fn snapshot(&self) -> IngressSnapshot {
        let mut snap = IngressSnapshot {
            active_connections: self.stats.active_connections.get(),
            push_blocked_count: self.stats.push_blocked.get(),
            push_blocked_ns_total: self.stats.push_blocked_ns.get(),
            buffered_bytes: self.budget.allocated() as u64,
            connections_refused_total: self.stats.refused.get(),
            connections_evicted_total: self.stats.evicted.get(),
            samples_pending: self.stats.pending.get(),
            samples_received_in_place_total: self.stats.in_place.get(),
            v1_connections_total: self.stats.v1.get(),
            v2_connections_total: self.stats.v2.get(),
            sessions_resumed_total: self.stats.resumed.get(),
            samples_deduplicated_total: self.stats.deduplicated.get(),
            handshakes_refused_protocol_total: self.stats.refused_protocol.get(),
            handshakes_refused_auth_total: self.stats.refused_auth.get(),
            handshakes_refused_layout_total: self.stats.refused_layout.get(),
            shm_connections_total: self.stats.shm.get(),
            shm_fallbacks_total: self.stats.shm_fallback.get(),
            samples_received_compressed_total: self.stats.compressed.get(),
            compressed_bytes_received_total: self.stats.compressed_bytes.get(),
            ..IngressSnapshot::default()
        };
        snap.samples_inserted_total = self.stats.direct_inserted.get();
        for d in &self.drainers {
            snap.queue_depth_sum += d.depth_sum.get();
            snap.queue_depth_max = snap.queue_depth_max.max(d.depth_max.get());
            snap.samples_inserted_total += d.inserted.get();
            // Shared-memory connections: their segment is their queue, and no drainer pops
            // it, so its depth is read here (as of each connection task's last look).
            // `read_recursive`: never waits behind the drainer asking for the write lock
            // (see `capture`).
            let state = d.state.read_recursive();
            let incoming = d.incoming.lock();
            for conn in state.conns.iter().chain(incoming.iter()) {
                let depth = conn.segment_depth.get();
                snap.queue_depth_sum += depth;
                snap.queue_depth_max = snap.queue_depth_max.max(depth);
            }
        }
        snap
    }

    /// The drainers' `drain_round` and `queue_dwell` histograms (zero without
    /// `detailed-metrics`).
    pub fn detailed(&self) -> (HistSummary, HistSummary) {
        (self.drain_round.summary(), self.queue_dwell.summary())
    }

    /// Clears the drainers' histograms.
    pub fn reset_histograms(&self) {
        self.drain_round.reset();
        self.queue_dwell.reset();
    }

    /// Stops and joins every drainer. Close the backend first, so that a drainer blocked on a
    /// full ring returns. Samples still queued are dropped (the server is closing). Idempotent.
    /// Drainers hold the ingress alive, so this must be called; dropping is not enough.
    pub fn shutdown(&self) {
        // ORDERING: Release pairs with the drainers' Acquire loads of the flag.
        self.shutdown.store(true, Release);
        for d in &self.drainers {
            d.bell.wake();
        }
        let handles = std::mem::take(&mut *self.handles.lock());
        for handle in handles {
            if handle.join().is_err() {
                log::error!("an echo drainer thread panicked");
            }
        }
        // A connection registered while its drainer was blocked (on a full backend) was never
        // adopted, and `Connection -> DrainerShared -> incoming -> Connection` is a cycle:
        // break it, or the connection and its buffers outlive the server.
        for d in &self.drainers {
            d.incoming.lock().clear();
            // Adopted connections and a round's buffers sit in the drainer's shared state,
            // which each connection points back to: the same cycle.
            *d.state.write() = DrainerState::default();
        }
    }

    fn is_shutting_down(&self) -> bool {
        // ORDERING: Acquire pairs with the Release store in `shutdown`.
        self.shutdown.load(Acquire)
    }

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

/// One drainer round's samples, counted as the backend takes them in (so the counters are
/// right also while the rest of the round waits for room).
struct Round<'a> {
    payloads: Payloads<'a, Box<[u8]>>,
    priorities: &'a [Option<f64>],
    packed: &'a [Option<Box<[u8]>>],
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
        conn.segment_depth.sub(n);
        conn.stats.pending.sub(n);
        self.src.inserted(count);
    }
}

/// One drainer's connections and round, behind [`DrainerShared::state`].
#[derive(Default)]
struct DrainerState {
    conns: Vec<Arc<Connection>>,
    /// Buffers popped this round and, in parallel, the index of the connection each came from
    /// and its priority. All keep their capacity across rounds.
    bufs: Vec<Box<[u8]>>,
    owners: Vec<usize>,
    priorities: Vec<Option<f64>>,
    marks: Vec<StepMark>,
    /// Each buffer's compressed leaves as they arrived, if the backend keeps them so.
    packed: Vec<Option<Box<[u8]>>>,
    round: usize,
}

/// One drainer thread.
struct Drainer {
    ingress: Arc<Ingress>,
    shared: Arc<DrainerShared>,
}

impl Drainer {
    fn new(ingress: Arc<Ingress>, shared: Arc<DrainerShared>) -> Self {
        Self { ingress, shared }
    }

    fn run(self) {
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
                    log::error!("echo drainer: dropping {dropped} samples: {err}");
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
                if conn.stashed() > 0 {
                    let mut stash = conn.stash.lock();
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
                }
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
