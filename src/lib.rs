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
//! | `ring`      | the raw slot memory and its only `unsafe` accessors                |
//! | [`store`]   | cursors, reservation, commit, wake-ups, release, shutdown          |
//! | [`sampler`] | which batch the consumer gets next, which slots are freed          |
//! | [`sumtree`] | priorities for prioritized sampling: sum/max/min tree, O(log n)    |
//! | [`replay`]  | replay tables: uniform/prioritized/LIFO sampling, eviction, rate limits |
//! | `ingress`   | per-connection queues, buffer pools, the drainer pool               |
//! | `transport` | the wire format, the tokio TCP server, the blocking TCP client      |
//! | [`metrics`] | detailed counters/histograms, free unless `detailed-metrics` is on  |
//! | `pinned`    | page-locking the ring with a run-time loaded CUDA runtime           |
//! | [`error`]   | the one error enum                                                 |
//! | `sync`      | std/loom facade, so loom models run the real code                  |
//!
//! The pyo3 bindings live in `python` behind the `python` cargo feature (on for maturin
//! builds) and are the only code that touches Python.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod error;
#[cfg(not(loom))]
pub mod ingress;
pub mod metrics;
#[cfg(not(loom))]
pub mod pinned;
#[cfg(not(loom))]
pub mod replay;
mod ring;
pub mod sampler;
pub mod spec;
pub mod store;
pub mod sumtree;
mod sync;
#[cfg(not(loom))]
pub mod transport;

#[cfg(feature = "python")]
mod python;

pub use error::EchoError;
pub use ring::RING_ALIGN;
pub use sampler::{Fifo, Remover, Sampler};
pub use spec::{ArraySpec, DataSpec};
pub use store::{
    Consumer, InsertError, Leaves, Payloads, SampleError, SampleSource, Sink, Store, StoreStats,
};
