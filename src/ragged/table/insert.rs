//! A ragged table's inserts: the samples of one entry, wherever their bytes lie
//! ([`GroupSource`]), checked against the spec and the batch, then copied into the arena
//! under the table's lock.

use std::borrow::Cow;
use std::time::Instant;

use super::{passed, wait, Entry, RaggedSampler, RaggedTable};
use crate::error::EchoError;
use crate::versions::VERSION_BYTES;

/// The key [`RaggedTable::insert_from`] returns for an entry it dropped as stale (older than
/// the staleness bound allows): no entry has it.
pub const DROPPED: u64 = u64::MAX;

/// One sample handed to [`RaggedTable::insert_group`]: its leaves' bytes and rows.
#[derive(Debug, Clone)]
pub struct SampleIn<'a> {
    /// Each leaf's bytes, in leaf order.
    pub leaves: Vec<&'a [u8]>,
    /// Each leaf's rows (1 for a fixed leaf).
    pub rows: Vec<usize>,
}

/// The samples of one insert, wherever their bytes lie: [`SampleIn`]s (slices of memory the
/// caller owns), or a frame still in a worker's shared-memory pipe, which the insert copies
/// from there straight into the arena (one copy, as for fixed-shape samples).
pub trait GroupSource {
    /// How many samples.
    fn samples(&self) -> usize;
    /// Sample `s`'s rows per leaf (1 for a fixed leaf).
    fn rows(&self, s: usize) -> &[usize];
    /// Sample `s`'s number of leaves.
    fn leaves(&self, s: usize) -> usize;
    /// The byte length of leaf `c` of sample `s`.
    fn leaf_len(&self, s: usize, c: usize) -> usize;
    /// Leaf `c` of sample `s` as a slice, where it is one (compression reads it there).
    fn leaf(&self, s: usize, c: usize) -> Option<&[u8]>;
    /// Copies leaf `c` of sample `s` into `dst`, which is `leaf_len(s, c)` bytes long.
    fn copy_leaf(&self, s: usize, c: usize, dst: &mut [u8]);
    /// Leaf `c` of sample `s` compressed by the table's codec for it, where it came so (a
    /// worker's compressed frame, checked to decompress into exactly the leaf): stored as
    /// it is instead of compressing the leaf again. `None`: compress it here.
    fn packed(&self, _s: usize, _c: usize) -> Option<&[u8]> {
        None
    }
}

impl GroupSource for [SampleIn<'_>] {
    fn samples(&self) -> usize {
        self.len()
    }
    fn rows(&self, s: usize) -> &[usize] {
        &self[s].rows
    }
    fn leaves(&self, s: usize) -> usize {
        self[s].leaves.len()
    }
    fn leaf_len(&self, s: usize, c: usize) -> usize {
        self[s].leaves[c].len()
    }
    fn leaf(&self, s: usize, c: usize) -> Option<&[u8]> {
        Some(self[s].leaves[c])
    }
    fn copy_leaf(&self, s: usize, c: usize, dst: &mut [u8]) {
        dst.copy_from_slice(self[s].leaves[c]);
    }
}

impl RaggedTable {
    /// Checks `samples` as one entry: each against the spec, the group against the batch.
    /// Returns the entry's rows in the token budget's group.
    fn check_entry<S: GroupSource + ?Sized>(
        &self,
        samples: &S,
        priority: Option<f64>,
    ) -> Result<usize, EchoError> {
        if samples.samples() == 0 {
            return Err(EchoError::Sample("a group needs at least one sample, got none".into()));
        }
        if samples.samples() > self.config.batch_size {
            return Err(EchoError::Sample(format!(
                "a group of {} samples is larger than a batch (batch_size {}); a group is \
                 never split across batches",
                samples.samples(),
                self.config.batch_size
            )));
        }
        let mut budget_rows = 0usize;
        for sample in 0..samples.samples() {
            let rows = samples.rows(sample);
            for got in [rows.len(), samples.leaves(sample)] {
                if got != self.spec.columns().len() {
                    return Err(self.spec.leaf_count(got));
                }
            }
            self.spec.check_with(|c| rows[c], |c| samples.leaf_len(sample, c))?;
            if let Some((group, _)) = self.config.batch_tokens {
                budget_rows += rows[self.spec.groups()[group].columns()[0]];
            }
        }
        if let Some((group, budget)) = self.config.batch_tokens {
            if budget_rows > budget {
                let what = if samples.samples() == 1 {
                    "a sample".to_owned()
                } else {
                    format!("a group of {} samples", samples.samples())
                };
                return Err(EchoError::Sample(format!(
                    "{what} with {budget_rows} rows in length group {:?} is larger than a \
                     batch's token budget (batch_tokens {budget})",
                    self.spec.groups()[group].name()
                )));
            }
        }
        match (&self.config.sampler, priority) {
            (RaggedSampler::Fifo, Some(_)) => {
                return Err(EchoError::Priority(
                    "a FIFO table takes no priorities (it hands each sample out once)".into(),
                ))
            }
            (_, Some(p)) if !p.is_finite() || p < 0.0 => {
                return Err(EchoError::Priority(format!(
                    "a priority must be finite and >= 0, got {p}"
                )))
            }
            _ => {}
        }
        Ok(budget_rows)
    }

