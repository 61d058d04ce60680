//! Taking a checkpoint of a sequence table: the metadata in one lock hold
//! ([`SequenceTable::checkpoint_with`]), then the steps' bytes chunk by chunk
//! ([`SequenceCheckpoint::next_chunk`]), with the copy-on-write marker saving what a writer
//! would overwrite before it is copied.

use std::collections::HashMap;

use super::{
    at_end_code, ChunkRow, CopyOnWrite, EpisodeRow, SequenceSnapshot, StreamRow, WindowRow,
};
use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::replay::sequence::{Compressed, SequenceTable, State};
use crate::spec::DataSpec;
use crate::sync::Arc;

/// A running checkpoint of a [`SequenceTable`] (from [`SequenceTable::checkpoint_with`]): the
/// metadata, and the steps' bytes still to copy with [`SequenceCheckpoint::next_chunk`]. At
/// most one per table; dropping it disarms the copy-on-write marker.
pub struct SequenceCheckpoint {
    table: Arc<SequenceTable>,
    snapshot: SequenceSnapshot,
    /// With compressed leaves, per chunk row: where its steps of them are (staged or packed
    /// buffers are never written where a snapshot reads them, so no copy-on-write is needed).
    compressed: Vec<Option<Compressed>>,
    /// `next_chunk` hands out the compressed leaves packed ([`SequenceCheckpoint::keep_packed`]).
    packed_out: bool,
    /// With `packed_out`: per compressed leaf, the bytes of each chunk row handed out.
    lengths: Vec<Vec<u32>>,
    /// The next chunk row (of `snapshot.chunks`) to copy.
    next_row: usize,
}

impl std::fmt::Debug for SequenceCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceCheckpoint")
            .field("steps", &self.snapshot.steps())
            .field("next_row", &self.next_row)
            .finish_non_exhaustive()
    }
}

impl SequenceCheckpoint {
    /// The snapshot's metadata.
    pub fn snapshot(&self) -> &SequenceSnapshot {
        &self.snapshot
    }

    /// The same, to add the ingress's queued steps to.
    pub fn snapshot_mut(&mut self) -> &mut SequenceSnapshot {
        &mut self.snapshot
    }

    /// The leaves the table stores compressed, if any.
    pub fn codecs(&self) -> Option<&LeafCodecs> {
        let codecs = &self.table.codecs;
        (!codecs.is_empty()).then_some(codecs)
    }

    /// From now on [`SequenceCheckpoint::next_chunk`] hands out each compressed leaf as the table stores
    /// it: one compressed row per chunk row of the snapshot, of varying length (see
    /// [`SequenceCheckpoint::packed_lengths`]; a chunk still filling is compressed for it).
    /// Call it before the first chunk; a no-op when no leaf is compressed.
    pub fn keep_packed(&mut self) {
        let leaves = self.table.codecs.packed_leaves().len();
        self.packed_out = leaves > 0;
        self.lengths = vec![Vec::with_capacity(self.snapshot.chunks.len()); leaves];
    }

    /// After [`SequenceCheckpoint::keep_packed`]: per compressed leaf, the bytes of each
    /// chunk row handed out so far, in the snapshot's order.
    pub fn packed_lengths(&self) -> &[Vec<u32>] {
        &self.lengths
    }

    /// Chunks (rows of a packed leaf) the snapshot holds.
    pub fn chunks(&self) -> usize {
        self.snapshot.chunks.len()
    }
}

impl SequenceCheckpoint {
    /// The table's step layout (what each leaf's rows hold).
    pub fn spec(&self) -> &DataSpec {
        &self.table.spec
    }

    /// Steps in the snapshot (rows of every leaf).
    pub fn len(&self) -> usize {
        self.snapshot.steps()
    }

