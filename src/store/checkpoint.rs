//! A store's checkpoints ([`RingCheckpoint`]): the snapshot of the samples not handed out
//! yet (the protocol in the module docs of [`crate::store`]), its copy chunk by chunk, and
//! the restore that puts a checkpoint's samples back before anything new.

use super::{Limits, Store, FROZEN};
use crate::error::{EchoError, InsertError};
use crate::slots::Slots;
use crate::source::SampleSource;
use crate::spec::DataSpec;
use crate::sync::{yield_now, Arc};

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

impl Store {
    /// Starts a checkpoint: a point-in-time snapshot of every committed sample the consumer
    /// has not been handed yet, in order, partial batch included (see the module docs). The
    /// samples are then copied out with [`RingCheckpoint::next_chunk`] while writers and the
    /// consumer go on; the slots not copied yet stay pinned until then.
    ///
    /// # Errors
    /// [`EchoError::Busy`] while another checkpoint of this store is running.
    pub fn checkpoint(self: &Arc<Self>) -> Result<RingCheckpoint, EchoError> {
        self.checkpoint_with(|| ()).map(|(checkpoint, ())| checkpoint)
    }

    /// [`Store::checkpoint`], calling `frozen` at the snapshot's moment: after every
    /// reservation made before it committed and before any new one. Nothing enters the ring
    /// while `frozen` runs, so it can read what writers hold outside the ring (the ingress)
    /// consistently with the snapshot. `frozen` must not insert into this store (it would
    /// wait for itself).
    ///
    /// # Errors
    /// [`EchoError::Busy`] while another checkpoint of this store is running.
    pub fn checkpoint_with<R>(
        self: &Arc<Self>,
        frozen: impl FnOnce() -> R,
    ) -> Result<(RingCheckpoint, R), EchoError> {
        // ORDERING: Acquire pairs with the Release store in `RingCheckpoint::drop`: the last
        // checkpoint's unpinning is done before we pin again.
        if self.checkpointing.swap(true, Acquire) {
            return Err(EchoError::Busy(
                "a checkpoint of this ring is already being written".into(),
            ));
        }
        // Step 1. ORDERING: AcqRel — a read-modify-write, so it sees the latest cursor (every
        // reservation made so far lies below `end`) and every later CAS fails on the bit;
        // Acquire/Release order it with the steps around it in this thread.
        let end = self.write_cursor.fetch_or(FROZEN, AcqRel) & !FROZEN;
        let batch_size = self.batch_size as u64;
        // Step 2.
        let (start, head) = {
            let mut limits = self.limits.lock();
            // ORDERING: Acquire pairs with the consumer's Release store in `sample`. Read under
            // `limits`, so the consumer cannot release past it before the pin is in place: it
            // has released at most the batches it took, and what it took but did not hand
            // out (`behind`, updated with `taken` under this lock) it did not release, so
            // `read_cursor <= start`.
            let start = self.taken.load(Acquire) * batch_size - limits.behind;
            limits.pin = Some(start);
            (start, self.spill_head(&limits))
        };
        let (head_rows, head) = head;
        // Step 3: every slot in [start, end) committed. Only writers with a reservation below
        // `end` can be behind, and they go straight from reserve to copy to commit.
        for batch in start / batch_size..end.div_ceil(batch_size) {
            let expected = (end - batch * batch_size).min(batch_size) as usize;
            let counter = &self.commits[self.batch_index(batch)];
            loop {
                // ORDERING: Acquire pairs with the writers' Release `fetch_add` in `commit`
                // (the slot bytes), and with the consumer's Release store of `taken`: a batch
                // it took was complete, and its bytes are visible through it. Checked first, as
                // a taken batch's counter is reset to 0 when it is given back.
                if self.taken.load(Acquire) > batch || counter.load(Acquire) == expected {
                    break;
                }
                yield_now();
            }
        }
        let out = frozen();
        // Step 4. ORDERING: Release — the pin stored above (under `limits`, whose lock the
        // writers do not take) is already what bounds them: they see a `read_cursor` <= it.
        // The Release orders our reads of the frozen state before writers continue.
        self.write_cursor.fetch_and(!FROZEN, Release);
        self.space_free.notify_all();
        let checkpoint =
            RingCheckpoint { store: Arc::clone(self), start, end, next: start, head, head_rows };
        Ok((checkpoint, out))
    }

