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
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`Table`]: its construction, accessors, priorities, counters, the batch area's face |
//! | `config` | [`ReplayConfig`], [`ReplayStats`], [`BATCH_META`] |
//! | `state` | what the lock protects: slot states and bookkeeping, draws, checkpoint copy-on-write |
//! | `insert` | inserting: packing ahead, waiting, reserving, copying, publishing |
//! | `checkpoint` | [`Checkpoint`] and the restores |
//! | `consumer` | [`ReplayConsumer`]: drawing a batch and gathering it into the batch area |
//!
//! The waits, the close protocol, the consumer claim and the batch area are the table's
//! [`Shell`](super::shell::Shell), shared with the sequence table.

use std::collections::HashMap;

use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::replay::limiter::{InsertHoldback, RateLimiter};
use crate::replay::rng::Rng;
use crate::replay::select::{new_remover, new_sampler};
use crate::replay::shell::{check_priority, check_update, BatchCursor, Parked, Shell};
use crate::slots::Slots;
use crate::spec::{ArraySpec, DataSpec};
use crate::sync::{Arc, AsyncBell, Mutex};

mod checkpoint;
mod config;
mod consumer;
mod insert;
mod state;

pub use checkpoint::{Checkpoint, LeafRows, SnapshotItems, TableState};
use config::LOG_TARGET;
pub use config::{MetaLeaf, ReplayConfig, ReplayStats, BATCH_META};
pub use consumer::ReplayConsumer;
use state::{Meta, State};

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

    /// Where the server's policy versions are set, once, when it keeps them.
    pub(crate) fn versions_cell(
        &self,
    ) -> &std::sync::OnceLock<std::sync::Arc<crate::versions::PolicyVersions>> {
        &self.shell.versions
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
            drawn_slots: Vec::with_capacity(self.config.batch_size),
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

    /// Decompresses compressed leaf `k` of `item` into `dst`. The table compressed every item
    /// itself (or checked it on arrival), so this cannot fail short of a bug; if it does, the
    /// leaf reads as zeros and the error is logged, rather than failing a learner's batch.
    fn unpack(&self, item: &[u8], k: usize, dst: &mut [u8]) {
        if let Err(msg) = self.codecs.unpack_into(item, k, dst) {
            debug_assert!(false, "a stored item does not decompress: {msg}");
            log::error!(target: LOG_TARGET, "echo replay: a stored item does not decompress ({msg}); zeros instead");
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
}

#[cfg(test)]
mod tests {
    use super::state::SlotState;
    use super::*;
    use crate::error::InsertError;
    use crate::replay::{RateLimit, RemoverKind, ReplayBatch, SamplerKind};
    use crate::source::Leaves;
    use std::time::Duration;
    use std::time::Instant;

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
