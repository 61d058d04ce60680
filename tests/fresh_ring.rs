//! The FIFO ring's consumer under a staleness bound ([`echo::fresh_ring::FreshRing`]):
//!
//! - a property test drives random inserts (with random versions), publishes, samples (some
//!   timing out part-way through a gathered batch) and checkpoints, and checks at every
//!   checkpoint that each sample is in exactly one place: handed out, skipped as stale
//!   (counted), or in the checkpoint, in order;
//! - a stress test runs writers against the consumer while versions move, and checks that
//!   every handed-out sample is fresh when handed, each writer's samples arrive in order, and
//!   handed plus skipped plus left in the ring is everything written.

#![cfg(not(loom))]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use echo::error::EchoError;
use echo::fresh_ring::{FreshBatch, FreshRing};
use echo::source::Leaves;
use echo::spec::{ArraySpec, DataSpec};
use echo::store::Store;
use echo::versions::{version_leaf, Admission, PolicyVersions};
use proptest::prelude::*;

const BATCH: usize = 4;

fn ring(batches: usize, k: u64) -> (Arc<Store>, FreshRing, Arc<PolicyVersions>) {
    let spec = DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap(), version_leaf()]).unwrap();
    let store = Store::new(spec, BATCH, batches).unwrap();
    let versions = Arc::new(PolicyVersions::new(1, Some(k), Admission::Drop));
    let fresh = FreshRing::new(store.consumer().unwrap(), Arc::clone(&versions)).unwrap();
    (store, fresh, versions)
}

fn put(store: &Store, id: u64, version: u64, deadline: Option<Instant>) -> bool {
    let (id, version) = (id.to_le_bytes(), version.to_le_bytes());
    store.insert(&Leaves(&[&id, &version]), deadline).is_ok()
}

fn u64s(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect()
}

/// The ids and versions of what `fresh` just handed out.
fn handed(fresh: &FreshRing, batch: FreshBatch) -> (Vec<u64>, Vec<u64>) {
    match batch {
        FreshBatch::Ring(_) => {
            (fresh.consumer().read_leaf(0, u64s), fresh.consumer().read_leaf(1, u64s))
        }
        FreshBatch::Spill(half) => {
            (fresh.read_spill(half, 0, u64s), fresh.read_spill(half, 1, u64s))
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    Insert(u64),
    Publish,
    Sample,
    Checkpoint,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u64..4).prop_map(Step::Insert),
        1 => Just(Step::Publish),
        3 => Just(Step::Sample),
        1 => Just(Step::Checkpoint),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_sample_is_handed_skipped_or_checkpointed_exactly_once(
        steps in proptest::collection::vec(step(), 1..120),
        k in 0u64..3,
    ) {
        let (store, mut fresh, versions) = ring(3, k);
        versions.set_latest(4);
        let mut inserted: Vec<(u64, u64)> = Vec::new();
        let mut out: Vec<u64> = Vec::new();
        for step in steps {
            match step {
                Step::Insert(lag) => {
                    let id = inserted.len() as u64;
                    let version = versions.latest().saturating_sub(lag);
                    // A full ring refuses (the consumer is this thread): skip it.
                    if put(&store, id, version, Some(Instant::now())) {
                        inserted.push((id, version));
                    }
                }
                Step::Publish => versions.set_latest(versions.latest() + 1),
                Step::Sample => {
                    let floor = versions.floor();
                    match fresh.sample(Some(Instant::now())) {
                        Ok(batch) => {
                            let (ids, vs) = handed(&fresh, batch);
                            prop_assert!(vs.iter().all(|&v| v >= floor), "{vs:?} < {floor}");
                            out.extend(ids);
                        }
                        Err(EchoError::TimedOut) => {}
                        Err(other) => prop_assert!(false, "{other}"),
                    }
                }
                Step::Checkpoint => {
                    let mut ckpt = store.checkpoint().unwrap();
                    let mut chunk = vec![Vec::new(), Vec::new()];
                    let mut kept = Vec::new();
                    while ckpt.next_chunk(64, &mut chunk) > 0 {
                        kept.extend(u64s(&chunk[0]));
                    }
                    drop(ckpt);
                    // Handed out in order, each once; the checkpoint after them, in order.
                    let mut sorted = out.clone();
                    sorted.sort_unstable();
                    prop_assert_eq!(&sorted, &out);
                    let mut ck_sorted = kept.clone();
                    ck_sorted.sort_unstable();
                    prop_assert_eq!(&ck_sorted, &kept);
                    if let (Some(last), Some(first)) = (out.last(), kept.first()) {
                        prop_assert!(last < first, "{last} handed, {first} kept");
                    }
                    // Everything else was skipped as stale, and counted so.
                    let seen: HashSet<u64> = out.iter().chain(&kept).copied().collect();
                    prop_assert_eq!(seen.len(), out.len() + kept.len(), "a sample twice");
                    let skipped = inserted.iter().filter(|(id, _)| !seen.contains(id)).count();
                    prop_assert_eq!(skipped as u64, versions.counts().at_sample);
                    for (id, version) in &inserted {
                        if !seen.contains(id) {
                            prop_assert!(*version < versions.floor(), "{id} v{version} lost");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn writers_and_a_consumer_with_moving_versions_lose_nothing_and_keep_order() {
    const WRITERS: u64 = 3;
    const PER_WRITER: u64 = 20_000;
    let (store, mut fresh, versions) = ring(4, 2);
    versions.set_latest(10);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (store, versions) = (Arc::clone(&store), Arc::clone(&versions));
            std::thread::spawn(move || {
                for i in 0..PER_WRITER {
                    // Lagging 0 to 4 versions behind: some stale at once, some later.
                    let version = versions.latest().saturating_sub(i % 5);
                    assert!(put(&store, w << 32 | i, version, None));
                    if i % 997 == 0 {
                        versions.set_latest(versions.latest() + 1);
                    }
                }
            })
        })
        .collect();
    let mut last = vec![None::<u64>; WRITERS as usize];
    let mut count = 0u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    let wanted = |versions: &PolicyVersions| versions.counts().at_sample;
    loop {
        let floor = versions.floor();
        match fresh.sample(Some(Instant::now() + Duration::from_millis(200))) {
            Ok(batch) => {
                let (ids, vs) = handed(&fresh, batch);
                assert!(vs.iter().all(|&v| v >= floor), "{vs:?} handed under floor {floor}");
                for id in ids {
                    let (w, i) = ((id >> 32) as usize, id & 0xFFFF_FFFF);
                    assert!(last[w].is_none_or(|prev| prev < i), "writer {w}: {i} out of order");
                    last[w] = Some(i);
                    count += 1;
                }
            }
            Err(EchoError::TimedOut) if writers.iter().all(|w| w.is_finished()) => break,
            Err(EchoError::TimedOut) => {}
            Err(other) => panic!("{other}"),
        }
        assert!(Instant::now() < deadline, "the consumer stalled");
    }
    for writer in writers {
        writer.join().unwrap();
    }
    // What is left in the ring: fewer than a batch of fresh rows (gathered or unjudged).
    let mut ckpt = store.checkpoint().unwrap();
    let left = ckpt.len() as u64;
    let mut chunk = vec![Vec::new(), Vec::new()];
    while ckpt.next_chunk(1 << 20, &mut chunk) > 0 {}
    drop(ckpt);
    assert_eq!(count + wanted(&versions) + left, WRITERS * PER_WRITER);
    assert!(wanted(&versions) > 0, "the versions moved: some samples became stale");
}
