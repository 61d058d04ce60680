//! The FIFO ring's consumer when samples carry policy versions under a staleness bound: a
//! sample that became stale while it waited in the ring is skipped at sample time, never
//! handed to the learner, and counted once (`stale_at_sample`).
//!
//! A batch whose every row is fresh goes out as it lies in the ring, zero-copy, as without a
//! bound. A batch that holds stale rows is judged row by row: its fresh rows, in order, are
//! copied into a *spill* batch (two halves of `batch_size` rows, made with the ring), which
//! goes out once full; the next batch's rows fill the rest. Only one ring batch is held at a
//! time, so the consumer never holds the ring's room hostage while it gathers.
//!
//! Checkpoints stay exact. The rows of the held batch not judged yet are not handed out (the
//! store's `behind`, updated with the taken count under its `limits` lock), and the rows
//! gathered into the spill but not handed out yet are copied by a checkpoint before the
//! ring's (visible under the same lock): a checkpoint holds every fresh sample the learner
//! was not handed, once, in order.

use std::time::Instant;

use crate::error::EchoError;
use crate::store::Consumer;
use crate::sync::Arc;
use crate::versions::{PolicyVersions, VERSION_BYTES};

/// What [`FreshRing::sample`] hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreshBatch {
    /// A whole ring batch (absolute index), every row fresh: held until the next call.
    Ring(u64),
    /// A spill half (0 or 1), gathered from the fresh rows of ring batches that held stale
    /// ones: stable until the second call after it.
    Spill(usize),
}

/// The FIFO consumer that skips stale rows.
#[derive(Debug)]
pub struct FreshRing {
    consumer: Consumer,
    versions: Arc<PolicyVersions>,
    batch_size: usize,
    /// Absolute slot of the next row to judge.
    pos: u64,
    /// The spill half being filled, and its rows.
    half: usize,
    fill: usize,
    /// Batches handed out so far (each call's `sequence`).
    handed: u64,
    /// The floor the gathered rows were judged by: when it moved, they are judged again.
    judged: u64,
}

impl FreshRing {
    /// `consumer`'s batches with stale rows skipped, as `versions` judge them (the store
    /// must hold the version leaf, raw).
    ///
    /// # Errors
    /// [`EchoError::OutOfMemory`] if the spill cannot be allocated.
    pub fn new(consumer: Consumer, versions: Arc<PolicyVersions>) -> Result<Self, EchoError> {
        consumer.store().spill()?;
        let batch_size = consumer.store().batch_size();
        Ok(Self { consumer, versions, batch_size, pos: 0, half: 0, fill: 0, handed: 0, judged: 0 })
    }

    /// The ring consumer underneath.
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// Batches handed out so far.
    pub fn handed(&self) -> u64 {
        self.handed
    }

    /// The next batch of fresh rows, waiting for ring batches until `deadline`. Rows gathered
    /// before a timeout stay gathered (nothing is lost, nothing goes out twice).
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the store is closed, [`EchoError::TimedOut`] at `deadline`.
    pub fn sample(&mut self, deadline: Option<Instant>) -> Result<FreshBatch, EchoError> {
        let b = self.batch_size as u64;
        let floor = self.versions.floor();
        if self.fill > 0 && floor > self.judged {
            // Rows gathered before a timeout may have become stale since.
            let gathered = self.fill;
            self.fill =
                self.consumer.compact_spill(self.half, gathered, self.versions.leaf(), |v| {
                    u64::from_le_bytes(v.try_into().expect("8 bytes")) >= floor
                });
            let stale = gathered - self.fill;
            if stale > 0 {
                self.versions.note_stale_at_sample(stale as u64);
            }
        }
        self.judged = floor;
        loop {
            let held_end = self.consumer.held().map(|batch| (batch + 1) * b);
            if held_end.is_none_or(|end| self.pos >= end) {
                // Every row of the held batch was judged (handed out, dropped, or gathered
                // and visible to checkpoints in the spill): give it back, take the next.
                let batch = self.consumer.take_unhanded(deadline)?;
                self.pos = batch * b;
            }
            let batch = self.consumer.held().expect("a batch is held");
            let first = (self.pos - batch * b) as usize;
            let fresh = self.fresh_rows(first, floor);
            if self.fill == 0 && first == 0 && fresh.iter().all(|&f| f) {
                self.pos += b;
                self.consumer.set_unhanded(0, self.half, 0);
                self.handed += 1;
                return Ok(FreshBatch::Ring(batch));
            }
            let mut stale = 0u64;
            let mut row = first;
            while row < self.batch_size && self.fill < self.batch_size {
                if !fresh[row - first] {
                    stale += 1;
                    row += 1;
                    continue;
                }
                // A run of fresh rows, as long as the spill has room: copied at once.
                let mut end = row + 1;
                while end < self.batch_size
                    && fresh[end - first]
                    && self.fill + (end - row) < self.batch_size
                {
                    end += 1;
                }
                self.gather(row..end);
                row = end;
            }
            self.pos = batch * b + row as u64;
            if stale > 0 {
                self.versions.note_stale_at_sample(stale);
            }
            let behind = (batch + 1) * b - self.pos;
            if self.fill == self.batch_size {
                let full = self.half;
                self.half ^= 1;
                self.fill = 0;
                self.consumer.set_unhanded(behind, self.half, 0);
                self.handed += 1;
                return Ok(FreshBatch::Spill(full));
            }
            self.consumer.set_unhanded(behind, self.half, self.fill);
        }
    }

