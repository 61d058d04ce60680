//! A [`SequenceSnapshot`] as one little-endian blob, the one definition of its format:
//! [`SequenceSnapshot::encode`] writes it, [`SequenceSnapshot::decode`] reads it back
//! defensively (every count bounded by the bytes left, nothing trusted).

use super::{ChunkRow, EpisodeRow, SequenceSnapshot, StreamRow, WindowRow};
use crate::error::EchoError;
use crate::replay::sequence::{EpisodeEnd, StepTag};

/// The blob's first bytes.
const MAGIC: &[u8; 8] = b"ECHOSEQ1";

impl SequenceSnapshot {
    /// The snapshot as bytes (little-endian; the one definition of the format).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            256 + self.generations.len() * 4
                + self.chunks.len() * 37
                + self.step_priority.len() * 8
                + self.windows.len() * 32
                + self.streams.len() * 33
                + self.episodes.len() * 22
                + self.queued.len() * 17,
        );
        out.extend_from_slice(MAGIC);
        for v in [self.chunk_length, self.chunks_total, self.length, self.period] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(self.at_end);
        for v in [self.inserts, self.samples] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in self.rng.iter().chain([&self.next_episode]) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.max_priority.to_le_bytes());
        for v in self.counters {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let count = |out: &mut Vec<u8>, n: usize| out.extend_from_slice(&(n as u64).to_le_bytes());
        count(&mut out, self.generations.len());
        for g in &self.generations {
            out.extend_from_slice(&g.to_le_bytes());
        }
        count(&mut out, self.free.len());
        for f in &self.free {
            out.extend_from_slice(&f.to_le_bytes());
        }
        count(&mut out, self.chunks.len());
        for c in &self.chunks {
            out.extend_from_slice(&c.index.to_le_bytes());
            out.extend_from_slice(&c.filled.to_le_bytes());
            out.extend_from_slice(&c.next.to_le_bytes());
            out.extend_from_slice(&c.stream.to_le_bytes());
            out.extend_from_slice(&c.last_episode.to_le_bytes());
            out.extend_from_slice(&c.last_index.to_le_bytes());
            out.push(u8::from(c.has_priorities));
        }
        count(&mut out, self.step_priority.len());
        for p in &self.step_priority {
            out.extend_from_slice(&p.to_le_bytes());
        }
        count(&mut out, self.windows.len());
        for w in &self.windows {
            out.extend_from_slice(&w.slot.to_le_bytes());
            out.extend_from_slice(&w.episode.to_le_bytes());
            out.extend_from_slice(&w.start.to_le_bytes());
            out.extend_from_slice(&w.len.to_le_bytes());
            out.extend_from_slice(&w.times_sampled.to_le_bytes());
            out.extend_from_slice(&w.priority.to_le_bytes());
        }
        count(&mut out, self.streams.len());
        for s in &self.streams {
            out.extend_from_slice(&s.id.to_le_bytes());
            out.extend_from_slice(&s.chunk.to_le_bytes());
            out.push(u8::from(s.in_episode));
            out.extend_from_slice(&s.episode.to_le_bytes());
            out.extend_from_slice(&s.count.to_le_bytes());
            out.extend_from_slice(&s.retained_from.to_le_bytes());
            out.extend_from_slice(&s.next_start.to_le_bytes());
        }
        count(&mut out, self.episodes.len());
        for e in &self.episodes {
            out.extend_from_slice(&e.id.to_le_bytes());
            out.extend_from_slice(&e.stream.to_le_bytes());
            out.push(e.end.code());
            out.push(u8::from(e.open));
            out.extend_from_slice(&e.len.to_le_bytes());
        }
        count(&mut out, self.queued.len());
        for (priority, step) in &self.queued {
            out.extend_from_slice(&priority.to_le_bytes());
            out.extend_from_slice(&step.stream.to_le_bytes());
            out.push(step.end.code());
        }
        out
    }

    /// Parses [`SequenceSnapshot::encode`]'s bytes. Only the format is checked here; what the
    /// values must satisfy is checked by [`SequenceTable::restore`].
    ///
    /// # Errors
    /// [`EchoError::Config`] saying what is wrong: the magic, a truncated field, a count
    /// larger than the bytes left, an unknown flag, bytes after the end.
    ///
    /// [`SequenceTable::restore`]: crate::replay::SequenceTable::restore
    pub fn decode(bytes: &[u8]) -> Result<Self, EchoError> {
        let mut r = Reader(bytes);
        if r.take(8, "the magic")? != MAGIC {
            return Err(bad("not a sequence table snapshot (wrong magic)".into()));
        }
        let (chunk_length, chunks_total, length, period) =
            (r.u64("chunk_length")?, r.u64("chunks")?, r.u64("length")?, r.u64("period")?);
        let at_end = r.u8("at_end")?;
        let (inserts, samples) = (r.u64("inserts")?, r.u64("samples")?);
        let rng = [r.u64("rng")?, r.u64("rng")?, r.u64("rng")?, r.u64("rng")?];
        let next_episode = r.u64("next_episode")?;
        let max_priority = f64::from_bits(r.u64("max_priority")?);
        let mut counters = [0u64; 12];
        for c in &mut counters {
            *c = r.u64("counters")?;
        }
        let n = r.count(4, "generations")?;
        let generations = (0..n).map(|_| r.u32("generations")).collect::<Result<_, _>>()?;
        let n = r.count(4, "free chunks")?;
        let free = (0..n).map(|_| r.u32("free chunks")).collect::<Result<_, _>>()?;
        let n = r.count(33, "chunks")?;
        let chunks = (0..n)
            .map(|_| {
                Ok(ChunkRow {
                    index: r.u32("chunk")?,
                    filled: r.u32("chunk")?,
                    next: r.u32("chunk")?,
                    stream: r.u64("chunk")?,
                    last_episode: r.u64("chunk")?,
                    last_index: r.u32("chunk")?,
                    has_priorities: r.flag("chunk")?,
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(8, "step priorities")?;
        let step_priority = (0..n).map(|_| r.u64("step priorities")).collect::<Result<_, _>>()?;
        let n = r.count(32, "windows")?;
        let windows = (0..n)
            .map(|_| {
                Ok(WindowRow {
                    slot: r.u32("window")?,
                    episode: r.u64("window")?,
                    start: r.u32("window")?,
                    len: r.u32("window")?,
                    times_sampled: r.u32("window")?,
                    priority: f64::from_bits(r.u64("window")?),
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(33, "streams")?;
        let streams = (0..n)
            .map(|_| {
                Ok(StreamRow {
                    id: r.u64("stream")?,
                    chunk: r.u32("stream")?,
                    in_episode: r.flag("stream")?,
                    episode: r.u64("stream")?,
                    count: r.u32("stream")?,
                    retained_from: r.u32("stream")?,
                    next_start: r.u32("stream")?,
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(22, "episodes")?;
        let episodes = (0..n)
            .map(|_| {
                Ok(EpisodeRow {
                    id: r.u64("episode")?,
                    stream: r.u64("episode")?,
                    end: r.end("episode")?,
                    open: r.flag("episode")?,
                    len: r.u32("episode")?,
                })
            })
            .collect::<Result<_, EchoError>>()?;
        let n = r.count(17, "queued steps")?;
        let queued = (0..n)
            .map(|_| {
                let priority = f64::from_bits(r.u64("queued step")?);
                let stream = r.u64("queued step")?;
                Ok((priority, StepTag { stream, end: r.end("queued step")? }))
            })
            .collect::<Result<_, EchoError>>()?;
        if !r.0.is_empty() {
            return Err(bad(format!("{} bytes after the end", r.0.len())));
        }
        Ok(Self {
            chunk_length,
            chunks_total,
            length,
            period,
            at_end,
            inserts,
            samples,
            rng,
            next_episode,
            max_priority,
            counters,
            generations,
            free,
            chunks,
            step_priority,
            windows,
            streams,
            episodes,
            queued,
        })
    }
}

fn bad(msg: String) -> EchoError {
    EchoError::Config(format!("restore: sequence table snapshot: {msg}"))
}

/// A cursor over the blob; every read says which field ran out.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], EchoError> {
        if self.0.len() < n {
            return Err(bad(format!("truncated in {what}")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, EchoError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, EchoError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, EchoError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn flag(&mut self, what: &str) -> Result<bool, EchoError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(bad(format!("{what}: a flag is 0 or 1, got {other}"))),
        }
    }
    fn end(&mut self, what: &str) -> Result<EpisodeEnd, EchoError> {
        let code = self.u8(what)?;
        EpisodeEnd::from_code(code)
            .ok_or_else(|| bad(format!("{what}: an episode flag is 0, 1 or 2, got {code}")))
    }
    /// A count of records of `size` bytes each, at most what the bytes left can hold.
    fn count(&mut self, size: usize, what: &str) -> Result<usize, EchoError> {
        let n = self.u64(what)?;
        let most = (self.0.len() / size) as u64;
        if n > most {
            return Err(bad(format!("{what}: {n} records, the bytes left hold {most}")));
        }
        Ok(n as usize)
    }
}
