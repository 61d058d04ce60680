//! Sequence tables: steps of many streams go in one at a time, each stored once; the table
//! cuts *windows* of `length` consecutive steps of one episode and samples those, by
//! priority, uniformly or newest first, the way R2D2, Dreamer and n-step learners read replay.
//!
//! ```text
//!  writers (any thread)                           consumer (one SequenceConsumer)
//!  ───────────────────                            ───────────────────────────────
//!  lock; wait for the rate limiter                lock; draw windows (the limiter allows n)
//!  full (max_size steps)? evict the oldest chunk    pin every chunk a window's steps lie in
//!    and every window starting in it              unlock; copy each window's steps into the
//!  append the step to its stream's open chunk       batch area (one memcpy per chunk run),
//!    (a new chunk when it is full)                  zero its padding, write mask and metadata
//!  a window's `length` steps are in? publish it   lock; unpin; unlock
//!  episode end? pad / shift / drop what is left
//! ```
//!
//! **Storage.** Step slots are grouped in *chunks* of `chunk_length` consecutive slots. A
//! stream appends its steps to its own open chunk and takes a new one when it is full, so a
//! stream's steps are contiguous inside a chunk and a chunk links to the stream's next one:
//! a window is one to three contiguous runs of slots per leaf, and a batch is assembled with a
//! handful of `memcpy`s per window.
//!
//! **Compressed leaves** (`ReplayConfig::compress`) are stored per chunk, the unit that
//! compresses best (one stream's consecutive frames) and that is evicted whole: staged raw
//! in a per-chunk buffer while the chunk fills, packed (one compressed frame per leaf) once
//! it is full or its stream is gone, outside the lock, by background packer threads (or the
//! writer that filled it, when they are behind). Readers (a batch, a checkpoint, a packer)
//! hold a reference to the buffer they read, so a staging buffer is reused only when nobody
//! holds it; a batch decompresses each packed
//! chunk it reads once, on several threads when large. `max_bytes` evicts by stored bytes.
//!
//! **Eviction.** Chunks are evicted in the order they were taken (`live_chunks` is that
//! queue), whenever an insert would hold more than `max_size` steps or needs a chunk and none
//! is free. A window is registered in the chunk holding its first step (`windows` is keyed by
//! that step's slot), and a stream takes its chunks in order, so every chunk a window reaches
//! into was taken after the one it starts in: evicting a window's first chunk comes first, and
//! removes it. So a window never outlives any of its steps, with no per-window list of chunks.
//!
//! **Keys** are `(chunk generation << 32) | first slot`: a chunk's generation goes up when it
//! is evicted, so the key of an evicted window never names a later window in the same slot.
//!
//! Invariants (checked by the tests in this file and `tests/sequence.rs`):
//! 1. Every live window's steps are stored: its first chunk is live, and its steps run on
//!    through `next` links into chunks taken later (which are live while the first one is).
//! 2. A chunk the consumer copies from is pinned (`pins > 0`); an evicted pinned chunk is
//!    `Retired` and freed by the last unpin, so its bytes stay put while they are read.
//! 3. Stored steps (the `filled` of live chunks) never exceed `max_size`; at most
//!    `batch_size * max_runs` chunks are pinned, and the table has that many chunks beyond
//!    `ceil(max_size / chunk_length)`, so an insert always finds a free chunk after evicting.
//! 4. A stream's `next_start` is the next window start (a multiple of `period`) not yet made,
//!    at or after `retained_from`, the first step of its open episode that is still stored.
//! 5. While a [`SequenceCheckpoint`] lives, a chunk it has not copied yet keeps its snapshot
//!    bytes: only `take_chunk` hands a chunk out to be overwritten, and the writer that takes
//!    one the checkpoint still needs saves its bytes first, under the lock (copy-on-write).
//!    Appends to an open chunk go past its snapshot steps, which they never touch.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

use crate::codec::{self, LeafCodecs};
use crate::error::{EchoError, InsertError};
use crate::replay::limiter::{InsertHoldback, RateLimiter, SampleHoldback};
use crate::replay::rng::Rng;
use crate::replay::select::{new_sampler, ItemSampler, RemoverKind};
use crate::replay::shell::{
    check_insert_priorities, check_priority, check_update, lock_until, BatchCursor, Draws, Parked,
    ReplayBatch, Shell, Side, WaitState,
};
use crate::replay::table::{MetaLeaf, ReplayConfig, ReplayStats};
use crate::slots::Slots;
use crate::source::{validate_source, SampleSource};
pub use crate::source::{EpisodeEnd, StepTag};
use crate::spec::{ArraySpec, DataSpec};
use crate::sync::{Arc, AsyncBell, Condvar, Mutex, MutexGuard};

mod snapshot;

pub use snapshot::{SequenceCheckpoint, SequenceSnapshot};

/// Marks "no chunk" / "no slot".
const NIL: u32 = u32::MAX;

/// Staging buffers kept for reuse (see [`State::release_staged`]).
const SPARE_STAGED: usize = 16;

/// Threads that pack full chunks in the background: one fewer than the cores (the inserting
/// thread has one), at most this many.
const MAX_PACKERS: usize = 4;

/// Chunks queued for the background packers per packer; past that, writers pack the chunks
/// they fill themselves (the packers are behind: inserts slow down to what they can pack).
/// A 16-stream vector env fills 16 chunks at once. Queued chunks are raw, and count so in
/// `stored_bytes`: with `max_bytes`, they may take at most an eighth of it.
const QUEUED_PER_PACKER: usize = 16;

/// What happens to the windows that would run past the end of an episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtEnd {
    /// Made with the steps there are; the rest of the window is zeros, `mask` false there.
    Pad,
    /// Moved back to end on the episode's last step (once, if no window ends there already).
    /// An episode shorter than `length` has no such place: its window starts at step 0 and is
    /// padded.
    Shift,
    /// Not made.
    Drop,
}

impl AtEnd {
    /// How Python spells it: `"pad"`, `"shift"`, `"drop"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pad => "pad",
            Self::Shift => "shift",
            Self::Drop => "drop",
        }
    }
}

/// How a sequence table cuts windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceConfig {
    /// Steps per window (`T`).
    pub length: usize,
    /// Steps between window starts within an episode (`P`): windows start at steps 0, P, 2P, ...
    pub period: usize,
    /// What happens at an episode's end.
    pub at_end: AtEnd,
    /// Streams per producer: in-process streams are `0..max_streams`, and so are the rows of
    /// one TCP client (its `send_batch` rows). Each stream the table knows costs
    /// `4 * length + 64` bytes until it is gone (its worker's connection pruned).
    pub max_streams: usize,
}

impl SequenceConfig {
    /// Windows of `length` steps, one every `length` steps, padded at episode ends, up to 4096
    /// streams.
    pub fn new(length: usize) -> Self {
        Self { length, period: length, at_end: AtEnd::Pad, max_streams: 4096 }
    }

    /// Steps per chunk for a table of `max_size` steps: `length`, so that a window spans at
    /// most two chunks, but at most a quarter of the table, so a small table still holds
    /// several streams' chunks.
    fn chunk_length(&self, max_size: usize) -> usize {
        self.length.min(max_size.div_ceil(4)).max(1)
    }
}

/// The per-window values a sequence batch carries after the steps' leaves, in batch-area
/// order. `per_step` values are `length` long per window (the mask), the others one per
/// window. Read by `SequenceConsumer::gather` (which writes them in this order) and by the
/// bindings (which name the arrays from it).
pub const SEQUENCE_META: [MetaLeaf; 10] = [
    MetaLeaf { name: "keys", kind: 'u', bytes: 8, per_step: false },
    MetaLeaf { name: "probabilities", kind: 'f', bytes: 8, per_step: false },
    MetaLeaf { name: "times_sampled", kind: 'u', bytes: 4, per_step: false },
    MetaLeaf { name: "mask", kind: 'b', bytes: 1, per_step: true },
    MetaLeaf { name: "episode", kind: 'u', bytes: 8, per_step: false },
    MetaLeaf { name: "start", kind: 'u', bytes: 4, per_step: false },
    MetaLeaf { name: "stream", kind: 'u', bytes: 8, per_step: false },
    MetaLeaf { name: "terminated", kind: 'b', bytes: 1, per_step: false },
    MetaLeaf { name: "truncated", kind: 'b', bytes: 1, per_step: false },
    MetaLeaf { name: "is_last", kind: 'b', bytes: 1, per_step: true },
];

