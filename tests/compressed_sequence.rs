//! Sequence tables that store leaves compressed per chunk: what the table holds in memory
//! (`stored_bytes` against `raw_bytes`), `max_bytes` eviction (oldest chunks first, also
//! under contention), and every step coming back bit-exact. The window rules themselves are
//! checked, with and without codecs, in `tests/sequence.rs`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use echo::codec::Codec;
use echo::replay::{
    LeafRows, ReplayBatch, ReplayConfig, SamplerKind, SequenceConfig, SequenceConsumer,
    SequenceSnapshot, SequenceTable, SEQUENCE_META,
};
use echo::{ArraySpec, DataSpec, EpisodeEnd, StepLeaves, StepTag};

const FRAME: usize = 4096;

/// Leaf 0: the step's id `stream << 32 | index` (u64). Leaf 1: a 4 KiB "frame" that changes
/// a little from step to step, as consecutive observations do.
fn spec() -> DataSpec {
    DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap(), ArraySpec::new(vec![FRAME], 1).unwrap()])
        .unwrap()
}

fn frame(id: u64) -> Vec<u8> {
    let (stream, index) = (id >> 32, id & 0xFFFF_FFFF);
    // Byte j is `(index / 3 + j / 97) ^ (stream * 31)`, filled 97 bytes at a time: a
    // per-byte iterator was most of these tests' time in unoptimised builds.
    let mut frame = vec![0u8; FRAME];
    for (run, bytes) in frame.chunks_mut(97).enumerate() {
        bytes.fill(((index / 3 + run as u64) ^ (stream * 31)) as u8);
    }
    frame
}

fn config(batch: usize, max_size: usize, codec: Codec) -> ReplayConfig {
    ReplayConfig {
        seed: Some(11),
        compress: vec![None, Some(codec)],
        ..ReplayConfig::new(batch, max_size)
    }
}

fn put(table: &SequenceTable, id: u64, end: EpisodeEnd) {
    let (head, frame) = (id.to_ne_bytes(), frame(id));
    let leaves = [&head[..], &frame[..]];
    let step = StepLeaves(&leaves, StepTag { stream: id >> 32, end });
    table.insert(&step, None, Some(Instant::now() + common::PATIENCE)).unwrap();
}

/// The real steps' ids of every window of `b`, each step's frame checked bit for bit and the
/// padding checked to be zeros.
fn windows(c: &SequenceConsumer, b: ReplayBatch, length: usize) -> Vec<Vec<u64>> {
    let ids: Vec<u64> = c.read_leaf(b, 0, |bytes| {
        bytes.chunks_exact(8).map(|x| u64::from_ne_bytes(x.try_into().unwrap())).collect()
    });
    let frames = c.read_leaf(b, 1, <[u8]>::to_vec);
    let mask_leaf = 2 + SEQUENCE_META.iter().position(|m| m.name == "mask").unwrap();
    let mask = c.read_leaf(b, mask_leaf, <[u8]>::to_vec);
    (0..mask.len() / length)
        .map(|w| {
            let real = mask[w * length..(w + 1) * length].iter().filter(|&&m| m == 1).count();
            for j in 0..length {
                let step = w * length + j;
                let got = &frames[step * FRAME..(step + 1) * FRAME];
                if j < real {
                    assert!(
                        got == frame(ids[step]),
                        "step {:#x}: its frame is corrupted",
                        ids[step]
                    );
                } else {
                    assert!(got.iter().all(|&x| x == 0) && ids[step] == 0, "padding is zeros");
                }
            }
            let w_ids = ids[w * length..w * length + real].to_vec();
            for (j, &id) in w_ids.iter().enumerate() {
                assert_eq!(id, w_ids[0] + j as u64, "window {w_ids:x?}: not consecutive steps");
            }
            w_ids
        })
        .collect()
}

