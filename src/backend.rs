//! One face over the two storage backends, so that everything above the core (the Python
//! bindings, a future transport, checkpoints) is written once.
//!
//! ```text
//!                 Backend (insert side, shared)            BatchConsumer (the one reader)
//!               ┌──────────────────────────────┐        ┌────────────────────────────────┐
//!  FIFO         │ Fifo(Arc<Store>)             │        │ Fifo(Consumer)                 │
//!               │   zero-copy ring of batches  │        │   next committed batch, held   │
//!  replay       │ Replay(Arc<Table>)           │        │ Replay(ReplayConsumer)         │
//!               │   items, sampler, limiter    │        │   drawn + gathered batch       │
//!               └──────────────────────────────┘        └────────────────────────────────┘
//!        insert / stats() / batch_ptr()                     sample() -> BatchRef, read_leaf()
//! ```
//!
//! A [`BatchRef`] names a batch the consumer holds; its leaves are the sample's leaves and,
//! for replay, the [`BATCH_META`] values after them ([`Backend::batch_meta`]). Where the
//! bytes of a leaf live ([`Backend::batch_ptr`]) is stable until the consumer's next
//! `sample` (FIFO: the slots go back to writers then) or the one after (replay: the batch
//! area is double-buffered).

use std::any::Any;
use std::time::Instant;

use crate::error::{EchoError, InsertError};
use crate::fresh_ring::{FreshBatch, FreshRing};
use crate::metrics::DetailedSnapshot;
use crate::queued::QueuedSamples;
use crate::replay::{
    Checkpoint, EpisodeEnd, InsertHoldback, LeafRows, MetaLeaf, ReplayBatch, ReplayConfig,
    ReplayConsumer, ReplayStats, SampleHoldback, SequenceCheckpoint, SequenceConfig,
    SequenceConsumer, SequenceSnapshot, SequenceStats, SequenceTable, SnapshotItems, Table,
    TableState, SEQUENCE_META,
};
use crate::source::SampleSource;
use crate::spec::DataSpec;
use crate::store::{Consumer, RingCheckpoint, Store, StoreStats};
use crate::sync::{Arc, AsyncBell};
use crate::versions::{Admission, PolicyVersions};

pub use crate::replay::BATCH_META;

/// Which backend to build, with its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendConfig {
    /// The FIFO ring: `num_batches` batches of `batch_size` samples, each handed out once.
    Fifo {
        /// Samples per batch.
        batch_size: usize,
        /// Batches the ring holds (at least 2).
        num_batches: usize,
    },
    /// A replay table.
    Replay(ReplayConfig),
    /// A sequence table: `max_size` steps, windows cut and sampled as a replay table's items.
    Sequence(ReplayConfig, SequenceConfig),
}

/// The insert side of a backend; cheap to share (`Arc` inside).
#[derive(Debug, Clone)]
pub enum Backend {
    /// The FIFO ring.
    Fifo(Arc<Store>),
    /// A replay table.
    Replay(Arc<Table>),
    /// A sequence table.
    Sequence(Arc<SequenceTable>),
}

/// The one reader of a backend. `sample` takes `&mut self`: one batch at a time.
#[derive(Debug)]
pub enum BatchConsumer {
    /// Hands out committed batches of the ring in order.
    Fifo(Consumer),
    /// The same, skipping samples that became stale while they waited (a staleness bound).
    FifoFresh(FreshRing),
    /// Draws and gathers batches from a replay table.
    Replay(ReplayConsumer),
    /// Draws and gathers windows from a sequence table.
    Sequence(SequenceConsumer),
}

/// A batch the consumer handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchRef {
    /// 0 for the first batch, then 1, 2, ...
    pub sequence: u64,
    at: BatchAt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchAt {
    /// Absolute batch index in the FIFO ring.
    Ring(u64),
    /// A half of the FIFO ring's spill ([`FreshRing`]).
    Spill(usize),
    /// A half of a replay table's batch area.
    Area(ReplayBatch),
}

