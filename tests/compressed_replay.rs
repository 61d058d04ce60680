//! Replay tables that store chosen leaves compressed: every leaf bit-exact after insert,
//! sample (one and several decompression threads) and checkpoint/restore, for each codec;
//! `max_bytes` eviction order and accounting under concurrent writers and a sampling
//! consumer; memory actually given back when items leave.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use common::PATIENCE;
use echo::codec::{Codec, LeafCodecs};
use echo::replay::{RemoverKind, ReplayBatch, ReplayConfig, ReplayConsumer, Table};
use echo::{ArraySpec, DataSpec, Leaves, Rows};

const SIDE: usize = 84;
const FRAME: usize = SIDE * SIDE;

/// A frame that compresses like a preprocessed Atari frame (flat regions, a few edges), and
/// differs for every id, with its id written into its first 8 bytes.
fn frame(id: u64, salt: u64) -> Vec<u8> {
    // Row by row, not pixel by pixel: the tests build thousands of these, and a per-pixel
    // iterator is most of their time in unoptimised (and AddressSanitizer) builds.
    let mut f = vec![(40 + (id + salt) % 5) as u8; FRAME];
    for (row, line) in f.chunks_exact_mut(SIDE).enumerate() {
        if (row as u64 + id * 7 + salt) % 17 < 3 {
            line.fill(200);
        } else {
            // The columns with (col + id) % 29 == 0.
            let first = (29 - id % 29) % 29;
            for col in (first as usize..SIDE).step_by(29) {
                line[col] = 200;
            }
        }
    }
    f[..8].copy_from_slice(&id.to_le_bytes());
    f
}

/// `obs` (compressed as given), `id` (raw u64), `next_obs` (compressed as given).
fn spec() -> DataSpec {
    DataSpec::new(vec![
        ArraySpec::new(vec![SIDE, SIDE], 1).unwrap(),
        ArraySpec::new(vec![], 8).unwrap(),
        ArraySpec::new(vec![SIDE, SIDE], 1).unwrap(),
    ])
    .unwrap()
}

fn config(batch: usize, max_size: usize, obs: Codec, next: Option<Codec>) -> ReplayConfig {
    ReplayConfig {
        seed: Some(5),
        compress: vec![Some(obs), None, next],
        ..ReplayConfig::new(batch, max_size)
    }
}

fn put(table: &Table, id: u64) {
    let (obs, next) = (frame(id, 0), frame(id, 1));
    let leaves: [&[u8]; 3] = [&obs, &id.to_le_bytes(), &next];
    table.insert(&Leaves(&leaves), None, Some(Instant::now() + PATIENCE)).unwrap();
}

fn sample(consumer: &mut ReplayConsumer) -> ReplayBatch {
    consumer.sample(Some(Instant::now() + PATIENCE)).expect("a batch within the patience")
}

/// Every item of `batch`: checks both frames against its id; returns the ids.
fn check_batch(table: &Table, batch: ReplayBatch) -> Vec<u64> {
    let n = table.config().batch_size;
    let read = |leaf: usize, bytes: usize| {
        let ptr = table.batch_ptr(batch.half, leaf);
        // SAFETY: the consumer just assembled `batch`: the half holds `n` values of `bytes`
        // bytes of this leaf and nothing writes it until the second `sample` after this one.
        unsafe { std::slice::from_raw_parts(ptr, n * bytes) }.to_vec()
    };
    let (obs, ids, next) = (read(0, FRAME), read(1, 8), read(2, FRAME));
    (0..n)
        .map(|i| {
            let id = u64::from_le_bytes(ids[8 * i..8 * i + 8].try_into().unwrap());
            assert!(obs[i * FRAME..(i + 1) * FRAME] == frame(id, 0), "obs of item {id}");
            assert!(next[i * FRAME..(i + 1) * FRAME] == frame(id, 1), "next_obs of item {id}");
            id
        })
        .collect()
}

