//! The store: many writers reserve slots in the ring, copy samples in and commit them; one
//! consumer takes whole batches out, zero-copy, and gives each back on its next `sample`.
//!
//! ```text
//!  writers (any thread)                               consumer (one Consumer handle)
//!  ───────────────────                                ──────────────────────────────
//!  reserve: CAS write_cursor w -> w+k                 sample():
//!    (k capped at the batch boundary; wait on           release held batch: commits[b] = 0,
//!     `space_free` while w >= read_cursor + cap)        read_cursor = (b+1)*bs, notify space_free
//!  memcpy every leaf into slots w..w+k                wait on `batch_ready` until
//!  commit: commits[batch].fetch_add(k)                  commits[next] == batch_size
//!    the writer that completes the batch              hand out slots next*bs..(next+1)*bs
//!    notifies `batch_ready` (once per batch)
//! ```
//!
//! Cursors are absolute and only grow; slot `s` lives at ring slot `s % capacity`, batch `b` at
//! ring batch `b % num_batches`, and `capacity = batch_size * num_batches`.
//!
//! Invariants (checked by `tests/loom_store.rs`, `tests/stress_store.rs`, `tests/prop_store.rs`):
//! 1. `read_cursor <= write_cursor <= read_cursor + capacity`, and `read_cursor` is always a
//!    multiple of `batch_size`.
//! 2. A reservation never crosses a batch boundary, so it lies in exactly one batch and that
//!    batch's commit counter reaches `batch_size` exactly once per lap: exactly one wake-up.
//! 3. Slots `[read_cursor, read_cursor + capacity)` belong either to the writer that reserved
//!    them (until commit), to nobody (committed, waiting), or to the consumer (handed out, until
//!    released). Nobody writes a slot the consumer holds.
//! 4. `read_cursor == min(released, pin rounded down to a batch)` (both under the `limits`
//!    lock): the consumer's release end, and the first slot a running checkpoint has not
//!    copied yet. So a checkpoint *pins* the slots it still has to copy: writers reuse them
//!    only once it has, and at worst wait for space (backpressure), never see or cause torn
//!    data.
//!
//! Checkpoints ([`Store::checkpoint`]): a point-in-time snapshot of every committed sample not
//! yet handed to the consumer, taken while writers and the consumer go on.
//!
//! ```text
//!  checkpoint                                       writers / consumer meanwhile
//!  ──────────                                       ────────────────────────────
//!  1. freeze: W = write_cursor.fetch_or(FROZEN)     a CAS from a value without the bit
//!                                                   fails; `has_space` says no: writers
//!                                                   wait on `space_free` (reservations made
//!                                                   before the freeze go on to commit)
//!  2. under `limits`: S = taken * batch_size,       the consumer may take batches >= S (it
//!     pin = S (read_cursor is already <= S)         only reads them); a release stops at S
//!  3. wait until every slot of [S, W) is committed  in-flight copies finish (no writer
//!     (counter == expected, or the batch taken)     waits between reserve and commit)
//!  4. thaw: clear FROZEN, notify `space_free`       writers reserve slots >= W again, but
//!                                                   below pin + capacity: never in [pin, W)
//!  5. copy [S, W) in chunks; after each chunk        the pin rises chunk by chunk: space
//!     pin = copied end, read_cursor = min(...)      comes back as the copy goes
//!  6. drop: pin = none, read_cursor = released
//! ```
//!
//! Steps 1-4 are the only stop, and they stop nobody but writers that want a new reservation,
//! for as long as the copies already reserved take to commit (a memcpy each). The partial
//! batch at `W` is included: with no reservation past `W`, its counter tells exactly when
//! its slots below `W` are all committed (commits may finish out of order).

use std::time::Instant;

use crossbeam_utils::CachePadded;

mod checkpoint;
pub use checkpoint::RingCheckpoint;

use crate::error::{EchoError, InsertError};
use crate::metrics::{Counter, DetailedSnapshot, Stamp, StoreMetrics};
use crate::slots::Slots;
use crate::source::{validate_source, SampleSource};
use crate::spec::DataSpec;
use crate::sync::{Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex, Signal};

// Every `Ordering::` use below is documented in place with an `ORDERING:` comment.
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// Set in `write_cursor` while a checkpoint takes its snapshot (steps 1-4 in the module docs).
/// Cursors never come near 2^63 (that is centuries of samples at any rate).
const FROZEN: u64 = 1 << 63;

