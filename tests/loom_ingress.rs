//! loom models of the ingress sleep/wake protocol: a drainer that finds nothing to do sleeps on
//! its `Doorbell` while pushes, new connections, closing connections and shutdown race to
//! wake it.
//!
//! Run with `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --test
//! loom_ingress --target-dir target/loom`. The `Doorbell` is the real code from
//! `src/doorbell.rs` (the one `src/ingress/` uses), on loom's atomics, mutex and park. Under
//! loom it parks with no timeout, so a lost wake-up leaves every thread blocked and loom
//! reports a deadlock.
//!
//! The ingress itself does not build under loom (crossbeam queues, parking_lot, tokio), so the
//! drainer loop below is a copy of `Drainer::run`'s control flow over stand-ins with the same
//! orderings as `src/ingress/`: `incoming` behind a mutex, `closed` set by a Release swap
//! and read with Acquire, the shutdown flag Release/Acquire. A connection queue is a count of
//! pushed items, written with Release and read with Acquire: weaker than crossbeam's
//! `ArrayQueue` (whose `push`/`is_empty` use SeqCst on the indices), so the doorbell's fences
//! alone must keep a push from being missed.
#![cfg(loom)]

use std::sync::atomic::Ordering::{Acquire, Release};

use loom::sync::atomic::{AtomicBool, AtomicUsize};
use loom::sync::{Arc, Mutex};
use loom::thread;

use echo::doorbell::Doorbell;

/// One connection: its queue (items pushed so far; one producer) and its `closed` flag.
#[derive(Default)]
struct Conn {
    pushed: AtomicUsize,
    closed: AtomicBool,
}

impl Conn {
    /// `Connection::try_push`: queue the item, then ring the drainer if it sleeps.
    fn push(&self, bell: &Doorbell) {
        let n = self.pushed.load(Acquire);
        self.pushed.store(n + 1, Release);
        bell.wake_if_sleeping();
    }

    /// `Connection::close`: publish every earlier push, then wake the drainer.
    fn close(&self, bell: &Doorbell) {
        if !self.closed.swap(true, Release) {
            bell.wake();
        }
    }
}

/// What the drainer shares with connections and the ingress (`DrainerShared` + `Ingress`).
struct Shared {
    bell: Doorbell,
    conns: Vec<Conn>,
    /// Indices of connections registered and not adopted yet.
    incoming: Mutex<Vec<usize>>,
    shutdown: AtomicBool,
}

impl Shared {
    fn new(num_conns: usize) -> Arc<Self> {
        Arc::new(Self {
            bell: Doorbell::new(),
            conns: (0..num_conns).map(|_| Conn::default()).collect(),
            incoming: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
        })
    }

    /// `Ingress::register`: hand the connection to the drainer, then wake it.
    fn register(&self, conn: usize) {
        self.incoming.lock().unwrap().push(conn);
        self.bell.wake();
    }

    /// `Ingress::shutdown` without the join: set the flag, then wake the drainer.
    fn shutdown(&self) {
        self.shutdown.store(true, Release);
        self.bell.wake();
    }
}

/// What the drainer saw: per connection, items popped, whether it was adopted, and the items
/// popped when it was pruned (`None`: never pruned).
#[derive(Debug, Default)]
struct Seen {
    popped: Vec<usize>,
    adopted: Vec<bool>,
    pruned_at: Vec<Option<usize>>,
}

/// Starts the drainer thread, which owns `owned` from the start, and records it as the
/// doorbell's sleeper before returning (as `Ingress::start` does before any waker exists).
/// The drainer follows `Drainer::run` and stops at shutdown or once `done` holds.
fn start_drainer(
    shared: &Arc<Shared>,
    owned: Vec<usize>,
    done: fn(&Seen) -> bool,
) -> thread::JoinHandle<Seen> {
    let shared_ref = Arc::clone(shared);
    let handle = thread::spawn(move || {
        let shared = shared_ref;
        let n = shared.conns.len();
        let mut seen = Seen {
            popped: vec![0; n],
            adopted: (0..n).map(|c| owned.contains(&c)).collect(),
            pruned_at: vec![None; n],
        };
        let mut owned = owned;
        while !shared.shutdown.load(Acquire) {
            // adopt_incoming
            for c in shared.incoming.lock().unwrap().drain(..) {
                seen.adopted[c] = true;
                owned.push(c);
            }
            // pop_round: take everything queued.
            let mut popped_any = false;
            for &c in &owned {
                let pushed = shared.conns[c].pushed.load(Acquire);
                if pushed > seen.popped[c] {
                    seen.popped[c] = pushed;
                    popped_any = true;
                }
            }
            // prune: closed and drained. The Acquire on `closed` makes the emptiness final.
            owned.retain(|&c| {
                let conn = &shared.conns[c];
                let drained =
                    conn.closed.load(Acquire) && conn.pushed.load(Acquire) == seen.popped[c];
                if drained {
                    seen.pruned_at[c] = Some(seen.popped[c]);
                }
                !drained
            });
            if done(&seen) {
                return seen;
            }
            if !popped_any {
                // Drainer::sleep: the same last look for work.
                let (owned, seen_popped) = (&owned, &seen.popped);
                shared.bell.sleep_unless(
                    || {
                        owned.iter().any(|&c| {
                            let conn = &shared.conns[c];
                            conn.pushed.load(Acquire) > seen_popped[c]
                                || (conn.closed.load(Acquire)
                                    && conn.pushed.load(Acquire) == seen_popped[c])
                        }) || !shared.incoming.lock().unwrap().is_empty()
                            || shared.shutdown.load(Acquire)
                    },
                    None,
                );
            }
        }
        seen
    });
    shared.bell.set_sleeper(handle.thread().clone());
    handle
}

