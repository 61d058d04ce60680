//! Page faults off the inserting thread: a large slot buffer is mapped lazily (its pages take
//! memory only once written), so the first pass of inserts into a new table used to take every
//! page fault itself, zeroing each page on the way: 3-10x slower than inserts into a full table.
//! A [`Prefault`] thread keeps the pages a window ahead of the highest slot written populated
//! (`MADV_POPULATE_WRITE`: the kernel faults them in writable without touching their bytes, so
//! it may run while writers fill the slots before them), so the writers find them present.
//! Memory still grows with the fill, at most a window ahead of it, and construction stays
//! cheap. The thread ends once the whole buffer is populated, or with its [`Slots`].
//!
//! Writers pay one relaxed load and a compare per slot they write ([`Prefault::note`]); they
//! wake the thread (a mutex and a condition variable) only when they come within half a window
//! of what it populated, about once per half window.
//!
//! [`Slots`]: crate::slots::Slots

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Buffers that together map at least this many bytes get a prefault thread.
pub(crate) const PREFAULT_MIN_BYTES: usize = 64 << 20;

/// Bytes (over every leaf) the thread keeps populated ahead of the highest slot written.
const WINDOW_BYTES: usize = 64 << 20;

/// Bytes populated per call: a stop request waits at most for one.
const STEP_BYTES: usize = 8 << 20;

/// One leaf's mapping, as the thread sees it: its address and its slots' size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    /// Start of the mapping (an address: the thread only passes it to `madvise`).
    pub(crate) base: usize,
    /// Bytes per slot.
    pub(crate) slot_bytes: usize,
}

#[derive(Debug)]
struct Shared {
    /// Slots the writers want present: the highest written plus a window (only grows).
    wanted: AtomicUsize,
    /// Slots populated so far, in every leaf (only grows; written by the thread).
    done: AtomicUsize,
    /// Set once: the buffers are going away.
    stop: AtomicBool,
    /// Whether a wake-up is pending (so writers ring at most once per round).
    rung: Mutex<bool>,
    ring: Condvar,
}

/// The prefault thread of one set of slot buffers.
#[derive(Debug)]
pub(crate) struct Prefault {
    shared: Arc<Shared>,
    /// Slots per window: what `note` adds to the slot written.
    window: usize,
    thread: Option<JoinHandle<()>>,
}

impl Prefault {
    /// Starts the thread over `regions` (each `capacity` slots), populating the first window
    /// at once. `None` if the thread cannot be started (inserts then fault as before).
    ///
    /// # Safety
    /// Each region's `base .. base + capacity * slot_bytes` is a mapping the caller owns, and
    /// stays mapped until this `Prefault` is dropped (which joins the thread).
    pub(crate) unsafe fn start(regions: Vec<Region>, capacity: usize) -> Option<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::start_with(regions, capacity, WINDOW_BYTES, true) }
    }

    /// [`Prefault::start`] with a window of `window_bytes`, populated at once if `eager`
    /// (otherwise from the first [`Prefault::note`]: a table that is made and never written
    /// takes no memory).
    ///
    /// # Safety
    /// As [`Prefault::start`].
    pub(crate) unsafe fn start_with(
        regions: Vec<Region>,
        capacity: usize,
        window_bytes: usize,
        eager: bool,
    ) -> Option<Self> {
        let row_bytes: usize = regions.iter().map(|r| r.slot_bytes).sum();
        let window = (window_bytes / row_bytes.max(1)).clamp(1, capacity);
        let shared = Arc::new(Shared {
            wanted: AtomicUsize::new(if eager { window } else { 0 }),
            done: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            rung: Mutex::new(true),
            ring: Condvar::new(),
        });
        let step = (STEP_BYTES / row_bytes.max(1)).clamp(1, capacity);
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("echo-prefault".into())
            .spawn(move || run(&theirs, &regions, capacity, step))
            .ok()?;
        Some(Self { shared, window, thread: Some(thread) })
    }

    /// A writer is about to write `slot`: wakes the thread if it is within half a window of
    /// what is populated.
    #[inline]
    pub(crate) fn note(&self, slot: usize) {
        // ORDERING: Relaxed — a hint: a stale value only wakes the thread late (the writer
        // then takes a page fault itself) or needlessly (it finds nothing to do).
        if slot + self.window / 2 < self.shared.done.load(Relaxed) {
            return;
        }
        // ORDERING: Relaxed — a hint, read by the thread after the mutex below orders it.
        self.shared.wanted.fetch_max(slot + self.window, Relaxed);
        let mut rung = self.shared.rung.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !*rung {
            *rung = true;
            self.shared.ring.notify_one();
        }
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        // ORDERING: Relaxed — the thread reads it under the mutex taken below, or between
        // steps (at most one step late); the join orders the rest.
        self.shared.stop.store(true, Relaxed);
        {
            let mut rung =
                self.shared.rung.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *rung = true;
            self.shared.ring.notify_one();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread: populate up to what is wanted, a step at a time, then wait to be rung.
fn run(shared: &Shared, regions: &[Region], capacity: usize, step: usize) {
    let mut done = 0;
    loop {
        {
            let mut rung = shared.rung.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // ORDERING: Relaxed (both) — read under the mutex the writers ring through.
            while !*rung && !shared.stop.load(Relaxed) {
                rung = shared
                    .ring
                    .wait_timeout(rung, Duration::from_secs(1))
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
            *rung = false;
        }
        // ORDERING: Relaxed — see `note`.
        let wanted = shared.wanted.load(Relaxed).min(capacity);
        while done < wanted {
            // ORDERING: Relaxed — see `Drop`.
            if shared.stop.load(Relaxed) {
                return;
            }
            let end = (done + step).min(wanted);
            for region in regions {
                let from = region.base + done * region.slot_bytes;
                let len = (end - done) * region.slot_bytes;
                if !populate(from, len) {
                    // Not supported here: writers fault as before, and stop ringing.
                    // ORDERING: Relaxed — a hint for `note` (see there).
                    shared.done.store(usize::MAX, Relaxed);
                    return;
                }
            }
            done = end;
            // ORDERING: Relaxed — a hint for `note` (see there).
            shared.done.store(done, Relaxed);
        }
        // ORDERING: Relaxed — see `Drop`.
        if done >= capacity || shared.stop.load(Relaxed) {
            return;
        }
    }
}

/// Faults `len` bytes from `from` in writable, without touching them; false if the kernel
/// cannot (before Linux 5.14).
fn populate(from: usize, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    // `madvise` needs a page-aligned start: round down (the page before belongs to the same
    // mapping, or is the mapping's first, which is aligned).
    // SAFETY: sysconf reads a constant of the system.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let start = from & !(page - 1);
    let len = len + (from - start);
    // SAFETY: advice on a range of a mapping the owner keeps mapped while the thread runs
    // (`Prefault::start`'s contract); MADV_POPULATE_WRITE reads or writes no byte of it.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
    // EINVAL: not supported; other errors (ENOMEM) end prefaulting too: the writers fault.
    rc == 0
}