/// A snapshot of the store's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Committed samples the consumer has not been handed yet.
    pub store_size: u64,
    /// Batches completed (one consumer wake-up each).
    pub notify_count: u64,
    /// Slots ever reserved by writers.
    pub write_cursor: u64,
    /// Slots ever given back by the consumer.
    pub read_cursor: u64,
    /// Nanoseconds writers spent waiting for free slots (the ring full), summed over writers,
    /// those waiting outside the store included ([`Store::note_insert_blocked`]).
    pub insert_blocked_ns: u64,
}

/// The shared state between writers and the consumer. Create with [`Store::new`].
#[derive(Debug)]
pub struct Store {
    /// Page-locking of the ring, if requested. Declared before `ring` so that it is dropped
    /// (unregistered) before the ring memory is freed.
    #[cfg(not(loom))]
    pinned: crate::pinned::Pinning,
    ring: Slots,
    spec: DataSpec,
    batch_size: usize,
    num_batches: usize,
    /// `batch_size * num_batches`, the ring's slot count.
    capacity: u64,
    /// Next slot a writer will reserve. Only grows; writers advance it with a CAS. Its top bit
    /// is [`FROZEN`] while a checkpoint takes its snapshot: no reservation succeeds then.
    write_cursor: CachePadded<AtomicU64>,
    /// `limits.read_cursor()`: the first slot that is not free for writers, a multiple of
    /// `batch_size`. Only grows, and is only stored under the `limits` lock. Writers may
    /// reserve slots below `read_cursor + capacity`.
    read_cursor: CachePadded<AtomicU64>,
    /// What `read_cursor` is made of (invariant 4). Taken once per released batch and once
    /// per checkpoint chunk, never by writers.
    limits: Mutex<Limits>,
    /// Batches handed to the consumer so far (the index of the next one). Only the consumer
    /// stores it; a checkpoint reads it to know where the samples not yet handed out begin.
    taken: CachePadded<AtomicU64>,
    /// Set while a [`RingCheckpoint`] lives: one at a time.
    checkpointing: AtomicBool,
    /// Set while restored samples are still going in ([`Store::restore`]): every other insert
    /// waits, so that nothing new goes in before them.
    restoring: AtomicBool,
    /// `commits[b % num_batches]`: slots of batch `b` written and committed. Reaches
    /// `batch_size` exactly once per lap; reset to 0 by the consumer on release, before
    /// `read_cursor` moves past the batch (so no writer of the next lap can see the old count).
    commits: Box<[CachePadded<AtomicUsize>]>,
    closed: AtomicBool,
    /// Set once a [`Consumer`] exists; there is never a second one.
    consumer_taken: AtomicBool,
    /// The consumer waits here for a full batch; the completing writer notifies.
    batch_ready: Signal,
    /// Writers wait here for free slots; the consumer notifies on every release.
    space_free: Signal,
    notify_count: CachePadded<Counter>,
    /// Writers waiting on `space_free`, and the consumer waiting on `batch_ready`.
    waiting_inserts: Waiting,
    waiting_samples: Waiting,
    /// Index of the batch the consumer holds, [`NOT_HELD`] if none: statistics only.
    held_batch: Counter,
    /// Zero-sized unless the `detailed-metrics` feature is on.
    metrics: StoreMetrics,
    /// The server's policy versions, set once when it keeps them.
    #[cfg(not(loom))]
    pub(crate) versions: std::sync::OnceLock<std::sync::Arc<crate::versions::PolicyVersions>>,
    /// Two batches (halves) where a [`FreshRing`](crate::fresh_ring::FreshRing) gathers the
    /// fresh rows of batches that held stale ones; made with it.
    #[cfg(not(loom))]
    spill: std::sync::OnceLock<Slots>,
}

/// `held_batch` when the consumer holds nothing.
const NOT_HELD: u64 = u64::MAX;

/// The two bounds `read_cursor` is the minimum of.
#[derive(Debug, Default)]
struct Limits {
    /// End of the last batch the consumer gave back (0 before any).
    released: u64,
    /// First snapshot slot a running checkpoint has not copied yet; `None` when none runs.
    pin: Option<u64>,
    /// Slots of the batches the consumer took that it has not handed out yet (0 unless a
    /// [`FreshRing`](crate::fresh_ring::FreshRing) judges a batch row by row): a checkpoint
    /// starts at `taken * batch_size - behind`.
    behind: u64,
    /// The spill half being filled, and its rows (copies of slots already released) that a
    /// checkpoint takes before the ring's.
    spill_half: usize,
    spill_rows: usize,
}