/// A running checkpoint of a backend, from [`Backend::checkpoint`].
#[derive(Debug)]
pub enum BackendCheckpoint {
    /// The ring's samples not yet handed out, then the ingress's (one sequence of rows).
    Fifo(FifoSnapshot),
    /// The table's snapshot, and the ingress's samples (not items yet: no keys).
    Replay(Checkpoint, QueuedSamples),
    /// The sequence table's snapshot, with the ingress's queued steps (their priorities and
    /// tags in the snapshot, their bytes here). Boxed: the snapshot is large.
    Sequence(Box<SequenceCheckpoint>, QueuedSamples),
}

/// A FIFO checkpoint: the ring's snapshot, then the acknowledged samples the ingress held at
/// the snapshot's moment, as one sequence of rows.
#[derive(Debug)]
pub struct FifoSnapshot {
    /// The ring's part (its slots stay pinned until copied).
    pub ring: RingCheckpoint,
    /// The ingress's part.
    pub queued: QueuedSamples,
    ring_rows: usize,
    /// The next ingress sample to write (the writer's cursor).
    pub(crate) next_queued: usize,
}

impl FifoSnapshot {
    /// The ring's snapshot followed by `queued`.
    pub fn new(ring: RingCheckpoint, queued: QueuedSamples) -> Self {
        let ring_rows = ring.len();
        Self { ring, queued, ring_rows, next_queued: 0 }
    }

    /// Rows from the ring (the first ones).
    pub fn ring_rows(&self) -> usize {
        self.ring_rows
    }
}

/// A checkpoint's contents, as [`Backend::restore`] takes them.
#[derive(Debug)]
pub enum Restore<'a> {
    /// The FIFO ring's `n` samples (`leaves[l]`: leaf `l` of each, back to back), the ingress's
    /// after the ring's.
    Fifo {
        /// Each leaf's rows.
        leaves: &'a [&'a [u8]],
        /// Samples.
        n: usize,
    },
    /// A replay table's items, in key order, and state; then the ingress's samples.
    Replay {
        /// Keys, priorities, times sampled.
        items: &'a SnapshotItems,
        /// The table-wide state.
        state: &'a TableState,
        /// Each leaf's rows.
        leaves: &'a [LeafRows<'a>],
        /// The ingress's acknowledged samples.
        queued: QueuedSamples,
    },
    /// A sequence table's snapshot, its steps and the steps the ingress had queued.
    Sequence {
        /// Everything but the steps.
        snapshot: &'a SequenceSnapshot,
        /// Each leaf's rows.
        leaves: &'a [LeafRows<'a>],
        /// Each leaf's queued steps.
        queued_leaves: &'a [&'a [u8]],
    },
}

impl Restore<'_> {
    /// `a replay table's`, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Self::Fifo { .. } => "a FIFO ring's",
            Self::Replay { .. } => "a replay table's",
            Self::Sequence { .. } => "a sequence table's",
        }
    }
}

/// A backend's counters, each in its own terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendStats {
    /// The FIFO ring's cursors and counts.
    Fifo(StoreStats),
    /// A replay table's counts.
    Replay(ReplayStats),
    /// A sequence table's counts (windows as items, plus steps, streams and episodes).
    Sequence(SequenceStats),
}

impl Backend {
    /// Builds the backend for samples of `spec` and its single consumer.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the bad setting; [`EchoError::OutOfMemory`] if the
    /// storage cannot be allocated.
    pub fn new(spec: DataSpec, config: BackendConfig) -> Result<(Self, BatchConsumer), EchoError> {
        match config {
            BackendConfig::Fifo { batch_size, num_batches } => {
                let store = Store::new(spec, batch_size, num_batches)?;
                let consumer = store.consumer().expect("a new store has no consumer yet");
                Ok((Self::Fifo(store), BatchConsumer::Fifo(consumer)))
            }
            BackendConfig::Replay(config) => {
                let table = Table::new(spec, config)?;
                let consumer = table.consumer().expect("a new table has no consumer yet");
                Ok((Self::Replay(table), BatchConsumer::Replay(consumer)))
            }
            BackendConfig::Sequence(config, sequence) => {
                let table = SequenceTable::new(spec, config, sequence)?;
                let consumer = table.consumer().expect("a new table has no consumer yet");
                Ok((Self::Sequence(table), BatchConsumer::Sequence(consumer)))
            }
        }
    }

