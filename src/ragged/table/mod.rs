//! The ragged table: samples with variable-length leaves, stored without padding in an
//! arena of blocks, handed out FIFO (each once, in order) or drawn for replay (uniform or
//! prioritized), in *entries*: a sample, or a group of samples inserted together, which a
//! batch always holds whole and eviction always removes whole.
//!
//! One mutex guards the bookkeeping (the arena's blocks, the entries, the order). Inserts
//! copy their bytes under it: a sample of a few kilobytes costs a microsecond there. A batch
//! is copied out with the lock released: a FIFO batch's entries are the consumer's until its
//! next `sample`, a replay batch's blocks are pinned until the copy is done, so no writer can
//! be handed their bytes meanwhile.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::arena::{Arena, ArenaMemory, Extent};
use super::batch::{self, BatchLayout, BufPool, Picked, RaggedBatch};
use super::spec::RaggedSpec;
use crate::codec::Codec;
use crate::error::EchoError;
use crate::replay::rng::Rng;
use crate::replay::sumtree::SumTree;
use crate::versions::{PolicyVersions, VersionsConfig, VERSION_BYTES};

mod insert;
pub use insert::{GroupSource, SampleIn, DROPPED};

/// How batches are made.
#[derive(Debug, Clone, PartialEq)]
pub enum RaggedSampler {
    /// Each entry handed out once, in insertion order; writers wait while the table is full.
    Fifo,
    /// Replay: entries drawn uniformly, with replacement; the oldest evicted when full.
    Uniform,
    /// Replay: entries drawn with probability proportional to `priority ^ exponent`.
    Prioritized {
        /// The exponent (alpha); 0 is uniform.
        exponent: f64,
    },
}

/// A ragged table's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RaggedConfig {
    /// FIFO or a replay sampler.
    pub sampler: RaggedSampler,
    /// The most samples a batch holds (exactly this many without a token budget or groups).
    pub batch_size: usize,
    /// The most samples the table holds.
    pub max_size: usize,
    /// The bytes of the arena that holds every leaf's values. `None`: `max_size` samples of
    /// the largest possible size, at most [`DEFAULT_MAX_BYTES`] (the memory is only taken as
    /// it is written).
    pub max_bytes: Option<usize>,
    /// A token budget: (length group, rows). A batch closes before the entry that would take
    /// the group's rows past it.
    pub batch_tokens: Option<(usize, usize)>,
    /// Replay: samples the table must hold before the first draw.
    pub min_size: usize,
    /// Replay: remove an entry after this many draws (0: never).
    pub max_times_sampled: u32,
    /// Replay: the random sequence's seed (`None`: a fresh one).
    pub seed: Option<u64>,
    /// Per leaf, the codec it is stored with (`None`: raw); empty: every leaf raw. Each
    /// sample's bytes of such a leaf are compressed on the inserting thread and decompressed
    /// into each batch (never handed out as a view).
    pub codecs: Vec<Option<Codec>>,
    /// Policy versions: the spec's last leaf is each sample's version (a fixed 8-byte
    /// little-endian `u64`), and with a bound a sample more than `max_staleness` versions
    /// behind the latest never reaches the learner ([`crate::versions`]). `None`: none kept.
    pub versions: Option<VersionsConfig>,
}

/// The default arena's largest size.
pub const DEFAULT_MAX_BYTES: usize = 4 << 30;

/// Counters of a ragged table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RaggedStats {
    /// Samples stored now (FIFO: not yet handed out).
    pub samples: usize,
    /// Entries (samples and groups) stored now.
    pub entries: usize,
    /// Samples inserted.
    pub inserted: u64,
    /// Groups of more than one sample inserted.
    pub groups_inserted: u64,
    /// Batches handed out.
    pub batches: u64,
    /// Samples handed out in batches (a sample drawn twice counts twice).
    pub sampled: u64,
    /// Samples evicted to make room (replay).
    pub evicted: u64,
    /// Samples removed after `max_times_sampled` draws.
    pub removed_max_times_sampled: u64,
    /// Bytes of the stored values as stored (compressed leaves compressed).
    pub payload_bytes: usize,
    /// Bytes of the stored values uncompressed (the payload).
    pub raw_bytes: usize,
    /// Bytes of the arena's blocks in use (payload, partly filled blocks, block tails).
    pub arena_bytes_in_use: usize,
    /// Bytes the arena spans.
    pub arena_capacity: usize,
    /// Nanoseconds inserts waited for room.
    pub insert_blocked_ns: u64,
}

