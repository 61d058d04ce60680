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
//! | `table` | slots, the lock, inserts, batch assembly, priorities, counters |
//! | `sequence` | sequence tables: steps of streams, windows cut by episode, chunked storage |
//! | `rng` | xoshiro256++, seedable |
//! | [`sumtree`] | the priority sum tree behind `Prioritized`: O(log n) update and draw |

mod limiter;
mod rng;
mod select;
mod sequence;
pub mod sumtree;
mod table;

pub use limiter::{InsertHoldback, RateLimit, SampleHoldback};
pub use select::{RemoverKind, SamplerKind};
pub use sequence::{
    AtEnd, EpisodeEnd, SequenceCheckpoint, SequenceConfig, SequenceConsumer, SequenceSnapshot,
    SequenceStats, SequenceTable, StepTag, SEQUENCE_META,
};
pub use table::{
    Checkpoint, LeafRows, MetaLeaf, ReplayBatch, ReplayConfig, ReplayConsumer, ReplayStats,
    SnapshotItems, Table, TableState, BATCH_META, MAX_PRIORITY,
};