impl Limits {
    /// `min(released, pin)`, the pin rounded down to a batch boundary: `read_cursor` stays a
    /// multiple of `batch_size` (invariant 1), so a reservation (which may run to the end of
    /// its batch) that passes the space check never reaches a pinned slot.
    fn read_cursor(&self, batch_size: u64) -> u64 {
        self.pin.map_or(self.released, |pin| (pin / batch_size * batch_size).min(self.released))
    }
}

/// How many threads are inside one kind of wait: entries and exits, each a statistics
/// [`Counter`]. Their difference is exact whenever nobody enters or leaves; a reader racing
/// an exit may see it before the entry, hence the saturation. Not counted under loom: the
/// models check the protocol, and two more atomics per wait would multiply their interleavings
/// for statistics that order nothing.
#[derive(Debug, Default)]
struct Waiting {
    entered: Counter,
    left: Counter,
    /// Nanoseconds spent inside `during`, summed over threads.
    waited_ns: Counter,
}

impl Waiting {
    /// Runs `wait`, counted as one thread waiting, and timed.
    fn during<R>(&self, wait: impl FnOnce() -> R) -> R {
        #[cfg(not(loom))]
        self.entered.add(1);
        #[cfg(not(loom))]
        let started = Instant::now();
        let out = wait();
        #[cfg(not(loom))]
        {
            self.add_waited(started.elapsed());
            self.left.add(1);
        }
        out
    }

    fn add_waited(&self, waited: std::time::Duration) {
        self.waited_ns.add(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX));
    }

    fn now(&self) -> u64 {
        let left = self.left.get();
        self.entered.get().saturating_sub(left)
    }
}

impl Store {
    /// A store holding `num_batches` batches of `batch_size` samples of `spec`.
    ///
    /// # Errors
    /// [`EchoError::Config`] if `batch_size < 1`, `num_batches < 2` or the ring would not fit
    /// in memory; [`EchoError::OutOfMemory`] if allocation fails.
    pub fn new(
        spec: DataSpec,
        batch_size: usize,
        num_batches: usize,
    ) -> Result<Arc<Self>, EchoError> {
        if batch_size < 1 {
            return Err(EchoError::Config(format!("batch_size must be >= 1, got {batch_size}")));
        }
        if num_batches < 2 {
            return Err(EchoError::Config(format!(
                "a store needs at least 2 batches (one for the consumer, one for writers), got {num_batches}"
            )));
        }
        let capacity = batch_size.checked_mul(num_batches).ok_or_else(|| {
            EchoError::Config(format!(
                "{num_batches} batches of {batch_size} samples overflow usize"
            ))
        })?;
        let ring = Slots::new(&spec, capacity)?;
        let commits = (0..num_batches).map(|_| CachePadded::new(AtomicUsize::new(0))).collect();
        Ok(Arc::new(Self {
            #[cfg(not(loom))]
            pinned: crate::pinned::Pinning::default(),
            ring,
            spec,
            batch_size,
            num_batches,
            capacity: capacity as u64,
            write_cursor: CachePadded::new(AtomicU64::new(0)),
            read_cursor: CachePadded::new(AtomicU64::new(0)),
            limits: Mutex::new(Limits::default()),
            taken: CachePadded::new(AtomicU64::new(0)),
            checkpointing: AtomicBool::new(false),
            restoring: AtomicBool::new(false),
            commits,
            closed: AtomicBool::new(false),
            consumer_taken: AtomicBool::new(false),
            batch_ready: Signal::default(),
            space_free: Signal::default(),
            notify_count: CachePadded::new(Counter::default()),
            waiting_inserts: Waiting::default(),
            waiting_samples: Waiting::default(),
            held_batch: Counter::new(NOT_HELD),
            metrics: StoreMetrics::default(),
            #[cfg(not(loom))]
            versions: std::sync::OnceLock::new(),
            #[cfg(not(loom))]
            spill: std::sync::OnceLock::new(),
        }))
    }

    /// The sample layout this store holds.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// Samples per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Batches the ring holds.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }

