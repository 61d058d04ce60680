//! Checkpoints on disk, in one place: the manifest and every format version echo has written
//! ([`manifest`]), the `.npy` files the data goes into and comes back from ([`npy`]), the
//! directory that replaces a checkpoint's path atomically ([`directory`]), writing a
//! backend's snapshot ([`write()`]) and reading one back, checked, into a new backend
//! ([`OpenedCheckpoint`]).
//!
//! A checkpoint is a directory:
//! - `manifest.json`: the format (`echo-replay-checkpoint`, `echo-fifo-checkpoint` or
//!   `echo-sequence-checkpoint`), its version, the echo version, the layout (each leaf's path
//!   name, dtype, shape and file), the settings, the counts, and the size and SHA-256 of every
//!   other file ([`Manifest`]);
//! - one `.npy` file per leaf (`leaf_000.npy`, ...), rows in order; a leaf a table stores
//!   compressed is written as stored (`leaf_001.zst` or `.lz4`: the rows back to back, no
//!   header) with each row's length in `leaf_001.lengths.npy`;
//! - a replay table's `keys.npy`, `priorities.npy`, `times_sampled.npy`, a sequence table's
//!   `sequence.npy` (its windows, streams, episodes and counters, encoded by the table), the
//!   ingress's acknowledged samples (`ingress_leaf_000.npy`, ... and a replay table's
//!   `ingress_priorities.npy`);
//! - the learner's `extra`: `extra.json` (the tree, encoded by `echo.checkpoint`) and its
//!   arrays, `extra_000.npy`, ...
//!
//! Every file opens with `numpy.load(file, mmap_mode="r")` (the compressed leaves with
//! `numpy.fromfile`), for inspection or offline RL.
//!
//! The bindings convert the example and the `extra` tree; the Python layer keeps only the
//! tree's encoding, the periodic schedule and `read_extra`.

pub mod directory;
pub mod manifest;
mod mapped;
pub mod npy;
mod read;
mod write;

use serde_json::Value;

pub use manifest::{Kind, Manifest, Settings, Tuning, FORMAT_VERSION};
pub use npy::{
    write_leaf_files, write_leaf_files_chunked, Chunks, LeafFile, QueuedChunks, CHUNK_BYTES,
};
pub use read::{OpenedCheckpoint, Verify};
pub use write::{write, CheckpointRequest, Extra, ExtraArray, Stage};

/// An example's layout as a checkpoint records it: the tree's structure and each leaf.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// The tree's structure as optree prints it.
    pub treespec: String,
    /// The leaves in flattened order.
    pub leaves: Vec<ExampleLeaf>,
}

/// One leaf of an [`Example`].
#[derive(Debug, Clone, PartialEq)]
pub struct ExampleLeaf {
    /// Its path as Python prints it (`['obs']`).
    pub name: String,
    /// The keys and indices leading to it.
    pub path: Vec<Value>,
    /// numpy's `dtype_to_descr` of its dtype, as JSON.
    pub dtype: Value,
    /// The dtype as a `.npy` header spells it (`'<f4'`).
    pub npy_descr: String,
    /// One sample's shape.
    pub shape: Vec<usize>,
}
