//! The real `Ingress` under many producers sending bursts with idle gaps between them, with
//! the drainers' idle park timeout **off** (`idle_park: None`): a drainer that misses a
//! wake-up (a push, a new or closing connection, shutdown) sleeps for good, and the watchdog
//! fails the test instead of the 100 ms safety net hiding it.
//!
//! Every round, each producer pushes a burst of 0 to `MAX_BURST` tagged samples on its
//! connection, then all producers and the checker meet at a barrier once the checker has
//! taken every sample of the round out of the store. Between rounds every queue is empty, so
//! the drainers run out of work and go to sleep, and the next round's first pushes race their
//! decision to sleep. Producers also close their connection and register a new one every few
//! rounds (at a barrier, so per-producer order stays checkable across connections), which
//! races `register`'s and `close`'s wake-ups against the drainers' sleep too. Small queues, a
//! small ring and batches of one add backpressure on both sides.
//!
//! The checker asserts that every sample arrives exactly once, uncorrupted, and in
//! per-producer order. `ECHO_STRESS_ROUNDS` overrides the number of rounds (default 1,000 in
//! debug builds, a couple of seconds; 5,000 in release).
//!
//! Checked to catch what it is for: with `Connection::try_push`'s wake removed, or with
//! `Doorbell::wake` unparking before it clears `sleeping`, both tests hit the watchdog (with
//! the 100 ms `idle_park` the first of those passes, just slowly).

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::thread::{self, Thread};
use std::time::Duration;

use common::{batch_leaves, decode, tagged_payload, tagged_spec};
use echo::backend::Backend;
use echo::ingress::{Connection, Ingress, IngressConfig, SpaceWaker};
use echo::Store;

/// A lost wake-up must fail the test well before CI's own timeout.
const WATCHDOG: Duration = Duration::from_secs(60);
const MAX_BURST: u64 = 12;
/// Each producer replaces its connection every this many rounds (offset by its id).
const RECONNECT_EVERY: u64 = 5;

fn rounds() -> u64 {
    std::env::var("ECHO_STRESS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) { 1_000 } else { 5_000 })
}

/// Samples producer `p` sends in `round`: 0 to `MAX_BURST`, scrambled so bursts differ between
/// producers and rounds (and some producers sit a round out), but known to the checker.
fn burst(p: u32, round: u64) -> u64 {
    let mut x = (u64::from(p) << 32 | round).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x % (MAX_BURST + 1)
}

/// Unparks the producer thread when its connection has a free buffer or queue slot.
struct Unpark(Thread);

impl SpaceWaker for Unpark {
    fn wake(&self) {
        self.0.unpark();
    }
}

/// Pushes one payload, parking (without timeout: the watchdog covers it) while the connection
/// has no free buffer or queue slot.
fn push(conn: &Arc<Connection>, payload: &[u8]) {
    loop {
        if let Some(mut buf) = conn.take_buffer() {
            buf.copy_from_slice(payload);
            match conn.try_push(buf) {
                Ok(()) => return,
                Err(buf) => conn.return_buffer(buf),
            }
        }
        conn.note_blocked();
        // The drainer's `SpaceWaker::wake` after a failed attempt leaves a token, so this
        // returns at once; otherwise it ends at the next recycle. Spurious returns just retry.
        thread::park();
    }
}

fn run(producers: u32, num_drainers: usize, queue_size: usize, ring_batches: usize) {
    let rounds = rounds();
    let total: u64 = (0..producers).map(|p| (0..rounds).map(|r| burst(p, r)).sum::<u64>()).sum();
    let store = Store::new(tagged_spec(), 1, ring_batches).unwrap();
    let mut consumer = store.consumer().unwrap();
    let config = IngressConfig { idle_park: None, ..IngressConfig::new(num_drainers, queue_size) };
    let ingress = Ingress::start(Backend::Fifo(Arc::clone(&store)), config).unwrap();

    let (done_tx, done_rx) = mpsc::channel();
    let scenario = {
        let ingress = Arc::clone(&ingress);
        thread::spawn(move || {
            let barrier = Arc::new(Barrier::new(producers as usize + 1));
            let handles: Vec<_> = (0..producers)
                .map(|p| {
                    let (ingress, barrier) = (Arc::clone(&ingress), Arc::clone(&barrier));
                    thread::spawn(move || {
                        let waker = || Box::new(Unpark(thread::current()));
                        let mut conn = ingress.register(waker());
                        let mut seq = 0u64;
                        for round in 0..rounds {
                            for _ in 0..burst(p, round) {
                                push(&conn, &tagged_payload(p, seq));
                                seq += 1;
                            }
                            // The checker has every sample of this round once we pass.
                            barrier.wait();
                            if (round + u64::from(p)) % RECONNECT_EVERY == 0 {
                                conn.close();
                                conn = ingress.register(waker());
                            }
                        }
                        conn.close();
                        seq
                    })
                })
                .collect();

            let mut next = vec![0u64; producers as usize];
            for round in 0..rounds {
                for _ in 0..(0..producers).map(|p| burst(p, round)).sum::<u64>() {
                    consumer.sample(None).expect("the store is open until the end");
                    let leaves = batch_leaves(&consumer);
                    let (p, seq) = decode(&leaves, 0);
                    assert!(p < producers, "unknown producer {p}");
                    assert_eq!(
                        seq, next[p as usize],
                        "producer {p}: lost, duplicated or reordered"
                    );
                    next[p as usize] += 1;
                }
                barrier.wait();
            }
            for (p, h) in handles.into_iter().enumerate() {
                assert_eq!(h.join().unwrap(), next[p], "producer {p}: samples missing");
            }
            // Shutdown wakes every drainer, which by now sleeps with nothing to do: a lost
            // wake-up here hangs the join inside `shutdown`.
            store.close();
            ingress.shutdown();
            done_tx.send(()).unwrap();
        })
    };
    if let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(WATCHDOG) {
        panic!(
            "ingress stress test stuck for {WATCHDOG:?} (a lost wake-up?); counters: {:?}",
            ingress.snapshot()
        );
    }
    // Re-raises the scenario's own assertion failure, if that is why it stopped.
    scenario.join().unwrap();
    let snap = ingress.snapshot();
    assert_eq!(snap.samples_inserted_total, total);
    assert_eq!(snap.active_connections, 0);
}

/// Eight producers on two drainers (fewer if the machine has one CPU), queues of two and a
/// ring of four: frequent backpressure and frequent sleeps.
#[test]
fn bursts_with_idle_gaps_never_lose_a_wake_up() {
    run(8, 2, 2, 4);
}

/// One drainer owns every connection, so every wake source races the same sleeper.
#[test]
fn one_drainer_many_producers_never_loses_a_wake_up() {
    run(6, 1, 4, 8);
}