/// A sequence table's counters: the replay counters in windows, plus steps, streams and
/// episodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SequenceStats {
    /// Windows as a replay table counts items: `size` is the windows that can be sampled,
    /// `inserted` the windows made, `evicted` those removed because a step of theirs was.
    pub windows: ReplayStats,
    /// Steps stored now.
    pub steps: u64,
    /// Steps ever inserted.
    pub steps_inserted: u64,
    /// Steps evicted to make room.
    pub steps_evicted: u64,
    /// Streams with an open episode.
    pub streams_open: u64,
    /// Episodes ended (terminated, truncated, or ended by their stream going away).
    pub episodes_ended: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    Free,
    Live,
    Retired,
}

#[derive(Debug, Clone, Copy)]
struct Chunk {
    /// Steps written so far (from the chunk's first slot on).
    filled: u32,
    /// Goes up each time the chunk is evicted: part of every key of a window starting here.
    generation: u32,
    /// Batches being copied from this chunk right now.
    pins: u32,
    state: ChunkState,
    /// The owning stream's next chunk (its steps go on there), or `NIL`.
    next: u32,
    /// The owning stream.
    stream: u64,
    /// Episode and in-episode index of the last step written here.
    last_episode: u64,
    last_index: u32,
    /// Whether a step here carries its own priority (`step_priority` to clear on reuse).
    has_priorities: bool,
    /// Bytes its steps take: raw, or with the compressed leaves packed once it is.
    bytes: u64,
    /// Whether it was handed to a writer to pack (see [`PackJob`]).
    queued: bool,
}

