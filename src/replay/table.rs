//! The replay table: `max_size` items that stay in memory, are drawn at random or by priority
//! (possibly many times) and are evicted by a remover when the table is full.
//!
//! ```text
//!  writers (any thread)                       consumer (one ReplayConsumer)
//!  ───────────────────                        ─────────────────────────────
//!  lock; wait for the rate limiter            lock; repeat until batch_size items drawn:
//!  full? evict the remover's victim             wait until the limiter allows n > 0 samples
//!  pop a free slot (state Writing)              draw n: times_sampled += 1, pin the slot,
//!  copy the sample in (small samples under        remove it if times_sampled == k
//!    the lock, large ones after unlocking)    unlock; copy every drawn slot into batch area
//!  lock; key, priority, state Live;             half h (h alternates), GIL-free, no lock
//!    tell sampler and remover; unlock         lock; unpin; unlock
//! ```
//!
//! Every decision (which slot, which item, what the limiter allows) is made under one mutex
//! and is O(log n) at most; only the copies of sample bytes run outside it. Unlike the FIFO
//! store this is not lockfree, and does not need to be: a batch is one lock round trip per
//! `batch_size` items, and an insert one or two.
//!
//! Invariants (checked by the tests in this file and `tests/replay.rs`):
//! 1. A slot is `Free`, `Writing` (one writer copies into it, nobody else touches it),
//!    `Live` (in the sampler, remover and key map; its bytes never change) or `Retired`
//!    (removed while pinned). Writers only ever write `Free` slots they popped under the lock,
//!    or (small items, see `State::reserve`) an unpinned victim's slot they reuse without
//!    releasing the lock between eviction and publication.
//! 2. A slot the consumer is copying from is pinned (`pins > 0`), so it is `Live` or
//!    `Retired`, never `Free`: its bytes stay put until it is unpinned.
//! 3. `live + writing <= max_size`; at most `batch_size` slots are pinned (one consumer, one
//!    batch), so `max_size + batch_size` slots always leave a free one for the next insert.
//! 4. While a [`Checkpoint`] lives, a slot is *pending* (`CheckpointCopies::take_pending`:
//!    live in `copies.snapshot`, not marked in `copies.done`) exactly when it holds a
//!    snapshot item whose bytes the checkpoint has not copied yet and that no writer has
//!    reserved since the snapshot, so its bytes are still the snapshot's; a writer that
//!    reserves such a slot first saves its bytes into `copies.saved` and marks it done, under
//!    the lock (copy-on-write).
//!
//! Checkpoints ([`Table::checkpoint`]): a point-in-time snapshot while inserts and sampling go
//! on. One lock hold copies every slot's metadata (one memcpy into a buffer allocated before)
//! and the table-wide state (limiter counters, RNG, next key, largest priority) and arms the
//! copy-on-write marker; then
//! [`Checkpoint::next_chunk`] copies the item bytes in key order, about a chunk at a time, each
//! chunk under the lock, so writers and the sampler wait at most one chunk's copy.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

use crate::codec::{self, Codec, LeafCodecs};
use crate::error::{EchoError, InsertError};
use crate::ingress::QueuedSamples;
use crate::replay::limiter::{InsertHoldback, RateLimit, RateLimiter, SampleHoldback};
use crate::replay::rng::Rng;
use crate::replay::select::{
    new_remover, new_sampler, ItemRemover, ItemSampler, RemoverKind, SamplerKind,
};
use crate::replay::shell::{
    check_insert_priorities, check_priority, check_update, lock_until, BatchCursor, Draws, Parked,
    ReplayBatch, Shell, Side, WaitState,
};
use crate::slots::Slots;
use crate::source::{validate_source, SampleSource};
use crate::spec::{ArraySpec, DataSpec};
use crate::sync::{Arc, AsyncBell, Mutex, MutexGuard};

/// Samples up to this size are copied into their slot under the table lock (one lock round
/// trip per insert instead of two); larger ones after releasing it.
const COPY_UNDER_LOCK_BYTES: usize = 4096;

/// One per-item value a replay batch carries after the sample's own leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLeaf {
    /// What it is called where a batch is handed out (`Sample.keys`, ...).
    pub name: &'static str,
    /// Its element type as a numpy type character: `u` unsigned, `f` floating point, `b` bool.
    pub kind: char,
    /// Bytes per element (native byte order).
    pub bytes: usize,
    /// One value per step of a window (a sequence table's `mask`) rather than one per item.
    pub per_step: bool,
}

/// The per-item values of a replay batch, in the order the batch area stores them after the
/// sample's leaves: the item's key, the probability it was drawn with, and how many times it
/// has been sampled (this draw included). The one definition of that layout: the batch area
/// is built from it, [`ReplayConsumer`] writes `Drawn::write_meta` in this order, and the
/// bindings describe the arrays from it.
pub const BATCH_META: [MetaLeaf; 3] = [
    MetaLeaf { name: "keys", kind: 'u', bytes: 8, per_step: false },
    MetaLeaf { name: "probabilities", kind: 'f', bytes: 8, per_step: false },
    MetaLeaf { name: "times_sampled", kind: 'u', bytes: 4, per_step: false },
];

/// How a replay table samples, evicts and paces. Build with [`ReplayConfig::new`] and adjust
/// the public fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayConfig {
    /// Items per batch.
    pub batch_size: usize,
    /// Items the table holds before the remover evicts one per insert.
    pub max_size: usize,
    /// How items are drawn.
    pub sampler: SamplerKind,
    /// Which item is evicted when the table is full.
    pub remover: RemoverKind,
    /// When inserts and samples may proceed.
    pub rate_limit: RateLimit,
    /// Remove an item once it was sampled this many times; 0 never does.
    pub max_times_sampled: u32,
    /// Fixes the sampling sequence (for reproducible runs); `None` seeds from the OS.
    pub seed: Option<u64>,
    /// How each leaf is stored: `None` as is, `Some(codec)` compressed ([`Codec`]). Empty:
    /// no leaf is compressed.
    pub compress: Vec<Option<Codec>>,
    /// Bounds the bytes the items take (their compressed leaves as stored, the others raw):
    /// the remover evicts until a new item fits, as it does at `max_size` items. `None`: only
    /// `max_size` bounds the table.
    pub max_bytes: Option<u64>,
}

impl ReplayConfig {
    /// Uniform sampling, FIFO eviction, `MinSize(1)`, unlimited `max_times_sampled`.
    pub fn new(batch_size: usize, max_size: usize) -> Self {
        Self {
            batch_size,
            max_size,
            sampler: SamplerKind::Uniform,
            remover: RemoverKind::Fifo,
            rate_limit: RateLimit::MinSize(1),
            max_times_sampled: 0,
            seed: None,
            compress: Vec::new(),
            max_bytes: None,
        }
    }

    fn validate(&self) -> Result<usize, EchoError> {
        let config = |msg: String| Err(EchoError::Config(msg));
        let (batch_size, max_size) = (self.batch_size, self.max_size);
        if batch_size < 1 {
            return config(format!("batch_size must be >= 1, got {batch_size}"));
        }
        if max_size < batch_size {
            return config(format!(
                "max_size must be >= batch_size ({batch_size}), got {max_size}"
            ));
        }
        let slots = max_size
            .checked_add(batch_size)
            .filter(|&s| s < u32::MAX as usize)
            .ok_or_else(|| {
                EchoError::Config(format!(
                    "max_size + batch_size must be below 2^32 - 1, got {max_size} + {batch_size}"
                ))
            })?;
        self.rate_limit.validate(max_size as u64)?;
        if self.max_bytes == Some(0) {
            return config("max_bytes must be >= 1, got 0".to_owned());
        }
        Ok(slots)
    }
}

/// A snapshot of a table's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Items that can be sampled now.
    pub size: u64,
    /// Inserts that hold a slot and are still copying.
    pub pending_inserts: u64,
    /// Items ever inserted (published).
    pub inserted: u64,
    /// Items ever handed out (a batch counts `batch_size`).
    pub sampled_items: u64,
    /// Batches ever handed out.
    pub batches: u64,
    /// Items evicted by the remover because the table was full.
    pub evicted: u64,
    /// Items removed because they reached `max_times_sampled`.
    pub removed_max_times_sampled: u64,
    /// Priorities changed by `update_priorities`.
    pub priority_updates: u64,
    /// Keys `update_priorities` ignored because they were unknown or already removed.
    pub unknown_keys: u64,
    /// Total nanoseconds inserts spent waiting for the rate limiter.
    pub insert_blocked_ns: u64,
    /// Total nanoseconds `sample` spent waiting for items or the rate limiter.
    pub sample_blocked_ns: u64,
    /// Bytes the table's items take as stored, compressed leaves compressed (items still
    /// being written included).
    pub stored_bytes: u64,
    /// Bytes the same items take raw (their number times the sample's size).
    pub raw_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Writing,
    Live,
    Retired,
}

#[derive(Debug, Clone, Copy)]
struct Meta {
    key: u64,
    priority: f64,
    times_sampled: u32,
    pins: u32,
    /// Bytes the item takes as stored (set when its slot is reserved).
    stored: u32,
    state: SlotState,
}

impl Meta {
    /// A free slot's metadata (what a checkpoint's snapshot buffer starts as).
    const UNUSED: Self = Self {
        key: 0,
        priority: 0.0,
        times_sampled: 0,
        pins: 0,
        stored: 0,
        state: SlotState::Free,
    };
}

/// One item drawn into the batch being assembled.
#[derive(Debug, Clone, Copy)]
struct Drawn {
    slot: usize,
    key: u64,
    probability: f64,
    times_sampled: u32,
}

impl Drawn {
    /// Calls `write(m, bytes)` with the item's [`BATCH_META`] value `m`, for each in order.
    /// (The area's slots are sized from `BATCH_META`, and `write_slot` checks every length.)
    fn write_meta(&self, mut write: impl FnMut(usize, &[u8])) {
        write(0, &self.key.to_ne_bytes());
        write(1, &self.probability.to_ne_bytes());
        write(2, &self.times_sampled.to_ne_bytes());
    }
}

/// Hashes the table's keys, which are insertion numbers: the low bits stay the key itself,
/// so consecutive keys land in consecutive buckets (inserting and evicting in key order walk
/// the map's memory sequentially instead of missing the cache twice per insert); the top 7
/// bits, which the map compares first, are mixed so that a probe rarely compares keys.
#[derive(Debug, Default, Clone, Copy)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        const TOP7: u64 = 0x7F << 57;
        self.0 ^ (self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) & TOP7)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, key: u64) {
        self.0 = key;
    }
}