#[test]
fn full_chunks_are_packed_and_every_step_comes_back_bit_exact() {
    for codec in [Codec::Zstd { level: 1 }, Codec::Lz4] {
        // Windows of 16 every 4 steps, in chunks of 16: each window spans one or two chunks,
        // read whole (straight into the batch) or in part (through the scratch buffer).
        let sequence = SequenceConfig { period: 4, ..SequenceConfig::new(16) };
        let table = SequenceTable::new(spec(), config(64, 10_000, codec), sequence).unwrap();
        assert_eq!(table.chunk_length(), 16);
        for index in 0..300u64 {
            for stream in 0..3u64 {
                let end = if index == 299 && stream == 2 {
                    EpisodeEnd::Terminated
                } else {
                    EpisodeEnd::No
                };
                put(&table, (stream << 32) | index, end);
            }
        }
        table.wait_packed();
        let stats = table.stats();
        assert_eq!(stats.windows.raw_bytes, 900 * (FRAME as u64 + 8));
        // 18 of every stream's 19 chunks are full and packed; the frames compress many times.
        assert!(
            stats.windows.stored_bytes * 5 < stats.windows.raw_bytes,
            "{codec:?}: {} bytes stored for {} raw",
            stats.windows.stored_bytes,
            stats.windows.raw_bytes
        );
        let mut c = table.consumer().unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..40 {
            let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
            for ids in windows(&c, b, 16) {
                seen.insert(ids[0]);
            }
        }
        // Windows from packed chunks and from each stream's open (staged) one.
        assert!(seen.iter().any(|&id| id & 0xFFFF_FFFF < 200), "{seen:?}");
        assert!(seen.iter().any(|&id| id & 0xFFFF_FFFF >= 284), "{seen:?}");
    }
}

#[test]
fn a_gone_stream_has_its_open_chunk_packed() {
    let table = SequenceTable::new(
        spec(),
        config(4, 1000, Codec::Zstd { level: 1 }),
        SequenceConfig::new(8),
    )
    .unwrap();
    for index in 0..5u64 {
        put(&table, (7 << 32) | index, EpisodeEnd::No);
    }
    let before = table.stats().windows;
    assert_eq!(before.stored_bytes, before.raw_bytes, "an open chunk is staged raw");
    assert!(table.end_stream(7, EpisodeEnd::Truncated));
    table.wait_packed();
    let after = table.stats().windows;
    assert!(after.stored_bytes * 4 < after.raw_bytes, "{after:?}");
    let mut c = table.consumer().unwrap();
    let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
    for ids in windows(&c, b, 8) {
        assert_eq!(ids, (0..5).map(|i| (7 << 32) | i).collect::<Vec<_>>());
    }
}

#[test]
fn max_bytes_evicts_the_oldest_chunks_first() {
    const LENGTH: usize = 8;
    let step = (FRAME + 8) as u64;
    // Room for 64 raw steps; max_size (100 000) is never the bound.
    let max_bytes = 64 * step;
    for codec in [None, Some(Codec::Zstd { level: 1 }), Some(Codec::Lz4)] {
        let config = ReplayConfig {
            seed: Some(2),
            sampler: SamplerKind::Uniform,
            compress: vec![None, codec],
            max_bytes: Some(max_bytes),
            ..ReplayConfig::new(32, 100_000)
        };
        let sequence = SequenceConfig { period: 1, ..SequenceConfig::new(LENGTH) };
        let table = SequenceTable::new(spec(), config, sequence).unwrap();
        let total = 5000u64;
        for id in 0..total {
            put(&table, id, EpisodeEnd::No);
            let stats = table.stats();
            assert!(stats.windows.stored_bytes <= max_bytes, "{codec:?}: {stats:?}");
        }
        let stats = table.stats();
        assert_eq!(stats.steps + stats.steps_evicted, total);
        if codec.is_some() {
            assert!(stats.steps > 5 * 64, "{codec:?}: only {} steps fit", stats.steps);
        } else {
            assert!(stats.steps <= 64);
        }
        // What is stored is the newest steps: every window starts at or after the oldest.
        let oldest = total - stats.steps;
        let mut c = table.consumer().unwrap();
        let mut lowest = u64::MAX;
        for _ in 0..50 {
            let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
            for ids in windows(&c, b, LENGTH) {
                assert!(ids[0] >= oldest, "{codec:?}: step {} was evicted", ids[0]);
                lowest = lowest.min(ids[0]);
            }
        }
        assert!(lowest < oldest + 3 * LENGTH as u64, "{codec:?}: oldest window {lowest}, {oldest}");
    }
}