/// Every stored entry of a table, from [`RaggedTable::export`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RaggedExport {
    /// Per leaf, every stored sample's bytes one after another, oldest first.
    pub values: Vec<Vec<u8>>,
    /// Per sample per leaf (sample-major), its rows (fixed leaves: 1).
    pub rows: Vec<usize>,
    /// Per entry, its samples (1, or a group's size).
    pub group_sizes: Vec<usize>,
    /// Per entry, its priority.
    pub priorities: Vec<f64>,
    /// Per entry, its draws so far.
    pub times_sampled: Vec<u32>,
}

#[derive(Debug)]
struct Entry {
    key: u64,
    slots: Vec<u32>,
    budget_rows: usize,
    times_sampled: u32,
    /// Its values' uncompressed bytes.
    raw_bytes: usize,
    /// Replay: where the entry sits in `State::live`.
    live_at: usize,
    priority: f64,
    /// The oldest policy version among its samples (0 when the table keeps none).
    version: u64,
}

#[derive(Debug)]
struct State {
    arena: Arena,
    columns: usize,
    /// `slot * columns + column`.
    extents: Vec<Extent>,
    rows: Vec<u32>,
    /// Slots given back, reused first; slots from `extents.len() / columns` on were never
    /// used (the per-slot arrays grow as the table first fills, so a large `max_size` costs
    /// memory only once used).
    free_slots: Vec<u32>,
    entries: Vec<Option<Entry>>,
    /// Entry ids given back; ids from `entries.len()` on were never used.
    free_entries: Vec<u32>,
    /// (entry, key) oldest first; pairs whose entry is gone are skipped.
    order: VecDeque<(u32, u64)>,
    /// Replay: the live entries, for uniform draws.
    live: Vec<u32>,
    tree: Option<SumTree>,
    max_priority: f64,
    /// FIFO: the entries of the batch the consumer holds.
    held: Vec<u32>,
    rng: Rng,
    next_key: u64,
    closed: bool,
    /// Closed, and the FIFO consumer still gets what is left.
    draining: bool,
    writers_waiting: usize,
    /// The consumer waits on `filled`.
    consumer_waiting: bool,
    pins: usize,
    /// Uncompressed bytes of the live entries.
    raw_bytes: usize,
    stats: RaggedStats,
}

impl State {
    /// Slots an insert can take now, of `max_size`.
    fn slots_free(&self, max_size: usize) -> usize {
        self.free_slots.len() + (max_size - self.extents.len() / self.columns)
    }

    /// A free slot: one given back, or a fresh one (its per-slot arrays grown).
    fn take_slot(&mut self) -> u32 {
        if let Some(slot) = self.free_slots.pop() {
            return slot;
        }
        let slot = (self.extents.len() / self.columns) as u32;
        self.extents.extend(std::iter::repeat_n(Extent::NONE, self.columns));
        self.rows.extend(std::iter::repeat_n(0, self.columns));
        slot
    }
}

/// The table. Shared (`Arc`) between the writers and the one consumer.
#[derive(Debug)]
pub struct RaggedTable {
    spec: RaggedSpec,
    config: RaggedConfig,
    state: Mutex<State>,
    /// Writers wait here for room (and a draw's pins to go).
    space: Condvar,
    /// The consumer waits here for a batch.
    filled: Condvar,
    memory: std::sync::Arc<ArenaMemory>,
    pool: std::sync::Arc<BufPool>,
    versions: Option<std::sync::Arc<PolicyVersions>>,
}

/// Waits for a change, or until `deadline`. The callers check their condition, then whether
/// the deadline passed, then wait: so a change that comes with the deadline is still seen.
fn wait(cond: &Condvar, guard: &mut MutexGuard<'_, State>, deadline: Option<Instant>) {
    match deadline {
        None => cond.wait(guard),
        Some(at) => {
            let _ = cond.wait_until(guard, at);
        }
    }
}

fn passed(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|at| Instant::now() >= at)
}

