//! Everything a sequence table's lock protects ([`State`]) and the bookkeeping on it: chunks
//! and their eviction order, streams and their open episodes, the live windows and the
//! sampler over them, the per-step priorities, the staged and packed compressed leaves. Each
//! invariant of the module (1 to 5) is kept by the methods here; no step bytes are copied
//! here, except that the caller's writes go where these methods say.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::replay::limiter::RateLimiter;
use crate::replay::rng::Rng;
use crate::replay::select::ItemSampler;
use crate::replay::shell::{Draws, Parked, Side, WaitState};
use crate::slots::Slots;
use crate::source::EpisodeEnd;
use crate::sync::Arc;

use super::config::{AtEnd, SequenceStats};

/// Marks "no chunk" / "no slot".
pub(super) const NIL: u32 = u32::MAX;

/// Staging buffers kept for reuse (see [`State::release_staged`]).
pub(super) const SPARE_STAGED: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChunkState {
    Free,
    Live,
    Retired,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Chunk {
    /// Steps written so far (from the chunk's first slot on).
    pub(super) filled: u32,
    /// Goes up each time the chunk is evicted: part of every key of a window starting here.
    pub(super) generation: u32,
    /// Batches being copied from this chunk right now.
    pub(super) pins: u32,
    pub(super) state: ChunkState,
    /// The owning stream's next chunk (its steps go on there), or `NIL`.
    pub(super) next: u32,
    /// The owning stream.
    pub(super) stream: u64,
    /// Episode and in-episode index of the last step written here.
    pub(super) last_episode: u64,
    pub(super) last_index: u32,
    /// Whether a step here carries its own priority (`step_priority` to clear on reuse).
    pub(super) has_priorities: bool,
    /// Bytes its steps take: raw, or with the compressed leaves packed once it is.
    pub(super) bytes: u64,
    /// Whether it was handed to a writer to pack (see [`PackJob`]).
    pub(super) queued: bool,
}

impl Chunk {
    pub(super) const FREE: Self = Self {
        filled: 0,
        generation: 0,
        pins: 0,
        state: ChunkState::Free,
        next: NIL,
        stream: 0,
        last_episode: 0,
        last_index: 0,
        has_priorities: false,
        bytes: 0,
        queued: false,
    };
}

/// A chunk's steps of the compressed leaves, raw, while it fills: slot `i` of leaf `k` is
/// the chunk's step `i` of compressed leaf `k`. Written under the lock past `filled` only;
/// a buffer is reused for another chunk only when nothing else holds it (`Arc::get_mut`).
pub(super) type Staged = Arc<Slots>;

/// A chunk's compressed leaves once it is full (or its stream is gone): the packed item of
/// [`LeafCodecs`] over its `filled` steps. Never changed; readers keep their own reference.
pub(super) type Packed = Arc<[u8]>;

/// Where a drawn run's compressed leaves are read from.
#[derive(Debug, Clone)]
pub(super) enum Compressed {
    Staged(Staged),
    /// The packed chunk and the steps it holds.
    Packed(Packed, u32),
}

/// A contiguous run of one window's steps, inside one chunk.
#[derive(Debug, Clone)]
pub(super) struct Run {
    pub(super) first: u32,
    pub(super) steps: u32,
    /// With compressed leaves: where they are.
    pub(super) compressed: Option<Compressed>,
}

/// A live window, kept by the slot of its first step.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Window {
    pub(super) episode: u64,
    /// In-episode index of the first step.
    pub(super) start: u32,
    /// Real steps (`length`, or fewer when padded).
    pub(super) len: u32,
    pub(super) times_sampled: u32,
    pub(super) priority: f64,
}

/// A stream: its open chunk, and its open episode (if `in_episode`). Kept between episodes,
/// so the next episode goes on in the same chunk; forgotten when the stream is gone.
#[derive(Debug)]
pub(super) struct Stream {
    pub(super) id: u64,
    /// The open chunk its next step goes to (`NIL`: take one).
    pub(super) chunk: u32,
    /// Whether an episode is open (the fields below describe it).
    pub(super) in_episode: bool,
    pub(super) episode: u64,
    /// Steps of the open episode so far.
    pub(super) count: u32,
    /// The first step of the open episode still stored (earlier ones were evicted).
    pub(super) retained_from: u32,
    /// The next window start to make (invariant 4).
    pub(super) next_start: u32,
    /// Slot of step `i` of the open episode at `recent[i % length]`, for the last `length`.
    pub(super) recent: Box<[u32]>,
}