/// A snapshot item saved from its slot before a writer reused it: the bytes of its leaves
/// stored raw (back to back) and its packed item (empty when no leaf is compressed).
type SavedItem = (Box<[u8]>, Box<[u8]>);

/// What the running [`Checkpoint`] still has to copy, and the copies writers saved for it
/// before reusing a slot (copy-on-write, invariant 4).
struct CheckpointCopies {
    /// Every slot's metadata at the snapshot (shared with the checkpoint while it sorts out
    /// the live items after the lock).
    snapshot: Arc<[Meta]>,
    /// `done[slot]`: the snapshot item in `slot` was copied or saved already.
    done: Box<[bool]>,
    /// Snapshot items whose slot a writer reserved before the checkpoint copied them, by
    /// slot: the bytes of the leaves stored raw (back to back) and the packed item (empty
    /// when no leaf is compressed).
    saved: HashMap<u32, SavedItem>,
    /// The packed items of pending snapshot slots freed before the checkpoint copied them
    /// (their other leaves stay in the slot until it is reserved), by slot.
    saved_packed: HashMap<u32, Box<[u8]>>,
}

impl CheckpointCopies {
    /// Whether `slot` holds a snapshot item whose bytes are still to be copied (it was live
    /// at the snapshot and neither copied nor saved since); marks it done.
    fn take_pending(&mut self, slot: usize) -> bool {
        let pending = self.is_pending(slot);
        self.done[slot] = true;
        pending
    }

    /// [`CheckpointCopies::take_pending`] without marking it done.
    fn is_pending(&self, slot: usize) -> bool {
        self.snapshot[slot].state == SlotState::Live && !self.done[slot]
    }
}

/// Everything the lock protects.
struct State {
    meta: Box<[Meta]>,
    free: Vec<u32>,
    keys: HashMap<u64, u32, BuildHasherDefault<KeyHasher>>,
    sampler: Box<dyn ItemSampler>,
    remover: Box<dyn ItemRemover>,
    limiter: RateLimiter,
    rng: Rng,
    /// Scratch for one draw call (`batch_size` long): no allocation per batch.
    draw_slots: Box<[usize]>,
    draw_probabilities: Box<[f64]>,
    max_size: usize,
    /// `ReplayConfig::max_bytes`, `u64::MAX` when unbounded.
    max_bytes: u64,
    max_times_sampled: u32,
    live: usize,
    writing: usize,
    /// Bytes live and writing items take as stored (their `Meta::stored`).
    stored_bytes: u64,
    /// The table's `packed` cells (shared): a slot that becomes free gives its compressed
    /// leaves' memory back at once, or to a running checkpoint that still needs them.
    packed: Arc<[Mutex<Box<[u8]>>]>,
    next_key: u64,
    /// The priority new items get: the largest priority seen so far, initially 1.
    max_priority: f64,
    stats: ReplayStats,
    /// Writers parked on the shell's `insert_ready`, and the consumer on its `sample_ready`.
    parked: Parked,
    /// The checkpoint being written, if any.
    copies: Option<CheckpointCopies>,
    /// Set while a restore's ingress samples are still going in ([`Table::restore_queued`]):
    /// every other insert waits, so that nothing new goes in before them.
    restoring: bool,
}

impl State {
    fn insertable(&self) -> bool {
        let size = self.live + self.writing;
        self.limiter.can_insert(size as u64) && (size < self.max_size || self.live > 0)
    }

    /// Takes a free slot for a new item, evicting the remover's victim if the table is full.
    ///
    /// With `in_place` (the caller writes and publishes the new item before releasing the
    /// lock) an unpinned victim's slot is reused at once and stays in the sampler until
    /// `publish` replaces it: nobody can sample in between, and the sampler does one update
    /// instead of a removal and an insertion. Returns the slot and whether it was reused so.
    ///
    /// `bytes` is what the new item takes as stored: while it would take the table past
    /// `max_bytes`, victims are evicted too (as long as there are live items; writers still
    /// copying may take it past the bound for as long as they copy).
    fn reserve(&mut self, in_place: bool, bytes: u32) -> (usize, bool) {
        loop {
            let full = self.live + self.writing >= self.max_size;
            let over = self.stored_bytes + u64::from(bytes) > self.max_bytes;
            if !(full || over) || self.live == 0 {
                break;
            }
            let victim = self.remover.victim().expect("a full table with live items has a victim");
            self.stats.evicted += 1;
            let victim_bytes = u64::from(self.meta[victim].stored);
            let last = self.stored_bytes - victim_bytes + u64::from(bytes) <= self.max_bytes;
            if last && in_place && self.meta[victim].pins == 0 {
                let meta = &mut self.meta[victim];
                self.keys.remove(&meta.key);
                meta.state = SlotState::Writing;
                meta.stored = bytes;
                self.remover.remove(victim);
                self.live -= 1;
                self.writing += 1;
                self.stored_bytes = self.stored_bytes - victim_bytes + u64::from(bytes);
                self.limiter.on_insert();
                return (victim, true);
            }
            self.remove_item(victim);
        }
        // Invariant 3: at most max_size - 1 live or pending items and batch_size pinned ones.
        let slot = self.free.pop().expect("max_size + batch_size slots leave one free") as usize;
        self.meta[slot].state = SlotState::Writing;
        self.meta[slot].stored = bytes;
        self.writing += 1;
        self.stored_bytes += u64::from(bytes);
        self.limiter.on_insert();
        (slot, false)
    }

    /// Puts `slot` back on the free list and gives its compressed leaves' memory back (or to
    /// the running checkpoint, if it still has to copy them: invariant 4).
    fn free_slot(&mut self, slot: usize) {
        self.meta[slot].state = SlotState::Free;
        self.free.push(slot as u32);
        if let Some(cell) = self.packed.get(slot) {
            let item = std::mem::take(&mut *cell.lock());
            if let Some(copies) = self.copies.as_mut().filter(|copies| copies.is_pending(slot)) {
                copies.saved_packed.insert(slot as u32, item);
            }
        }
    }

    /// Makes the item in `slot` (fully written) sampleable; `replaced` as `reserve` said.
    fn publish(&mut self, slot: usize, priority: Option<f64>, replaced: bool) {
        let priority = priority.unwrap_or(self.max_priority);
        self.max_priority = self.max_priority.max(priority);
        let key = self.next_key;
        self.next_key += 1;
        let stored = self.meta[slot].stored;
        self.meta[slot] =
            Meta { key, priority, times_sampled: 0, pins: 0, stored, state: SlotState::Live };
        self.keys.insert(key, slot as u32);
        if replaced {
            self.sampler.replace(slot, priority);
        } else {
            self.sampler.insert(slot, priority);
        }
        self.remover.insert(slot, priority);
        self.writing -= 1;
        self.live += 1;
        self.stats.inserted += 1;
    }

    fn remove_item(&mut self, slot: usize) {
        let meta = &mut self.meta[slot];
        debug_assert_eq!(meta.state, SlotState::Live);
        self.keys.remove(&meta.key);
        self.stored_bytes -= u64::from(meta.stored);
        if meta.pins > 0 {
            meta.state = SlotState::Retired;
        } else {
            self.free_slot(slot);
        }
        self.sampler.remove(slot);
        self.remover.remove(slot);
        self.live -= 1;
    }

    fn take(&mut self, slot: usize, probability: f64, pending: &mut Vec<Drawn>) {
        let meta = &mut self.meta[slot];
        debug_assert_eq!(meta.state, SlotState::Live);
        meta.times_sampled = meta.times_sampled.saturating_add(1);
        meta.pins += 1;
        pending.push(Drawn { slot, key: meta.key, probability, times_sampled: meta.times_sampled });
    }

    /// Draws up to `n` items (`live > 0`) into `pending`; returns how many.
    fn draw(&mut self, n: usize, pending: &mut Vec<Drawn>) -> usize {
        if self.max_times_sampled == 0 {
            let (slots, probabilities) =
                (&mut self.draw_slots[..n], &mut self.draw_probabilities[..n]);
            let got = self.sampler.draw(&mut self.rng, slots, probabilities);
            for j in 0..got {
                self.take(self.draw_slots[j], self.draw_probabilities[j], pending);
            }
            return got;
        }
        // One at a time, so an item that reaches `max_times_sampled` is gone before the next
        // draw: nothing is handed out more than k times.
        let mut got = 0;
        while got < n && self.live > 0 {
            let (slot, probability) =
                (&mut self.draw_slots[..1], &mut self.draw_probabilities[..1]);
            self.sampler.draw(&mut self.rng, slot, probability);
            let (slot, probability) = (self.draw_slots[0], self.draw_probabilities[0]);
            self.take(slot, probability, pending);
            if self.meta[slot].times_sampled >= self.max_times_sampled {
                self.remove_item(slot);
                self.stats.removed_max_times_sampled += 1;
            }
            got += 1;
        }
        got
    }

    fn unpin(&mut self, slot: usize) {
        let meta = &mut self.meta[slot];
        meta.pins -= 1;
        if meta.pins == 0 && meta.state == SlotState::Retired {
            self.free_slot(slot);
        }
    }
}

impl WaitState for State {
    fn parked(&mut self) -> &mut Parked {
        &mut self.parked
    }

    fn add_blocked_ns(&mut self, side: Side, ns: u64) {
        match side {
            Side::Insert => self.stats.insert_blocked_ns += ns,
            Side::Sample => self.stats.sample_blocked_ns += ns,
        }
    }
}

impl Draws for State {
    fn limiter(&mut self) -> &mut RateLimiter {
        &mut self.limiter
    }

    fn live(&self) -> u64 {
        self.live as u64
    }

    fn add_sampled(&mut self, n: u64) {
        self.stats.sampled_items += n;
    }
}

