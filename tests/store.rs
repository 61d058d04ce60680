//! Behaviour of the store through its public API, single- and multi-threaded.

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{decode, tagged_payload, tagged_spec, wait_until};
use echo::{ArraySpec, DataSpec, EchoError, InsertError, Leaves, Payloads, Store};

fn read_batch(consumer: &echo::Consumer) -> [Vec<u8>; 3] {
    std::array::from_fn(|leaf| consumer.read_leaf(leaf, <[u8]>::to_vec))
}

fn soon() -> Option<Instant> {
    Some(Instant::now() + Duration::from_millis(20))
}

#[test]
fn batches_come_out_in_fifo_order_with_every_byte_intact() {
    let store = Store::new(tagged_spec(), 4, 3).unwrap();
    let mut consumer = store.consumer().unwrap();
    for round in 0..5u64 {
        let payloads: Vec<_> = (0..4).map(|i| tagged_payload(7, round * 4 + i)).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
        store.insert(&Payloads::new(store.spec(), &refs).unwrap(), None).unwrap();
        assert_eq!(consumer.sample(None).unwrap(), round);
        let leaves = read_batch(&consumer);
        for i in 0..4 {
            assert_eq!(decode(&leaves, i), (7, round * 4 + i as u64));
        }
    }
}

#[test]
fn a_partial_batch_is_not_handed_out() {
    let store = Store::new(tagged_spec(), 4, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    for seq in 0..3 {
        let p = tagged_payload(0, seq);
        store.insert(&Payloads::new(store.spec(), &[&p[..]]).unwrap(), None).unwrap();
    }
    assert!(matches!(consumer.sample(soon()), Err(EchoError::TimedOut)));
    assert_eq!(consumer.stats().store_size, 3);
    let p = tagged_payload(0, 3);
    store.insert(&Payloads::new(store.spec(), &[&p[..]]).unwrap(), None).unwrap();
    assert_eq!(consumer.sample(soon()).unwrap(), 0);
    assert_eq!(consumer.stats().notify_count, 1);
    assert_eq!(consumer.stats().store_size, 0);
}

#[test]
fn invalid_samples_write_nothing() {
    let store = Store::new(tagged_spec(), 2, 2).unwrap();
    let good = tagged_payload(1, 1);
    let err = Payloads::new(store.spec(), &[&good[..], &good[..3]]).unwrap_err();
    assert!(matches!(err, EchoError::PayloadSize { expected: 25, got: 3 }), "{err}");

    let wrong_leaf: [&[u8]; 3] = [&[0; 4], &[0; 7], &[0; 13]];
    let err = store.insert(&Leaves(&wrong_leaf), None).unwrap_err();
    assert!(
        matches!(
            err,
            InsertError {
                inserted: 0,
                error: EchoError::SizeMismatch { leaf: 1, expected: 8, got: 7 }
            }
        ),
        "{err}"
    );
    let too_few: [&[u8]; 2] = [&[0; 4], &[0; 8]];
    let err = store.insert(&Leaves(&too_few), None).unwrap_err();
    assert!(matches!(
        err,
        InsertError { inserted: 0, error: EchoError::LeafCount { expected: 3, got: 2 } }
    ));
    assert_eq!(store.stats().write_cursor, 0, "a rejected insert must not reserve slots");
}

#[test]
fn bad_configuration_is_an_error_not_a_panic() {
    assert!(
        matches!(Store::new(tagged_spec(), 0, 3), Err(EchoError::Config(m)) if m.contains("batch_size"))
    );
    assert!(
        matches!(Store::new(tagged_spec(), 4, 1), Err(EchoError::Config(m)) if m.contains("at least 2 batches"))
    );
    assert!(matches!(Store::new(tagged_spec(), usize::MAX, 2), Err(EchoError::Config(_))));
}

#[test]
fn only_one_consumer_exists() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let first = store.consumer();
    assert!(first.is_some());
    assert!(store.consumer().is_none());
}