/// An episode some live window or open stream refers to.
#[derive(Debug, Clone, Copy)]
pub(super) struct Episode {
    pub(super) stream: u64,
    pub(super) end: EpisodeEnd,
    pub(super) windows: u32,
    pub(super) open: bool,
    /// Steps, once it has ended.
    pub(super) len: u32,
}

/// One window drawn into the batch being assembled.
#[derive(Debug, Clone, Copy)]
pub(super) struct Drawn {
    pub(super) key: u64,
    pub(super) probability: f64,
    pub(super) times_sampled: u32,
    pub(super) episode: u64,
    pub(super) start: u32,
    pub(super) len: u32,
    pub(super) stream: u64,
    pub(super) end: EpisodeEnd,
    /// The episode's length once it has ended (for `is_last`), else 0.
    pub(super) episode_len: u32,
    /// `runs[first_run..last_run]` of the consumer's run list are this window's slot ranges.
    pub(super) first_run: usize,
    pub(super) last_run: usize,
}

impl Drawn {
    /// Calls `write(m, bytes)` for each per-window [`SEQUENCE_META`] value `m` except the mask.
    pub(super) fn write_meta(&self, mut write: impl FnMut(usize, &[u8])) {
        write(0, &self.key.to_ne_bytes());
        write(1, &self.probability.to_ne_bytes());
        write(2, &self.times_sampled.to_ne_bytes());
        write(4, &self.episode.to_ne_bytes());
        write(5, &self.start.to_ne_bytes());
        write(6, &self.stream.to_ne_bytes());
        write(7, &[u8::from(self.end == EpisodeEnd::Terminated)]);
        write(8, &[u8::from(self.end == EpisodeEnd::Truncated)]);
    }
}

/// The fewest forgotten stream slots [`State::shrink_streams`] gives back at once.
pub(super) const SHRINK_STREAMS_AT: usize = 256;

/// Everything the lock protects.
pub(super) struct State {
    pub(super) chunks: Box<[Chunk]>,
    pub(super) free_chunks: Vec<u32>,
    /// Live chunks, oldest first: the eviction order.
    pub(super) live_chunks: VecDeque<u32>,
    /// Per slot: 0, or the step's own priority's bits + 1.
    pub(super) step_priority: Box<[u64]>,
    /// Per slot: the window starting at that step.
    pub(super) windows: HashMap<u32, Window, BuildHasherDefault<SlotHasher>>,
    pub(super) streams: Vec<Stream>,
    pub(super) free_streams: Vec<u32>,
    pub(super) stream_index: HashMap<u64, u32>,
    pub(super) episodes: HashMap<u64, Episode>,
    pub(super) sampler: Box<dyn ItemSampler>,
    pub(super) limiter: RateLimiter,
    pub(super) rng: Rng,
    pub(super) draw_slots: Box<[usize]>,
    pub(super) draw_probabilities: Box<[f64]>,
    pub(super) live_windows: usize,
    pub(super) steps: usize,
    pub(super) next_episode: u64,
    pub(super) max_priority: f64,
    pub(super) stats: SequenceStats,
    /// Writers parked on the shell's `insert_ready`, and the consumer on its `sample_ready`.
    pub(super) parked: Parked,
    /// The checkpoint being written, if any (invariant 5).
    pub(super) cow: Option<super::snapshot::CopyOnWrite>,
    /// Bytes the live chunks' steps take (`Chunk::bytes` summed).
    pub(super) stored_bytes: u64,
    /// With compressed leaves, per chunk: its raw steps of them while it fills (or is
    /// packed), then its packed steps. Both are dropped when it is evicted.
    pub(super) staged: Box<[Option<Staged>]>,
    pub(super) packed: Box<[Option<Packed>]>,
    /// Staging buffers of packed or evicted chunks, to reuse.
    pub(super) spare_staged: Vec<Staged>,
    /// Chunks for the writer holding the lock to pack once it lets go of it.
    pub(super) to_pack: Vec<PackJob>,
}

