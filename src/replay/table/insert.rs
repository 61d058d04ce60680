//! Inserting: the writers' side of a replay table. A sample's compressed leaves are packed
//! ahead without the lock (on several threads for a large shared source); then, under the
//! lock, the writer waits for the rate limiter, reserves a slot (evicting if full), saves a
//! running checkpoint's bytes before overwriting them, copies the sample in (under the lock
//! when small, after letting it go when large) and publishes the item.

use std::time::Instant;

use crate::codec;
use crate::error::InsertError;
use crate::replay::shell::{check_insert_priorities, lock_until};
use crate::source::{validate_source, SampleSource};
use crate::sync::MutexGuard;

use super::state::State;
use super::Table;

/// Samples up to this size are copied into their slot under the table lock (one lock round
/// trip per insert instead of two); larger ones after releasing it.
pub(super) const COPY_UNDER_LOCK_BYTES: usize = 4096;

impl Table {
    /// Copies every sample of `src` into the table, each as a new item with `priority` (or
    /// the largest priority seen so far), waiting for the rate limiter until `deadline`.
    ///
    /// # Errors
    /// An input error (nothing written) if a sample does not match the spec or the priority is
    /// invalid; [`EchoError::Closed`](crate::EchoError::Closed) /
    /// [`EchoError::TimedOut`](crate::EchoError::TimedOut) with the count inserted so far.
    pub fn insert<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        self.insert_as(src, priority, deadline, false)
    }

    /// [`Table::insert`]; `restorer`: the restore's own insert, which the restore gate lets by.
    pub(super) fn insert_as<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
        restorer: bool,
    ) -> Result<(), InsertError> {
        validate_source(&self.spec, src)?;
        let small = self.fixed_bytes as usize <= COPY_UNDER_LOCK_BYTES;
        // Compressed leaves are packed without the lock (writers compress in parallel), a
        // group of samples at a time right before they go in: the first group before the lock
        // is taken, the others with it released, so a sample the limiter holds back is not
        // compressed again and again, nor many that never go in (a timeout).
        let (n, group) = (src.num_samples(), self.pack_group(src));
        let mut ahead = self.pack_ahead(src, 0..group.min(n)).into_iter();
        // The deadline bounds the wait for the lock too.
        let mut state =
            lock_until(&self.state, deadline).map_err(|error| InsertError::new(0, error))?;
        check_insert_priorities(&*state.sampler, src, priority)?;
        for sample in 0..n {
            let item = match ahead.next() {
                Some(item) => item,
                None if self.codecs.is_empty() => Box::default(),
                None => {
                    let next = sample..(sample + group).min(n);
                    ahead =
                        MutexGuard::unlocked(&mut state, || self.pack_ahead(src, next)).into_iter();
                    ahead.next().expect("one packed item per sample of the group")
                }
            };
            self.shell
                .wait_writable(&mut state, deadline, |s| {
                    s.insertable() && (restorer || !s.restoring)
                })
                .map_err(|error| InsertError::new(sample, error))?;
            let packed_len = u32::try_from(item.len()).unwrap_or(u32::MAX);
            let bytes = self.fixed_bytes.saturating_add(packed_len);
            let (slot, replaced) = state.reserve(small, bytes);
            self.preserve_for_checkpoint(&mut state, slot);
            if small {
                self.write_item(slot, src, sample, item);
            } else {
                MutexGuard::unlocked(&mut state, || self.write_item(slot, src, sample, item));
            }
            self.publish(&mut state, slot, src.priority(sample).or(priority), replaced);
            src.inserted(1);
        }
        Ok(())
    }

    /// How many samples of `src` an insert packs at a time: one from a source only the
    /// calling thread may read; from one any thread may read ([`SampleSource::shared`]: a
    /// `submit_batch`, a round of wire samples), enough for four parts per codec thread, so a
    /// large insert compresses on every thread while holding only a few MiBs packed ahead.
    pub(super) fn pack_group<S: SampleSource + ?Sized>(&self, src: &S) -> usize {
        match src.shared() {
            Some(_) if self.codec_threads > 1 => {
                let raw = self.codecs.raw_packed_bytes().max(1);
                (4 * self.codec_threads * codec::COMPRESS_BYTES_PER_THREAD / raw).max(1)
            }
            _ => 1,
        }
    }

    /// The packed items of `samples` of `src` (none without compressed leaves): a sample
    /// that arrived compressed as it is, the others compressed, split over threads when the
    /// source allows it and they add up to enough raw bytes.
    pub(super) fn pack_ahead<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        samples: std::ops::Range<usize>,
    ) -> Vec<Box<[u8]>> {
        if self.codecs.is_empty() {
            return Vec::new();
        }
        // As it arrived (checked on arrival): no second compression.
        let arrived: Vec<Option<&[u8]>> = samples
            .clone()
            .map(|i| src.packed(i).filter(|item| self.codecs.check_item(item).is_ok()))
            .collect();
        let fresh = arrived.iter().filter(|item| item.is_none()).count();
        let raw = fresh * self.codecs.raw_packed_bytes();
        let threads = codec::threads_for(
            raw,
            codec::COMPRESS_BYTES_PER_THREAD,
            arrived.len(),
            self.codec_threads,
        );
        match src.shared() {
            Some(shared) if threads > 1 => {
                let parts = codec::in_parts(&arrived, threads, |first, part| {
                    let at = samples.start + first;
                    let packed = part.iter().enumerate();
                    packed.map(|(i, item)| self.pack_one(shared, at + i, *item)).collect::<Vec<_>>()
                });
                parts.into_iter().flatten().collect()
            }
            _ => {
                arrived.iter().zip(samples).map(|(item, i)| self.pack_one(src, i, *item)).collect()
            }
        }
    }

    /// Sample `sample`'s packed item: `arrived` as it is, or compressed from `src`.
    pub(super) fn pack_one<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        sample: usize,
        arrived: Option<&[u8]>,
    ) -> Box<[u8]> {
        arrived.map_or_else(|| self.codecs.pack(src, sample), Box::from)
    }

    /// `State::publish` plus the wake-ups it owes: the consumer may wait for an item, and
    /// when the table goes from no live item to one, writers that found it full of pending
    /// (large, still copying) items may now evict.
    pub(super) fn publish(
        &self,
        state: &mut State,
        slot: usize,
        priority: Option<f64>,
        replaced: bool,
    ) {
        state.publish(slot, priority, replaced);
        self.shell.notify_sample();
        if state.live == 1 {
            self.shell.wake_writers();
        }
    }

    /// Invariant 4: saves the snapshot bytes of `slot`, just reserved by this writer (under the
    /// lock, before anything is written to it), if a running checkpoint still needs them.
    pub(super) fn preserve_for_checkpoint(&self, state: &mut State, slot: usize) {
        let Some(copies) = state.copies.as_mut() else {
            return;
        };
        if !copies.take_pending(slot) {
            return;
        }
        let mut bytes = Vec::with_capacity(self.fixed_bytes as usize);
        let item = match copies.saved_packed.remove(&(slot as u32)) {
            Some(item) => item,
            None => self.packed.get(slot).map(|cell| cell.lock().clone()).unwrap_or_default(),
        };
        for leaf in (0..self.spec.len()).filter(|&leaf| self.codecs.get(leaf).is_none()) {
            // SAFETY: the caller reserved `slot` under the lock it still holds and has not
            // written it yet; the pending bit says no writer reserved it since the snapshot
            // (invariant 4), so nobody writes it while we read (the consumer may read it too).
            unsafe {
                self.storage.read_slots(leaf, slot..slot + 1, |b| bytes.extend_from_slice(b));
            }
        }
        copies.saved.insert(slot as u32, (bytes.into_boxed_slice(), item));
    }

    /// Writes sample `sample` of `src` into `slot`: its leaves stored as they are, and `item`,
    /// its compressed leaves packed (empty when none is compressed).
    pub(super) fn write_item<S: SampleSource + ?Sized>(
        &self,
        slot: usize,
        src: &S,
        sample: usize,
        item: Box<[u8]>,
    ) {
        for leaf in 0..self.spec.len() {
            if self.codecs.get(leaf).is_some() {
                continue;
            }
            // SAFETY: `reserve` popped `slot` from the free list under the lock and marked it
            // `Writing`; until `publish` nobody else reads or writes it (invariant 1). Sizes
            // were checked by `validate_source`, so `copy_leaf` gets exactly the leaf's size.
            unsafe { self.storage.fill_slot(slot, leaf, |dst| src.copy_leaf(sample, leaf, dst)) };
        }
        if let Some(cell) = self.packed.get(slot) {
            // The slot's previous item (an evicted victim reused in place) is freed here.
            let previous = std::mem::replace(&mut *cell.lock(), item);
            drop(previous);
        }
    }
}
