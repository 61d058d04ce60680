//! Packing full chunks' compressed leaves: a writer that filled chunks hands them to the
//! background packers ([`Packers`], one thread per spare core, at most [`MAX_PACKERS`]) or,
//! when they are behind, packs them itself with the lock let go; either way the packed chunk
//! is put in place of its staged steps under the lock, if the chunk is still the one packed.

use std::collections::VecDeque;

use crate::codec;
use crate::spec::ArraySpec;
use crate::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::state::{PackJob, Packed, State};
use super::SequenceTable;

/// Threads that pack full chunks in the background: one fewer than the cores (the inserting
/// thread has one), at most this many.
pub(super) const MAX_PACKERS: usize = 4;

/// Chunks queued for the background packers per packer; past that, writers pack the chunks
/// they fill themselves (the packers are behind: inserts slow down to what they can pack).
/// A 16-stream vector env fills 16 chunks at once. Queued chunks are raw, and count so in
/// `stored_bytes`: with `max_bytes`, they may take at most an eighth of it.
pub(super) const QUEUED_PER_PACKER: usize = 16;

/// Full chunks waiting for a background packer, and the packers' state.
#[derive(Default)]
pub(super) struct PackQueue {
    pub(super) jobs: VecDeque<PackJob>,
    /// Jobs a packer has taken and not yet put in place.
    pub(super) busy: usize,
    /// The table is gone: the packers stop.
    pub(super) closed: bool,
}

/// The background packers of a table with compressed leaves (see
/// [`SequenceTable::pack_queued`]). The packer threads hold this and a weak reference to the
/// table; the table's drop closes it.
#[derive(Default)]
pub(super) struct Packers {
    pub(super) queue: Mutex<PackQueue>,
    /// Rung when a job is queued or the queue closes.
    pub(super) ready: Condvar,
    /// Rung when the queue is empty and no job is being packed.
    pub(super) idle: Condvar,
    pub(super) threads: usize,
}

impl SequenceTable {
    /// Packs the chunks queued for packing (full, or their stream gone) with the lock let go,
    /// then puts each in place of its staged steps. The chunks stay readable meanwhile:
    /// nothing writes a full chunk, and the staging buffer being read is not reused while
    /// this writer holds it.
    ///
    /// With background packers, the chunks go to them instead (the writer returns at once),
    /// as long as they are not behind by more than [`QUEUED_PER_PACKER`] chunks each; the
    /// rest this writer packs itself.
    pub(super) fn pack_queued(&self, state: &mut MutexGuard<'_, State>) {
        if state.to_pack.is_empty() {
            return;
        }
        let mut jobs = std::mem::take(&mut state.to_pack);
        if let Some(packers) = &self.packers {
            let mut queue = packers.queue.lock();
            let chunk = (self.geometry.chunk_length as u64
                * self.staged_arrays.iter().map(|a| a.num_bytes() as u64).sum::<u64>())
            .max(1);
            let most = (packers.threads * QUEUED_PER_PACKER)
                .min(usize::try_from(self.max_bytes / 8 / chunk).unwrap_or(usize::MAX));
            let room = most.saturating_sub(queue.jobs.len());
            let handed = jobs.len().min(room);
            queue.jobs.extend(jobs.drain(..handed));
            drop(queue);
            for _ in 0..handed {
                packers.ready.notify_one();
            }
            if jobs.is_empty() {
                return;
            }
        }
        let raw = jobs.iter().map(|job| job.filled as usize).sum::<usize>()
            * self.staged_arrays.iter().map(ArraySpec::num_bytes).sum::<usize>();
        let threads = codec::threads_for(
            raw,
            codec::COMPRESS_BYTES_PER_THREAD,
            jobs.len(),
            self.codec_threads,
        );
        let packed: Vec<Packed> = MutexGuard::unlocked(state, || {
            // Several full chunks (many streams stepping together): one per thread at a time.
            let parts = codec::in_parts(&jobs, threads, |_, part| {
                part.iter().map(|job| self.pack(job)).collect::<Vec<_>>()
            });
            parts.into_iter().flatten().collect()
        });
        for (job, packed) in jobs.iter().zip(packed) {
            state.install_packed(job, packed, self.fixed_bytes);
        }
    }

    /// Waits until the background packers have packed and put in place every chunk handed
    /// to them so far (at once without packers). For tests and benchmarks that read
    /// `stored_bytes` right after inserting: chunks waiting to be packed count raw.
    pub fn wait_packed(&self) {
        let Some(packers) = &self.packers else { return };
        let mut queue = packers.queue.lock();
        while !queue.jobs.is_empty() || queue.busy > 0 {
            packers.idle.wait(&mut queue);
        }
    }

    /// The packed item of a chunk's first `job.filled` staged steps.
    pub(super) fn pack(&self, job: &PackJob) -> Packed {
        let steps = 0..job.filled as usize;
        self.codecs.pack_with(
            |k, compress| {
                // SAFETY: the chunk's first `filled` steps are written (under the lock, which
                // this writer took since) and nothing writes them again: appends go past
                // them, and the buffer is reused only once nobody else holds it.
                unsafe { job.staged.read_slots(k, steps.clone(), |raw| compress(raw)) };
            },
            |packed: &[u8]| Arc::from(packed),
        )
    }
}

impl Drop for SequenceTable {
    fn drop(&mut self) {
        if let Some(packers) = &self.packers {
            packers.queue.lock().closed = true;
            packers.ready.notify_all();
        }
    }
}

/// A background packer: takes the queued chunks one at a time, packs each with the table's
/// lock let go, and puts it in place under the lock (as a writer would), until the table is
/// gone.
pub(super) fn pack_in_background(packers: &Packers, table: &std::sync::Weak<SequenceTable>) {
    loop {
        let job = {
            let mut queue = packers.queue.lock();
            loop {
                if queue.closed {
                    return;
                }
                if let Some(job) = queue.jobs.pop_front() {
                    queue.busy += 1;
                    break job;
                }
                packers.ready.wait(&mut queue);
            }
        };
        // The table may be dropped meanwhile (then the job is too). Its last reference may
        // be this one: it is dropped before the queue is locked again, as the table's drop
        // locks it.
        if let Some(table) = table.upgrade() {
            let packed = table.pack(&job);
            table.state.lock().install_packed(&job, packed, table.fixed_bytes);
        }
        drop(job);
        let mut queue = packers.queue.lock();
        queue.busy -= 1;
        if queue.jobs.is_empty() && queue.busy == 0 {
            packers.idle.notify_all();
        }
    }
}
