//! Many writers, one consumer, real contention: every sample arrives exactly once, unbroken,
//! and in per-writer order. Writers mix single inserts and multi-sample inserts so
//! reservations are split at batch boundaries and race each other for the same batch.
//!
//! `ECHO_STRESS_COUNT` overrides the samples per writer (valgrind runs use a small count).

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::{
    batch_leaves, decode, spawn_writers, stress_count, tagged_payload, tagged_spec, TAGGED_PAYLOAD,
};
use echo::{Payloads, Store};

const WRITERS: u32 = 4;

fn per_writer() -> u64 {
    stress_count(250_000, 1_000_000)
}

fn run(batch_size: usize, num_batches: usize) {
    let count = per_writer();
    let total = count * u64::from(WRITERS);
    assert_eq!(total % batch_size as u64, 0, "pick counts that fill whole batches");
    let store = Store::new(tagged_spec(), batch_size, num_batches).unwrap();
    let mut consumer = store.consumer().unwrap();
    let writers = spawn_writers(&store, WRITERS, move |store, producer| {
        let mut seq = 0u64;
        let mut chunk = Vec::with_capacity(64);
        while seq < count {
            // Chunk sizes cycle 1, 2, ..., 37 so inserts straddle batch boundaries.
            let n = ((seq % 37) + 1).min(count - seq);
            chunk.clear();
            chunk.extend((seq..seq + n).map(|s| tagged_payload(producer, s)));
            let refs: Vec<&[u8]> = chunk.iter().map(|p: &[u8; TAGGED_PAYLOAD]| &p[..]).collect();
            store.insert(&Payloads::new(store.spec(), &refs).unwrap(), None).unwrap();
            seq += n;
        }
    });

    let (done_tx, done_rx) = mpsc::channel();
    let checker = thread::spawn(move || {
        let mut next = vec![0u64; WRITERS as usize];
        let batches = total / batch_size as u64;
        for expected_batch in 0..batches {
            assert_eq!(consumer.sample(None).unwrap(), expected_batch);
            let leaves = batch_leaves(&consumer);
            for i in 0..batch_size {
                let (producer, seq) = decode(&leaves, i);
                assert_eq!(
                    seq, next[producer as usize],
                    "writer {producer}: out of order or duplicated"
                );
                next[producer as usize] += 1;
            }
        }
        assert!(next.iter().all(|&n| n == count), "missing samples: {next:?}");
        done_tx.send(()).unwrap();
        consumer
    });
    // Watchdog: a deadlock fails the test instead of hanging CI.
    done_rx.recv_timeout(Duration::from_secs(300)).expect("stress test deadlocked");
    let consumer = checker.join().unwrap();
    for w in writers {
        w.join().unwrap();
    }
    // After the joins, the Relaxed statistics counters are exact.
    let stats = consumer.stats();
    assert_eq!(stats.notify_count, total / batch_size as u64, "exactly one wake-up per batch");
    assert_eq!(stats.store_size, 0);
    assert_eq!(stats.write_cursor, total);
}

#[test]
fn four_writers_small_batches_tight_ring() {
    run(4, 2);
}

#[test]
fn four_writers_large_batches() {
    run(200, 3);
}