    /// The sample layout.
    pub fn spec(&self) -> &DataSpec {
        match self {
            Self::Fifo(store) => store.spec(),
            Self::Replay(table) => table.spec(),
            Self::Sequence(table) => table.spec(),
        }
    }

    /// Samples (items) per batch.
    pub fn batch_size(&self) -> usize {
        match self {
            Self::Fifo(store) => store.batch_size(),
            Self::Replay(table) => table.config().batch_size,
            Self::Sequence(table) => table.config().batch_size,
        }
    }

    /// Batches the FIFO ring holds; `None` for a replay or sequence table.
    pub fn num_batches(&self) -> Option<usize> {
        match self {
            Self::Fifo(store) => Some(store.num_batches()),
            Self::Replay(_) | Self::Sequence(_) => None,
        }
    }

    /// The most samples the backend holds at once: the FIFO ring's batches times their size,
    /// a replay table's items, a sequence table's steps.
    pub fn capacity(&self) -> usize {
        match self {
            Self::Fifo(store) => store.num_batches() * store.batch_size(),
            Self::Replay(table) => table.config().max_size,
            Self::Sequence(table) => table.config().max_size,
        }
    }

    /// Items a replay table holds (steps, for a sequence table); `None` for the FIFO ring.
    pub fn max_size(&self) -> Option<usize> {
        match self {
            Self::Fifo(_) => None,
            Self::Replay(table) => Some(table.config().max_size),
            Self::Sequence(table) => Some(table.config().max_size),
        }
    }

    /// How windows are cut: `Some` for a sequence table.
    pub fn sequence(&self) -> Option<&SequenceConfig> {
        match self {
            Self::Sequence(table) => Some(table.sequence()),
            Self::Fifo(_) | Self::Replay(_) => None,
        }
    }

    /// What one stream of a sequence table costs its memory ([`SequenceTable::stream_cost`]);
    /// 0 for the other backends, which have no streams.
    pub fn stream_cost(&self) -> usize {
        match self {
            Self::Sequence(table) => table.stream_cost(),
            Self::Fifo(_) | Self::Replay(_) => 0,
        }
    }

    /// The leaves a replay table stores compressed (what it takes from the wire as it
    /// arrived); `None` for the other backends and uncompressed tables.
    pub fn stored_codecs(&self) -> Option<&crate::codec::LeafCodecs> {
        match self {
            Self::Replay(table) => table.codecs(),
            Self::Fifo(_) | Self::Sequence(_) => None,
        }
    }

    /// Whether the table stores some leaves compressed (an insert may compress them).
    pub fn compresses(&self) -> bool {
        match self {
            Self::Replay(table) => table.codecs().is_some(),
            Self::Sequence(table) => !table.codecs().is_empty(),
            Self::Fifo(_) => false,
        }
    }

    /// Whether items carry priorities (a replay or sequence table).
    pub fn has_priorities(&self) -> bool {
        !matches!(self, Self::Fifo(_))
    }

