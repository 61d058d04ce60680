//! Replay: items that stay in memory and are drawn at random, by priority or newest first,
//! possibly many times, evicted by a remover when the table is full and paced by a rate
//! limiter. DeepMind Reverb's table semantics, in-process.
//!
//! The FIFO store ([`crate::store`]) stays the zero-copy path for on-policy learners: each
//! sample is handed out once, as a view into the ring. A replay [`Table`] instead decouples
//! item storage from batches: `max_size` items of any count, each with a stable 64-bit key
//! (its insertion number), a priority and a times-sampled count, and a batch is *gathered*
//! into a pre-allocated, double-buffered batch area. Both are fed through [`crate::backend::Backend`],
//! so the ingress and every transport feed either without knowing which.
//!
//! | module | owns |
//! |---|---|
//! | `select` | samplers (`Uniform`, `Prioritized`, `Lifo`) and removers (`Fifo`, `Lifo`, `MinPriority`) |
//! | `limiter` | `MinSize`, `SampleToInsertRatio`, `Queue` (one mechanism, Reverb's meaning) |
//! | `shell` | what both tables wrap around their state: waits and close, the consumer claim, sample rounds, priority checks, the batch area and its pinning |
//! | `table` | slots, the lock, inserts, batch assembly, priorities, counters |
//! | `sequence` | sequence tables: steps of streams, windows cut by episode, chunked storage |
//! | `rng` | xoshiro256++, seedable |
//! | [`sumtree`] | the priority sum tree behind `Prioritized`: O(log n) update and draw |
//!
//! Under `--cfg loom` only `shell`'s wait/close protocol builds (for `tests/loom_shell.rs`).

#[cfg(not(loom))]
mod limiter;
#[cfg(not(loom))]
pub(crate) mod rng;
#[cfg(not(loom))]
mod select;
#[cfg(not(loom))]
mod sequence;
#[doc(hidden)]
pub mod shell;
#[cfg(not(loom))]
pub mod sumtree;
#[cfg(not(loom))]
mod table;

#[cfg(not(loom))]
pub use limiter::{InsertHoldback, RateLimit, SampleHoldback};
#[cfg(not(loom))]
pub use select::{RemoverKind, SamplerKind};
#[cfg(not(loom))]
pub use sequence::{
    AtEnd, EpisodeEnd, SequenceCheckpoint, SequenceConfig, SequenceConsumer, SequenceSnapshot,
    SequenceStats, SequenceTable, StepTag, SEQUENCE_META,
};
pub use shell::{ReplayBatch, MAX_PRIORITY};
#[cfg(not(loom))]
pub use table::{
    Checkpoint, LeafRows, MetaLeaf, ReplayConfig, ReplayConsumer, ReplayStats, SnapshotItems,
    Table, TableState, BATCH_META,
};
