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
//!
//! | file            | holds                                                          |
//! |-----------------|----------------------------------------------------------------|
//! | `mod.rs`        | [`SequenceSnapshot`]'s contents and the copy-on-write marker   |
//! | `format.rs`     | the blob: [`SequenceSnapshot::encode`] and its defensive decode |
//! | `checkpoint.rs` | taking one: [`SequenceCheckpoint`], the lock hold, the copy-out |
//! | `restore.rs`    | rebuilding a new table from one, checked before it is touched  |

mod checkpoint;
mod format;
mod restore;

use std::collections::HashMap;

use super::{AtEnd, EpisodeEnd, StepTag};
use crate::queued::QueuedSamples;

pub use checkpoint::SequenceCheckpoint;

/// Copy-on-write bookkeeping of the running checkpoint (invariant 5).
pub(super) struct CopyOnWrite {
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
}