    /// The per-item values a batch carries after the sample's leaves: [`BATCH_META`] for a
    /// replay table, [`SEQUENCE_META`] for a sequence table, none for the FIFO ring.
    pub fn batch_meta(&self) -> &'static [MetaLeaf] {
        match self {
            Self::Fifo(_) => &[],
            Self::Replay(_) => &BATCH_META,
            Self::Sequence(_) => &SEQUENCE_META,
        }
    }

    /// The owner of every byte a [`BatchRef`] points into: keep it alive to keep them valid.
    pub fn memory_owner(&self) -> Arc<dyn Any + Send + Sync> {
        match self {
            Self::Fifo(store) => Arc::clone(store) as _,
            Self::Replay(table) => Arc::clone(table) as _,
            Self::Sequence(table) => Arc::clone(table) as _,
        }
    }

    /// Inserts every sample of `src`, waiting for room (FIFO) or the rate limiter (replay)
    /// until `deadline`. `priority` is the new items' priority (replay; `None`: the largest
    /// seen so far).
    ///
    /// # Errors
    /// [`EchoError::Priority`] if a priority is given to the FIFO ring or is invalid; as
    /// [`Store::insert`] and [`Table::insert`] otherwise.
    ///
    /// With policy versions and a staleness bound ([`Backend::set_policy_versions`]), the
    /// samples older than the bound are left out and counted; `src` still hears of them
    /// through [`SampleSource::inserted`], and an error's `inserted` counts them (it says
    /// where in `src` to go on).
    pub fn insert(
        &self,
        src: &dyn SampleSource,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        let versions = self.policy_versions();
        let Some((versions, fresh)) = versions.and_then(|v| Some((v, v.fresh(src)?))) else {
            return self.insert_all(src, priority, deadline);
        };
        let outcome = self.insert_all(&fresh, priority, deadline);
        fresh.finish();
        versions.note_stale_at_insert(fresh.stale_consumed() as u64);
        outcome.map_err(|err| InsertError { inserted: fresh.consumed(), ..err })
    }

    fn insert_all(
        &self,
        src: &dyn SampleSource,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        match self {
            Self::Fifo(_) if priority.is_some() => Err(fifo_has_no_priorities().into()),
            Self::Fifo(store) => store.insert(src, deadline),
            Self::Replay(table) => table.insert(src, priority, deadline),
            Self::Sequence(table) => table.insert(src, priority, deadline),
        }
    }

    /// Makes the backend keep policy versions (its spec's last leaf holds them): inserts drop
    /// samples older than the bound, a replay table's draws remove items that became so.
    /// Once; `false` if they were set already.
    pub fn set_policy_versions(&self, versions: Arc<PolicyVersions>) -> bool {
        let cell = match self {
            Self::Fifo(store) => &store.versions,
            Self::Replay(table) => table.versions_cell(),
            Self::Sequence(table) => table.versions_cell(),
        };
        cell.set(versions).is_ok()
    }

    /// The policy versions the backend keeps, if it keeps them.
    pub fn policy_versions(&self) -> Option<&Arc<PolicyVersions>> {
        match self {
            Self::Fifo(store) => store.versions.get(),
            Self::Replay(table) => table.versions_cell().get(),
            Self::Sequence(table) => table.versions_cell().get(),
        }
    }

    /// [`Store::try_insert_in_place`] for the FIFO ring; `false` (nothing called) for a
    /// replay table, whose inserts take its lock. (With a staleness bound, a stale sample
    /// read in place is skipped when the consumer meets it: [`FreshRing`].)
    pub fn try_insert_in_place(&self, fill: impl FnOnce(&mut [&mut [u8]])) -> bool {
        match self {
            Self::Fifo(store) => store.try_insert_in_place(fill),
            Self::Replay(_) | Self::Sequence(_) => false,
        }
    }

    /// Rung whenever an insert that found no room (FIFO) or was held by the rate limiter
    /// (replay) might now go further: room freed, a checkpoint thawed, a restore finished,
    /// the backend closed. An async writer reads [`AsyncBell::rung`] first, tries an insert that
    /// does not wait, and if it was refused awaits [`AsyncBell::rung_since`] and tries again,
    /// rather than blocking a thread in [`Backend::insert`].
    #[cfg_attr(any(loom, not(target_os = "linux")), allow(dead_code))] // only the shared-memory path (Linux) awaits it
    pub(crate) fn insert_bell(&self) -> &AsyncBell {
        match self {
            Self::Fifo(store) => store.space_bell(),
            Self::Replay(table) => table.insert_bell(),
            Self::Sequence(table) => table.insert_bell(),
        }
    }

    /// Closes the backend: waiting inserts fail and the consumer's `sample` returns
    /// [`EchoError::Closed`]. Idempotent.
    pub fn close(&self) {
        match self {
            Self::Fifo(store) => store.close(),
            Self::Replay(table) => table.close(),
            Self::Sequence(table) => table.close(),
        }
    }

    /// Whether [`Backend::close`] was called.
    pub fn is_closed(&self) -> bool {
        match self {
            Self::Fifo(store) => store.is_closed(),
            Self::Replay(table) => table.is_closed(),
            Self::Sequence(table) => table.is_closed(),
        }
    }

    /// Address of the first byte of `leaf` of `batch`: `batch_size` contiguous values. Reading
    /// through it is sound while the bytes are stable (see the module docs) and
    /// [`Backend::memory_owner`] is alive.
    pub fn batch_ptr(&self, batch: &BatchRef, leaf: usize) -> *const u8 {
        match (self, batch.at) {
            (Self::Fifo(store), BatchAt::Ring(index)) => store.batch_ptr(index, leaf),
            (Self::Fifo(store), BatchAt::Spill(half)) => store.spill_ptr(half, leaf),
            (Self::Replay(table), BatchAt::Area(area)) => table.batch_ptr(area.half, leaf),
            (Self::Sequence(table), BatchAt::Area(area)) => table.batch_ptr(area.half, leaf),
            _ => unreachable!("a BatchRef comes from this backend's own consumer"),
        }
    }

    /// Ends `stream`'s open episode (a sequence table; nothing for the others): as truncated
    /// when its worker is gone for good. Returns whether it had one.
    pub fn end_stream(&self, stream: u64, end: EpisodeEnd) -> bool {
        match self {
            Self::Sequence(table) => table.end_stream(stream, end),
            Self::Fifo(_) | Self::Replay(_) => false,
        }
    }

    /// [`Backend::end_stream`] for every stream whose id lies in `ids` (a connection's rows),
    /// walking only the streams that exist. Returns how many had an open episode.
    pub fn end_streams_in(&self, ids: std::ops::RangeInclusive<u64>, end: EpisodeEnd) -> usize {
        match self {
            Self::Sequence(table) => table.end_streams_in(ids, end),
            Self::Fifo(_) | Self::Replay(_) => 0,
        }
    }

    /// Sets the priorities of the items with these keys; returns how many keys were unknown.
    ///
    /// # Errors
    /// [`EchoError::Priority`] for the FIFO ring (it has none), or as
    /// [`Table::update_priorities`].
    pub fn update_priorities(&self, keys: &[u64], priorities: &[f64]) -> Result<u64, EchoError> {
        match self {
            Self::Fifo(_) => Err(EchoError::Priority(
                "the FIFO ring has no priorities to update: that needs a replay table".into(),
            )),
            Self::Replay(table) => table.update_priorities(keys, priorities),
            Self::Sequence(table) => table.update_priorities(keys, priorities),
        }
    }

    /// Starts a checkpoint ([`Store::checkpoint_with`], [`Table::checkpoint_with`]): a
    /// snapshot of the backend and, taken at the same moment by `capture`, the acknowledged
    /// samples still held outside it (the ingress's, or none), so that the two together hold
    /// every acknowledged sample the learner was not handed, each once. `capture` runs at the
    /// snapshot moment, when nothing can move a sample into the backend (the ring frozen, a
    /// table under its lock): it must not insert, and should only copy.
    ///
    /// # Errors
    /// [`EchoError::Busy`] while another checkpoint of the backend runs.
    pub fn checkpoint(
        &self,
        capture: impl FnOnce() -> QueuedSamples,
    ) -> Result<BackendCheckpoint, EchoError> {
        match self {
            Self::Fifo(store) => {
                let (ring, queued) = store.checkpoint_with(capture)?;
                Ok(BackendCheckpoint::Fifo(FifoSnapshot::new(ring, queued)))
            }
            Self::Replay(table) => {
                let (checkpoint, queued) = table.checkpoint_with(capture)?;
                Ok(BackendCheckpoint::Replay(checkpoint, queued))
            }
            Self::Sequence(table) => {
                let (mut checkpoint, queued) = table.checkpoint_with(capture)?;
                checkpoint.snapshot_mut().set_queued(&queued);
                Ok(BackendCheckpoint::Sequence(Box::new(checkpoint), queued))
            }
        }
    }

    /// Fills this new backend with a checkpoint's contents, which must be of its kind: a
    /// replay table's items and state, then its ingress samples before anything new
    /// ([`Table::restore_rows`], [`Table::restore_queued`]); a sequence table's snapshot
    /// ([`SequenceTable::restore`]); the FIFO ring's samples, in order, before anything new
    /// ([`Store::restore`]). Returns how many samples went in at once (the rest of a FIFO
    /// ring's follow as the consumer frees room; the others go in whole: 0).
    ///
    /// # Errors
    /// [`EchoError::Config`] for a checkpoint of another kind, or as the backend's restore.
    pub fn restore(&self, data: Restore<'_>) -> Result<usize, EchoError> {
        match (self, data) {
            (Self::Fifo(store), Restore::Fifo { leaves, n }) => store.restore(leaves, n),
            (Self::Replay(table), Restore::Replay { items, state, leaves, queued }) => {
                table.restore_rows(items, state, leaves)?;
                table.restore_queued(queued).map(|()| 0)
            }
            (Self::Sequence(table), Restore::Sequence { snapshot, leaves, queued_leaves }) => {
                table.restore(snapshot, leaves, queued_leaves).map(|()| 0)
            }
            (_, data) => Err(EchoError::Config(format!(
                "restore: {} checkpoint needs a server of its kind, this one is {}",
                data.kind(),
                self.kind()
            ))),
        }
    }

    /// `a FIFO ring`, `a replay table` or `a sequence table`, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Fifo(_) => "a FIFO ring",
            Self::Replay(_) => "a replay table",
            Self::Sequence(_) => "a sequence table",
        }
    }

    /// Whether a restore's samples are still going in (other inserts wait for them).
    pub fn is_restoring(&self) -> bool {
        match self {
            Self::Fifo(store) => store.is_restoring(),
            Self::Replay(table) => table.is_restoring(),
            Self::Sequence(_) => false,
        }
    }

    /// Checks a priority an insert would be given.
    ///
    /// # Errors
    /// [`EchoError::Priority`]: the FIFO ring has none, or it is invalid for the table.
    pub fn check_priority(&self, priority: f64) -> Result<(), EchoError> {
        match self {
            Self::Fifo(_) => Err(fifo_has_no_priorities()),
            Self::Replay(table) => table.check_one_priority(priority),
            Self::Sequence(table) => table.check_one_priority(priority),
        }
    }

    /// The priority of the item with `key`; `None` if it is not in the table (or FIFO).
    pub fn priority(&self, key: u64) -> Option<f64> {
        match self {
            Self::Fifo(_) => None,
            Self::Replay(table) => table.priority(key),
            Self::Sequence(table) => table.priority(key),
        }
    }

    /// A snapshot of the backend's counters.
    pub fn stats(&self) -> BackendStats {
        match self {
            Self::Fifo(store) => BackendStats::Fifo(store.stats()),
            Self::Replay(table) => BackendStats::Replay(table.stats()),
            Self::Sequence(table) => BackendStats::Sequence(table.stats()),
        }
    }

    /// An insert that does not wait (the shared-memory path's, `deadline` now) was refused
    /// and its caller waited `waited` outside the backend (on its insert bell)
    /// before trying again: counted where an insert's own wait inside the backend is, so the
    /// counter means the same whoever inserts. A replay or sequence table adds it to
    /// `insert_blocked_ns`; the FIFO ring to its writers' wait for free slots.
    pub fn note_insert_blocked(&self, waited: std::time::Duration) {
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        match self {
            Self::Fifo(store) => store.note_insert_blocked(waited),
            Self::Replay(table) => table.note_insert_blocked(ns),
            Self::Sequence(table) => table.note_insert_blocked(ns),
        }
    }

    /// What holds inserts back now (a replay or sequence table's rate limiter and its
    /// counters), for the message of an insert that timed out; `None` for the FIFO ring.
    pub fn insert_holdback(&self) -> Option<InsertHoldback> {
        match self {
            Self::Fifo(_) => None,
            Self::Replay(table) => Some(table.insert_holdback()),
            Self::Sequence(table) => Some(table.insert_holdback()),
        }
    }

    /// `(writers, consumers)` parked right now: inserts waiting for room (FIFO) or for the rate
    /// limiter (replay), and a `sample` waiting for a batch. For tests that must know a call
    /// is blocked before they unblock it.
    pub fn waiting(&self) -> (u64, u64) {
        match self {
            Self::Fifo(store) => (store.waiting_inserts(), store.waiting_samples()),
            Self::Replay(table) => (table.waiting_inserts(), table.waiting_samples()),
            Self::Sequence(table) => (table.waiting_inserts(), table.waiting_samples()),
        }
    }

    /// The detailed counters and histograms (all zero without `detailed-metrics`; a replay
    /// table records none).
    pub fn detailed(&self) -> DetailedSnapshot {
        match self {
            Self::Fifo(store) => store.detailed(),
            Self::Replay(_) | Self::Sequence(_) => DetailedSnapshot::default(),
        }
    }

    /// Clears the timing histograms; counters keep counting.
    pub fn reset_histograms(&self) {
        match self {
            Self::Fifo(store) => store.reset_histograms(),
            Self::Replay(_) | Self::Sequence(_) => {}
        }
    }

    /// Page-locks the memory batches are read from (the FIFO ring, or a replay table's batch
    /// area) with `cudaHostRegister`. Idempotent; unregistered when the backend is dropped.
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
        match self {
            // SAFETY: the caller vouches for the libraries.
            Self::Fifo(store) => unsafe { store.pin_host_memory(cuda_runtimes) },
            // SAFETY: as above.
            Self::Replay(table) => unsafe { table.pin_host_memory(cuda_runtimes) },
            // SAFETY: as above.
            Self::Sequence(table) => unsafe { table.pin_host_memory(cuda_runtimes) },
        }
    }

    /// Whether the batch memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        match self {
            Self::Fifo(store) => store.is_pinned(),
            Self::Replay(table) => table.is_pinned(),
            Self::Sequence(table) => table.is_pinned(),
        }
    }
}

