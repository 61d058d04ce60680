//! How samples are handed to a backend: [`SampleSource`] is `n` samples, each a list of byte
//! slices (one per leaf); [`Leaves`] is one sample given leaf by leaf (in-process `submit`),
//! [`Payloads`] samples as concatenated wire payloads (the ingress). Both backends, the FIFO
//! [`Store`](crate::store::Store) and a replay [`Table`](crate::replay::Table), take any
//! source, through [`Backend::insert`](crate::backend::Backend::insert) where the caller does
//! not know which backend it feeds (the ingress, every transport).

use crate::error::EchoError;
use crate::spec::DataSpec;

/// How a step ends its episode (sequence tables; other backends ignore it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EpisodeEnd {
    /// The episode goes on.
    #[default]
    No,
    /// The step is the episode's last: the environment terminated it.
    Terminated,
    /// The step is the episode's last: it was cut short (a time limit, a worker gone).
    Truncated,
}

/// Which stream a step belongs to and whether it ends its episode ([`SampleSource::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepTag {
    /// The stream (one episode after another).
    pub stream: u64,
    /// Whether the step is its episode's last.
    pub end: EpisodeEnd,
}

/// Where samples come from: `num_samples` samples, each `num_leaves` byte slices.
pub trait SampleSource {
    /// Number of samples.
    fn num_samples(&self) -> usize;
    /// Number of leaves sample `sample` has.
    fn num_leaves(&self, sample: usize) -> usize;
    /// The bytes of leaf `leaf` of sample `sample`.
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8];
    /// The priority sample `sample` carries itself (wire v2 frames); `None`: the one the
    /// insert call gives. Default: `None`.
    fn priority(&self, sample: usize) -> Option<f64> {
        let _ = sample;
        None
    }
    /// Bytes of leaf `leaf` of sample `sample`. Default: the length of
    /// [`SampleSource::leaf`]; a source that overrides [`SampleSource::copy_leaf`] to avoid
    /// `leaf` overrides this too.
    fn leaf_len(&self, sample: usize, leaf: usize) -> usize {
        self.leaf(sample, leaf).len()
    }
    /// Copies leaf `leaf` of sample `sample` into `dst` (exactly [`SampleSource::leaf_len`]
    /// bytes, checked before): what the backends call to write a slot. Default: from
    /// [`SampleSource::leaf`]. A source whose bytes live in memory another process may write
    /// (a shared-memory ring) copies through raw pointers instead, so that no Rust reference
    /// to that memory is ever made.
    fn copy_leaf(&self, sample: usize, leaf: usize, dst: &mut [u8]) {
        dst.copy_from_slice(self.leaf(sample, leaf));
    }
    /// Called by the backend each time `count` more samples of this source (the next ones, in
    /// order) go in: the FIFO store calls it right before the commit that makes them visible
    /// to the consumer (so a checkpoint that sees the commit sees the count), a replay table
    /// once they are in. Lets a caller count inserts as
    /// they happen, also while the rest of the source still waits for room. Default: nothing.
    fn inserted(&self, count: usize) {
        let _ = count;
    }
    /// Sample `sample`'s compressed leaves as they arrived, packed as the backend's
    /// [`LeafCodecs`](crate::codec::LeafCodecs) packs them and checked to decompress to the
    /// leaves [`SampleSource::leaf`] gives: a replay table that stores those leaves compressed
    /// keeps these bytes instead of compressing again. Default: `None`.
    fn packed(&self, sample: usize) -> Option<&[u8]> {
        let _ = sample;
        None
    }
    /// The stream sample `sample` belongs to and whether it ends its episode, for a sequence
    /// table (other backends ignore it). Default: stream 0, the episode goes on.
    fn step(&self, sample: usize) -> StepTag {
        let _ = sample;
        StepTag::default()
    }

    /// This source as one whose leaves are plain memory that nothing else writes while the
    /// call that was given it runs, so any thread may read them, and read them in place
    /// through [`SampleSource::leaf`]: a replay table compresses a large insert's samples on
    /// several threads, and compression reads each leaf where it lies instead of copying it
    /// out first. Only its leaves are read through it. Default: `None`, the source is read
    /// from the calling thread only, through [`SampleSource::copy_leaf`].
    fn shared(&self) -> Option<&(dyn SampleSource + Sync)> {
        None
    }
}

/// One sample given leaf by leaf (the in-process `submit` path).
#[derive(Debug, Clone, Copy)]
pub struct Leaves<'a>(pub &'a [&'a [u8]]);

impl SampleSource for Leaves<'_> {
    fn num_samples(&self) -> usize {
        1
    }
    fn shared(&self) -> Option<&(dyn SampleSource + Sync)> {
        Some(self)
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.0.len()
    }
    fn leaf(&self, _sample: usize, leaf: usize) -> &[u8] {
        self.0[leaf]
    }
}

