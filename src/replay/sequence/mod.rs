//! Sequence tables: steps of many streams go in one at a time, each stored once; the table
//! cuts *windows* of `length` consecutive steps of one episode and samples those, by
//! priority, uniformly or newest first, the way R2D2, Dreamer and n-step learners read replay.
//!
//! ```text
//!  writers (any thread)                           consumer (one SequenceConsumer)
//!  ───────────────────                            ───────────────────────────────
//!  lock; wait for the rate limiter                lock; draw windows (the limiter allows n)
//!  full (max_size steps)? evict the oldest chunk    pin every chunk a window's steps lie in
//!    and every window starting in it              unlock; copy each window's steps into the
//!  append the step to its stream's open chunk       batch area (one memcpy per chunk run),
//!    (a new chunk when it is full)                  zero its padding, write mask and metadata
//!  a window's `length` steps are in? publish it   lock; unpin; unlock
//!  episode end? pad / shift / drop what is left
//! ```
//!
//! **Storage.** Step slots are grouped in *chunks* of `chunk_length` consecutive slots. A
//! stream appends its steps to its own open chunk and takes a new one when it is full, so a
//! stream's steps are contiguous inside a chunk and a chunk links to the stream's next one:
//! a window is one to three contiguous runs of slots per leaf, and a batch is assembled with a
//! handful of `memcpy`s per window.
//!
//! **Compressed leaves** (`ReplayConfig::compress`) are stored per chunk, the unit that
//! compresses best (one stream's consecutive frames) and that is evicted whole: staged raw
//! in a per-chunk buffer while the chunk fills, packed (one compressed frame per leaf) once
//! it is full or its stream is gone, outside the lock, by background packer threads (or the
//! writer that filled it, when they are behind). Readers (a batch, a checkpoint, a packer)
//! hold a reference to the buffer they read, so a staging buffer is reused only when nobody
//! holds it; a batch decompresses each packed
//! chunk it reads once, on several threads when large. `max_bytes` evicts by stored bytes.
//!
//! **Eviction.** Chunks are evicted in the order they were taken (`live_chunks` is that
//! queue), whenever an insert would hold more than `max_size` steps or needs a chunk and none
//! is free. A window is registered in the chunk holding its first step (`windows` is keyed by
//! that step's slot), and a stream takes its chunks in order, so every chunk a window reaches
//! into was taken after the one it starts in: evicting a window's first chunk comes first, and
//! removes it. So a window never outlives any of its steps, with no per-window list of chunks.
//!
//! **Keys** are `(chunk generation << 32) | first slot`: a chunk's generation goes up when it
//! is evicted, so the key of an evicted window never names a later window in the same slot.
//!
//! Invariants (checked by the tests in this file and `tests/sequence.rs`):
//! 1. Every live window's steps are stored: its first chunk is live, and its steps run on
//!    through `next` links into chunks taken later (which are live while the first one is).
//! 2. A chunk the consumer copies from is pinned (`pins > 0`); an evicted pinned chunk is
//!    `Retired` and freed by the last unpin, so its bytes stay put while they are read.
//! 3. Stored steps (the `filled` of live chunks) never exceed `max_size`; at most
//!    `batch_size * max_runs` chunks are pinned, and the table has that many chunks beyond
//!    `ceil(max_size / chunk_length)`, so an insert always finds a free chunk after evicting.
//! 4. A stream's `next_start` is the next window start (a multiple of `period`) not yet made,
//!    at or after `retained_from`, the first step of its open episode that is still stored.
//! 5. While a [`SequenceCheckpoint`] lives, a chunk it has not copied yet keeps its snapshot
//!    bytes: only `take_chunk` hands a chunk out to be overwritten, and the writer that takes
//!    one the checkpoint still needs saves its bytes first, under the lock (copy-on-write).
//!    Appends to an open chunk go past its snapshot steps, which they never touch.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`SequenceTable`]: its construction, accessors, priorities, counters, the batch area's face |
//! | `config` | [`SequenceConfig`], [`AtEnd`], [`SEQUENCE_META`], [`SequenceStats`] |
//! | `state` | what the lock protects: chunks, streams, episodes, windows, draws |
//! | `insert` | appending steps and ending streams |
//! | `packing` | packing full chunks' compressed leaves, in the background or by the writer |
//! | `consumer` | [`SequenceConsumer`]: drawing windows and gathering them into the batch area |
//! | `snapshot` | checkpoints and restores |
//!
//! The waits, the close protocol, the consumer claim and the batch area are the table's
//! [`Shell`](super::shell::Shell), shared with the replay table.

use std::collections::{HashMap, VecDeque};

