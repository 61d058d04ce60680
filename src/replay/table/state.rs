//! Everything a replay table's lock protects ([`State`]): the slots' metadata and states
//! (invariants 1 to 3 of the module), the free list, the key map, the sampler and remover,
//! the rate limiter, the counters, and the running checkpoint's copy-on-write record
//! ([`CheckpointCopies`], invariant 4). Every decision about which slot or item is made here,
//! under the lock, in O(log n) at most; no sample bytes are copied here.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::replay::limiter::RateLimiter;
use crate::replay::rng::Rng;
use crate::replay::select::{ItemRemover, ItemSampler};
use crate::replay::shell::{Draws, Parked, Side, WaitState};
use crate::sync::{Arc, Mutex};

use super::ReplayStats;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    Writing,
    Live,
    Retired,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Meta {
    pub(super) key: u64,
    pub(super) priority: f64,
    pub(super) times_sampled: u32,
    pub(super) pins: u32,
    /// Bytes the item takes as stored (set when its slot is reserved).
    pub(super) stored: u32,
    pub(super) state: SlotState,
}

impl Meta {
    /// A free slot's metadata (what a checkpoint's snapshot buffer starts as).
    pub(super) const UNUSED: Self = Self {
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
pub(super) struct Drawn {
    pub(super) slot: usize,
    pub(super) key: u64,
    pub(super) probability: f64,
    pub(super) times_sampled: u32,
}

impl Drawn {
    /// Calls `write(m, bytes)` with the item's [`BATCH_META`] value `m`, for each in order.
    /// (The area's slots are sized from `BATCH_META`, and `write_slot` checks every length.)
    pub(super) fn write_meta(&self, mut write: impl FnMut(usize, &[u8])) {
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
pub(super) struct KeyHasher(u64);

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
pub(super) type SavedItem = (Box<[u8]>, Box<[u8]>);

/// What the running [`Checkpoint`] still has to copy, and the copies writers saved for it
/// before reusing a slot (copy-on-write, invariant 4).
pub(super) struct CheckpointCopies {
    /// Every slot's metadata at the snapshot (shared with the checkpoint while it sorts out
    /// the live items after the lock).
    pub(super) snapshot: Arc<[Meta]>,
    /// `done[slot]`: the snapshot item in `slot` was copied or saved already.
    pub(super) done: Box<[bool]>,
    /// Snapshot items whose slot a writer reserved before the checkpoint copied them, by
    /// slot: the bytes of the leaves stored raw (back to back) and the packed item (empty
    /// when no leaf is compressed).
    pub(super) saved: HashMap<u32, SavedItem>,
    /// The packed items of pending snapshot slots freed before the checkpoint copied them
    /// (their other leaves stay in the slot until it is reserved), by slot.
    pub(super) saved_packed: HashMap<u32, Box<[u8]>>,
}

impl CheckpointCopies {
    /// Whether `slot` holds a snapshot item whose bytes are still to be copied (it was live
    /// at the snapshot and neither copied nor saved since); marks it done.
    pub(super) fn take_pending(&mut self, slot: usize) -> bool {
        let pending = self.is_pending(slot);
        self.done[slot] = true;
        pending
    }

    /// [`CheckpointCopies::take_pending`] without marking it done.
    pub(super) fn is_pending(&self, slot: usize) -> bool {
        self.snapshot[slot].state == SlotState::Live && !self.done[slot]
    }
}

/// Everything the lock protects.
pub(super) struct State {
    pub(super) meta: Box<[Meta]>,
    pub(super) free: Vec<u32>,
    pub(super) keys: HashMap<u64, u32, BuildHasherDefault<KeyHasher>>,
    pub(super) sampler: Box<dyn ItemSampler>,
    pub(super) remover: Box<dyn ItemRemover>,
    pub(super) limiter: RateLimiter,
    pub(super) rng: Rng,
    /// Scratch for one draw call (`batch_size` long): no allocation per batch.
    pub(super) draw_slots: Box<[usize]>,
    pub(super) draw_probabilities: Box<[f64]>,
    pub(super) max_size: usize,
    /// `ReplayConfig::max_bytes`, `u64::MAX` when unbounded.
    pub(super) max_bytes: u64,
    pub(super) max_times_sampled: u32,
    pub(super) live: usize,
    pub(super) writing: usize,
    /// Bytes live and writing items take as stored (their `Meta::stored`).
    pub(super) stored_bytes: u64,
    /// The table's `packed` cells (shared): a slot that becomes free gives its compressed
    /// leaves' memory back at once, or to a running checkpoint that still needs them.
    pub(super) packed: Arc<[Mutex<Box<[u8]>>]>,
    pub(super) next_key: u64,
    /// The priority new items get: the largest priority seen so far, initially 1.
    pub(super) max_priority: f64,
    pub(super) stats: ReplayStats,
    /// Writers parked on the shell's `insert_ready`, and the consumer on its `sample_ready`.
    pub(super) parked: Parked,
    /// The checkpoint being written, if any.
    pub(super) copies: Option<CheckpointCopies>,
    /// Set while a restore's ingress samples are still going in ([`Table::restore_queued`]):
    /// every other insert waits, so that nothing new goes in before them.
    pub(super) restoring: bool,
}

impl State {
    pub(super) fn insertable(&self) -> bool {
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
    pub(super) fn reserve(&mut self, in_place: bool, bytes: u32) -> (usize, bool) {
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
    pub(super) fn free_slot(&mut self, slot: usize) {
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
    pub(super) fn publish(&mut self, slot: usize, priority: Option<f64>, replaced: bool) {
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

    pub(super) fn remove_item(&mut self, slot: usize) {
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

    pub(super) fn take(&mut self, slot: usize, probability: f64, pending: &mut Vec<Drawn>) {
        let meta = &mut self.meta[slot];
        debug_assert_eq!(meta.state, SlotState::Live);
        meta.times_sampled = meta.times_sampled.saturating_add(1);
        meta.pins += 1;
        pending.push(Drawn { slot, key: meta.key, probability, times_sampled: meta.times_sampled });
    }

    /// Draws up to `n` items (`live > 0`) into `pending`; returns how many. A drawn item
    /// that `stale` says is stale is removed instead of taken, and counted in `*removed`.
    pub(super) fn draw(
        &mut self,
        n: usize,
        pending: &mut Vec<Drawn>,
        stale: Option<&dyn Fn(usize) -> bool>,
        removed: &mut u64,
    ) -> usize {
        if self.max_times_sampled == 0 {
            let (slots, probabilities) =
                (&mut self.draw_slots[..n], &mut self.draw_probabilities[..n]);
            let drawn = self.sampler.draw(&mut self.rng, slots, probabilities);
            let mut got = 0;
            for j in 0..drawn {
                let slot = self.draw_slots[j];
                if let Some(stale) = stale {
                    // Drawn twice in one call and removed the first time: not live any more.
                    if self.meta[slot].state != SlotState::Live {
                        continue;
                    }
                    if stale(slot) {
                        self.remove_item(slot);
                        *removed += 1;
                        continue;
                    }
                }
                self.take(slot, self.draw_probabilities[j], pending);
                got += 1;
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
            if stale.is_some_and(|stale| stale(slot)) {
                self.remove_item(slot);
                *removed += 1;
                continue;
            }
            self.take(slot, probability, pending);
            if self.meta[slot].times_sampled >= self.max_times_sampled {
                self.remove_item(slot);
                self.stats.removed_max_times_sampled += 1;
            }
            got += 1;
        }
        got
    }

    pub(super) fn unpin(&mut self, slot: usize) {
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