    /// Whether the snapshot holds no step.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the steps of the next chunks (in eviction order), about `max_bytes` but at
    /// least one chunk, into `out` (leaf `l`'s steps back to back in `out[l]`). One lock hold
    /// per call. Returns the steps copied; 0 when done.
    pub fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
        let table = &*self.table;
        let g = &table.geometry;
        assert_eq!(out.len(), table.spec.len(), "one buffer per leaf");
        for buf in out.iter_mut() {
            buf.clear();
        }
        let budget = (max_bytes / table.spec.payload_size().max(1)).max(1);
        let mut copied = 0;
        let first_row = self.next_row;
        let mut state = table.state.lock();
        let cow = state.cow.as_mut().expect("armed while the checkpoint lives");
        while copied < budget {
            let Some(row) = self.snapshot.chunks.get(self.next_row) else { break };
            let (c, filled) = (row.index as usize, row.filled as usize);
            if cow.pending[c] > 0 {
                cow.pending[c] = 0;
                let first = g.first_slot(c);
                for (leaf, buf) in out.iter_mut().enumerate() {
                    // SAFETY: the chunk is still the snapshot's (invariant 5: no writer took it
                    // since, and none can while we hold the lock), and appends only write past
                    // its snapshot steps, so these slots hold the snapshot's bytes and nobody
                    // writes them during the read.
                    unsafe {
                        table.storage.read_slots(leaf, first..first + filled, |b| {
                            buf.extend_from_slice(b);
                        });
                    }
                }
            } else {
                let saved = cow.saved.remove(&row.index).expect("a taken snapshot chunk was saved");
                let mut at = 0;
                for (leaf, buf) in out.iter_mut().enumerate() {
                    let len = table.storage.slot_bytes(leaf) * filled;
                    buf.extend_from_slice(&saved[at..at + len]);
                    at += len;
                }
            }
            copied += filled;
            self.next_row += 1;
        }
        drop(state);
        // The compressed leaves, without the lock.
        for row in first_row..self.next_row {
            let filled = self.snapshot.chunks[row].filled as usize;
            for (k, &leaf) in table.codecs.packed_leaves().iter().enumerate() {
                let buf = &mut out[leaf];
                if self.packed_out {
                    let before = buf.len();
                    match &self.compressed[row] {
                        Some(Compressed::Packed(packed, _)) => {
                            let bytes = table.codecs.packed_leaf(packed, k).unwrap_or_else(|e| {
                                debug_assert!(false, "a packed chunk is malformed: {e}");
                                &[]
                            });
                            buf.extend_from_slice(bytes);
                        }
                        // SAFETY: the chunk's first `filled` steps (the snapshot's) are
                        // written and never written again while this checkpoint holds the
                        // buffer.
                        Some(Compressed::Staged(staged)) => unsafe {
                            let codec = table.codecs.get(leaf).expect("a packed leaf has a codec");
                            staged.read_slots(k, 0..filled, |b| codec.compress_append(b, buf));
                        },
                        None => unreachable!("every chunk of a table with compressed leaves is"),
                    }
                    self.lengths[k].push((buf.len() - before) as u32);
                    continue;
                }
                match &self.compressed[row] {
                    Some(Compressed::Packed(packed, _)) => {
                        let start = buf.len();
                        buf.resize(start + table.spec.arrays()[leaf].num_bytes() * filled, 0);
                        table.unpack(packed, k, &mut buf[start..]);
                    }
                    // SAFETY: the chunk's first `filled` steps (the snapshot's) are written
                    // and never written again while this checkpoint holds the buffer.
                    Some(Compressed::Staged(staged)) => unsafe {
                        staged.read_slots(k, 0..filled, |b| buf.extend_from_slice(b));
                    },
                    None => unreachable!("every chunk of a table with compressed leaves is"),
                }
            }
        }
        copied
    }
}

impl Drop for SequenceCheckpoint {
    fn drop(&mut self) {
        // Taken out under the lock, freed after it.
        let cow = self.table.state.lock().cow.take();
        drop(cow);
    }
}

impl SequenceTable {
    /// Invariant 5: saves the snapshot bytes of chunk `c`, just taken by this writer (under
    /// the lock, before anything is written to it), if a running checkpoint still needs them.
    pub(in crate::replay::sequence) fn preserve_for_checkpoint(&self, state: &mut State, c: usize) {
        let Some(cow) = state.cow.as_mut() else { return };
        let filled = std::mem::take(&mut cow.pending[c]) as usize;
        if filled == 0 {
            return;
        }
        let first = self.geometry.first_slot(c);
        let mut bytes = Vec::with_capacity(self.spec.payload_size() * filled);
        for leaf in 0..self.spec.len() {
            // SAFETY: the caller took chunk `c` under the lock it still holds and has not
            // written it yet; its snapshot steps are untouched (invariant 5), and no writer
            // can write them while we hold the lock (the consumer may read them too).
            unsafe {
                self.storage.read_slots(leaf, first..first + filled, |b| {
                    bytes.extend_from_slice(b);
                });
            }
        }
        cow.saved.insert(c as u32, bytes.into_boxed_slice());
    }