#[test]
fn max_bytes_holds_under_concurrent_inserts_and_samples() {
    const WRITERS: u64 = 3;
    const STEPS: u64 = 4000;
    const LENGTH: usize = 6;
    let step = (FRAME + 8) as u64;
    let max_bytes = 200 * step;
    let config = ReplayConfig {
        seed: Some(4),
        compress: vec![Some(Codec::Lz4), Some(Codec::Zstd { level: 1 })],
        max_bytes: Some(max_bytes),
        ..ReplayConfig::new(16, 50_000)
    };
    let sequence = SequenceConfig { period: 2, ..SequenceConfig::new(LENGTH) };
    let table = SequenceTable::new(spec(), config, sequence).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let table = Arc::clone(&table);
            thread::spawn(move || {
                // Two streams per writer, episodes of 50 steps.
                for n in 0..STEPS {
                    let stream = w * 2 + n % 2;
                    let index = n / 2;
                    let end =
                        if index % 50 == 49 { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                    put(&table, (stream << 32) | index, end);
                }
            })
        })
        .collect();
    let sampler = {
        let (table, done) = (Arc::clone(&table), Arc::clone(&done));
        thread::spawn(move || {
            let mut c = table.consumer().unwrap();
            let mut batches = 0u64;
            while !done.load(Ordering::Relaxed) || batches < 30 {
                let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
                for ids in windows(&c, b, LENGTH) {
                    // One episode of one stream.
                    let first = ids[0] & 0xFFFF_FFFF;
                    assert_eq!(first / 50, (first + ids.len() as u64 - 1) / 50, "{ids:x?}");
                }
                assert!(table.stats().windows.stored_bytes <= max_bytes);
                batches += 1;
            }
            batches
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    assert!(sampler.join().unwrap() >= 30);
    let stats = table.stats();
    assert_eq!(stats.steps_inserted, WRITERS * STEPS);
    assert!(stats.windows.stored_bytes <= max_bytes && stats.steps_evicted > 0, "{stats:?}");
    assert!(stats.steps > 2 * 200, "compressed chunks hold more than raw: {stats:?}");
}

#[test]
fn settings_that_cannot_work_are_refused() {
    let sequence = SequenceConfig::new(8);
    let mut c = config(4, 100, Codec::Zstd { level: 1 });
    c.max_bytes = Some(7 * (FRAME as u64 + 8));
    let err = SequenceTable::new(spec(), c, sequence).unwrap_err().to_string();
    assert!(err.contains("max_bytes must hold one window of raw steps"), "{err}");
    let err = SequenceTable::new(spec(), config(4, 100, Codec::Zstd { level: 99 }), sequence)
        .unwrap_err()
        .to_string();
    assert!(err.contains("level"), "{err}");
}

/// A compressed table's checkpoint with its frames kept packed (one compressed row per
/// chunk), as `(steps' ids raw, frames packed, their lengths, snapshot)`.
fn packed_checkpoint(codec: Codec) -> (Vec<u8>, Vec<u8>, Vec<u32>, SequenceSnapshot) {
    let table = SequenceTable::new(spec(), config(4, 1000, codec), SequenceConfig::new(8)).unwrap();
    for index in 0..60u64 {
        for stream in 0..2u64 {
            put(&table, (stream << 32) | index, EpisodeEnd::No);
        }
    }
    let (mut checkpoint, ()) = table.checkpoint_with(|| ()).unwrap();
    checkpoint.keep_packed();
    let (mut ids, mut frames) = (Vec::new(), Vec::new());
    let mut out = vec![Vec::new(), Vec::new()];
    while echo::checkpoint::Chunks::next_chunk(&mut checkpoint, 1 << 16, &mut out) > 0 {
        ids.extend_from_slice(&out[0]);
        frames.extend_from_slice(&out[1]);
    }
    let lengths = checkpoint.packed_lengths()[0].clone();
    assert_eq!(lengths.len(), checkpoint.chunks());
    assert_eq!(lengths.iter().map(|&l| l as usize).sum::<usize>(), frames.len());
    assert!(frames.len() * 5 < 120 * FRAME, "the frames are written compressed");
    (ids, frames, lengths, checkpoint.snapshot().clone())
}

#[test]
fn a_packed_checkpoint_restores_bit_exact_and_corrupt_rows_are_errors() {
    let zstd = Codec::Zstd { level: 1 };
    let (ids, frames, lengths, snap) = packed_checkpoint(zstd);
    let new = |codec: Codec| {
        SequenceTable::new(spec(), config(4, 1000, codec), SequenceConfig::new(8)).unwrap()
    };
    let restore = |table: &SequenceTable, codec: Codec, frames: &[u8], lengths: &[u32]| {
        let leaves = [LeafRows::Raw(&ids), LeafRows::Packed { codec, bytes: frames, lengths }];
        table.restore(&snap, &leaves, &[&[], &[]])
    };
    // Into a table with the same codec (stored as they come) or another (compressed again).
    for codec in [zstd, Codec::Lz4] {
        let table = new(codec);
        restore(&table, zstd, &frames, &lengths).unwrap();
        assert_eq!(table.stats().steps, 120);
        let mut c = table.consumer().unwrap();
        for _ in 0..10 {
            let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
            windows(&c, b, 8);
        }
    }
    let refused = |frames: &[u8], lengths: &[u32], claimed: Codec| {
        let table = new(zstd);
        let err = restore(&table, claimed, frames, lengths).unwrap_err().to_string();
        assert_eq!(table.stats().steps, 0, "nothing restored: {err}");
        err
    };
    // Lengths that do not add up, or one row too few.
    let mut long = lengths.clone();
    long[0] += 1;
    assert!(refused(&frames, &long, zstd).contains("compressed rows of"));
    assert!(refused(&frames, &lengths[1..], zstd).contains("compressed rows for"));
    // A row cut short (the next one starts a byte early).
    let mut cut = frames.clone();
    cut.remove(lengths[0] as usize - 1);
    let mut cut_lengths = lengths.clone();
    cut_lengths[0] -= 1;
    assert!(refused(&cut, &cut_lengths, zstd).contains("compressed row 0"));
    // A decompression bomb: a row whose frame claims far more than the chunk's steps.
    let mut bomb = Vec::new();
    zstd.compress_append(&vec![0u8; 64 * 8 * FRAME], &mut bomb);
    let mut bombed = bomb.clone();
    bombed.extend_from_slice(&frames[lengths[0] as usize..]);
    let mut bomb_lengths = lengths.clone();
    bomb_lengths[0] = bomb.len() as u32;
    assert!(refused(&bombed, &bomb_lengths, zstd).contains("compressed row 0"));
    // Zstd rows said to be LZ4.
    assert!(refused(&frames, &lengths, Codec::Lz4).contains("compressed row"));
}

/// Threads of this process named like the background packers.
fn packer_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(Result::ok)
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("echo-pack"))
        })
        .count()
}