impl RaggedTable {
    /// A table of `spec` samples.
    ///
    /// # Errors
    /// [`EchoError::Config`] for an out-of-range setting (a zero batch or size, a batch
    /// larger than the table, a token budget below one row, a negative exponent, an arena too
    /// small); [`EchoError::OutOfMemory`] if the arena cannot be mapped.
    pub fn new(spec: RaggedSpec, config: RaggedConfig) -> Result<Self, EchoError> {
        if config.batch_size == 0 || config.max_size == 0 {
            return Err(EchoError::Config("batch_size and max_size must be at least 1".into()));
        }
        if config.max_size > u32::MAX as usize / 2 {
            return Err(EchoError::Config(format!("max_size {} is too large", config.max_size)));
        }
        let fifo = config.sampler == RaggedSampler::Fifo;
        if fifo && config.max_size < config.batch_size {
            return Err(EchoError::Config(format!(
                "the table holds {} samples, fewer than a batch of {}",
                config.max_size, config.batch_size
            )));
        }
        if let Some((group, rows)) = config.batch_tokens {
            if group >= spec.groups().len() || rows == 0 {
                return Err(EchoError::Config(format!(
                    "batch_tokens must name a length group and be at least 1, got {rows} rows \
                     of group {group}"
                )));
            }
        }
        if let RaggedSampler::Prioritized { exponent } = config.sampler {
            if !exponent.is_finite() || exponent < 0.0 {
                return Err(EchoError::Config(format!(
                    "the priority exponent must be finite and >= 0, got {exponent}"
                )));
            }
        }
        let columns = spec.columns().len();
        let versions = match &config.versions {
            None => None,
            Some(kept) => {
                let last = spec.columns().last().filter(|c| {
                    !c.is_ragged() && c.row_bytes() == VERSION_BYTES && c.group().is_none()
                });
                if last.is_none() {
                    return Err(EchoError::Config(
                        "policy versions need a last leaf of one 8-byte value (the version)".into(),
                    ));
                }
                Some(std::sync::Arc::new(PolicyVersions::new(
                    columns - 1,
                    kept.max_staleness,
                    kept.admission,
                )))
            }
        };
        if !config.codecs.is_empty() && config.codecs.len() != columns {
            return Err(EchoError::Config(format!(
                "{} codecs for {columns} leaves",
                config.codecs.len()
            )));
        }
        let largest = spec
            .columns()
            .iter()
            .enumerate()
            .map(|(c, column)| match config.codecs.get(c).copied().flatten() {
                Some(codec) => codec.bound(column.max_bytes()),
                None => column.max_bytes(),
            })
            .max()
            .unwrap_or(0);
        let total = match config.max_bytes {
            Some(bytes) => bytes,
            None => {
                let wanted = spec.max_sample_bytes().saturating_mul(config.max_size);
                // Room for the partly filled blocks beside `max_size` full-size samples.
                let floor = (columns + 1) * (largest.max(1).next_multiple_of(64)).max(1 << 20);
                wanted.saturating_add(floor).min(DEFAULT_MAX_BYTES.max(floor))
            }
        };
        let arena = Arena::new(total, columns, largest)?;
        let tree = match config.sampler {
            RaggedSampler::Prioritized { .. } => Some(SumTree::sums_only(config.max_size)?),
            _ => None,
        };
        let memory = arena.memory().clone();
        let mut stats = RaggedStats { arena_capacity: arena.capacity(), ..Default::default() };
        stats.arena_bytes_in_use = 0;
        let rng = config.seed.map_or_else(Rng::from_entropy, Rng::from_seed);
        let state = State {
            arena,
            columns,
            extents: Vec::new(),
            rows: Vec::new(),
            free_slots: Vec::new(),
            entries: Vec::new(),
            free_entries: Vec::new(),
            order: VecDeque::with_capacity(config.max_size),
            live: Vec::with_capacity(if fifo { 0 } else { config.max_size }),
            tree,
            max_priority: 1.0,
            held: Vec::new(),
            rng,
            next_key: 1,
            closed: false,
            draining: false,
            writers_waiting: 0,
            consumer_waiting: false,
            pins: 0,
            raw_bytes: 0,
            stats,
        };
        Ok(Self {
            spec,
            config,
            state: Mutex::new(state),
            space: Condvar::new(),
            filled: Condvar::new(),
            memory,
            pool: BufPool::new(),
            versions,
        })
    }