impl WaitState for State {
    fn parked(&mut self) -> &mut Parked {
        &mut self.parked
    }

    fn add_blocked_ns(&mut self, side: Side, ns: u64) {
        match side {
            Side::Insert => self.stats.windows.insert_blocked_ns += ns,
            Side::Sample => self.stats.windows.sample_blocked_ns += ns,
        }
    }
}

impl Draws for State {
    fn limiter(&mut self) -> &mut RateLimiter {
        &mut self.limiter
    }

    fn live(&self) -> u64 {
        self.live_windows as u64
    }

    fn add_sampled(&mut self, n: u64) {
        self.stats.windows.sampled_items += n;
    }
}

/// The table's fixed geometry, shared by the lock holders and the consumer's copies.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    pub(super) length: usize,
    pub(super) period: usize,
    pub(super) at_end: AtEnd,
    pub(super) max_size: usize,
    pub(super) chunk_length: usize,
    pub(super) max_times_sampled: u32,
}

impl Geometry {
    pub(super) fn chunk_of(&self, slot: usize) -> usize {
        slot / self.chunk_length
    }
    pub(super) fn first_slot(&self, chunk: usize) -> usize {
        chunk * self.chunk_length
    }
    /// Rounds `i` up to a window start (a multiple of `period`).
    pub(super) fn start_at_or_after(&self, i: u32) -> u32 {
        let p = self.period as u32;
        i.div_ceil(p).saturating_mul(p)
    }
}

pub(super) fn key_of(generation: u32, slot: usize) -> u64 {
    (u64::from(generation) << 32) | slot as u64
}

/// A full chunk (or one whose stream is gone) for a writer to pack outside the lock.
pub(super) struct PackJob {
    pub(super) chunk: u32,
    pub(super) generation: u32,
    pub(super) filled: u32,
    pub(super) staged: Staged,
}

impl State {
    pub(super) fn stream_mut(&mut self, id: u64) -> Option<&mut Stream> {
        let &at = self.stream_index.get(&id)?;
        Some(&mut self.streams[at as usize])
    }

    /// The stream `id`'s state, with an open episode (a new one if it had none).
    pub(super) fn open_stream(&mut self, g: &Geometry, id: u64) -> usize {
        let at = match self.stream_index.get(&id) {
            Some(&at) => at as usize,
            None => {
                let fresh = Stream {
                    id,
                    chunk: NIL,
                    in_episode: false,
                    episode: 0,
                    count: 0,
                    retained_from: 0,
                    next_start: 0,
                    recent: Box::new([]),
                };
                let at = if let Some(at) = self.free_streams.pop() {
                    self.streams[at as usize] = fresh;
                    at as usize
                } else {
                    self.streams.push(fresh);
                    self.streams.len() - 1
                };
                self.stream_index.insert(id, at as u32);
                at
            }
        };
        // The ring of its last `length` steps, taken at its first step: a restored stream
        // that had no step stored (or no episode open) has none until it gets one.
        if self.streams[at].recent.is_empty() {
            self.streams[at].recent = vec![NIL; g.length].into_boxed_slice();
        }
        if !self.streams[at].in_episode {
            let episode = self.next_episode;
            self.next_episode += 1;
            let stream = &mut self.streams[at];
            stream.in_episode = true;
            stream.episode = episode;
            stream.count = 0;
            stream.retained_from = 0;
            stream.next_start = 0;
            self.episodes.insert(
                episode,
                Episode { stream: id, end: EpisodeEnd::No, windows: 0, open: true, len: 0 },
            );
            self.stats.streams_open += 1;
        }
        at
    }