/// A replay table. Create with [`Table::new`]; many writers [`Table::insert`], one
/// [`ReplayConsumer`] samples.
pub struct Table {
    spec: DataSpec,
    config: ReplayConfig,
    /// `max_size + batch_size` item slots of the leaves stored as they are (compressed leaves
    /// take no room here).
    storage: Slots,
    /// Which leaves are stored compressed.
    codecs: LeafCodecs,
    /// Each slot's compressed leaves (a packed item, [`crate::codec`]); empty when no leaf is
    /// compressed. A slot's cell follows the slot's states (invariant 1): the writer that
    /// reserved it sets it, the consumer reads it while pinned, a checkpoint or a release
    /// reads or empties it under the table lock. So its lock is never contended; it is taken
    /// under the table lock or with no other lock held (lock order: table, then slot).
    packed: Arc<[Mutex<Box<[u8]>>]>,
    /// Bytes an item takes in `storage` (its leaves stored as they are).
    fixed_bytes: u32,
    /// The most threads that decompress one batch or compress one insert (the calling
    /// thread included).
    codec_threads: usize,
    state: Mutex<State>,
    /// The waits (writers for the rate limiter, woken whenever a sample progresses; the
    /// consumer for items, woken on every publish), the close protocol, the consumer claim,
    /// and the batch area: two batches (halves) of the sample's leaves plus [`BATCH_META`].
    shell: Shell,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Table {
    /// A table for samples of `spec`.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the bad parameter; [`EchoError::OutOfMemory`] if the
    /// storage cannot be allocated.
    pub fn new(spec: DataSpec, config: ReplayConfig) -> Result<Arc<Self>, EchoError> {
        let slots = config.validate()?;
        let batch_size = config.batch_size;
        let codecs = if config.compress.is_empty() {
            LeafCodecs::none(&spec)
        } else {
            LeafCodecs::new(&spec, config.compress.clone())?
        };
        // Compressed leaves live in `packed`: in `storage` they take no bytes.
        let stored_arrays = spec
            .arrays()
            .iter()
            .enumerate()
            .map(|(leaf, array)| match codecs.get(leaf) {
                Some(_) => ArraySpec::new(vec![0], array.dtype_size()),
                None => Ok(array.clone()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fixed_bytes: usize = (0..spec.len())
            .filter(|&leaf| codecs.get(leaf).is_none())
            .map(|leaf| spec.arrays()[leaf].num_bytes())
            .sum();
        let fixed_bytes = u32::try_from(fixed_bytes).map_err(|_| {
            EchoError::Config(format!(
                "a replay item holds at most 2^32 - 1 bytes uncompressed, got {fixed_bytes}"
            ))
        })?;
        if !codecs.is_empty() && spec.payload_size() > u32::MAX as usize {
            return Err(EchoError::Config(format!(
                "a compressed replay item holds at most 2^32 - 1 bytes raw, got {}",
                spec.payload_size()
            )));
        }
        let storage = Slots::of_arrays(&stored_arrays, slots)?;
        let packed: Arc<[Mutex<Box<[u8]>>]> = if codecs.is_empty() {
            Arc::from(Vec::new())
        } else {
            (0..slots).map(|_| Mutex::new(Box::default())).collect()
        };
        let mut area_arrays = spec.arrays().to_vec();
        for meta in BATCH_META {
            area_arrays.push(ArraySpec::new(Vec::new(), meta.bytes)?);
        }
        let area = Slots::new(&DataSpec::new(area_arrays)?, 2 * batch_size)?;
        let empty = Meta::UNUSED;
        // Twice the most keys it ever holds: removals leave tombstones, and when they use up
        // the spare room the map rehashes in place only while it is at most half full;
        // otherwise it would allocate a bigger table in the middle of an insert.
        let mut keys = HashMap::default();
        keys.try_reserve(2 * slots).map_err(|_| EchoError::OutOfMemory { bytes: slots * 32 })?;
        let state = State {
            meta: vec![empty; slots].into_boxed_slice(),
            free: (0..slots as u32).rev().collect(),
            keys,
            sampler: new_sampler(config.sampler, slots, batch_size)?,
            remover: new_remover(config.remover, slots),
            limiter: RateLimiter::new(config.rate_limit),
            rng: config.seed.map_or_else(Rng::from_entropy, Rng::from_seed),
            draw_slots: vec![0; batch_size].into_boxed_slice(),
            draw_probabilities: vec![0.0; batch_size].into_boxed_slice(),
            max_size: config.max_size,
            max_bytes: config.max_bytes.unwrap_or(u64::MAX),
            max_times_sampled: config.max_times_sampled,
            live: 0,
            writing: 0,
            stored_bytes: 0,
            packed: Arc::clone(&packed),
            next_key: 0,
            max_priority: 1.0,
            stats: ReplayStats::default(),
            parked: Parked::default(),
            copies: None,
            restoring: false,
        };
        let shell = Shell::new(config.rate_limit, batch_size, area);
        Ok(Arc::new(Self {
            spec,
            config,
            storage,
            codecs,
            packed,
            fixed_bytes,
            codec_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            state: Mutex::new(state),
            shell,
        }))
    }

    /// The leaves the table stores compressed, `None` if none.
    pub fn codecs(&self) -> Option<&LeafCodecs> {
        (!self.codecs.is_empty()).then_some(&self.codecs)
    }

    /// The configuration the table was built with.
    pub fn config(&self) -> &ReplayConfig {
        &self.config
    }

    /// The sample layout.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// The single consumer handle; `None` if one was already taken.
    pub fn consumer(self: &Arc<Self>) -> Option<ReplayConsumer> {
        if !self.shell.claim_consumer() {
            return None;
        }
        Some(ReplayConsumer {
            table: Arc::clone(self),
            pending: Vec::with_capacity(self.config.batch_size),
            cursor: BatchCursor::default(),
            holdback: None,
        })
    }

    /// Closes the table: waiting and future inserts fail with `Closed`, `sample` returns
    /// [`EchoError::Closed`]. Idempotent.
    pub fn close(&self) {
        self.shell.close(&self.state.lock());
    }

    /// Whether [`Table::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.shell.is_closed()
    }

    /// Rung whenever a waiting insert might now go further (see [`Backend::insert_bell`]).
    ///
    /// [`Backend::insert_bell`]: crate::backend::Backend::insert_bell
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn insert_bell(&self) -> &AsyncBell {
        self.shell.insert_bell()
    }

    /// Checks one priority as an insert or an update would (takes the lock briefly).
    ///
    /// # Errors
    /// [`EchoError::Priority`] saying what is wrong with it.
    pub fn check_one_priority(&self, priority: f64) -> Result<(), EchoError> {
        let state = self.state.lock();
        check_priority(&*state.sampler, priority)
            .map_err(|msg| EchoError::Priority(format!("priority {msg}")))
    }

    /// Copies every sample of `src` into the table, each as a new item with `priority` (or
    /// the largest priority seen so far), waiting for the rate limiter until `deadline`.
    ///
    /// # Errors
    /// An input error (nothing written) if a sample does not match the spec or the priority is
    /// invalid; [`EchoError::Closed`] / [`EchoError::TimedOut`] with the count inserted so far.
    pub fn insert<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        self.insert_as(src, priority, deadline, false)
    }

    /// [`Table::insert`]; `restorer`: the restore's own insert, which the restore gate lets by.
    fn insert_as<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
        restorer: bool,
    ) -> Result<(), InsertError> {
        validate_source(&self.spec, src)?;
        let small = self.fixed_bytes as usize <= COPY_UNDER_LOCK_BYTES;
        // Compressed leaves are packed without the lock (writers compress in parallel), a
        // group of samples at a time right before they go in: the first group before the lock
        // is taken, the others with it released, so a sample the limiter holds back is not
        // compressed again and again, nor many that never go in (a timeout).
        let (n, group) = (src.num_samples(), self.pack_group(src));
        let mut ahead = self.pack_ahead(src, 0..group.min(n)).into_iter();
        // The deadline bounds the wait for the lock too.
        let mut state =
            lock_until(&self.state, deadline).map_err(|error| InsertError::new(0, error))?;
        check_insert_priorities(&*state.sampler, src, priority)?;
        for sample in 0..n {
            let item = match ahead.next() {
                Some(item) => item,
                None if self.codecs.is_empty() => Box::default(),
                None => {
                    let next = sample..(sample + group).min(n);
                    ahead =
                        MutexGuard::unlocked(&mut state, || self.pack_ahead(src, next)).into_iter();
                    ahead.next().expect("one packed item per sample of the group")
                }
            };
            self.shell
                .wait_writable(&mut state, deadline, |s| {
                    s.insertable() && (restorer || !s.restoring)
                })
                .map_err(|error| InsertError::new(sample, error))?;
            let packed_len = u32::try_from(item.len()).unwrap_or(u32::MAX);
            let bytes = self.fixed_bytes.saturating_add(packed_len);
            let (slot, replaced) = state.reserve(small, bytes);
            self.preserve_for_checkpoint(&mut state, slot);
            if small {
                self.write_item(slot, src, sample, item);
            } else {
                MutexGuard::unlocked(&mut state, || self.write_item(slot, src, sample, item));
            }
            self.publish(&mut state, slot, src.priority(sample).or(priority), replaced);
            src.inserted(1);
        }
        Ok(())
    }

    /// How many samples of `src` an insert packs at a time: one from a source only the
    /// calling thread may read; from one any thread may read ([`SampleSource::shared`]: a
    /// `submit_batch`, a round of wire samples), enough for four parts per codec thread, so a
    /// large insert compresses on every thread while holding only a few MiBs packed ahead.
    fn pack_group<S: SampleSource + ?Sized>(&self, src: &S) -> usize {
        match src.shared() {
            Some(_) if self.codec_threads > 1 => {
                let raw = self.codecs.raw_packed_bytes().max(1);
                (4 * self.codec_threads * codec::COMPRESS_BYTES_PER_THREAD / raw).max(1)
            }
            _ => 1,
        }
    }

    /// The packed items of `samples` of `src` (none without compressed leaves): a sample
    /// that arrived compressed as it is, the others compressed, split over threads when the
    /// source allows it and they add up to enough raw bytes.
    fn pack_ahead<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        samples: std::ops::Range<usize>,
    ) -> Vec<Box<[u8]>> {
        if self.codecs.is_empty() {
            return Vec::new();
        }
        // As it arrived (checked on arrival): no second compression.
        let arrived: Vec<Option<&[u8]>> = samples
            .clone()
            .map(|i| src.packed(i).filter(|item| self.codecs.check_item(item).is_ok()))
            .collect();
        let fresh = arrived.iter().filter(|item| item.is_none()).count();
        let raw = fresh * self.codecs.raw_packed_bytes();
        let threads = codec::threads_for(
            raw,
            codec::COMPRESS_BYTES_PER_THREAD,
            arrived.len(),
            self.codec_threads,
        );
        match src.shared() {
            Some(shared) if threads > 1 => {
                let parts = codec::in_parts(&arrived, threads, |first, part| {
                    let at = samples.start + first;
                    let packed = part.iter().enumerate();
                    packed.map(|(i, item)| self.pack_one(shared, at + i, *item)).collect::<Vec<_>>()
                });
                parts.into_iter().flatten().collect()
            }
            _ => {
                arrived.iter().zip(samples).map(|(item, i)| self.pack_one(src, i, *item)).collect()
            }
        }
    }