fn spawn(shared: &Arc<Shared>, f: impl FnOnce(&Shared) + 'static) -> thread::JoinHandle<()> {
    let shared = Arc::clone(shared);
    thread::spawn(move || f(&shared))
}

/// Two producers on two connections push one item each while the drainer decides to sleep:
/// the drainer must see both items (a missed push parks it forever: a deadlock).
#[test]
fn two_pushes_race_the_drainers_sleep() {
    loom::model(|| {
        let shared = Shared::new(2);
        let drainer = start_drainer(&shared, vec![0, 1], |s| s.popped == [1, 1]);
        let producers = [
            spawn(&shared, |s| s.conns[0].push(&s.bell)),
            spawn(&shared, |s| s.conns[1].push(&s.bell)),
        ];
        for p in producers {
            p.join().unwrap();
        }
        assert_eq!(drainer.join().unwrap().popped, [1, 1]);
    });
}

/// One producer pushes twice: its second push may read the `false` the drainer stored after
/// waking from the first, and must still not be missed.
#[test]
fn back_to_back_pushes_race_the_drainers_sleep() {
    loom::model(|| {
        let shared = Shared::new(1);
        let drainer = start_drainer(&shared, vec![0], |s| s.popped == [2]);
        let producer = spawn(&shared, |s| {
            s.conns[0].push(&s.bell);
            s.conns[0].push(&s.bell);
        });
        producer.join().unwrap();
        assert_eq!(drainer.join().unwrap().popped, [2]);
    });
}

/// A new connection (`register`'s unconditional wake, which clears `sleeping`) races a push on
/// another connection: the push's `wake_if_sleeping` may read the registrar's `false` and skip
/// its unpark, and the drainer must still see both.
#[test]
fn register_races_a_push_and_the_drainers_sleep() {
    loom::model(|| {
        let shared = Shared::new(2);
        let drainer = start_drainer(&shared, vec![0], |s| s.adopted[1] && s.popped[0] == 1);
        let registrar = spawn(&shared, |s| s.register(1));
        let producer = spawn(&shared, |s| s.conns[0].push(&s.bell));
        registrar.join().unwrap();
        producer.join().unwrap();
        let seen = drainer.join().unwrap();
        assert!(seen.adopted[1]);
        assert_eq!(seen.popped[0], 1);
    });
}

/// A producer pushes one item and closes its connection while another connection is
/// registered and closed at once: the drainer must prune both, and the first only after
/// popping its item (acknowledged samples survive the close).
#[test]
fn close_and_register_race_the_drainers_sleep() {
    loom::model(|| {
        let shared = Shared::new(2);
        let drainer = start_drainer(&shared, vec![0], |s| s.pruned_at.iter().all(Option::is_some));
        let producer = spawn(&shared, |s| {
            s.conns[0].push(&s.bell);
            s.conns[0].close(&s.bell);
        });
        let registrar = spawn(&shared, |s| {
            s.register(1);
            s.conns[1].close(&s.bell);
        });
        producer.join().unwrap();
        registrar.join().unwrap();
        let seen = drainer.join().unwrap();
        assert_eq!(seen.pruned_at, [Some(1), Some(0)], "pruned before its queue was drained");
    });
}

/// Shutdown races the drainer's sleep while a push is in flight: the drainer must return (a
/// lost shutdown wake-up hangs the join, as it would hang `Ingress::shutdown`).
#[test]
fn shutdown_races_a_push_and_the_drainers_sleep() {
    loom::model(|| {
        let shared = Shared::new(1);
        let drainer = start_drainer(&shared, vec![0], |_| false);
        let producer = spawn(&shared, |s| s.conns[0].push(&s.bell));
        shared.shutdown();
        drainer.join().unwrap();
        producer.join().unwrap();
    });
}