    /// Forgets a stream that is gone for good (its episode ended first); its chunks stay
    /// until they are evicted.
    pub(super) fn forget_stream(&mut self, at: usize) {
        let id = self.streams[at].id;
        // Nothing goes into its open chunk any more: packed as it is.
        let chunk = self.streams[at].chunk;
        if chunk != NIL {
            self.queue_pack(chunk as usize);
        }
        self.stream_index.remove(&id);
        // Its memory goes back now, not when the slot is reused (a peer's streams may never
        // be followed by others).
        self.streams[at].recent = Box::new([]);
        self.free_streams.push(at as u32);
    }

    /// Gives back the memory of forgotten streams' slots once they are most of the slots
    /// (at least [`SHRINK_STREAMS_AT`]): the streams that remain move to the front. Stream
    /// indices change, so no caller may hold one across this (call it after a loop of
    /// [`State::forget_stream`]). O(streams), at most once per as many forgets: amortised O(1).
    pub(super) fn shrink_streams(&mut self) {
        let free = self.free_streams.len();
        if free < SHRINK_STREAMS_AT || free * 2 < self.streams.len() {
            return;
        }
        let mut is_free = vec![false; self.streams.len()];
        for &at in &self.free_streams {
            is_free[at as usize] = true;
        }
        let kept: Vec<Stream> = std::mem::take(&mut self.streams)
            .into_iter()
            .zip(is_free)
            .filter_map(|(stream, free)| (!free).then_some(stream))
            .collect();
        self.streams = kept;
        self.free_streams = Vec::new();
        self.stream_index = HashMap::with_capacity(self.streams.len());
        for (at, stream) in self.streams.iter().enumerate() {
            self.stream_index.insert(stream.id, at as u32);
        }
    }

    /// Hands live chunk `c` to the writer holding the lock to pack, if its leaves are
    /// compressed, it holds steps and it is not packed or handed out already.
    pub(super) fn queue_pack(&mut self, c: usize) {
        let chunk = &mut self.chunks[c];
        let Some(staged) = &self.staged[c] else { return };
        if chunk.queued || chunk.filled == 0 || chunk.state != ChunkState::Live {
            return;
        }
        chunk.queued = true;
        let job = PackJob {
            chunk: c as u32,
            generation: chunk.generation,
            filled: chunk.filled,
            staged: Arc::clone(staged),
        };
        self.to_pack.push(job);
    }

    /// Puts chunk `job.chunk`'s packed steps in place of its staged ones, if it is still the
    /// chunk that was packed (not evicted meanwhile). `fixed` is the bytes of a step's leaves
    /// stored raw.
    pub(super) fn install_packed(&mut self, job: &PackJob, packed: Packed, fixed: u64) {
        let c = job.chunk as usize;
        let chunk = &mut self.chunks[c];
        if chunk.state != ChunkState::Live
            || chunk.generation != job.generation
            || chunk.filled != job.filled
            || self.packed[c].is_some()
        {
            return;
        }
        let bytes = u64::from(chunk.filled) * fixed + packed.len() as u64;
        self.stored_bytes = self.stored_bytes - chunk.bytes + bytes;
        chunk.bytes = bytes;
        self.packed[c] = Some(packed);
        self.release_staged(c);
    }

    /// Gives chunk `c`'s staging buffer back for reuse (readers may still hold it: reuse waits
    /// for them, see [`Staged`]).
    pub(super) fn release_staged(&mut self, c: usize) {
        if let Some(staged) = self.staged[c].take() {
            // A few spares cover the chunks that fill at once; the rest are freed.
            if self.spare_staged.len() < SPARE_STAGED {
                self.spare_staged.push(staged);
            }
        }
    }

    /// A staging buffer nobody else holds, if a spare is one.
    pub(super) fn reuse_staged(&mut self) -> Option<Staged> {
        let at = self.spare_staged.iter_mut().position(|s| Arc::get_mut(s).is_some())?;
        Some(self.spare_staged.swap_remove(at))
    }