    /// The single consumer handle. `None` if one was already taken.
    pub fn consumer(self: &Arc<Self>) -> Option<Consumer> {
        // ORDERING: Relaxed — the flag only has to be claimed once; it guards no other memory.
        if self.consumer_taken.swap(true, Relaxed) {
            return None;
        }
        Some(Consumer { store: Arc::clone(self), next: 0, held: None })
    }

    /// Closes the store: blocked and future inserts fail with `Closed`, the consumer's
    /// `sample` returns [`EchoError::Closed`]. Idempotent.
    pub fn close(&self) {
        // ORDERING: Release/Acquire pair with the waiters' `is_closed` loads; the notifications
        // below take the signals' locks, so a waiter that checked before the store is parked.
        self.closed.store(true, Release);
        self.batch_ready.notify_all();
        self.space_free.notify_all();
    }

    /// Rung whenever a waiting insert might now go further (see [`Backend::insert_bell`]).
    ///
    /// [`Backend::insert_bell`]: crate::backend::Backend::insert_bell
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn space_bell(&self) -> &crate::sync::AsyncBell {
        self.space_free.bell()
    }

    /// Whether [`Store::close`] was called.
    pub fn is_closed(&self) -> bool {
        // ORDERING: Acquire pairs with the Release store in `close`.
        self.closed.load(Acquire)
    }