    /// Sample `sample`'s packed item: `arrived` as it is, or compressed from `src`.
    fn pack_one<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        sample: usize,
        arrived: Option<&[u8]>,
    ) -> Box<[u8]> {
        arrived.map_or_else(|| self.codecs.pack(src, sample), Box::from)
    }

    /// `State::publish` plus the wake-ups it owes: the consumer may wait for an item, and
    /// when the table goes from no live item to one, writers that found it full of pending
    /// (large, still copying) items may now evict.
    fn publish(&self, state: &mut State, slot: usize, priority: Option<f64>, replaced: bool) {
        state.publish(slot, priority, replaced);
        self.shell.notify_sample();
        if state.live == 1 {
            self.shell.wake_writers();
        }
    }

    /// Invariant 4: saves the snapshot bytes of `slot`, just reserved by this writer (under the
    /// lock, before anything is written to it), if a running checkpoint still needs them.
    fn preserve_for_checkpoint(&self, state: &mut State, slot: usize) {
        let Some(copies) = state.copies.as_mut() else {
            return;
        };
        if !copies.take_pending(slot) {
            return;
        }
        let mut bytes = Vec::with_capacity(self.fixed_bytes as usize);
        let item = match copies.saved_packed.remove(&(slot as u32)) {
            Some(item) => item,
            None => self.packed.get(slot).map(|cell| cell.lock().clone()).unwrap_or_default(),
        };
        for leaf in (0..self.spec.len()).filter(|&leaf| self.codecs.get(leaf).is_none()) {
            // SAFETY: the caller reserved `slot` under the lock it still holds and has not
            // written it yet; the pending bit says no writer reserved it since the snapshot
            // (invariant 4), so nobody writes it while we read (the consumer may read it too).
            unsafe {
                self.storage.read_slots(leaf, slot..slot + 1, |b| bytes.extend_from_slice(b));
            }
        }
        copies.saved.insert(slot as u32, (bytes.into_boxed_slice(), item));
    }

    /// Writes sample `sample` of `src` into `slot`: its leaves stored as they are, and `item`,
    /// its compressed leaves packed (empty when none is compressed).
    fn write_item<S: SampleSource + ?Sized>(
        &self,
        slot: usize,
        src: &S,
        sample: usize,
        item: Box<[u8]>,
    ) {
        for leaf in 0..self.spec.len() {
            if self.codecs.get(leaf).is_some() {
                continue;
            }
            // SAFETY: `reserve` popped `slot` from the free list under the lock and marked it
            // `Writing`; until `publish` nobody else reads or writes it (invariant 1). Sizes
            // were checked by `validate_source`, so `copy_leaf` gets exactly the leaf's size.
            unsafe { self.storage.fill_slot(slot, leaf, |dst| src.copy_leaf(sample, leaf, dst)) };
        }
        if let Some(cell) = self.packed.get(slot) {
            // The slot's previous item (an evicted victim reused in place) is freed here.
            let previous = std::mem::replace(&mut *cell.lock(), item);
            drop(previous);
        }
    }

    /// Appends one item to a checkpoint's chunk `out` (one buffer per leaf): the leaves
    /// stored raw from `stored(leaf, out)` (called in leaf order), the compressed ones from
    /// `item`, its packed item: decompressed, or with `packed_out` as they are, their lengths
    /// pushed onto `lengths`.
    fn emit(
        &self,
        mut stored: impl FnMut(usize, &mut Vec<u8>),
        item: &[u8],
        packed_out: bool,
        lengths: &mut [Vec<u32>],
        out: &mut [Vec<u8>],
    ) {
        let mut k = 0;
        for (leaf, buf) in out.iter_mut().enumerate() {
            if self.codecs.get(leaf).is_none() {
                stored(leaf, buf);
                continue;
            }
            if packed_out {
                let bytes = self.codecs.packed_leaf(item, k).unwrap_or_else(|msg| {
                    debug_assert!(false, "a stored item is malformed: {msg}");
                    &[]
                });
                buf.extend_from_slice(bytes);
                lengths[k].push(bytes.len() as u32);
            } else {
                let start = buf.len();
                buf.resize(start + self.spec.arrays()[leaf].num_bytes(), 0);
                self.unpack(item, k, &mut buf[start..]);
            }
            k += 1;
        }
    }

    /// Decompresses compressed leaf `k` of `item` into `dst`. The table compressed every item
    /// itself (or checked it on arrival), so this cannot fail short of a bug; if it does, the
    /// leaf reads as zeros and the error is logged, rather than failing a learner's batch.
    fn unpack(&self, item: &[u8], k: usize, dst: &mut [u8]) {
        if let Err(msg) = self.codecs.unpack_into(item, k, dst) {
            debug_assert!(false, "a stored item does not decompress: {msg}");
            log::error!("echo replay: a stored item does not decompress ({msg}); zeros instead");
            dst.fill(0);
        }
    }

    /// Sets the priority of every item in `keys` that is still in the table; unknown or
    /// removed keys are skipped and counted. The next batch is drawn with the new priorities.
    /// Returns the number of keys skipped.
    ///
    /// # Errors
    /// [`EchoError::Priority`] (nothing changed) if the lengths differ or a priority is
    /// invalid, naming its index.
    pub fn update_priorities(&self, keys: &[u64], priorities: &[f64]) -> Result<u64, EchoError> {
        let mut state = self.state.lock();
        check_update(&*state.sampler, keys, priorities)?;
        let mut unknown = 0;
        for (&key, &priority) in keys.iter().zip(priorities) {
            let Some(&slot) = state.keys.get(&key) else {
                unknown += 1;
                continue;
            };
            let slot = slot as usize;
            state.meta[slot].priority = priority;
            state.sampler.update(slot, priority);
            state.remover.update(slot, priority);
            state.max_priority = state.max_priority.max(priority);
        }
        state.stats.priority_updates += keys.len() as u64 - unknown;
        state.stats.unknown_keys += unknown;
        Ok(unknown)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ReplayStats {
        let state = self.state.lock();
        ReplayStats {
            size: state.live as u64,
            pending_inserts: state.writing as u64,
            stored_bytes: state.stored_bytes,
            raw_bytes: (state.live + state.writing) as u64 * self.spec.payload_size() as u64,
            insert_blocked_ns: state.stats.insert_blocked_ns
                + self.shell.insert_blocked_outside_ns.get(),
            ..state.stats
        }
    }

    /// Adds `ns` to `insert_blocked_ns`: an insert that does not wait was refused and its
    /// caller waited that long outside the table before trying again (see
    /// `Backend::note_insert_blocked`). Never takes the lock.
    pub fn note_insert_blocked(&self, ns: u64) {
        self.shell.note_insert_blocked(ns);
    }

    /// Writers inside `insert` parked on the rate limiter (or a table full of pending items)
    /// right now. Counted under the table lock, which the wait releases: a test that reads
    /// 1 knows the writer is parked, so it can check a call is blocked without sleeping.
    pub fn waiting_inserts(&self) -> u64 {
        self.state.lock().parked.inserts
    }

    /// 1 while the consumer is parked in `sample` waiting for items or the rate limiter.
    pub fn waiting_samples(&self) -> u64 {
        self.state.lock().parked.samples
    }

    /// The limiter and its counters now, for the message of an insert that timed out.
    pub fn insert_holdback(&self) -> InsertHoldback {
        let state = self.state.lock();
        self.shell.insert_holdback(&state.limiter, (state.live + state.writing) as u64)
    }

    /// `(inserts, samples)` as the rate limiter counts them (inserts when their slot is
    /// reserved, samples per item).
    pub fn limiter_counts(&self) -> (u64, u64) {
        self.state.lock().limiter.counts()
    }

    /// The priority of the item with `key`, `None` if it is not in the table.
    pub fn priority(&self, key: u64) -> Option<f64> {
        let state = self.state.lock();
        state.keys.get(&key).map(|&slot| state.meta[slot as usize].priority)
    }

    /// Address of the first byte of `leaf` in batch-area half `half`: `batch_size` contiguous
    /// values. Leaves `spec.len()..spec.len() + BATCH_META.len()` are the [`BATCH_META`]
    /// values. The bytes are stable until the consumer's second `sample` after the one that
    /// returned `half`.
    pub fn batch_ptr(&self, half: usize, leaf: usize) -> *const u8 {
        self.shell.batch_ptr(half, leaf)
    }

    /// Page-locks the batch area (what a learner copies to the GPU) with `cudaHostRegister`.
    /// Idempotent; unregistered when the table is dropped.
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

    /// Starts a checkpoint: a consistent snapshot of the live items (in key order) and the
    /// table-wide state as of now, taken in one lock hold that copies only metadata. The
    /// items' bytes are then copied with [`Checkpoint::next_chunk`] while inserts and sampling
    /// go on; dropping the checkpoint disarms the copy-on-write marker.
    ///
    /// Inserts still copying their sample (reserved, not yet published) are not in the
    /// snapshot, and the limiter's insert count leaves them out too: the snapshot is the table
    /// as if they had not started. Items drawn into a batch being assembled are counted as
    /// sampled.
    ///
    /// # Errors
    /// [`EchoError::Busy`] if another checkpoint of this table is running.
    pub fn checkpoint(self: &Arc<Self>) -> Result<Checkpoint, EchoError> {
        self.checkpoint_with(|| ()).map(|(checkpoint, ())| checkpoint)
    }

    /// [`Table::checkpoint`], calling `frozen` inside the snapshot's lock hold: no item is
    /// published meanwhile, so it can read what writers hold outside the table (the ingress)
    /// consistently with the snapshot. `frozen` must not touch this table.
    ///
    /// # Errors
    /// [`EchoError::Busy`] if another checkpoint of this table is running.
    pub fn checkpoint_with<R>(
        self: &Arc<Self>,
        frozen: impl FnOnce() -> R,
    ) -> Result<(Checkpoint, R), EchoError> {
        let slots = self.config.max_size + self.config.batch_size;
        // Allocated and written (so its pages exist) before taking the lock: the lock hold
        // is one memcpy of the slots' metadata, not a scan (measured for 1e6 items on a 2-core
        // VM: a scan that collected the live items held the lock 21-32 ms; see the checkpoint
        // guide). Which items are live, and their order, is worked out after the lock.
        let mut snapshot: Arc<[Meta]> = vec![Meta::UNUSED; slots].into();
        let done = vec![false; slots].into_boxed_slice();
        let mut state = self.state.lock();
        if state.copies.is_some() {
            return Err(EchoError::Busy(
                "a checkpoint of this table is already being written".to_owned(),
            ));
        }
        Arc::get_mut(&mut snapshot).expect("not shared yet").copy_from_slice(&state.meta);
        let (inserts, samples) = state.limiter.counts();
        let table_state = TableState {
            inserts: inserts - state.writing as u64,
            samples,
            rng: state.rng.state(),
            next_key: state.next_key,
            max_priority: state.max_priority,
        };
        state.copies = Some(CheckpointCopies {
            snapshot: Arc::clone(&snapshot),
            done,
            saved: HashMap::new(),
            saved_packed: HashMap::new(),
        });
        let out = frozen();
        drop(state);
        let mut rows: Vec<(u64, u32, f64, u32)> = snapshot
            .iter()
            .enumerate()
            .filter(|(_, meta)| meta.state == SlotState::Live)
            .map(|(slot, meta)| (meta.key, slot as u32, meta.priority, meta.times_sampled))
            .collect();
        drop(snapshot);
        rows.sort_unstable_by_key(|row| row.0);
        let items = SnapshotItems {
            keys: rows.iter().map(|row| row.0).collect(),
            priorities: rows.iter().map(|row| row.2).collect(),
            times_sampled: rows.iter().map(|row| row.3).collect(),
        };
        let checkpoint = Checkpoint {
            table: Arc::clone(self),
            slots: rows.iter().map(|row| row.1).collect(),
            items,
            state: table_state,
            next_row: 0,
            packed_out: false,
            lengths: Vec::new(),
        };
        Ok((checkpoint, out))
    }

    /// Inserts a checkpoint's ingress samples (`queued`, each with the priority it was sent
    /// with) after a [`Table::restore`], from a thread named `echo-restore`, waiting for the
    /// rate limiter like any insert; every other insert waits until they are all in (or the
    /// table closes), so nothing new goes in before them. Returns at once.
    ///
    /// # Errors
    /// [`EchoError::Io`] if the thread cannot start (nothing is inserted then).
    pub fn restore_queued(self: &Arc<Self>, queued: QueuedSamples) -> Result<(), EchoError> {
        if queued.is_empty() {
            return Ok(());
        }
        self.state.lock().restoring = true;
        let table = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("echo-restore".into()).spawn(move || {
            for i in 0..queued.len() {
                let payload = [queued.payload(i)];
                let result = crate::source::Payloads::new(&table.spec, &payload[..])
                    .map_err(InsertError::from)
                    .and_then(|src| table.insert_as(&src, queued.priorities[i], None, true));
                match result {
                    Ok(()) => {}
                    Err(InsertError { error: EchoError::Closed, .. }) => break,
                    Err(err) => log::error!("echo restore: dropping a queued sample: {err}"),
                }
            }
            table.end_restore();
        });
        if let Err(err) = spawned {
            self.end_restore();
            return Err(EchoError::Io(err));
        }
        Ok(())
    }

    /// Whether a restore's ingress samples are still going in.
    pub fn is_restoring(&self) -> bool {
        self.state.lock().restoring
    }

    fn end_restore(&self) {
        self.state.lock().restoring = false;
        self.shell.wake_writers();
    }

    /// Fills a new, empty table with a checkpoint's items (in key order, `leaves[l]` holding
    /// leaf `l` of every item back to back) and state, so that it samples, evicts, paces and
    /// numbers new items exactly as the checkpointed table would have.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming what does not fit (nothing is inserted then): the table is
    /// not new, lengths differ, more items than `max_size`, keys not increasing or not below
    /// `next_key`, an invalid priority, a count at `max_times_sampled`, an all-zero RNG state.
    pub fn restore(
        &self,
        items: &SnapshotItems,
        saved: &TableState,
        leaves: &[&[u8]],
    ) -> Result<(), EchoError> {
        let rows: Vec<LeafRows<'_>> = leaves.iter().map(|&bytes| LeafRows::Raw(bytes)).collect();
        self.restore_rows(items, saved, &rows)
    }

    /// [`Table::restore`] from rows that may come compressed ([`LeafRows::Packed`], as
    /// [`Checkpoint::keep_packed`] hands them out): a leaf this table compresses with the same
    /// codec is stored as it comes (no second compression); otherwise it is decompressed
    /// (and compressed again if this table compresses it another way).
    ///
    /// # Errors
    /// As [`Table::restore`]; also packed rows whose lengths do not add up, or a compressed
    /// row that does not decompress to its leaf's size (nothing is inserted then).
    pub fn restore_rows(
        &self,
        items: &SnapshotItems,
        saved: &TableState,
        leaves: &[LeafRows<'_>],
    ) -> Result<(), EchoError> {
        let config = |msg: String| Err(EchoError::Config(format!("restore: {msg}")));
        let n = items.keys.len();
        if items.priorities.len() != n || items.times_sampled.len() != n {
            return config(format!(
                "{n} keys, {} priorities and {} times_sampled: one of each per item",
                items.priorities.len(),
                items.times_sampled.len()
            ));
        }
        if n > self.config.max_size {
            return config(format!("{n} items do not fit max_size {}", self.config.max_size));
        }
        if leaves.len() != self.spec.len() {
            return config(format!("{} leaves, the layout has {}", leaves.len(), self.spec.len()));
        }
        // Where each item's row starts in each leaf's bytes.
        let mut starts: Vec<Vec<usize>> = Vec::with_capacity(leaves.len());
        for (leaf, (rows, array)) in leaves.iter().zip(self.spec.arrays()).enumerate() {
            match *rows {
                LeafRows::Raw(bytes) => {
                    if Some(bytes.len()) != n.checked_mul(array.num_bytes()) {
                        return config(format!(
                            "leaf {leaf}: {} bytes for {n} items of {} bytes",
                            bytes.len(),
                            array.num_bytes()
                        ));
                    }
                    starts.push((0..=n).map(|i| i * array.num_bytes()).collect());
                }
                LeafRows::Packed { bytes, lengths, .. } => {
                    if lengths.len() != n {
                        return config(format!(
                            "leaf {leaf}: {} compressed lengths for {n} items",
                            lengths.len()
                        ));
                    }
                    let mut at = vec![0usize; n + 1];
                    for i in 0..n {
                        at[i + 1] = at[i] + lengths[i] as usize;
                    }
                    if at[n] != bytes.len() {
                        return config(format!(
                            "leaf {leaf}: compressed lengths add up to {} bytes, the rows hold {}",
                            at[n],
                            bytes.len()
                        ));
                    }
                    starts.push(at);
                }
            }
        }
        // Every row this table stores raw or compresses another way, decoded and checked before
        // anything is inserted (rows kept as they come were checked by their file's digest).
        let mut items_packed: Vec<Box<[u8]>> = Vec::with_capacity(n);
        let mut raw_rows: Vec<Vec<u8>> = vec![Vec::new(); leaves.len()];
        for (leaf, rows) in leaves.iter().enumerate() {
            if let LeafRows::Packed { codec, bytes, .. } = *rows {
                if self.codecs.get(leaf) == Some(codec) {
                    continue;
                }
                let size = self.spec.arrays()[leaf].num_bytes();
                let mut raw = vec![0u8; n * size];
                for i in 0..n {
                    let row = &bytes[starts[leaf][i]..starts[leaf][i + 1]];
                    if let Err(msg) = codec.decompress_into(row, &mut raw[i * size..(i + 1) * size])
                    {
                        return config(format!("leaf {leaf}, item {i}: {msg}"));
                    }
                }
                raw_rows[leaf] = raw;
            }
        }
        let row = |leaf: usize, i: usize| -> &[u8] {
            match leaves[leaf] {
                LeafRows::Packed { bytes, .. } if raw_rows[leaf].is_empty() => {
                    &bytes[starts[leaf][i]..starts[leaf][i + 1]]
                }
                LeafRows::Packed { .. } => {
                    let size = self.spec.arrays()[leaf].num_bytes();
                    &raw_rows[leaf][i * size..(i + 1) * size]
                }
                LeafRows::Raw(bytes) => &bytes[starts[leaf][i]..starts[leaf][i + 1]],
            }
        };
        if !self.codecs.is_empty() {
            let packed = self.codecs.packed_leaves();
            for i in 0..n {
                let mut item = vec![0u8; 4 * packed.len()];
                for (k, &leaf) in packed.iter().enumerate() {
                    let codec = self.codecs.get(leaf).expect("a packed leaf has a codec");
                    let before = item.len();
                    match leaves[leaf] {
                        LeafRows::Packed { codec: theirs, .. } if theirs == codec => {
                            let bytes = row(leaf, i);
                            let size = self.spec.arrays()[leaf].num_bytes();
                            if !codec.plausible(bytes, size) {
                                return config(format!(
                                    "leaf {leaf}, item {i}: not {} data of {size} bytes",
                                    codec.name()
                                ));
                            }
                            item.extend_from_slice(bytes);
                        }
                        _ => codec.compress_append(row(leaf, i), &mut item),
                    }
                    let len = u32::try_from(item.len() - before).map_err(|_| {
                        EchoError::Config(format!("restore: leaf {leaf}, item {i} is too large"))
                    })?;
                    item[4 * k..4 * k + 4].copy_from_slice(&len.to_le_bytes());
                }
                items_packed.push(item.into_boxed_slice());
            }
        }
        if let Some(i) = items.keys.windows(2).position(|w| w[0] >= w[1]) {
            return config(format!("keys must increase, but keys[{}] >= keys[{}]", i, i + 1));
        }
        if items.keys.last().is_some_and(|&last| last >= saved.next_key) {
            return config(format!("keys must be below next_key {}", saved.next_key));
        }
        let k = self.config.max_times_sampled;
        if let Some(i) = items.times_sampled.iter().position(|&t| k > 0 && t >= k) {
            return config(format!(
                "times_sampled[{i}] = {} has reached max_times_sampled {k}",
                items.times_sampled[i]
            ));
        }
        let rng = Rng::from_state(saved.rng).map_or_else(
            || Err(EchoError::Config("restore: the RNG state is all zeros".to_owned())),
            Ok,
        )?;
        let mut state = self.state.lock();
        for (i, &priority) in items.priorities.iter().enumerate() {
            check_priority(&*state.sampler, priority)
                .map_err(|msg| EchoError::Config(format!("restore: priorities[{i}] {msg}")))?;
        }
        check_priority(&*state.sampler, saved.max_priority)
            .map_err(|msg| EchoError::Config(format!("restore: max_priority {msg}")))?;
        if state.live + state.writing > 0 || state.stats.inserted > 0 || state.copies.is_some() {
            return config("the table is not new".to_owned());
        }
        let mut items_packed = items_packed.into_iter();
        for i in 0..n {
            let slot = state.free.pop().expect("n <= max_size slots are free") as usize;
            for leaf in 0..leaves.len() {
                if self.codecs.get(leaf).is_some() {
                    continue;
                }
                // SAFETY: `slot` was just popped from the free list under the lock we hold and
                // is not published yet: nobody else reads or writes it (invariant 1). Sizes
                // were checked above (raw rows, and decompressed ones by their codec); the
                // bytes are caller memory or ours, not the table.
                unsafe { self.storage.write_slot(slot, leaf, row(leaf, i)) };
            }
            let mut stored = self.fixed_bytes;
            if let Some(cell) = self.packed.get(slot) {
                let item = items_packed.next().expect("one packed item per row");
                stored = stored.saturating_add(u32::try_from(item.len()).unwrap_or(u32::MAX));
                *cell.lock() = item;
            }
            state.stored_bytes += u64::from(stored);
            let (key, priority) = (items.keys[i], items.priorities[i]);
            let times_sampled = items.times_sampled[i];
            state.meta[slot] =
                Meta { key, priority, times_sampled, pins: 0, stored, state: SlotState::Live };
            state.keys.insert(key, slot as u32);
            state.sampler.insert(slot, priority);
            state.remover.insert(slot, priority);
            state.live += 1;
        }
        state.limiter.set_counts(saved.inserts, saved.samples);
        state.rng = rng;
        state.next_key = saved.next_key;
        state.max_priority = saved.max_priority;
        drop(state);
        self.shell.notify_sample();
        Ok(())
    }
}

/// One leaf's rows for [`Table::restore_rows`]: every item's bytes back to back.
#[derive(Debug, Clone, Copy)]
pub enum LeafRows<'a> {
    /// Raw: each row is the leaf's size.
    Raw(&'a [u8]),
    /// Compressed by `codec`, row `i` being `lengths[i]` bytes.
    Packed {
        /// How the rows are compressed.
        codec: Codec,
        /// The rows, back to back.
        bytes: &'a [u8],
        /// Each row's length.
        lengths: &'a [u32],
    },
}

/// The table-wide values a checkpoint saves besides the items.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableState {
    /// The rate limiter's insert count (inserts still copying at the snapshot left out).
    pub inserts: u64,
    /// The rate limiter's sample count (items drawn).
    pub samples: u64,
    /// The sampler's RNG state (xoshiro256++), never all zeros.
    pub rng: [u64; 4],
    /// The key the next item gets.
    pub next_key: u64,
    /// The priority new items get (the largest priority seen so far).
    pub max_priority: f64,
}

