//! How samples are handed to a backend: [`SampleSource`] is `n` samples, each a list of byte
//! slices (one per leaf); [`Leaves`] is one sample given leaf by leaf (in-process `submit`),
//! [`Payloads`] samples as concatenated wire payloads (the ingress). Both backends, the FIFO
//! [`Store`](crate::store::Store) and a replay [`Table`](crate::replay::Table), take any
//! source, through [`Backend::insert`](crate::backend::Backend::insert) where the caller does
//! not know which backend it feeds (the ingress, every transport).

use crate::error::EchoError;
use crate::spec::DataSpec;

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
    /// Called by the backend each time `count` more samples of this source (the next ones, in
    /// order) are in: committed and visible to the consumer. Lets a caller count inserts as
    /// they happen, also while the rest of the source still waits for room. Default: nothing.
    fn inserted(&self, count: usize) {
        let _ = count;
    }
}

/// One sample given leaf by leaf (the in-process `submit` path).
#[derive(Debug, Clone, Copy)]
pub struct Leaves<'a>(pub &'a [&'a [u8]]);

impl SampleSource for Leaves<'_> {
    fn num_samples(&self) -> usize {
        1
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.0.len()
    }
    fn leaf(&self, _sample: usize, leaf: usize) -> &[u8] {
        self.0[leaf]
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

impl<P: AsRef<[u8]>> SampleSource for Payloads<'_, P> {
    fn num_samples(&self) -> usize {
        self.payloads.len()
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.spec.len()
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        &self.payloads[sample].as_ref()[self.spec.leaf_range(leaf)]
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
            let got = src.leaf(sample, leaf).len();
            if got != array.num_bytes() {
                return Err(EchoError::SizeMismatch { leaf, expected: array.num_bytes(), got });
            }
        }
    }
    Ok(())
}
