//! The one place the crate takes its synchronisation primitives from.
//!
//! Normal builds use `std` atomics and `parking_lot`'s mutex/condvar. Builds with
//! `RUSTFLAGS="--cfg loom"` swap every primitive for its [`loom`] twin, so the loom models
//! in `tests/loom_store.rs` explore every interleaving of the real store code, not a copy.
//!
//! Wrappers hide the differences between the two worlds:
//! - [`Signal`]: a mutex + condvar pair for "wait until a predicate holds". Under loom a wait
//!   has no timeout, so a lost wake-up shows up as a deadlock that loom reports.
//! - [`park`]: `std::thread::park`/`park_timeout`, or loom's `park` with no timeout, for the
//!   same reason; [`Thread`] is the matching handle whose `unpark` ends it.
//! - [`Mutex`]: `parking_lot`'s mutex, or a loom mutex with the same infallible `lock`.
//! - [`SlotTracker`]: a zero-sized marker in normal builds, a `loom::cell::UnsafeCell<()>` under
//!   loom, touched around every slot read and write so loom detects two threads accessing the
//!   same ring slot without a happens-before edge between them.

use std::time::{Duration, Instant};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
#[cfg(loom)]
pub(crate) use loom::thread::Thread;
#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
#[cfg(not(loom))]
pub(crate) use std::thread::Thread;
// `Arc` stays `std`'s in loom builds too: its refcount is not part of any protocol we model,
// and `self: &Arc<Self>` receivers need the real type.
pub(crate) use std::sync::Arc;

/// A condition that waiters block on and notifiers announce.
///
/// The protocol that makes it lose no wake-up: a notifier first makes the predicate true
/// (an atomic store or RMW), then calls [`Signal::notify_one`]/[`Signal::notify_all`], which take
/// the internal lock. A waiter evaluates the predicate while holding that lock, so either it
/// sees the new state or it is already parked when the notifier takes the lock.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    #[cfg(not(loom))]
    lock: parking_lot::Mutex<()>,
    #[cfg(not(loom))]
    cond: parking_lot::Condvar,
    #[cfg(loom)]
    lock: loom::sync::Mutex<()>,
    #[cfg(loom)]
    cond: loom::sync::Condvar,
}

impl Signal {
    /// Blocks until `ready()` returns true or `deadline` passes; returns the last `ready()`.
    ///
    /// `deadline: None` waits without limit. Under loom the deadline is ignored.
    #[cfg(not(loom))]
    pub(crate) fn wait_until(
        &self,
        mut ready: impl FnMut() -> bool,
        deadline: Option<Instant>,
    ) -> bool {
        if ready() {
            return true;
        }
        let mut guard = self.lock.lock();
        loop {
            if ready() {
                return true;
            }
            match deadline {
                None => self.cond.wait(&mut guard),
                Some(deadline) => {
                    if self.cond.wait_until(&mut guard, deadline).timed_out() {
                        return ready();
                    }
                }
            }
        }
    }

    #[cfg(loom)]
    pub(crate) fn wait_until(
        &self,
        mut ready: impl FnMut() -> bool,
        _deadline: Option<Instant>,
    ) -> bool {
        if ready() {
            return true;
        }
        let mut guard = self.lock.lock().unwrap();
        loop {
            if ready() {
                return true;
            }
            guard = self.cond.wait(guard).unwrap();
        }
    }

    /// Wakes one waiter. Call it after making the predicate true.
    pub(crate) fn notify_one(&self) {
        let _guard = self.lock();
        self.cond.notify_one();
    }

    /// Wakes every waiter. Call it after making the predicate true.
    pub(crate) fn notify_all(&self) {
        let _guard = self.lock();
        self.cond.notify_all();
    }

    #[cfg(not(loom))]
    fn lock(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.lock.lock()
    }

    #[cfg(loom)]
    fn lock(&self) -> loom::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap()
    }
}

/// Lets loom see accesses to raw ring memory (see the module docs). Free in normal builds.
#[derive(Debug, Default)]
pub(crate) struct SlotTracker {
    #[cfg(loom)]
    cell: loom::cell::UnsafeCell<()>,
}

impl SlotTracker {
    /// Marks a write to the tracked slot for the duration of `f`.
    #[inline]
    pub(crate) fn writing<R>(&self, f: impl FnOnce() -> R) -> R {
        #[cfg(loom)]
        {
            self.cell.with_mut(|_| f())
        }
        #[cfg(not(loom))]
        {
            f()
        }
    }

    /// Marks a read of the tracked slot for the duration of `f`.
    #[inline]
    pub(crate) fn reading<R>(&self, f: impl FnOnce() -> R) -> R {
        #[cfg(loom)]
        {
            self.cell.with(|_| f())
        }
        #[cfg(not(loom))]
        {
            f()
        }
    }
}

/// Blocks the current thread until its [`Thread::unpark`] token is available or `timeout`
/// passes (`None`: no limit). Like `std::thread::park`, it may also return spuriously, so
/// callers re-check their condition. Under loom the timeout is ignored: a wake-up that never
/// comes is a deadlock that loom reports, not a delay.
#[cfg(not(loom))]
#[inline]
pub(crate) fn park(timeout: Option<Duration>) {
    match timeout {
        Some(timeout) => std::thread::park_timeout(timeout),
        None => std::thread::park(),
    }
}

#[cfg(loom)]
pub(crate) fn park(_timeout: Option<Duration>) {
    loom::thread::park();
}

/// Lets other threads run: `std::thread::yield_now`, or loom's, which tells loom that this
/// thread waits for another (a spin loop without it is an infinite model).
#[inline]
pub(crate) fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

/// A loom mutex with `parking_lot`'s infallible `lock` (a panic while holding it aborts the
/// model anyway, so poisoning carries no information).
#[cfg(loom)]
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0.lock().unwrap()
    }
}