/// A snapshot's items in key (insertion) order, one entry per item in each array.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SnapshotItems {
    /// Each item's key.
    pub keys: Vec<u64>,
    /// Each item's priority.
    pub priorities: Vec<f64>,
    /// How many times each item was sampled.
    pub times_sampled: Vec<u32>,
}

/// A running checkpoint of a [`Table`] (from [`Table::checkpoint`]): the snapshot's metadata,
/// and the items' bytes still to copy with [`Checkpoint::next_chunk`]. At most one per table.
pub struct Checkpoint {
    table: Arc<Table>,
    items: SnapshotItems,
    state: TableState,
    /// The slot each snapshot item was in, in key order.
    slots: Vec<u32>,
    /// Items whose bytes were handed out by `next_chunk` so far.
    next_row: usize,
    /// `next_chunk` hands out compressed leaves as they are stored ([`Checkpoint::keep_packed`]).
    packed_out: bool,
    /// With `packed_out`: each handed-out item's bytes of each compressed leaf, per
    /// compressed leaf ([`LeafCodecs::packed_leaves`] order).
    lengths: Vec<Vec<u32>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("items", &self.slots.len())
            .field("next_row", &self.next_row)
            .finish_non_exhaustive()
    }
}

impl Checkpoint {
    /// The snapshot's items (keys, priorities, times sampled), in key order.
    pub fn items(&self) -> &SnapshotItems {
        &self.items
    }

