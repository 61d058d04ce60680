//! Checkpoints of a replay table and the restore from them: [`Table::checkpoint`] copies
//! every slot's metadata in one lock hold and arms the copy-on-write record;
//! [`Checkpoint::next_chunk`] then copies the items' bytes in key order, a chunk per lock
//! hold; [`Table::restore_rows`] fills a new table from a checkpoint's rows (raw or as
//! stored, compressed), and [`Table::restore_queued`] inserts the ingress samples it held.

use std::collections::HashMap;

use crate::codec::{Codec, LeafCodecs};
use crate::error::{EchoError, InsertError};
use crate::queued::QueuedSamples;
use crate::replay::rng::Rng;
use crate::replay::shell::check_priority;
use crate::spec::DataSpec;
use crate::sync::Arc;

use super::config::LOG_TARGET;
use super::state::{CheckpointCopies, Meta, SlotState};
use super::Table;

impl Table {
    /// Appends one item to a checkpoint's chunk `out` (one buffer per leaf): the leaves
    /// stored raw from `stored(leaf, out)` (called in leaf order), the compressed ones from
    /// `item`, its packed item: decompressed, or with `packed_out` as they are, their lengths
    /// pushed onto `lengths`.
    pub(super) fn emit(
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
                    Err(err) => log::error!(target: LOG_TARGET, "echo restore: dropping a queued sample: {err}"),
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

    pub(super) fn end_restore(&self) {
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
