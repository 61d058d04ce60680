//! Inserting steps: the writers' side of a sequence table. Under the lock a writer waits for
//! the rate limiter, makes room (evicting the oldest chunks), appends the step to its
//! stream's open chunk (taking a new one when full, saving a running checkpoint's bytes
//! first), publishes the windows the step completes, and ends the episode if the step does.

use std::time::Instant;

use crate::error::{EchoError, InsertError};
use crate::replay::shell::{check_insert_priorities, lock_until};
use crate::slots::Slots;
use crate::source::EpisodeEnd;
use crate::source::{validate_source, SampleSource};
use crate::sync::Arc;

use super::state::{encode_priority, State, NIL};
use super::SequenceTable;

impl SequenceTable {
    /// Appends every step of `src` to its stream ([`SampleSource::step`]), in order, each
    /// with `priority` (or its own, [`SampleSource::priority`]) for the windows it is part
    /// of, waiting for the rate limiter until `deadline`. A step that ends its episode makes
    /// the episode's last windows as `at_end` says.
    ///
    /// # Errors
    /// An input error (nothing written) if a step does not match the spec or a priority is
    /// invalid; [`EchoError::Config`] (with the count inserted before it) for a step that
    /// would open more than `max_streams` streams; [`EchoError::Closed`] /
    /// [`EchoError::TimedOut`] with the count inserted so far.
    pub fn insert<S: SampleSource + ?Sized>(
        &self,
        src: &S,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        validate_source(&self.spec, src)?;
        let mut state =
            lock_until(&self.state, deadline).map_err(|error| InsertError::new(0, error))?;
        check_insert_priorities(&*state.sampler, src, priority)?;
        let mut put = || {
            for sample in 0..src.num_samples() {
                self.shell
                    .wait_writable(&mut state, deadline, |s| {
                        s.limiter.can_insert(s.live_windows as u64)
                    })
                    .map_err(|error| InsertError::new(sample, error))?;
                let windows_before = state.live_windows;
                self.put_step(&mut state, src, sample, src.priority(sample).or(priority))
                    .map_err(|error| InsertError::new(sample, error))?;
                src.inserted(1);
                if state.live_windows > windows_before {
                    self.shell.notify_sample();
                }
            }
            Ok(())
        };
        let put = put();
        // The chunks these steps filled, at once: a vector env's streams fill theirs together.
        self.pack_queued(&mut state);
        put
    }

