//! Variable-length samples: leaves ragged along their first axis (episodes, token rollouts),
//! stored without padding and handed out packed (`cu_seqlens`) or padded (with a mask).
//!
//! ```text
//!  insert_group(samples)         RaggedTable (one lock)                 sample(layout)
//!  ───────────────────▶  checks ─▶ entries (a sample or a group)  ──▶  picked entries
//!   lengths, groups,             │   slots: per leaf an Extent          │ (held / pinned)
//!   token budget                 ▼                                      ▼
//!                          Arena: blocks shared by all leaves     batch::build: views of
//!                          (each leaf appends to its own block)   side-by-side rows, or
//!                                                                  gathered / padded copies
//! ```
//!
//! - [`spec`]: ragged and fixed leaves, length groups, and every length check.
//! - `arena`: the pre-allocated bytes, in blocks given back when their last sample goes.
//! - [`table`]: FIFO or replay (uniform, prioritized), groups inserted and handed out whole,
//!   token budgets, eviction of the oldest entries by items and by bytes.
//! - [`batch`]: the packed and padded layouts.
//! - [`wire`], [`tcp`], [`client`]: ragged samples and groups over wire v2, one thread per
//!   connection.

mod arena;
pub mod batch;
pub mod client;
pub mod spec;
pub mod table;
pub mod tcp;
pub mod wire;

pub use batch::{BatchLayout, BufPool, ColumnBatch, ColumnData, GroupBatch, OutBuf, RaggedBatch};
pub use spec::{Column, LeafDecl, LengthGroup, RaggedDecl, RaggedSpec};
pub use table::{
    deadline_after, RaggedConfig, RaggedExport, RaggedSampler, RaggedStats, RaggedTable, SampleIn,
    DEFAULT_MAX_BYTES, DROPPED,
};
