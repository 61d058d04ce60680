//! Sequence tables through their public API.
//!
//! - Against a model (proptest): random interleavings of several streams' episodes, for every
//!   `at_end`, length and period, in a table large enough that nothing is evicted. Draining it
//!   (LIFO, each window once) hands out exactly the windows the model cuts from the episodes,
//!   each with the steps, mask and start the model says.
//! - Under contention: writer threads append steps of several streams each to a table whose
//!   `max_size` is a prime (so nothing lines up with the chunks), while the consumer samples
//!   batches. Every window it is handed is `length` (or, padded, fewer) consecutive steps of
//!   one episode of one stream, never a step that was evicted and written over.
//!
//! Each runs with the leaves stored raw and with some or all of them compressed per chunk
//! ([`CODECS`]): staged while a chunk fills, packed once it is full or its stream is gone,
//! decompressed into the batch, copied out by a checkpoint and packed again by a restore.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use echo::codec::Codec;
use echo::replay::{
    AtEnd, LeafRows, ReplayBatch, ReplayConfig, SamplerKind, SequenceConfig, SequenceConsumer,
    SequenceSnapshot, SequenceTable, SEQUENCE_META,
};
use echo::{ArraySpec, DataSpec, EpisodeEnd, SampleSource, StepLeaves, StepTag};
use proptest::prelude::*;

/// Leaf 0: the step's id `stream << 40 | episode << 20 | index` (u64). Leaf 1: 5 bytes derived
/// from it (an odd size, to catch torn or misaligned copies).
fn spec() -> DataSpec {
    DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap(), ArraySpec::new(vec![5], 1).unwrap()])
        .unwrap()
}

/// How the two leaves are stored: raw; the odd-sized one compressed; both (with another
/// codec each); the id only.
const CODECS: [[Option<Codec>; 2]; 4] = [
    [None, None],
    [None, Some(Codec::Zstd { level: 1 })],
    [Some(Codec::Lz4), Some(Codec::Zstd { level: 3 })],
    [Some(Codec::Zstd { level: -1 }), None],
];

fn with_codecs(config: ReplayConfig, codecs: [Option<Codec>; 2]) -> ReplayConfig {
    ReplayConfig { compress: codecs.to_vec(), ..config }
}

fn step_id(stream: u64, episode: u64, index: u64) -> u64 {
    (stream << 40) | (episode << 20) | index
}

fn tail(id: u64) -> [u8; 5] {
    std::array::from_fn(|i| (id.wrapping_mul(2_654_435_761).wrapping_add(i as u64) >> 3) as u8)
}

fn put(table: &SequenceTable, id: u64, stream: u64, end: EpisodeEnd) {
    let (head, tail) = (id.to_ne_bytes(), tail(id));
    let leaves = [&head[..], &tail[..]];
    let step = StepLeaves(&leaves, StepTag { stream, end });
    assert_eq!(step.num_samples(), 1);
    table.insert(&step, None, Some(Instant::now() + common::PATIENCE)).unwrap();
}

/// One window as handed out: its real steps' ids, the mask, and the per-window values.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Got {
    stream: u64,
    start: u32,
    ids: Vec<u64>,
    terminated: bool,
    truncated: bool,
    /// Where the episode's last step is in the window, if it is there (and has arrived).
    last: Option<usize>,
}

fn meta_index(name: &str) -> usize {
    2 + SEQUENCE_META.iter().position(|m| m.name == name).unwrap()
}

fn read_u64s(c: &SequenceConsumer, b: ReplayBatch, leaf: usize) -> Vec<u64> {
    c.read_leaf(b, leaf, |bytes| {
        bytes.chunks_exact(8).map(|x| u64::from_ne_bytes(x.try_into().unwrap())).collect()
    })
}