    /// The snapshot's table-wide state.
    pub fn state(&self) -> &TableState {
        &self.state
    }

    /// The table's sample layout (what each leaf's rows hold).
    pub fn spec(&self) -> &DataSpec {
        &self.table.spec
    }

    /// Items in the snapshot.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the snapshot holds no item.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The leaves the table stores compressed, `None` if none.
    pub fn codecs(&self) -> Option<&LeafCodecs> {
        self.table.codecs()
    }

    /// From now on [`Checkpoint::next_chunk`] hands out each compressed leaf as it is stored
    /// (its compressed bytes, item after item, of varying length: see
    /// [`Checkpoint::packed_lengths`]) instead of decompressing it. Call it before the first
    /// chunk; a no-op when no leaf is compressed.
    pub fn keep_packed(&mut self) {
        if let Some(codecs) = self.table.codecs() {
            self.packed_out = true;
            self.lengths = vec![Vec::with_capacity(self.slots.len()); codecs.packed_leaves().len()];
        }
    }

    /// After [`Checkpoint::keep_packed`]: per compressed leaf, the bytes each item handed out
    /// so far takes in it, in key order.
    pub fn packed_lengths(&self) -> &[Vec<u32>] {
        &self.lengths
    }

    /// Copies the bytes of the next items (in key order), about `max_bytes` of them but at
    /// least one item, into `out`: `out[l]` is cleared and then holds leaf `l` of each item
    /// back to back (compressed as stored, after [`Checkpoint::keep_packed`], for the
    /// compressed leaves). One lock hold per call. Returns the number of items; 0 when done.
    ///
    /// # Panics
    /// If `out` does not have one buffer per leaf.
    pub fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
        let table = &*self.table;
        let spec = &table.spec;
        assert_eq!(out.len(), spec.len(), "one buffer per leaf");
        for buf in out.iter_mut() {
            buf.clear();
        }
        let n =
            (max_bytes / spec.payload_size().max(1)).max(1).min(self.slots.len() - self.next_row);
        if n == 0 {
            return 0;
        }
        let rows = self.next_row..self.next_row + n;
        let (packed_out, lengths) = (self.packed_out, &mut self.lengths);
        let mut state = table.state.lock();
        let copies = state.copies.as_mut().expect("armed while the checkpoint lives");
        for &slot in &self.slots[rows] {
            if copies.take_pending(slot as usize) {
                let freed = copies.saved_packed.remove(&slot);
                let slot = slot as usize;
                let cell = table.packed.get(slot).map(|cell| cell.lock());
                let item: &[u8] = match (&freed, &cell) {
                    (Some(item), _) => item,
                    (None, Some(cell)) => cell,
                    (None, None) => &[],
                };
                let stored = |leaf: usize, out: &mut Vec<u8>| {
                    // SAFETY: the pending bit says no writer reserved `slot` since the
                    // snapshot (invariant 4), and none can while we hold the lock, so its
                    // bytes are the snapshot item's and nobody writes them during the read.
                    unsafe {
                        table
                            .storage
                            .read_slots(leaf, slot..slot + 1, |b| out.extend_from_slice(b));
                    }
                };
                table.emit(stored, item, packed_out, lengths, out);
            } else {
                let (fixed, item) =
                    copies.saved.remove(&slot).expect("a reused snapshot slot was saved");
                let mut at = 0;
                let stored = |leaf: usize, out: &mut Vec<u8>| {
                    let len = spec.arrays()[leaf].num_bytes();
                    out.extend_from_slice(&fixed[at..at + len]);
                    at += len;
                };
                table.emit(stored, &item, packed_out, lengths, out);
            }
        }
        drop(state);
        self.next_row += n;
        n
    }
}

impl Drop for Checkpoint {
    fn drop(&mut self) {
        // Taken out under the lock, freed after it.
        let copies = self.table.state.lock().copies.take();
        drop(copies);
    }
}

/// The one consumer of a [`Table`]. `sample` takes `&mut self`: one batch at a time.
#[derive(Debug)]
pub struct ReplayConsumer {
    table: Arc<Table>,
    /// Items drawn for the batch being assembled (kept across a timed-out `sample`).
    pending: Vec<Drawn>,
    /// The batch-area half the next batch goes into, and its number.
    cursor: BatchCursor,
    /// What held the last `sample` back when it timed out (`None` after a batch).
    holdback: Option<SampleHoldback>,
}

impl ReplayConsumer {
    /// The table this consumer reads.
    pub fn table(&self) -> &Arc<Table> {
        &self.table
    }

    /// Draws the next batch and copies it into the batch area (the half not returned by the
    /// previous call), waiting for items and the rate limiter until `deadline`.
    ///
    /// The batch is drawn in rounds of what the limiter allows. If the deadline passes
    /// part-way, the items drawn so far stay reserved for the next call (nothing is drawn
    /// twice or lost).
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the table is closed, [`EchoError::TimedOut`] when the
    /// deadline passes first.
    pub fn sample(&mut self, deadline: Option<Instant>) -> Result<ReplayBatch, EchoError> {
        let table = &*self.table;
        let mut state = table.state.lock();
        let pending = &mut self.pending;
        table.shell.draw_rounds(
            &mut state,
            deadline,
            pending.len(),
            &mut self.holdback,
            |state, n| state.draw(n, pending),
        )?;
        self.holdback = None;
        drop(state);
        self.gather();
        let mut state = table.state.lock();
        for drawn in self.pending.drain(..) {
            state.unpin(drawn.slot);
        }
        state.stats.batches += 1;
        drop(state);
        Ok(self.cursor.advance())
    }