#[test]
fn every_leaf_comes_back_bit_exact_for_each_codec_and_batch_size() {
    let codecs = [
        (Codec::Zstd { level: 1 }, Some(Codec::Lz4)),
        (Codec::Lz4, None),
        (Codec::Zstd { level: 19 }, Some(Codec::Zstd { level: -5 })),
    ];
    for (obs, next) in codecs {
        // 8 items decompress on one thread; 160 (2.2 MiB raw) on several.
        for batch in [8, 160] {
            let table = Table::new(spec(), config(batch, 400, obs, next)).unwrap();
            for id in 0..500 {
                put(&table, id);
            }
            let mut consumer = table.consumer().unwrap();
            let mut seen = HashSet::new();
            for _ in 0..4 {
                let ids = check_batch(&table, sample(&mut consumer));
                assert!(ids.iter().all(|&id| (100..500).contains(&id)), "evicted ids drawn");
                seen.extend(ids);
            }
            assert!(seen.len() > batch, "{obs:?}/{next:?}: draws vary");
            let stats = table.stats();
            assert_eq!(stats.raw_bytes, 400 * (2 * FRAME as u64 + 8));
            // Leaves stored raw take their size; compressed ones an eighth at most.
            let fixed = 400 * (8 + if next.is_none() { FRAME as u64 } else { 0 });
            let packed = stats.stored_bytes - fixed;
            assert!(
                packed * 8 < stats.raw_bytes - fixed,
                "{obs:?}: {packed} stored for {} raw",
                stats.raw_bytes - fixed
            );
        }
    }
}

/// Every leaf's bytes of a checkpoint, copied `chunk_bytes` at a time.
fn drain(ckpt: &mut echo::replay::Checkpoint, chunk_bytes: usize) -> Vec<Vec<u8>> {
    let mut all = vec![Vec::new(); 3];
    let mut chunk = vec![Vec::new(); 3];
    while ckpt.next_chunk(chunk_bytes, &mut chunk) > 0 {
        for (all, chunk) in all.iter_mut().zip(&chunk) {
            all.extend_from_slice(chunk);
        }
    }
    all
}

