//! echo: a very fast replay buffer for distributed reinforcement learning.
//!
//! The core is plain Rust and knows nothing about Python or pytrees: a sample is a list of
//! byte arrays described by a [`DataSpec`]. Writers copy samples into a pre-allocated ring
//! ([`Store::insert`]); one [`Consumer`] takes out whole batches, each a contiguous slot range of
//! every leaf, so the Python layer can hand them out as zero-copy numpy views.
//!
//! | module      | owns                                                               |
//! |-------------|--------------------------------------------------------------------|
//! | [`spec`]    | sample layout, overflow-checked sizes                              |
//! | `slots`     | the raw slot memory and its only `unsafe` accessors                |
//! | [`source`]  | how samples are handed to a backend: `SampleSource` and its kinds  |
//! | [`store`]   | the FIFO ring: cursors, reservation, commit, wake-ups, release      |
//! | [`codec`]   | zstd/LZ4 compression of chosen leaves, packed items                 |
//! | [`replay`]  | replay tables: uniform/prioritized/LIFO sampling, eviction, rate limits |
//! | [`backend`] | one face over both: build, insert, sample, batch memory, statistics |
//! | [`server`]  | the server: a backend, its consumer, the ingress and transport, their lifecycle |
//! | `ingress`   | per-connection queues, buffer pools, the drainer pool               |
//! | [`queued`]  | acknowledged samples a checkpoint finds outside the backend          |
//! | [`params`]  | the learner's published parameters: two versions, read in chunks     |
//! | [`checkpoint`] | the checkpoint format: manifest, files, atomic directory, restore |
//! | `doorbell`  | the drainers' sleep/wake protocol, loom-checked                     |
//! | `transport` | the wire format, the TCP server, the TCP client, shared memory      |
//! | [`metrics`] | statistics counters; detailed histograms behind `detailed-metrics` |
//! | `pinned`    | page-locking memory with a run-time loaded CUDA runtime            |
//! | [`error`]   | the error enum, and the partial-insert error layered on it         |
//! | `sync`      | std/loom facade, so loom models run the real code                  |
//!
//! The pyo3 bindings live in `python` behind the `python` cargo feature (on for maturin
//! builds) and are the only code that touches Python.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// Under `--cfg loom` (scripts/loom.sh) the paths that loom cannot model (the gather and
// prefetch over mapped slots, the shared-memory maps, parts of the metrics) are compiled out
// of their callers, so their helpers go unused in that build only.
#![cfg_attr(loom, allow(dead_code, unused_imports))]

#[cfg(not(loom))]
pub mod backend;
#[cfg(not(loom))]
pub mod checkpoint;
#[cfg(not(loom))]
pub mod codec;
#[doc(hidden)]
pub mod doorbell;
pub mod error;
#[cfg(not(loom))]
pub mod fresh_ring;
#[cfg(not(loom))]
pub mod ingress;
pub mod metrics;
#[cfg(not(loom))]
pub mod params;
#[cfg(not(loom))]
pub mod pinned;
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
mod prefault;
#[cfg(not(loom))]
pub mod queued;
#[cfg(not(loom))]
pub mod ragged;
pub mod replay;
#[cfg(not(loom))]
pub mod server;
mod slots;
pub mod source;
pub mod spec;
pub mod store;
#[doc(hidden)]
pub mod sync;
pub mod transport;
pub mod versions;

#[cfg(feature = "python")]
mod python;

pub use error::{EchoError, InsertError};
pub use slots::RING_ALIGN;
pub use source::{EpisodeEnd, Leaves, Payloads, Rows, SampleSource, StepLeaves, StepTag};
pub use spec::{ArraySpec, DataSpec};
pub use store::{Consumer, Store, StoreStats};
