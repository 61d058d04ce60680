//! The one consumer of a sequence table ([`SequenceConsumer`]): draws windows in rounds of
//! what the rate limiter allows (the shell's `draw_rounds`), pinning every chunk a window's
//! steps lie in, then copies each window's runs of steps into the batch area with the lock
//! let go (decompressing each packed chunk once, on several threads for a large batch),
//! writes the mask and the per-window values, and unpins.

use std::collections::HashMap;
use std::time::Instant;

use crate::codec;
use crate::error::EchoError;
use crate::replay::limiter::SampleHoldback;
use crate::replay::shell::{BatchCursor, ReplayBatch};
use crate::spec::ArraySpec;
use crate::sync::Arc;

use super::config::LOG_TARGET;
use super::state::{Compressed, Drawn, Packed, Run, StaleWindow};
use super::SequenceTable;

/// Windows a gather prefetches ahead of the one it copies.
const WINDOWS_AHEAD: usize = 2;

impl SequenceTable {
    /// Decompresses compressed leaf `k` of a packed chunk into `dst` (its steps' raw bytes).
    /// The table packed every chunk itself, so this cannot fail short of a bug; if it does,
    /// the steps read as zeros and the error is logged, rather than failing a learner's batch.
    pub(super) fn unpack(&self, packed: &[u8], k: usize, dst: &mut [u8]) {
        if let Err(msg) = self.codecs.unpack_into(packed, k, dst) {
            debug_assert!(false, "a packed chunk does not decompress: {msg}");
            log::error!(target: LOG_TARGET, "echo sequence: a packed chunk does not decompress ({msg}); zeros instead");
            dst.fill(0);
        }
    }
}

/// A packed chunk a batch reads: its steps, and its runs as (window, step in the window,
/// step in the chunk, steps).
struct ChunkReads<'a> {
    packed: &'a Packed,
    filled: u32,
    runs: Vec<(usize, usize, usize, usize)>,
}

