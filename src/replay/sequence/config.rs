//! What a sequence table is built with and what it reports: how windows are cut
//! ([`SequenceConfig`], [`AtEnd`]), the per-window values a batch carries after the steps'
//! leaves ([`SEQUENCE_META`]), and the counters ([`SequenceStats`]).

use crate::replay::table::{MetaLeaf, ReplayStats};

/// The `log` target of everything the sequence table logs: the logger `echo.replay.sequence` in Python,
/// whichever file of the module the record comes from (the user guides name it).
pub(crate) const LOG_TARGET: &str = "echo::replay::sequence";

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
    pub(super) fn chunk_length(&self, max_size: usize) -> usize {
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