    /// Copies every sample of `src` into the ring, waiting for space (until `deadline`, or
    /// without limit if `None`). Samples go in in order; the whole source is validated against
    /// the spec before anything is written.
    ///
    /// # Errors
    /// An input error ([`EchoError::LeafCount`], [`EchoError::SizeMismatch`]; nothing written),
    /// or [`EchoError::Closed`] / [`EchoError::TimedOut`] with the count written so far.
    pub fn insert<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        validate_source(&self.spec, src)?;
        // ORDERING: Relaxed — the flag orders no memory (restored samples are published by their
        // commits like any others); it is set before the store is shared and cleared before a
        // `notify_all`, which the wait below re-checks under the signal's lock.
        if self.restoring.load(Relaxed) {
            let ready = self.waiting_inserts.during(|| {
                self.space_free.wait_until(
                    // ORDERING: Relaxed — as above.
                    || self.is_closed() || !self.restoring.load(Relaxed),
                    deadline,
                )
            });
            if self.is_closed() {
                return Err(InsertError::new(0, EchoError::Closed));
            }
            if !ready {
                return Err(InsertError::new(0, EchoError::TimedOut));
            }
        }
        self.insert_unchecked(src, deadline)
    }

    /// [`Store::insert`] without the restore gate (the source is already validated).
    fn insert_unchecked<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        let total = src.num_samples();
        let mut inserted = 0;
        while inserted < total {
            let (start, len) = self
                .reserve(total - inserted, deadline)
                .map_err(|error| InsertError::new(inserted, error))?;
            let copy_started = Stamp::now();
            for i in 0..len {
                let slot = self.ring_slot(start + i as u64);
                for leaf in 0..self.spec.len() {
                    // `reserve`'s CAS made `start..start + len` unique among writers, and its
                    // space check put it below `read_cursor + capacity`: nobody else touches it.
                    // SAFETY: exclusive slots as above; sizes were validated by `validate`, so
                    // `copy_leaf` gets a destination of exactly the leaf's size.
                    unsafe {
                        self.ring
                            .fill_slot(slot, leaf, |dst| src.copy_leaf(inserted + i, leaf, dst));
                    }
                }
            }
            self.metrics.memcpy.record_since(copy_started);
            // Before the commit: a checkpoint that sees the commit (with Acquire) also sees the
            // source's count of samples in (the ingress relies on it to tell which of a
            // drainer's samples the snapshot already has).
            src.inserted(len);
            self.commit(start, len);
            inserted += len;
        }
        Ok(())
    }

    /// Writes one sample straight into the ring, if a slot is free now: `fill` gets that
    /// slot of every leaf (in spec order) and must write all of their bytes. The slot is
    /// committed when `fill` returns, so `fill` cannot fail; whoever calls this must already
    /// have the bytes at hand (the TCP ingress calls it only when the kernel holds the whole
    /// sample). Returns `false`, without calling `fill`, when the ring is full or closed, a
    /// checkpoint is taking its snapshot, or restored samples are still going in: never
    /// waits.
    pub fn try_insert_in_place(&self, fill: impl FnOnce(&mut [&mut [u8]])) -> bool {
        // ORDERING: Relaxed — as in `insert`: restored samples go in first; the caller's
        // fallback (`insert`) waits for them.
        if self.restoring.load(Relaxed) {
            return false;
        }
        let Some(start) = self.try_reserve_one() else { return false };
        let copy_started = Stamp::now();
        let slot = self.ring_slot(start);
        // SAFETY: `try_reserve_one`'s CAS made slot `start` ours alone and its space check put
        // it below `read_cursor + capacity`: nobody reads or writes it until we commit.
        unsafe { self.ring.write_in_place(slot, fill) };
        self.metrics.memcpy.record_since(copy_started);
        self.commit(start, 1);
        true
    }

    /// [`Store::reserve`] of one slot without waiting: `None` when the ring is full or closed.
    fn try_reserve_one(&self) -> Option<u64> {
        loop {
            if self.is_closed() {
                return None;
            }
            // ORDERING: Relaxed — as in `reserve`: the CAS hands out unique slots, and
            // `has_space` acquires `read_cursor`.
            let write = self.write_cursor.load(Relaxed);
            if !self.has_space(write) {
                return None;
            }
            // ORDERING: Relaxed on success and failure — as in `reserve`.
            let cas = self.write_cursor.compare_exchange_weak(write, write + 1, Relaxed, Relaxed);
            if cas.is_ok() {
                self.metrics.cas_success.add(1);
                return Some(write);
            }
            self.metrics.cas_failure.add(1);
        }
    }

    /// Reserves up to `want` slots (at least one, never across a batch boundary). Returns the
    /// first absolute slot and the count.
    fn reserve(&self, want: usize, deadline: Option<Instant>) -> Result<(u64, usize), EchoError> {
        debug_assert!(want > 0);
        let batch_size = self.batch_size as u64;
        loop {
            if self.is_closed() {
                return Err(EchoError::Closed);
            }
            // ORDERING: Relaxed — the CAS below only needs to hand out unique ranges; it fails
            // (and we retry) if this value is stale or a checkpoint froze the cursor since
            // (the [`FROZEN`] bit makes the value differ). A frozen value fails `has_space`.
            let write = self.write_cursor.load(Relaxed);
            if !self.has_space(write) {
                self.metrics.reservation_retries.add(1);
                let ready = self.waiting_inserts.during(|| {
                    self.space_free.wait_until(
                        || {
                            // ORDERING: Relaxed — see above; `has_space` acquires `read_cursor`.
                            self.is_closed() || self.has_space(self.write_cursor.load(Relaxed))
                        },
                        deadline,
                    )
                });
                if !ready {
                    return Err(EchoError::TimedOut);
                }
                continue;
            }
            let batch_end = (write / batch_size + 1) * batch_size;
            let len = (want as u64).min(batch_end - write);
            let next = write + len;
            // ORDERING: Relaxed on success and failure — uniqueness comes from the CAS itself;
            // the slot memory was made ours by the Acquire load of `read_cursor` in `has_space`
            // (pairs with the consumer's Release store in `release`), and our writes are
            // published by the Release `fetch_add` in `commit`.
            let cas = self.write_cursor.compare_exchange_weak(write, next, Relaxed, Relaxed);
            if cas.is_ok() {
                self.metrics.cas_success.add(1);
                return Ok((write, len as usize));
            }
            self.metrics.cas_failure.add(1);
        }
    }

    /// Whether slot `write` (absolute) is free for writing; never while `write` carries the
    /// [`FROZEN`] bit (a checkpoint thaws it and then notifies `space_free`).
    fn has_space(&self, write: u64) -> bool {
        // ORDERING: Acquire pairs with the Release stores of `read_cursor` (in
        // `Consumer::release` and as a checkpoint's pin moves, both under `limits`): it orders
        // the consumer's reads of the released batch, its reset of that batch's commit counter
        // and a checkpoint's copy of those slots before our writes to the slots and our
        // `fetch_add` on the counter.
        write & FROZEN == 0 && write < self.read_cursor.load(Acquire) + self.capacity
    }

    /// Publishes slots `start..start + len` (all in one batch) to the consumer.
    fn commit(&self, start: u64, len: usize) {
        let batch = start / self.batch_size as u64;
        let counter = &self.commits[self.batch_index(batch)];
        // ORDERING: Release publishes our slot writes; the consumer's Acquire load that sees the
        // count reach `batch_size` synchronises with every writer's `fetch_add` (they form one
        // release sequence on this counter).
        let before = counter.fetch_add(len, Release);
        debug_assert!(before + len <= self.batch_size, "commit overflowed its batch");
        if before + len == self.batch_size {
            self.notify_count.add(1);
            // Exactly one writer sees the count reach `batch_size`, so one wake-up per batch.
            self.batch_ready.notify_one();
        }
    }

    fn is_committed(&self, batch: u64) -> bool {
        // ORDERING: Acquire pairs with the writers' Release `fetch_add` in `commit`, making the
        // slot bytes of a complete batch visible to the consumer.
        self.commits[self.batch_index(batch)].load(Acquire) == self.batch_size
    }

    fn ring_slot(&self, absolute: u64) -> usize {
        (absolute % self.capacity) as usize
    }

    fn batch_index(&self, batch: u64) -> usize {
        (batch % self.num_batches as u64) as usize
    }

    /// A snapshot of the counters. `store_size` counts committed samples in every batch the
    /// consumer does not hold.
    pub fn stats(&self) -> StoreStats {
        let held = self.held_batch.get();
        let held_index = (held != NOT_HELD).then(|| self.batch_index(held));
        let store_size = (0..self.num_batches)
            .filter(|&i| Some(i) != held_index)
            // ORDERING: Acquire pairs with the writers' Release `fetch_add` in `commit`: a
            // commit seen here brings along what its writer counted before it (an ingress's
            // `samples_inserted_total`, read after this), so that counter never lags
            // `store_size`. Not used to access slots.
            .map(|i| self.commits[i].load(Acquire) as u64)
            .sum();
        StoreStats {
            store_size,
            notify_count: self.notify_count.get(),
            // ORDERING: Relaxed — a snapshot of the cursors, not used to access slots.
            write_cursor: self.write_cursor.load(Relaxed) & !FROZEN,
            // ORDERING: Relaxed — as above.
            read_cursor: self.read_cursor.load(Relaxed),
            insert_blocked_ns: self.waiting_inserts.waited_ns.get(),
        }
    }

    /// Counts `waited` as writers' time waiting for free slots: a writer that waited outside
    /// the store (the shared-memory path's task, on the insert bell) after an insert that did
    /// not wait was refused for want of room.
    pub fn note_insert_blocked(&self, waited: std::time::Duration) {
        self.waiting_inserts.add_waited(waited);
    }

    /// Writers inside `insert` waiting for free slots right now. With
    /// [`Store::waiting_samples`], lets a test see that a call is blocked instead of sleeping
    /// and hoping it is.
    pub fn waiting_inserts(&self) -> u64 {
        self.waiting_inserts.now()
    }

    /// 1 while the consumer is in `sample` waiting for the next batch (or just checking that
    /// it is complete), else 0.
    pub fn waiting_samples(&self) -> u64 {
        self.waiting_samples.now()
    }

    /// Page-locks every ring buffer with `cudaHostRegister`, loading the CUDA runtime from the
    /// first of `cuda_runtimes` that opens. Unregistered when the store is dropped, i.e. after
    /// the last consumer, writer and view. Idempotent.
    ///
    /// # Errors
    /// [`EchoError::Io`] saying what is missing (runtime library, device) or which CUDA call
    /// failed; nothing stays registered then.
    ///
    /// # Safety
    /// Every path in `cuda_runtimes` must be a CUDA runtime library (loading runs its code).
    #[cfg(not(loom))]
    pub unsafe fn pin_host_memory(
        &self,
        cuda_runtimes: &[std::path::PathBuf],
    ) -> Result<(), EchoError> {
        // SAFETY: the ranges are the ring's own allocations, which live as long as `self`;
        // `self.pinned` is dropped before `self.ring` (field order). The caller vouches for
        // the libraries.
        unsafe { self.pinned.pin(cuda_runtimes, || self.ring.buffers()) }
    }

    /// Whether the ring is page-locked.
    #[cfg(not(loom))]
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_pinned()
    }

    /// The detailed counters and the `memcpy` histogram (all zero without `detailed-metrics`).
    pub fn detailed(&self) -> DetailedSnapshot {
        DetailedSnapshot {
            cas_success_total: self.metrics.cas_success.get(),
            cas_failure_total: self.metrics.cas_failure.get(),
            reservation_retries_total: self.metrics.reservation_retries.get(),
            memcpy: self.metrics.memcpy.summary(),
            ..DetailedSnapshot::default()
        }
    }

    /// Clears the `memcpy` histogram; counters keep counting.
    pub fn reset_histograms(&self) {
        self.metrics.memcpy.reset();
    }

    /// Address of the first byte of `leaf` for absolute batch `batch`: `batch_size` contiguous
    /// slots. Reading through it is sound only while the consumer holds that batch.
    pub fn batch_ptr(&self, batch: u64, leaf: usize) -> *const u8 {
        self.ring.slot_ptr(leaf, self.batch_index(batch) * self.batch_size)
    }

    /// Bytes one sample of `leaf` takes in the ring.
    pub fn leaf_bytes(&self, leaf: usize) -> usize {
        self.ring.slot_bytes(leaf)
    }
}