    /// The policy versions this table keeps (the latest published, the bound, the stale
    /// counts), if it keeps them.
    pub fn versions(&self) -> Option<&std::sync::Arc<PolicyVersions>> {
        self.versions.as_ref()
    }

    /// The oldest version a sample may have to reach the learner now (0: any).
    fn version_floor(&self) -> u64 {
        self.versions.as_ref().map_or(0, |v| v.floor())
    }

    /// The samples' layout.
    pub fn spec(&self) -> &RaggedSpec {
        &self.spec
    }

    /// The settings.
    pub fn config(&self) -> &RaggedConfig {
        &self.config
    }

    /// The arena's memory, which numpy views into a FIFO batch keep alive.
    pub fn memory_owner(&self) -> std::sync::Arc<dyn std::any::Any + Send + Sync> {
        self.memory.clone()
    }

    /// The pool the owned parts of batches come from and go back to.
    pub fn pool(&self) -> &std::sync::Arc<BufPool> {
        &self.pool
    }

    /// Counters, now.
    pub fn stats(&self) -> RaggedStats {
        let state = self.state.lock();
        let mut stats = state.stats;
        // A FIFO batch the consumer holds is handed out already.
        stats.samples -= state
            .held
            .iter()
            .map(|&id| state.entries[id as usize].as_ref().map_or(0, |e| e.slots.len()))
            .sum::<usize>();
        stats.payload_bytes = state.arena.live_bytes();
        stats.raw_bytes = state.raw_bytes;
        stats.arena_bytes_in_use = state.arena.bytes_in_use();
        stats
    }

    /// Closes the table: inserts fail with [`EchoError::Closed`]; `sample` returns `None`,
    /// or with `drain` (FIFO), first hands out what is left, in batches as full as they
    /// come.
    pub fn close(&self, drain: bool) {
        let mut state = self.state.lock();
        state.closed = true;
        state.draining = drain && self.config.sampler == RaggedSampler::Fifo;
        drop(state);
        self.space.notify_all();
        self.filled.notify_all();
    }

    /// Whether [`RaggedTable::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// Removes the oldest live entry; false when there is none.
    fn evict_oldest(state: &mut State) -> bool {
        while let Some((id, key)) = state.order.pop_front() {
            if state.entries[id as usize].as_ref().is_some_and(|e| e.key == key) {
                let n = Self::remove(state, id);
                state.stats.evicted += n as u64;
                return true;
            }
        }
        false
    }

    /// Removes entry `id` and gives its room back; returns its samples.
    fn remove(state: &mut State, id: u32) -> usize {
        let entry = state.entries[id as usize].take().expect("a live entry");
        let ncols = state.columns;
        for &slot in &entry.slots {
            for c in 0..ncols {
                let extent =
                    std::mem::replace(&mut state.extents[slot as usize * ncols + c], Extent::NONE);
                state.arena.release(extent);
            }
            state.free_slots.push(slot);
        }
        if entry.live_at != usize::MAX {
            let last = state.live.pop().expect("the entry is live");
            if last != id {
                state.live[entry.live_at] = last;
                if let Some(moved) = state.entries[last as usize].as_mut() {
                    moved.live_at = entry.live_at;
                }
            }
        }
        if let Some(tree) = state.tree.as_mut() {
            let _ = tree.clear(id as usize);
        }
        state.free_entries.push(id);
        state.raw_bytes -= entry.raw_bytes;
        state.stats.samples -= entry.slots.len();
        state.stats.entries -= 1;
        entry.slots.len()
    }

    /// A copy of every stored entry, oldest first (a FIFO table: those not handed out yet),
    /// for a checkpoint. Taken under the lock: inserts and sampling wait for the copy.
    ///
    /// # Errors
    /// [`EchoError::Sample`] if a stored compressed sample does not decompress.
    pub fn export(&self) -> Result<RaggedExport, EchoError> {
        self.export_with(|| ()).map(|(out, ())| out)
    }

