//! What one sample looks like to the core: an ordered list of arrays, each a shape and an
//! element size in bytes. The core never learns what the elements mean (dtypes, pytrees):
//! that is the Python layer's business. All sizes are computed with overflow checks, so a
//! hostile or mistaken spec is a [`EchoError::Config`], never a wrapped-around allocation.

use crate::error::EchoError;

/// The layout of one leaf of a sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArraySpec {
    shape: Vec<usize>,
    dtype_size: usize,
    /// `product(shape) * dtype_size`, checked for overflow at construction.
    num_bytes: usize,
}

impl ArraySpec {
    /// A leaf of `shape` whose elements are `dtype_size` bytes each.
    ///
    /// # Errors
    /// [`EchoError::Config`] if `dtype_size` is zero or the byte size overflows `usize`.
    pub fn new(shape: Vec<usize>, dtype_size: usize) -> Result<Self, EchoError> {
        if dtype_size == 0 {
            return Err(EchoError::Config("dtype size must be at least 1 byte, got 0".into()));
        }
        let num_bytes = shape
            .iter()
            .try_fold(dtype_size, |acc, &dim| acc.checked_mul(dim))
            .ok_or_else(|| {
                EchoError::Config(format!(
                    "array of shape {shape:?} with {dtype_size}-byte elements overflows usize"
                ))
            })?;
        Ok(Self { shape, dtype_size, num_bytes })
    }

    /// The leaf's shape (without the batch dimension).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Bytes per element.
    pub fn dtype_size(&self) -> usize {
        self.dtype_size
    }

    /// Bytes of one sample of this leaf.
    pub fn num_bytes(&self) -> usize {
        self.num_bytes
    }
}

/// The layout of a whole sample: its leaves in flattened order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataSpec {
    arrays: Vec<ArraySpec>,
    /// Byte offset of each leaf inside a concatenated payload; `offsets[i] + arrays[i].num_bytes`.
    offsets: Vec<usize>,
    payload_size: usize,
}

impl DataSpec {
    /// A sample made of `arrays`, in that order.
    ///
    /// # Errors
    /// [`EchoError::Config`] if there are no arrays, if they hold no bytes at all, or if the
    /// payload size overflows.
    pub fn new(arrays: Vec<ArraySpec>) -> Result<Self, EchoError> {
        if arrays.is_empty() {
            return Err(EchoError::Config("a sample needs at least one array, got none".into()));
        }
        let mut offsets = Vec::with_capacity(arrays.len());
        let mut payload_size = 0usize;
        for array in &arrays {
            offsets.push(payload_size);
            payload_size = payload_size.checked_add(array.num_bytes).ok_or_else(|| {
                EchoError::Config("the sample's total byte size overflows usize".into())
            })?;
        }
        if payload_size == 0 {
            return Err(EchoError::Config(
                "every array in the sample is empty (0 bytes in total); nothing to store".into(),
            ));
        }
        Ok(Self { arrays, offsets, payload_size })
    }

    /// The leaves in flattened order.
    pub fn arrays(&self) -> &[ArraySpec] {
        &self.arrays
    }

    /// Number of leaves.
    pub fn len(&self) -> usize {
        self.arrays.len()
    }

    /// Always false: a spec has at least one leaf.
    pub fn is_empty(&self) -> bool {
        self.arrays.is_empty()
    }

    /// Bytes of one sample with every leaf concatenated (the wire payload).
    pub fn payload_size(&self) -> usize {
        self.payload_size
    }

    /// Byte range of leaf `leaf` inside a concatenated payload.
    pub fn leaf_range(&self, leaf: usize) -> std::ops::Range<usize> {
        let start = self.offsets[leaf];
        start..start + self.arrays[leaf].num_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_products_of_shape_and_dtype() {
        let spec = DataSpec::new(vec![
            ArraySpec::new(vec![4], 4).unwrap(),
            ArraySpec::new(vec![], 8).unwrap(),
            ArraySpec::new(vec![2, 3], 2).unwrap(),
        ])
        .unwrap();
        assert_eq!(spec.payload_size(), 16 + 8 + 12);
        assert_eq!(spec.leaf_range(0), 0..16);
        assert_eq!(spec.leaf_range(1), 16..24);
        assert_eq!(spec.leaf_range(2), 24..36);
    }

    #[test]
    fn overflowing_shape_is_a_config_error() {
        let err = ArraySpec::new(vec![usize::MAX, 2], 1).unwrap_err();
        assert!(matches!(err, EchoError::Config(msg) if msg.contains("overflows")));
        let big = ArraySpec::new(vec![usize::MAX / 2 + 1], 1).unwrap();
        let err = DataSpec::new(vec![big.clone(), big]).unwrap_err();
        assert!(matches!(err, EchoError::Config(msg) if msg.contains("overflows")));
    }

    #[test]
    fn empty_specs_are_rejected() {
        assert!(matches!(DataSpec::new(vec![]), Err(EchoError::Config(_))));
        let empty = ArraySpec::new(vec![0, 3], 4).unwrap();
        assert_eq!(empty.num_bytes(), 0);
        assert!(matches!(DataSpec::new(vec![empty.clone()]), Err(EchoError::Config(_))));
        // An empty leaf next to a non-empty one is fine.
        let spec = DataSpec::new(vec![empty, ArraySpec::new(vec![1], 1).unwrap()]).unwrap();
        assert_eq!(spec.payload_size(), 1);
        assert!(matches!(ArraySpec::new(vec![1], 0), Err(EchoError::Config(_))));
    }
}