/// The one consumer of a [`Store`]. Not `Clone` and `sample` takes `&mut self`, so two threads
/// can never be inside it at once; share it behind a mutex if you must.
#[derive(Debug)]
pub struct Consumer {
    store: Arc<Store>,
    /// Absolute index of the batch handed out next: batches go out in commit-slot order.
    next: u64,
    /// The batch handed out by the last `sample`, given back on the next call or `release`.
    held: Option<u64>,
}

impl Consumer {
    /// The store this consumer reads.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Gives the held batch (if any) back to the writers.
    pub fn release(&mut self) {
        let Some(batch) = self.held.take() else {
            return;
        };
        let store = &self.store;
        store.held_batch.set(NOT_HELD);
        // ORDERING: Relaxed — the Release store of `read_cursor` below (ours, or a checkpoint's
        // under the same lock, later) publishes the reset to every writer that can next
        // increment this counter (they Acquire `read_cursor` first).
        store.commits[store.batch_index(batch)].store(0, Relaxed);
        // FIFO: every slot below the end of the released batch may be rewritten, unless a
        // checkpoint still has to copy it (invariant 4). A whole number of batches, or a
        // checkpoint's copied end; either way the slots below it are done with.
        let released = (batch + 1) * store.batch_size as u64;
        {
            let mut limits = store.limits.lock();
            limits.released = released;
            // Whatever of it was not handed out is given up with it.
            limits.behind = 0;
            // ORDERING: Release pairs with the writers' Acquire in `has_space`: our reads of
            // the batch and the counter reset happen before any writer reuses the slots.
            store.read_cursor.store(limits.read_cursor(store.batch_size as u64), Release);
        }
        // Unconditional: a writer that found the ring full is parked or about to park on
        // `space_free`; it re-checks `read_cursor` under the signal's lock, so this cannot be lost.
        store.space_free.notify_all();
    }