    /// [`RaggedTable::export`], and what `during` returns, run under the same lock: what
    /// inserts raise with their entries (`insert_from_then`) it reads as of the copy.
    ///
    /// # Errors
    /// As [`RaggedTable::export`].
    pub fn export_with<T>(
        &self,
        during: impl FnOnce() -> T,
    ) -> Result<(RaggedExport, T), EchoError> {
        let state = self.state.lock();
        let seen = during();
        let ncols = state.columns;
        let mut out = RaggedExport {
            values: vec![Vec::new(); ncols],
            rows: Vec::new(),
            group_sizes: Vec::new(),
            priorities: Vec::new(),
            times_sampled: Vec::new(),
        };
        for &(id, key) in &state.order {
            let Some(entry) = state.entries[id as usize].as_ref().filter(|e| e.key == key) else {
                continue;
            };
            out.group_sizes.push(entry.slots.len());
            out.priorities.push(entry.priority);
            out.times_sampled.push(entry.times_sampled);
            for &slot in &entry.slots {
                for c in 0..ncols {
                    let at = slot as usize * ncols + c;
                    let extent = state.extents[at];
                    if extent.bytes > 0 {
                        // SAFETY: a live entry's extent, read under the lock that keeps any
                        // writer off it.
                        let bytes = unsafe {
                            std::slice::from_raw_parts(
                                self.memory.ptr(extent),
                                extent.bytes as usize,
                            )
                        };
                        match self.config.codecs.get(c).copied().flatten() {
                            None => out.values[c].extend_from_slice(bytes),
                            Some(codec) => {
                                let raw =
                                    state.rows[at] as usize * self.spec.columns()[c].row_bytes();
                                let values = &mut out.values[c];
                                let from = values.len();
                                values.resize(from + raw, 0);
                                codec.decompress_into(bytes, &mut values[from..]).map_err(
                                    |why| {
                                        EchoError::Sample(format!(
                                            "a stored sample does not decompress: {why}"
                                        ))
                                    },
                                )?;
                            }
                        }
                    }
                    out.rows.push(state.rows[at] as usize);
                }
            }
        }
        Ok((out, seen))
    }

    /// Sets the draw count of the entry `key` (a restored checkpoint's); false if it is gone.
    pub fn set_times_sampled(&self, key: u64, times: u32) -> bool {
        let mut state = self.state.lock();
        let id = (key & 0xffff_ffff) as usize;
        match state.entries.get_mut(id).and_then(Option::as_mut).filter(|e| e.key == key) {
            Some(entry) => {
                entry.times_sampled = times;
                true
            }
            None => false,
        }
    }

    /// Sets the priorities of the entries `keys` name (a group's samples share one key).
    /// Returns how many were updated; unknown keys (evicted entries) are skipped.
    ///
    /// # Errors
    /// [`EchoError::Priority`] if the table is not prioritized, the lengths differ, or a
    /// priority is invalid (nothing is updated then).
    pub fn update_priorities(&self, keys: &[u64], priorities: &[f64]) -> Result<u64, EchoError> {
        let RaggedSampler::Prioritized { exponent } = self.config.sampler else {
            return Err(EchoError::Priority(
                "only a Prioritized table takes priority updates".into(),
            ));
        };
        if keys.len() != priorities.len() {
            return Err(EchoError::Priority(format!(
                "{} keys but {} priorities",
                keys.len(),
                priorities.len()
            )));
        }
        if let Some(p) = priorities.iter().find(|p| !p.is_finite() || **p < 0.0) {
            return Err(EchoError::Priority(format!(
                "a priority must be finite and >= 0, got {p}"
            )));
        }
        let mut state = self.state.lock();
        let state = &mut *state;
        let mut updated = 0;
        for (&key, &priority) in keys.iter().zip(priorities) {
            let id = (key & 0xffff_ffff) as usize;
            let Some(entry) = state.entries.get_mut(id).and_then(Option::as_mut) else { continue };
            if entry.key != key {
                continue;
            }
            entry.priority = priority;
            state.max_priority = state.max_priority.max(priority);
            if let Some(tree) = state.tree.as_mut() {
                tree.set(id, priority.powf(exponent))?;
            }
            updated += 1;
        }
        // A consumer waiting because every priority was 0 (or its batch ran out) may draw now.
        if updated > 0 && state.consumer_waiting {
            self.filled.notify_one();
        }
        Ok(updated)
    }

