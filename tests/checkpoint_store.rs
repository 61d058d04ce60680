//! Checkpoints of the FIFO ring (`Store::checkpoint`): what a snapshot holds, how its pin
//! holds writers back (and only them), one checkpoint at a time, restores that go first, and a
//! stress test of the pin against real contention.
//!
//! `ECHO_STRESS_COUNT` overrides the samples per writer of the stress test.

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{
    batch_leaves, decode, spawn_writers, stress_count, tagged_payload, tagged_spec, TAGGED_PAYLOAD,
};
use echo::{EchoError, Payloads, Store};

fn put(
    store: &Store,
    producer: u32,
    seqs: std::ops::Range<u64>,
    deadline: Option<Instant>,
) -> Result<(), EchoError> {
    let payloads: Vec<[u8; TAGGED_PAYLOAD]> = seqs.map(|s| tagged_payload(producer, s)).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
    store.insert(&Payloads::new(store.spec(), &refs).unwrap(), deadline).map_err(|e| e.error)
}

/// Every row of a checkpoint, copied `max_bytes` at a time, decoded (and checked whole).
fn rows(checkpoint: &mut echo::store::RingCheckpoint, max_bytes: usize) -> Vec<(u32, u64)> {
    let mut out = Vec::new();
    let mut chunk: Vec<Vec<u8>> = vec![Vec::new(); 3];
    loop {
        let n = checkpoint.next_chunk(max_bytes, &mut chunk);
        if n == 0 {
            return out;
        }
        let leaves: [Vec<u8>; 3] = std::array::from_fn(|l| chunk[l].clone());
        out.extend((0..n).map(|i| decode(&leaves, i)));
    }
}

fn seqs(rows: &[(u32, u64)]) -> Vec<u64> {
    rows.iter().map(|&(_, s)| s).collect()
}

#[test]
fn a_checkpoint_holds_the_samples_not_handed_out_in_order_partial_batch_included() {
    let store = Store::new(tagged_spec(), 4, 3).unwrap();
    let mut consumer = store.consumer().unwrap();
    put(&store, 0, 0..10, None).unwrap();
    assert_eq!(consumer.sample(None).unwrap(), 0);
    let mut checkpoint = store.checkpoint().unwrap();
    assert_eq!((checkpoint.handed_out(), checkpoint.len()), (4, 6));
    // One sample per chunk, so the pin moves after every row.
    assert_eq!(seqs(&rows(&mut checkpoint, 1)), (4..10).collect::<Vec<_>>());
    drop(checkpoint);
    // The store goes on: the consumer gets the same samples, writers fill on.
    put(&store, 0, 10..12, None).unwrap();
    assert_eq!(consumer.sample(None).unwrap(), 1);
    assert_eq!(consumer.sample(None).unwrap(), 2);
}