/// The ids a checkpoint of `table` holds, in key order, after checking every item's bytes.
fn checkpoint_ids(table: &Arc<Table>) -> (Vec<u64>, echo::replay::Checkpoint, Vec<Vec<u8>>) {
    let mut ckpt = table.checkpoint().unwrap();
    let all = drain(&mut ckpt, 100_000);
    let ids: Vec<u64> =
        all[1].chunks(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
    for (i, &id) in ids.iter().enumerate() {
        assert!(all[0][i * FRAME..(i + 1) * FRAME] == frame(id, 0), "checkpointed obs {id}");
        assert!(all[2][i * FRAME..(i + 1) * FRAME] == frame(id, 1), "checkpointed next {id}");
    }
    (ids, ckpt, all)
}

#[test]
fn a_checkpoint_taken_while_writers_evict_restores_bit_exact() {
    let table =
        Table::new(spec(), config(4, 300, Codec::Zstd { level: 1 }, Some(Codec::Lz4))).unwrap();
    for id in 0..300 {
        put(&table, id);
    }
    let mut ckpt = table.checkpoint().unwrap();
    // Every snapshot item is evicted (its slot freed, then reused) before it is copied.
    for id in 300..700 {
        put(&table, id);
    }
    let all = drain(&mut ckpt, 50_000);
    let ids: Vec<u64> =
        all[1].chunks(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(ids, (0..300).collect::<Vec<_>>(), "the snapshot, not what replaced it");
    for (i, &id) in ids.iter().enumerate() {
        assert!(all[0][i * FRAME..(i + 1) * FRAME] == frame(id, 0), "obs {id}");
        assert!(all[2][i * FRAME..(i + 1) * FRAME] == frame(id, 1), "next_obs {id}");
    }
    let (items, state) = (ckpt.items().clone(), *ckpt.state());
    drop(ckpt);
    let restored =
        Table::new(spec(), config(4, 300, Codec::Lz4, Some(Codec::Zstd { level: 3 }))).unwrap();
    let leaves: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
    restored.restore(&items, &state, &leaves).unwrap();
    let (again, _, _) = checkpoint_ids(&restored);
    assert_eq!(again, ids, "restored under another codec, bit-exact");
    let mut consumer = restored.consumer().unwrap();
    check_batch(&restored, sample(&mut consumer));
    assert!(restored.stats().stored_bytes * 8 < restored.stats().raw_bytes);
}

#[test]
fn max_bytes_evicts_oldest_first_until_a_new_item_fits() {
    let probe = Table::new(spec(), config(1, 10, Codec::Zstd { level: 1 }, None)).unwrap();
    put(&probe, 0);
    let item = probe.stats().stored_bytes;
    // Room for about 20 items by bytes, 1,000 by count: bytes bind.
    let max_bytes = 20 * item + item / 2;
    let table = Table::new(
        spec(),
        ReplayConfig {
            max_bytes: Some(max_bytes),
            ..config(1, 1000, Codec::Zstd { level: 1 }, None)
        },
    )
    .unwrap();
    for id in 0..200 {
        put(&table, id);
        let stats = table.stats();
        assert!(stats.stored_bytes <= max_bytes, "{} > {max_bytes}", stats.stored_bytes);
    }
    let (ids, _, _) = checkpoint_ids(&table);
    let first = ids[0];
    assert_eq!(ids, (first..200).collect::<Vec<_>>(), "the newest items, in order");
    assert!((15..=25).contains(&ids.len()), "{} items fit {max_bytes} bytes", ids.len());
    assert_eq!(table.stats().evicted, first);
}

#[test]
fn max_bytes_holds_under_concurrent_writers_and_a_sampling_consumer() {
    const WRITERS: u64 = 4;
    const PER_WRITER: u64 = 400;
    let max_bytes = 2_000_000;
    let table = Table::new(
        spec(),
        ReplayConfig {
            max_bytes: Some(max_bytes),
            remover: RemoverKind::Fifo,
            ..config(16, 5000, Codec::Zstd { level: 1 }, Some(Codec::Lz4))
        },
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (table, stop) = (Arc::clone(&table), Arc::clone(&stop));
        thread::spawn(move || {
            let mut consumer = table.consumer().unwrap();
            let mut batches = 0;
            // ORDERING: Relaxed: only ends the loop; the writers' joins order everything else.
            while !stop.load(Ordering::Relaxed) && batches < 10_000 {
                check_batch(&table, sample(&mut consumer));
                batches += 1;
            }
            batches
        })
    };
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let table = Arc::clone(&table);
            thread::spawn(move || {
                for i in 0..PER_WRITER {
                    put(&table, w * PER_WRITER + i);
                    // Writers still copying may overshoot by their own items, no more.
                    let over = table.stats().stored_bytes.saturating_sub(max_bytes);
                    assert!(over < WRITERS * 2 * FRAME as u64, "{over} bytes over max_bytes");
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    // ORDERING: Relaxed: see the reader.
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    let stats = table.stats();
    assert!(stats.stored_bytes <= max_bytes, "{} > {max_bytes} at rest", stats.stored_bytes);
    assert_eq!(stats.inserted, WRITERS * PER_WRITER);
    assert_eq!(stats.evicted + stats.size, WRITERS * PER_WRITER);
    // FIFO by key: what is left is the newest keys, none missing.
    let ckpt = table.checkpoint().unwrap();
    let keys = &ckpt.items().keys;
    let first = keys[0];
    assert_eq!(*keys, (first..first + keys.len() as u64).collect::<Vec<_>>());
    assert_eq!(first + keys.len() as u64, WRITERS * PER_WRITER);
}

#[test]
fn stored_bytes_is_the_sum_of_what_items_take_and_falls_as_they_leave() {
    let table = Table::new(
        spec(),
        ReplayConfig {
            max_times_sampled: 1,
            ..config(10, 100, Codec::Zstd { level: 1 }, Some(Codec::Zstd { level: 1 }))
        },
    )
    .unwrap();
    for id in 0..100 {
        put(&table, id);
    }
    let full = table.stats().stored_bytes;
    let mut consumer = table.consumer().unwrap();
    for _ in 0..10 {
        check_batch(&table, sample(&mut consumer));
    }
    let stats = table.stats();
    assert_eq!((stats.size, stats.stored_bytes, stats.raw_bytes), (0, 0, 0), "{full} before");
}

/// A source whose samples arrived with their compressed leaves already packed (as the TCP
/// ingress hands them over): the table keeps those bytes instead of compressing again.
struct Arrived<'a> {
    leaves: [&'a [u8]; 3],
    packed: &'a [u8],
}

impl echo::SampleSource for Arrived<'_> {
    fn num_samples(&self) -> usize {
        1
    }
    fn num_leaves(&self, _: usize) -> usize {
        3
    }
    fn leaf(&self, _: usize, leaf: usize) -> &[u8] {
        self.leaves[leaf]
    }
    fn packed(&self, _: usize) -> Option<&[u8]> {
        Some(self.packed)
    }
}

/// Rows of samples, some of which arrived packed (as the TCP ingress hands a round over),
/// that any thread may read.
struct Round<'a> {
    rows: Vec<[&'a [u8]; 3]>,
    packed: &'a [Option<Box<[u8]>>],
}

impl echo::SampleSource for Round<'_> {
    fn num_samples(&self) -> usize {
        self.rows.len()
    }
    fn num_leaves(&self, _: usize) -> usize {
        3
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        self.rows[sample][leaf]
    }
    fn packed(&self, sample: usize) -> Option<&[u8]> {
        self.packed[sample].as_deref()
    }
    fn shared(&self) -> Option<&(dyn echo::SampleSource + Sync)> {
        Some(self)
    }
}

#[test]
fn an_insert_of_mibs_compresses_its_samples_on_several_threads_each_into_its_own_item() {
    // 4.3 MiB raw: several threads' worth, and on a machine of few cores several groups (a
    // table packs four parts per thread ahead at a time).
    let (zstd1, n) = (Codec::Zstd { level: 1 }, 320u64);
    let own = LeafCodecs::new(&spec(), vec![Some(zstd1), None, Some(Codec::Lz4)]).unwrap();
    let frames: Vec<(Vec<u8>, [u8; 8], Vec<u8>)> =
        (0..n).map(|id| (frame(id, 0), id.to_le_bytes(), frame(id, 1))).collect();
    let leaves = |i: usize| -> [&[u8]; 3] { [&frames[i].0, &frames[i].1, &frames[i].2] };
    let packed_len = |codecs: &LeafCodecs, i: usize| codecs.pack(&Leaves(&leaves(i)), 0).len();
    let check = |table: &Arc<Table>, expected_packed: usize| {
        let stored = table.stats().stored_bytes;
        assert_eq!(stored, 8 * n + expected_packed as u64, "each row packed once, as itself");
        let mut consumer = table.consumer().unwrap();
        let mut seen = HashSet::new();
        for _ in 0..20 {
            seen.extend(check_batch(table, sample(&mut consumer)));
        }
        assert!(seen.len() > 250, "{} distinct of {n} in 1280 draws", seen.len());
    };
    let deadline = Some(Instant::now() + PATIENCE);

    // `submit_batch`: rows of batched leaves.
    let batched: [Vec<u8>; 3] = [
        frames.iter().flat_map(|f| f.0.clone()).collect(),
        frames.iter().flat_map(|f| f.1).collect(),
        frames.iter().flat_map(|f| f.2.clone()).collect(),
    ];
    let batched: [&[u8]; 3] = [&batched[0], &batched[1], &batched[2]];
    let table = Table::new(spec(), config(64, n as usize, zstd1, Some(Codec::Lz4))).unwrap();
    table.insert(&Rows::new(&spec(), &batched, n as usize, None).unwrap(), None, deadline).unwrap();
    check(&table, (0..n as usize).map(|i| packed_len(&own, i)).sum());

    // A round from the wire: every third row arrived packed tighter (kept as it is), one
    // with a header that does not add up (compressed again), the rest raw.
    let slow =
        LeafCodecs::new(&spec(), vec![Some(Codec::Zstd { level: 19 }), None, Some(Codec::Lz4)])
            .unwrap();
    let mut arrived: Vec<Option<Box<[u8]>>> =
        (0..n as usize).map(|i| (i % 3 == 0).then(|| slow.pack(&Leaves(&leaves(i)), 0))).collect();
    arrived[7] = Some(Box::from(&[9u8, 0, 0, 0, 1, 2][..]));
    let expected: usize = (0..n as usize)
        .map(|i| match &arrived[i] {
            Some(item) if i != 7 => item.len(),
            _ => packed_len(&own, i),
        })
        .sum();
    let round = Round { rows: (0..n as usize).map(leaves).collect(), packed: &arrived };
    let table = Table::new(spec(), config(64, n as usize, zstd1, Some(Codec::Lz4))).unwrap();
    table.insert(&round, None, deadline).unwrap();
    check(&table, expected);
}

#[test]
fn items_that_arrive_compressed_are_stored_as_they_arrived() {
    let zstd1 = Codec::Zstd { level: 1 };
    let table = Table::new(spec(), config(1, 10, zstd1, None)).unwrap();
    let (obs, next) = (frame(3, 0), frame(3, 1));
    let id = 3u64.to_le_bytes();
    // Packed at level 19 by the sender: smaller than the table's own level 1 would make it.
    let slow =
        echo::codec::LeafCodecs::new(&spec(), vec![Some(Codec::Zstd { level: 19 }), None, None])
            .unwrap();
    let packed = slow.pack(&Leaves(&[&obs, &id, &next]), 0);
    let own = echo::codec::LeafCodecs::new(&spec(), vec![Some(zstd1), None, None])
        .unwrap()
        .pack(&Leaves(&[&obs, &id, &next]), 0);
    assert!(packed.len() < own.len(), "level 19 packs tighter ({} vs {})", packed.len(), own.len());
    let src = Arrived { leaves: [&obs, &id, &next], packed: &packed };
    table.insert(&src, None, Some(Instant::now() + PATIENCE)).unwrap();
    let fixed = (8 + FRAME) as u64;
    assert_eq!(table.stats().stored_bytes, fixed + packed.len() as u64, "kept as it arrived");
    let mut consumer = table.consumer().unwrap();
    assert_eq!(check_batch(&table, sample(&mut consumer)), vec![3]);
}

#[test]
fn a_checkpoint_can_keep_compressed_leaves_as_stored_and_restore_them_without_recompressing() {
    use echo::replay::LeafRows;
    let zstd1 = Codec::Zstd { level: 1 };
    let table = Table::new(spec(), config(4, 200, zstd1, Some(Codec::Lz4))).unwrap();
    for id in 0..200 {
        put(&table, id);
    }
    let stored_before = table.stats().stored_bytes;
    let mut ckpt = table.checkpoint().unwrap();
    ckpt.keep_packed();
    // Half the snapshot is evicted and its slots reused before it is copied.
    for id in 200..300 {
        put(&table, id);
    }
    let all = drain(&mut ckpt, 40_000);
    let lengths = ckpt.packed_lengths().to_vec();
    assert_eq!(lengths.len(), 2, "one list per compressed leaf");
    assert!(lengths.iter().all(|l| l.len() == 200));
    assert_eq!(all[0].len(), lengths[0].iter().map(|&l| l as usize).sum::<usize>());
    assert!(all[0].len() * 8 < 200 * FRAME, "the obs rows are compressed");
    assert_eq!(all[1].len(), 200 * 8, "raw leaves stay raw");
    let (items, state) = (ckpt.items().clone(), *ckpt.state());
    drop(ckpt);
    let rows = [
        LeafRows::Packed { codec: zstd1, bytes: &all[0], lengths: &lengths[0] },
        LeafRows::Raw(&all[1]),
        LeafRows::Packed { codec: Codec::Lz4, bytes: &all[2], lengths: &lengths[1] },
    ];
    // The same codecs: stored as they come, byte for byte the table's own.
    let same = Table::new(spec(), config(4, 200, zstd1, Some(Codec::Lz4))).unwrap();
    same.restore_rows(&items, &state, &rows).unwrap();
    assert_eq!(same.stats().stored_bytes, stored_before);
    let (ids, _, _) = checkpoint_ids(&same);
    assert_eq!(ids, (0..200).collect::<Vec<_>>());
    // Other codecs, and none: decompressed (and compressed again) on the way in.
    for other in [config(4, 200, Codec::Lz4, None), ReplayConfig::new(4, 200)] {
        let restored = Table::new(spec(), other).unwrap();
        restored.restore_rows(&items, &state, &rows).unwrap();
        let (ids, _, _) = checkpoint_ids(&restored);
        assert_eq!(ids, (0..200).collect::<Vec<_>>());
    }
    // Lengths that do not add up, and a row that is not what it claims, insert nothing.
    let fresh = || Table::new(spec(), config(4, 200, zstd1, Some(Codec::Lz4))).unwrap();
    let mut short = lengths[0].clone();
    short[0] -= 1;
    let bad =
        [LeafRows::Packed { codec: zstd1, bytes: &all[0], lengths: &short }, rows[1], rows[2]];
    let err = fresh().restore_rows(&items, &state, &bad).unwrap_err().to_string();
    assert!(err.contains("add up"), "{err}");
    let mut garbled = all[0].clone();
    garbled[0] ^= 0xFF;
    let bad = [
        LeafRows::Packed { codec: zstd1, bytes: &garbled, lengths: &lengths[0] },
        rows[1],
        rows[2],
    ];
    let t = fresh();
    let err = t.restore_rows(&items, &state, &bad).unwrap_err().to_string();
    assert!(err.contains("item 0"), "{err}");
    assert_eq!(t.stats().size, 0);
}
