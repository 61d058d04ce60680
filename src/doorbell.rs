//! The sleep/wake protocol between one sleeping thread and any number of wakers.
//!
//! An ingress drainer that finds nothing to pop sleeps on its [`Doorbell`]. Its wakers come in
//! two kinds:
//! - a transport task that just pushed into a lock-free queue calls
//!   [`Doorbell::wake_if_sleeping`]: a fence and a load, and an `unpark` only when the
//!   drainer sleeps or is about to. This is the hot path, once per sample.
//! - rare events (a new connection, a closing one, shutdown) call [`Doorbell::wake`], which
//!   always unparks.
//!
//! ```text
//!  sleeper: sleep_unless(has_work)            waker: publish, then wake_if_sleeping()
//!  ───────────────────────────────            ───────────────────────────────────────
//!  sleeping.store(true)          (SeqCst)     publish the work (queue push, ...)
//!  fence                         (SeqCst)     fence                          (SeqCst)
//!  has_work()?  no -> park                    sleeping.load()                (Relaxed)
//!  sleeping.store(false)         (Relaxed)      true -> wake(): sleeping = false, unpark
//! ```
//!
//! The two fences form a Dekker pair: whichever comes first in the single total order of
//! `SeqCst` operations, either `has_work` sees the published work, or the waker sees
//! `sleeping == true` and unparks (an unpark that arrives before `park` leaves a token, so the
//! park returns at once).
//!
//! The type is compiled in loom builds too, on the `src/sync.rs` facade, so
//! `tests/loom_ingress.rs` model-checks this very code. Under loom, [`Doorbell::sleep_unless`]
//! parks without a timeout, so a lost wake-up is a deadlock loom reports. Normal builds keep
//! an optional timeout (`IngressConfig::idle_park`) as a safety net that only bounds the cost
//! of a bug.
//!
//! Public but hidden from the docs only so the loom models (integration tests) can reach it.

use std::time::Duration;

use crate::sync::{fence, park, AtomicBool, Mutex, Thread};

use std::sync::atomic::Ordering::{Relaxed, SeqCst};

/// Where one thread sleeps until another has work for it. See the module docs.
#[derive(Debug, Default)]
pub struct Doorbell {
    /// Set by the sleeper just before its last look for work and cleared once it is awake
    /// again; also cleared by [`Doorbell::wake`], which **always unparks right after**. So a
    /// waker that reads `false` after its fence either raced a sleeper that will still see its
    /// work, or one that an unpark is already on its way to.
    sleeping: AtomicBool,
    /// The sleeper, set once by [`Doorbell::set_sleeper`] before any waker runs.
    sleeper: Mutex<Option<Thread>>,
}

impl Doorbell {
    /// A doorbell with no sleeper yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the thread that sleeps on this doorbell. Call it before any waker can ring
    /// (the ingress does so right after spawning the drainer, before `Ingress::start`
    /// returns); a wake with no sleeper recorded unparks nobody.
    pub fn set_sleeper(&self, thread: Thread) {
        *self.sleeper.lock() = Some(thread);
    }

    /// Called by the sleeper only: announces it is going to sleep, takes one last look with
    /// `has_work`, and parks (at most `timeout`, ignored under loom) if there is none.
    /// Returns whether it parked.
    ///
    /// `has_work` must read everything whose publisher wakes this doorbell. It may return
    /// early, and the caller must look for work again after this returns: a park also ends on
    /// timeout, spuriously, or on a token left by a wake that the caller has already served.
    pub fn sleep_unless(&self, has_work: impl FnOnce() -> bool, timeout: Option<Duration>) -> bool {
        // ORDERING: SeqCst store + SeqCst fence, the sleeper's half of the Dekker pair with the
        // fence in `wake_if_sleeping`: if that fence comes later in the SeqCst order, the
        // waker's load sees this `true` (or a later `false` from a waker that unparks); if it
        // comes earlier, `has_work` below sees what the waker published. The fence carries the
        // argument: loom treats the SeqCst store as Release only, and the models still pass.
        self.sleeping.store(true, SeqCst);
        fence(SeqCst);
        let park_now = !has_work();
        if park_now {
            park(timeout);
        }
        // ORDERING: Relaxed — the flag guards no data and only saves unparks while we are
        // awake. A waker that reads this `false` instead of our next `true` fences before our
        // next `has_work`, which then sees its work (see `wake_if_sleeping`).
        self.sleeping.store(false, Relaxed);
        park_now
    }

    /// Called by a waker after it published work that `has_work` reads (a queue push):
    /// unparks the sleeper if it sleeps or is about to. No lock and no unpark while the sleeper
    /// is busy.
    #[inline]
    pub fn wake_if_sleeping(&self) {
        // ORDERING: SeqCst fence, the waker's half of the Dekker pair with the store + fence in
        // `sleep_unless`: it orders the publication before it against the load below, so either
        // the sleeper's `has_work` sees the work, or this load sees `sleeping == true`.
        fence(SeqCst);
        // ORDERING: Relaxed — ordered after the publication by the fence above; what it reads
        // is argued there.
        if self.sleeping.load(Relaxed) {
            self.wake();
        }
    }

    /// Unparks the sleeper unconditionally. For rare events, after making them visible to
    /// `has_work` (under a lock, or through an atomic the sleeper reads): if `has_work`
    /// missed the event, this unpark ends the park, and `unpark` synchronises with the
    /// `park` it ends, so the sleeper's next look sees the event.
    pub fn wake(&self) {
        // ORDERING: Relaxed — the flag guards no data; clearing it only saves later wakers an
        // unpark. It stays safe because the unpark below always follows (see the field docs).
        self.sleeping.store(false, Relaxed);
        if let Some(thread) = self.sleeper.lock().as_ref() {
            thread.unpark();
        }
    }
}