    /// Gives back the held batch, then waits (until `deadline`, or without limit) for the next
    /// full batch and holds it. Returns its absolute batch index.
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the store is closed, [`EchoError::TimedOut`] when the
    /// deadline passes first (nothing is lost: the same batch is awaited on the next call).
    pub fn sample(&mut self, deadline: Option<Instant>) -> Result<u64, EchoError> {
        self.take(deadline, None)
    }

    /// [`Consumer::sample`] for a consumer that hands the batch out row by row: `behind` of
    /// its slots are not handed out yet when it is taken (all of them, `batch_size`), stored
    /// with the taken count under `limits`, so that a checkpoint starts at the first of them.
    ///
    /// # Errors
    /// As [`Consumer::sample`].
    #[cfg(not(loom))]
    pub(crate) fn take_unhanded(&mut self, deadline: Option<Instant>) -> Result<u64, EchoError> {
        self.take(deadline, Some(self.store.batch_size as u64))
    }

    /// Records, for checkpoints, which rows of the held batch are not handed out yet (the
    /// last `behind`) and which gathered rows `half` of the spill holds (`rows`).
    #[cfg(not(loom))]
    pub(crate) fn set_unhanded(&self, behind: u64, half: usize, rows: usize) {
        let mut limits = self.store.limits.lock();
        limits.behind = behind;
        limits.spill_half = half;
        limits.spill_rows = rows;
    }