use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::replay::limiter::{InsertHoldback, RateLimiter};
use crate::replay::rng::Rng;
use crate::replay::select::{new_sampler, RemoverKind};
use crate::replay::shell::{check_priority, check_update, BatchCursor, Parked, Shell};
use crate::replay::table::ReplayConfig;
use crate::slots::Slots;
pub use crate::source::{EpisodeEnd, StepTag};
use crate::spec::{ArraySpec, DataSpec};
use crate::sync::{Arc, AsyncBell, Mutex};

mod config;
mod consumer;
mod insert;
mod packing;
mod snapshot;

pub use snapshot::{SequenceCheckpoint, SequenceSnapshot};
mod state;

pub use config::{AtEnd, SequenceConfig, SequenceStats, SEQUENCE_META};
pub use consumer::SequenceConsumer;
use packing::{pack_in_background, Packers, MAX_PACKERS};
use state::{Chunk, ChunkState, Compressed, Episode, Geometry, Packed, State, Stream, Window, NIL};

/// A sequence table. Create with [`SequenceTable::new`]; many writers
/// [`SequenceTable::insert`] steps, one [`SequenceConsumer`] samples windows.
pub struct SequenceTable {
    spec: DataSpec,
    config: ReplayConfig,
    sequence: SequenceConfig,
    geometry: Geometry,
    /// Every chunk's step slots, back to back (compressed leaves take no bytes here: they are
    /// staged per chunk, then packed).
    storage: Slots,
    /// Which leaves are compressed, per chunk of steps (the layout's shapes with the chunk's
    /// steps in front: it bounds what one packed leaf may hold).
    codecs: LeafCodecs,
    /// The compressed leaves, in order: a staging buffer's layout.
    staged_arrays: Box<[ArraySpec]>,
    /// Per leaf: its number among the compressed leaves, if it is one.
    packed_index: Box<[Option<usize>]>,
    /// Bytes of one step's leaves stored raw, and of all its leaves.
    fixed_bytes: u64,
    step_bytes: u64,
    /// `max_bytes`, `u64::MAX` when unbounded.
    max_bytes: u64,
    /// The most threads one batch decompresses on, or one insert's full chunks pack on.
    codec_threads: usize,
    /// With compressed leaves and more than one core: the background packers.
    packers: Option<Arc<Packers>>,
    state: Mutex<State>,
    /// The table's shell (the replay table's `shell`; `snapshot` reads it by this name): the
    /// waits (writers for the rate limiter, the consumer for windows), the close protocol,
    /// the consumer claim, and the batch area, two batches (halves) of windows: each leaf
    /// `length` steps long, then [`SEQUENCE_META`].
    shell: Shell,
}

impl std::fmt::Debug for SequenceTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceTable")
            .field("config", &self.config)
            .field("sequence", &self.sequence)
            .finish_non_exhaustive()
    }
}

