//! The table shell: what a replay [`Table`](super::Table) and a
//! [`SequenceTable`](super::SequenceTable) both wrap around their own slots, one [`Shell`] each.
//!
//! A table keeps its items (slots or chunks), its samplers and its rate limiter in a state
//! behind one lock, which is the table's own. Around that state the two tables are the same,
//! and the shell is that sameness, written once:
//! - the **wait/close protocol**: writers park on `insert_ready` (or await `insert_bell`)
//!   until the rate limiter lets them in, the one consumer parks on `sample_ready` until it
//!   may draw; [`Shell::close`] wakes both for good. Every park happens with the table's lock
//!   held up to the condvar's release of it, and every notifier changes the state under that
//!   lock first, so no wake-up falls between a waiter's check and its park;
//! - the **consumer claim** (one [`Shell::claim_consumer`] succeeds per table);
//! - the **sample rounds** (`Shell::draw_rounds`): draw what the limiter allows, wait for
//!   more, and say what held a timed-out call back;
//! - the **priority checks** every insert, update and restore makes (`check_priority`);
//! - the **batch area**, two halves of `batch_size` items the consumer gathers into, and its
//!   page-locking for the GPU (`Shell::pin_host_memory`).
//!
//! Its locks, condvars and atomics come from [`crate::sync`], and the wait/close half builds
//! under `--cfg loom` on its own (the batch area and the limiter do not): `tests/loom_shell.rs`
//! checks that protocol on this very code. That is also why the module is public, hidden from
//! the docs.
//!
//! ```text
//!  writer (table lock held)                   consumer (table lock held)
//!  ────────────────────────                   ──────────────────────────
//!  wait_writable: closed? ready? deadline?    draw_rounds: closed? drawn enough?
//!    park on insert_ready (lock released)       draw what the limiter allows; wake_writers
//!  ... insert, notify_sample ...                park on sample_ready (lock released)
//!                     close (lock held): closed = true; wake both sides
//! ```

use std::time::Instant;

use crate::error::EchoError;
use crate::metrics::Counter;
use crate::sync::{AsyncBell, AtomicBool, Condvar, MutexGuard};
#[cfg(not(loom))]
use crate::{
    replay::limiter::{InsertHoldback, RateLimit, RateLimiter, SampleHoldback},
    replay::select::ItemSampler,
    slots::Slots,
    source::SampleSource,
};

// Every `Ordering::` use below is documented in place with an `ORDERING:` comment.
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// The largest priority a table accepts (far below what any sum tree can hold).
pub const MAX_PRIORITY: f64 = 1e250;

/// Who is parked in a table right now. Kept in the table's state, so it is read and written
/// only under the table's lock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Parked {
    /// Writers inside [`Shell::wait_writable`] parked on `insert_ready`; a test that reads 1
    /// knows the writer is parked (the count changes only under the lock the park releases).
    pub inserts: u64,
    /// 1 while the consumer is parked on `sample_ready`.
    pub samples: u64,
}

/// Which side waited, for [`WaitState::add_blocked_ns`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A writer waited for the rate limiter (or room).
    Insert,
    /// The consumer waited for items or the rate limiter.
    Sample,
}

/// The part of a table's locked state the shell's waits keep up to date.
pub trait WaitState {
    /// Who is parked now.
    fn parked(&mut self) -> &mut Parked;
    /// Adds `ns` to the time `side` spent waiting (the table's `*_blocked_ns` counters).
    fn add_blocked_ns(&mut self, side: Side, ns: u64);
}

