//! Restoring a sequence table from a snapshot: every index and count checked before the
//! table is touched, chunks put back where they were with their generations (so window keys
//! stay valid), stored compressed rows kept as they are, then the queued steps inserted and
//! the TCP clients' open episodes ended.

use std::collections::{HashMap, HashSet};

use super::{at_end_code, SequenceSnapshot, StreamRow};
use crate::codec::{self, Codec};
use crate::error::EchoError;
use crate::replay::rng::Rng;
use crate::replay::sequence::{
    Chunk, ChunkState, Episode, EpisodeEnd, Geometry, Packed, SequenceTable, State, Stream, Window,
    NIL,
};
use crate::replay::LeafRows;
use crate::slots::Slots;
use crate::source::SampleSource;
use crate::spec::DataSpec;
use crate::sync::Arc;

/// Streams from this id on are TCP clients' ([`crate::ingress::Connection::stream`]).
const TRANSPORT_STREAMS: u64 = 1 << 32;

impl SequenceTable {
    /// Fills a new, empty table with a snapshot's state and steps (`leaves[l]`: leaf `l` of
    /// every step, in the snapshot's order, raw; or compressed per chunk row as a checkpoint
    /// that kept them packed wrote them, see [`SequenceCheckpoint::keep_packed`]: stored as
    /// they are where this table compresses the leaf with the same codec, after checking that
    /// each decompresses to its steps), then inserts the snapshot's queued steps
    /// (`queued_leaves`, same layout) and ends the open episodes of TCP clients' streams
    /// (truncated). The table samples, evicts, paces and numbers as the checkpointed one
    /// would have; window keys stay valid.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming what does not fit (nothing is inserted then): another
    /// geometry (length, period, `at_end`, chunks), a table that is not new, lengths that
    /// differ, an index out of range, a window whose steps are not stored, an invalid priority
    /// or RNG state.
    ///
    /// [`SequenceCheckpoint::keep_packed`]: super::SequenceCheckpoint::keep_packed
    pub fn restore(
        &self,
        snap: &SequenceSnapshot,
        leaves: &[LeafRows<'_>],
        queued_leaves: &[&[u8]],
    ) -> Result<(), EchoError> {
        let g = self.geometry;
        let config = |msg: String| Err(EchoError::Config(format!("restore: {msg}")));
        let mut state = self.state.lock();
        let chunks_total = state.chunks.len();
        let ours = (
            g.chunk_length as u64,
            chunks_total as u64,
            g.length as u64,
            g.period as u64,
            at_end_code(g.at_end),
        );
        let theirs = (snap.chunk_length, snap.chunks_total, snap.length, snap.period, snap.at_end);
        if ours != theirs {
            return config(format!(
                "the snapshot's geometry (chunk length, chunks, length, period, at_end) \
                 {theirs:?} differs from this table's {ours:?}: restore with the checkpoint's \
                 settings"
            ));
        }
        if state.stats.steps_inserted > 0 || !state.stream_index.is_empty() || state.cow.is_some() {
            return config("the table is not new".to_owned());
        }
        let steps = snap.step_priority.len();
        if snap.generations.len() != chunks_total {
            return config(format!(
                "{} chunk generations for {chunks_total} chunks",
                snap.generations.len()
            ));
        }
        let rows: usize = snap.chunks.iter().map(|c| c.filled as usize).sum();
        if rows != steps || steps > g.max_size {
            return config(format!(
                "{rows} steps in chunks, {steps} step priorities, max_size {}",
                g.max_size
            ));
        }
        let rows = RestoreRows::new(&self.spec, leaves, snap)?;
        check_leaves(&self.spec, queued_leaves, snap.queued.len(), "queued leaf")?;
        let rng = Rng::from_state(snap.rng)
            .ok_or_else(|| EchoError::Config("restore: the RNG state is all zeros".into()))?;
        self.check_priority_value(&state, snap.max_priority, "max_priority")?;
        // Chunks: in range, each once, never empty or over-full; links to live chunks.
        let mut live = vec![false; chunks_total];
        for row in &snap.chunks {
            let c = row.index as usize;
            if c >= chunks_total || live[c] {
                return config(format!("chunk {c} out of range or listed twice"));
            }
            if row.filled == 0 || row.filled as usize > g.chunk_length {
                return config(format!(
                    "chunk {c} holds {} steps of {}",
                    row.filled, g.chunk_length
                ));
            }
            live[c] = true;
        }
        let mut free_seen = vec![false; chunks_total];
        for &f in &snap.free {
            let f = f as usize;
            if f >= chunks_total || live[f] || std::mem::replace(&mut free_seen[f], true) {
                return config(format!("free chunk {f} out of range, live or listed twice"));
            }
        }
        // A stream takes its chunks in eviction order (the module's eviction argument): a link
        // must point to a chunk taken later.
        let mut position = vec![usize::MAX; chunks_total];
        for (i, row) in snap.chunks.iter().enumerate() {
            position[row.index as usize] = i;
        }
        for (i, row) in snap.chunks.iter().enumerate() {
            let later = position.get(row.next as usize).is_some_and(|&p| p != usize::MAX && p > i);
            if row.next != NIL && !later {
                return config(format!(
                    "chunk {} links to {}, not a live chunk taken after it",
                    row.index, row.next
                ));
            }
        }
        // Every check below looks up what it needs (linear in the snapshot, not a scan per
        // row: a checkpoint of a million chunks or streams restores in seconds).
        let mut filled = vec![0usize; chunks_total];
        for row in &snap.chunks {
            filled[row.index as usize] = row.filled as usize;
        }
        let next: HashMap<usize, usize> = snap
            .chunks
            .iter()
            .filter(|r| r.next != NIL)
            .map(|r| (r.index as usize, r.next as usize))
            .collect();
        // Episodes, and the windows that refer to them: every window's steps must be stored.
        let mut episodes: HashMap<u64, Episode> = HashMap::with_capacity(snap.episodes.len());
        for e in &snap.episodes {
            if e.id >= snap.next_episode || episodes.contains_key(&e.id) {
                return config(format!("episode {} out of range or listed twice", e.id));
            }
            let episode =
                Episode { stream: e.stream, end: e.end, windows: 0, open: e.open, len: e.len };
            episodes.insert(e.id, episode);
        }
        let mut window_slots = HashSet::with_capacity(snap.windows.len());
        let k = g.max_times_sampled;
        for w in &snap.windows {
            let slot = w.slot as usize;
            if !window_slots.insert(slot) {
                return config(format!("two windows start at slot {slot}"));
            }
            if w.len == 0 || w.len as usize > g.length {
                return config(format!("a window of {} steps, length is {}", w.len, g.length));
            }
            if k > 0 && w.times_sampled >= k {
                return config(format!(
                    "a window sampled {} times, max_times_sampled {k}",
                    w.times_sampled
                ));
            }
            if !stored_run(&g, &filled, &next, slot, w.len as usize) {
                return config(format!(
                    "the window at slot {slot} holds steps that are not stored"
                ));
            }
            self.check_priority_value(&state, w.priority, "a window's priority")?;
            let Some(e) = episodes.get_mut(&w.episode) else {
                return config(format!("a window of episode {}, which is not listed", w.episode));
            };
            e.windows += 1;
        }
        // Streams: their own live chunk (or none), their open episode listed and open, its
        // windows all before the next start to make (no window is made twice).
        let mut stream_ids = HashSet::with_capacity(snap.streams.len());
        let mut open_chunks = HashSet::with_capacity(snap.streams.len());
        // Per episode, the latest start of its windows.
        let mut last_start: HashMap<u64, u32> = HashMap::with_capacity(episodes.len());
        for w in &snap.windows {
            let start = last_start.entry(w.episode).or_insert(w.start);
            *start = (*start).max(w.start);
        }
        for s in &snap.streams {
            if !stream_ids.insert(s.id) {
                return config(format!("stream {} listed twice", s.id));
            }
            if s.chunk != NIL {
                let owned = position
                    .get(s.chunk as usize)
                    .is_some_and(|&p| p != usize::MAX && snap.chunks[p].stream == s.id);
                if !owned || !open_chunks.insert(s.chunk) {
                    return config(format!(
                        "stream {}'s chunk {} is not a live chunk of its own",
                        s.id, s.chunk
                    ));
                }
            }
            if s.in_episode && last_start.get(&s.episode).is_some_and(|&l| l >= s.next_start) {
                return config(format!(
                    "stream {} has a window at or past its next start {}",
                    s.id, s.next_start
                ));
            }
            if s.in_episode && !episodes.get(&s.episode).is_some_and(|e| e.open) {
                return config(format!(
                    "stream {}'s open episode {} is not listed as open",
                    s.id, s.episode
                ));
            }
            // The next window to make is not yet complete (else it would have been made): this
            // also bounds the work the next step does for the stream.
            if s.in_episode && u64::from(s.next_start) + g.length as u64 <= u64::from(s.count) {
                return config(format!(
                    "stream {} has {} steps but its next window starts at {}",
                    s.id, s.count, s.next_start
                ));
            }
            if s.retained_from > s.count {
                return config(format!(
                    "stream {} keeps steps from {} of {}",
                    s.id, s.retained_from, s.count
                ));
            }
        }
        // Counts no table reaches (2^62: over a century at a billion a second; an episode of
        // 2^32 steps) would overflow as the table counts on.
        let counts = [("inserts", snap.inserts), ("samples", snap.samples)]
            .into_iter()
            .chain([("the next episode", snap.next_episode)])
            .chain(snap.counters.iter().map(|&c| ("a counter", c)));
        if let Some((what, value)) = counts.into_iter().find(|&(_, v)| v > 1 << 62) {
            return config(format!("{what} is {value}, more than a table counts (2^62)"));
        }
        if let Some(s) = snap.streams.iter().find(|s| s.count == u32::MAX) {
            return config(format!(
                "stream {} has {} steps, more than an episode holds",
                s.id, s.count
            ));
        }
        let streams_open: HashSet<u64> =
            snap.streams.iter().filter(|s| s.in_episode).map(|s| s.episode).collect();
        if let Some(e) = episodes.iter().find(|(id, e)| e.open && !streams_open.contains(id)) {
            return config(format!("episode {} is open but no stream has it", e.0));
        }
        if let Some(q) = snap
            .queued
            .iter()
            .find(|(p, _)| !p.is_nan() && self.check_priority_value(&state, *p, "").is_err())
        {
            return config(format!("a queued step's priority {} is invalid", q.0));
        }
        // Everything checked: fill the table. With compressed leaves, the chunks that take
        // no more steps are packed first (on several threads: a large table is gigabytes),
        // the streams' open chunks staged.
        let open: HashSet<u32> = snap.streams.iter().map(|s| s.chunk).collect();
        let mut packed = self.pack_rows(snap, &rows, &open)?;
        let unpack = |e: String| EchoError::Config(format!("restore: {e}"));
        let mut scratch = Vec::new();
        let st = &mut *state;
        let mut at = 0usize;
        for (r, row) in snap.chunks.iter().enumerate() {
            let c = row.index as usize;
            let first = g.first_slot(c);
            let filled = row.filled as usize;
            let mut bytes = filled as u64 * self.step_bytes;
            if let Some(p) = packed.get_mut(r).and_then(Option::take) {
                bytes = filled as u64 * self.fixed_bytes + p.len() as u64;
                st.packed[c] = Some(p);
            } else if !self.codecs.is_empty() {
                let staged = Arc::new(Slots::of_arrays(&self.staged_arrays, g.chunk_length)?);
                for (k, &leaf) in self.codecs.packed_leaves().iter().enumerate() {
                    let len = self.spec.arrays()[leaf].num_bytes();
                    let raw = rows.raw(leaf, r, &mut scratch).map_err(unpack)?;
                    for (i, step) in raw.chunks_exact(len).enumerate() {
                        // SAFETY: a new buffer nobody else holds yet.
                        unsafe { staged.write_slot(i, k, step) };
                    }
                }
                st.staged[c] = Some(staged);
            }
            st.stored_bytes += bytes;
            for leaf in (0..self.spec.len()).filter(|&leaf| self.packed_index[leaf].is_none()) {
                let len = self.spec.arrays()[leaf].num_bytes();
                let raw = rows.raw(leaf, r, &mut scratch).map_err(unpack)?;
                for (i, step) in raw.chunks_exact(len).enumerate() {
                    // SAFETY: the table is new and we hold its lock: nobody else reads or
                    // writes any slot (no window exists yet). Sizes were checked above;
                    // `step` is caller memory (or ours), not the table.
                    unsafe { self.storage.write_slot(first + i, leaf, step) };
                }
            }
            for i in 0..filled {
                if snap.step_priority[at + i] != 0 {
                    st.step_priority[first + i] = snap.step_priority[at + i];
                }
            }
            at += row.filled as usize;
            st.chunks[c] = Chunk {
                filled: row.filled,
                generation: snap.generations[c],
                pins: 0,
                state: ChunkState::Live,
                next: row.next,
                stream: row.stream,
                last_episode: row.last_episode,
                last_index: row.last_index,
                has_priorities: row.has_priorities,
                bytes,
                queued: st.packed[c].is_some(),
            };
            st.live_chunks.push_back(row.index);
        }
        for (c, chunk) in st.chunks.iter_mut().enumerate() {
            chunk.generation = snap.generations[c];
        }
        // The free chunks in the snapshot's order, after the ones it had pinned (retired then,
        // free now), so new steps take the chunks the checkpointed table would have.
        let listed: HashSet<u32> = snap.free.iter().copied().collect();
        st.free_chunks = (0..chunks_total as u32)
            .rev()
            .filter(|&c| !live[c as usize] && !listed.contains(&c))
            .chain(snap.free.iter().copied())
            .collect();
        st.steps = steps;
        for w in &snap.windows {
            let slot = w.slot as usize;
            let window = Window {
                episode: w.episode,
                start: w.start,
                len: w.len,
                times_sampled: w.times_sampled,
                priority: w.priority,
            };
            st.windows.insert(w.slot, window);
            st.sampler.insert(slot, w.priority);
        }
        st.live_windows = snap.windows.len();
        st.episodes = episodes;
        // Each chunk's predecessor in its stream, for the walks back from the open chunks.
        let prev: HashMap<usize, usize> = next.iter().map(|(&a, &b)| (b, a)).collect();
        for s in &snap.streams {
            // Only a stream with steps stored in a live chunk of its own gets the ring of its
            // last `length` steps now: at most one per chunk (each owns a distinct one, checked
            // above), so a snapshot that lists many streams cannot make the table allocate
            // `length` slots for each. The others take theirs at their next step.
            let ringed = s.in_episode && s.count > 0 && s.chunk != NIL;
            let mut recent: Box<[u32]> =
                if ringed { vec![NIL; g.length].into_boxed_slice() } else { Box::new([]) };
            let mut retained_from = s.retained_from;
            if ringed {
                retained_from = recent_slots(&g, &filled, &prev, s, &mut recent);
            }
            // A window still to make reads only steps found stored (`recent`): a stream whose
            // snapshot claims more of its last `length` steps than its chunks hold (a tampered
            // or corrupt one: no chunk, a broken chain) keeps only those after the last gap.
            let last = retained_from.max(s.count.saturating_sub(g.length as u32));
            let stored = |i: u32| ringed && recent[i as usize % g.length] != NIL;
            if let Some(gap) = (last..s.count).rev().find(|&i| !stored(i)) {
                retained_from = gap + 1;
            }
            let stream = Stream {
                id: s.id,
                chunk: s.chunk,
                in_episode: s.in_episode,
                episode: s.episode,
                count: s.count,
                retained_from,
                next_start: s.next_start.max(g.start_at_or_after(retained_from)),
                recent,
            };
            st.stream_index.insert(s.id, st.streams.len() as u32);
            st.streams.push(stream);
        }
        st.limiter.set_counts(snap.inserts, snap.samples);
        st.rng = rng;
        st.next_episode = snap.next_episode;
        st.max_priority = snap.max_priority;
        let c = snap.counters;
        let w = &mut st.stats.windows;
        (w.inserted, w.sampled_items, w.batches, w.evicted, w.removed_max_times_sampled) =
            (c[0], c[1], c[2], c[3], c[4]);
        (w.priority_updates, w.unknown_keys, w.insert_blocked_ns, w.sample_blocked_ns) =
            (c[5], c[6], c[7], c[8]);
        (st.stats.steps_inserted, st.stats.steps_evicted, st.stats.episodes_ended) =
            (c[9], c[10], c[11]);
        st.stats.streams_open = snap.streams.iter().filter(|s| s.in_episode).count() as u64;
        // The steps TCP clients had queued, then their streams' ends: their clients come
        // back (if at all) as new streams of the new server.
        for (i, (priority, step)) in snap.queued.iter().enumerate() {
            let row: Vec<&[u8]> = queued_leaves
                .iter()
                .zip(self.spec.arrays())
                .map(|(bytes, array)| &bytes[i * array.num_bytes()..(i + 1) * array.num_bytes()])
                .collect();
            let source = crate::source::StepLeaves(&row, *step);
            debug_assert_eq!(source.num_samples(), 1);
            let priority = (!priority.is_nan()).then_some(*priority);
            self.put_step(st, &source, 0, priority)?;
        }
        let transport: Vec<u64> =
            st.stream_index.keys().copied().filter(|&id| id >= TRANSPORT_STREAMS).collect();
        for id in transport {
            let at = st.stream_index[&id] as usize;
            if st.streams[at].in_episode {
                st.end_episode(&g, at, EpisodeEnd::Truncated);
            }
            st.forget_stream(at);
        }
        st.shrink_streams();
        self.pack_queued(&mut state);
        drop(state);
        self.shell.sample_ready.notify_one();
        Ok(())
    }

    /// Per chunk row of `snap`: its steps of the compressed leaves packed (as they come
    /// when the checkpoint compressed a leaf with the same codec, else compressed here),
    /// unless the table compresses nothing or the row is a stream's open chunk (in `open`)
    /// with room left. Every compressed row of `rows` is checked to decompress to exactly
    /// its steps first, whatever is done with it. On several threads.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the first row that does not decompress.
    fn pack_rows(
        &self,
        snap: &SequenceSnapshot,
        rows: &RestoreRows<'_>,
        open: &HashSet<u32>,
    ) -> Result<Vec<Option<Packed>>, EchoError> {
        let pack = |r: usize, scratch: &mut Vec<u8>| -> Result<Option<Packed>, String> {
            for leaf in 0..self.spec.len() {
                if rows.segment(leaf, r).is_some() {
                    rows.raw(leaf, r, scratch)?;
                }
            }
            let row = &snap.chunks[r];
            let stays_open =
                open.contains(&row.index) && (row.filled as usize) < self.geometry.chunk_length;
            if self.codecs.is_empty() || stays_open {
                return Ok(None);
            }
            let mut item = vec![0u8; 4 * self.codecs.packed_leaves().len()];
            for (k, &leaf) in self.codecs.packed_leaves().iter().enumerate() {
                let codec = self.codecs.get(leaf).expect("a packed leaf has a codec");
                let before = item.len();
                match rows.segment(leaf, r) {
                    Some((theirs, bytes)) if theirs == codec => item.extend_from_slice(bytes),
                    _ => codec.compress_append(rows.raw(leaf, r, scratch)?, &mut item),
                }
                let len =
                    u32::try_from(item.len() - before).map_err(|_| "a packed row over 4 GiB")?;
                item[4 * k..4 * k + 4].copy_from_slice(&len.to_le_bytes());
            }
            Ok(Some(Arc::from(item)))
        };
        let n = snap.chunks.len();
        let parts = codec::in_parts(&snap.chunks, self.codec_threads, |first, part| {
            let mut scratch = Vec::new();
            let rows = first..first + part.len();
            rows.map(|r| pack(r, &mut scratch)).collect::<Result<Vec<_>, String>>()
        });
        let mut out = Vec::with_capacity(n);
        for part in parts {
            out.extend(part.map_err(|e| EchoError::Config(format!("restore: {e}")))?);
        }
        Ok(out)
    }

    fn check_priority_value(
        &self,
        state: &State,
        priority: f64,
        what: &str,
    ) -> Result<(), EchoError> {
        Self::check_priority(state, priority)
            .map_err(|msg| EchoError::Config(format!("restore: {what} {msg}")))
    }
}

/// Whether `len` steps from `slot` on are stored: inside live chunks, running on through
/// `next` links (a chunk must be full to run past its end).
fn stored_run(
    g: &Geometry,
    filled: &[usize],
    next: &HashMap<usize, usize>,
    slot: usize,
    len: usize,
) -> bool {
    let mut c = g.chunk_of(slot);
    if c >= filled.len() {
        return false;
    }
    let mut offset = slot - g.first_slot(c);
    let mut left = len;
    // At most one hop per chunk: a cycle of links cannot loop forever.
    for _ in 0..=filled.len() {
        let here = filled[c].saturating_sub(offset);
        if here == 0 {
            return false;
        }
        if here >= left {
            return true;
        }
        if filled[c] != g.chunk_length {
            return false;
        }
        left -= here;
        let Some(&n) = next.get(&c) else { return false };
        c = n;
        offset = 0;
    }
    false
}

/// Fills `recent` with the slots of the last `length` steps of stream `s`'s open episode,
/// walking back from the last step written in its open chunk through the chunks that link
/// to each other; returns the first step it could reach (or `s.retained_from` if further):
/// what is still stored.
fn recent_slots(
    g: &Geometry,
    filled: &[usize],
    prev: &HashMap<usize, usize>,
    s: &StreamRow,
    recent: &mut [u32],
) -> u32 {
    let mut c = s.chunk as usize;
    let Some(&f) = filled.get(c) else { return s.count };
    if f == 0 {
        return s.count;
    }
    let mut slot = g.first_slot(c) + f - 1;
    let lowest = s.retained_from.max(s.count.saturating_sub(g.length as u32));
    if lowest >= s.count {
        return s.retained_from;
    }
    let mut index = s.count - 1;
    loop {
        recent[index as usize % g.length] = slot as u32;
        if index == lowest {
            return s.retained_from;
        }
        if slot > g.first_slot(c) {
            slot -= 1;
        } else {
            match prev.get(&c) {
                Some(&p) if filled[p] == g.chunk_length => {
                    c = p;
                    slot = g.first_slot(c) + g.chunk_length - 1;
                }
                _ => return index,
            }
        }
        index -= 1;
    }
}

/// A restore's steps, leaf by leaf, per chunk row of the snapshot: raw rows (each step the
/// leaf's size), or one compressed row per chunk row (a checkpoint of a table that stored
/// the leaf compressed).
struct RestoreRows<'a> {
    spec: &'a DataSpec,
    leaves: &'a [LeafRows<'a>],
    /// Per chunk row: its first step and its steps.
    rows: Vec<(usize, usize)>,
    /// Per leaf (empty for raw ones): each chunk row's first byte.
    starts: Vec<Vec<usize>>,
}