/// Every window of batch `b`, checked for what holds of any window: real steps first (mask
/// exact), zeros after them, uncorrupted tails, consecutive steps of one episode of one
/// stream, `start` its first step's index.
fn windows(c: &SequenceConsumer, b: ReplayBatch, length: usize) -> Vec<Got> {
    let ids = read_u64s(c, b, 0);
    let tails = c.read_leaf(b, 1, <[u8]>::to_vec);
    let mask = c.read_leaf(b, meta_index("mask"), <[u8]>::to_vec);
    let starts: Vec<u32> = c.read_leaf(b, meta_index("start"), |bytes| {
        bytes.chunks_exact(4).map(|x| u32::from_ne_bytes(x.try_into().unwrap())).collect()
    });
    let streams = read_u64s(c, b, meta_index("stream"));
    let terminated = c.read_leaf(b, meta_index("terminated"), <[u8]>::to_vec);
    let truncated = c.read_leaf(b, meta_index("truncated"), <[u8]>::to_vec);
    let is_last = c.read_leaf(b, meta_index("is_last"), <[u8]>::to_vec);
    (0..starts.len())
        .map(|w| {
            let m = &mask[w * length..(w + 1) * length];
            let real = m.iter().take_while(|&&x| x == 1).count();
            assert!(m[real..].iter().all(|&x| x == 0), "mask {m:?}: real steps, then padding");
            assert!(real > 0, "a window has at least one real step");
            let w_ids = ids[w * length..w * length + real].to_vec();
            for (j, &id) in ids[w * length..(w + 1) * length].iter().enumerate() {
                let t = &tails[(w * length + j) * 5..(w * length + j + 1) * 5];
                if j < real {
                    assert_eq!(t, tail(id), "step {id:#x} is corrupted");
                } else {
                    assert_eq!((id, t), (0, &[0u8; 5][..]), "padding is zeros");
                }
            }
            let first = w_ids[0];
            for (j, &id) in w_ids.iter().enumerate() {
                assert_eq!(id, first + j as u64, "window {w_ids:x?}: not consecutive steps");
            }
            assert_eq!(first >> 40, streams[w] & 0xFFFF_FFFF, "the window's stream");
            assert_eq!(u64::from(starts[w]), first & 0xF_FFFF, "start is the first step's index");
            let lasts: Vec<usize> = (0..length).filter(|&j| is_last[w * length + j] == 1).collect();
            assert!(lasts.len() <= 1 && lasts.iter().all(|&j| j < real), "is_last {lasts:?}");
            Got {
                stream: streams[w],
                start: starts[w],
                ids: w_ids,
                terminated: terminated[w] == 1,
                truncated: truncated[w] == 1,
                last: lasts.first().copied(),
            }
        })
        .collect()
}

/// The windows the rules cut from one ended episode of `len` steps: `(start, real steps)`.
fn model_windows(len: u32, t: u32, p: u32, at_end: AtEnd) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> =
        (0..len).step_by(p as usize).filter(|s| s + t <= len).map(|s| (s, t)).collect();
    let pending: Vec<u32> = (0..len).step_by(p as usize).filter(|s| s + t > len).collect();
    match at_end {
        AtEnd::Drop => {}
        AtEnd::Pad => out.extend(pending.iter().map(|&s| (s, len - s))),
        AtEnd::Shift if !pending.is_empty() => {
            let start = len.saturating_sub(t);
            if !out.iter().any(|&(s, _)| s == start) {
                out.push((start, len - start));
            }
        }
        AtEnd::Shift => {}
    }
    out
}

