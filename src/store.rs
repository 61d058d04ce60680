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

use std::time::Instant;

use crossbeam_utils::CachePadded;

use crate::error::{EchoError, InsertError};
use crate::metrics::{Counter, DetailedSnapshot, Stamp, StoreMetrics};
use crate::slots::Slots;
use crate::source::{validate_source, SampleSource};
use crate::spec::DataSpec;
use crate::sync::{Arc, AtomicBool, AtomicU64, AtomicUsize, Signal};

// Every `Ordering::` use below is documented in place with an `ORDERING:` comment.
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

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
    /// Next slot a writer will reserve. Only grows; writers advance it with a CAS.
    write_cursor: CachePadded<AtomicU64>,
    /// First slot the consumer has not given back. Only grows, in whole batches, and only the
    /// consumer stores it. Writers may reserve slots below `read_cursor + capacity`.
    read_cursor: CachePadded<AtomicU64>,
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
}

/// `held_batch` when the consumer holds nothing.
const NOT_HELD: u64 = u64::MAX;

/// How many threads are inside one kind of wait: entries and exits, each a statistics
/// [`Counter`]. Their difference is exact whenever nobody enters or leaves; a reader racing
/// an exit may see it before the entry, hence the saturation. Not counted under loom: the
/// models check the protocol, and two more atomics per wait would multiply their interleavings
/// for statistics that order nothing.
#[derive(Debug, Default)]
struct Waiting {
    entered: Counter,
    left: Counter,
}

impl Waiting {
    /// Runs `wait`, counted as one thread waiting.
    fn during<R>(&self, wait: impl FnOnce() -> R) -> R {
        #[cfg(not(loom))]
        self.entered.add(1);
        let out = wait();
        #[cfg(not(loom))]
        self.left.add(1);
        out
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
            self.commit(start, len);
            src.inserted(len);
            inserted += len;
        }
        Ok(())
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
            // (and we retry) if this value is stale.
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

    /// Whether slot `write` (absolute) is free for writing.
    fn has_space(&self, write: u64) -> bool {
        // ORDERING: Acquire pairs with the consumer's Release store in `Consumer::release`: it
        // orders the consumer's reads of the released batch and its reset of that batch's commit
        // counter before our writes to those slots and our `fetch_add` on the counter.
        write < self.read_cursor.load(Acquire) + self.capacity
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
            // ORDERING: Relaxed — a statistics snapshot, not used to access slots.
            .map(|i| self.commits[i].load(Relaxed) as u64)
            .sum();
        StoreStats {
            store_size,
            notify_count: self.notify_count.get(),
            // ORDERING: Relaxed — a snapshot of the cursors, not used to access slots.
            write_cursor: self.write_cursor.load(Relaxed),
            // ORDERING: Relaxed — as above.
            read_cursor: self.read_cursor.load(Relaxed),
        }
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
        // ORDERING: Relaxed — the Release store of `read_cursor` below publishes the reset to
        // every writer that can next increment this counter (they Acquire `read_cursor` first).
        store.commits[store.batch_index(batch)].store(0, Relaxed);
        // FIFO: every slot below the end of the released batch may be rewritten. A whole
        // number of batches, so a reservation (never across a batch boundary) is either
        // entirely free or entirely busy.
        let read = (batch + 1) * store.batch_size as u64;
        // ORDERING: Release pairs with the writers' Acquire in `has_space`: our reads of the
        // batch and the counter reset happen before any writer reuses the slots.
        store.read_cursor.store(read, Release);
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
