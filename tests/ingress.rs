//! The ingress's promises about memory: what it holds is bounded, and everything it holds is
//! freed once it shuts down, whatever state the drainers were in.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{tagged_payload, tagged_spec, TAGGED_PAYLOAD};
use echo::backend::Backend;
use echo::ingress::{Connection, Ingress, IngressConfig, SpaceWaker};
use echo::Store;

struct NoWake;

impl SpaceWaker for NoWake {
    fn wake(&self) {}
}

/// Polls `done` until it holds; fails the test after 10 s (a hang).
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn push(conn: &Arc<Connection>, producer: u32, seq: u64) {
    let mut buf = conn.take_buffer().expect("a free buffer");
    buf.copy_from_slice(&tagged_payload(producer, seq));
    assert!(conn.try_push(buf).is_ok(), "room in the queue");
}

#[test]
fn a_connection_registered_while_its_drainer_is_blocked_is_freed_at_shutdown() {
    // A ring of 2 slots that nobody samples: the drainer inserts two samples, then blocks on
    // the third. A connection registered now is never adopted by that drainer.
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let ingress =
        Ingress::start(Backend::Fifo(Arc::clone(&store)), IngressConfig::new(1, 4)).unwrap();
    let first = ingress.register(Box::new(NoWake));
    for seq in 0..3 {
        push(&first, 0, seq);
    }
    eventually("the drainer takes all three", || first.queue_len() == 0);
    eventually("the ring fills", || store.stats().write_cursor == 2);
    let late = ingress.register(Box::new(NoWake));
    push(&late, 1, 0);
    first.close();
    late.close();
    store.close();
    ingress.shutdown();
    drop(ingress);
    // Connection -> its drainer's shared state -> incoming list -> Connection was a cycle
    // that kept the connection and its buffers alive after shutdown.
    assert_eq!(Arc::strong_count(&late), 1, "the ingress still holds the late connection");
    assert_eq!(Arc::strong_count(&first), 1, "the ingress still holds the first connection");
}

/// Counts its wake-ups.
struct CountWakes(Arc<AtomicUsize>);

impl SpaceWaker for CountWakes {
    fn wake(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn the_ingress_holds_at_most_max_buffered_bytes_and_waiters_are_woken_when_it_frees() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let config =
        IngressConfig { max_buffered_bytes: 3 * TAGGED_PAYLOAD, ..IngressConfig::new(1, 8) };
    let ingress = Ingress::start(Backend::Fifo(Arc::clone(&store)), config).unwrap();
    let first = ingress.register(Box::new(NoWake));
    // Nobody samples: two samples fill the ring, then the bound stops this connection. Its
    // queue (8) and pool (17) would take many more without it.
    let mut pushed = 0;
    eventually("the bound is reached with the ring full", || {
        while let Some(mut buf) = first.take_buffer() {
            buf.copy_from_slice(&tagged_payload(0, pushed));
            first.try_push(buf).expect("room in the queue");
            pushed += 1;
            assert!(pushed <= 2 + 3, "more samples taken in than the ring and the bound allow");
        }
        let full = ingress.snapshot().buffered_bytes == 3 * TAGGED_PAYLOAD as u64;
        full && store.stats().write_cursor == 2
    });
    let snap = ingress.snapshot();
    assert!(snap.buffered_bytes <= 3 * TAGGED_PAYLOAD as u64, "{snap:?}");
    // A second connection waits for bytes: no buffer now, and a wake-up once some are freed.
    let wakes = Arc::new(AtomicUsize::new(0));
    let second = ingress.register(Box::new(CountWakes(Arc::clone(&wakes))));
    assert!(second.take_buffer().is_none(), "the bound is spent");
    let mut consumer = store.consumer().unwrap();
    let mut sampled = 0;
    eventually("the learner frees room and the waiter is woken", || {
        if consumer.sample(Some(Instant::now())).is_ok() {
            sampled += 1;
        }
        wakes.load(Ordering::SeqCst) > 0
    });
    eventually("the waiter gets a buffer", || {
        let _ = consumer.sample(Some(Instant::now()));
        second.take_buffer().is_some()
    });
    assert!(sampled >= 1);
    first.close();
    second.close();
    store.close();
    ingress.shutdown();
}

#[test]
fn shared_memory_segments_take_at_most_half_the_byte_budget_and_wake_waiters_when_freed() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let config =
        IngressConfig { max_buffered_bytes: 8 * TAGGED_PAYLOAD, ..IngressConfig::new(1, 8) };
    let ingress = Ingress::start(Backend::Fifo(Arc::clone(&store)), config).unwrap();
    let segment =
        ingress.reserve_segment(3 * TAGGED_PAYLOAD).expect("3 of the 4 segments may have");
    let refused = ingress.reserve_segment(2 * TAGGED_PAYLOAD).unwrap_err();
    assert!(refused.contains("half of max_buffered_bytes"), "{refused}");
    assert_eq!(ingress.snapshot().buffered_bytes, 3 * TAGGED_PAYLOAD as u64);
    // TCP buffers get the rest of the budget, the segment's half included.
    let wakes = Arc::new(AtomicUsize::new(0));
    let conn = ingress.register(Box::new(CountWakes(Arc::clone(&wakes))));
    let mut held = Vec::new();
    while let Some(buf) = conn.take_buffer() {
        held.push(buf);
    }
    assert_eq!(held.len(), 5, "the budget less the segment");
    let refused = ingress.reserve_segment(TAGGED_PAYLOAD).unwrap_err();
    assert!(refused.contains("ingress buffers hold"), "{refused}");
    // The segment goes with its worker: its bytes come back and the waiting connection is
    // woken to take them.
    drop(segment);
    assert!(wakes.load(Ordering::SeqCst) > 0, "the waiting connection was not woken");
    assert!(conn.take_buffer().is_some());
    assert!(
        ingress.segment_shortfall(3 * TAGGED_PAYLOAD).is_some(),
        "TCP buffers hold 6 of the 8 payloads now"
    );
    conn.close();
    store.close();
    ingress.shutdown();
}