#[derive(Debug, Clone)]
struct Case {
    length: u32,
    period: u32,
    at_end: AtEnd,
    /// Per stream: its episodes' lengths; the last may stay open.
    episodes: Vec<Vec<u32>>,
    last_open: bool,
    /// The order streams take turns in (indices into `episodes`, cycled).
    turns: Vec<usize>,
    /// Which of [`CODECS`] stores the leaves.
    codecs: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1u32..7,
        1u32..7,
        prop_oneof![Just(AtEnd::Pad), Just(AtEnd::Shift), Just(AtEnd::Drop)],
        prop::collection::vec(prop::collection::vec(1u32..15, 1..4), 1..4),
        any::<bool>(),
        prop::collection::vec(0usize..4, 1..12),
        0..CODECS.len(),
    )
        .prop_map(|(length, period, at_end, episodes, last_open, turns, codecs)| Case {
            length,
            period,
            at_end,
            episodes,
            last_open,
            turns,
            codecs,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn every_window_matches_a_model_of_its_episodes(case in case()) {
        let (t, p) = (case.length, case.period);
        let config = with_codecs(ReplayConfig {
            sampler: SamplerKind::Lifo,
            max_times_sampled: 1,
            seed: Some(1),
            ..ReplayConfig::new(1, 4096)
        }, CODECS[case.codecs]);
        let sequence = SequenceConfig {
            period: p as usize,
            at_end: case.at_end,
            ..SequenceConfig::new(t as usize)
        };
        let table = SequenceTable::new(spec(), config, sequence).unwrap();
        // Each stream's steps, in order, with the flag each carries.
        let mut queues: Vec<Vec<(u64, EpisodeEnd)>> = Vec::new();
        let mut expected = Vec::new();
        for (s, lens) in case.episodes.iter().enumerate() {
            let s = s as u64;
            let mut steps = Vec::new();
            for (e, &len) in lens.iter().enumerate() {
                let open = case.last_open && e + 1 == lens.len();
                for i in 0..len {
                    let end = if i + 1 == len && !open { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                    steps.push((step_id(s, e as u64, u64::from(i)), end));
                }
                let cut = if open {
                    // An open episode has only its whole windows so far.
                    (0..len).step_by(p as usize).filter(|st| st + t <= len).map(|st| (st, t)).collect()
                } else {
                    model_windows(len, t, p, case.at_end)
                };
                for (start, real) in cut {
                    let ids = (0..real).map(|j| step_id(s, e as u64, u64::from(start + j))).collect();
                    let last = (!open && start + real == len).then(|| (real - 1) as usize);
                    expected.push(Got { stream: s, start, ids, terminated: !open, truncated: false, last });
                }
            }
            queues.push(steps);
        }
        // Interleave the streams in the case's turn order (then whatever is left, in order).
        let mut next = vec![0usize; queues.len()];
        let turns = case.turns.iter().map(|&i| i % queues.len());
        for s in turns.cycle().take(queues.iter().map(Vec::len).sum::<usize>() * 2) {
            if let Some(&(id, end)) = queues[s].get(next[s]) {
                put(&table, id, s as u64, end);
                next[s] += 1;
            }
        }
        for (s, q) in queues.iter().enumerate() {
            for &(id, end) in &q[next[s]..] {
                put(&table, id, s as u64, end);
            }
        }
        let stats = table.stats();
        prop_assert_eq!(stats.windows.size, expected.len() as u64);
        prop_assert_eq!(stats.windows.evicted, 0);
        let mut c = table.consumer().unwrap();
        let mut got = Vec::new();
        for _ in 0..expected.len() {
            let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
            got.extend(windows(&c, b, t as usize));
        }
        got.sort();
        expected.sort();
        prop_assert_eq!(got, expected);
        prop_assert_eq!(table.stats().windows.size, 0, "each window handed out once");
    }
}

#[test]
fn concurrent_inserts_and_samples_never_see_an_evicted_step() {
    const WRITERS: u64 = 3;
    const STREAMS_PER_WRITER: u64 = 4;
    const STEPS_PER_WRITER: u64 = 60_000;
    const LENGTH: usize = 8;
    let cases = [
        (AtEnd::Pad, CODECS[0]),
        (AtEnd::Shift, CODECS[1]),
        (AtEnd::Drop, CODECS[2]),
        (AtEnd::Pad, CODECS[3]),
    ];
    for (at_end, codecs) in cases {
        // 997 is prime: no chunk boundary lines up with the table's end.
        let config =
            with_codecs(ReplayConfig { seed: Some(3), ..ReplayConfig::new(16, 997) }, codecs);
        let sequence = SequenceConfig { period: 3, at_end, ..SequenceConfig::new(LENGTH) };
        let table = SequenceTable::new(spec(), config, sequence).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let table = Arc::clone(&table);
                thread::spawn(move || {
                    // Episode lengths from a fixed sequence: 1..=37 steps.
                    let mut state = w * 7 + 1;
                    let mut episode = vec![0u64; STREAMS_PER_WRITER as usize];
                    let mut index = vec![0u64; STREAMS_PER_WRITER as usize];
                    let mut left = vec![0u64; STREAMS_PER_WRITER as usize];
                    for n in 0..STEPS_PER_WRITER {
                        let k = (n % STREAMS_PER_WRITER) as usize;
                        if left[k] == 0 {
                            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                            left[k] = 1 + (state >> 33) % 37;
                        }
                        left[k] -= 1;
                        let stream = w * STREAMS_PER_WRITER + k as u64;
                        let end = match (left[k], n % 2) {
                            (0, 0) => EpisodeEnd::Terminated,
                            (0, _) => EpisodeEnd::Truncated,
                            _ => EpisodeEnd::No,
                        };
                        put(&table, step_id(stream, episode[k], index[k]), stream, end);
                        index[k] += 1;
                        if end != EpisodeEnd::No {
                            episode[k] += 1;
                            index[k] = 0;
                        }
                    }
                })
            })
            .collect();
        let sampler = {
            let table = Arc::clone(&table);
            let done = Arc::clone(&done);
            thread::spawn(move || {
                let mut c = table.consumer().unwrap();
                let mut batches = 0u64;
                while !done.load(Ordering::Relaxed) || batches < 50 {
                    let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
                    for got in windows(&c, b, LENGTH) {
                        if got.ids.len() < LENGTH {
                            assert_ne!(at_end, AtEnd::Drop, "drop never pads");
                            assert!(got.terminated || got.truncated, "padding only at an end");
                        }
                    }
                    batches += 1;
                }
                batches
            })
        };
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        let batches = sampler.join().unwrap();
        let stats = table.stats();
        assert!(stats.steps <= 997, "{at_end:?}: {} steps stored", stats.steps);
        assert_eq!(stats.windows.raw_bytes, stats.steps * 13);
        if codecs == CODECS[0] {
            assert_eq!(stats.windows.stored_bytes, stats.windows.raw_bytes);
        }
        assert_eq!(stats.steps_inserted, WRITERS * STEPS_PER_WRITER);
        assert!(stats.windows.evicted > 0 && stats.steps_evicted > 0, "{at_end:?}: {stats:?}");
        assert!(batches >= 50, "{at_end:?}");
        // Every stream left its last episode open or ended it; nothing else is open.
        assert!(stats.streams_open <= WRITERS * STREAMS_PER_WRITER);
    }
}

