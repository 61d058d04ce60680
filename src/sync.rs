//! The one place the crate takes its synchronisation primitives from.
//!
//! Public but hidden from the docs only so that the loom models (integration tests) can lock
//! the [`Mutex`] a table shell waits under; everything else here is crate-private.
//!
//! Normal builds use `std` atomics and `parking_lot`'s mutex/condvar. Builds with
//! `RUSTFLAGS="--cfg loom"` swap every primitive for its `loom` twin, so the loom models
//! in `tests/loom_store.rs` explore every interleaving of the real store code, not a copy.
//!
//! Wrappers hide the differences between the two worlds:
//! - [`Signal`]: a mutex + condvar pair for "wait until a predicate holds". Under loom a wait
//!   has no timeout, so a lost wake-up shows up as a deadlock that loom reports.
//! - [`park`]: `std::thread::park`/`park_timeout`, or loom's `park` with no timeout, for the
//!   same reason; [`Thread`] is the matching handle whose `unpark` ends it.
//! - [`Mutex`]: `parking_lot`'s mutex, or a loom mutex with the same infallible `lock`,
//!   `try_lock_until` and [`MutexGuard::unlocked`].
//! - [`Condvar`]: `parking_lot`'s condvar, waiting on a [`MutexGuard`] of a data lock (a
//!   table's state), or loom's behind the same `wait(&mut guard)` face. Under loom a wait has
//!   no timeout, so a lost wake-up is a deadlock that loom reports.
//! - [`AsyncBell`]: the async side of a condition: tasks await "rung since I last looked"
//!   instead of blocking a thread. Normal types in both worlds: no loom model waits on it.
//! - [`SlotTracker`]: a zero-sized marker in normal builds, a `loom::cell::UnsafeCell<()>` under
//!   loom, touched around every slot read and write so loom detects two threads accessing the
//!   same ring slot without a happens-before edge between them.

// The module is public only for the loom models; its docs speak of crate-private items.
#![allow(rustdoc::private_intra_doc_links)]

use std::time::{Duration, Instant};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize,
};
#[cfg(loom)]
pub(crate) use loom::thread::Thread;
#[cfg(not(loom))]
pub use parking_lot::{Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize,
};
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
    /// Rung by every notification, for async waiters ([`Signal::bell`]).
    bell: AsyncBell,
}

impl Signal {
    /// The bell that every [`Signal::notify_one`]/[`Signal::notify_all`] rings: an async task
    /// that found the predicate false reads [`AsyncBell::rung`] *before* evaluating it, and then
    /// awaits [`AsyncBell::rung_since`] instead of blocking in [`Signal::wait_until`].
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn bell(&self) -> &AsyncBell {
        &self.bell
    }

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
        {
            let _guard = self.lock();
            self.cond.notify_one();
        }
        self.bell.ring();
    }

    /// Wakes every waiter. Call it after making the predicate true.
    pub(crate) fn notify_all(&self) {
        {
            let _guard = self.lock();
            self.cond.notify_all();
        }
        self.bell.ring();
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

/// A counter of notifications with the tasks waiting for the next one: how an async task
/// waits for a condition that threads wait for on a condvar, without a thread of its own.
///
/// The protocol that loses no wake-up: the task reads [`AsyncBell::rung`], then evaluates its
/// condition; if it is false, it awaits [`AsyncBell::rung_since`] with the count it read. A
/// notifier makes the condition true first and then rings. Either the ring comes after the
/// task registered (the count compared under the lock is the old one, and the ring, taking
/// the same lock afterwards, wakes it), or before the task's check under the lock, which
/// then sees the new count and returns at once. A wake-up may be spurious (rung for another
/// reason): the task evaluates its condition again.
#[derive(Debug, Default)]
pub(crate) struct AsyncBell {
    state: parking_lot::Mutex<AsyncBellState>,
}

#[derive(Debug, Default)]
struct AsyncBellState {
    rung: u64,
    wakers: Vec<std::task::Waker>,
}

impl AsyncBell {
    /// How many times the bell has rung.
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn rung(&self) -> u64 {
        self.state.lock().rung
    }

    /// Rings: wakes every task waiting in [`AsyncBell::rung_since`].
    pub(crate) fn ring(&self) {
        let wakers = {
            let mut state = self.state.lock();
            state.rung = state.rung.wrapping_add(1);
            if state.wakers.is_empty() {
                return;
            }
            std::mem::take(&mut state.wakers)
        };
        for waker in wakers {
            waker.wake();
        }
    }

    /// Completes once the bell has rung since it had rung `seen` times.
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn rung_since(&self, seen: u64) -> RungSince<'_> {
        RungSince { bell: self, seen }
    }
}