impl SequenceTable {
    /// A table of `config.max_size` steps of `spec`, cut into windows as `sequence` says.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the bad parameter; [`EchoError::OutOfMemory`] if the
    /// storage cannot be allocated.
    pub fn new(
        spec: DataSpec,
        config: ReplayConfig,
        sequence: SequenceConfig,
    ) -> Result<Arc<Self>, EchoError> {
        let bad = |msg: String| Err(EchoError::Config(msg));
        let SequenceConfig { length, period, max_streams, .. } = sequence;
        if length < 1 {
            return bad(format!("Sequence(length) must be >= 1, got {length}"));
        }
        if period < 1 {
            return bad(format!("Sequence(period) must be >= 1, got {period}"));
        }
        if max_streams < 1 {
            return bad(format!("Sequence(max_streams) must be >= 1, got {max_streams}"));
        }
        if length > u32::MAX as usize / 4 || period > u32::MAX as usize / 4 {
            return bad(format!("Sequence: length and period must be below 2^30, got {length}"));
        }
        let (batch_size, max_size) = (config.batch_size, config.max_size);
        if batch_size < 1 {
            return bad(format!("batch_size must be >= 1, got {batch_size}"));
        }
        if max_size < length {
            return bad(format!(
                "max_size counts steps and must hold one window: >= length ({length}), got \
                 {max_size}"
            ));
        }
        if config.remover != RemoverKind::Fifo {
            return bad(
                "a sequence table evicts its oldest chunks of steps: remover must be Fifo()"
                    .to_owned(),
            );
        }
        config.rate_limit.validate(max_size as u64)?;
        config.sampler.check()?;
        let chunk_length = sequence.chunk_length(max_size);
        let step_bytes = spec.payload_size() as u64;
        if let Some(most) = config.max_bytes {
            let window = step_bytes.saturating_mul(length as u64);
            if most < window {
                return bad(format!(
                    "max_bytes must hold one window of raw steps, length ({length}) * \
                     {step_bytes} bytes = {window}, got {most}"
                ));
            }
        }
        let chunk_arrays = spec
            .arrays()
            .iter()
            .map(|a| {
                let shape = std::iter::once(chunk_length).chain(a.shape().iter().copied());
                ArraySpec::new(shape.collect(), a.dtype_size())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let codecs = if config.compress.is_empty() {
            LeafCodecs::none(&spec)
        } else {
            LeafCodecs::new(&DataSpec::new(chunk_arrays)?, config.compress.clone())
                .map_err(|e| EchoError::Config(format!("a chunk of {chunk_length} steps: {e}")))?
        };
        let mut packed_index = vec![None; spec.len()].into_boxed_slice();
        for (k, &leaf) in codecs.packed_leaves().iter().enumerate() {
            packed_index[leaf] = Some(k);
        }
        let staged_arrays: Box<[ArraySpec]> =
            codecs.packed_leaves().iter().map(|&leaf| spec.arrays()[leaf].clone()).collect();
        let stored_arrays = spec
            .arrays()
            .iter()
            .enumerate()
            .map(|(leaf, array)| match packed_index[leaf] {
                Some(_) => ArraySpec::new(vec![0], array.dtype_size()),
                None => Ok(array.clone()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fixed_bytes =
            step_bytes - staged_arrays.iter().map(|a| a.num_bytes() as u64).sum::<u64>();
        // Invariant 3: a window of `length` steps starting anywhere in a chunk spans at most
        // this many chunks, and a batch pins at most `batch_size` windows' worth.
        let max_runs = (length - 1).div_ceil(chunk_length) + 1;
        let chunks = batch_size
            .checked_mul(max_runs)
            .and_then(|spare| spare.checked_add(max_size.div_ceil(chunk_length) + 1))
            .filter(|&c| c.checked_mul(chunk_length).is_some_and(|s| s < u32::MAX as usize))
            .ok_or_else(|| {
                EchoError::Config(format!(
                    "max_size ({max_size}) + batch_size ({batch_size}) * {max_runs} chunks of \
                     {chunk_length} steps must stay below 2^32 - 1 slots"
                ))
            })?;
        let slots = chunks * chunk_length;
        let storage = Slots::of_arrays(&stored_arrays, slots)?;
        let mut area_arrays = Vec::with_capacity(spec.len() + SEQUENCE_META.len());
        for array in spec.arrays() {
            let shape = std::iter::once(length).chain(array.shape().iter().copied()).collect();
            area_arrays.push(ArraySpec::new(shape, array.dtype_size())?);
        }
        for meta in SEQUENCE_META {
            let shape = if meta.per_step { vec![length] } else { Vec::new() };
            area_arrays.push(ArraySpec::new(shape, meta.bytes)?);
        }
        let area = Slots::new(&DataSpec::new(area_arrays)?, 2 * batch_size)?;
        let max_bytes = config.max_bytes.unwrap_or(u64::MAX);
        let geometry = Geometry {
            length,
            period,
            at_end: sequence.at_end,
            max_size,
            chunk_length,
            max_times_sampled: config.max_times_sampled,
        };
        let state = State {
            chunks: vec![Chunk::FREE; chunks].into_boxed_slice(),
            free_chunks: (0..chunks as u32).rev().collect(),
            live_chunks: VecDeque::with_capacity(chunks),
            step_priority: vec![0; slots].into_boxed_slice(),
            windows: {
                // Room for a window per `period` steps: more only with many short episodes.
                let mut map = HashMap::default();
                map.reserve(slots / period + 1);
                map
            },
            streams: Vec::new(),
            free_streams: Vec::new(),
            stream_index: HashMap::new(),
            episodes: HashMap::new(),
            sampler: new_sampler(config.sampler, slots, batch_size)?,
            limiter: RateLimiter::new(config.rate_limit),
            rng: config.seed.map_or_else(Rng::from_entropy, Rng::from_seed),
            draw_slots: vec![0; batch_size].into_boxed_slice(),
            draw_probabilities: vec![0.0; batch_size].into_boxed_slice(),
            live_windows: 0,
            steps: 0,
            next_episode: 0,
            max_priority: 1.0,
            stats: SequenceStats::default(),
            parked: Parked::default(),
            cow: None,
            stored_bytes: 0,
            staged: vec![None; chunks].into_boxed_slice(),
            packed: vec![None; chunks].into_boxed_slice(),
            spare_staged: Vec::new(),
            to_pack: Vec::new(),
        };
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let packer_threads = if codecs.is_empty() { 0 } else { (cores - 1).min(MAX_PACKERS) };
        let packers = (packer_threads > 0)
            .then(|| Arc::new(Packers { threads: packer_threads, ..Packers::default() }));
        let shell = Shell::new(config.rate_limit, batch_size, area);
        let table = Arc::new(Self {
            spec,
            config,
            sequence,
            geometry,
            storage,
            codecs,
            staged_arrays,
            packed_index,
            fixed_bytes,
            step_bytes,
            max_bytes,
            codec_threads: cores.min(8),
            packers,
            state: Mutex::new(state),
            shell,
        });
        if let Some(packers) = &table.packers {
            for i in 0..packers.threads {
                let (packers, weak) = (Arc::clone(packers), Arc::downgrade(&table));
                std::thread::Builder::new()
                    .name(format!("echo-pack-{i}"))
                    .spawn(move || pack_in_background(&packers, &weak))
                    .map_err(|e| EchoError::Config(format!("cannot start a packer thread: {e}")))?;
            }
        }
        Ok(table)
    }

    /// The replay settings (`max_size` in steps, the rest in windows).
    pub fn config(&self) -> &ReplayConfig {
        &self.config
    }

    /// Where the server's policy versions are set, once, when it keeps them.
    pub(crate) fn versions_cell(
        &self,
    ) -> &std::sync::OnceLock<std::sync::Arc<crate::versions::PolicyVersions>> {
        &self.shell.versions
    }

    /// How windows are cut.
    pub fn sequence(&self) -> &SequenceConfig {
        &self.sequence
    }

    /// The step layout.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// Steps per chunk (consecutive steps of one stream stored together).
    pub fn chunk_length(&self) -> usize {
        self.geometry.chunk_length
    }

    /// The single consumer handle; `None` if one was already taken.
    pub fn consumer(self: &Arc<Self>) -> Option<SequenceConsumer> {
        if !self.shell.claim_consumer() {
            return None;
        }
        Some(SequenceConsumer {
            table: Arc::clone(self),
            pending: Vec::with_capacity(self.config.batch_size),
            runs: Vec::new(),
            cursor: BatchCursor::default(),
            holdback: None,
        })
    }

    /// Closes the table: waiting and future inserts fail with `Closed`, `sample` returns
    /// [`EchoError::Closed`]. Idempotent.
    pub fn close(&self) {
        self.shell.close(&self.state.lock());
    }

    /// Whether [`SequenceTable::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.shell.is_closed()
    }

    /// Rung whenever a waiting insert might now go further (see `Backend::insert_bell`).
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn insert_bell(&self) -> &AsyncBell {
        self.shell.insert_bell()
    }

    fn check_priority(state: &State, priority: f64) -> Result<(), String> {
        check_priority(&*state.sampler, priority)
    }

    /// Checks one priority as an insert or an update would.
    ///
    /// # Errors
    /// [`EchoError::Priority`] saying what is wrong with it.
    pub fn check_one_priority(&self, priority: f64) -> Result<(), EchoError> {
        let state = self.state.lock();
        Self::check_priority(&state, priority)
            .map_err(|msg| EchoError::Priority(format!("priority {msg}")))
    }

    /// Sets the priority of every window in `keys` that is still in the table; keys of
    /// evicted or removed windows are skipped and counted. Returns the number skipped.
    ///
    /// # Errors
    /// [`EchoError::Priority`] (nothing changed) if the lengths differ or a priority is
    /// invalid, naming its index.
    pub fn update_priorities(&self, keys: &[u64], priorities: &[f64]) -> Result<u64, EchoError> {
        let mut state = self.state.lock();
        check_update(&*state.sampler, keys, priorities)?;
        let mut unknown = 0;
        for (&key, &priority) in keys.iter().zip(priorities) {
            let Some(slot) = state.window_of_key(&self.geometry, key) else {
                unknown += 1;
                continue;
            };
            state.windows.get_mut(&(slot as u32)).expect("a live window").priority = priority;
            state.sampler.update(slot, priority);
            state.max_priority = state.max_priority.max(priority);
        }
        state.stats.windows.priority_updates += keys.len() as u64 - unknown;
        state.stats.windows.unknown_keys += unknown;
        Ok(unknown)
    }

    /// The priority of the window `key`, `None` if it is not in the table.
    pub fn priority(&self, key: u64) -> Option<f64> {
        let state = self.state.lock();
        state.window_of_key(&self.geometry, key).map(|slot| state.windows[&(slot as u32)].priority)
    }

    /// About what one stream costs this table's memory while it exists: its state, its last
    /// `length` steps' slots, and its share of the maps and vectors that find it (with their
    /// growth slack). A TCP or shared-memory connection holds this much of the ingress's byte
    /// budget for every row it has used, until its streams end.
    pub fn stream_cost(&self) -> usize {
        2 * (std::mem::size_of::<state::Stream>() + 4 * self.geometry.length) + 128
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SequenceStats {
        let state = self.state.lock();
        let mut stats = state.stats;
        stats.windows.size = state.live_windows as u64;
        stats.windows.insert_blocked_ns += self.shell.insert_blocked_outside_ns.get();
        stats.steps = state.steps as u64;
        stats.windows.stored_bytes = state.stored_bytes;
        stats.windows.raw_bytes = stats.steps * self.step_bytes;
        stats
    }

    /// Adds `ns` to the windows' `insert_blocked_ns`: an insert that does not wait was
    /// refused and its caller waited that long outside the table before trying again (see
    /// `Backend::note_insert_blocked`). Never takes the lock.
    pub fn note_insert_blocked(&self, ns: u64) {
        self.shell.note_insert_blocked(ns);
    }

    /// The limiter and its counters now (over windows), for the message of an insert that
    /// timed out.
    pub fn insert_holdback(&self) -> InsertHoldback {
        let state = self.state.lock();
        self.shell.insert_holdback(&state.limiter, state.live_windows as u64)
    }

    /// Writers parked on the rate limiter right now.
    pub fn waiting_inserts(&self) -> u64 {
        self.state.lock().parked.inserts
    }

    /// 1 while the consumer is parked in `sample`.
    pub fn waiting_samples(&self) -> u64 {
        self.state.lock().parked.samples
    }

    /// Address of the first byte of `leaf` in batch-area half `half`: `batch_size` windows
    /// back to back. Leaves `spec.len()..` are the [`SEQUENCE_META`] values.
    pub fn batch_ptr(&self, half: usize, leaf: usize) -> *const u8 {
        self.shell.batch_ptr(half, leaf)
    }

    /// Page-locks the batch area with `cudaHostRegister`. Idempotent.
    ///
    /// # Errors
    /// [`EchoError::Io`] saying what is missing or which CUDA call failed.
    ///
    /// # Safety
    /// Every path in `cuda_runtimes` must be a CUDA runtime library (loading runs its code).
    pub unsafe fn pin_host_memory(
        &self,
        cuda_runtimes: &[std::path::PathBuf],
    ) -> Result<(), EchoError> {
        // SAFETY: the caller vouches for the libraries, as this function's contract asks.
        unsafe { self.shell.pin_host_memory(cuda_runtimes) }
    }

    /// Whether the batch area is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.shell.is_pinned()
    }

    /// Which leaves are stored compressed (`None`: no codec per leaf).
    pub fn codecs(&self) -> &LeafCodecs {
        &self.codecs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Leaves;
    use crate::source::SampleSource;
    use std::time::Instant;

    /// One leaf: the step's id (u64).
    fn spec() -> DataSpec {
        DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap()
    }

    struct Step<'a> {
        leaves: Leaves<'a>,
        tag: StepTag,
    }

    impl SampleSource for Step<'_> {
        fn num_samples(&self) -> usize {
            1
        }
        fn num_leaves(&self, _: usize) -> usize {
            self.leaves.0.len()
        }
        fn leaf(&self, _: usize, leaf: usize) -> &[u8] {
            self.leaves.0[leaf]
        }
        fn step(&self, _: usize) -> StepTag {
            self.tag
        }
    }

    fn put(t: &SequenceTable, stream: u64, id: u64, end: EpisodeEnd) {
        let bytes = id.to_ne_bytes();
        let slices = [&bytes[..]];
        let step = Step { leaves: Leaves(&slices), tag: StepTag { stream, end } };
        t.insert(&step, None, None).unwrap();
    }

    fn table(batch: usize, max_size: usize, seq: SequenceConfig) -> Arc<SequenceTable> {
        let config = ReplayConfig { seed: Some(7), ..ReplayConfig::new(batch, max_size) };
        SequenceTable::new(spec(), config, seq).unwrap()
    }

    /// Every window of a batch: (ids of its real steps, mask, start, episode).
    fn windows(c: &mut SequenceConsumer) -> Vec<(Vec<u64>, Vec<bool>, u32, u64)> {
        let b = c.sample(Some(Instant::now() + std::time::Duration::from_secs(5))).unwrap();
        let t = c.table.geometry.length;
        let n = c.table.config.batch_size;
        let ids: Vec<u64> = c.read_leaf(b, 0, |bytes| {
            bytes.chunks_exact(8).map(|x| u64::from_ne_bytes(x.try_into().unwrap())).collect()
        });
        let mask: Vec<bool> =
            c.read_leaf(b, 1 + 3, |bytes| bytes.iter().map(|&x| x == 1).collect());
        let start: Vec<u32> = c.read_leaf(b, 1 + 5, |bytes| {
            bytes.chunks_exact(4).map(|x| u32::from_ne_bytes(x.try_into().unwrap())).collect()
        });
        let episode: Vec<u64> = c.read_leaf(b, 1 + 4, |bytes| {
            bytes.chunks_exact(8).map(|x| u64::from_ne_bytes(x.try_into().unwrap())).collect()
        });
        (0..n)
            .map(|i| {
                let m = mask[i * t..(i + 1) * t].to_vec();
                let real = m.iter().filter(|&&x| x).count();
                (ids[i * t..i * t + real].to_vec(), m, start[i], episode[i])
            })
            .collect()
    }

    #[test]
    fn config_errors_name_the_parameter() {
        let err = |seq: SequenceConfig, max_size: usize| {
            SequenceTable::new(spec(), ReplayConfig::new(2, max_size), seq).unwrap_err().to_string()
        };
        assert!(err(SequenceConfig::new(0), 10).contains("Sequence(length) must be >= 1, got 0"));
        let p0 = SequenceConfig { period: 0, ..SequenceConfig::new(4) };
        assert!(err(p0, 10).contains("Sequence(period) must be >= 1, got 0"));
        assert!(err(SequenceConfig::new(8), 5).contains(">= length (8), got 5"));
        let mut c = ReplayConfig::new(2, 10);
        c.remover = RemoverKind::MinPriority;
        let e = SequenceTable::new(spec(), c, SequenceConfig::new(2)).unwrap_err().to_string();
        assert!(e.contains("remover must be Fifo()"), "{e}");
    }

    #[test]
    fn windows_start_every_period_and_hold_consecutive_steps() {
        let seq = SequenceConfig { period: 2, at_end: AtEnd::Drop, ..SequenceConfig::new(4) };
        let t = table(8, 100, seq);
        for id in 0..9 {
            put(&t, 0, id, EpisodeEnd::No);
        }
        // Starts 0, 2, 4 are complete (4 + 4 <= 9); 6 is not.
        assert_eq!(t.stats().windows.size, 3);
        let mut c = t.consumer().unwrap();
        for (ids, mask, start, _) in windows(&mut c) {
            assert_eq!(ids, (u64::from(start)..u64::from(start) + 4).collect::<Vec<_>>());
            assert!(mask.iter().all(|&m| m));
            assert!([0, 2, 4].contains(&start));
        }
    }

    #[test]
    fn at_end_pad_shift_drop() {
        // An episode of 7 steps, windows of 4 every 2: whole windows at 0 and 2 (steps 0-3,
        // 2-5); start 4 and 6 would run past the end.
        let cases = [
            (AtEnd::Pad, vec![(0, 4), (2, 4), (4, 3), (6, 1)]),
            (AtEnd::Shift, vec![(0, 4), (2, 4), (3, 4)]),
            (AtEnd::Drop, vec![(0, 4), (2, 4)]),
        ];
        for (at_end, expected) in cases {
            let seq = SequenceConfig { period: 2, at_end, ..SequenceConfig::new(4) };
            let t = table(64, 100, seq);
            for id in 0..7 {
                let end = if id == 6 { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                put(&t, 3, id, end);
            }
            assert_eq!(t.stats().windows.size, expected.len() as u64, "{at_end:?}");
            let mut c = t.consumer().unwrap();
            let mut seen: Vec<(u32, usize)> = Vec::new();
            for (ids, mask, start, _) in windows(&mut c) {
                let len = ids.len();
                assert_eq!(
                    ids,
                    (u64::from(start)..u64::from(start) + len as u64).collect::<Vec<_>>()
                );
                assert_eq!(mask.iter().filter(|&&m| m).count(), len);
                assert!(mask[..len].iter().all(|&m| m) && mask[len..].iter().all(|&m| !m));
                seen.push((start, len));
            }
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen, expected, "{at_end:?}: every window drawn in 64 draws of 2-4");
        }
    }

    #[test]
    fn short_episodes_follow_the_same_rule() {
        for (at_end, windows_made) in [(AtEnd::Pad, 1), (AtEnd::Shift, 1), (AtEnd::Drop, 0)] {
            let seq = SequenceConfig { at_end, ..SequenceConfig::new(5) };
            let t = table(2, 50, seq);
            put(&t, 0, 10, EpisodeEnd::No);
            put(&t, 0, 11, EpisodeEnd::Truncated);
            let stats = t.stats();
            assert_eq!(stats.windows.size, windows_made, "{at_end:?}");
            assert_eq!((stats.episodes_ended, stats.streams_open), (1, 0));
        }
    }

    #[test]
    fn interleaved_streams_never_mix() {
        let seq = SequenceConfig { period: 3, ..SequenceConfig::new(5) };
        let t = table(32, 1000, seq);
        // Stream s sends ids s * 1000 + i, episodes of 11 steps.
        for i in 0..40u64 {
            for s in 0..4u64 {
                let end = if i % 11 == 10 { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                put(&t, s, s * 1000 + i, end);
            }
        }
        let mut c = t.consumer().unwrap();
        for _ in 0..20 {
            for (ids, _, start, _) in windows(&mut c) {
                let stream = ids[0] / 1000;
                let first = ids[0] % 1000;
                assert_eq!(first % 11, u64::from(start), "start is the index in the episode");
                for (j, id) in ids.iter().enumerate() {
                    assert_eq!(*id, stream * 1000 + first + j as u64);
                    assert_eq!((first + j as u64) / 11, first / 11, "one episode");
                }
            }
        }
    }

    #[test]
    fn eviction_removes_every_window_with_an_evicted_step() {
        // max_size 23 (prime), chunks of min(4, 6) = 4 steps, one stream, no episode ends.
        let seq = SequenceConfig { period: 1, ..SequenceConfig::new(4) };
        let t = table(4, 23, seq);
        assert_eq!(t.chunk_length(), 4);
        let mut c = t.consumer().unwrap();
        for id in 0..500u64 {
            put(&t, 0, id, EpisodeEnd::No);
            let stats = t.stats();
            assert!(stats.steps <= 23, "stored {} > max_size", stats.steps);
            if stats.windows.size > 0 && id % 7 == 0 {
                for (ids, _, _, _) in windows(&mut c) {
                    assert_eq!(ids.len(), 4);
                    // Everything stored is at most 23 steps old, and a window's steps are.
                    assert!(ids[0] + 23 > id, "window {ids:?} holds an evicted step at {id}");
                    assert_eq!(ids[3], ids[0] + 3);
                }
            }
        }
        assert!(t.stats().windows.evicted > 0);
    }

    /// Inserts 3,000 steps of `streams` streams (one episode each, never ended), each to a
    /// stream drawn with a skew (stream k about k + 1 times as often as stream 0), into a
    /// table of `max_size` 256 and chunks of 8; after each insert once full, checks the
    /// bounds the sequences guide gives for eviction by chunk (C = 8, S = `streams`): every
    /// step held is among the newest `max_size + (S - 1)(C - 1)`, at most `S(C - 1)` of the
    /// newest `max_size` are gone, and at least `max_size - C + 1` steps are held.
    fn eviction_by_chunk_stays_within_its_bounds(streams: u64) {
        const MAX_SIZE: usize = 256;
        const C: usize = 8;
        let t = table(1, MAX_SIZE, SequenceConfig::new(C));
        assert_eq!(t.geometry.chunk_length, C);
        let s = usize::try_from(streams).unwrap();
        let (mut ids, mut counts) = (HashMap::new(), vec![0u32; s]);
        let mut rng = 0x9e37_79b9_u64;
        for n in 0..3_000u64 {
            rng =
                rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let weights = s * (s + 1) / 2;
            let mut pick = usize::try_from(rng >> 33).unwrap() % weights;
            let mut stream = 0;
            while pick > stream {
                pick -= stream + 1;
                stream += 1;
            }
            ids.insert((stream as u64, counts[stream]), n);
            counts[stream] += 1;
            put(&t, stream as u64, n, EpisodeEnd::No);
            let inserted = usize::try_from(n).unwrap() + 1;
            if inserted < MAX_SIZE {
                continue;
            }
            let state = t.state.lock();
            let mut held = Vec::new();
            for &c in &state.live_chunks {
                let chunk = state.chunks[c as usize];
                for index in chunk.last_index + 1 - chunk.filled..=chunk.last_index {
                    held.push(ids[&(chunk.stream, index)]);
                }
            }
            drop(state);
            let oldest = *held.iter().min().unwrap();
            let newest_kept = held.iter().filter(|&&id| id >= n + 1 - MAX_SIZE as u64).count();
            assert!((MAX_SIZE - C + 1..=MAX_SIZE).contains(&held.len()), "{}", held.len());
            assert!(n - oldest < (MAX_SIZE + (s - 1) * (C - 1)) as u64, "{n}: {oldest}");
            assert!(MAX_SIZE - newest_kept <= s * (C - 1), "{n}: {newest_kept} of the newest");
            if s == 1 {
                // One stream: exactly its newest steps.
                assert_eq!(n - oldest + 1, held.len() as u64);
            }
        }
        assert!(t.stats().steps_evicted > 0);
    }

    #[test]
    fn eviction_by_chunk_keeps_one_streams_newest_steps() {
        eviction_by_chunk_stays_within_its_bounds(1);
    }

    #[test]
    fn eviction_by_chunk_stays_within_its_bounds_for_many_streams() {
        eviction_by_chunk_stays_within_its_bounds(4);
    }

    #[test]
    fn a_stream_keeps_its_chunk_across_episodes() {
        // 100 episodes of 3 steps on one stream: chunks fill up across episode ends, so the
        // table holds as many steps as it may (it evicts a whole chunk, 8, at a time).
        let t = table(2, 64, SequenceConfig::new(8));
        for e in 0..100u64 {
            for i in 0..3 {
                let end = if i == 2 { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                put(&t, 0, e * 3 + i, end);
            }
        }
        let stats = t.stats();
        assert!(stats.steps >= 64 - 8, "{stats:?}");
        assert_eq!((stats.episodes_ended, stats.streams_open), (100, 0));
    }

    #[test]
    fn stale_keys_are_ignored_and_counted() {
        let seq = SequenceConfig::new(2);
        let t = table(1, 8, seq);
        let mut c = t.consumer().unwrap();
        put(&t, 0, 0, EpisodeEnd::No);
        put(&t, 0, 1, EpisodeEnd::No);
        let b = c.sample(None).unwrap();
        let key = c.read_leaf(b, 1, |k| u64::from_ne_bytes(k.try_into().unwrap()));
        assert_eq!(t.priority(key), Some(1.0));
        assert_eq!(t.update_priorities(&[key], &[3.0]).unwrap(), 0);
        assert_eq!(t.priority(key), Some(3.0));
        for id in 2..40 {
            put(&t, 0, id, EpisodeEnd::No);
        }
        assert_eq!(t.priority(key), None, "its steps were evicted");
        assert_eq!(t.update_priorities(&[key, key + 1], &[5.0, 5.0]).unwrap(), 2);
        assert_eq!(t.stats().windows.unknown_keys, 2);
        // A new window later in the same slot has another key.
        for _ in 0..10 {
            let b = c.sample(None).unwrap();
            let k = c.read_leaf(b, 1, |k| u64::from_ne_bytes(k.try_into().unwrap()));
            assert_ne!(k, key);
        }
    }

    #[test]
    fn a_window_priority_is_the_max_of_its_steps_priorities() {
        let seq = SequenceConfig::new(3);
        let t = table(1, 30, seq);
        let mut c = t.consumer().unwrap();
        for (id, p) in [(0u64, Some(0.5)), (1, None), (2, Some(2.5))] {
            let bytes = id.to_ne_bytes();
            let slices = [&bytes[..]];
            let step = Step { leaves: Leaves(&slices), tag: StepTag::default() };
            t.insert(&step, p, None).unwrap();
        }
        let b = c.sample(None).unwrap();
        let key = c.read_leaf(b, 1, |k| u64::from_ne_bytes(k.try_into().unwrap()));
        assert_eq!(t.priority(key), Some(2.5));
    }

    #[test]
    fn a_gone_stream_is_truncated_and_its_windows_stay() {
        let seq = SequenceConfig { at_end: AtEnd::Pad, ..SequenceConfig::new(4) };
        let t = table(4, 40, seq);
        for id in 0..6 {
            put(&t, 9, id, EpisodeEnd::No);
        }
        assert_eq!(t.stats().windows.size, 1);
        assert!(t.end_stream(9, EpisodeEnd::Truncated));
        assert!(!t.end_stream(9, EpisodeEnd::Truncated), "no open episode any more");
        let stats = t.stats();
        assert_eq!((stats.windows.size, stats.streams_open, stats.episodes_ended), (2, 0, 1));
        let mut c = t.consumer().unwrap();
        let b = c.sample(None).unwrap();
        let truncated = c.read_leaf(b, 1 + 8, <[u8]>::to_vec);
        let terminated = c.read_leaf(b, 1 + 7, <[u8]>::to_vec);
        assert!(truncated.iter().all(|&x| x == 1) && terminated.iter().all(|&x| x == 0));
    }

    #[test]
    fn the_memory_of_ended_streams_is_given_back() {
        // 1,000 streams of a connection's range, then ended together: their slots, last
        // steps and index entries are freed, not kept for streams that may never come.
        let t = table(4, 4096, SequenceConfig { max_streams: 1 << 20, ..SequenceConfig::new(4) });
        let base = 7u64 << 32;
        for row in 0..1000 {
            put(&t, base | row, row, EpisodeEnd::No);
        }
        put(&t, 3, 5000, EpisodeEnd::No); // another producer's stream, which stays
        assert_eq!(t.stats().streams_open, 1001);
        assert_eq!(t.end_streams_in(base..=base | 999, EpisodeEnd::Truncated), 1000);
        let state = t.state.lock();
        assert_eq!(state.streams.len(), 1, "only the stream still open keeps a slot");
        assert!(state.free_streams.is_empty());
        assert_eq!(state.stream_index.get(&3), Some(&0));
        drop(state);
        put(&t, 3, 5001, EpisodeEnd::No);
        put(&t, base, 6000, EpisodeEnd::No); // a new stream after the shrink
        assert_eq!(t.stats().streams_open, 2);
    }
}