#[test]
fn a_stale_key_never_reaches_a_newer_window() {
    for codecs in CODECS {
        a_stale_key_never_reaches_a_newer_window_with(codecs);
    }
}

fn a_stale_key_never_reaches_a_newer_window_with(codecs: [Option<Codec>; 2]) {
    let config = with_codecs(ReplayConfig { seed: Some(5), ..ReplayConfig::new(4, 31) }, codecs);
    let table = SequenceTable::new(spec(), config, SequenceConfig::new(3)).unwrap();
    let mut c = table.consumer().unwrap();
    let mut seen = BTreeMap::new();
    for i in 0..3000u64 {
        put(&table, step_id(0, 0, i), 0, EpisodeEnd::No);
        if i % 50 == 49 {
            let b = c.sample(Some(Instant::now() + Duration::from_secs(5))).unwrap();
            let keys = read_u64s(&c, b, meta_index("keys"));
            for (key, got) in keys.iter().zip(windows(&c, b, 3)) {
                // A key names one window for good: never another window's steps.
                let first = *seen.entry(*key).or_insert(got.ids[0]);
                assert_eq!(first, got.ids[0], "key {key:#x} named two windows");
            }
        }
    }
    let stale: Vec<u64> = seen.keys().copied().collect();
    let live_before = stale.iter().filter(|&&k| table.priority(k).is_some()).count() as u64;
    let unknown = table.update_priorities(&stale, &vec![2.0; stale.len()]).unwrap();
    assert_eq!(unknown, stale.len() as u64 - live_before);
    assert!(unknown > 0, "most keys sampled early were evicted");
}

/// Steps of in-process streams 0..3 (episodes of 5..=13 steps, the last one left open) and of
/// one TCP client's stream (`1 << 32 | 4`), interleaved; the same calls give the same table.
/// Returns each stream's open episode and its next step's index.
fn fill_for_checkpoint(table: &SequenceTable) -> ([u64; 5], [u64; 5]) {
    let tcp = (1u64 << 32) | 4;
    let mut episode = [0u64; 5];
    let mut index = [0u64; 5];
    for n in 0..180u64 {
        let k = (n * 7 % 5) as usize;
        let stream = if k == 4 { tcp } else { k as u64 };
        let len = 5 + (k as u64 * 3 + episode[k] * 5) % 9;
        let last = index[k] + 1 == len && n < 160;
        let end = if last { EpisodeEnd::Terminated } else { EpisodeEnd::No };
        put(table, step_id(k as u64, episode[k], index[k]), stream, end);
        index[k] += 1;
        if last {
            episode[k] += 1;
            index[k] = 0;
        }
    }
    (episode, index)
}

fn drain_all(table: &Arc<SequenceTable>, length: usize) -> Vec<(u64, Got)> {
    let mut c = table.consumer().unwrap();
    let mut out = Vec::new();
    while table.stats().windows.size > 0 {
        let b = c.sample(Some(Instant::now() + common::PATIENCE)).unwrap();
        let keys = read_u64s(&c, b, meta_index("keys"));
        out.extend(keys.into_iter().zip(windows(&c, b, length)));
    }
    out.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    out
}