    /// Starts a checkpoint: the table's metadata as of now, in one lock hold, and
    /// `frozen()`'s value, called inside that hold (no step goes in meanwhile, so it can read
    /// what writers hold outside the table, the ingress, consistently). The steps' bytes are
    /// then copied with [`SequenceCheckpoint::next_chunk`] while inserts and sampling go on.
    ///
    /// # Errors
    /// [`EchoError::Busy`] if another checkpoint of this table is running.
    pub fn checkpoint_with<R>(
        self: &Arc<Self>,
        frozen: impl FnOnce() -> R,
    ) -> Result<(SequenceCheckpoint, R), EchoError> {
        let g = self.geometry;
        let chunks_total = self.storage_chunks();
        let mut pending = vec![0u32; chunks_total].into_boxed_slice();
        let mut state = self.state.lock();
        if state.cow.is_some() {
            return Err(EchoError::Busy(
                "a checkpoint of this table is already being written".to_owned(),
            ));
        }
        let mut chunks = Vec::with_capacity(state.live_chunks.len());
        let mut compressed = Vec::with_capacity(state.live_chunks.len());
        let mut step_priority = Vec::with_capacity(state.steps);
        let mut windows = Vec::new();
        for &c in &state.live_chunks {
            let chunk = state.chunks[c as usize];
            chunks.push(ChunkRow {
                index: c,
                filled: chunk.filled,
                next: chunk.next,
                stream: chunk.stream,
                last_episode: chunk.last_episode,
                last_index: chunk.last_index,
                has_priorities: chunk.has_priorities,
            });
            pending[c as usize] = chunk.filled;
            compressed.push(match (&state.packed[c as usize], &state.staged[c as usize]) {
                (Some(packed), _) => Some(Compressed::Packed(Arc::clone(packed), chunk.filled)),
                (None, Some(staged)) => Some(Compressed::Staged(Arc::clone(staged))),
                (None, None) => None,
            });
            let first = g.first_slot(c as usize);
            for slot in first..first + chunk.filled as usize {
                step_priority.push(state.step_priority[slot]);
                if let Some(w) = state.windows.get(&(slot as u32)) {
                    windows.push(WindowRow {
                        slot: slot as u32,
                        episode: w.episode,
                        start: w.start,
                        len: w.len,
                        times_sampled: w.times_sampled,
                        priority: w.priority,
                    });
                }
            }
        }
        let streams = state
            .stream_index
            .values()
            .map(|&at| {
                let s = &state.streams[at as usize];
                StreamRow {
                    id: s.id,
                    chunk: s.chunk,
                    in_episode: s.in_episode,
                    episode: s.episode,
                    count: s.count,
                    retained_from: s.retained_from,
                    next_start: s.next_start,
                }
            })
            .collect();
        let episodes = state
            .episodes
            .iter()
            .map(|(&id, e)| EpisodeRow {
                id,
                stream: e.stream,
                end: e.end,
                open: e.open,
                len: e.len,
            })
            .collect();
        let (inserts, samples) = state.limiter.counts();
        let w = &state.stats.windows;
        let snapshot = SequenceSnapshot {
            chunk_length: g.chunk_length as u64,
            chunks_total: chunks_total as u64,
            length: g.length as u64,
            period: g.period as u64,
            at_end: at_end_code(g.at_end),
            inserts,
            samples,
            rng: state.rng.state(),
            next_episode: state.next_episode,
            max_priority: state.max_priority,
            counters: [
                w.inserted,
                w.sampled_items,
                w.batches,
                w.evicted,
                w.removed_max_times_sampled,
                w.priority_updates,
                w.unknown_keys,
                w.insert_blocked_ns + self.shell.insert_blocked_outside_ns.get(),
                w.sample_blocked_ns,
                state.stats.steps_inserted,
                state.stats.steps_evicted,
                state.stats.episodes_ended,
            ],
            generations: state.chunks.iter().map(|c| c.generation).collect(),
            free: state.free_chunks.clone(),
            chunks,
            step_priority,
            windows,
            streams,
            episodes,
            queued: Vec::new(),
        };
        state.cow = Some(CopyOnWrite { pending, saved: HashMap::new() });
        let out = frozen();
        drop(state);
        let checkpoint = SequenceCheckpoint {
            table: Arc::clone(self),
            snapshot,
            compressed,
            packed_out: false,
            lengths: Vec::new(),
            next_row: 0,
        };
        Ok((checkpoint, out))
    }

    /// Chunks of step storage (the main ones and the spares).
    fn storage_chunks(&self) -> usize {
        self.state.lock().chunks.len()
    }
}