    /// Evicts the oldest live chunk: its windows are removed, its steps no longer count, and
    /// its stream's open episode keeps only what comes after it (invariant 4).
    pub(super) fn evict_oldest(&mut self, g: &Geometry) {
        let c = self.live_chunks.pop_front().expect("only called with a live chunk") as usize;
        let chunk = self.chunks[c];
        let first = g.first_slot(c);
        for slot in first..first + chunk.filled as usize {
            if self.windows.contains_key(&(slot as u32)) {
                self.remove_window(slot);
                self.stats.windows.evicted += 1;
            }
        }
        self.steps -= chunk.filled as usize;
        self.stored_bytes -= chunk.bytes;
        self.stats.steps_evicted += u64::from(chunk.filled);
        self.packed[c] = None;
        self.release_staged(c);
        if let Some(stream) = self.stream_mut(chunk.stream) {
            if stream.chunk == c as u32 {
                stream.chunk = NIL;
            }
            if stream.in_episode && stream.episode == chunk.last_episode {
                stream.retained_from = stream.retained_from.max(chunk.last_index + 1);
                stream.next_start =
                    stream.next_start.max(g.start_at_or_after(stream.retained_from));
            }
        }
        let chunk = &mut self.chunks[c];
        chunk.generation = chunk.generation.wrapping_add(1);
        chunk.next = NIL;
        if chunk.pins > 0 {
            chunk.state = ChunkState::Retired;
        } else {
            chunk.state = ChunkState::Free;
            self.free_chunks.push(c as u32);
        }
    }

    /// A free chunk for `stream`, evicting old ones until one is free (invariant 3).
    pub(super) fn take_chunk(&mut self, g: &Geometry, stream: u64) -> usize {
        let c = loop {
            if let Some(c) = self.free_chunks.pop() {
                break c as usize;
            }
            self.evict_oldest(g);
        };
        let chunk = &mut self.chunks[c];
        if chunk.has_priorities {
            let first = g.first_slot(c);
            self.step_priority[first..first + g.chunk_length].fill(0);
        }
        let generation = self.chunks[c].generation;
        self.chunks[c] = Chunk { generation, state: ChunkState::Live, stream, ..Chunk::FREE };
        self.live_chunks.push_back(c as u32);
        c
    }

    pub(super) fn remove_window(&mut self, slot: usize) {
        let window = self.windows.remove(&(slot as u32)).expect("a live window");
        let episode = window.episode;
        self.sampler.remove(slot);
        self.live_windows -= 1;
        self.release_episode(episode);
    }

    /// One window of `episode` fewer; forgets an ended episode with none left.
    pub(super) fn release_episode(&mut self, episode: u64) {
        if let Some(e) = self.episodes.get_mut(&episode) {
            e.windows -= 1;
            if e.windows == 0 && !e.open {
                self.episodes.remove(&episode);
            }
        }
    }

    /// Makes the window of stream `at`'s open episode starting at step `start`, `len` real
    /// steps (all stored: `start >= retained_from`, within the last `length` steps).
    pub(super) fn make_window(&mut self, g: &Geometry, at: usize, start: u32, len: u32) {
        let stream = &self.streams[at];
        let slot = stream.recent[start as usize % g.length] as usize;
        let episode = stream.episode;
        let mut own: Option<f64> = None;
        for i in start..start + len {
            let s = stream.recent[i as usize % g.length] as usize;
            if let Some(p) = decode_priority(self.step_priority[s]) {
                own = Some(own.map_or(p, |o: f64| o.max(p)));
            }
        }
        let priority = own.unwrap_or(self.max_priority);
        self.max_priority = self.max_priority.max(priority);
        if self.windows.contains_key(&(slot as u32)) {
            // One window per first step: a start is made once (invariant 4). Only a restored
            // snapshot that lied about a stream gets here; its window stays as it was.
            return;
        }
        self.windows
            .insert(slot as u32, Window { episode, start, len, times_sampled: 0, priority });
        self.sampler.insert(slot, priority);
        self.live_windows += 1;
        self.limiter.on_insert();
        self.stats.windows.inserted += 1;
        if let Some(e) = self.episodes.get_mut(&episode) {
            e.windows += 1;
        }
    }