impl BatchConsumer {
    /// This consumer for a backend whose samples `versions` judge: the FIFO ring's skips
    /// those that became stale while they waited ([`FreshRing`]) when there is a bound;
    /// the tables judge their draws themselves.
    ///
    /// # Errors
    /// [`EchoError::OutOfMemory`] if the ring's spill cannot be allocated.
    pub fn judged_by(self, versions: &Arc<PolicyVersions>) -> Result<Self, EchoError> {
        match self {
            Self::Fifo(consumer)
                if versions.max_staleness().is_some()
                    && versions.admission() == Admission::Drop =>
            {
                Ok(Self::FifoFresh(FreshRing::new(consumer, Arc::clone(versions))?))
            }
            other => Ok(other),
        }
    }

    /// Gives back what the previous call handed out (FIFO) and waits until `deadline` for the
    /// next batch.
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the backend is closed, [`EchoError::TimedOut`] when the
    /// deadline passes first (nothing is lost: the next call goes on where this one stopped).
    pub fn sample(&mut self, deadline: Option<Instant>) -> Result<BatchRef, EchoError> {
        match self {
            Self::Fifo(consumer) => {
                let index = consumer.sample(deadline)?;
                Ok(BatchRef { sequence: index, at: BatchAt::Ring(index) })
            }
            Self::FifoFresh(ring) => {
                let at = match ring.sample(deadline)? {
                    FreshBatch::Ring(index) => BatchAt::Ring(index),
                    FreshBatch::Spill(half) => BatchAt::Spill(half),
                };
                Ok(BatchRef { sequence: ring.handed() - 1, at })
            }
            Self::Replay(consumer) => {
                let batch = consumer.sample(deadline)?;
                Ok(BatchRef { sequence: batch.sequence, at: BatchAt::Area(batch) })
            }
            Self::Sequence(consumer) => {
                let batch = consumer.sample(deadline)?;
                Ok(BatchRef { sequence: batch.sequence, at: BatchAt::Area(batch) })
            }
        }
    }