    /// Per row of the held batch from `first` on: whether it is fresh (its version at least
    /// `floor`).
    fn fresh_rows(&self, first: usize, floor: u64) -> Vec<bool> {
        let leaf = self.versions.leaf();
        self.consumer.read_rows(leaf, first..self.batch_size, |bytes| {
            bytes
                .chunks_exact(VERSION_BYTES)
                .map(|v| u64::from_le_bytes(v.try_into().expect("8 bytes")) >= floor)
                .collect()
        })
    }

    /// Copies rows `rows` of the held batch into the spill half being filled.
    fn gather(&mut self, rows: std::ops::Range<usize>) {
        let store = self.consumer.store();
        let spill = store.spill().expect("made by new");
        let at = self.half * self.batch_size + self.fill;
        for leaf in 0..store.spec().len() {
            self.consumer.read_rows(leaf, rows.clone(), |bytes| {
                let size = store.leaf_bytes(leaf);
                for (i, row) in bytes.chunks_exact(size.max(1)).enumerate().take(rows.len()) {
                    // SAFETY: only this consumer writes the spill, rows it has not made
                    // visible to checkpoints (past `fill`) of the half it fills; the other
                    // half is the batch it handed out last, which stays put. Python views of
                    // this half from two calls ago may still be read: the documented lifetime
                    // of a batch (until the next `sample`) makes that the user's stale read
                    // of memory that stays allocated.
                    unsafe { spill.write_slot(at + i, leaf, &row[..size]) };
                }
            });
        }
        self.fill += rows.len();
    }