    /// Ends stream `at`'s open episode after its `count` steps, making the windows the
    /// `at_end` rule gives. The stream keeps its open chunk for its next episode.
    pub(super) fn end_episode(&mut self, g: &Geometry, at: usize, end: EpisodeEnd) {
        let (count, retained_from, next_start, episode) = {
            let s = &self.streams[at];
            (s.count, s.retained_from, s.next_start, s.episode)
        };
        let t = g.length as u32;
        match g.at_end {
            AtEnd::Drop => {}
            AtEnd::Pad => {
                let mut start = next_start;
                while start < count {
                    self.make_window(g, at, start, count - start);
                    start += g.period as u32;
                }
            }
            AtEnd::Shift => {
                // The one shifted window ends on the last step; none is needed if every
                // start before the end was made whole (`next_start >= count`).
                if next_start < count {
                    let start = count.saturating_sub(t);
                    let exists = count >= t && start < next_start && start % g.period as u32 == 0;
                    if start >= retained_from && !exists {
                        self.make_window(g, at, start, count - start);
                    }
                }
            }
        }
        if let Some(e) = self.episodes.get_mut(&episode) {
            e.end = end;
            e.open = false;
            e.len = count;
            if e.windows == 0 {
                self.episodes.remove(&episode);
            }
        }
        self.stats.episodes_ended += 1;
        self.stats.streams_open -= 1;
        self.streams[at].in_episode = false;
    }

    /// Draws up to `n` windows (`live_windows > 0`) into `pending`, pinning their chunks and
    /// appending their slot runs to `runs`; returns how many.
    /// Draws up to `n` windows into `pending` (their steps' runs into `runs`); returns how
    /// many. With `stale` (a staleness bound), a drawn window for which it says so, given
    /// the slot ranges of its steps, is removed instead (counted in `removed`).
    pub(super) fn draw(
        &mut self,
        g: &Geometry,
        n: usize,
        pending: &mut Vec<Drawn>,
        runs: &mut Vec<Run>,
        stale: Option<StaleWindow<'_>>,
        removed: &mut u64,
    ) -> usize {
        // Whether the live window at `slot` is stale (removed if so).
        let mut judged_stale = |state: &mut Self, slot: usize| {
            let Some(stale) = stale else { return false };
            if stale(&state.window_steps(g, slot)) {
                state.remove_window(slot);
                *removed += 1;
                return true;
            }
            false
        };
        if g.max_times_sampled == 0 {
            let got = {
                let (slots, probabilities) =
                    (&mut self.draw_slots[..n], &mut self.draw_probabilities[..n]);
                self.sampler.draw(&mut self.rng, slots, probabilities)
            };
            let mut taken = 0;
            for j in 0..got {
                let (slot, probability) = (self.draw_slots[j], self.draw_probabilities[j]);
                if stale.is_some() {
                    // Drawn twice in one call and removed the first time: not live any more.
                    if !self.windows.contains_key(&(slot as u32)) || judged_stale(self, slot) {
                        continue;
                    }
                }
                self.take(g, slot, probability, pending, runs);
                taken += 1;
            }
            return taken;
        }
        // One at a time, so a window that reaches `max_times_sampled` is gone before the next
        // draw: nothing is handed out more than k times.
        let mut got = 0;
        while got < n && self.live_windows > 0 {
            let (slot, probability) =
                (&mut self.draw_slots[..1], &mut self.draw_probabilities[..1]);
            self.sampler.draw(&mut self.rng, slot, probability);
            let (slot, probability) = (self.draw_slots[0], self.draw_probabilities[0]);
            if judged_stale(self, slot) {
                continue;
            }
            self.take(g, slot, probability, pending, runs);
            if self.windows[&(slot as u32)].times_sampled >= g.max_times_sampled {
                self.remove_window(slot);
                self.stats.windows.removed_max_times_sampled += 1;
            }
            got += 1;
        }
        got
    }

    /// The slot ranges `(first, steps)` that hold the live window at `slot`'s real steps,
    /// in order (invariant 1: from its first slot on through its stream's `next` chunks).
    pub(super) fn window_steps(&self, g: &Geometry, slot: usize) -> Vec<(usize, usize)> {
        let window = self.windows[&(slot as u32)];
        let mut out = Vec::new();
        let (mut c, mut at, mut left) = (g.chunk_of(slot), slot, window.len as usize);
        while left > 0 {
            let chunk = &self.chunks[c];
            let n = left.min(g.first_slot(c) + chunk.filled as usize - at);
            out.push((at, n));
            left -= n;
            if left > 0 {
                c = chunk.next as usize;
                at = g.first_slot(c);
            }
        }
        out
    }

