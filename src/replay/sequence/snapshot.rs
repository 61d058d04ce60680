//! Checkpoints of a sequence table: a point-in-time snapshot while inserts and sampling go on,
//! and the restore that rebuilds the table from it, open episodes included.
//!
//! One lock hold copies the metadata ([`SequenceSnapshot`]: every live chunk in eviction
//! order, every chunk's generation, the stored steps' priorities, the live windows, the
//! streams and the episodes, the limiter's counts, the RNG, the counters) and arms the
//! copy-on-write marker (invariant 5 of the module). [`SequenceCheckpoint::next_chunk`] then
//! copies the steps' bytes chunk by chunk, each call under the lock, so writers and the sampler
//! wait for at most one call's copy. The steps come out in eviction order, each chunk's
//! steps in order: what the restore writes back into the same chunks.
//!
//! A restore puts every chunk back where it was, with its generation, so window keys handed
//! out before the checkpoint still name the same windows. In-process streams (ids below
//! 2^32) keep their open episodes; the streams of TCP clients end theirs, truncated, after the
//! steps their connections had queued in the ingress: the new server's clients are new
//! streams. The metadata travels as one little-endian blob ([`SequenceSnapshot::encode`]),
//! decoded defensively: every count is bounded by the bytes left, and every index is checked
//! before the table is touched.

use std::collections::{HashMap, HashSet};

use super::{
    AtEnd, Chunk, ChunkState, Compressed, Episode, EpisodeEnd, Geometry, Packed, SequenceTable,
    State, StepTag, Stream, Window, NIL,
};
use crate::checkpoint::Chunks;
use crate::codec::{self, Codec, LeafCodecs};
use crate::error::EchoError;
use crate::queued::QueuedSamples;
use crate::replay::rng::Rng;
use crate::replay::LeafRows;
use crate::slots::Slots;
use crate::source::SampleSource;
use crate::spec::DataSpec;
use crate::sync::Arc;

/// Streams from this id on are TCP clients' ([`crate::ingress::Connection::stream`]).
const TRANSPORT_STREAMS: u64 = 1 << 32;

/// The blob's first bytes.
const MAGIC: &[u8; 8] = b"ECHOSEQ1";

/// Copy-on-write bookkeeping of the running checkpoint (invariant 5).
pub(super) struct Cow {
    /// Per chunk: steps of the snapshot still to copy from it (0: none, or copied or saved).
    pending: Box<[u32]>,
    /// Bytes of snapshot chunks a writer took before they were copied (every leaf's steps,
    /// leaf after leaf), by chunk.
    saved: HashMap<u32, Box<[u8]>>,
}

/// A live chunk as a snapshot keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChunkRow {
    index: u32,
    filled: u32,
    next: u32,
    stream: u64,
    last_episode: u64,
    last_index: u32,
    has_priorities: bool,
}

/// A live window as a snapshot keeps it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct WindowRow {
    slot: u32,
    episode: u64,
    start: u32,
    len: u32,
    times_sampled: u32,
    priority: f64,
}

/// A stream as a snapshot keeps it (its `recent` slots are derived again on restore).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StreamRow {
    id: u64,
    chunk: u32,
    in_episode: bool,
    episode: u64,
    count: u32,
    retained_from: u32,
    next_start: u32,
}

/// An episode as a snapshot keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EpisodeRow {
    id: u64,
    stream: u64,
    end: EpisodeEnd,
    open: bool,
    len: u32,
}

/// Everything a sequence table holds but its steps' bytes, at one moment; with the ingress's
/// queued steps' priorities and tags when it comes from a checkpoint of a server.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceSnapshot {
    chunk_length: u64,
    chunks_total: u64,
    length: u64,
    period: u64,
    at_end: u8,
    inserts: u64,
    samples: u64,
    rng: [u64; 4],
    next_episode: u64,
    max_priority: f64,
    /// `windows.inserted, sampled_items, batches, evicted, removed_max_times_sampled,
    /// priority_updates, unknown_keys, insert_blocked_ns, sample_blocked_ns, steps_inserted,
    /// steps_evicted, episodes_ended`.
    counters: [u64; 12],
    generations: Vec<u32>,
    /// The free chunks in the order they are handed out (last first).
    free: Vec<u32>,
    chunks: Vec<ChunkRow>,
    step_priority: Vec<u64>,
    windows: Vec<WindowRow>,
    streams: Vec<StreamRow>,
    episodes: Vec<EpisodeRow>,
    /// The ingress's queued steps: priority (NaN: none) and tag, in order.
    queued: Vec<(f64, StepTag)>,
}

fn at_end_code(at_end: AtEnd) -> u8 {
    match at_end {
        AtEnd::Pad => 0,
        AtEnd::Shift => 1,
        AtEnd::Drop => 2,
    }
}

impl SequenceSnapshot {
    /// Steps the snapshot holds (rows of every leaf file).
    pub fn steps(&self) -> usize {
        self.step_priority.len()
    }