/// The shell of a table (see the module docs): its wait/close protocol, consumer claim and
/// batch area.
pub struct Shell {
    /// Writers park here until the table lets them in. Notified (`wake_writers`) after every
    /// change, made under the table's lock, that can let a parked writer go on: a sample
    /// progressed, room appeared, a restore finished, the table closed.
    pub(super) insert_ready: Condvar,
    /// Rung with every `insert_ready` notification, for async writers that await instead of
    /// parking (`Backend::insert_bell`).
    insert_bell: AsyncBell,
    /// The consumer parks here until it may draw. Notified after every change, made under
    /// the table's lock, that can let it draw: an item (window) published, a restore, close.
    pub(super) sample_ready: Condvar,
    /// Set once by [`Shell::close`], never cleared. Stored with the table's lock held, so a
    /// waiter that read `false` under the lock is parked before the close's notifications.
    closed: AtomicBool,
    /// Set by the one successful [`Shell::claim_consumer`], never cleared.
    consumer_taken: AtomicBool,
    /// Nanoseconds async writers waited on `insert_bell` after the table refused an insert
    /// that does not wait (`note_insert_blocked`): part of `insert_blocked_ns`, kept outside
    /// the lock so that such a writer never waits for it (a long `update_priorities` holds
    /// it).
    #[cfg_attr(loom, allow(dead_code))] // read by the tables' `stats`
    pub(super) insert_blocked_outside_ns: Counter,
    /// How the table paces inserts and samples (for what held a call back).
    #[cfg(not(loom))]
    limit: RateLimit,
    /// Items (windows) per batch: each half of `area` holds one batch.
    #[cfg(not(loom))]
    batch_size: usize,
    /// Page-locking of the batch area, if requested. Declared before `area` so that it is
    /// dropped (unregistered) before the area is freed.
    #[cfg(not(loom))]
    pinned: crate::pinned::Pinning,
    /// Two batches (halves): batch `h` is slots `h * batch_size .. (h + 1) * batch_size` of
    /// every leaf (the table's leaves, then its per-item values). Only the consumer writes
    /// it, one half per `sample`; the other half is the batch it returned before, which stays
    /// put until the next `sample`.
    #[cfg(not(loom))]
    area: Slots,
    /// The server's policy versions, set once when it keeps them: a draw removes the items
    /// that became stale.
    #[cfg(not(loom))]
    pub(crate) versions: std::sync::OnceLock<std::sync::Arc<crate::versions::PolicyVersions>>,
}

impl std::fmt::Debug for Shell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shell").field("closed", &self.is_closed()).finish_non_exhaustive()
    }
}