    /// What held the last `sample` back when its deadline passed (a replay table's rate
    /// limiter or an empty table); `None` for the FIFO ring, which has no limiter.
    pub fn holdback(&self) -> Option<SampleHoldback> {
        match self {
            Self::Fifo(_) | Self::FifoFresh(_) => None,
            Self::Replay(consumer) => consumer.holdback(),
            Self::Sequence(consumer) => consumer.holdback(),
        }
    }

    /// Calls `f` with the bytes of `leaf` of `batch` (the last batch `sample` returned):
    /// `batch_size` values back to back.
    ///
    /// # Panics
    /// If `batch` is not this consumer's current batch or `leaf` is out of range.
    pub fn read_leaf<T>(&self, batch: &BatchRef, leaf: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        match (self, batch.at) {
            (Self::Fifo(consumer), BatchAt::Ring(index)) => {
                assert_eq!(consumer.held(), Some(index), "read_leaf needs the held batch");
                consumer.read_leaf(leaf, f)
            }
            (Self::FifoFresh(ring), BatchAt::Ring(index)) => {
                assert_eq!(ring.consumer().held(), Some(index), "read_leaf needs the held batch");
                ring.consumer().read_leaf(leaf, f)
            }
            (Self::FifoFresh(ring), BatchAt::Spill(half)) => ring.read_spill(half, leaf, f),
            (Self::Replay(consumer), BatchAt::Area(area)) => consumer.read_leaf(area, leaf, f),
            (Self::Sequence(consumer), BatchAt::Area(area)) => consumer.read_leaf(area, leaf, f),
            _ => unreachable!("a BatchRef comes from this consumer"),
        }
    }
}