/// The future of [`AsyncBell::rung_since`].
#[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
#[derive(Debug)]
pub(crate) struct RungSince<'a> {
    bell: &'a AsyncBell,
    seen: u64,
}

impl std::future::Future for RungSince<'_> {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let mut state = self.bell.state.lock();
        if state.rung != self.seen {
            return std::task::Poll::Ready(());
        }
        // Polled again without a ring (a timeout around it, say): registered already.
        if !state.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            state.wakers.push(cx.waker().clone());
        }
        std::task::Poll::Pending
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
pub struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    /// A mutex holding `value`.
    pub fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }

    /// Waits for the lock and takes it.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard { mutex: &self.0, guard: Some(self.0.lock().unwrap()) }
    }

    /// `parking_lot`'s `try_lock_until`; under loom the deadline is ignored (the lock is
    /// waited for), as every loom wait ignores its deadline.
    #[allow(dead_code)] // the replay tables' deadline-bounded insert; not in every loom model
    pub fn try_lock_until(&self, _deadline: Instant) -> Option<MutexGuard<'_, T>> {
        Some(self.lock())
    }
}

/// The guard of a loom [`Mutex`], with `parking_lot`'s face: a [`Condvar`] waits on it by
/// `&mut`, and [`MutexGuard::unlocked`] lets the lock go for a while.
#[cfg(loom)]
#[derive(Debug)]
pub struct MutexGuard<'a, T> {
    mutex: &'a loom::sync::Mutex<T>,
    /// `Some` except inside a condvar wait or `unlocked`, which put it back before returning.
    guard: Option<loom::sync::MutexGuard<'a, T>>,
}

#[cfg(loom)]
impl<T> MutexGuard<'_, T> {
    /// Runs `f` with the lock let go, and takes it again (`parking_lot`'s `unlocked`).
    #[allow(dead_code)] // the replay tables' copies outside the lock; not in every loom model
    pub fn unlocked<R>(this: &mut Self, f: impl FnOnce() -> R) -> R {
        drop(this.guard.take());
        let out = f();
        this.guard = Some(this.mutex.lock().unwrap());
        out
    }
}

#[cfg(loom)]
impl<T> std::ops::Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_ref().expect("held outside a wait")
    }
}

#[cfg(loom)]
impl<T> std::ops::DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("held outside a wait")
    }
}

/// A loom condvar with `parking_lot`'s face: it waits on a guard by `&mut`. `wait_until`
/// ignores its deadline (a wake-up that never comes is a deadlock loom reports).
#[cfg(loom)]
#[derive(Debug, Default)]
pub struct Condvar(loom::sync::Condvar);

#[cfg(loom)]
impl Condvar {
    /// A condvar nobody waits on.
    pub fn new() -> Self {
        Self(loom::sync::Condvar::new())
    }