impl Shell {
    /// A shell with the wait/close protocol alone, for the loom models (which build neither
    /// the batch area nor the limiter).
    #[cfg(loom)]
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        Self {
            insert_ready: Condvar::new(),
            insert_bell: AsyncBell::default(),
            sample_ready: Condvar::new(),
            closed: AtomicBool::new(false),
            consumer_taken: AtomicBool::new(false),
            insert_blocked_outside_ns: Counter::default(),
        }
    }

    /// A shell for a table paced by `limit` whose batches of `batch_size` go into `area`
    /// (two halves of `batch_size` slots).
    #[cfg(not(loom))]
    pub(super) fn new(limit: RateLimit, batch_size: usize, area: Slots) -> Self {
        Self {
            insert_ready: Condvar::new(),
            insert_bell: AsyncBell::default(),
            sample_ready: Condvar::new(),
            closed: AtomicBool::new(false),
            consumer_taken: AtomicBool::new(false),
            insert_blocked_outside_ns: Counter::default(),
            limit,
            batch_size,
            pinned: crate::pinned::Pinning::default(),
            area,
            versions: std::sync::OnceLock::new(),
        }
    }

    /// Claims the one consumer handle: `false` if it was claimed already.
    pub fn claim_consumer(&self) -> bool {
        // ORDERING: Relaxed — the flag only has to be claimed once; it guards no other memory.
        !self.consumer_taken.swap(true, Relaxed)
    }

    /// Marks the table closed and wakes every waiter. `_held` is the table's lock, held, so a
    /// waiter that checked `closed` before is already parked and gets the notification.
    pub fn close<T>(&self, _held: &MutexGuard<'_, T>) {
        // ORDERING: Release pairs with the Acquire in `is_closed` (lock-free readers).
        self.closed.store(true, Release);
        self.wake_writers();
        self.sample_ready.notify_all();
    }

    /// Whether [`Shell::close`] was called.
    pub fn is_closed(&self) -> bool {
        // ORDERING: Acquire pairs with the Release store in `close`.
        self.closed.load(Acquire)
    }

    /// Wakes the writers waiting for the rate limiter or the table's state: threads on
    /// `insert_ready`, tasks on the bell. Call it after changing that state under the lock.
    pub fn wake_writers(&self) {
        self.insert_ready.notify_all();
        self.insert_bell.ring();
    }

    /// Wakes the consumer if it waits for items. Call it after publishing one under the lock
    /// (or right after letting the lock go).
    pub fn notify_sample(&self) {
        self.sample_ready.notify_one();
    }

    /// Rung whenever a waiting insert might now go further (see `Backend::insert_bell`).
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn insert_bell(&self) -> &AsyncBell {
        &self.insert_bell
    }

    /// Waits, the table's lock held by `state` (released while parked), until `ready(state)`
    /// holds. Parked writers are counted in [`Parked::inserts`], and the time waited goes to
    /// [`Side::Insert`].
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the table is closed (checked first, every time),
    /// [`EchoError::TimedOut`] when `deadline` passes first. Under loom the deadline is
    /// ignored.
    pub fn wait_writable<S: WaitState>(
        &self,
        state: &mut MutexGuard<'_, S>,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&S) -> bool,
    ) -> Result<(), EchoError> {
        let mut waited = None;
        let outcome = loop {
            if self.is_closed() {
                break Err(EchoError::Closed);
            }
            if ready(&**state) {
                break Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break Err(EchoError::TimedOut);
            }
            waited.get_or_insert_with(Instant::now);
            state.parked().inserts += 1;
            wait(&self.insert_ready, state, deadline);
            state.parked().inserts -= 1;
        };
        if let Some(started) = waited {
            state.add_blocked_ns(Side::Insert, elapsed_ns(started));
        }
        outcome
    }

    /// Parks the consumer on `sample_ready` once (the lock held by `state` released while
    /// parked), counted in [`Parked::samples`]. The caller checks its condition again after.
    pub fn park_consumer<S: WaitState>(
        &self,
        state: &mut MutexGuard<'_, S>,
        deadline: Option<Instant>,
    ) {
        state.parked().samples += 1;
        wait(&self.sample_ready, state, deadline);
        state.parked().samples -= 1;
    }
}

/// What [`Shell::draw_rounds`] needs of a table's locked state besides its waits.
#[cfg(not(loom))]
pub(super) trait Draws: WaitState {
    /// The table's rate limiter.
    fn limiter(&mut self) -> &mut RateLimiter;
    /// Items (windows) that can be sampled now.
    fn live(&self) -> u64;
    /// Counts `n` items (windows) handed out.
    fn add_sampled(&mut self, n: u64);
}

#[cfg(not(loom))]
impl Shell {
    /// The batch area (see the field's docs for who writes it).
    pub(super) fn area(&self) -> &Slots {
        &self.area
    }

    /// Draws until `drawn` reaches a batch, in rounds of what the rate limiter allows: each
    /// round calls `draw(state, n)` (which returns how many it drew, up to `n`), counts them
    /// and wakes the writers; between rounds the consumer parks. `drawn` is what the batch
    /// being assembled holds already. When the deadline passes first, `holdback` says what
    /// held the call back.
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the table is closed, [`EchoError::TimedOut`] when
    /// `deadline` passes first; what was drawn stays drawn.
    pub(super) fn draw_rounds<S: Draws>(
        &self,
        state: &mut MutexGuard<'_, S>,
        deadline: Option<Instant>,
        mut drawn: usize,
        holdback: &mut Option<SampleHoldback>,
        mut draw: impl FnMut(&mut S, usize) -> usize,
    ) -> Result<(), EchoError> {
        let batch_size = self.batch_size;
        let mut waited = None;
        let outcome = loop {
            if self.is_closed() {
                break Err(EchoError::Closed);
            }
            let missing = batch_size - drawn;
            if missing == 0 {
                break Ok(());
            }
            let live = state.live();
            let allowed = state.limiter().allowed_samples(live);
            if allowed > 0 {
                let n = missing.min(usize::try_from(allowed).unwrap_or(usize::MAX));
                let got = draw(&mut **state, n);
                drawn += got;
                state.limiter().on_sample(got as u64);
                state.add_sampled(got as u64);
                self.wake_writers();
                continue;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let (inserts, samples) = state.limiter().counts();
                *holdback = Some(SampleHoldback {
                    limit: self.limit,
                    inserts,
                    samples,
                    live,
                    drawn,
                    batch_size,
                });
                break Err(EchoError::TimedOut);
            }
            waited.get_or_insert_with(Instant::now);
            self.park_consumer(state, deadline);
        };
        if let Some(started) = waited {
            state.add_blocked_ns(Side::Sample, elapsed_ns(started));
        }
        outcome
    }