/// Payloads that record, each time the backend reports samples in (right before its commit),
/// what the ingress and the store said at that moment.
struct Watched<'a> {
    payloads: echo::Payloads<'a, [u8; TAGGED_PAYLOAD]>,
    ingress: &'a Ingress,
    store: &'a Store,
    seen: &'a std::sync::Mutex<Vec<(u64, u64)>>,
}

impl echo::SampleSource for Watched<'_> {
    fn num_samples(&self) -> usize {
        self.payloads.num_samples()
    }
    fn num_leaves(&self, sample: usize) -> usize {
        self.payloads.num_leaves(sample)
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        self.payloads.leaf(sample, leaf)
    }
    fn inserted(&self, _count: usize) {
        let inserted = self.ingress.snapshot().samples_inserted_total;
        self.seen.lock().unwrap().push((inserted, self.store.stats().store_size));
    }
}

#[test]
fn a_connection_inserting_itself_counts_before_the_commit_and_its_segment_as_queued() {
    // Batches of 2 in a ring of 4: what a shared-memory connection's task does, by hand.
    let store = Store::new(tagged_spec(), 2, 2).unwrap();
    let ingress =
        Ingress::start(Backend::Fifo(Arc::clone(&store)), IngressConfig::new(1, 4)).unwrap();
    let conn = ingress.register(Box::new(NoWake));
    // The task looked: 3 samples committed to its segment. Queued and pending, like samples
    // in a TCP connection's queue.
    conn.note_segment_depth(3);
    let snap = ingress.snapshot();
    assert_eq!((snap.samples_pending, snap.queue_depth_sum, snap.queue_depth_max), (3, 3, 3));
    let spec = tagged_spec();
    let payloads = [tagged_payload(0, 0), tagged_payload(0, 1)];
    let seen = std::sync::Mutex::new(Vec::new());
    let watched = Watched {
        payloads: echo::Payloads::new(&spec, &payloads).unwrap(),
        ingress: &ingress,
        store: &store,
        seen: &seen,
    };
    ingress.backend().insert(&conn.direct(watched), None, None).unwrap();
    // Counted before the store's commit (nothing committed yet when the count was there).
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, vec![(2, 0)], "(inserted, store_size) as the backend reported them in");
    assert_eq!(store.stats().store_size, 2);
    let snap = ingress.snapshot();
    assert_eq!(snap.samples_inserted_total, 2);
    assert_eq!((snap.samples_pending, snap.queue_depth_sum, snap.queue_depth_max), (1, 1, 1));
    // The channel ended with one sample left in the segment: it never goes in.
    conn.note_segment_depth(0);
    let snap = ingress.snapshot();
    assert_eq!(
        (snap.samples_pending, snap.queue_depth_sum, snap.samples_inserted_total),
        (0, 0, 2)
    );
    conn.close();
    store.close();
    ingress.shutdown();
}