#[test]
fn the_pin_holds_writers_back_from_uncopied_slots_only() {
    // Batches of 2, a ring of 2 batches: slots 0..4.
    let store = Store::new(tagged_spec(), 2, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    put(&store, 0, 0..4, None).unwrap();
    assert_eq!(consumer.sample(None).unwrap(), 0); // holds samples 0, 1
    let mut checkpoint = store.checkpoint().unwrap();
    assert_eq!((checkpoint.handed_out(), checkpoint.len()), (2, 2)); // samples 2, 3
                                                                     // The consumer is not held back: it gives batch 0 back and takes batch 1 (in the snapshot).
    assert_eq!(consumer.sample(None).unwrap(), 1);
    // Batch 0's slots were free to reuse: a writer fills them.
    put(&store, 0, 4..6, Some(Instant::now())).unwrap();
    // Giving batch 1 back does not free its slots while the checkpoint still has to copy them.
    assert_eq!(consumer.sample(None).unwrap(), 2);
    let blocked = put(&store, 0, 6..7, Some(Instant::now() + Duration::from_millis(20)));
    assert!(matches!(blocked, Err(EchoError::TimedOut)), "{blocked:?}");
    // Slots come back a batch at a time: after the first row of the batch is copied a
    // two-sample insert (which would reserve the whole batch, the uncopied slot too) still
    // waits; after the second it goes in.
    let mut chunk: Vec<Vec<u8>> = vec![Vec::new(); 3];
    assert_eq!(checkpoint.next_chunk(1, &mut chunk), 1);
    assert!(matches!(put(&store, 0, 6..8, Some(Instant::now())), Err(EchoError::TimedOut)));
    assert_eq!(checkpoint.next_chunk(1, &mut chunk), 1);
    // The copied row is the snapshot's, though the consumer and writers moved on.
    let leaves: [Vec<u8>; 3] = std::array::from_fn(|l| chunk[l].clone());
    assert_eq!(decode(&leaves, 0), (0, 3));
    put(&store, 0, 6..8, Some(Instant::now())).unwrap();
    assert_eq!(checkpoint.next_chunk(1, &mut chunk), 0);
}

#[test]
fn dropping_a_checkpoint_unpins_what_it_did_not_copy() {
    let store = Store::new(tagged_spec(), 1, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    put(&store, 0, 0..2, None).unwrap();
    let checkpoint = store.checkpoint().unwrap();
    assert_eq!(checkpoint.len(), 2);
    consumer.sample(None).unwrap();
    consumer.sample(None).unwrap(); // gives slot 0 back: pinned
    assert!(matches!(put(&store, 0, 2..3, Some(Instant::now())), Err(EchoError::TimedOut)));
    drop(checkpoint);
    put(&store, 0, 2..3, Some(Instant::now())).unwrap();
}

#[test]
fn one_checkpoint_at_a_time() {
    let store = Store::new(tagged_spec(), 2, 2).unwrap();
    let first = store.checkpoint().unwrap();
    assert!(matches!(store.checkpoint(), Err(EchoError::Busy(_))));
    drop(first);
    assert!(store.checkpoint().unwrap().is_empty());
}

#[test]
fn a_restore_goes_in_first_and_what_does_not_fit_follows_before_anything_new() {
    let spec = tagged_spec();
    let payloads: Vec<[u8; TAGGED_PAYLOAD]> = (0..6).map(|s| tagged_payload(7, s)).collect();
    // Leaf-major rows, as a checkpoint's files hold them.
    let mut leaves: Vec<Vec<u8>> = vec![Vec::new(); 3];
    for p in &payloads {
        for (leaf, buf) in leaves.iter_mut().enumerate() {
            buf.extend_from_slice(&p[spec.leaf_range(leaf)]);
        }
    }
    let store = Store::new(spec, 2, 2).unwrap();
    let mut consumer = store.consumer().unwrap();
    let slices: Vec<&[u8]> = leaves.iter().map(Vec::as_slice).collect();
    assert_eq!(store.restore(&slices, 6).unwrap(), 4, "a ring of 4");
    assert!(store.is_restoring());
    assert!(matches!(store.restore(&slices, 6), Err(EchoError::Config(_))), "only a new ring");
    // A new sample waits for the restored ones, even with room.
    let writer = {
        let store = store.clone();
        thread::spawn(move || put(&store, 1, 0..2, Some(Instant::now() + common::PATIENCE)))
    };
    let mut got = Vec::new();
    for _ in 0..4 {
        consumer.sample(None).unwrap();
        let leaves = batch_leaves(&consumer);
        got.extend((0..2).map(|i| decode(&leaves, i)));
    }
    writer.join().unwrap().unwrap();
    assert!(!store.is_restoring());
    let expected: Vec<(u32, u64)> = (0..6).map(|s| (7, s)).chain([(1, 0), (1, 1)]).collect();
    assert_eq!(got, expected);
}

/// Writers, a consumer and a checkpointer that copies one sample per chunk (so the pin moves
/// as often as it can) race; every checkpoint must be exactly the samples the consumer gets
/// next, from its `handed_out()` on, each whole.
#[test]
fn checkpoints_under_contention_are_the_samples_the_consumer_gets_next() {
    const WRITERS: u32 = 3;
    const CHECKPOINTS: usize = 200;
    let per_writer = stress_count(30_000, 200_000);
    let (batch_size, num_batches) = (8, 3);
    let total = per_writer * u64::from(WRITERS);
    assert_eq!(total % batch_size as u64, 0);
    let store = Store::new(tagged_spec(), batch_size, num_batches).unwrap();
    let mut consumer = store.consumer().unwrap();
    let writers = spawn_writers(&store, WRITERS, move |store, producer| {
        let mut seq = 0;
        while seq < per_writer {
            let n = ((seq % 5) + 1).min(per_writer - seq);
            put(&store, producer, seq..seq + n, None).unwrap();
            seq += n;
        }
    });
    let (done_tx, done_rx) = mpsc::channel();
    let reader = thread::spawn(move || {
        let mut stream = Vec::with_capacity(total as usize);
        for _ in 0..total / batch_size as u64 {
            consumer.sample(None).unwrap();
            let leaves = batch_leaves(&consumer);
            stream.extend((0..batch_size).map(|i| decode(&leaves, i)));
        }
        done_tx.send(()).unwrap();
        stream
    });
    let checkpointer = {
        let store = store.clone();
        thread::spawn(move || {
            // Until CHECKPOINTS of them caught samples (checkpoints of an empty ring, before
            // the writers get going, do not count), or the consumer has had everything.
            let mut taken = Vec::new();
            let mut caught = 0;
            while caught < CHECKPOINTS && !store.is_closed() {
                let mut checkpoint = store.checkpoint().unwrap();
                let at = checkpoint.handed_out();
                let got = rows(&mut checkpoint, 1);
                if at >= total {
                    break;
                }
                caught += usize::from(!got.is_empty());
                taken.push((at, got));
            }
            taken
        })
    };
    done_rx.recv_timeout(Duration::from_secs(240)).expect("checkpoint stress test deadlocked");
    let stream = reader.join().unwrap();
    for w in writers {
        w.join().unwrap();
    }
    let taken = checkpointer.join().unwrap();
    assert!(!taken.is_empty());
    let mut non_empty = 0;
    for (at, got) in &taken {
        let at = *at as usize;
        assert_eq!(&stream[at..at + got.len()], &got[..], "checkpoint at {at}");
        non_empty += usize::from(!got.is_empty());
    }
    assert!(non_empty > 0, "no checkpoint caught a sample");
    // Per-writer order and exactly-once in the consumer's stream, for good measure.
    let mut next = [0u64; WRITERS as usize];
    for &(p, s) in &stream {
        assert_eq!(s, next[p as usize]);
        next[p as usize] += 1;
    }
}