impl Chunk {
    const FREE: Self = Self {
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
type Staged = Arc<Slots>;

/// A chunk's compressed leaves once it is full (or its stream is gone): the packed item of
/// [`LeafCodecs`] over its `filled` steps. Never changed; readers keep their own reference.
type Packed = Arc<[u8]>;

/// Where a drawn run's compressed leaves are read from.
#[derive(Debug, Clone)]
enum Compressed {
    Staged(Staged),
    /// The packed chunk and the steps it holds.
    Packed(Packed, u32),
}

/// A contiguous run of one window's steps, inside one chunk.
#[derive(Debug, Clone)]
struct Run {
    first: u32,
    steps: u32,
    /// With compressed leaves: where they are.
    compressed: Option<Compressed>,
}

/// Full chunks waiting for a background packer, and the packers' state.
#[derive(Default)]
struct PackQueue {
    jobs: VecDeque<PackJob>,
    /// Jobs a packer has taken and not yet put in place.
    busy: usize,
    /// The table is gone: the packers stop.
    closed: bool,
}

/// The background packers of a table with compressed leaves (see
/// [`SequenceTable::pack_queued`]). The packer threads hold this and a weak reference to the
/// table; the table's drop closes it.
#[derive(Default)]
struct Packers {
    queue: Mutex<PackQueue>,
    /// Rung when a job is queued or the queue closes.
    ready: Condvar,
    /// Rung when the queue is empty and no job is being packed.
    idle: Condvar,
    threads: usize,
}

/// A full chunk (or one whose stream is gone) for a writer to pack outside the lock.
struct PackJob {
    chunk: u32,
    generation: u32,
    filled: u32,
    staged: Staged,
}

/// A live window, kept by the slot of its first step.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    episode: u64,
    /// In-episode index of the first step.
    start: u32,
    /// Real steps (`length`, or fewer when padded).
    len: u32,
    times_sampled: u32,
    priority: f64,
}

/// A stream: its open chunk, and its open episode (if `in_episode`). Kept between episodes,
/// so the next episode goes on in the same chunk; forgotten when the stream is gone.
#[derive(Debug)]
struct Stream {
    id: u64,
    /// The open chunk its next step goes to (`NIL`: take one).
    chunk: u32,
    /// Whether an episode is open (the fields below describe it).
    in_episode: bool,
    episode: u64,
    /// Steps of the open episode so far.
    count: u32,
    /// The first step of the open episode still stored (earlier ones were evicted).
    retained_from: u32,
    /// The next window start to make (invariant 4).
    next_start: u32,
    /// Slot of step `i` of the open episode at `recent[i % length]`, for the last `length`.
    recent: Box<[u32]>,
}

/// An episode some live window or open stream refers to.
#[derive(Debug, Clone, Copy)]
struct Episode {
    stream: u64,
    end: EpisodeEnd,
    windows: u32,
    open: bool,
    /// Steps, once it has ended.
    len: u32,
}

/// One window drawn into the batch being assembled.
#[derive(Debug, Clone, Copy)]
struct Drawn {
    key: u64,
    probability: f64,
    times_sampled: u32,
    episode: u64,
    start: u32,
    len: u32,
    stream: u64,
    end: EpisodeEnd,
    /// The episode's length once it has ended (for `is_last`), else 0.
    episode_len: u32,
    /// `runs[first_run..last_run]` of the consumer's run list are this window's slot ranges.
    first_run: usize,
    last_run: usize,
}

impl Drawn {
    /// Calls `write(m, bytes)` for each per-window [`SEQUENCE_META`] value `m` except the mask.
    fn write_meta(&self, mut write: impl FnMut(usize, &[u8])) {
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

/// Everything the lock protects.
struct State {
    chunks: Box<[Chunk]>,
    free_chunks: Vec<u32>,
    /// Live chunks, oldest first: the eviction order.
    live_chunks: VecDeque<u32>,
    /// Per slot: 0, or the step's own priority's bits + 1.
    step_priority: Box<[u64]>,
    /// Per slot: the window starting at that step.
    windows: HashMap<u32, Window, BuildHasherDefault<SlotHasher>>,
    streams: Vec<Stream>,
    free_streams: Vec<u32>,
    stream_index: HashMap<u64, u32>,
    episodes: HashMap<u64, Episode>,
    sampler: Box<dyn ItemSampler>,
    limiter: RateLimiter,
    rng: Rng,
    draw_slots: Box<[usize]>,
    draw_probabilities: Box<[f64]>,
    live_windows: usize,
    steps: usize,
    next_episode: u64,
    max_priority: f64,
    stats: SequenceStats,
    /// Writers parked on the shell's `insert_ready`, and the consumer on its `sample_ready`.
    parked: Parked,
    /// The checkpoint being written, if any (invariant 5).
    cow: Option<snapshot::Cow>,
    /// Bytes the live chunks' steps take (`Chunk::bytes` summed).
    stored_bytes: u64,
    /// With compressed leaves, per chunk: its raw steps of them while it fills (or is
    /// packed), then its packed steps. Both are dropped when it is evicted.
    staged: Box<[Option<Staged>]>,
    packed: Box<[Option<Packed>]>,
    /// Staging buffers of packed or evicted chunks, to reuse.
    spare_staged: Vec<Staged>,
    /// Chunks for the writer holding the lock to pack once it lets go of it.
    to_pack: Vec<PackJob>,
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
struct Geometry {
    length: usize,
    period: usize,
    at_end: AtEnd,
    max_size: usize,
    chunk_length: usize,
    max_times_sampled: u32,
}

impl Geometry {
    fn chunk_of(&self, slot: usize) -> usize {
        slot / self.chunk_length
    }
    fn first_slot(&self, chunk: usize) -> usize {
        chunk * self.chunk_length
    }
    /// Rounds `i` up to a window start (a multiple of `period`).
    fn start_at_or_after(&self, i: u32) -> u32 {
        let p = self.period as u32;
        i.div_ceil(p).saturating_mul(p)
    }
}

fn key_of(generation: u32, slot: usize) -> u64 {
    (u64::from(generation) << 32) | slot as u64
}

impl State {
    fn stream_mut(&mut self, id: u64) -> Option<&mut Stream> {
        let &at = self.stream_index.get(&id)?;
        Some(&mut self.streams[at as usize])
    }

    /// The stream `id`'s state, with an open episode (a new one if it had none).
    fn open_stream(&mut self, g: &Geometry, id: u64) -> usize {
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
                    let recent = std::mem::take(&mut self.streams[at as usize].recent);
                    self.streams[at as usize] = Stream { recent, ..fresh };
                    at as usize
                } else {
                    let recent = vec![NIL; g.length].into_boxed_slice();
                    self.streams.push(Stream { recent, ..fresh });
                    self.streams.len() - 1
                };
                self.stream_index.insert(id, at as u32);
                at
            }
        };
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
    fn forget_stream(&mut self, at: usize) {
        let id = self.streams[at].id;
        // Nothing goes into its open chunk any more: packed as it is.
        let chunk = self.streams[at].chunk;
        if chunk != NIL {
            self.queue_pack(chunk as usize);
        }
        self.stream_index.remove(&id);
        self.free_streams.push(at as u32);
    }

    /// Hands live chunk `c` to the writer holding the lock to pack, if its leaves are
    /// compressed, it holds steps and it is not packed or handed out already.
    fn queue_pack(&mut self, c: usize) {
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
    fn install_packed(&mut self, job: &PackJob, packed: Packed, fixed: u64) {
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
    fn release_staged(&mut self, c: usize) {
        if let Some(staged) = self.staged[c].take() {
            // A few spares cover the chunks that fill at once; the rest are freed.
            if self.spare_staged.len() < SPARE_STAGED {
                self.spare_staged.push(staged);
            }
        }
    }

    /// A staging buffer nobody else holds, if a spare is one.
    fn reuse_staged(&mut self) -> Option<Staged> {
        let at = self.spare_staged.iter_mut().position(|s| Arc::get_mut(s).is_some())?;
        Some(self.spare_staged.swap_remove(at))
    }

    /// Evicts the oldest live chunk: its windows are removed, its steps no longer count, and
    /// its stream's open episode keeps only what comes after it (invariant 4).
    fn evict_oldest(&mut self, g: &Geometry) {
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
    fn take_chunk(&mut self, g: &Geometry, stream: u64) -> usize {
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

    fn remove_window(&mut self, slot: usize) {
        let window = self.windows.remove(&(slot as u32)).expect("a live window");
        let episode = window.episode;
        self.sampler.remove(slot);
        self.live_windows -= 1;
        self.release_episode(episode);
    }

    /// One window of `episode` fewer; forgets an ended episode with none left.
    fn release_episode(&mut self, episode: u64) {
        if let Some(e) = self.episodes.get_mut(&episode) {
            e.windows -= 1;
            if e.windows == 0 && !e.open {
                self.episodes.remove(&episode);
            }
        }
    }

    /// Makes the window of stream `at`'s open episode starting at step `start`, `len` real
    /// steps (all stored: `start >= retained_from`, within the last `length` steps).
    fn make_window(&mut self, g: &Geometry, at: usize, start: u32, len: u32) {
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
    fn end_episode(&mut self, g: &Geometry, at: usize, end: EpisodeEnd) {
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
    fn draw(
        &mut self,
        g: &Geometry,
        n: usize,
        pending: &mut Vec<Drawn>,
        runs: &mut Vec<Run>,
    ) -> usize {
        if g.max_times_sampled == 0 {
            let got = {
                let (slots, probabilities) =
                    (&mut self.draw_slots[..n], &mut self.draw_probabilities[..n]);
                self.sampler.draw(&mut self.rng, slots, probabilities)
            };
            for j in 0..got {
                let (slot, probability) = (self.draw_slots[j], self.draw_probabilities[j]);
                self.take(g, slot, probability, pending, runs);
            }
            return got;
        }
        // One at a time, so a window that reaches `max_times_sampled` is gone before the next
        // draw: nothing is handed out more than k times.
        let mut got = 0;
        while got < n && self.live_windows > 0 {
            let (slot, probability) =
                (&mut self.draw_slots[..1], &mut self.draw_probabilities[..1]);
            self.sampler.draw(&mut self.rng, slot, probability);
            let (slot, probability) = (self.draw_slots[0], self.draw_probabilities[0]);
            self.take(g, slot, probability, pending, runs);
            if self.windows[&(slot as u32)].times_sampled >= g.max_times_sampled {
                self.remove_window(slot);
                self.stats.windows.removed_max_times_sampled += 1;
            }
            got += 1;
        }
        got
    }

    fn take(
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

    fn unpin(&mut self, g: &Geometry, slot: usize) {
        let c = g.chunk_of(slot);
        let chunk = &mut self.chunks[c];
        chunk.pins -= 1;
        if chunk.pins == 0 && chunk.state == ChunkState::Retired {
            chunk.state = ChunkState::Free;
            self.free_chunks.push(c as u32);
        }
    }

    /// The live window `key` names, if any: its slot.
    fn window_of_key(&self, g: &Geometry, key: u64) -> Option<usize> {
        let slot = usize::try_from(key & u64::from(u32::MAX)).ok()?;
        let generation = u32::try_from(key >> 32).ok()?;
        let live = self.windows.contains_key(&u32::try_from(slot).ok()?);
        let chunk = self.chunks.get(g.chunk_of(slot))?;
        (live && chunk.state == ChunkState::Live && chunk.generation == generation).then_some(slot)
    }
}

/// Hashes a window's first slot: the slot times an odd constant (Fibonacci hashing), so
/// windows of consecutive starts spread over the map's groups.
#[derive(Debug, Default, Clone, Copy)]
struct SlotHasher(u64);

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

fn encode_priority(priority: f64) -> u64 {
    priority.to_bits() + 1
}

fn decode_priority(bits: u64) -> Option<f64> {
    (bits != 0).then(|| f64::from_bits(bits - 1))
}

/// A sequence table. Create with [`SequenceTable::new`]; many writers
/// [`SequenceTable::insert`] steps, one [`SequenceConsumer`] samples windows.
pub struct SequenceTable {
    spec: DataSpec,
    config: ReplayConfig,
    sequence: SequenceConfig,
    geometry: Geometry,
    /// Every chunk's step slots, back to back (compressed leaves take no bytes here: they are
    /// staged per chunk, then packed).
    storage: Slots,
    /// Which leaves are compressed, per chunk of steps (the layout's shapes with the chunk's
    /// steps in front: it bounds what one packed leaf may hold).
    codecs: LeafCodecs,
    /// The compressed leaves, in order: a staging buffer's layout.
    staged_arrays: Box<[ArraySpec]>,
    /// Per leaf: its number among the compressed leaves, if it is one.
    packed_index: Box<[Option<usize>]>,
    /// Bytes of one step's leaves stored raw, and of all its leaves.
    fixed_bytes: u64,
    step_bytes: u64,
    /// `max_bytes`, `u64::MAX` when unbounded.
    max_bytes: u64,
    /// The most threads one batch decompresses on, or one insert's full chunks pack on.
    codec_threads: usize,
    /// With compressed leaves and more than one core: the background packers.
    packers: Option<Arc<Packers>>,
    state: Mutex<State>,
    /// The table's shell (the replay table's `shell`; `snapshot` reads it by this name): the
    /// waits (writers for the rate limiter, the consumer for windows), the close protocol,
    /// the consumer claim, and the batch area, two batches (halves) of windows: each leaf
    /// `length` steps long, then [`SEQUENCE_META`].
    signals: Shell,
}

impl std::fmt::Debug for SequenceTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceTable")
            .field("config", &self.config)
            .field("sequence", &self.sequence)
            .finish_non_exhaustive()
    }
}

impl SequenceTable {
    /// A table of `config.max_size` steps of `spec`, cut into windows as `sequence` says.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the bad parameter; [`EchoError::OutOfMemory`] if the
    /// storage cannot be allocated.
    pub fn new(
        spec: DataSpec,
        config: ReplayConfig,
        sequence: SequenceConfig,
    ) -> Result<Arc<Self>, EchoError> {
        let bad = |msg: String| Err(EchoError::Config(msg));
        let SequenceConfig { length, period, max_streams, .. } = sequence;
        if length < 1 {
            return bad(format!("Sequence(length) must be >= 1, got {length}"));
        }
        if period < 1 {
            return bad(format!("Sequence(period) must be >= 1, got {period}"));
        }
        if max_streams < 1 {
            return bad(format!("Sequence(max_streams) must be >= 1, got {max_streams}"));
        }
        if length > u32::MAX as usize / 4 || period > u32::MAX as usize / 4 {
            return bad(format!("Sequence: length and period must be below 2^30, got {length}"));
        }
        let (batch_size, max_size) = (config.batch_size, config.max_size);
        if batch_size < 1 {
            return bad(format!("batch_size must be >= 1, got {batch_size}"));
        }
        if max_size < length {
            return bad(format!(
                "max_size counts steps and must hold one window: >= length ({length}), got \
                 {max_size}"
            ));
        }
        if config.remover != RemoverKind::Fifo {
            return bad(
                "a sequence table evicts its oldest steps: remover must be Fifo()".to_owned()
            );
        }
        config.rate_limit.validate(max_size as u64)?;
        config.sampler.check()?;
        let chunk_length = sequence.chunk_length(max_size);
        let step_bytes = spec.payload_size() as u64;
        if let Some(most) = config.max_bytes {
            let window = step_bytes.saturating_mul(length as u64);
            if most < window {
                return bad(format!(
                    "max_bytes must hold one window of raw steps, length ({length}) * \
                     {step_bytes} bytes = {window}, got {most}"
                ));
            }
        }
        let chunk_arrays = spec
            .arrays()
            .iter()
            .map(|a| {
                let shape = std::iter::once(chunk_length).chain(a.shape().iter().copied());
                ArraySpec::new(shape.collect(), a.dtype_size())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let codecs = if config.compress.is_empty() {
            LeafCodecs::none(&spec)
        } else {
            LeafCodecs::new(&DataSpec::new(chunk_arrays)?, config.compress.clone())
                .map_err(|e| EchoError::Config(format!("a chunk of {chunk_length} steps: {e}")))?
        };
        let mut packed_index = vec![None; spec.len()].into_boxed_slice();
        for (k, &leaf) in codecs.packed_leaves().iter().enumerate() {
            packed_index[leaf] = Some(k);
        }
        let staged_arrays: Box<[ArraySpec]> =
            codecs.packed_leaves().iter().map(|&leaf| spec.arrays()[leaf].clone()).collect();
        let stored_arrays = spec
            .arrays()
            .iter()
            .enumerate()
            .map(|(leaf, array)| match packed_index[leaf] {
                Some(_) => ArraySpec::new(vec![0], array.dtype_size()),
                None => Ok(array.clone()),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fixed_bytes =
            step_bytes - staged_arrays.iter().map(|a| a.num_bytes() as u64).sum::<u64>();
        // Invariant 3: a window of `length` steps starting anywhere in a chunk spans at most
        // this many chunks, and a batch pins at most `batch_size` windows' worth.
        let max_runs = (length - 1).div_ceil(chunk_length) + 1;
        let chunks = batch_size
            .checked_mul(max_runs)
            .and_then(|spare| spare.checked_add(max_size.div_ceil(chunk_length) + 1))
            .filter(|&c| c.checked_mul(chunk_length).is_some_and(|s| s < u32::MAX as usize))
            .ok_or_else(|| {
                EchoError::Config(format!(
                    "max_size ({max_size}) + batch_size ({batch_size}) * {max_runs} chunks of \
                     {chunk_length} steps must stay below 2^32 - 1 slots"
                ))
            })?;
        let slots = chunks * chunk_length;
        let storage = Slots::of_arrays(&stored_arrays, slots)?;
        let mut area_arrays = Vec::with_capacity(spec.len() + SEQUENCE_META.len());
        for array in spec.arrays() {
            let shape = std::iter::once(length).chain(array.shape().iter().copied()).collect();
            area_arrays.push(ArraySpec::new(shape, array.dtype_size())?);
        }
        for meta in SEQUENCE_META {
            let shape = if meta.per_step { vec![length] } else { Vec::new() };
            area_arrays.push(ArraySpec::new(shape, meta.bytes)?);
        }
        let area = Slots::new(&DataSpec::new(area_arrays)?, 2 * batch_size)?;
        let max_bytes = config.max_bytes.unwrap_or(u64::MAX);
        let geometry = Geometry {
            length,
            period,
            at_end: sequence.at_end,
            max_size,
            chunk_length,
            max_times_sampled: config.max_times_sampled,
        };
        let state = State {
            chunks: vec![Chunk::FREE; chunks].into_boxed_slice(),
            free_chunks: (0..chunks as u32).rev().collect(),
            live_chunks: VecDeque::with_capacity(chunks),
            step_priority: vec![0; slots].into_boxed_slice(),
            windows: {
                // Room for a window per `period` steps: more only with many short episodes.
                let mut map = HashMap::default();
                map.reserve(slots / period + 1);
                map
            },
            streams: Vec::new(),
            free_streams: Vec::new(),
            stream_index: HashMap::new(),
            episodes: HashMap::new(),
            sampler: new_sampler(config.sampler, slots, batch_size)?,
            limiter: RateLimiter::new(config.rate_limit),
            rng: config.seed.map_or_else(Rng::from_entropy, Rng::from_seed),
            draw_slots: vec![0; batch_size].into_boxed_slice(),
            draw_probabilities: vec![0.0; batch_size].into_boxed_slice(),
            live_windows: 0,
            steps: 0,
            next_episode: 0,
            max_priority: 1.0,
            stats: SequenceStats::default(),
            parked: Parked::default(),
            cow: None,
            stored_bytes: 0,
            staged: vec![None; chunks].into_boxed_slice(),
            packed: vec![None; chunks].into_boxed_slice(),
            spare_staged: Vec::new(),
            to_pack: Vec::new(),
        };
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let packer_threads = if codecs.is_empty() { 0 } else { (cores - 1).min(MAX_PACKERS) };
        let packers = (packer_threads > 0)
            .then(|| Arc::new(Packers { threads: packer_threads, ..Packers::default() }));
        let signals = Shell::new(config.rate_limit, batch_size, area);
        let table = Arc::new(Self {
            spec,
            config,
            sequence,
            geometry,
            storage,
            codecs,
            staged_arrays,
            packed_index,
            fixed_bytes,
            step_bytes,
            max_bytes,
            codec_threads: cores.min(8),
            packers,
            state: Mutex::new(state),
            signals,
        });
        if let Some(packers) = &table.packers {
            for i in 0..packers.threads {
                let (packers, weak) = (Arc::clone(packers), Arc::downgrade(&table));
                std::thread::Builder::new()
                    .name(format!("echo-pack-{i}"))
                    .spawn(move || pack_in_background(&packers, &weak))
                    .map_err(|e| EchoError::Config(format!("cannot start a packer thread: {e}")))?;
            }
        }
        Ok(table)
    }

    /// The replay settings (`max_size` in steps, the rest in windows).
    pub fn config(&self) -> &ReplayConfig {
        &self.config
    }

    /// How windows are cut.
    pub fn sequence(&self) -> &SequenceConfig {
        &self.sequence
    }

    /// The step layout.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// Steps per chunk (consecutive steps of one stream stored together).
    pub fn chunk_length(&self) -> usize {
        self.geometry.chunk_length
    }

    /// The single consumer handle; `None` if one was already taken.
    pub fn consumer(self: &Arc<Self>) -> Option<SequenceConsumer> {
        if !self.signals.claim_consumer() {
            return None;
        }
        Some(SequenceConsumer {
            table: Arc::clone(self),
            pending: Vec::with_capacity(self.config.batch_size),
            runs: Vec::new(),
            cursor: BatchCursor::default(),
            holdback: None,
        })
    }

    /// Closes the table: waiting and future inserts fail with `Closed`, `sample` returns
    /// [`EchoError::Closed`]. Idempotent.
    pub fn close(&self) {
        self.signals.close(&self.state.lock());
    }

    /// Whether [`SequenceTable::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.signals.is_closed()
    }

    /// Rung whenever a waiting insert might now go further (see `Backend::insert_bell`).
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn insert_bell(&self) -> &AsyncBell {
        self.signals.insert_bell()
    }

    fn check_priority(state: &State, priority: f64) -> Result<(), String> {
        check_priority(&*state.sampler, priority)
    }

    /// Checks one priority as an insert or an update would.
    ///
    /// # Errors
    /// [`EchoError::Priority`] saying what is wrong with it.
    pub fn check_one_priority(&self, priority: f64) -> Result<(), EchoError> {
        let state = self.state.lock();
        Self::check_priority(&state, priority)
            .map_err(|msg| EchoError::Priority(format!("priority {msg}")))
    }

    /// Appends every step of `src` to its stream ([`SampleSource::step`]), in order, each
    /// with `priority` (or its own, [`SampleSource::priority`]) for the windows it is part
    /// of, waiting for the rate limiter until `deadline`. A step that ends its episode makes
    /// the episode's last windows as `at_end` says.
    ///
    /// # Errors
    /// An input error (nothing written) if a step does not match the spec or a priority is
    /// invalid; [`EchoError::Config`] (with the count inserted before it) for a step that
    /// would open more than `max_streams` streams; [`EchoError::Closed`] /
    /// [`EchoError::TimedOut`] with the count inserted so far.
    pub fn insert<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        validate_source(&self.spec, src)?;
        let mut state =
            lock_until(&self.state, deadline).map_err(|error| InsertError::new(0, error))?;
        check_insert_priorities(&*state.sampler, src, priority)?;
        let mut put = || {
            for sample in 0..src.num_samples() {
                self.signals
                    .wait_writable(&mut state, deadline, |s| {
                        s.limiter.can_insert(s.live_windows as u64)
                    })
                    .map_err(|error| InsertError::new(sample, error))?;
                let windows_before = state.live_windows;
                self.put_step(&mut state, src, sample, src.priority(sample).or(priority))
                    .map_err(|error| InsertError::new(sample, error))?;
                src.inserted(1);
                if state.live_windows > windows_before {
                    self.signals.notify_sample();
                }
            }
            Ok(())
        };
        let put = put();
        // The chunks these steps filled, at once: a vector env's streams fill theirs together.
        self.pack_queued(&mut state);
        put
    }

    /// Packs the chunks queued for packing (full, or their stream gone) with the lock let go,
    /// then puts each in place of its staged steps. The chunks stay readable meanwhile:
    /// nothing writes a full chunk, and the staging buffer being read is not reused while
    /// this writer holds it.
    ///
    /// With background packers, the chunks go to them instead (the writer returns at once),
    /// as long as they are not behind by more than [`QUEUED_PER_PACKER`] chunks each; the
    /// rest this writer packs itself.
    fn pack_queued(&self, state: &mut MutexGuard<'_, State>) {
        if state.to_pack.is_empty() {
            return;
        }
        let mut jobs = std::mem::take(&mut state.to_pack);
        if let Some(packers) = &self.packers {
            let mut queue = packers.queue.lock();
            let chunk = (self.geometry.chunk_length as u64
                * self.staged_arrays.iter().map(|a| a.num_bytes() as u64).sum::<u64>())
            .max(1);
            let most = (packers.threads * QUEUED_PER_PACKER)
                .min(usize::try_from(self.max_bytes / 8 / chunk).unwrap_or(usize::MAX));
            let room = most.saturating_sub(queue.jobs.len());
            let handed = jobs.len().min(room);
            queue.jobs.extend(jobs.drain(..handed));
            drop(queue);
            for _ in 0..handed {
                packers.ready.notify_one();
            }
            if jobs.is_empty() {
                return;
            }
        }
        let raw = jobs.iter().map(|job| job.filled as usize).sum::<usize>()
            * self.staged_arrays.iter().map(ArraySpec::num_bytes).sum::<usize>();
        let threads = codec::threads_for(
            raw,
            codec::COMPRESS_BYTES_PER_THREAD,
            jobs.len(),
            self.codec_threads,
        );
        let packed: Vec<Packed> = MutexGuard::unlocked(state, || {
            // Several full chunks (many streams stepping together): one per thread at a time.
            let parts = codec::in_parts(&jobs, threads, |_, part| {
                part.iter().map(|job| self.pack(job)).collect::<Vec<_>>()
            });
            parts.into_iter().flatten().collect()
        });
        for (job, packed) in jobs.iter().zip(packed) {
            state.install_packed(job, packed, self.fixed_bytes);
        }
    }

    /// Waits until the background packers have packed and put in place every chunk handed
    /// to them so far (at once without packers). For tests and benchmarks that read
    /// `stored_bytes` right after inserting: chunks waiting to be packed count raw.
    pub fn wait_packed(&self) {
        let Some(packers) = &self.packers else { return };
        let mut queue = packers.queue.lock();
        while !queue.jobs.is_empty() || queue.busy > 0 {
            packers.idle.wait(&mut queue);
        }
    }

    /// The packed item of a chunk's first `job.filled` staged steps.
    fn pack(&self, job: &PackJob) -> Packed {
        let steps = 0..job.filled as usize;
        self.codecs.pack_with(
            |k, compress| {
                // SAFETY: the chunk's first `filled` steps are written (under the lock, which
                // this writer took since) and nothing writes them again: appends go past
                // them, and the buffer is reused only once nobody else holds it.
                unsafe { job.staged.read_slots(k, steps.clone(), |raw| compress(raw)) };
            },
            |packed: &[u8]| Arc::from(packed),
        )
    }

    /// Appends one step (the lock held): room first (evicting the oldest chunks), then the
    /// stream's chunk, the copy, and the windows the step completes.
    fn put_step<S: SampleSource + ?Sized>(
        &self,
        state: &mut State,
        src: &S,
        sample: usize,
        priority: Option<f64>,
    ) -> Result<(), EchoError> {
        let g = &self.geometry;
        let tag = src.step(sample);
        let at = state.open_stream(g, tag.stream);
        // Room by count, then by bytes (as long as something is stored: the window-sized
        // minimum of `max_bytes` is the caller's floor).
        while state.steps >= g.max_size
            || (state.stored_bytes + self.step_bytes > self.max_bytes
                && !state.live_chunks.is_empty())
        {
            state.evict_oldest(g);
        }
        let mut c = state.streams[at].chunk;
        if c == NIL || state.chunks[c as usize].filled as usize == g.chunk_length {
            // Its staging buffer first: a failed allocation leaves the table as it was.
            let staged = match self.codecs.is_empty() {
                true => None,
                false => Some(match state.reuse_staged() {
                    Some(staged) => staged,
                    None => Arc::new(Slots::of_arrays(&self.staged_arrays, g.chunk_length)?),
                }),
            };
            let new = state.take_chunk(g, tag.stream) as u32;
            state.staged[new as usize] = staged;
            self.preserve_for_checkpoint(state, new as usize);
            // The stream's old chunk may have been evicted just now (then it is not linked:
            // nothing live reaches past it).
            let old = state.streams[at].chunk;
            if old != NIL {
                state.chunks[old as usize].next = new;
            }
            state.streams[at].chunk = new;
            c = new;
        }
        let c = c as usize;
        let offset = state.chunks[c].filled as usize;
        let slot = g.first_slot(c) + offset;
        for leaf in 0..self.spec.len() {
            let copy = |dst: &mut [u8]| src.copy_leaf(sample, leaf, dst);
            match (self.packed_index[leaf], &state.staged[c]) {
                // SAFETY: `offset` is past the `filled` steps of the chunk's staging buffer:
                // readers (the consumer, a packing writer, a checkpoint) only read the
                // steps a chunk held when they took the buffer, and it is only ever written
                // here, under the lock, for the chunk that owns it (a reused buffer is one
                // nobody else holds). Sizes were checked by `validate_source`.
                (Some(k), Some(staged)) => unsafe { staged.fill_slot(offset, k, copy) },
                (Some(_), None) => unreachable!("a chunk with compressed leaves is staged"),
                // SAFETY: `slot` is past the `filled` steps of a live chunk we hold the lock
                // over: no window covers it (windows only cover written steps), so the
                // consumer never reads it, and writers only write under this lock (invariant
                // 2: a chunk being read is pinned, and a pinned chunk is never handed out by
                // `take_chunk`). Sizes were checked by `validate_source`.
                (None, _) => unsafe { self.storage.fill_slot(slot, leaf, copy) },
            }
        }
        let stream = &mut state.streams[at];
        let index = stream.count;
        stream.count += 1;
        stream.recent[index as usize % g.length] = slot as u32;
        let episode = stream.episode;
        let chunk = &mut state.chunks[c];
        chunk.filled += 1;
        chunk.bytes += self.step_bytes;
        chunk.last_episode = episode;
        chunk.last_index = index;
        let full = chunk.filled as usize == g.chunk_length;
        state.stored_bytes += self.step_bytes;
        if full {
            state.queue_pack(c);
        }
        // The slot reads 0 (no priority) already: a chunk is cleared when taken if it had any.
        // Writing only real priorities leaves the array's pages untouched (not resident).
        if let Some(p) = priority {
            state.step_priority[slot] = encode_priority(p);
            state.chunks[c].has_priorities = true;
        }
        state.steps += 1;
        state.stats.steps_inserted += 1;
        // The windows this step completes: the one starting `length - 1` steps back.
        let t = g.length as u32;
        loop {
            let stream = &state.streams[at];
            let start = stream.next_start;
            if start.saturating_add(t) > stream.count {
                break;
            }
            state.streams[at].next_start += g.period as u32;
            if start >= state.streams[at].retained_from {
                state.make_window(g, at, start, t);
            }
        }
        if tag.end != EpisodeEnd::No {
            state.end_episode(g, at, tag.end);
        }
        Ok(())
    }

    /// Ends `stream`'s open episode as `end` (truncated when its worker is gone for good)
    /// after its last step, making its last windows as `at_end` says. Returns whether the
    /// stream had an open episode.
    pub fn end_stream(&self, stream: u64, end: EpisodeEnd) -> bool {
        let end = if end == EpisodeEnd::No { EpisodeEnd::Truncated } else { end };
        let mut state = self.state.lock();
        let Some(&at) = state.stream_index.get(&stream) else {
            return false;
        };
        let at = at as usize;
        let open = state.streams[at].in_episode;
        let before = state.live_windows;
        if open {
            state.end_episode(&self.geometry, at, end);
        }
        state.forget_stream(at);
        if state.live_windows > before {
            self.signals.notify_sample();
        }
        self.pack_queued(&mut state);
        open
    }

    /// Sets the priority of every window in `keys` that is still in the table; keys of
    /// evicted or removed windows are skipped and counted. Returns the number skipped.
    ///
    /// # Errors
    /// [`EchoError::Priority`] (nothing changed) if the lengths differ or a priority is
    /// invalid, naming its index.
    pub fn update_priorities(&self, keys: &[u64], priorities: &[f64]) -> Result<u64, EchoError> {
        let mut state = self.state.lock();
        check_update(&*state.sampler, keys, priorities)?;
        let mut unknown = 0;
        for (&key, &priority) in keys.iter().zip(priorities) {
            let Some(slot) = state.window_of_key(&self.geometry, key) else {
                unknown += 1;
                continue;
            };
            state.windows.get_mut(&(slot as u32)).expect("a live window").priority = priority;
            state.sampler.update(slot, priority);
            state.max_priority = state.max_priority.max(priority);
        }
        state.stats.windows.priority_updates += keys.len() as u64 - unknown;
        state.stats.windows.unknown_keys += unknown;
        Ok(unknown)
    }

    /// The priority of the window `key`, `None` if it is not in the table.
    pub fn priority(&self, key: u64) -> Option<f64> {
        let state = self.state.lock();
        state.window_of_key(&self.geometry, key).map(|slot| state.windows[&(slot as u32)].priority)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SequenceStats {
        let state = self.state.lock();
        let mut stats = state.stats;
        stats.windows.size = state.live_windows as u64;
        stats.windows.insert_blocked_ns += self.signals.insert_blocked_outside_ns.get();
        stats.steps = state.steps as u64;
        stats.windows.stored_bytes = state.stored_bytes;
        stats.windows.raw_bytes = stats.steps * self.step_bytes;
        stats
    }

    /// Adds `ns` to the windows' `insert_blocked_ns`: an insert that does not wait was
    /// refused and its caller waited that long outside the table before trying again (see
    /// `Backend::note_insert_blocked`). Never takes the lock.
    pub fn note_insert_blocked(&self, ns: u64) {
        self.signals.note_insert_blocked(ns);
    }

    /// The limiter and its counters now (over windows), for the message of an insert that
    /// timed out.
    pub fn insert_holdback(&self) -> InsertHoldback {
        let state = self.state.lock();
        self.signals.insert_holdback(&state.limiter, state.live_windows as u64)
    }

    /// Writers parked on the rate limiter right now.
    pub fn waiting_inserts(&self) -> u64 {
        self.state.lock().parked.inserts
    }

    /// 1 while the consumer is parked in `sample`.
    pub fn waiting_samples(&self) -> u64 {
        self.state.lock().parked.samples
    }

    /// Address of the first byte of `leaf` in batch-area half `half`: `batch_size` windows
    /// back to back. Leaves `spec.len()..` are the [`SEQUENCE_META`] values.
    pub fn batch_ptr(&self, half: usize, leaf: usize) -> *const u8 {
        self.signals.batch_ptr(half, leaf)
    }

    /// Page-locks the batch area with `cudaHostRegister`. Idempotent.
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
        unsafe { self.signals.pin_host_memory(cuda_runtimes) }
    }

    /// Whether the batch area is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.signals.is_pinned()
    }

    /// Decompresses compressed leaf `k` of a packed chunk into `dst` (its steps' raw bytes).
    /// The table packed every chunk itself, so this cannot fail short of a bug; if it does,
    /// the steps read as zeros and the error is logged, rather than failing a learner's batch.
    fn unpack(&self, packed: &[u8], k: usize, dst: &mut [u8]) {
        if let Err(msg) = self.codecs.unpack_into(packed, k, dst) {
            debug_assert!(false, "a packed chunk does not decompress: {msg}");
            log::error!("echo sequence: a packed chunk does not decompress ({msg}); zeros instead");
            dst.fill(0);
        }
    }

    /// Which leaves are stored compressed (`None`: no codec per leaf).
    pub fn codecs(&self) -> &LeafCodecs {
        &self.codecs
    }
}

/// A packed chunk a batch reads: its steps, and its runs as (window, step in the window,
/// step in the chunk, steps).
struct ChunkReads<'a> {
    packed: &'a Packed,
    filled: u32,
    runs: Vec<(usize, usize, usize, usize)>,
}

impl Drop for SequenceTable {
    fn drop(&mut self) {
        if let Some(packers) = &self.packers {
            packers.queue.lock().closed = true;
            packers.ready.notify_all();
        }
    }
}

/// A background packer: takes the queued chunks one at a time, packs each with the table's
/// lock let go, and puts it in place under the lock (as a writer would), until the table is
/// gone.
fn pack_in_background(packers: &Packers, table: &std::sync::Weak<SequenceTable>) {
    loop {
        let job = {
            let mut queue = packers.queue.lock();
            loop {
                if queue.closed {
                    return;
                }
                if let Some(job) = queue.jobs.pop_front() {
                    queue.busy += 1;
                    break job;
                }
                packers.ready.wait(&mut queue);
            }
        };
        // The table may be dropped meanwhile (then the job is too). Its last reference may
        // be this one: it is dropped before the queue is locked again, as the table's drop
        // locks it.
        if let Some(table) = table.upgrade() {
            let packed = table.pack(&job);
            table.state.lock().install_packed(&job, packed, table.fixed_bytes);
        }
        drop(job);
        let mut queue = packers.queue.lock();
        queue.busy -= 1;
        if queue.jobs.is_empty() && queue.busy == 0 {
            packers.idle.notify_all();
        }
    }
}

thread_local! {
    /// Where a packed chunk's leaf is decompressed when a batch reads only part of it.
    static UNPACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The one consumer of a [`SequenceTable`]. `sample` takes `&mut self`: one batch at a time.
#[derive(Debug)]
pub struct SequenceConsumer {
    table: Arc<SequenceTable>,
    /// Windows drawn for the batch being assembled (kept across a timed-out `sample`).
    pending: Vec<Drawn>,
    /// The slot runs of `pending`'s windows.
    runs: Vec<Run>,
    /// The batch-area half the next batch goes into, and its number.
    cursor: BatchCursor,
    /// What held the last `sample` back when it timed out (`None` after a batch).
    holdback: Option<SampleHoldback>,
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
        let mut state = table.state.lock();
        let (pending, runs) = (&mut self.pending, &mut self.runs);
        table.signals.draw_rounds(
            &mut state,
            deadline,
            pending.len(),
            &mut self.holdback,
            |state, n| state.draw(g, n, pending, runs),
        )?;
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
                unsafe { table.signals.area().fill_slot(base + i, leaf, fill) };
            }
        }
        let t = table.geometry.length;
        for (i, drawn) in self.pending.iter().enumerate() {
            let real = (drawn.len as usize).min(t);
            // SAFETY: as above, the consumer's own batch area.
            unsafe {
                table.signals.area().fill_slot(base + i, leaves + 3, |mask| {
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
                table.signals.area().fill_slot(base + i, leaves + 9, |is_last| {
                    is_last.fill(0);
                    if let Some(j) = last {
                        is_last[j] = 1;
                    }
                });
            }
            drawn.write_meta(|m, bytes| {
                // SAFETY: as above; `write_slot` checks the length against the area's leaf.
                unsafe { table.signals.area().write_slot(base + i, leaves + m, bytes) }
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
            self.table.signals.area().fill_part(
                slot,
                leaf,
                steps.start * size..steps.end * size,
                fill,
            )
        };
    }

    /// Calls `f` with the bytes of `leaf` (a step leaf, `length` steps per window, then the
    /// [`SEQUENCE_META`] values) of `batch`: `batch_size` windows back to back.
    ///
    /// # Panics
    /// If `leaf` is out of range.
    pub fn read_leaf<T>(&self, batch: ReplayBatch, leaf: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        // SAFETY: only this consumer writes the batch area, in `sample` (`&mut self`), which
        // cannot run while `&self` is borrowed here.
        unsafe { self.table.signals.read_batch(batch, leaf, f) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Leaves;

    /// One leaf: the step's id (u64).
    fn spec() -> DataSpec {
        DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap()
    }

    struct Step<'a> {
        leaves: Leaves<'a>,
        tag: StepTag,
    }

    impl SampleSource for Step<'_> {
        fn num_samples(&self) -> usize {
            1
        }
        fn num_leaves(&self, _: usize) -> usize {
            self.leaves.0.len()
        }
        fn leaf(&self, _: usize, leaf: usize) -> &[u8] {
            self.leaves.0[leaf]
        }
        fn step(&self, _: usize) -> StepTag {
            self.tag
        }
    }

    fn put(t: &SequenceTable, stream: u64, id: u64, end: EpisodeEnd) {
        let bytes = id.to_ne_bytes();
        let slices = [&bytes[..]];
        let step = Step { leaves: Leaves(&slices), tag: StepTag { stream, end } };
        t.insert(&step, None, None).unwrap();
    }

    fn table(batch: usize, max_size: usize, seq: SequenceConfig) -> Arc<SequenceTable> {
        let config = ReplayConfig { seed: Some(7), ..ReplayConfig::new(batch, max_size) };
        SequenceTable::new(spec(), config, seq).unwrap()
    }

    /// Every window of a batch: (ids of its real steps, mask, start, episode).
    fn windows(c: &mut SequenceConsumer) -> Vec<(Vec<u64>, Vec<bool>, u32, u64)> {
        let b = c.sample(Some(Instant::now() + std::time::Duration::from_secs(5))).unwrap();
        let t = c.table.geometry.length;
        let n = c.table.config.batch_size;
        let ids: Vec<u64> = c.read_leaf(b, 0, |bytes| {
            bytes.chunks_exact(8).map(|x| u64::from_ne_bytes(x.try_into().unwrap())).collect()
        });
        let mask: Vec<bool> =
            c.read_leaf(b, 1 + 3, |bytes| bytes.iter().map(|&x| x == 1).collect());
        let start: Vec<u32> = c.read_leaf(b, 1 + 5, |bytes| {
            bytes.chunks_exact(4).map(|x| u32::from_ne_bytes(x.try_into().unwrap())).collect()
        });
        let episode: Vec<u64> = c.read_leaf(b, 1 + 4, |bytes| {
            bytes.chunks_exact(8).map(|x| u64::from_ne_bytes(x.try_into().unwrap())).collect()
        });
        (0..n)
            .map(|i| {
                let m = mask[i * t..(i + 1) * t].to_vec();
                let real = m.iter().filter(|&&x| x).count();
                (ids[i * t..i * t + real].to_vec(), m, start[i], episode[i])
            })
            .collect()
    }

    #[test]
    fn config_errors_name_the_parameter() {
        let err = |seq: SequenceConfig, max_size: usize| {
            SequenceTable::new(spec(), ReplayConfig::new(2, max_size), seq).unwrap_err().to_string()
        };
        assert!(err(SequenceConfig::new(0), 10).contains("Sequence(length) must be >= 1, got 0"));
        let p0 = SequenceConfig { period: 0, ..SequenceConfig::new(4) };
        assert!(err(p0, 10).contains("Sequence(period) must be >= 1, got 0"));
        assert!(err(SequenceConfig::new(8), 5).contains(">= length (8), got 5"));
        let mut c = ReplayConfig::new(2, 10);
        c.remover = RemoverKind::MinPriority;
        let e = SequenceTable::new(spec(), c, SequenceConfig::new(2)).unwrap_err().to_string();
        assert!(e.contains("remover must be Fifo()"), "{e}");
    }

    #[test]
    fn windows_start_every_period_and_hold_consecutive_steps() {
        let seq = SequenceConfig { period: 2, at_end: AtEnd::Drop, ..SequenceConfig::new(4) };
        let t = table(8, 100, seq);
        for id in 0..9 {
            put(&t, 0, id, EpisodeEnd::No);
        }
        // Starts 0, 2, 4 are complete (4 + 4 <= 9); 6 is not.
        assert_eq!(t.stats().windows.size, 3);
        let mut c = t.consumer().unwrap();
        for (ids, mask, start, _) in windows(&mut c) {
            assert_eq!(ids, (u64::from(start)..u64::from(start) + 4).collect::<Vec<_>>());
            assert!(mask.iter().all(|&m| m));
            assert!([0, 2, 4].contains(&start));
        }
    }

    #[test]
    fn at_end_pad_shift_drop() {
        // An episode of 7 steps, windows of 4 every 2: whole windows at 0 and 2 (steps 0-3,
        // 2-5); start 4 and 6 would run past the end.
        let cases = [
            (AtEnd::Pad, vec![(0, 4), (2, 4), (4, 3), (6, 1)]),
            (AtEnd::Shift, vec![(0, 4), (2, 4), (3, 4)]),
            (AtEnd::Drop, vec![(0, 4), (2, 4)]),
        ];
        for (at_end, expected) in cases {
            let seq = SequenceConfig { period: 2, at_end, ..SequenceConfig::new(4) };
            let t = table(64, 100, seq);
            for id in 0..7 {
                let end = if id == 6 { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                put(&t, 3, id, end);
            }
            assert_eq!(t.stats().windows.size, expected.len() as u64, "{at_end:?}");
            let mut c = t.consumer().unwrap();
            let mut seen: Vec<(u32, usize)> = Vec::new();
            for (ids, mask, start, _) in windows(&mut c) {
                let len = ids.len();
                assert_eq!(
                    ids,
                    (u64::from(start)..u64::from(start) + len as u64).collect::<Vec<_>>()
                );
                assert_eq!(mask.iter().filter(|&&m| m).count(), len);
                assert!(mask[..len].iter().all(|&m| m) && mask[len..].iter().all(|&m| !m));
                seen.push((start, len));
            }
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen, expected, "{at_end:?}: every window drawn in 64 draws of 2-4");
        }
    }

    #[test]
    fn short_episodes_follow_the_same_rule() {
        for (at_end, windows_made) in [(AtEnd::Pad, 1), (AtEnd::Shift, 1), (AtEnd::Drop, 0)] {
            let seq = SequenceConfig { at_end, ..SequenceConfig::new(5) };
            let t = table(2, 50, seq);
            put(&t, 0, 10, EpisodeEnd::No);
            put(&t, 0, 11, EpisodeEnd::Truncated);
            let stats = t.stats();
            assert_eq!(stats.windows.size, windows_made, "{at_end:?}");
            assert_eq!((stats.episodes_ended, stats.streams_open), (1, 0));
        }
    }

    #[test]
    fn interleaved_streams_never_mix() {
        let seq = SequenceConfig { period: 3, ..SequenceConfig::new(5) };
        let t = table(32, 1000, seq);
        // Stream s sends ids s * 1000 + i, episodes of 11 steps.
        for i in 0..40u64 {
            for s in 0..4u64 {
                let end = if i % 11 == 10 { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                put(&t, s, s * 1000 + i, end);
            }
        }
        let mut c = t.consumer().unwrap();
        for _ in 0..20 {
            for (ids, _, start, _) in windows(&mut c) {
                let stream = ids[0] / 1000;
                let first = ids[0] % 1000;
                assert_eq!(first % 11, u64::from(start), "start is the index in the episode");
                for (j, id) in ids.iter().enumerate() {
                    assert_eq!(*id, stream * 1000 + first + j as u64);
                    assert_eq!((first + j as u64) / 11, first / 11, "one episode");
                }
            }
        }
    }

    #[test]
    fn eviction_removes_every_window_with_an_evicted_step() {
        // max_size 23 (prime), chunks of min(4, 6) = 4 steps, one stream, no episode ends.
        let seq = SequenceConfig { period: 1, ..SequenceConfig::new(4) };
        let t = table(4, 23, seq);
        assert_eq!(t.chunk_length(), 4);
        let mut c = t.consumer().unwrap();
        for id in 0..500u64 {
            put(&t, 0, id, EpisodeEnd::No);
            let stats = t.stats();
            assert!(stats.steps <= 23, "stored {} > max_size", stats.steps);
            if stats.windows.size > 0 && id % 7 == 0 {
                for (ids, _, _, _) in windows(&mut c) {
                    assert_eq!(ids.len(), 4);
                    // Everything stored is at most 23 steps old, and a window's steps are.
                    assert!(ids[0] + 23 > id, "window {ids:?} holds an evicted step at {id}");
                    assert_eq!(ids[3], ids[0] + 3);
                }
            }
        }
        assert!(t.stats().windows.evicted > 0);
    }

    #[test]
    fn a_stream_keeps_its_chunk_across_episodes() {
        // 100 episodes of 3 steps on one stream: chunks fill up across episode ends, so the
        // table holds as many steps as it may (it evicts a whole chunk, 8, at a time).
        let t = table(2, 64, SequenceConfig::new(8));
        for e in 0..100u64 {
            for i in 0..3 {
                let end = if i == 2 { EpisodeEnd::Terminated } else { EpisodeEnd::No };
                put(&t, 0, e * 3 + i, end);
            }
        }
        let stats = t.stats();
        assert!(stats.steps >= 64 - 8, "{stats:?}");
        assert_eq!((stats.episodes_ended, stats.streams_open), (100, 0));
    }

    #[test]
    fn stale_keys_are_ignored_and_counted() {
        let seq = SequenceConfig::new(2);
        let t = table(1, 8, seq);
        let mut c = t.consumer().unwrap();
        put(&t, 0, 0, EpisodeEnd::No);
        put(&t, 0, 1, EpisodeEnd::No);
        let b = c.sample(None).unwrap();
        let key = c.read_leaf(b, 1, |k| u64::from_ne_bytes(k.try_into().unwrap()));
        assert_eq!(t.priority(key), Some(1.0));
        assert_eq!(t.update_priorities(&[key], &[3.0]).unwrap(), 0);
        assert_eq!(t.priority(key), Some(3.0));
        for id in 2..40 {
            put(&t, 0, id, EpisodeEnd::No);
        }
        assert_eq!(t.priority(key), None, "its steps were evicted");
        assert_eq!(t.update_priorities(&[key, key + 1], &[5.0, 5.0]).unwrap(), 2);
        assert_eq!(t.stats().windows.unknown_keys, 2);
        // A new window later in the same slot has another key.
        for _ in 0..10 {
            let b = c.sample(None).unwrap();
            let k = c.read_leaf(b, 1, |k| u64::from_ne_bytes(k.try_into().unwrap()));
            assert_ne!(k, key);
        }
    }

    #[test]
    fn a_window_priority_is_the_max_of_its_steps_priorities() {
        let seq = SequenceConfig::new(3);
        let t = table(1, 30, seq);
        let mut c = t.consumer().unwrap();
        for (id, p) in [(0u64, Some(0.5)), (1, None), (2, Some(2.5))] {
            let bytes = id.to_ne_bytes();
            let slices = [&bytes[..]];
            let step = Step { leaves: Leaves(&slices), tag: StepTag::default() };
            t.insert(&step, p, None).unwrap();
        }
        let b = c.sample(None).unwrap();
        let key = c.read_leaf(b, 1, |k| u64::from_ne_bytes(k.try_into().unwrap()));
        assert_eq!(t.priority(key), Some(2.5));
    }

    #[test]
    fn a_gone_stream_is_truncated_and_its_windows_stay() {
        let seq = SequenceConfig { at_end: AtEnd::Pad, ..SequenceConfig::new(4) };
        let t = table(4, 40, seq);
        for id in 0..6 {
            put(&t, 9, id, EpisodeEnd::No);
        }
        assert_eq!(t.stats().windows.size, 1);
        assert!(t.end_stream(9, EpisodeEnd::Truncated));
        assert!(!t.end_stream(9, EpisodeEnd::Truncated), "no open episode any more");
        let stats = t.stats();
        assert_eq!((stats.windows.size, stats.streams_open, stats.episodes_ended), (2, 0, 1));
        let mut c = t.consumer().unwrap();
        let b = c.sample(None).unwrap();
        let truncated = c.read_leaf(b, 1 + 8, <[u8]>::to_vec);
        let terminated = c.read_leaf(b, 1 + 7, <[u8]>::to_vec);
        assert!(truncated.iter().all(|&x| x == 1) && terminated.iter().all(|&x| x == 0));
    }
}
