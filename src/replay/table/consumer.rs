//! The one consumer of a replay table ([`ReplayConsumer`]): draws a batch in rounds of what
//! the rate limiter allows (the shell's `draw_rounds`), pinning each drawn slot, then copies
//! the pinned slots into the batch area with the lock let go (decompressing compressed leaves
//! straight into it, on several threads for a large batch) and unpins them.

use std::time::Instant;

use crate::codec;
use crate::error::EchoError;
use crate::replay::limiter::SampleHoldback;
use crate::replay::shell::{BatchCursor, ReplayBatch};
use crate::sync::Arc;

use super::state::Drawn;
use super::Table;

/// The one consumer of a [`Table`]. `sample` takes `&mut self`: one batch at a time.
#[derive(Debug)]
pub struct ReplayConsumer {
    pub(super) table: Arc<Table>,
    /// Items drawn for the batch being assembled (kept across a timed-out `sample`).
    pub(super) pending: Vec<Drawn>,
    /// The batch-area half the next batch goes into, and its number.
    pub(super) cursor: BatchCursor,
    /// What held the last `sample` back when it timed out (`None` after a batch).
    pub(super) holdback: Option<SampleHoldback>,
    /// The pending items' slots, for the gather (kept to reuse its allocation).
    pub(super) drawn_slots: Vec<usize>,
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
        // With a staleness bound, items older than it now are removed as draws meet them.
        let versions = table.shell.versions.get().filter(|v| v.floor() > 0);
        let floor = versions.map_or(0, |v| v.floor());
        let leaf = versions.map(|v| v.leaf()).filter(|&l| table.codecs.get(l).is_none());
        let stale = |slot: usize| {
            leaf.is_some_and(|leaf| {
                // SAFETY: `slot` is live (the caller checks it under the table lock, which
                // we hold): writers only write free or reserved slots, so its bytes are
                // stable while we read them.
                let version = unsafe {
                    table.storage.read_slots(leaf, slot..slot + 1, |bytes| {
                        bytes.try_into().map_or(u64::MAX, u64::from_le_bytes)
                    })
                };
                version < floor
            })
        };
        let stale: Option<&dyn Fn(usize) -> bool> = (floor > 0).then_some(&stale);
        let mut removed = 0;
        let mut state = table.state.lock();
        let pending = &mut self.pending;
        let drawn = table.shell.draw_rounds(
            &mut state,
            deadline,
            pending.len(),
            &mut self.holdback,
            |state, n| state.draw(n, pending, stale, &mut removed),
        );
        if removed > 0 {
            versions.expect("stale items need versions").note_stale_at_sample(removed);
        }
        drawn?;
        self.holdback = None;
        drop(state);
        self.gather();
        let table = &*self.table;
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
    fn gather(&mut self) {
        let mut slots = std::mem::take(&mut self.drawn_slots);
        slots.clear();
        slots.extend(self.pending.iter().map(|drawn| drawn.slot));
        let table = &*self.table;
        let base = self.cursor.half() * table.config.batch_size;
        let leaves = table.spec.len();
        for leaf in 0..leaves {
            if table.codecs.get(leaf).is_some() {
                continue;
            }
            // SAFETY: every drawn slot is pinned by this consumer (invariant 2): it is `Live`
            // or `Retired`, and writers only write `Free` slots, so its bytes are stable until
            // `unpin`. Only this consumer (one per table, `&mut self` in `sample`) writes the
            // batch area; numpy views of this half from two calls ago may still be read by
            // Python, which the documented lifetime rule (a batch is stable until the second
            // `sample` after it) makes the user's stale read of memory that stays allocated.
            unsafe { table.storage.gather_into(leaf, &slots, table.shell.area(), base) };
        }
        if !table.codecs.is_empty() {
            self.gather_packed(base);
        }
        for (i, drawn) in self.pending.iter().enumerate() {
            drawn.write_meta(|m, bytes| self.write_area(base + i, leaves + m, bytes));
        }
        self.drawn_slots = slots;
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

    /// Calls `f` with the bytes of `leaf` (a sample leaf, then the [`BATCH_META`](super::BATCH_META) values) of
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