#[test]
fn a_dropped_table_stops_its_packers_even_with_chunks_waiting() {
    // Many writers filling chunks at once: the packers fall behind and writers pack some
    // chunks themselves; `wait_packed` returns once every handed-out chunk is in place.
    let table = SequenceTable::new(
        spec(),
        config(4, 20_000, Codec::Zstd { level: 1 }),
        SequenceConfig::new(4),
    )
    .unwrap();
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let table = Arc::clone(&table);
            thread::spawn(move || {
                for index in 0..400u64 {
                    for stream in 0..4u64 {
                        put(&table, ((w * 4 + stream) << 32) | index, EpisodeEnd::No);
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    table.wait_packed();
    let stats = table.stats().windows;
    // Every full chunk is packed: only the 16 streams' open chunks (none: 400 steps fill
    // 100 chunks of 4 each) could be raw.
    assert!(stats.stored_bytes * 20 < stats.raw_bytes, "{stats:?}");
    drop(table);
    // Tables dropped right after filling, with chunks still queued: their packers stop.
    for round in 0..100u64 {
        let table = SequenceTable::new(spec(), config(4, 2000, Codec::Lz4), SequenceConfig::new(4))
            .unwrap();
        for index in 0..16u64 {
            for stream in 0..8u64 {
                put(&table, (((round << 8) | stream) << 32) | index, EpisodeEnd::No);
            }
        }
    }
    let deadline = Instant::now() + common::PATIENCE;
    while packer_threads() >= 40 && Instant::now() < deadline {
        thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(packer_threads() < 40, "{} packer threads left", packer_threads());
}