#[test]
fn a_full_ring_blocks_writers_until_the_consumer_moves_on() {
    let store = Store::new(tagged_spec(), 2, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    let insert = |seq: u64, deadline| {
        let p = tagged_payload(3, seq);
        store.insert(&Payloads::new(store.spec(), &[&p[..]]).unwrap(), deadline)
    };
    for seq in 0..4 {
        insert(seq, None).unwrap();
    }
    assert!(matches!(
        insert(4, soon()),
        Err(InsertError { inserted: 0, error: EchoError::TimedOut })
    ));
    assert_eq!(consumer.sample(None).unwrap(), 0);
    // The consumer still holds batch 0: the ring is still full.
    assert!(matches!(
        insert(4, soon()),
        Err(InsertError { inserted: 0, error: EchoError::TimedOut })
    ));
    assert_eq!(consumer.sample(None).unwrap(), 1); // releases batch 0
    insert(4, soon()).unwrap();
    insert(5, soon()).unwrap();
    assert_eq!(consumer.sample(None).unwrap(), 2);
    let leaves = read_batch(&consumer);
    assert_eq!((decode(&leaves, 0), decode(&leaves, 1)), ((3, 4), (3, 5)));
}

#[test]
fn a_blocked_writer_is_woken_by_release() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    let payloads: Vec<_> = (0..6).map(|i| tagged_payload(9, i)).collect();
    let writer = {
        let store = store.clone();
        thread::spawn(move || {
            let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
            store.insert(&Payloads::new(store.spec(), &refs).unwrap(), None)
        })
    };
    for expected in 0..6u64 {
        assert_eq!(consumer.sample(None).unwrap(), expected);
        assert_eq!(decode(&read_batch(&consumer), 0), (9, expected));
    }
    writer.join().unwrap().unwrap();
}

/// Runs `f` on a thread and fails the test if it does not finish within 10 s (a lost wake-up).
fn with_watchdog<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> (mpsc::Receiver<T>, thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || tx.send(f()).unwrap());
    (rx, handle)
}

#[test]
fn close_wakes_a_blocked_consumer() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    let (rx, handle) = with_watchdog(move || consumer.sample(None));
    wait_until("the consumer parks", || store.waiting_samples() == 1);
    assert!(rx.try_recv().is_err(), "nothing was committed: the consumer must still wait");
    store.close();
    let result = rx.recv_timeout(Duration::from_secs(10)).expect("consumer was not woken by close");
    assert!(matches!(result, Err(EchoError::Closed)));
    handle.join().unwrap();
}

#[test]
fn close_wakes_a_blocked_writer() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let p = tagged_payload(0, 0);
    store.insert(&Payloads::new(store.spec(), &[&p[..], &p[..]]).unwrap(), None).unwrap();
    let writer_store = store.clone();
    let (rx, handle) = with_watchdog(move || {
        let p = tagged_payload(0, 1);
        writer_store.insert(&Payloads::new(writer_store.spec(), &[&p[..]]).unwrap(), None)
    });
    wait_until("the writer parks", || store.waiting_inserts() == 1);
    assert!(rx.try_recv().is_err(), "the ring is full: the writer must still wait");
    store.close();
    let result = rx.recv_timeout(Duration::from_secs(10)).expect("writer was not woken by close");
    assert!(
        matches!(result, Err(InsertError { inserted: 0, error: EchoError::Closed })),
        "{result:?}"
    );
    handle.join().unwrap();
}

#[test]
fn sample_after_close_returns_closed() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    let p = tagged_payload(0, 0);
    store.insert(&Payloads::new(store.spec(), &[&p[..]]).unwrap(), None).unwrap();
    store.close();
    assert!(matches!(consumer.sample(None), Err(EchoError::Closed)));
    store.close(); // idempotent
}

#[test]
fn reservations_stop_at_batch_boundaries() {
    // 10 samples in one call into batches of 4: batches 0 and 1 complete, 2 samples remain.
    let store = Store::new(tagged_spec(), 4, 4).unwrap();
    let mut consumer = store.consumer().unwrap();
    let payloads: Vec<_> = (0..10).map(|i| tagged_payload(1, i)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    store.insert(&Payloads::new(store.spec(), &refs).unwrap(), None).unwrap();
    assert_eq!(store.stats().notify_count, 2);
    assert_eq!(consumer.sample(soon()).unwrap(), 0);
    assert_eq!(consumer.sample(soon()).unwrap(), 1);
    assert_eq!(decode(&read_batch(&consumer), 3), (1, 7));
    assert!(matches!(consumer.sample(soon()), Err(EchoError::TimedOut)));
    assert_eq!(consumer.stats().store_size, 2);
}

#[test]
fn zero_byte_leaves_and_scalars_round_trip() {
    let spec = DataSpec::new(vec![
        ArraySpec::new(vec![0], 4).unwrap(),
        ArraySpec::new(vec![], 2).unwrap(),
    ])
    .unwrap();
    let store = Store::new(spec, 3, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    for i in 0..3u16 {
        store.insert(&Leaves(&[&[], &i.to_le_bytes()]), None).unwrap();
    }
    consumer.sample(None).unwrap();
    assert_eq!(consumer.read_leaf(0, <[u8]>::len), 0);
    assert_eq!(consumer.read_leaf(1, <[u8]>::to_vec), vec![0, 0, 1, 0, 2, 0]);
}