thread_local! {
    /// Where a packed chunk's leaf is decompressed when a batch reads only part of it.
    static UNPACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The one consumer of a [`SequenceTable`]. `sample` takes `&mut self`: one batch at a time.
#[derive(Debug)]
pub struct SequenceConsumer {
    pub(super) table: Arc<SequenceTable>,
    /// Windows drawn for the batch being assembled (kept across a timed-out `sample`).
    pub(super) pending: Vec<Drawn>,
    /// The slot runs of `pending`'s windows.
    pub(super) runs: Vec<Run>,
    /// The batch-area half the next batch goes into, and its number.
    pub(super) cursor: BatchCursor,
    /// What held the last `sample` back when it timed out (`None` after a batch).
    pub(super) holdback: Option<SampleHoldback>,
}

impl SequenceConsumer {
    /// The table this consumer reads.
    pub fn table(&self) -> &Arc<SequenceTable> {
        &self.table
    }

    /// Draws the next batch of windows and copies it into the batch area (the half not
    /// returned by the previous call), waiting for windows and the rate limiter until
    /// `deadline`. Windows drawn before a timeout stay drawn for the next call.
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the table is closed, [`EchoError::TimedOut`] when the
    /// deadline passes first.
    pub fn sample(&mut self, deadline: Option<Instant>) -> Result<ReplayBatch, EchoError> {
        let table = &*self.table;
        let g = &table.geometry;
        // With a staleness bound, windows with a step older than it now are removed as draws
        // meet them.
        let versions = table.shell.versions.get().filter(|v| v.floor() > 0);
        let floor = versions.map_or(0, |v| v.floor());
        let leaf = versions.map(|v| v.leaf()).filter(|&l| table.packed_index[l].is_none());
        let stale = |steps: &[(usize, usize)]| {
            let Some(leaf) = leaf else { return false };
            steps.iter().any(|&(first, n)| {
                // SAFETY: these are a live window's written steps, read under the table lock
                // (the caller holds it): writers only write a stream's next slots, and only
                // eviction under this lock frees these, so their bytes are stable.
                unsafe {
                    table.storage.read_slots(leaf, first..first + n, |bytes| {
                        bytes
                            .chunks_exact(8)
                            .any(|v| v.try_into().map_or(u64::MAX, u64::from_le_bytes) < floor)
                    })
                }
            })
        };
        let stale: Option<StaleWindow<'_>> = (floor > 0).then_some(&stale);
        let mut removed = 0;
        let mut state = table.state.lock();
        let (pending, runs) = (&mut self.pending, &mut self.runs);
        let drawn = table.shell.draw_rounds(
            &mut state,
            deadline,
            pending.len(),
            &mut self.holdback,
            |state, n| state.draw(g, n, pending, runs, stale, &mut removed),
        );
        if removed > 0 {
            versions.expect("stale windows need versions").note_stale_at_sample(removed);
        }
        drawn?;
        self.holdback = None;
        drop(state);
        self.gather();
        let mut state = table.state.lock();
        for run in &self.runs {
            state.unpin(g, run.first as usize);
        }
        state.stats.windows.batches += 1;
        drop(state);
        self.pending.clear();
        self.runs.clear();
        Ok(self.cursor.advance())
    }

    /// What held the last `sample` back when its deadline passed.
    pub fn holdback(&self) -> Option<SampleHoldback> {
        self.holdback
    }

    /// Copies the pending windows into the batch-area half the cursor points at: each leaf's steps run by
    /// run, zeros after the real steps, then the mask and the per-window values.
    fn gather(&self) {
        let table = &*self.table;
        let base = self.cursor.half() * table.config.batch_size;
        let leaves = table.spec.len();
        if !table.codecs.is_empty() {
            self.gather_compressed(base);
        }
        for leaf in (0..leaves).filter(|&leaf| table.packed_index[leaf].is_none()) {
            for (i, drawn) in self.pending.iter().enumerate() {
                // Windows are drawn at random: start the next ones' cache misses now.
                if let Some(ahead) = self.pending.get(i + WINDOWS_AHEAD) {
                    for run in &self.runs[ahead.first_run..ahead.last_run] {
                        table.storage.prefetch(leaf, run.first as usize, run.steps as usize);
                    }
                }
                let runs = &self.runs[drawn.first_run..drawn.last_run];
                let fill = |dst: &mut [u8]| {
                    let mut at = 0;
                    for run in runs {
                        let (first, n) = (run.first as usize, run.steps as usize);
                        // SAFETY: every chunk of these runs is pinned by this consumer
                        // (invariant 2), and the runs cover written steps only, so no writer
                        // touches these slots until `unpin`.
                        unsafe {
                            table.storage.read_slots(leaf, first..first + n, |src| {
                                dst[at..at + src.len()].copy_from_slice(src);
                                at += src.len();
                            });
                        }
                    }
                    dst[at..].fill(0);
                };
                // SAFETY: only this consumer writes the batch area (`&mut self` in `sample`),
                // and `base + i` is in the half being assembled.
                unsafe { table.shell.area().fill_slot(base + i, leaf, fill) };
            }
        }
        let t = table.geometry.length;
        for (i, drawn) in self.pending.iter().enumerate() {
            let real = (drawn.len as usize).min(t);
            // SAFETY: as above, the consumer's own batch area.
            unsafe {
                table.shell.area().fill_slot(base + i, leaves + 3, |mask| {
                    mask[..real].fill(1);
                    mask[real..].fill(0);
                });
            }
            // The episode's last step, where it is in this window.
            let last = (drawn.episode_len > 0)
                .then(|| (drawn.episode_len - 1).checked_sub(drawn.start))
                .flatten()
                .map(|j| j as usize)
                .filter(|&j| j < real);
            // SAFETY: as above.
            unsafe {
                table.shell.area().fill_slot(base + i, leaves + 9, |is_last| {
                    is_last.fill(0);
                    if let Some(j) = last {
                        is_last[j] = 1;
                    }
                });
            }
            drawn.write_meta(|m, bytes| {
                // SAFETY: as above; `write_slot` checks the length against the area's leaf.
                unsafe { table.shell.area().write_slot(base + i, leaves + m, bytes) }
            });
        }
    }

    /// Copies the compressed leaves of the pending windows into the batch-area half being assembled
    /// (starting at area slot `base`): steps of staged chunks straight from their staging
    /// buffers; each packed chunk the batch reads decompressed once per leaf, straight into
    /// the window when the window reads all of it, else into a scratch buffer its runs are
    /// copied from. Packed chunks are spread over threads for large batches.
    fn gather_compressed(&self, base: usize) {
        let table = &*self.table;
        let g = &table.geometry;
        // Per packed chunk the batch reads: the chunk, and its runs as (window, step in
        // the window, step in the chunk, steps).
        let mut chunks: Vec<ChunkReads<'_>> = Vec::new();
        let mut index: HashMap<*const u8, usize> = HashMap::new();
        for (i, drawn) in self.pending.iter().enumerate() {
            let mut at = 0;
            for run in &self.runs[drawn.first_run..drawn.last_run] {
                let (first, n) = (run.first as usize, run.steps as usize);
                let offset = first - g.first_slot(g.chunk_of(first));
                match &run.compressed {
                    Some(Compressed::Packed(packed, filled)) => {
                        let j = *index.entry(packed.as_ptr()).or_insert_with(|| {
                            chunks.push(ChunkReads { packed, filled: *filled, runs: Vec::new() });
                            chunks.len() - 1
                        });
                        chunks[j].runs.push((i, at, offset, n));
                    }
                    Some(Compressed::Staged(staged)) => {
                        for (k, &leaf) in table.codecs.packed_leaves().iter().enumerate() {
                            let copy = |src: &[u8]| {
                                // SAFETY: the area's bytes are this consumer's (`sample`
                                // takes `&mut self`) and no other thread runs yet.
                                unsafe {
                                    self.fill_steps(base + i, leaf, at..at + n, |dst| {
                                        dst.copy_from_slice(src);
                                    });
                                }
                            };
                            // SAFETY: the run's steps are written and stay as they are while
                            // this consumer holds the buffer (see `Staged`).
                            unsafe { staged.read_slots(k, offset..offset + n, copy) };
                        }
                    }
                    None => unreachable!("every chunk of a table with compressed leaves is"),
                }
                at += n;
            }
            for &leaf in table.codecs.packed_leaves() {
                // SAFETY: as above: the padding after the window's steps, before any thread.
                unsafe { self.fill_steps(base + i, leaf, at..g.length, |dst| dst.fill(0)) };
            }
        }
        if chunks.is_empty() {
            return;
        }
        let unpack = |chunks: &[ChunkReads<'_>]| {
            for ChunkReads { packed, filled, runs } in chunks {
                for (k, &leaf) in table.codecs.packed_leaves().iter().enumerate() {
                    let size = table.spec.arrays()[leaf].num_bytes();
                    let raw = *filled as usize * size;
                    if let [(i, at, 0, n)] = runs[..] {
                        if n * size == raw {
                            // SAFETY: each window's steps are its own bytes, and each run is
                            // read from one chunk, handled by one thread: no other thread
                            // touches this range.
                            unsafe {
                                self.fill_steps(base + i, leaf, at..at + n, |dst| {
                                    table.unpack(packed, k, dst);
                                });
                            }
                            continue;
                        }
                    }
                    UNPACKED.with(|scratch| {
                        let mut scratch = scratch.borrow_mut();
                        scratch.resize(raw, 0);
                        table.unpack(packed, k, &mut scratch);
                        for &(i, at, offset, n) in runs {
                            let src = &scratch[offset * size..(offset + n) * size];
                            // SAFETY: as above.
                            unsafe {
                                self.fill_steps(base + i, leaf, at..at + n, |dst| {
                                    dst.copy_from_slice(src);
                                });
                            }
                        }
                    });
                }
            }
        };
        let raw: usize = chunks.iter().map(|c| c.filled as usize).sum::<usize>()
            * table.staged_arrays.iter().map(ArraySpec::num_bytes).sum::<usize>();
        let threads = codec::threads_for(
            raw,
            codec::DECOMPRESS_BYTES_PER_THREAD,
            chunks.len(),
            table.codec_threads,
        );
        codec::in_parts(&chunks, threads, |_, part| unpack(part));
    }

    /// Lets `fill` write steps `steps` of the window in batch-area slot `slot`, leaf `leaf`.
    ///
    /// # Safety
    /// Only this consumer writes the batch area, and no other thread touches these bytes
    /// while `fill` runs.
    unsafe fn fill_steps(
        &self,
        slot: usize,
        leaf: usize,
        steps: std::ops::Range<usize>,
        fill: impl FnOnce(&mut [u8]),
    ) {
        let size = self.table.spec.arrays()[leaf].num_bytes();
        // SAFETY: the caller's guarantee.
        unsafe {
            self.table.shell.area().fill_part(
                slot,
                leaf,
                steps.start * size..steps.end * size,
                fill,
            )
        };
    }

    /// Calls `f` with the bytes of `leaf` (a step leaf, `length` steps per window, then the
    /// [`SEQUENCE_META`](super::SEQUENCE_META) values) of `batch`: `batch_size` windows back to back.
    ///
    /// # Panics
    /// If `leaf` is out of range.
    pub fn read_leaf<T>(&self, batch: ReplayBatch, leaf: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        // SAFETY: only this consumer writes the batch area, in `sample` (`&mut self`), which
        // cannot run while `&self` is borrowed here.
        unsafe { self.table.shell.read_batch(batch, leaf, f) }
    }
}