    pub(super) fn take(
        &mut self,
        g: &Geometry,
        slot: usize,
        probability: f64,
        pending: &mut Vec<Drawn>,
        runs: &mut Vec<Run>,
    ) {
        let window = self.windows.get_mut(&(slot as u32)).expect("a drawn window is live");
        window.times_sampled = window.times_sampled.saturating_add(1);
        let window = *window;
        let first_chunk = g.chunk_of(slot);
        let episode = self.episodes.get(&window.episode).copied();
        let first_run = runs.len();
        // Invariant 1: the steps run on from the first slot through the stream's `next`
        // chunks, all live; pin each chunk so its bytes stay put while they are copied.
        let (mut c, mut at, mut left) = (first_chunk, slot, window.len as usize);
        while left > 0 {
            let chunk = &mut self.chunks[c];
            debug_assert_ne!(chunk.state, ChunkState::Free);
            let end = g.first_slot(c) + chunk.filled as usize;
            let n = left.min(end - at);
            debug_assert!(n > 0, "a live window's steps are stored");
            chunk.pins += 1;
            let compressed = match (&self.packed[c], &self.staged[c]) {
                (Some(packed), _) => Some(Compressed::Packed(Arc::clone(packed), chunk.filled)),
                (None, Some(staged)) => Some(Compressed::Staged(Arc::clone(staged))),
                (None, None) => None,
            };
            runs.push(Run { first: at as u32, steps: n as u32, compressed });
            left -= n;
            if left > 0 {
                c = chunk.next as usize;
                at = g.first_slot(c);
            }
        }
        pending.push(Drawn {
            key: key_of(self.chunks[first_chunk].generation, slot),
            probability,
            times_sampled: window.times_sampled,
            episode: window.episode,
            start: window.start,
            len: window.len,
            stream: episode.map_or(0, |e| e.stream),
            end: episode.map_or(EpisodeEnd::No, |e| e.end),
            episode_len: episode.map_or(0, |e| e.len),
            first_run,
            last_run: runs.len(),
        });
    }

    pub(super) fn unpin(&mut self, g: &Geometry, slot: usize) {
        let c = g.chunk_of(slot);
        let chunk = &mut self.chunks[c];
        chunk.pins -= 1;
        if chunk.pins == 0 && chunk.state == ChunkState::Retired {
            chunk.state = ChunkState::Free;
            self.free_chunks.push(c as u32);
        }
    }

    /// The live window `key` names, if any: its slot.
    pub(super) fn window_of_key(&self, g: &Geometry, key: u64) -> Option<usize> {
        let slot = usize::try_from(key & u64::from(u32::MAX)).ok()?;
        let generation = u32::try_from(key >> 32).ok()?;
        let live = self.windows.contains_key(&u32::try_from(slot).ok()?);
        let chunk = self.chunks.get(g.chunk_of(slot))?;
        (live && chunk.state == ChunkState::Live && chunk.generation == generation).then_some(slot)
    }
}

/// Whether a window is stale, given the slot ranges `(first, steps)` of its steps
/// ([`State::window_steps`]).
pub(super) type StaleWindow<'a> = &'a dyn Fn(&[(usize, usize)]) -> bool;

/// Hashes a window's first slot: the slot times an odd constant (Fibonacci hashing), so
/// windows of consecutive starts spread over the map's groups.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct SlotHasher(u64);

impl Hasher for SlotHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b);
        }
    }
    fn write_u32(&mut self, slot: u32) {
        self.0 = u64::from(slot);
    }
}

pub(super) fn encode_priority(priority: f64) -> u64 {
    priority.to_bits() + 1
}

pub(super) fn decode_priority(bits: u64) -> Option<f64> {
    (bits != 0).then(|| f64::from_bits(bits - 1))
}