/// One step given leaf by leaf, with its stream and episode flag (in-process `submit` to a
/// sequence table).
#[derive(Debug, Clone, Copy)]
pub struct StepLeaves<'a>(pub &'a [&'a [u8]], pub StepTag);

impl SampleSource for StepLeaves<'_> {
    fn num_samples(&self) -> usize {
        1
    }
    fn shared(&self) -> Option<&(dyn SampleSource + Sync)> {
        Some(self)
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.0.len()
    }
    fn leaf(&self, _sample: usize, leaf: usize) -> &[u8] {
        self.0[leaf]
    }
    fn step(&self, _sample: usize) -> StepTag {
        self.1
    }
}

impl EpisodeEnd {
    /// The code the bindings and the wire use: 0 goes on, 1 terminated, 2 truncated.
    pub fn code(self) -> u8 {
        match self {
            Self::No => 0,
            Self::Terminated => 1,
            Self::Truncated => 2,
        }
    }

    /// From the code wire frames and sequence snapshots carry: 0 goes on, 1 terminated, 2
    /// truncated.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::No),
            1 => Some(Self::Terminated),
            2 => Some(Self::Truncated),
            _ => None,
        }
    }
}

/// Samples given as concatenated payloads (the wire format): each payload is every leaf's
/// bytes back to back, in spec order. `P` is anything holding bytes: `&[u8]` for borrowed
/// payloads, `Box<[u8]>` for the ingress's pooled buffers.
#[derive(Debug, Clone, Copy)]
pub struct Payloads<'a, P: AsRef<[u8]> = &'a [u8]> {
    spec: &'a DataSpec,
    payloads: &'a [P],
}

impl<'a, P: AsRef<[u8]>> Payloads<'a, P> {
    /// Checks that every payload is exactly `spec.payload_size()` bytes.
    ///
    /// # Errors
    /// [`EchoError::PayloadSize`] naming the size of the first payload that is wrong.
    pub fn new(spec: &'a DataSpec, payloads: &'a [P]) -> Result<Self, EchoError> {
        let expected = spec.payload_size();
        if let Some(bad) = payloads.iter().find(|p| p.as_ref().len() != expected) {
            return Err(EchoError::PayloadSize { expected, got: bad.as_ref().len() });
        }
        Ok(Self { spec, payloads })
    }
}

impl<P: AsRef<[u8]> + Sync> SampleSource for Payloads<'_, P> {
    fn num_samples(&self) -> usize {
        self.payloads.len()
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.spec.len()
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        &self.payloads[sample].as_ref()[self.spec.leaf_range(leaf)]
    }
    fn shared(&self) -> Option<&(dyn SampleSource + Sync)> {
        Some(self)
    }
}

/// Samples given as rows of batched leaves (`submit_batch`, `send_batch`): leaf `l` holds the
/// values of `n` samples back to back, so sample `i` is row `i` of every leaf; optionally with
/// a priority per row. [`Rows::skip`] continues after rows already inserted.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    spec: &'a DataSpec,
    leaves: &'a [&'a [u8]],
    first: usize,
    count: usize,
    priorities: Option<&'a [f64]>,
    /// Row `i` is stream `first_stream + i`, ending its episode as `ends[i]` says.
    first_stream: u64,
    ends: Option<&'a [EpisodeEnd]>,
}