fn fifo_has_no_priorities() -> EchoError {
    EchoError::Priority("the FIFO ring has no priorities: a priority needs a replay table".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Leaves;
    use crate::spec::ArraySpec;

    fn spec() -> DataSpec {
        DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap()
    }

    fn put(backend: &Backend, id: u64) {
        backend.insert(&Leaves(&[&id.to_ne_bytes()]), None, None).unwrap();
    }

    fn ids(consumer: &BatchConsumer, batch: &BatchRef, n: usize) -> Vec<u64> {
        consumer.read_leaf(batch, 0, |bytes| {
            assert_eq!(bytes.len(), 8 * n);
            bytes.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().unwrap())).collect()
        })
    }

    #[test]
    fn both_backends_hand_out_batches_through_one_face() {
        let fifo = BackendConfig::Fifo { batch_size: 2, num_batches: 2 };
        let mut replay = ReplayConfig::new(2, 4);
        replay.max_times_sampled = 1;
        replay.sampler = crate::replay::SamplerKind::Lifo;
        for (config, meta) in [(fifo, 0), (BackendConfig::Replay(replay), BATCH_META.len())] {
            let (backend, mut consumer) = Backend::new(spec(), config).unwrap();
            assert_eq!(backend.batch_meta().len(), meta);
            put(&backend, 7);
            put(&backend, 9);
            let batch = consumer.sample(None).unwrap();
            assert_eq!(batch.sequence, 0);
            let mut got = ids(&consumer, &batch, 2);
            got.sort_unstable();
            assert_eq!(got, [7, 9]);
            // SAFETY: test-only read of the batch just handed out, whose memory is alive.
            let first = unsafe { backend.batch_ptr(&batch, 0).cast::<u64>().read_unaligned() };
            assert!(first == 7 || first == 9);
            backend.close();
            assert!(matches!(consumer.sample(None), Err(EchoError::Closed)));
        }
    }

    #[test]
    fn the_fifo_ring_refuses_priorities() {
        let config = BackendConfig::Fifo { batch_size: 1, num_batches: 2 };
        let (backend, _consumer) = Backend::new(spec(), config).unwrap();
        let err = backend.insert(&Leaves(&[&[0; 8]]), Some(1.0), None).unwrap_err();
        assert!(matches!(err.error, EchoError::Priority(_)), "{err}");
        assert!(backend.update_priorities(&[0], &[1.0]).is_err());
        assert_eq!(backend.priority(0), None);
        assert!(matches!(backend.stats(), BackendStats::Fifo(s) if s.write_cursor == 0));
    }
}