    /// Calls `f` with the bytes of `leaf` of the spill half `half` (`batch_size` rows).
    pub fn read_spill<T>(&self, half: usize, leaf: usize, f: impl FnOnce(&[u8]) -> T) -> T {
        let spill = self.consumer.store().spill().expect("made by new");
        let first = half * self.batch_size;
        // SAFETY: only this consumer writes the spill, in `sample` (`&mut self`), which
        // cannot run while `&self` is borrowed here.
        unsafe { spill.read_slots(leaf, first..first + self.batch_size, f) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Leaves;
    use crate::spec::{ArraySpec, DataSpec};
    use crate::store::Store;
    use crate::versions::{version_leaf, Admission};

    /// A ring of `batches` batches of 4 samples of (id: u32, version), and its fresh consumer
    /// bounded by `k`.
    fn ring(batches: usize, k: u64) -> (Arc<Store>, FreshRing, Arc<PolicyVersions>) {
        let spec = DataSpec::new(vec![ArraySpec::new(vec![], 4).unwrap(), version_leaf()]);
        let store = Store::new(spec.unwrap(), 4, batches).unwrap();
        let versions = Arc::new(PolicyVersions::new(1, Some(k), Admission::Drop));
        let consumer = store.consumer().unwrap();
        let fresh = FreshRing::new(consumer, Arc::clone(&versions)).unwrap();
        (store, fresh, versions)
    }

    fn put(store: &Store, id: u32, version: u64) {
        let (id, version) = (id.to_le_bytes(), version.to_le_bytes());
        store.insert(&Leaves(&[&id, &version]), None).unwrap();
    }

    fn ids(fresh: &FreshRing, store: &Store, batch: FreshBatch) -> Vec<u32> {
        let read = |bytes: &[u8]| -> Vec<u32> {
            bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect()
        };
        match batch {
            FreshBatch::Ring(index) => {
                assert_eq!(fresh.consumer().held(), Some(index));
                fresh.consumer().read_leaf(0, read)
            }
            FreshBatch::Spill(half) => {
                let _ = store;
                fresh.read_spill(half, 0, read)
            }
        }
    }

    #[test]
    fn fresh_batches_go_out_whole_and_stale_rows_are_skipped_in_order() {
        let (store, mut fresh, versions) = ring(4, 1);
        versions.set_latest(5);
        for id in 0..4 {
            put(&store, id, 5);
        }
        let first = fresh.sample(None).unwrap();
        assert!(matches!(first, FreshBatch::Ring(0)), "{first:?}");
        assert_eq!(ids(&fresh, &store, first), [0, 1, 2, 3]);
        // 4..12 with versions: 3 is stale (floor 4), 4 and 5 are not.
        for (id, v) in (4..12).zip([5, 3, 4, 3, 3, 5, 4, 5]) {
            put(&store, id, v);
        }
        let second = fresh.sample(None).unwrap();
        assert!(matches!(second, FreshBatch::Spill(_)), "{second:?}");
        assert_eq!(ids(&fresh, &store, second), [4, 6, 9, 10]);
        assert_eq!(versions.counts().at_sample, 3);
        // 11 is gathered, and a checkpoint now holds it before the ring's unjudged rows.
        for (id, v) in (12..16).zip([5, 5, 5, 5]) {
            put(&store, id, v);
        }
        let third = fresh.sample(None).unwrap();
        assert_eq!(ids(&fresh, &store, third), [11, 12, 13, 14]);
        let mut ckpt = store.checkpoint().unwrap();
        assert_eq!(ckpt.len(), 1, "15 is not handed out");
        let mut out = vec![Vec::new(), Vec::new()];
        assert_eq!(ckpt.next_chunk(1 << 20, &mut out), 1);
        assert_eq!(out[0], 15u32.to_le_bytes());
        drop(ckpt);
        assert_eq!(fresh.handed(), 3);
        assert_eq!(versions.counts().at_sample, 3);
    }

    #[test]
    fn a_checkpoint_holds_the_gathered_rows_then_the_unjudged_ones_once() {
        let (store, mut fresh, versions) = ring(3, 0);
        versions.set_latest(2);
        for (id, v) in (0..4).zip([2, 1, 2, 1]) {
            put(&store, id, v);
        }
        // Two fresh rows gathered; the ring has nothing more: the call times out.
        let now = Some(Instant::now());
        assert!(matches!(fresh.sample(now), Err(EchoError::TimedOut)));
        for (id, v) in (4..8).zip([2, 2, 1, 2]) {
            put(&store, id, v);
        }
        let mut ckpt = store.checkpoint().unwrap();
        let mut out = vec![Vec::new(), Vec::new()];
        let mut got = Vec::new();
        while ckpt.next_chunk(1 << 20, &mut out) > 0 {
            got.extend(out[0].chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())));
        }
        drop(ckpt);
        assert_eq!(got, [0, 2, 4, 5, 6, 7], "gathered rows first, then the ring's, each once");
        let batch = fresh.sample(None).unwrap();
        assert_eq!(ids(&fresh, &store, batch), [0, 2, 4, 5]);
        assert_eq!(versions.counts().at_sample, 2);
    }

    #[test]
    fn a_ring_of_two_batches_never_deadlocks_while_gathering() {
        let (store, mut fresh, versions) = ring(2, 0);
        versions.set_latest(1);
        let writer = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                for id in 0..400u32 {
                    put(&store, id, u64::from(id % 3 != 0));
                }
            })
        };
        let mut got = Vec::new();
        while got.len() < 264 {
            let batch = fresh.sample(Some(Instant::now() + std::time::Duration::from_secs(10)));
            got.extend(ids(&fresh, &store, batch.unwrap()));
        }
        writer.join().unwrap();
        let want: Vec<u32> = (0..400).filter(|id| id % 3 != 0).take(264).collect();
        assert_eq!(got, want);
    }
}