#[test]
fn a_checkpoint_restores_the_table_as_it_was_while_writers_go_on() {
    for codecs in CODECS {
        a_checkpoint_restores_the_table_with(codecs, false);
        if codecs.iter().any(Option::is_some) {
            a_checkpoint_restores_the_table_with(codecs, true);
        }
    }
}

/// With `packed`, the checkpoint hands out the compressed leaves as stored (one compressed
/// row per chunk) and the restore takes them so.
fn a_checkpoint_restores_the_table_with(codecs: [Option<Codec>; 2], packed: bool) {
    const LENGTH: usize = 4;
    let config = with_codecs(
        ReplayConfig {
            sampler: SamplerKind::Lifo,
            max_times_sampled: 1,
            seed: Some(9),
            ..ReplayConfig::new(1, 101)
        },
        codecs,
    );
    let sequence = SequenceConfig { period: 2, at_end: AtEnd::Pad, ..SequenceConfig::new(LENGTH) };
    let new = || SequenceTable::new(spec(), config.clone(), sequence).unwrap();
    let (live, reference) = (new(), new());
    fill_for_checkpoint(&live);
    let (episode, index) = fill_for_checkpoint(&reference);
    let (mut checkpoint, ()) = live.checkpoint_with(|| ()).unwrap();
    assert!(matches!(live.checkpoint_with(|| ()), Err(echo::EchoError::Busy(_))));
    // Writers go on before anything is copied: every chunk of the snapshot is evicted and
    // taken again (copy-on-write keeps the snapshot's bytes).
    for i in 0..400 {
        put(&live, step_id(9, 0, i), 9, EpisodeEnd::No);
    }
    let steps = checkpoint.snapshot().steps();
    if packed {
        checkpoint.keep_packed();
    }
    let mut leaves = [Vec::new(), Vec::new()];
    let mut out = vec![Vec::new(), Vec::new()];
    loop {
        let n = echo::checkpoint::Chunks::next_chunk(&mut checkpoint, 64, &mut out);
        if n == 0 {
            break;
        }
        for (all, part) in leaves.iter_mut().zip(&out) {
            all.extend_from_slice(part);
        }
    }
    if !packed || codecs[0].is_none() {
        assert_eq!(leaves[0].len(), steps * 8);
    }
    let lengths = checkpoint.packed_lengths().to_vec();
    assert_eq!(lengths.len(), if packed { codecs.iter().flatten().count() } else { 0 });
    assert!(lengths.iter().all(|l| l.len() == checkpoint.chunks()));
    let bytes = checkpoint.snapshot().encode();
    drop(checkpoint);
    let snapshot = SequenceSnapshot::decode(&bytes).unwrap();
    assert_eq!(&snapshot, &SequenceSnapshot::decode(&snapshot.encode()).unwrap());
    let restored = new();
    let mut lengths = lengths.iter();
    let leaf_rows: Vec<LeafRows<'_>> = leaves
        .iter()
        .zip(codecs)
        .map(|(bytes, codec)| match codec.filter(|_| packed) {
            Some(codec) => LeafRows::Packed { codec, bytes, lengths: lengths.next().unwrap() },
            None => LeafRows::Raw(bytes),
        })
        .collect();
    restored.restore(&snapshot, &leaf_rows, &[&[], &[]]).unwrap();
    // The TCP client's stream ends (truncated) at the restore; in-process ones stay open.
    assert!(reference.end_stream((1 << 32) | 4, EpisodeEnd::Truncated));
    let (a, b) = (restored.stats(), reference.stats());
    assert_eq!(
        (a.steps, a.streams_open, a.windows.size),
        (b.steps, b.streams_open, b.windows.size)
    );
    // Both go on alike: open in-process episodes continue across the checkpoint.
    for table in [&restored, &reference] {
        for i in 0..6 {
            put(table, step_id(0, episode[0], index[0] + i), 0, EpisodeEnd::No);
            let end = if i == 5 { EpisodeEnd::Truncated } else { EpisodeEnd::No };
            put(table, step_id(2, episode[2], index[2] + i), 2, end);
        }
    }
    restored.wait_packed();
    reference.wait_packed();
    let (mut a, mut b) = (restored.stats(), reference.stats());
    // Chunks packed at other moments compress alike but may differ by a few bytes (a chunk
    // the reference packed when its stream went away, the restore packs whole).
    if codecs.iter().any(Option::is_some) {
        assert!(
            a.windows.stored_bytes.abs_diff(b.windows.stored_bytes) < b.windows.stored_bytes / 4
        );
        (a.windows.stored_bytes, b.windows.stored_bytes) = (0, 0);
    }
    assert_eq!(a, b);
    let (got, expected) = (drain_all(&restored, LENGTH), drain_all(&reference, LENGTH));
    assert!(!expected.is_empty());
    assert_eq!(got, expected, "the same windows, keys, steps and flags");
}