    /// What held the last `sample` back when its deadline passed: the rate limiter's counters
    /// then, for a timeout message. `None` once a batch was handed out since.
    pub fn holdback(&self) -> Option<SampleHoldback> {
        self.holdback
    }

    /// Copies the pending items into the batch-area half the cursor points at.
    fn gather(&self) {
        let table = &*self.table;
        let base = self.cursor.half() * table.config.batch_size;
        let leaves = table.spec.len();
        for leaf in 0..leaves {
            if table.codecs.get(leaf).is_some() {
                continue;
            }
            for (i, drawn) in self.pending.iter().enumerate() {
                let slot = drawn.slot;
                // SAFETY: `slot` is pinned by this consumer (invariant 2): it is `Live` or
                // `Retired`, and writers only write `Free` slots, so its bytes are stable
                // until `unpin` below.
                unsafe {
                    table.storage.read_slots(leaf, slot..slot + 1, |src| {
                        self.write_area(base + i, leaf, src)
                    })
                }
            }
        }
        if !table.codecs.is_empty() {
            self.gather_packed(base);
        }
        for (i, drawn) in self.pending.iter().enumerate() {
            drawn.write_meta(|m, bytes| self.write_area(base + i, leaves + m, bytes));
        }
    }

    /// Decompresses the pending items' compressed leaves into the batch area from slot
    /// `base` on: straight into the batch (one decompression, no copy after it), on several
    /// threads when the batch is large enough to repay starting them.
    fn gather_packed(&self, base: usize) {
        let table = &*self.table;
        let raw = table.codecs.raw_packed_bytes() * self.pending.len();
        let threads = codec::threads_for(
            raw,
            codec::DECOMPRESS_BYTES_PER_THREAD,
            self.pending.len(),
            table.codec_threads,
        );
        codec::in_parts(&self.pending, threads, |first, drawn| {
            for (i, d) in drawn.iter().enumerate() {
                let item = table.packed[d.slot].lock();
                for (k, &leaf) in table.codecs.packed_leaves().iter().enumerate() {
                    // SAFETY: only this consumer writes the batch area (`sample` takes `&mut
                    // self`; see `write_area` for views of older batches), and each thread
                    // writes its own slots `base + first + i`. The item is pinned: no writer
                    // changes its cell while we read it (the cell's lock is held anyway).
                    unsafe {
                        table.shell.area().fill_slot(base + first + i, leaf, |dst| {
                            table.unpack(&item, k, dst);
                        });
                    }
                }
            }
        });
    }

    /// Calls `f` with the bytes of `leaf` (a sample leaf, then the [`BATCH_META`] values) of
    /// the batch `batch` (from this consumer's `sample`): `batch_size` values back to back.
    ///
    /// # Panics
    /// If `leaf` is out of range.
    pub fn read_leaf<T>(&self, batch: ReplayBatch, leaf: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        // SAFETY: only this consumer writes the batch area, in `sample` (`&mut self`), which
        // cannot run while `&self` is borrowed here.
        unsafe { self.table.shell.read_batch(batch, leaf, f) }
    }

    fn write_area(&self, slot: usize, leaf: usize, src: &[u8]) {
        // Numpy views of this half from two calls ago may still be read by Python: the
        // documented lifetime rule (a batch is stable until the second `sample` after it)
        // makes that the user's stale read of memory that stays allocated, as with FIFO.
        // SAFETY: only this consumer (one per table, `&mut self` in `sample`) writes the
        // batch area, and `src` is table storage or a local, never the area.
        unsafe { self.table.shell.area().write_slot(slot, leaf, src) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Leaves;
    use std::time::Duration;

    fn spec() -> DataSpec {
        DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap()
    }

    fn table(config: ReplayConfig) -> Arc<Table> {
        Table::new(spec(), config).unwrap()
    }

    fn put(table: &Table, id: u64) {
        let bytes = id.to_ne_bytes();
        table.insert(&Leaves(&[&bytes]), None, None).unwrap();
    }

    /// Polls `done` until it holds; fails the test if that takes 10 s (a hang).
    fn wait_until(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "{what}: not within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn ids(consumer: &mut ReplayConsumer, batch: ReplayBatch) -> Vec<u64> {
        let n = consumer.table.config.batch_size;
        let ptr = consumer.table.batch_ptr(batch.half, 0).cast::<u64>();
        // SAFETY: test-only read of a batch this consumer just assembled.
        (0..n).map(|i| unsafe { ptr.wrapping_add(i).read_unaligned() }).collect()
    }

    #[test]
    fn config_errors_name_the_parameter() {
        let err = |c: ReplayConfig| Table::new(spec(), c).unwrap_err().to_string();
        assert!(err(ReplayConfig::new(0, 4)).contains("batch_size must be >= 1, got 0"));
        assert!(err(ReplayConfig::new(8, 4)).contains("max_size must be >= batch_size (8), got 4"));
        assert!(err(ReplayConfig::new(1, u32::MAX as usize)).contains("below 2^32 - 1"));
        let mut c = ReplayConfig::new(4, 16);
        c.sampler = SamplerKind::Prioritized { exponent: -1.0 };
        assert!(err(c).contains("exponent must be a finite number >= 0, got -1"));
    }

    #[test]
    fn full_table_evicts_oldest_and_keys_are_insertion_order() {
        let t = table(ReplayConfig { seed: Some(1), ..ReplayConfig::new(2, 3) });
        for id in 0..5 {
            put(&t, id);
        }
        let stats = t.stats();
        assert_eq!((stats.size, stats.inserted, stats.evicted), (3, 5, 2));
        assert_eq!(t.priority(1), None, "key 1 was evicted");
        assert_eq!(t.priority(2), Some(1.0));
        let mut c = t.consumer().unwrap();
        for _ in 0..20 {
            let b = c.sample(None).unwrap();
            assert!(ids(&mut c, b).iter().all(|id| (2..5).contains(id)));
        }
    }

    #[test]
    fn max_times_sampled_removes_after_exactly_k_draws() {
        let mut config = ReplayConfig::new(3, 10);
        config.max_times_sampled = 2;
        config.seed = Some(4);
        let t = table(config);
        for id in 0..6 {
            put(&t, id);
        }
        let mut c = t.consumer().unwrap();
        let mut counts = [0u32; 6];
        for _ in 0..4 {
            let b = c.sample(Some(Instant::now() + Duration::from_secs(5))).unwrap();
            for id in ids(&mut c, b) {
                counts[id as usize] += 1;
            }
        }
        assert_eq!(counts, [2; 6], "12 draws from 6 items with k = 2");
        assert_eq!(t.stats().size, 0);
        assert_eq!(t.stats().removed_max_times_sampled, 6);
        let timed_out = c.sample(Some(Instant::now() + Duration::from_millis(20)));
        assert!(matches!(timed_out, Err(EchoError::TimedOut)));
        let holdback = c.holdback().expect("a timed-out sample records what held it back");
        assert_eq!((holdback.inserts, holdback.samples, holdback.live), (6, 12, 0));
        assert!(!holdback.is_rate_limited(), "an empty table, not the limiter");
    }

    #[test]
    fn a_timed_out_partial_batch_is_finished_by_the_next_call() {
        let mut config = ReplayConfig::new(4, 10);
        config.max_times_sampled = 1;
        let t = table(config);
        let mut c = t.consumer().unwrap();
        put(&t, 10);
        put(&t, 11);
        assert!(matches!(c.sample(Some(Instant::now())), Err(EchoError::TimedOut)));
        let holdback = c.holdback().unwrap();
        assert_eq!((holdback.drawn, holdback.batch_size, holdback.live), (2, 4, 0));
        put(&t, 12);
        put(&t, 13);
        let b = c.sample(None).unwrap();
        assert_eq!(c.holdback(), None, "a batch clears the last timeout's holdback");
        let mut got = ids(&mut c, b);
        got.sort_unstable();
        assert_eq!(got, [10, 11, 12, 13]);
    }

    #[test]
    fn retired_slots_are_not_reused_while_pinned() {
        // max_size 1, batch 1: every insert evicts. Fill, draw (pins), and check the slot count
        // never runs out while inserts evict the pinned item.
        let t = table(ReplayConfig::new(1, 1));
        let mut c = t.consumer().unwrap();
        for id in 0..100 {
            put(&t, id);
            let b = c.sample(None).unwrap();
            assert_eq!(ids(&mut c, b), [id]);
        }
    }

    #[test]
    fn close_wakes_a_waiting_consumer_and_writer() {
        let mut config = ReplayConfig::new(1, 4);
        config.rate_limit = RateLimit::Queue(1);
        let t = table(config);
        put(&t, 0);
        let writer = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || t.insert(&Leaves(&[&[0u8; 8]]), None, None))
        };
        let mut c = t.consumer().unwrap();
        c.sample(None).unwrap();
        c.sample(None).unwrap(); // the writer's item
        let consumer = std::thread::spawn(move || c.sample(None));
        wait_until("the consumer parks", || t.waiting_samples() == 1);
        assert!(!consumer.is_finished(), "nothing to sample: the consumer must be waiting");
        t.close();
        assert!(writer.join().unwrap().is_ok());
        assert!(matches!(consumer.join().unwrap(), Err(EchoError::Closed)));
        assert!(matches!(put_err(&t), InsertError { inserted: 0, error: EchoError::Closed }));
    }

    fn put_err(t: &Table) -> InsertError {
        t.insert(&Leaves(&[&[0u8; 8]]), None, None).unwrap_err()
    }

    #[test]
    fn the_key_map_never_grows_however_many_items_pass_through() {
        for remover in [RemoverKind::Fifo, RemoverKind::Lifo, RemoverKind::MinPriority] {
            let t = table(ReplayConfig { remover, ..ReplayConfig::new(4, 100) });
            let capacity = t.state.lock().keys.capacity();
            for id in 0..200_000 {
                put(&t, id);
            }
            let state = t.state.lock();
            // Tombstones lower `capacity()` until the next in-place rehash; only a reallocation
            // (to a bigger table) can raise it.
            assert!(state.keys.capacity() <= capacity, "{remover:?}: the map reallocated");
            assert_eq!(state.keys.len(), 100);
        }
    }