    /// The rows a [`FreshRing`](crate::fresh_ring::FreshRing) gathered and has not handed out
    /// (copies of slots it released), per leaf: they come before the ring's in a checkpoint.
    /// Read under `limits`, which the consumer holds to change them.
    fn spill_head(&self, limits: &Limits) -> (usize, Vec<Vec<u8>>) {
        #[cfg(not(loom))]
        if let Some(spill) = self.spill.get().filter(|_| limits.spill_rows > 0) {
            let first = limits.spill_half * self.batch_size;
            let rows = first..first + limits.spill_rows;
            let head = (0..self.spec.len())
                .map(|leaf| {
                    // SAFETY: the consumer wrote these rows before it made them visible under
                    // `limits` (held here), and writes no visible row of a half until it hands
                    // the half out, under `limits` too.
                    unsafe { spill.read_slots(leaf, rows.clone(), <[u8]>::to_vec) }
                })
                .collect();
            return (limits.spill_rows, head);
        }
        let _ = limits;
        (0, Vec::new())
    }

    /// The spill area of a [`FreshRing`](crate::fresh_ring::FreshRing): two batches.
    ///
    /// # Errors
    /// [`EchoError::OutOfMemory`] if it cannot be allocated.
    #[cfg(not(loom))]
    pub(crate) fn spill(&self) -> Result<&Slots, EchoError> {
        if let Some(spill) = self.spill.get() {
            return Ok(spill);
        }
        let spill = Slots::new(&self.spec, 2 * self.batch_size)?;
        Ok(self.spill.get_or_init(|| spill))
    }

    /// Where leaf `leaf` of spill half `half` starts (its batch, `batch_size` rows).
    #[cfg(not(loom))]
    pub fn spill_ptr(&self, half: usize, leaf: usize) -> *const u8 {
        let spill = self.spill.get().expect("a spill batch comes from a FreshRing, which made it");
        spill.slot_ptr(leaf, half * self.batch_size)
    }

    /// Moves a running checkpoint's pin up to `pin` (the first slot it has not copied).
    fn move_pin(&self, pin: Option<u64>) {
        {
            let mut limits = self.limits.lock();
            limits.pin = pin;
            // ORDERING: Release pairs with the writers' Acquire in `has_space`: the checkpoint's
            // reads of the slots below the pin happen before any writer reuses them.
            self.read_cursor.store(limits.read_cursor(self.batch_size as u64), Release);
        }
        self.space_free.notify_all();
    }

    /// Puts `rows` into this new, empty store, in order, before any other insert: every other
    /// `insert` waits until they are all in (or the store closes). Returns how many went in at
    /// once (as many as the ring had room for); if some did not fit, a thread named
    /// `echo-restore` inserts them, in order, as the consumer frees room, and only then lets
    /// other inserts in.
    ///
    /// # Errors
    /// [`EchoError::Config`] if the store is not new (something was inserted before); the
    /// errors of [`Rows::new`](crate::source::Rows::new) (as input errors) if `leaves` do not
    /// hold `n` rows of the spec.
    #[cfg(not(loom))]
    pub fn restore(self: &Arc<Self>, leaves: &[&[u8]], n: usize) -> Result<usize, EchoError> {
        let rows = crate::source::Rows::new(&self.spec, leaves, n, None)?;
        // ORDERING: Relaxed — only a new store (not yet shared) can be restored; this checks
        // that and publishes nothing.
        if self.write_cursor.load(Relaxed) != 0 || self.restoring.swap(true, Relaxed) {
            return Err(EchoError::Config(
                "restore: only a new, empty FIFO ring can be restored into".into(),
            ));
        }
        let now = n.min(self.capacity as usize);
        let head = rows.take(now);
        if let Err(err) = self.insert_unchecked(&head, None) {
            self.end_restore();
            return Err(err.error);
        }
        if now == n {
            self.end_restore();
            return Ok(now);
        }
        // The rest needs room the consumer has yet to free: owned copies for a thread.
        let rest = rows.skip(now);
        let owned: Vec<Vec<u8>> = (0..self.spec.len())
            .map(|leaf| {
                let size = self.spec.arrays()[leaf].num_bytes();
                leaves[leaf][now * size..].to_vec()
            })
            .collect();
        let count = rest.num_samples();
        let store = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("echo-restore".into()).spawn(move || {
            let slices: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
            let result = crate::source::Rows::new(&store.spec, &slices, count, None)
                .map_err(InsertError::from)
                .and_then(|rows| store.insert_unchecked(&rows, None));
            match result {
                Ok(()) | Err(InsertError { error: EchoError::Closed, .. }) => {}
                Err(err) => log::error!("echo restore: {err}"),
            }
            store.end_restore();
        });
        if let Err(err) = spawned {
            self.end_restore();
            return Err(EchoError::Io(err));
        }
        Ok(now)
    }