#[test]
fn a_corrupt_snapshot_is_an_error_never_a_panic() {
    let config = ReplayConfig { seed: Some(1), ..ReplayConfig::new(2, 64) };
    let new = || SequenceTable::new(spec(), config.clone(), SequenceConfig::new(4)).unwrap();
    let table = new();
    let _ = fill_for_checkpoint(&table);
    let (mut checkpoint, ()) = table.checkpoint_with(|| ()).unwrap();
    let mut leaves = [Vec::new(), Vec::new()];
    let mut out = vec![Vec::new(), Vec::new()];
    while echo::checkpoint::Chunks::next_chunk(&mut checkpoint, 1 << 20, &mut out) > 0 {
        for (all, part) in leaves.iter_mut().zip(&out) {
            all.extend_from_slice(part);
        }
    }
    let bytes = checkpoint.snapshot().encode();
    let leaf_refs: Vec<LeafRows<'_>> = leaves.iter().map(|l| LeafRows::Raw(l)).collect();
    // Every truncation, and every byte flipped in turn (a few values each), fails cleanly or
    // restores a consistent table; none panics.
    for cut in 0..bytes.len() {
        assert!(SequenceSnapshot::decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    for at in (0..bytes.len()).step_by(3) {
        for value in [0u8, 1, 0xFF, bytes[at].wrapping_add(1)] {
            let mut bad = bytes.clone();
            bad[at] = value;
            let Ok(snapshot) = SequenceSnapshot::decode(&bad) else { continue };
            let fresh = new();
            if fresh.restore(&snapshot, &leaf_refs, &[&[], &[]]).is_ok() {
                // Whatever was accepted samples and takes steps without a panic.
                let mut c = fresh.consumer().unwrap();
                if fresh.stats().windows.size > 0 {
                    let _ = c.sample(Some(Instant::now() + Duration::from_millis(50)));
                }
                put(&fresh, step_id(0, 0, 0), 0, EpisodeEnd::Terminated);
            }
        }
    }
    assert!(new()
        .restore(&SequenceSnapshot::decode(&bytes).unwrap(), &leaf_refs[..1], &[&[], &[]])
        .is_err());
}

/// Every seed of the `sequence_snapshot` fuzz target (real snapshots, and the inputs it found
/// that once made a restore panic: an open stream claiming steps its chunks do not hold,
/// counters at the edge of overflowing) decodes and restores into a new table of its geometry,
/// or is refused; a restored table samples and takes steps; nothing panics.
#[test]
fn the_snapshot_fuzz_seeds_restore_or_are_refused_without_a_panic() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/sequence_snapshot");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        seen += 1;
        let Ok(snapshot) = SequenceSnapshot::decode(&bytes) else { continue };
        let spec = DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap();
        let config = ReplayConfig { seed: Some(1), ..ReplayConfig::new(2, 64) };
        let table = SequenceTable::new(spec, config, SequenceConfig::new(4)).unwrap();
        let steps = vec![0u8; snapshot.steps().min(1 << 16) * 8];
        if table.restore(&snapshot, &[LeafRows::Raw(&steps)], &[&[]]).is_err() {
            continue;
        }
        let mut consumer = table.consumer().unwrap();
        if table.stats().windows.size > 0 {
            consumer.sample(Some(Instant::now() + Duration::from_secs(1))).unwrap();
        }
        let step = 7u64.to_ne_bytes();
        let leaves = [&step[..]];
        let source = StepLeaves(&leaves, StepTag { stream: 0, end: EpisodeEnd::Terminated });
        table.insert(&source, None, Some(Instant::now() + common::PATIENCE)).unwrap();
    }
    assert!(seen >= 4, "the seeds are in {dir}");
}