    /// Inserts `samples` as one entry (a group when more than one): atomically, and handed
    /// out whole. FIFO waits for room until `deadline`; replay evicts the oldest entries.
    /// Returns the entry's key, or [`DROPPED`] when the table keeps policy versions under a
    /// bound and one of the samples is stale already (nothing stored; counted).
    ///
    /// # Errors
    /// [`EchoError::Sample`] for a sample the table cannot take (see [`RaggedSpec::check`](crate::ragged::RaggedSpec::check),
    /// a group larger than a batch or its token budget, more bytes than the arena holds),
    /// [`EchoError::Priority`], [`EchoError::Closed`], [`EchoError::TimedOut`]. Nothing is
    /// stored then.
    pub fn insert_group(
        &self,
        samples: &[SampleIn<'_>],
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<u64, EchoError> {
        self.insert_from(samples, priority, deadline)
    }

    /// [`RaggedTable::insert_group`] of samples wherever their bytes lie: each leaf is
    /// copied once, from `samples` into the arena, under the lock.
    ///
    /// # Errors
    /// As [`RaggedTable::insert_group`].
    pub fn insert_from<S: GroupSource + ?Sized>(
        &self,
        samples: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<u64, EchoError> {
        self.insert_from_then(samples, priority, deadline, || {})
    }

    /// [`RaggedTable::insert_from`], running `committed` once the samples are taken: under
    /// the table's lock with their entry (so that what [`RaggedTable::export_with`] reads
    /// under it matches the entries), or, for samples dropped as stale, without it.
    ///
    /// # Errors
    /// As [`RaggedTable::insert_group`]; `committed` does not run then.
    pub fn insert_from_then<S: GroupSource + ?Sized>(
        &self,
        samples: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
        committed: impl FnOnce(),
    ) -> Result<u64, EchoError> {
        let budget_rows = self.check_entry(samples, priority)?;
        let count = samples.samples();
        if count > self.config.max_size {
            return Err(EchoError::Sample(format!(
                "a group of {} samples is larger than the table (max_size {})",
                count, self.config.max_size
            )));
        }
        // Policy versions: the oldest of the entry's samples, which decides whether it is
        // stale (a group goes in or is dropped whole).
        let version = match &self.versions {
            None => 0,
            Some(versions) => {
                let oldest = (0..count)
                    .map(|s| {
                        let mut le = [0u8; VERSION_BYTES];
                        samples.copy_leaf(s, versions.leaf(), &mut le);
                        u64::from_le_bytes(le)
                    })
                    .min()
                    .unwrap_or(0);
                if oldest < versions.floor() {
                    versions.note_stale_at_insert(count as u64);
                    committed();
                    return Ok(DROPPED);
                }
                oldest
            }
        };
        let columns = self.spec.columns();
        // Compressed leaves, compressed before the lock is taken (none without a codec).
        let compressing = self.config.codecs.iter().any(Option::is_some);
        let packed: Vec<Vec<Option<Cow<'_, [u8]>>>> = (0..if compressing { count } else { 0 })
            .map(|s| {
                (0..columns.len())
                    .map(|c| {
                        let codec = self.config.codecs.get(c).copied().flatten()?;
                        let len = samples.leaf_len(s, c);
                        if len == 0 {
                            return None;
                        }
                        if let Some(came) = samples.packed(s, c) {
                            return Some(Cow::Borrowed(came));
                        }
                        let mut out = Vec::with_capacity(len / 2);
                        match samples.leaf(s, c) {
                            Some(leaf) => codec.compress_append(leaf, &mut out),
                            None => {
                                let mut raw = vec![0u8; len];
                                samples.copy_leaf(s, c, &mut raw);
                                codec.compress_append(&raw, &mut out);
                            }
                        }
                        Some(Cow::Owned(out))
                    })
                    .collect()
            })
            .collect();
        let packed_of = |s: usize, c: usize| packed.get(s).and_then(|p| p[c].as_deref());
        let stored_len = |s: usize, c: usize| {
            packed_of(s, c).map_or_else(|| samples.leaf_len(s, c), <[u8]>::len)
        };
        let raw_bytes: usize = (0..count)
            .flat_map(|s| (0..columns.len()).map(move |c| (s, c)))
            .map(|(s, c)| samples.leaf_len(s, c))
            .sum();
        let demands: Vec<(usize, usize, usize)> = (0..count)
            .flat_map(|s| (0..columns.len()).map(move |c| (s, c)))
            .map(|(s, c)| (c, stored_len(s, c), columns[c].align()))
            .collect();
        let mut guard = self.state.lock();
        let state = &mut guard;
        let started = Instant::now();
        let mut waited = false;
        loop {
            if state.closed {
                return Err(EchoError::Closed);
            }
            let room = state.slots_free(self.config.max_size) >= count
                && (!state.free_entries.is_empty() || state.entries.len() < self.config.max_size)
                && state.arena.fits(&demands);
            if room {
                break;
            }
            // Before anything is evicted or waited for: an entry that would not fit even
            // with every other one gone is refused as it is.
            if !state.arena.fits_alone(&demands) {
                return Err(EchoError::Sample(format!(
                    "an entry of {} bytes in {} leaves does not fit in the table's arena even \
                     empty ({} bytes in blocks of {}; each leaf fills blocks of its own); \
                     raise max_bytes",
                    demands.iter().map(|d| d.1).sum::<usize>(),
                    demands
                        .iter()
                        .filter(|d| d.1 > 0)
                        .map(|d| d.0)
                        .collect::<std::collections::BTreeSet<_>>()
                        .len(),
                    state.arena.capacity(),
                    state.arena.block_bytes()
                )));
            }
            if self.config.sampler != RaggedSampler::Fifo && !state.order.is_empty() {
                let _ = Self::evict_oldest(state);
                continue;
            }
            if passed(deadline) {
                state.stats.insert_blocked_ns += started.elapsed().as_nanos() as u64;
                return Err(EchoError::TimedOut);
            }
            waited = true;
            state.writers_waiting += 1;
            if state.consumer_waiting {
                self.filled.notify_one(); // a FIFO consumer may close a partial batch now
            }
            wait(&self.space, state, deadline);
            state.writers_waiting -= 1;
        }
        if waited {
            state.stats.insert_blocked_ns += started.elapsed().as_nanos() as u64;
        }
        let state = &mut **state;
        let ncols = columns.len();
        let mut slots = Vec::with_capacity(count);
        for s in 0..count {
            let slot = state.take_slot();
            let rows = samples.rows(s);
            for (c, column) in columns.iter().enumerate() {
                let len = stored_len(s, c);
                let extent = state
                    .arena
                    .alloc(c, len, column.align())
                    .expect("checked: the arena fits the entry");
                if len > 0 {
                    // SAFETY: `extent` is fresh room of `len` bytes in the arena, which no
                    // live extent overlaps and no batch reads (blocks are reused only once
                    // every extent and pin in them is gone); we hold the lock that hands it
                    // out, so this is the only reference to those bytes.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(self.memory.ptr(extent), len) };
                    match packed_of(s, c) {
                        Some(bytes) => dst.copy_from_slice(bytes),
                        None => samples.copy_leaf(s, c, dst),
                    }
                }
                state.extents[slot as usize * ncols + c] = extent;
                state.rows[slot as usize * ncols + c] = rows[c] as u32;
            }
            slots.push(slot);
        }
        let id = state.free_entries.pop().unwrap_or_else(|| {
            state.entries.push(None);
            (state.entries.len() - 1) as u32
        });
        let key = (state.next_key << 32) | u64::from(id);
        state.next_key += 1;
        let priority = priority.unwrap_or(state.max_priority);
        state.max_priority = state.max_priority.max(priority);
        let mut entry = Entry {
            key,
            slots,
            budget_rows,
            times_sampled: 0,
            raw_bytes,
            live_at: usize::MAX,
            priority,
            version,
        };
        state.raw_bytes += raw_bytes;
        if self.config.sampler != RaggedSampler::Fifo {
            entry.live_at = state.live.len();
            state.live.push(id);
        }
        if let (Some(tree), RaggedSampler::Prioritized { exponent }) =
            (state.tree.as_mut(), &self.config.sampler)
        {
            tree.set(id as usize, priority.powf(*exponent))?;
        }
        state.entries[id as usize] = Some(entry);
        state.order.push_back((id, key));
        state.stats.samples += count;
        state.stats.entries += 1;
        state.stats.inserted += count as u64;
        state.stats.groups_inserted += u64::from(count > 1);
        committed();
        // A FIFO consumer waits for a complete batch: woken only once there is one (a writer
        // that starts waiting for room wakes it too, above), not by every insert before.
        let wake = state.consumer_waiting
            && (self.config.sampler != RaggedSampler::Fifo || self.fill_fifo(state).1);
        drop(guard);
        if wake {
            self.filled.notify_one();
        }
        Ok(key)
    }
}