    /// Whether restored samples are still going in ([`Store::restore`]).
    pub fn is_restoring(&self) -> bool {
        // ORDERING: Relaxed — a status read for tests and statistics.
        self.restoring.load(Relaxed)
    }

    #[cfg(not(loom))]
    fn end_restore(&self) {
        // ORDERING: Relaxed — see `insert`; the notification below takes the signal's lock.
        self.restoring.store(false, Relaxed);
        self.space_free.notify_all();
    }
}

/// A running checkpoint of a [`Store`] (from [`Store::checkpoint`]): the snapshot's bounds and
/// how far the copy got. Slots not copied yet are pinned (writers do not reuse them) until
/// [`RingCheckpoint::next_chunk`] copies them or the checkpoint is dropped.
#[derive(Debug)]
pub struct RingCheckpoint {
    store: Arc<Store>,
    /// First snapshot slot (absolute): every sample before it was handed to the consumer.
    start: u64,
    /// One past the last snapshot slot.
    end: u64,
    /// First slot not copied yet; `start <= next <= end`.
    next: u64,
    /// Rows before the ring's (a fresh ring's gathered rows), per leaf; taken by the first
    /// `next_chunk`.
    head: Vec<Vec<u8>>,
    head_rows: usize,
}

impl RingCheckpoint {
    /// The sample layout.
    pub fn spec(&self) -> &DataSpec {
        &self.store.spec
    }

    /// Samples in the snapshot.
    pub fn len(&self) -> usize {
        self.head_rows + (self.end - self.start) as usize
    }

    /// Whether the snapshot holds no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples the consumer had been handed before the snapshot (whole batches): the
    /// snapshot's first sample is sample number `handed_out()` of this store.
    pub fn handed_out(&self) -> u64 {
        self.start
    }

    /// Copies the next samples (at least one, about `max_bytes` of them, never across the
    /// ring's end) into `out[l]` for each leaf `l` (cleared first), then unpins their slots.
    /// Returns how many samples it copied: 0 once everything is copied.
    ///
    /// # Panics
    /// If `out` does not have one buffer per leaf.
    pub fn next_chunk(&mut self, max_bytes: usize, out: &mut [Vec<u8>]) -> usize {
        let store = &self.store;
        assert_eq!(out.len(), store.spec.len(), "one buffer per leaf");
        for buf in out.iter_mut() {
            buf.clear();
        }
        if self.head_rows > 0 {
            for (buf, head) in out.iter_mut().zip(std::mem::take(&mut self.head)) {
                *buf = head;
            }
            return std::mem::take(&mut self.head_rows);
        }
        if self.next == self.end {
            return 0;
        }
        let first = store.ring_slot(self.next);
        let per_sample = store.spec.payload_size().max(1);
        let n = ((max_bytes / per_sample).max(1) as u64)
            .min(self.end - self.next)
            .min(store.capacity - first as u64) as usize;
        for (leaf, buf) in out.iter_mut().enumerate() {
            // SAFETY: the slots `next..next + n` are committed (step 3 of `checkpoint_with`,
            // whose Acquire made their bytes visible) and pinned: `read_cursor <= next`, so
            // writers reserve only below `next + capacity`, and every slot they reserved since
            // the snapshot is at or past `end` (never `next..end` again, nor its ring slots,
            // which come back only at `next + capacity`). The consumer only reads them.
            unsafe { store.ring.read_slots(leaf, first..first + n, |b| buf.extend_from_slice(b)) };
        }
        self.next += n as u64;
        let pin = (self.next < self.end).then_some(self.next);
        store.move_pin(pin);
        n
    }
}

impl Drop for RingCheckpoint {
    fn drop(&mut self) {
        self.store.move_pin(None);
        // ORDERING: Release pairs with the Acquire swap in `checkpoint_with`.
        self.store.checkpointing.store(false, Release);
    }
}