    /// Drops, from the `rows` gathered rows of spill half `half`, those `keep` refuses (it is
    /// given each row's bytes of leaf `leaf`), moving the rest down in order; returns how many
    /// are left. Under `limits`, so that a checkpoint copies the rows before or after, never
    /// while they move.
    #[cfg(not(loom))]
    pub(crate) fn compact_spill(
        &self,
        half: usize,
        rows: usize,
        leaf: usize,
        mut keep: impl FnMut(&[u8]) -> bool,
    ) -> usize {
        let store = &self.store;
        let Some(spill) = store.spill.get() else { return rows };
        let mut limits = store.limits.lock();
        let first = half * store.batch_size;
        let size = spill.slot_bytes(leaf);
        // SAFETY: only this consumer writes the spill (it is in `&self`'s owner's `sample`),
        // and checkpoints read it under `limits`, which we hold.
        let kept: Vec<usize> = unsafe {
            spill.read_slots(leaf, first..first + rows, |bytes| {
                (0..rows).filter(|&r| keep(&bytes[r * size..(r + 1) * size])).collect()
            })
        };
        for leaf in 0..store.spec.len() {
            for (to, &from) in kept.iter().enumerate().filter(|(to, from)| to != *from) {
                // SAFETY: as above; `to < from`, so a row is read before it is overwritten.
                let row = unsafe {
                    spill.read_slots(leaf, first + from..first + from + 1, <[u8]>::to_vec)
                };
                // SAFETY: as above.
                unsafe { spill.write_slot(first + to, leaf, &row) };
            }
        }
        limits.spill_rows = kept.len();
        kept.len()
    }

    /// Calls `f` with the bytes of rows `rows` of `leaf` of the held batch.
    ///
    /// # Panics
    /// If no batch is held, `leaf` or a row is out of range.
    #[cfg(not(loom))]
    pub(crate) fn read_rows<T>(
        &self,
        leaf: usize,
        rows: std::ops::Range<usize>,
        f: impl FnOnce(&[u8]) -> T,
    ) -> T {
        let batch = self.held.expect("read_rows needs a held batch");
        let store = &self.store;
        assert!(rows.end <= store.batch_size, "rows {rows:?} out of the batch");
        let start = store.batch_index(batch) * store.batch_size;
        // SAFETY: as `read_leaf`: this consumer holds `batch`, and only `release` (which needs
        // `&mut self`) lets writers at its slots again.
        unsafe { store.ring.read_slots(leaf, start + rows.start..start + rows.end, f) }
    }

    fn take(&mut self, deadline: Option<Instant>, behind: Option<u64>) -> Result<u64, EchoError> {
        self.release();
        let store = &self.store;
        let batch = self.next;
        let ready = store.waiting_samples.during(|| {
            store
                .batch_ready
                .wait_until(|| store.is_closed() || store.is_committed(batch), deadline)
        });
        if store.is_closed() {
            return Err(EchoError::Closed);
        }
        if !ready {
            return Err(EchoError::TimedOut);
        }
        self.next = batch + 1;
        self.held = Some(batch);
        store.held_batch.set(batch);
        // Rows taken but not handed out go in a checkpoint: `behind` changes with `taken`.
        let limits = behind.map(|behind| {
            let mut limits = store.limits.lock();
            limits.behind = behind;
            limits
        });
        // ORDERING: Release — a checkpoint that Acquires this count (step 3 of the module docs)
        // sees this batch's bytes through us: our Acquire of its commit counter above saw
        // every writer's Release.
        store.taken.store(self.next, Release);
        drop(limits);
        Ok(batch)
    }

    /// The batch currently held, if any.
    pub fn held(&self) -> Option<u64> {
        self.held
    }

    /// Calls `f` with the bytes of `leaf` of the held batch (`batch_size` samples back to back).
    ///
    /// # Panics
    /// If no batch is held or `leaf` is out of range.
    pub fn read_leaf<T>(&self, leaf: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        let batch = self.held.expect("read_leaf needs a held batch: call sample() first");
        let start = self.store.batch_index(batch) * self.store.batch_size;
        // SAFETY: this consumer holds `batch` (committed, observed with Acquire in `sample`) and
        // only `release` (which needs `&mut self`, impossible while `&self` is borrowed here)
        // lets writers at these slots again.
        unsafe { self.store.ring.read_slots(leaf, start..start + self.store.batch_size, f) }
    }

    /// A snapshot of the store's counters, as seen from this consumer.
    pub fn stats(&self) -> StoreStats {
        self.store.stats()
    }
}