    /// The limiter and its counters now, for the message of an insert that timed out; `size`
    /// is the table's size as the limiter sees it.
    pub(super) fn insert_holdback(&self, limiter: &RateLimiter, size: u64) -> InsertHoldback {
        let (inserts, samples) = limiter.counts();
        InsertHoldback { limit: self.limit, inserts, samples, size }
    }

    /// Adds `ns` to the inserts' blocked time: an insert that does not wait was refused and
    /// its caller waited that long outside the table before trying again (see
    /// `Backend::note_insert_blocked`). Never takes the lock.
    pub(super) fn note_insert_blocked(&self, ns: u64) {
        self.insert_blocked_outside_ns.add(ns);
    }

    /// Address of the first byte of `leaf` in batch-area half `half`: `batch_size`
    /// contiguous values.
    pub(super) fn batch_ptr(&self, half: usize, leaf: usize) -> *const u8 {
        self.area.slot_ptr(leaf, half * self.batch_size)
    }

    /// Calls `f` with the bytes of `leaf` of the batch in half `batch.half`: `batch_size`
    /// values back to back.
    ///
    /// # Safety
    /// Nothing writes that half while `f` runs: the caller is the table's one consumer, and
    /// its `sample` (the only writer of the area) cannot run meanwhile.
    ///
    /// # Panics
    /// If `leaf` is out of range.
    pub(super) unsafe fn read_batch<T>(
        &self,
        batch: ReplayBatch,
        leaf: usize,
        f: impl FnOnce(&[u8]) -> T,
    ) -> T {
        let start = batch.half * self.batch_size;
        // SAFETY: the caller's guarantee; `half` is 0 or 1 (`BatchCursor` hands out no
        // other), so the range is inside the area's `2 * batch_size` slots.
        unsafe { self.area.read_slots(leaf, start..start + self.batch_size, f) }
    }

    /// Page-locks the batch area (what a learner copies to the GPU) with `cudaHostRegister`.
    /// Idempotent; unregistered when the table is dropped.
    ///
    /// # Errors
    /// [`EchoError::Io`] saying what is missing or which CUDA call failed.
    ///
    /// # Safety
    /// Every path in `cuda_runtimes` must be a CUDA runtime library (loading runs its code).
    pub(super) unsafe fn pin_host_memory(
        &self,
        cuda_runtimes: &[std::path::PathBuf],
    ) -> Result<(), EchoError> {
        // SAFETY: the ranges are the batch area's own allocations, which live as long as
        // `self`; `self.pinned` is dropped before `self.area` (field order). The caller vouches
        // for the libraries.
        unsafe { self.pinned.pin(cuda_runtimes, || self.area.buffers()) }
    }

    /// Whether the batch area is page-locked.
    pub(super) fn is_pinned(&self) -> bool {
        self.pinned.is_pinned()
    }
}

/// The batch a consumer's `sample` call assembled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayBatch {
    /// Which half of the batch area holds it (see `Table::batch_ptr`).
    pub half: usize,
    /// 0 for the first batch, then 1, 2, ...
    pub sequence: u64,
}

