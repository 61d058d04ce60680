//! A sample's layout as wire v2 describes it: each leaf's name, numpy dtype and shape, encoded
//! into the hello and decoded defensively (counts capped before anything is allocated), and
//! compared leaf by leaf with the server's so that a mismatch names the leaf.

use super::reader::{count, Cursor};
use crate::error::EchoError;
use crate::spec::{ArraySpec, DataSpec};

/// A numpy dtype as the wire describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DType {
    /// `b'<'`, `b'>'` or `b'|'` (not applicable).
    pub order: u8,
    /// numpy's kind character (`b'f'`, `b'i'`, `b'u'`, `b'b'`, `b'c'`, `b'V'`, ...).
    pub kind: u8,
    /// Bytes per element.
    pub size: u32,
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match (self.kind, self.size) {
            (b'b', 1) => return write!(f, "bool"),
            (b'f', n) => format!("float{}", n * 8),
            (b'i', n) => format!("int{}", n * 8),
            (b'u', n) => format!("uint{}", n * 8),
            (b'c', n) => format!("complex{}", n * 8),
            (kind, n) => format!("{}{n}", char::from(kind)),
        };
        match self.order {
            b'>' => write!(f, "{name} (big-endian)"),
            _ => write!(f, "{name}"),
        }
    }
}

/// One leaf: its path name, dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafType {
    /// The leaf's path in the pytree, e.g. `['obs']['pixels']`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
}

impl LeafType {
    /// The version leaf a server that keeps policy versions stores after the sample's
    /// (`crate::versions`): a little-endian `uint64` scalar.
    pub fn policy_version() -> Self {
        Self {
            name: crate::versions::VERSION_LEAF_NAME.to_owned(),
            dtype: DType { order: b'<', kind: b'u', size: crate::versions::VERSION_BYTES as u32 },
            shape: Vec::new(),
        }
    }
}

/// A sample layout with dtypes and names, as v2 checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout(pub Vec<LeafType>);

impl Layout {
    /// The layout of `spec` when nothing more is known (Rust callers): leaves named by index,
    /// of raw-byte kind `b'V'`.
    pub fn untyped(spec: &DataSpec) -> Self {
        Self(
            spec.arrays()
                .iter()
                .enumerate()
                .map(|(i, a)| LeafType {
                    name: i.to_string(),
                    dtype: DType {
                        order: b'|',
                        kind: b'V',
                        size: u32::try_from(a.dtype_size()).unwrap_or(u32::MAX),
                    },
                    shape: a.shape().to_vec(),
                })
                .collect(),
        )
    }

    /// This layout without its last leaf.
    #[must_use]
    pub fn without_last(mut self) -> Self {
        self.0.pop();
        self
    }

    /// This layout with the policy version leaf after its leaves: what a client that sends
    /// versions sends.
    #[must_use]
    pub fn with_policy_version(&self) -> Self {
        let mut leaves = self.0.clone();
        leaves.push(LeafType::policy_version());
        Self(leaves)
    }

    /// The byte layout this describes.
    ///
    /// # Errors
    /// [`EchoError::Config`] if a size overflows or there is no data.
    pub fn spec(&self) -> Result<DataSpec, EchoError> {
        let arrays = self
            .0
            .iter()
            .map(|l| ArraySpec::new(l.shape.clone(), l.dtype.size as usize))
            .collect::<Result<Vec<_>, _>>()?;
        DataSpec::new(arrays)
    }

    /// Why `client` (a client's layout) is not this (the server's) one; `None` if it is.
    pub fn mismatch(&self, client: &Layout) -> Option<String> {
        if self.0.len() != client.0.len() {
            return Some(format!(
                "the server stores samples of {} leaves, the client sends {}",
                self.0.len(),
                client.0.len()
            ));
        }
        for (i, (ours, theirs)) in self.0.iter().zip(&client.0).enumerate() {
            if ours.name != theirs.name {
                return Some(format!(
                    "leaf {i}: the server expects leaf {}, the client sends leaf {}",
                    ours.name, theirs.name
                ));
            }
            if ours.dtype != theirs.dtype || ours.shape != theirs.shape {
                return Some(format!(
                    "leaf {}: the server expects {} {}, the client has {} {}",
                    ours.name,
                    ours.dtype,
                    self.shape_words(i),
                    theirs.dtype,
                    client.shape_words(i)
                ));
            }
        }
        None
    }