    /// Releases the guard's lock, parks until notified, and takes the lock again.
    pub fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
        let held = guard.guard.take().expect("held outside a wait");
        guard.guard = Some(self.0.wait(held).unwrap());
    }

    /// [`Condvar::wait`]: under loom the deadline is ignored.
    pub fn wait_until<T>(&self, guard: &mut MutexGuard<'_, T>, _deadline: Instant) {
        self.wait(guard);
    }

    /// Wakes one waiter.
    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Duration;

    use super::{AsyncBell, AtomicU64, AtomicUsize};

    /// A waker that counts its wake-ups.
    struct Counted(AtomicUsize);

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            // ORDERING: SeqCst — test bookkeeping; the bell's lock is what is under test.
            self.0.fetch_add(1, SeqCst);
        }
    }

    fn counted() -> (Arc<Counted>, Waker) {
        let count = Arc::new(Counted(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        (count, waker)
    }

    #[test]
    fn a_ring_between_reading_the_count_and_waiting_is_not_lost() {
        let bell = AsyncBell::default();
        let seen = bell.rung();
        bell.ring();
        let (count, waker) = counted();
        let mut wait = pin!(bell.rung_since(seen));
        assert_eq!(wait.as_mut().poll(&mut Context::from_waker(&waker)), Poll::Ready(()));
        // ORDERING: SeqCst — test bookkeeping; the bell's lock is what is under test.
        assert_eq!(count.0.load(SeqCst), 0);
    }

    #[test]
    fn a_ring_wakes_a_waiting_task_once_however_often_it_was_polled() {
        let bell = AsyncBell::default();
        let (count, waker) = counted();
        let mut cx = Context::from_waker(&waker);
        let mut wait = pin!(bell.rung_since(bell.rung()));
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        // ORDERING: SeqCst — test bookkeeping; the bell's lock is what is under test.
        assert_eq!(count.0.load(SeqCst), 0);
        bell.ring();
        assert_eq!(count.0.load(SeqCst), 1);
        assert_eq!(wait.as_mut().poll(&mut cx), Poll::Ready(()));
        bell.ring();
        // ORDERING: SeqCst — test bookkeeping; the bell's lock is what is under test.
        assert_eq!(count.0.load(SeqCst), 1, "woken tasks are forgotten");
    }

    /// Ping-pong: each thread makes one unit of room for its task, rings, and waits until
    /// the task took it before making the next; each task takes its room and otherwise
    /// waits on the bell. Every ring is the only wake-up its unit gets, so a lost one leaves
    /// a task asleep with room left and its thread waiting: the run times out.
    #[test]
    fn tasks_waiting_on_rings_from_threads_take_every_unit_of_room() {
        const PAIRS: usize = 2;
        const UNITS: u64 = 20_000;
        let bell = Arc::new(AsyncBell::default());
        let rooms: Arc<Vec<AtomicU64>> = Arc::new((0..PAIRS).map(|_| AtomicU64::new(0)).collect());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .expect("a runtime");
        let tasks: Vec<_> = (0..PAIRS)
            .map(|i| {
                let (bell, rooms) = (Arc::clone(&bell), Arc::clone(&rooms));
                runtime.spawn(async move {
                    let mut taken = 0;
                    while taken < UNITS {
                        let seen = bell.rung();
                        // ORDERING: SeqCst — test bookkeeping; the bell's lock is what is under test.
                        if rooms[i].swap(0, SeqCst) == 1 {
                            taken += 1;
                        } else {
                            bell.rung_since(seen).await;
                        }
                    }
                })
            })
            .collect();
        let makers: Vec<_> = (0..PAIRS)
            .map(|i| {
                let (bell, rooms) = (Arc::clone(&bell), Arc::clone(&rooms));
                std::thread::spawn(move || {
                    for unit in 0..UNITS {
                        // ORDERING: SeqCst — test bookkeeping; the bell's lock is what is under test.
                        rooms[i].store(1, SeqCst);
                        bell.ring();
                        let deadline = std::time::Instant::now() + Duration::from_secs(10);
                        // ORDERING: SeqCst — test bookkeeping; the bell's lock is what is under test.
                        while rooms[i].load(SeqCst) == 1 {
                            assert!(
                                std::time::Instant::now() < deadline,
                                "unit {unit} of pair {i} never taken: a lost wake-up"
                            );
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        for maker in makers {
            maker.join().expect("every unit taken");
        }
        for task in tasks {
            runtime.block_on(async {
                tokio::time::timeout(Duration::from_secs(10), task)
                    .await
                    .expect("the task ends")
                    .expect("the task does not panic");
            });
        }
    }
}