/// Which batch-area half a consumer's next batch goes into, and its number.
#[cfg(not(loom))]
#[derive(Debug, Default)]
pub(super) struct BatchCursor {
    /// The half the next batch goes into: 0 or 1, alternating.
    half: usize,
    /// The next batch's number.
    sequence: u64,
}

#[cfg(not(loom))]
impl BatchCursor {
    /// The half the batch being assembled goes into.
    pub(super) fn half(&self) -> usize {
        self.half
    }

    /// The batch just assembled; the next one goes into the other half.
    pub(super) fn advance(&mut self) -> ReplayBatch {
        let batch = ReplayBatch { half: self.half, sequence: self.sequence };
        self.half ^= 1;
        self.sequence += 1;
        batch
    }
}

/// Checks one priority of a replay or sequence table: finite, `>= 0`, at most
/// [`MAX_PRIORITY`] and storable by `sampler` (`priority^exponent` must stay finite).
#[cfg(not(loom))]
pub(super) fn check_priority(sampler: &dyn ItemSampler, priority: f64) -> Result<(), String> {
    if !(priority.is_finite() && priority >= 0.0) {
        return Err(format!("must be a finite number >= 0, got {priority}"));
    }
    if priority > MAX_PRIORITY {
        return Err(format!("must be at most {MAX_PRIORITY:e}, got {priority:e}"));
    }
    sampler.check_priority(priority)
}

/// Checks the priorities an insert of `src` would give its items: `priority`, and each
/// sample's own.
///
/// # Errors
/// [`EchoError::Priority`] naming the bad one.
#[cfg(not(loom))]
pub(super) fn check_insert_priorities<S: SampleSource + ?Sized>(
    sampler: &dyn ItemSampler,
    src: &S,
    priority: Option<f64>,
) -> Result<(), EchoError> {
    if let Some(priority) = priority {
        check_priority(sampler, priority)
            .map_err(|msg| EchoError::Priority(format!("priority {msg}")))?;
    }
    for sample in 0..src.num_samples() {
        if let Some(own) = src.priority(sample) {
            check_priority(sampler, own)
                .map_err(|msg| EchoError::Priority(format!("sample {sample}'s priority {msg}")))?;
        }
    }
    Ok(())
}

/// Checks an `update_priorities` call before it changes anything: one priority per key,
/// each valid.
///
/// # Errors
/// [`EchoError::Priority`] if the lengths differ or naming the first bad priority's index.
#[cfg(not(loom))]
pub(super) fn check_update(
    sampler: &dyn ItemSampler,
    keys: &[u64],
    priorities: &[f64],
) -> Result<(), EchoError> {
    if keys.len() != priorities.len() {
        return Err(EchoError::Priority(format!(
            "keys and priorities must have the same length, got {} keys and {} priorities",
            keys.len(),
            priorities.len()
        )));
    }
    for (i, &priority) in priorities.iter().enumerate() {
        check_priority(sampler, priority)
            .map_err(|msg| EchoError::Priority(format!("priorities[{i}] {msg}")))?;
    }
    Ok(())
}

/// Locks `state`, waiting at most until `deadline` (`None`: without limit). A caller that
/// must not block (the bindings try once with the GIL held, passing `now`) never waits behind
/// a long `update_priorities`.
///
/// # Errors
/// [`EchoError::TimedOut`] when the deadline passes first.
#[cfg(not(loom))]
pub(super) fn lock_until<S>(
    state: &crate::sync::Mutex<S>,
    deadline: Option<Instant>,
) -> Result<MutexGuard<'_, S>, EchoError> {
    match deadline {
        Some(deadline) => state.try_lock_until(deadline).ok_or(EchoError::TimedOut),
        None => Ok(state.lock()),
    }
}

/// Waits on `cond` until notified or `deadline` (a table's lock held by `state`).
fn wait<T>(cond: &Condvar, state: &mut MutexGuard<'_, T>, deadline: Option<Instant>) {
    match deadline {
        None => cond.wait(state),
        Some(deadline) => {
            let _ = cond.wait_until(state, deadline);
        }
    }
}

/// Nanoseconds since `since`, saturating.
pub(super) fn elapsed_ns(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