    /// Leaf `i`'s shape in words: `of shape (2, 3)`, or for a ragged leaf (see
    /// [`crate::ragged::wire::ragged_dims`]) its rows, `max_len` and length group.
    fn shape_words(&self, i: usize) -> String {
        match self.0[i].shape.as_slice() {
            [crate::ragged::wire::RAGGED_DIM, max_len, first, inner @ ..] => {
                let members: Vec<&str> = self
                    .0
                    .iter()
                    .filter(|leaf| {
                        matches!(leaf.shape.as_slice(),
                            [crate::ragged::wire::RAGGED_DIM, _, f, ..] if f == first)
                    })
                    .map(|leaf| leaf.name.as_str())
                    .collect();
                let group = match members.as_slice() {
                    [_] | [] => "alone in its length group".to_owned(),
                    all => format!("in one length group with {}", all.join(", ")),
                };
                format!("rows of shape {}, 0 to {max_len} a sample, {group}", shape_text(inner))
            }
            shape => format!("of shape {}", shape_text(shape)),
        }
    }

    pub(super) fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EchoError> {
        out.extend_from_slice(&count(self.0.len(), "leaf count")?.to_le_bytes());
        for leaf in &self.0 {
            let name = u16::try_from(leaf.name.len()).map_err(|_| {
                EchoError::Config(format!("leaf name {:?} is over 65535 bytes", leaf.name))
            })?;
            out.extend_from_slice(&name.to_le_bytes());
            out.extend_from_slice(leaf.name.as_bytes());
            out.push(leaf.dtype.order);
            out.push(leaf.dtype.kind);
            out.extend_from_slice(&leaf.dtype.size.to_le_bytes());
            out.extend_from_slice(&count(leaf.shape.len(), "dimension count")?.to_le_bytes());
            for &dim in &leaf.shape {
                out.extend_from_slice(&count(dim, "dimension")?.to_le_bytes());
            }
        }
        Ok(())
    }

    pub(super) fn decode(reader: &mut Cursor<'_>) -> Result<Self, EchoError> {
        let n = reader.u32()?;
        if n > super::MAX_ARRAYS {
            return Err(EchoError::Protocol(format!(
                "hello announces {n} leaves, more than the {} allowed",
                super::MAX_ARRAYS
            )));
        }
        let mut leaves = Vec::with_capacity((n as usize).min(64));
        for index in 0..n {
            let name_len = usize::from(reader.u16()?);
            let name = String::from_utf8(reader.take(name_len)?.to_vec())
                .map_err(|_| EchoError::Protocol(format!("leaf {index}: the name is not UTF-8")))?;
            let order = reader.u8()?;
            let kind = reader.u8()?;
            let size = reader.u32()?;
            let ndim = reader.u32()?;
            if ndim > super::MAX_DIMS {
                return Err(EchoError::Protocol(format!(
                    "leaf {name}: {ndim} dimensions, more than the {} allowed",
                    super::MAX_DIMS
                )));
            }
            let shape =
                (0..ndim).map(|_| reader.u32().map(|d| d as usize)).collect::<Result<_, _>>()?;
            leaves.push(LeafType { name, dtype: DType { order, kind, size }, shape });
        }
        Ok(Self(leaves))
    }

    /// Bytes of this layout in a hello.
    pub(super) fn encoded_len(&self) -> usize {
        4 + self
            .0
            .iter()
            .map(|l| 2 + l.name.len() + 1 + 1 + 4 + 4 + 4 * l.shape.len())
            .sum::<usize>()
    }
}

fn shape_text(shape: &[usize]) -> String {
    match shape {
        [one] => format!("({one},)"),
        dims => format!("({})", dims.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    }
}