    /// Live windows.
    pub fn windows(&self) -> usize {
        self.windows.len()
    }

    /// Streams with an open episode.
    pub fn open_episodes(&self) -> usize {
        self.streams.iter().filter(|s| s.in_episode).count()
    }

    /// Sets the ingress's queued steps (a checkpoint of a server keeps them with the table).
    pub fn set_queued(&mut self, queued: &QueuedSamples) {
        self.queued = queued
            .priorities
            .iter()
            .zip(&queued.steps)
            .map(|(p, step)| (p.unwrap_or(f64::NAN), *step))
            .collect();
    }

    /// Queued steps the snapshot carries.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    /// The snapshot as bytes (little-endian; the one definition of the format).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            256 + self.generations.len() * 4
                + self.chunks.len() * 37
                + self.step_priority.len() * 8
                + self.windows.len() * 32
                + self.streams.len() * 33
                + self.episodes.len() * 22
                + self.queued.len() * 17,
        );
        out.extend_from_slice(MAGIC);
        for v in [self.chunk_length, self.chunks_total, self.length, self.period] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(self.at_end);
        for v in [self.inserts, self.samples] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in self.rng.iter().chain([&self.next_episode]) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.max_priority.to_le_bytes());
        for v in self.counters {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let count = |out: &mut Vec<u8>, n: usize| out.extend_from_slice(&(n as u64).to_le_bytes());
        count(&mut out, self.generations.len());
        for g in &self.generations {
            out.extend_from_slice(&g.to_le_bytes());
        }
        count(&mut out, self.free.len());
        for f in &self.free {
            out.extend_from_slice(&f.to_le_bytes());
        }
        count(&mut out, self.chunks.len());
        for c in &self.chunks {
            out.extend_from_slice(&c.index.to_le_bytes());
            out.extend_from_slice(&c.filled.to_le_bytes());
            out.extend_from_slice(&c.next.to_le_bytes());
            out.extend_from_slice(&c.stream.to_le_bytes());
            out.extend_from_slice(&c.last_episode.to_le_bytes());
            out.extend_from_slice(&c.last_index.to_le_bytes());
            out.push(u8::from(c.has_priorities));
        }
        count(&mut out, self.step_priority.len());
        for p in &self.step_priority {
            out.extend_from_slice(&p.to_le_bytes());
        }
        count(&mut out, self.windows.len());
        for w in &self.windows {
            out.extend_from_slice(&w.slot.to_le_bytes());
            out.extend_from_slice(&w.episode.to_le_bytes());
            out.extend_from_slice(&w.start.to_le_bytes());
            out.extend_from_slice(&w.len.to_le_bytes());
            out.extend_from_slice(&w.times_sampled.to_le_bytes());
            out.extend_from_slice(&w.priority.to_le_bytes());
        }
        count(&mut out, self.streams.len());
        for s in &self.streams {
            out.extend_from_slice(&s.id.to_le_bytes());
            out.extend_from_slice(&s.chunk.to_le_bytes());
            out.push(u8::from(s.in_episode));
            out.extend_from_slice(&s.episode.to_le_bytes());
            out.extend_from_slice(&s.count.to_le_bytes());
            out.extend_from_slice(&s.retained_from.to_le_bytes());
            out.extend_from_slice(&s.next_start.to_le_bytes());
        }
        count(&mut out, self.episodes.len());
        for e in &self.episodes {
            out.extend_from_slice(&e.id.to_le_bytes());
            out.extend_from_slice(&e.stream.to_le_bytes());
            out.push(e.end.code());
            out.push(u8::from(e.open));
            out.extend_from_slice(&e.len.to_le_bytes());
        }
        count(&mut out, self.queued.len());
        for (priority, step) in &self.queued {
            out.extend_from_slice(&priority.to_le_bytes());
            out.extend_from_slice(&step.stream.to_le_bytes());
            out.push(step.end.code());
        }
        out
    }

    /// Parses [`SequenceSnapshot::encode`]'s bytes. Only the format is checked here; what the
    /// values must satisfy is checked by [`SequenceTable::restore`].
    ///
    /// # Errors
    /// [`EchoError::Config`] saying what is wrong: the magic, a truncated field, a count
    /// larger than the bytes left, an unknown flag, bytes after the end.
    pub fn decode(bytes: &[u8]) -> Result<Self, EchoError> {
        let mut r = Reader(bytes);
        if r.take(8, "the magic")? != MAGIC {
            return Err(bad("not a sequence table snapshot (wrong magic)".into()));
        }
        let (chunk_length, chunks_total, length, period) =
            (r.u64("chunk_length")?, r.u64("chunks")?, r.u64("length")?, r.u64("period")?);
        let at_end = r.u8("at_end")?;
        let (inserts, samples) = (r.u64("inserts")?, r.u64("samples")?);
        let rng = [r.u64("rng")?, r.u64("rng")?, r.u64("rng")?, r.u64("rng")?];
        let next_episode = r.u64("next_episode")?;
        let max_priority = f64::from_bits(r.u64("max_priority")?);
        let mut counters = [0u64; 12];
        for c in &mut counters {
            *c = r.u64("counters")?;
        }
        let n = r.count(4, "generations")?;
        let generations = (0..n).map(|_| r.u32("generations")).collect::<Result<_, _>>()?;
        let n = r.count(4, "free chunks")?;
        let free = (0..n).map(|_| r.u32("free chunks")).collect::<Result<_, _>>()?;
        let n = r.count(33, "chunks")?;
        let chunks = (0..n)
            .map(|_| {
                Ok(ChunkRow {
                    index: r.u32("chunk")?,
                    filled: r.u32("chunk")?,
                    next: r.u32("chunk")?,
                    stream: r.u64("chunk")?,
                    last_episode: r.u64("chunk")?,
                    last_index: r.u32("chunk")?,
                    has_priorities: r.flag("chunk")?,
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(8, "step priorities")?;
        let step_priority = (0..n).map(|_| r.u64("step priorities")).collect::<Result<_, _>>()?;
        let n = r.count(32, "windows")?;
        let windows = (0..n)
            .map(|_| {
                Ok(WindowRow {
                    slot: r.u32("window")?,
                    episode: r.u64("window")?,
                    start: r.u32("window")?,
                    len: r.u32("window")?,
                    times_sampled: r.u32("window")?,
                    priority: f64::from_bits(r.u64("window")?),
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(33, "streams")?;
        let streams = (0..n)
            .map(|_| {
                Ok(StreamRow {
                    id: r.u64("stream")?,
                    chunk: r.u32("stream")?,
                    in_episode: r.flag("stream")?,
                    episode: r.u64("stream")?,
                    count: r.u32("stream")?,
                    retained_from: r.u32("stream")?,
                    next_start: r.u32("stream")?,
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(22, "episodes")?;
        let episodes = (0..n)
            .map(|_| {
                Ok(EpisodeRow {
                    id: r.u64("episode")?,
                    stream: r.u64("episode")?,
                    end: r.end("episode")?,
                    open: r.flag("episode")?,
                    len: r.u32("episode")?,
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(17, "queued steps")?;
        let queued = (0..n)
            .map(|_| {
                let priority = f64::from_bits(r.u64("queued step")?);
                let stream = r.u64("queued step")?;
                Ok((priority, StepTag { stream, end: r.end("queued step")? }))
            })
            .collect::<Result<_, EchoError>>()?;
        if !r.0.is_empty() {
            return Err(bad(format!("{} bytes after the end", r.0.len())));
        }
        Ok(Self {
            chunk_length,
            chunks_total,
            length,
            period,
            at_end,
            inserts,
            samples,
            rng,
            next_episode,
            max_priority,
            counters,
            generations,
            free,
            chunks,
            step_priority,
            windows,
            streams,
            episodes,
            queued,
        })
    }
}

fn bad(msg: String) -> EchoError {
    EchoError::Config(format!("restore: sequence table snapshot: {msg}"))
}

/// A cursor over the blob; every read says which field ran out.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], EchoError> {
        if self.0.len() < n {
            return Err(bad(format!("truncated in {what}")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, EchoError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, EchoError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, EchoError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn flag(&mut self, what: &str) -> Result<bool, EchoError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(bad(format!("{what}: a flag is 0 or 1, got {other}"))),
        }
    }
    fn end(&mut self, what: &str) -> Result<EpisodeEnd, EchoError> {
        let code = self.u8(what)?;
        EpisodeEnd::from_code(code)
            .ok_or_else(|| bad(format!("{what}: an episode flag is 0, 1 or 2, got {code}")))
    }
    /// A count of records of `size` bytes each, at most what the bytes left can hold.
    fn count(&mut self, size: usize, what: &str) -> Result<usize, EchoError> {
        let n = self.u64(what)?;
        let most = (self.0.len() / size) as u64;
        if n > most {
            return Err(bad(format!("{what}: {n} records, the bytes left hold {most}")));
        }
        Ok(n as usize)
    }
}

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

    /// From now on [`Chunks::next_chunk`] hands out each compressed leaf as the table stores
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

impl Chunks for SequenceCheckpoint {
    fn spec(&self) -> &DataSpec {
        &self.table.spec
    }

    fn len(&self) -> usize {
        self.snapshot.steps()
    }

    /// Copies the steps of the next chunks (in eviction order), about `max_bytes` but at
    /// least one chunk, into `out` (leaf `l`'s steps back to back in `out[l]`). One lock hold
    /// per call. Returns the steps copied; 0 when done.
    fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
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
    pub(super) fn preserve_for_checkpoint(&self, state: &mut State, c: usize) {
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
                w.insert_blocked_ns + self.signals.insert_blocked_outside_ns.get(),
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
        state.cow = Some(Cow { pending, saved: HashMap::new() });
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

    /// Fills a new, empty table with a snapshot's state and steps (`leaves[l]`: leaf `l` of
    /// every step, in the snapshot's order, raw; or compressed per chunk row as a checkpoint
    /// that kept them packed wrote them, see [`SequenceCheckpoint::keep_packed`]: stored as
    /// they are where this table compresses the leaf with the same codec, after checking that
    /// each decompresses to its steps), then inserts the snapshot's queued steps
    /// (`queued_leaves`, same layout) and ends the open episodes of TCP clients' streams
    /// (truncated). The table samples, evicts, paces and numbers as the checkpointed one
    /// would have; window keys stay valid.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming what does not fit (nothing is inserted then): another
    /// geometry (length, period, `at_end`, chunks), a table that is not new, lengths that
    /// differ, an index out of range, a window whose steps are not stored, an invalid priority
    /// or RNG state.
    pub fn restore(
        &self,
        snap: &SequenceSnapshot,
        leaves: &[LeafRows<'_>],
        queued_leaves: &[&[u8]],
    ) -> Result<(), EchoError> {
        let g = self.geometry;
        let config = |msg: String| Err(EchoError::Config(format!("restore: {msg}")));
        let mut state = self.state.lock();
        let chunks_total = state.chunks.len();
        let ours = (
            g.chunk_length as u64,
            chunks_total as u64,
            g.length as u64,
            g.period as u64,
            at_end_code(g.at_end),
        );
        let theirs = (snap.chunk_length, snap.chunks_total, snap.length, snap.period, snap.at_end);
        if ours != theirs {
            return config(format!(
                "the snapshot's geometry (chunk length, chunks, length, period, at_end) \
                 {theirs:?} differs from this table's {ours:?}: restore with the checkpoint's \
                 settings"
            ));
        }
        if state.stats.steps_inserted > 0 || !state.stream_index.is_empty() || state.cow.is_some() {
            return config("the table is not new".to_owned());
        }
        let steps = snap.step_priority.len();
        if snap.generations.len() != chunks_total {
            return config(format!(
                "{} chunk generations for {chunks_total} chunks",
                snap.generations.len()
            ));
        }
        let rows: usize = snap.chunks.iter().map(|c| c.filled as usize).sum();
        if rows != steps || steps > g.max_size {
            return config(format!(
                "{rows} steps in chunks, {steps} step priorities, max_size {}",
                g.max_size
            ));
        }
        let rows = RestoreRows::new(&self.spec, leaves, snap)?;
        check_leaves(&self.spec, queued_leaves, snap.queued.len(), "queued leaf")?;
        let rng = Rng::from_state(snap.rng)
            .ok_or_else(|| EchoError::Config("restore: the RNG state is all zeros".into()))?;
        self.check_priority_value(&state, snap.max_priority, "max_priority")?;
        // Chunks: in range, each once, never empty or over-full; links to live chunks.
        let mut live = vec![false; chunks_total];
        for row in &snap.chunks {
            let c = row.index as usize;
            if c >= chunks_total || live[c] {
                return config(format!("chunk {c} out of range or listed twice"));
            }
            if row.filled == 0 || row.filled as usize > g.chunk_length {
                return config(format!(
                    "chunk {c} holds {} steps of {}",
                    row.filled, g.chunk_length
                ));
            }
            live[c] = true;
        }
        let mut free_seen = vec![false; chunks_total];
        for &f in &snap.free {
            let f = f as usize;
            if f >= chunks_total || live[f] || std::mem::replace(&mut free_seen[f], true) {
                return config(format!("free chunk {f} out of range, live or listed twice"));
            }
        }
        // A stream takes its chunks in eviction order (the module's eviction argument): a link
        // must point to a chunk taken later.
        let mut position = vec![usize::MAX; chunks_total];
        for (i, row) in snap.chunks.iter().enumerate() {
            position[row.index as usize] = i;
        }
        for (i, row) in snap.chunks.iter().enumerate() {
            let later = position.get(row.next as usize).is_some_and(|&p| p != usize::MAX && p > i);
            if row.next != NIL && !later {
                return config(format!(
                    "chunk {} links to {}, not a live chunk taken after it",
                    row.index, row.next
                ));
            }
        }
        let filled_of = |c: usize| {
            snap.chunks.iter().find(|r| r.index as usize == c).map_or(0, |r| r.filled as usize)
        };
        let filled: Vec<usize> =
            (0..chunks_total).map(|c| if live[c] { filled_of(c) } else { 0 }).collect();
        let next: HashMap<usize, usize> = snap
            .chunks
            .iter()
            .filter(|r| r.next != NIL)
            .map(|r| (r.index as usize, r.next as usize))
            .collect();
        // Episodes, and the windows that refer to them: every window's steps must be stored.
        let mut episodes: HashMap<u64, Episode> = HashMap::with_capacity(snap.episodes.len());
        for e in &snap.episodes {
            if e.id >= snap.next_episode || episodes.contains_key(&e.id) {
                return config(format!("episode {} out of range or listed twice", e.id));
            }
            let episode =
                Episode { stream: e.stream, end: e.end, windows: 0, open: e.open, len: e.len };
            episodes.insert(e.id, episode);
        }
        let mut window_slots = HashSet::with_capacity(snap.windows.len());
        let k = g.max_times_sampled;
        for w in &snap.windows {
            let slot = w.slot as usize;
            if !window_slots.insert(slot) {
                return config(format!("two windows start at slot {slot}"));
            }
            if w.len == 0 || w.len as usize > g.length {
                return config(format!("a window of {} steps, length is {}", w.len, g.length));
            }
            if k > 0 && w.times_sampled >= k {
                return config(format!(
                    "a window sampled {} times, max_times_sampled {k}",
                    w.times_sampled
                ));
            }
            if !stored_run(&g, &filled, &next, slot, w.len as usize) {
                return config(format!(
                    "the window at slot {slot} holds steps that are not stored"
                ));
            }
            self.check_priority_value(&state, w.priority, "a window's priority")?;
            let Some(e) = episodes.get_mut(&w.episode) else {
                return config(format!("a window of episode {}, which is not listed", w.episode));
            };
            e.windows += 1;
        }
        // Streams: their own live chunk (or none), their open episode listed and open, its
        // windows all before the next start to make (no window is made twice).
        let mut stream_ids = HashSet::with_capacity(snap.streams.len());
        let mut open_chunks = HashSet::with_capacity(snap.streams.len());
        for s in &snap.streams {
            if !stream_ids.insert(s.id) {
                return config(format!("stream {} listed twice", s.id));
            }
            if s.chunk != NIL {
                let owned = snap.chunks.iter().any(|r| r.index == s.chunk && r.stream == s.id);
                if !owned || !open_chunks.insert(s.chunk) {
                    return config(format!(
                        "stream {}'s chunk {} is not a live chunk of its own",
                        s.id, s.chunk
                    ));
                }
            }
            if s.in_episode
                && snap.windows.iter().any(|w| w.episode == s.episode && w.start >= s.next_start)
            {
                return config(format!(
                    "stream {} has a window at or past its next start {}",
                    s.id, s.next_start
                ));
            }
            if s.in_episode && !episodes.get(&s.episode).is_some_and(|e| e.open) {
                return config(format!(
                    "stream {}'s open episode {} is not listed as open",
                    s.id, s.episode
                ));
            }
            // The next window to make is not yet complete (else it would have been made): this
            // also bounds the work the next step does for the stream.
            if s.in_episode && u64::from(s.next_start) + g.length as u64 <= u64::from(s.count) {
                return config(format!(
                    "stream {} has {} steps but its next window starts at {}",
                    s.id, s.count, s.next_start
                ));
            }
            if s.retained_from > s.count {
                return config(format!(
                    "stream {} keeps steps from {} of {}",
                    s.id, s.retained_from, s.count
                ));
            }
        }
        if let Some(e) = episodes.iter().find(|(id, e)| {
            e.open && !snap.streams.iter().any(|s| s.in_episode && s.episode == **id)
        }) {
            return config(format!("episode {} is open but no stream has it", e.0));
        }
        if let Some(q) = snap
            .queued
            .iter()
            .find(|(p, _)| !p.is_nan() && self.check_priority_value(&state, *p, "").is_err())
        {
            return config(format!("a queued step's priority {} is invalid", q.0));
        }
        // Everything checked: fill the table. With compressed leaves, the chunks that take
        // no more steps are packed first (on several threads: a large table is gigabytes),
        // the streams' open chunks staged.
        let open: HashSet<u32> = snap.streams.iter().map(|s| s.chunk).collect();
        let mut packed = self.pack_rows(snap, &rows, &open)?;
        let unpack = |e: String| EchoError::Config(format!("restore: {e}"));
        let mut scratch = Vec::new();
        let st = &mut *state;
        let mut at = 0usize;
        for (r, row) in snap.chunks.iter().enumerate() {
            let c = row.index as usize;
            let first = g.first_slot(c);
            let filled = row.filled as usize;
            let mut bytes = filled as u64 * self.step_bytes;
            if let Some(p) = packed.get_mut(r).and_then(Option::take) {
                bytes = filled as u64 * self.fixed_bytes + p.len() as u64;
                st.packed[c] = Some(p);
            } else if !self.codecs.is_empty() {
                let staged = Arc::new(Slots::of_arrays(&self.staged_arrays, g.chunk_length)?);
                for (k, &leaf) in self.codecs.packed_leaves().iter().enumerate() {
                    let len = self.spec.arrays()[leaf].num_bytes();
                    let raw = rows.raw(leaf, r, &mut scratch).map_err(unpack)?;
                    for (i, step) in raw.chunks_exact(len).enumerate() {
                        // SAFETY: a new buffer nobody else holds yet.
                        unsafe { staged.write_slot(i, k, step) };
                    }
                }
                st.staged[c] = Some(staged);
            }
            st.stored_bytes += bytes;
            for leaf in (0..self.spec.len()).filter(|&leaf| self.packed_index[leaf].is_none()) {
                let len = self.spec.arrays()[leaf].num_bytes();
                let raw = rows.raw(leaf, r, &mut scratch).map_err(unpack)?;
                for (i, step) in raw.chunks_exact(len).enumerate() {
                    // SAFETY: the table is new and we hold its lock: nobody else reads or
                    // writes any slot (no window exists yet). Sizes were checked above;
                    // `step` is caller memory (or ours), not the table.
                    unsafe { self.storage.write_slot(first + i, leaf, step) };
                }
            }
            for i in 0..filled {
                if snap.step_priority[at + i] != 0 {
                    st.step_priority[first + i] = snap.step_priority[at + i];
                }
            }
            at += row.filled as usize;
            st.chunks[c] = Chunk {
                filled: row.filled,
                generation: snap.generations[c],
                pins: 0,
                state: ChunkState::Live,
                next: row.next,
                stream: row.stream,
                last_episode: row.last_episode,
                last_index: row.last_index,
                has_priorities: row.has_priorities,
                bytes,
                queued: st.packed[c].is_some(),
            };
            st.live_chunks.push_back(row.index);
        }
        for (c, chunk) in st.chunks.iter_mut().enumerate() {
            chunk.generation = snap.generations[c];
        }
        // The free chunks in the snapshot's order, after the ones it had pinned (retired then,
        // free now), so new steps take the chunks the checkpointed table would have.
        let listed: HashSet<u32> = snap.free.iter().copied().collect();
        st.free_chunks = (0..chunks_total as u32)
            .rev()
            .filter(|&c| !live[c as usize] && !listed.contains(&c))
            .chain(snap.free.iter().copied())
            .collect();
        st.steps = steps;
        for w in &snap.windows {
            let slot = w.slot as usize;
            let window = Window {
                episode: w.episode,
                start: w.start,
                len: w.len,
                times_sampled: w.times_sampled,
                priority: w.priority,
            };
            st.windows.insert(w.slot, window);
            st.sampler.insert(slot, w.priority);
        }
        st.live_windows = snap.windows.len();
        st.episodes = episodes;
        for s in &snap.streams {
            let mut recent = vec![NIL; g.length].into_boxed_slice();
            let mut retained_from = s.retained_from;
            if s.in_episode && s.count > 0 && s.chunk != NIL {
                retained_from = recent_slots(&g, &filled, &next, s, &mut recent);
            }
            let stream = Stream {
                id: s.id,
                chunk: s.chunk,
                in_episode: s.in_episode,
                episode: s.episode,
                count: s.count,
                retained_from,
                next_start: s.next_start.max(g.start_at_or_after(retained_from)),
                recent,
            };
            st.stream_index.insert(s.id, st.streams.len() as u32);
            st.streams.push(stream);
        }
        st.limiter.set_counts(snap.inserts, snap.samples);
        st.rng = rng;
        st.next_episode = snap.next_episode;
        st.max_priority = snap.max_priority;
        let c = snap.counters;
        let w = &mut st.stats.windows;
        (w.inserted, w.sampled_items, w.batches, w.evicted, w.removed_max_times_sampled) =
            (c[0], c[1], c[2], c[3], c[4]);
        (w.priority_updates, w.unknown_keys, w.insert_blocked_ns, w.sample_blocked_ns) =
            (c[5], c[6], c[7], c[8]);
        (st.stats.steps_inserted, st.stats.steps_evicted, st.stats.episodes_ended) =
            (c[9], c[10], c[11]);
        st.stats.streams_open = snap.streams.iter().filter(|s| s.in_episode).count() as u64;
        // The steps TCP clients had queued, then their streams' ends: their clients come
        // back (if at all) as new streams of the new server.
        for (i, (priority, step)) in snap.queued.iter().enumerate() {
            let row: Vec<&[u8]> = queued_leaves
                .iter()
                .zip(self.spec.arrays())
                .map(|(bytes, array)| &bytes[i * array.num_bytes()..(i + 1) * array.num_bytes()])
                .collect();
            let source = crate::source::StepLeaves(&row, *step);
            debug_assert_eq!(source.num_samples(), 1);
            let priority = (!priority.is_nan()).then_some(*priority);
            self.put_step(st, &source, 0, priority)?;
        }
        let transport: Vec<u64> =
            st.stream_index.keys().copied().filter(|&id| id >= TRANSPORT_STREAMS).collect();
        for id in transport {
            let at = st.stream_index[&id] as usize;
            if st.streams[at].in_episode {
                st.end_episode(&g, at, EpisodeEnd::Truncated);
            }
            st.forget_stream(at);
        }
        self.pack_queued(&mut state);
        drop(state);
        self.signals.sample_ready.notify_one();
        Ok(())
    }

    /// Per chunk row of `snap`: its steps of the compressed leaves packed (as they come
    /// when the checkpoint compressed a leaf with the same codec, else compressed here),
    /// unless the table compresses nothing or the row is a stream's open chunk (in `open`)
    /// with room left. Every compressed row of `rows` is checked to decompress to exactly
    /// its steps first, whatever is done with it. On several threads.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the first row that does not decompress.
    fn pack_rows(
        &self,
        snap: &SequenceSnapshot,
        rows: &RestoreRows<'_>,
        open: &HashSet<u32>,
    ) -> Result<Vec<Option<Packed>>, EchoError> {
        let pack = |r: usize, scratch: &mut Vec<u8>| -> Result<Option<Packed>, String> {
            for leaf in 0..self.spec.len() {
                if rows.segment(leaf, r).is_some() {
                    rows.raw(leaf, r, scratch)?;
                }
            }
            let row = &snap.chunks[r];
            let stays_open =
                open.contains(&row.index) && (row.filled as usize) < self.geometry.chunk_length;
            if self.codecs.is_empty() || stays_open {
                return Ok(None);
            }
            let mut item = vec![0u8; 4 * self.codecs.packed_leaves().len()];
            for (k, &leaf) in self.codecs.packed_leaves().iter().enumerate() {
                let codec = self.codecs.get(leaf).expect("a packed leaf has a codec");
                let before = item.len();
                match rows.segment(leaf, r) {
                    Some((theirs, bytes)) if theirs == codec => item.extend_from_slice(bytes),
                    _ => codec.compress_append(rows.raw(leaf, r, scratch)?, &mut item),
                }
                let len =
                    u32::try_from(item.len() - before).map_err(|_| "a packed row over 4 GiB")?;
                item[4 * k..4 * k + 4].copy_from_slice(&len.to_le_bytes());
            }
            Ok(Some(Arc::from(item)))
        };
        let n = snap.chunks.len();
        let parts = codec::in_parts(&snap.chunks, self.codec_threads, |first, part| {
            let mut scratch = Vec::new();
            let rows = first..first + part.len();
            rows.map(|r| pack(r, &mut scratch)).collect::<Result<Vec<_>, String>>()
        });
        let mut out = Vec::with_capacity(n);
        for part in parts {
            out.extend(part.map_err(|e| EchoError::Config(format!("restore: {e}")))?);
        }
        Ok(out)
    }

    fn check_priority_value(
        &self,
        state: &State,
        priority: f64,
        what: &str,
    ) -> Result<(), EchoError> {
        Self::check_priority(state, priority)
            .map_err(|msg| EchoError::Config(format!("restore: {what} {msg}")))
    }
}

/// Whether `len` steps from `slot` on are stored: inside live chunks, running on through
/// `next` links (a chunk must be full to run past its end).
fn stored_run(
    g: &Geometry,
    filled: &[usize],
    next: &HashMap<usize, usize>,
    slot: usize,
    len: usize,
) -> bool {
    let mut c = g.chunk_of(slot);
    if c >= filled.len() {
        return false;
    }
    let mut offset = slot - g.first_slot(c);
    let mut left = len;
    // At most one hop per chunk: a cycle of links cannot loop forever.
    for _ in 0..=filled.len() {
        let here = filled[c].saturating_sub(offset);
        if here == 0 {
            return false;
        }
        if here >= left {
            return true;
        }
        if filled[c] != g.chunk_length {
            return false;
        }
        left -= here;
        let Some(&n) = next.get(&c) else { return false };
        c = n;
        offset = 0;
    }
    false
}

/// Fills `recent` with the slots of the last `length` steps of stream `s`'s open episode,
/// walking back from the last step written in its open chunk through the chunks that link
/// to each other; returns the first step it could reach (or `s.retained_from` if further):
/// what is still stored.
fn recent_slots(
    g: &Geometry,
    filled: &[usize],
    next: &HashMap<usize, usize>,
    s: &StreamRow,
    recent: &mut [u32],
) -> u32 {
    let prev: HashMap<usize, usize> = next.iter().map(|(&a, &b)| (b, a)).collect();
    let mut c = s.chunk as usize;
    let Some(&f) = filled.get(c) else { return s.count };
    if f == 0 {
        return s.count;
    }
    let mut slot = g.first_slot(c) + f - 1;
    let lowest = s.retained_from.max(s.count.saturating_sub(g.length as u32));
    if lowest >= s.count {
        return s.retained_from;
    }
    let mut index = s.count - 1;
    loop {
        recent[index as usize % g.length] = slot as u32;
        if index == lowest {
            return s.retained_from;
        }
        if slot > g.first_slot(c) {
            slot -= 1;
        } else {
            match prev.get(&c) {
                Some(&p) if filled[p] == g.chunk_length => {
                    c = p;
                    slot = g.first_slot(c) + g.chunk_length - 1;
                }
                _ => return index,
            }
        }
        index -= 1;
    }
}

/// A restore's steps, leaf by leaf, per chunk row of the snapshot: raw rows (each step the
/// leaf's size), or one compressed row per chunk row (a checkpoint of a table that stored
/// the leaf compressed).
struct RestoreRows<'a> {
    spec: &'a DataSpec,
    leaves: &'a [LeafRows<'a>],
    /// Per chunk row: its first step and its steps.
    rows: Vec<(usize, usize)>,
    /// Per leaf (empty for raw ones): each chunk row's first byte.
    starts: Vec<Vec<usize>>,
}

impl<'a> RestoreRows<'a> {
    /// Checks that `leaves` holds `snap`'s steps: raw rows of the right size, or one
    /// compressed row per chunk whose lengths add up to the bytes.
    fn new(
        spec: &'a DataSpec,
        leaves: &'a [LeafRows<'a>],
        snap: &SequenceSnapshot,
    ) -> Result<Self, EchoError> {
        let config = |msg: String| Err(EchoError::Config(format!("restore: {msg}")));
        if leaves.len() != spec.len() {
            return config(format!("{} leaves, the layout has {}", leaves.len(), spec.len()));
        }
        let mut rows = Vec::with_capacity(snap.chunks.len());
        let mut steps = 0usize;
        for row in &snap.chunks {
            rows.push((steps, row.filled as usize));
            steps += row.filled as usize;
        }
        let mut starts = Vec::with_capacity(leaves.len());
        for (leaf, (rows_of, array)) in leaves.iter().zip(spec.arrays()).enumerate() {
            match *rows_of {
                LeafRows::Raw(bytes) => {
                    if Some(bytes.len()) != steps.checked_mul(array.num_bytes()) {
                        return config(format!(
                            "leaf {leaf}: {} bytes for {steps} steps of {} bytes",
                            bytes.len(),
                            array.num_bytes()
                        ));
                    }
                    starts.push(Vec::new());
                }
                LeafRows::Packed { bytes, lengths, .. } => {
                    if lengths.len() != rows.len() {
                        return config(format!(
                            "leaf {leaf}: {} compressed rows for {} chunks",
                            lengths.len(),
                            rows.len()
                        ));
                    }
                    let mut at = 0usize;
                    let mut first = Vec::with_capacity(lengths.len());
                    for &len in lengths {
                        first.push(at);
                        at = at.saturating_add(len as usize);
                    }
                    if at != bytes.len() {
                        return config(format!(
                            "leaf {leaf}: compressed rows of {at} bytes in all, {} given",
                            bytes.len()
                        ));
                    }
                    starts.push(first);
                }
            }
        }
        Ok(Self { spec, leaves, rows, starts })
    }

    /// Chunk row `r` of `leaf` as compressed in the checkpoint, if it is.
    fn segment(&self, leaf: usize, r: usize) -> Option<(Codec, &'a [u8])> {
        match self.leaves[leaf] {
            LeafRows::Raw(_) => None,
            LeafRows::Packed { codec, bytes, lengths } => {
                let at = self.starts[leaf][r];
                Some((codec, &bytes[at..at + lengths[r] as usize]))
            }
        }
    }

    /// The raw steps of chunk row `r` of `leaf`: a slice of the rows, or decompressed into
    /// `scratch` (exactly the row's steps: never more, whatever the row claims).
    fn raw<'s>(
        &'s self,
        leaf: usize,
        r: usize,
        scratch: &'s mut Vec<u8>,
    ) -> Result<&'s [u8], String> {
        let (first, n) = self.rows[r];
        let size = self.spec.arrays()[leaf].num_bytes();
        match (self.leaves[leaf], self.segment(leaf, r)) {
            (LeafRows::Raw(bytes), _) => Ok(&bytes[first * size..(first + n) * size]),
            (LeafRows::Packed { .. }, Some((codec, packed))) => {
                scratch.clear();
                scratch.resize(n * size, 0);
                codec
                    .decompress_into(packed, scratch)
                    .map_err(|e| format!("leaf {leaf}, compressed row {r}: {e}"))?;
                Ok(scratch)
            }
            (LeafRows::Packed { .. }, None) => unreachable!("a packed leaf has segments"),
        }
    }
}

fn check_leaves(
    spec: &DataSpec,
    leaves: &[&[u8]],
    rows: usize,
    what: &str,
) -> Result<(), EchoError> {
    if leaves.len() != spec.len() {
        return Err(EchoError::Config(format!(
            "restore: {} {what}s, the layout has {}",
            leaves.len(),
            spec.len()
        )));
    }
    for (leaf, (bytes, array)) in leaves.iter().zip(spec.arrays()).enumerate() {
        if Some(bytes.len()) != rows.checked_mul(array.num_bytes()) {
            return Err(EchoError::Config(format!(
                "restore: {what} {leaf}: {} bytes for {rows} steps of {} bytes",
                bytes.len(),
                array.num_bytes()
            )));
        }
    }
    Ok(())
}