    #[test]
    fn a_writer_waiting_on_a_table_full_of_pending_items_is_woken_by_a_publish() {
        // max_size 2 with both slots reserved by (simulated) large inserts still copying: no
        // live item to evict, so a third insert must wait until one is published, and that
        // publish alone (no sample) must wake it.
        let t = table(ReplayConfig::new(1, 2));
        let (first, second) = {
            let mut state = t.state.lock();
            (state.reserve(false, 8).0, state.reserve(false, 8).0)
        };
        let writer = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || {
                let bytes = 7u64.to_ne_bytes();
                t.insert(&Leaves(&[&bytes]), None, Some(Instant::now() + Duration::from_secs(10)))
            })
        };
        wait_until("the third insert parks", || t.waiting_inserts() == 1);
        assert!(!writer.is_finished(), "the third insert cannot proceed yet");
        let started = Instant::now();
        t.publish(&mut t.state.lock(), first, None, false);
        writer.join().unwrap().unwrap();
        assert!(started.elapsed() < Duration::from_secs(5), "woken by the publish");
        t.publish(&mut t.state.lock(), second, None, false);
        let stats = t.stats();
        assert_eq!((stats.size, stats.inserted, stats.evicted), (2, 3, 1));
    }

    #[test]
    fn update_priorities_counts_unknown_keys_and_rejects_bad_values_atomically() {
        let mut config = ReplayConfig::new(1, 4);
        config.sampler = SamplerKind::Prioritized { exponent: 1.0 };
        let t = table(config);
        put(&t, 0);
        put(&t, 1);
        assert_eq!(t.update_priorities(&[0, 1, 99], &[2.0, 3.0, 4.0]).unwrap(), 1);
        assert_eq!((t.priority(0), t.priority(1)), (Some(2.0), Some(3.0)));
        let err = t.update_priorities(&[0, 1], &[5.0, f64::NAN]).unwrap_err().to_string();
        assert!(err.contains("priorities[1] must be a finite number >= 0, got NaN"), "{err}");
        assert_eq!(t.priority(0), Some(2.0), "nothing changes on error");
        let err = t.update_priorities(&[0], &[]).unwrap_err().to_string();
        assert!(err.contains("got 1 keys and 0 priorities"), "{err}");
        // New items get the largest priority seen so far.
        put(&t, 2);
        assert_eq!(t.priority(2), Some(3.0));
        let s = t.stats();
        assert_eq!((s.priority_updates, s.unknown_keys), (2, 1));
    }

    /// Every chunk of `ckpt` (at most `max_bytes` each), leaf by leaf.
    fn drain(ckpt: &mut Checkpoint, max_bytes: usize) -> Vec<Vec<u8>> {
        let leaves = ckpt.spec().len();
        let mut all = vec![Vec::new(); leaves];
        let mut chunk = vec![Vec::new(); leaves];
        while ckpt.next_chunk(max_bytes, &mut chunk) > 0 {
            for (all, chunk) in all.iter_mut().zip(&chunk) {
                all.extend_from_slice(chunk);
            }
        }
        all
    }

    fn u64s(bytes: &[u8]) -> Vec<u64> {
        bytes.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn a_checkpoint_keeps_its_snapshot_when_every_slot_is_reused_before_it_is_copied() {
        // Small items: evictions reuse the victim's slot in place; the copy-on-write must save
        // each snapshot item before its slot is overwritten.
        let t = table(ReplayConfig::new(2, 4));
        for id in 0..4 {
            put(&t, id);
        }
        let mut ckpt = t.checkpoint().unwrap();
        for id in 100..112 {
            put(&t, id);
        }
        assert_eq!(ckpt.items().keys, [0, 1, 2, 3]);
        assert_eq!(u64s(&drain(&mut ckpt, 8)[0]), [0, 1, 2, 3]);
        assert!(
            t.state.lock().copies.as_ref().unwrap().saved.is_empty(),
            "saved bytes are consumed"
        );
        drop(ckpt);
        assert!(t.state.lock().copies.is_none(), "dropping the checkpoint disarms the marker");
    }

    #[test]
    fn a_checkpoint_of_large_items_survives_slots_freed_by_sampling_and_reused() {
        // Large items (copied outside the lock, from the free list) and max_times_sampled = 1:
        // sampling retires and frees the snapshot's slots, and new inserts reuse them.
        const LEN: usize = 8192;
        let spec = DataSpec::new(vec![ArraySpec::new(vec![LEN], 1).unwrap()]).unwrap();
        let config =
            ReplayConfig { max_times_sampled: 1, seed: Some(3), ..ReplayConfig::new(2, 6) };
        let t = Table::new(spec, config).unwrap();
        let put_big = |id: u8| t.insert(&Leaves(&[&[id; LEN]]), None, None).unwrap();
        for id in 0..6 {
            put_big(id);
        }
        let mut c = t.consumer().unwrap();
        c.sample(None).unwrap();
        let mut ckpt = t.checkpoint().unwrap();
        assert_eq!(ckpt.len(), 4, "two items were removed by the first batch");
        for _ in 0..2 {
            c.sample(None).unwrap();
        }
        for id in 10..16 {
            put_big(id);
        }
        let data = drain(&mut ckpt, 3 * LEN).remove(0);
        let ids: Vec<u64> = ckpt.items().keys.clone();
        for (row, &key) in data.chunks_exact(LEN).zip(&ids) {
            assert!(row.iter().all(|&b| u64::from(b) == key), "item {key} intact");
        }
        assert!(ckpt.items().times_sampled.iter().all(|&n| n == 0));
    }

    #[test]
    fn one_checkpoint_at_a_time_per_table() {
        let t = table(ReplayConfig::new(1, 4));
        put(&t, 0);
        let first = t.checkpoint().unwrap();
        assert!(matches!(t.checkpoint(), Err(EchoError::Busy(_))));
        drop(first);
        assert_eq!(t.checkpoint().unwrap().len(), 1);
    }

    #[test]
    fn restore_reproduces_items_state_and_the_next_key() {
        for remover in [RemoverKind::Fifo, RemoverKind::Lifo, RemoverKind::MinPriority] {
            let mut config = ReplayConfig::new(2, 5);
            config.sampler = SamplerKind::Prioritized { exponent: 0.5 };
            config.remover = remover;
            config.seed = Some(11);
            let t = table(config.clone());
            for id in 0..8u64 {
                t.insert(&Leaves(&[&id.to_ne_bytes()]), Some(1.0 + (id % 3) as f64), None).unwrap();
            }
            let mut c = t.consumer().unwrap();
            c.sample(None).unwrap();
            let mut ckpt = t.checkpoint().unwrap();
            let data = drain(&mut ckpt, 1 << 20);
            let (items, saved) = (ckpt.items().clone(), *ckpt.state());
            let r = table(ReplayConfig { seed: Some(99), ..config });
            r.restore(&items, &saved, &[&data[0]]).unwrap();
            assert_eq!(r.limiter_counts(), t.limiter_counts(), "{remover:?}");
            for (&key, &priority) in items.keys.iter().zip(&items.priorities) {
                assert_eq!(r.priority(key), Some(priority));
            }
            // The same victim next, and the same key for the next item.
            let victim = |t: &Table| {
                let state = t.state.lock();
                state.meta[state.remover.victim().unwrap()].key
            };
            assert_eq!(victim(&r), victim(&t), "{remover:?}");
            assert_eq!(live_items(&r), live_items(&t), "{remover:?}");
            drop(ckpt);
            put(&r, 100);
            put(&t, 100);
            assert_eq!(live_items(&r), live_items(&t), "the same eviction and next key");
            assert!(r.restore(&items, &saved, &[&data[0]]).is_err(), "only a new table");
        }
    }

    /// `(key, priority, times_sampled)` of every live item, in key order.
    fn live_items(t: &Table) -> Vec<(u64, f64, u32)> {
        let state = t.state.lock();
        let mut rows: Vec<_> = state
            .meta
            .iter()
            .filter(|m| m.state == SlotState::Live)
            .map(|m| (m.key, m.priority, m.times_sampled))
            .collect();
        rows.sort_unstable_by_key(|r| r.0);
        rows
    }

    #[test]
    fn restore_rejects_inconsistent_input_and_inserts_nothing() {
        let t = table(ReplayConfig::new(1, 4));
        let items = SnapshotItems {
            keys: vec![3, 2],
            priorities: vec![1.0, 1.0],
            times_sampled: vec![0, 0],
        };
        let saved = TableState {
            inserts: 4,
            samples: 0,
            rng: [1, 2, 3, 4],
            next_key: 4,
            max_priority: 1.0,
        };
        let data = [0u8; 16];
        let err = t.restore(&items, &saved, &[&data]).unwrap_err().to_string();
        assert!(err.contains("keys must increase"), "{err}");
        let err = t.restore(&items, &saved, &[&data[..8]]).unwrap_err().to_string();
        assert!(err.contains("leaf 0: 8 bytes for 2 items"), "{err}");
        let zero = TableState { rng: [0; 4], ..saved };
        let sorted = SnapshotItems { keys: vec![2, 3], ..items };
        assert!(t.restore(&sorted, &zero, &[&data]).unwrap_err().to_string().contains("all zeros"));
        assert_eq!(t.stats().size, 0);
        t.restore(&sorted, &saved, &[&data]).unwrap();
        assert_eq!(t.stats().size, 2);
    }

    #[test]
    fn a_checkpoint_under_concurrent_inserts_and_samples_is_a_consistent_snapshot() {
        // One writer: item bytes = its id = its key. Every restored row must hold its key.
        const ITEMS: u64 = if cfg!(miri) { 200 } else { 50_000 };
        let config =
            ReplayConfig { max_times_sampled: 3, seed: Some(5), ..ReplayConfig::new(4, 64) };
        let t = table(config);
        let writer = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || (0..ITEMS).for_each(|id| put(&t, id)))
        };
        let mut c = t.consumer().unwrap();
        let sampler = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            while c.sample(Some(deadline)).is_ok() {}
        });
        let mut checked = 0;
        while !writer.is_finished() || checked == 0 {
            let mut ckpt = t.checkpoint().unwrap();
            let data = u64s(&drain(&mut ckpt, 16).remove(0));
            assert_eq!(data, ckpt.items().keys, "every item intact, in key order");
            assert!(ckpt.items().keys.iter().all(|&k| k < ckpt.state().next_key));
            checked += 1;
        }
        writer.join().unwrap();
        t.close();
        sampler.join().unwrap();
        assert!(checked > 0);
    }
}