    /// The next batch, in `layout`, or `None` once the table is closed. Waits until
    /// `deadline` for one. One consumer at a time (it holds the FIFO batch it was handed
    /// until its next call).
    ///
    /// # Errors
    /// [`EchoError::TimedOut`]; [`EchoError::Sample`] if a packed batch has more than
    /// `i32::MAX` rows.
    pub fn sample(
        &self,
        layout: BatchLayout,
        deadline: Option<Instant>,
    ) -> Result<Option<RaggedBatch>, EchoError> {
        let mut state = self.state.lock();
        let picked = if self.config.sampler == RaggedSampler::Fifo {
            match self.pick_fifo(&mut state, deadline)? {
                Some(picked) => picked,
                None => return Ok(None),
            }
        } else {
            match self.pick_replay(&mut state, deadline)? {
                Some(picked) => picked,
                None => return Ok(None),
            }
        };
        let sequence = state.stats.batches;
        let store_size = state.stats.samples
            - state
                .held
                .iter()
                .map(|&id| state.entries[id as usize].as_ref().map_or(0, |e| e.slots.len()))
                .sum::<usize>();
        state.stats.batches += 1;
        state.stats.sampled += picked.samples() as u64;
        drop(state);
        let fifo = self.config.sampler == RaggedSampler::Fifo;
        let built = batch::build(
            &self.spec,
            &self.config.codecs,
            &self.memory,
            &self.pool,
            &picked,
            layout,
            fifo,
            sequence,
        );
        if !fifo {
            let mut state = self.state.lock();
            for extent in &picked.extents {
                state.arena.unpin(*extent);
            }
            state.pins -= picked.extents.len();
            let wake = state.writers_waiting > 0;
            drop(state);
            if wake {
                self.space.notify_all();
            }
        }
        built.map(|mut batch| {
            batch.store_size = store_size;
            if let Some(versions) = &self.versions {
                versions.note_handed(batch.column_bytes(versions.leaf()));
            }
            Some(batch)
        })
    }

    /// Gives the held FIFO batch back and waits for the next one.
    fn pick_fifo(
        &self,
        state: &mut MutexGuard<'_, State>,
        deadline: Option<Instant>,
    ) -> Result<Option<Picked>, EchoError> {
        let held = std::mem::take(&mut state.held);
        let freed = !held.is_empty();
        for id in held {
            Self::remove(state, id);
        }
        if freed && state.writers_waiting > 0 {
            self.space.notify_all();
        }
        loop {
            if state.closed && !state.draining {
                return Ok(None);
            }
            self.drop_stale_fifo(state);
            let (take, complete) = self.fill_fifo(state);
            if take > 0 && (complete || state.writers_waiting > 0 || state.closed) {
                let ids: Vec<u32> =
                    (0..take).map(|_| state.order.pop_front().expect("counted").0).collect();
                let picked = self.collect(state, &ids, None, false);
                state.held = ids;
                return Ok(Some(picked));
            }
            if state.closed {
                return Ok(None); // drained
            }
            if passed(deadline) {
                return Err(EchoError::TimedOut);
            }
            state.consumer_waiting = true;
            wait(&self.filled, state, deadline);
            state.consumer_waiting = false;
        }
    }

    /// How many of the oldest entries make the next FIFO batch, and whether it is complete
    /// (full, at its token budget, or the next entry does not fit).
    fn fill_fifo(&self, state: &State) -> (usize, bool) {
        let (mut samples, mut rows, mut take) = (0usize, 0usize, 0usize);
        for &(id, _) in &state.order {
            let entry = state.entries[id as usize].as_ref().expect("FIFO entries stay live");
            if samples + entry.slots.len() > self.config.batch_size {
                return (take, true);
            }
            if let Some((_, budget)) = self.config.batch_tokens {
                if rows + entry.budget_rows > budget {
                    return (take, true);
                }
            }
            samples += entry.slots.len();
            rows += entry.budget_rows;
            take += 1;
            let at_budget = self.config.batch_tokens.is_some_and(|(_, budget)| rows == budget);
            if samples == self.config.batch_size || at_budget {
                return (take, true);
            }
        }
        (take, false)
    }