impl<'a> RestoreRows<'a> {
    /// Checks that `leaves` holds `snap`'s steps: raw rows of the right size, or one
    /// compressed row per chunk whose lengths add up to the bytes.
    fn new(
        spec: &'a DataSpec,
        leaves: &'a [LeafRows<'a>],
        snap: &SequenceSnapshot,
    ) -> Result<Self, EchoError> {
        let config = |msg: String| Err(EchoError::Config(format!("restore: {msg}")));
        if leaves.len() != spec.len() {
            return config(format!("{} leaves, the layout has {}", leaves.len(), spec.len()));
        }
        let mut rows = Vec::with_capacity(snap.chunks.len());
        let mut steps = 0usize;
        for row in &snap.chunks {
            rows.push((steps, row.filled as usize));
            steps += row.filled as usize;
        }
        let mut starts = Vec::with_capacity(leaves.len());
        for (leaf, (rows_of, array)) in leaves.iter().zip(spec.arrays()).enumerate() {
            match *rows_of {
                LeafRows::Raw(bytes) => {
                    if Some(bytes.len()) != steps.checked_mul(array.num_bytes()) {
                        return config(format!(
                            "leaf {leaf}: {} bytes for {steps} steps of {} bytes",
                            bytes.len(),
                            array.num_bytes()
                        ));
                    }
                    starts.push(Vec::new());
                }
                LeafRows::Packed { bytes, lengths, .. } => {
                    if lengths.len() != rows.len() {
                        return config(format!(
                            "leaf {leaf}: {} compressed rows for {} chunks",
                            lengths.len(),
                            rows.len()
                        ));
                    }
                    let mut at = 0usize;
                    let mut first = Vec::with_capacity(lengths.len());
                    for &len in lengths {
                        first.push(at);
                        at = at.saturating_add(len as usize);
                    }
                    if at != bytes.len() {
                        return config(format!(
                            "leaf {leaf}: compressed rows of {at} bytes in all, {} given",
                            bytes.len()
                        ));
                    }
                    starts.push(first);
                }
            }
        }
        Ok(Self { spec, leaves, rows, starts })
    }

    /// Chunk row `r` of `leaf` as compressed in the checkpoint, if it is.
    fn segment(&self, leaf: usize, r: usize) -> Option<(Codec, &'a [u8])> {
        match self.leaves[leaf] {
            LeafRows::Raw(_) => None,
            LeafRows::Packed { codec, bytes, lengths } => {
                let at = self.starts[leaf][r];
                Some((codec, &bytes[at..at + lengths[r] as usize]))
            }
        }
    }

    /// The raw steps of chunk row `r` of `leaf`: a slice of the rows, or decompressed into
    /// `scratch` (exactly the row's steps: never more, whatever the row claims).
    fn raw<'s>(
        &'s self,
        leaf: usize,
        r: usize,
        scratch: &'s mut Vec<u8>,
    ) -> Result<&'s [u8], String> {
        let (first, n) = self.rows[r];
        let size = self.spec.arrays()[leaf].num_bytes();
        match (self.leaves[leaf], self.segment(leaf, r)) {
            (LeafRows::Raw(bytes), _) => Ok(&bytes[first * size..(first + n) * size]),
            (LeafRows::Packed { .. }, Some((codec, packed))) => {
                scratch.clear();
                scratch.resize(n * size, 0);
                codec
                    .decompress_into(packed, scratch)
                    .map_err(|e| format!("leaf {leaf}, compressed row {r}: {e}"))?;
                Ok(scratch)
            }
            (LeafRows::Packed { .. }, None) => unreachable!("a packed leaf has segments"),
        }
    }
}

fn check_leaves(
    spec: &DataSpec,
    leaves: &[&[u8]],
    rows: usize,
    what: &str,
) -> Result<(), EchoError> {
    if leaves.len() != spec.len() {
        return Err(EchoError::Config(format!(
            "restore: {} {what}s, the layout has {}",
            leaves.len(),
            spec.len()
        )));
    }
    for (leaf, (bytes, array)) in leaves.iter().zip(spec.arrays()).enumerate() {
        if Some(bytes.len()) != rows.checked_mul(array.num_bytes()) {
            return Err(EchoError::Config(format!(
                "restore: {what} {leaf}: {} bytes for {rows} steps of {} bytes",
                bytes.len(),
                array.num_bytes()
            )));
        }
    }
    Ok(())
}