impl<'a> Rows<'a> {
    /// `n` rows of every leaf in `leaves` (one slice per leaf of `spec`, `n` rows each).
    ///
    /// # Errors
    /// [`EchoError::LeafCount`] or [`EchoError::SizeMismatch`] if a leaf does not hold exactly
    /// `n` rows; [`EchoError::Priority`] if `priorities` is not one per row.
    pub fn new(
        spec: &'a DataSpec,
        leaves: &'a [&'a [u8]],
        n: usize,
        priorities: Option<&'a [f64]>,
    ) -> Result<Self, EchoError> {
        if leaves.len() != spec.len() {
            return Err(EchoError::LeafCount { expected: spec.len(), got: leaves.len() });
        }
        for (leaf, (bytes, array)) in leaves.iter().zip(spec.arrays()).enumerate() {
            let expected = array.num_bytes().checked_mul(n).ok_or_else(|| {
                EchoError::Config(format!("{n} rows of leaf {leaf} overflow the address space"))
            })?;
            if bytes.len() != expected {
                return Err(EchoError::SizeMismatch { leaf, expected, got: bytes.len() });
            }
        }
        if let Some(p) = priorities {
            if p.len() != n {
                return Err(EchoError::Priority(format!(
                    "one priority per row: expected {n}, got {}",
                    p.len()
                )));
            }
        }
        Ok(Self { spec, leaves, first: 0, count: n, priorities, first_stream: 0, ends: None })
    }

    /// The same rows as steps of a sequence table: row `i` is stream `first_stream + i`, and
    /// ends its episode as `ends[i]` says (`None`: none does).
    ///
    /// # Errors
    /// [`EchoError::Config`] if `ends` is not one per row or the stream ids overflow.
    pub fn with_steps(
        self,
        first_stream: u64,
        ends: Option<&'a [EpisodeEnd]>,
    ) -> Result<Self, EchoError> {
        if let Some(ends) = ends {
            if ends.len() != self.count {
                return Err(EchoError::Config(format!(
                    "one episode flag per row: expected {}, got {}",
                    self.count,
                    ends.len()
                )));
            }
        }
        if first_stream.checked_add(self.count as u64).is_none() {
            return Err(EchoError::Config(format!(
                "streams {first_stream} + {} rows overflow",
                self.count
            )));
        }
        Ok(Self { first_stream, ends, ..self })
    }

    /// The rows after the first `k`.
    #[must_use]
    pub fn skip(&self, k: usize) -> Self {
        let k = k.min(self.count);
        Self { first: self.first + k, count: self.count - k, ..*self }
    }

    /// The first `k` rows only.
    #[must_use]
    pub fn take(&self, k: usize) -> Self {
        Self { count: k.min(self.count), ..*self }
    }

    /// The priority row `i` carries, if any.
    pub fn row_priority(&self, i: usize) -> Option<f64> {
        self.priorities.map(|p| p[self.first + i])
    }

    /// Leaf `leaf` of row `i`.
    pub fn row_leaf(&self, i: usize, leaf: usize) -> &'a [u8] {
        let size = self.spec.arrays()[leaf].num_bytes();
        let at = (self.first + i) * size;
        &self.leaves[leaf][at..at + size]
    }
}

impl SampleSource for Rows<'_> {
    fn num_samples(&self) -> usize {
        self.count
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.spec.len()
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        self.row_leaf(sample, leaf)
    }
    fn priority(&self, sample: usize) -> Option<f64> {
        self.row_priority(sample)
    }
    fn shared(&self) -> Option<&(dyn SampleSource + Sync)> {
        Some(self)
    }
    fn step(&self, sample: usize) -> StepTag {
        let row = self.first + sample;
        StepTag {
            stream: self.first_stream + row as u64,
            end: self.ends.map_or(EpisodeEnd::No, |ends| ends[row]),
        }
    }
}

/// Checks every sample of `src` against `spec`: leaf count and each leaf's byte size.
///
/// # Errors
/// [`EchoError::LeafCount`] or [`EchoError::SizeMismatch`] for the first sample that is wrong.
pub(crate) fn validate_source<S: SampleSource + ?Sized>(
    spec: &DataSpec,
    src: &S,
) -> Result<(), EchoError> {
    for sample in 0..src.num_samples() {
        let got = src.num_leaves(sample);
        if got != spec.len() {
            return Err(EchoError::LeafCount { expected: spec.len(), got });
        }
        for (leaf, array) in spec.arrays().iter().enumerate() {
            let got = src.leaf_len(sample, leaf);
            if got != array.num_bytes() {
                return Err(EchoError::SizeMismatch { leaf, expected: array.num_bytes(), got });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ArraySpec;

    #[test]
    fn rows_are_samples_and_skip_continues() {
        let spec = DataSpec::new(vec![
            ArraySpec::new(vec![2], 1).unwrap(),
            ArraySpec::new(vec![], 4).unwrap(),
        ])
        .unwrap();
        let a = [1u8, 2, 3, 4, 5, 6];
        let b: Vec<u8> = [10u32, 20, 30].iter().flat_map(|v| v.to_le_bytes()).collect();
        let leaves = [&a[..], &b[..]];
        let prio = [0.5, 1.5, 2.5];
        let rows = Rows::new(&spec, &leaves, 3, Some(&prio)).unwrap();
        assert_eq!(
            (rows.num_samples(), rows.leaf(1, 0), rows.leaf(2, 1)),
            (3, &[3u8, 4][..], &30u32.to_le_bytes()[..])
        );
        let rest = rows.skip(2);
        assert_eq!(
            (rest.num_samples(), rest.leaf(0, 0), rest.priority(0)),
            (1, &[5u8, 6][..], Some(2.5))
        );
        validate_source(&spec, &rows).unwrap();
        assert!(matches!(
            Rows::new(&spec, &leaves, 2, None),
            Err(EchoError::SizeMismatch { leaf: 0, .. })
        ));
        assert!(matches!(
            Rows::new(&spec, &leaves, 3, Some(&prio[..2])),
            Err(EchoError::Priority(_))
        ));
    }
}