    /// Draws a replay batch and pins its bytes. Each draw counts at once (a sample drawn
    /// twice in one batch says 1, then 2), and an entry that reaches `max_times_sampled` is
    /// drawn no more: withdrawn from the draw at once, removed once its bytes are pinned.
    /// A batch that runs out of entries to draw before it is full is put back as it was
    /// and waits for more to arrive (as a fixed-shape table's does).
    fn pick_replay(
        &self,
        state: &mut MutexGuard<'_, State>,
        deadline: Option<Instant>,
    ) -> Result<Option<Picked>, EchoError> {
        let floor = self.version_floor();
        let limit = self.config.max_times_sampled;
        let (mut ids, mut probabilities, mut times) = (Vec::new(), Vec::new(), Vec::new());
        let mut spent: Vec<u32> = Vec::new();
        let mut starved = false;
        'draw: loop {
            loop {
                if state.closed {
                    return Ok(None);
                }
                if !starved && self.can_draw(state) {
                    break;
                }
                if passed(deadline) {
                    return Err(EchoError::TimedOut);
                }
                state.consumer_waiting = true;
                wait(&self.filled, state, deadline);
                state.consumer_waiting = false;
                starved = false;
            }
            let (mut samples, mut rows) = (0usize, 0usize);
            while samples < self.config.batch_size {
                if !self.can_draw(state) {
                    // The entries left were all spent by this batch's draws.
                    self.undraw(state, &ids, &spent);
                    (ids, probabilities, times, spent) = Default::default();
                    starved = true;
                    continue 'draw;
                }
                let u = state.rng.next_f64();
                let (id, probability) = match state.tree.as_ref() {
                    None => {
                        let n = state.live.len();
                        let at = ((u * n as f64) as usize).min(n - 1);
                        (state.live[at], 1.0 / n as f64)
                    }
                    Some(tree) => {
                        let total = tree.total();
                        let id = tree.sample(u).expect("a positive total");
                        (id as u32, tree.get(id).unwrap_or(0.0) / total)
                    }
                };
                let entry = state.entries[id as usize].as_mut().expect("a live entry");
                if entry.version < floor {
                    // Stale since it went in: removed, never handed out, and counted once.
                    let n = Self::remove(state, id);
                    if let Some(versions) = &self.versions {
                        versions.note_stale_at_sample(n as u64);
                    }
                    if !self.can_draw(state) && ids.is_empty() {
                        continue 'draw;
                    }
                    continue;
                }
                let too_many = samples + entry.slots.len() > self.config.batch_size;
                let over = self
                    .config
                    .batch_tokens
                    .is_some_and(|(_, budget)| rows + entry.budget_rows > budget);
                if !ids.is_empty() && (too_many || over) {
                    break;
                }
                samples += entry.slots.len();
                rows += entry.budget_rows;
                entry.times_sampled += 1;
                times.push(entry.times_sampled);
                if limit > 0 && entry.times_sampled >= limit {
                    Self::withdraw(state, id);
                    spent.push(id);
                }
                ids.push(id);
                probabilities.push(probability);
                if self.config.batch_tokens.is_some_and(|(_, budget)| rows == budget) {
                    break;
                }
            }
            break;
        }
        let picked = self.collect(state, &ids, Some((probabilities, times)), true);
        // The entries that reached their limit go (their bytes stay pinned until the copy
        // is done).
        for &id in &spent {
            let n = Self::remove(state, id);
            state.stats.removed_max_times_sampled += n as u64;
        }
        Ok(Some(picked))
    }

    /// Takes entry `id` out of the draw (the live list, the priority tree) and keeps its
    /// bytes: one that reached `max_times_sampled` in the batch being drawn.
    fn withdraw(state: &mut State, id: u32) {
        let Some(entry) = state.entries[id as usize].as_mut() else { return };
        let at = std::mem::replace(&mut entry.live_at, usize::MAX);
        if at != usize::MAX {
            let last = state.live.pop().expect("the entry is live");
            if last != id {
                state.live[at] = last;
                if let Some(moved) = state.entries[last as usize].as_mut() {
                    moved.live_at = at;
                }
            }
        }
        if let Some(tree) = state.tree.as_mut() {
            let _ = tree.clear(id as usize);
        }
    }

    /// Puts a batch's draws back: `ids`' counts as they were, and the `spent` entries back
    /// in the draw.
    fn undraw(&self, state: &mut State, ids: &[u32], spent: &[u32]) {
        for &id in ids {
            if let Some(entry) = state.entries[id as usize].as_mut() {
                entry.times_sampled -= 1;
            }
        }
        for &id in spent {
            let Some(entry) = state.entries[id as usize].as_mut() else { continue };
            entry.live_at = state.live.len();
            let priority = entry.priority;
            state.live.push(id);
            if let (Some(tree), RaggedSampler::Prioritized { exponent }) =
                (state.tree.as_mut(), &self.config.sampler)
            {
                let _ = tree.set(id as usize, priority.powf(*exponent));
            }
        }
    }

    /// Why no batch can be handed out now, in words (for a `sample()` that timed out).
    pub fn why_no_batch(&self) -> String {
        let state = self.state.lock();
        let held = state.stats.samples;
        if self.config.sampler == RaggedSampler::Fifo {
            return format!(
                "not enough samples arrived ({held} wait; a batch closes at batch_size {} or \
                 at the token budget)",
                self.config.batch_size
            );
        }
        let min = self.config.min_size.max(1);
        if held < min {
            return format!("not enough samples arrived (the table holds {held}, {min} needed)");
        }
        if state.tree.as_ref().is_some_and(|t| t.total() <= 0.0) {
            return format!(
                "every one of the {held} samples stored has priority 0: none can be drawn \
                 (update_priorities to more)"
            );
        }
        if self.config.max_times_sampled > 0 {
            return format!(
                "the {held} samples stored cannot fill a batch of {}: each is drawn at most \
                 max_times_sampled={} times",
                self.config.batch_size, self.config.max_times_sampled
            );
        }
        "not enough samples arrived".to_owned()
    }

    /// Whether a replay draw can be made now: enough samples, a live entry, and (prioritized)
    /// a positive total.
    fn can_draw(&self, state: &State) -> bool {
        let enough = state.stats.samples >= self.config.min_size.max(1);
        let weighed = state.tree.as_ref().is_none_or(|t| t.total() > 0.0);
        enough && !state.live.is_empty() && weighed
    }

    /// FIFO: removes the entries waiting to be handed out that became stale while they
    /// waited (counted once); the others keep their order.
    fn drop_stale_fifo(&self, state: &mut State) {
        let floor = self.version_floor();
        if floor == 0 {
            return;
        }
        let entries = &state.entries;
        let stale: Vec<u32> = state
            .order
            .iter()
            .filter(|&&(id, _)| entries[id as usize].as_ref().is_some_and(|e| e.version < floor))
            .map(|&(id, _)| id)
            .collect();
        if stale.is_empty() {
            return;
        }
        state.order.retain(|&(id, _)| !stale.contains(&id));
        let removed: usize = stale.iter().map(|&id| Self::remove(state, id)).sum();
        if let Some(versions) = &self.versions {
            versions.note_stale_at_sample(removed as u64);
        }
        if state.writers_waiting > 0 {
            self.space.notify_all();
        }
    }

    /// The extents, rows and per-sample values of `ids`' samples (a replay batch's `draws`:
    /// each draw's probability and count); pins them when asked.
    fn collect(
        &self,
        state: &mut State,
        ids: &[u32],
        draws: Option<(Vec<f64>, Vec<u32>)>,
        pin: bool,
    ) -> Picked {
        let ncols = self.spec.columns().len();
        let mut picked = Picked::with_columns(ncols);
        for (i, &id) in ids.iter().enumerate() {
            let entry = state.entries[id as usize].as_ref().expect("a live entry");
            for &slot in &entry.slots {
                let at = slot as usize * ncols;
                picked.extents.extend_from_slice(&state.extents[at..at + ncols]);
                picked.rows.extend_from_slice(&state.rows[at..at + ncols]);
                picked.keys.push(entry.key);
                if let Some((probabilities, times)) = &draws {
                    picked.probabilities.push(probabilities[i]);
                    picked.times_sampled.push(times[i]);
                }
            }
        }
        if pin {
            for extent in &picked.extents {
                state.arena.pin(*extent);
            }
            state.pins += picked.extents.len();
        }
        picked
    }
}

/// A deadline `timeout` from now (`None`: wait for ever).
pub fn deadline_after(timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| Instant::now() + t)
}