    /// Appends one step (the lock held): room first (evicting the oldest chunks), then the
    /// stream's chunk, the copy, and the windows the step completes.
    pub(super) fn put_step<S: SampleSource + ?Sized>(
        &self,
        state: &mut State,
        src: &S,
        sample: usize,
        priority: Option<f64>,
    ) -> Result<(), EchoError> {
        let g = &self.geometry;
        let tag = src.step(sample);
        let at = state.open_stream(g, tag.stream);
        // Room by count, then by bytes (as long as something is stored: the window-sized
        // minimum of `max_bytes` is the caller's floor).
        while state.steps >= g.max_size
            || (state.stored_bytes + self.step_bytes > self.max_bytes
                && !state.live_chunks.is_empty())
        {
            state.evict_oldest(g);
        }
        let mut c = state.streams[at].chunk;
        if c == NIL || state.chunks[c as usize].filled as usize == g.chunk_length {
            // Its staging buffer first: a failed allocation leaves the table as it was.
            let staged = match self.codecs.is_empty() {
                true => None,
                false => Some(match state.reuse_staged() {
                    Some(staged) => staged,
                    None => Arc::new(Slots::of_arrays(&self.staged_arrays, g.chunk_length)?),
                }),
            };
            let new = state.take_chunk(g, tag.stream) as u32;
            state.staged[new as usize] = staged;
            self.preserve_for_checkpoint(state, new as usize);
            // The stream's old chunk may have been evicted just now (then it is not linked:
            // nothing live reaches past it).
            let old = state.streams[at].chunk;
            if old != NIL {
                state.chunks[old as usize].next = new;
            }
            state.streams[at].chunk = new;
            c = new;
        }
        let c = c as usize;
        let offset = state.chunks[c].filled as usize;
        let slot = g.first_slot(c) + offset;
        for leaf in 0..self.spec.len() {
            let copy = |dst: &mut [u8]| src.copy_leaf(sample, leaf, dst);
            match (self.packed_index[leaf], &state.staged[c]) {
                // SAFETY: `offset` is past the `filled` steps of the chunk's staging buffer:
                // readers (the consumer, a packing writer, a checkpoint) only read the
                // steps a chunk held when they took the buffer, and it is only ever written
                // here, under the lock, for the chunk that owns it (a reused buffer is one
                // nobody else holds). Sizes were checked by `validate_source`.
                (Some(k), Some(staged)) => unsafe { staged.fill_slot(offset, k, copy) },
                (Some(_), None) => unreachable!("a chunk with compressed leaves is staged"),
                // SAFETY: `slot` is past the `filled` steps of a live chunk we hold the lock
                // over: no window covers it (windows only cover written steps), so the
                // consumer never reads it, and writers only write under this lock (invariant
                // 2: a chunk being read is pinned, and a pinned chunk is never handed out by
                // `take_chunk`). Sizes were checked by `validate_source`.
                (None, _) => unsafe { self.storage.fill_slot(slot, leaf, copy) },
            }
        }
        let stream = &mut state.streams[at];
        let index = stream.count;
        stream.count += 1;
        stream.recent[index as usize % g.length] = slot as u32;
        let episode = stream.episode;
        let chunk = &mut state.chunks[c];
        chunk.filled += 1;
        chunk.bytes += self.step_bytes;
        chunk.last_episode = episode;
        chunk.last_index = index;
        let full = chunk.filled as usize == g.chunk_length;
        state.stored_bytes += self.step_bytes;
        if full {
            state.queue_pack(c);
        }
        // The slot reads 0 (no priority) already: a chunk is cleared when taken if it had any.
        // Writing only real priorities leaves the array's pages untouched (not resident).
        if let Some(p) = priority {
            state.step_priority[slot] = encode_priority(p);
            state.chunks[c].has_priorities = true;
        }
        state.steps += 1;
        state.stats.steps_inserted += 1;
        // The windows this step completes: the one starting `length - 1` steps back.
        let t = g.length as u32;
        loop {
            let stream = &state.streams[at];
            let start = stream.next_start;
            if start.saturating_add(t) > stream.count {
                break;
            }
            state.streams[at].next_start += g.period as u32;
            if start >= state.streams[at].retained_from {
                state.make_window(g, at, start, t);
            }
        }
        if tag.end != EpisodeEnd::No {
            state.end_episode(g, at, tag.end);
        }
        Ok(())
    }

    /// Ends `stream`'s open episode as `end` (truncated when its worker is gone for good)
    /// after its last step, making its last windows as `at_end` says. Returns whether the
    /// stream had an open episode.
    pub fn end_stream(&self, stream: u64, end: EpisodeEnd) -> bool {
        self.end_streams_in(stream..=stream, end) > 0
    }

    /// [`SequenceTable::end_stream`] for every stream of the table whose id lies in `ids` (a
    /// connection's rows, say), under one lock. Walks the streams the table has, not the
    /// range: a peer that used one row near 2^32 costs one stream, not 2^32 lookups. Returns
    /// how many had an open episode.
    pub fn end_streams_in(&self, ids: std::ops::RangeInclusive<u64>, end: EpisodeEnd) -> usize {
        let end = if end == EpisodeEnd::No { EpisodeEnd::Truncated } else { end };
        let mut state = self.state.lock();
        let mut found: Vec<u32> = if ids.start() == ids.end() {
            state.stream_index.get(ids.start()).copied().into_iter().collect()
        } else {
            state
                .stream_index
                .iter()
                .filter(|(id, _)| ids.contains(id))
                .map(|(_, &at)| at)
                .collect()
        };
        // In stream order, so the windows they make come out the same run to run.
        found.sort_unstable_by_key(|&at| state.streams[at as usize].id);
        let before = state.live_windows;
        let mut open = 0;
        for at in found {
            let at = at as usize;
            if state.streams[at].in_episode {
                state.end_episode(&self.geometry, at, end);
                open += 1;
            }
            state.forget_stream(at);
        }
        state.shrink_streams();
        if state.live_windows > before {
            self.shell.notify_sample();
        }
        self.pack_queued(&mut state);
        open
    }
}
