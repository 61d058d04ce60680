//! Ragged samples on wire v2. The handshake is v2's (offer, hello, reply); a ragged leaf's
//! shape in the hello's layout is `[RAGGED_DIM, *inner_shape]`, so a client whose leaves are
//! not ragged the same way is refused, naming the leaf. Samples then travel in group frames:
//!
//! ```text
//! client -> server:  0x18 n: u16 | rows | body
//!                  | 0x19 n: u16 | priority: f64 | rows | body
//!   rows:            for each of the n samples, for each ragged leaf (in leaf order): u32
//!   body:            for each sample, each leaf's bytes in leaf order (fixed leaves whole,
//!                    ragged leaves `rows * row_bytes`), C-contiguous
//!                  | 0x20 (heartbeat) | 0x30 (bye)
//! server -> client:  0x01 per sample once its group is stored | 0x03 msg_len: u32 | msg
//!                    (error; the server then closes) | 0x04 reason: u8 (closing)
//! ```
//!
//! A frame of n > 1 samples is a group: stored atomically, handed out whole. Every count and
//! length is checked against the server's spec (`max_len`, length groups, the batch's size)
//! by [`decode_head`] before the body is read or anything is allocated for it, so a hostile
//! peer can make the server hold at most one valid frame.

use super::spec::RaggedSpec;
use crate::error::EchoError;
use crate::transport::wire::v2;

/// Client frame: a sample, or a group of samples, of a ragged server.
pub const GROUP: u8 = 0x18;
/// Client frame: the same with the group's priority (f64) after the count.
pub const GROUP_PRIORITY: u8 = 0x19;
/// The first dimension of a ragged leaf in a hello's layout.
pub const RAGGED_DIM: usize = u32::MAX as usize;

/// A group frame's header.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    /// Samples in the group (at least 1).
    pub samples: usize,
    /// The group's priority, if it has one.
    pub priority: Option<f64>,
    /// Rows per sample per leaf (fixed leaves: 1), sample-major.
    pub rows: Vec<usize>,
    /// Bytes of the body that follows.
    pub body_len: usize,
}

/// Bytes of a group frame's header after its kind byte, for `n` samples of `spec`.
pub fn head_len(spec: &RaggedSpec, kind: u8, n: usize) -> usize {
    let ragged = spec.columns().iter().filter(|c| c.is_ragged()).count();
    2 + if kind == GROUP_PRIORITY { 8 } else { 0 } + 4 * ragged * n
}

/// Decodes the header of a group frame of `kind` from `bytes` (what follows the kind byte,
/// as much as has arrived): `Ok(None)` until all of it is there, else the header and its
/// length. `max_samples` caps the group (the server's batch size).
///
/// # Errors
/// [`EchoError::Protocol`] for an unknown kind, a group of 0 or more than `max_samples`
/// samples, or a priority that is not a finite number `>= 0`; [`EchoError::Sample`] for a
/// ragged leaf longer than its `max_len` or unequal lengths within a length group.
pub fn decode_head(
    spec: &RaggedSpec,
    max_samples: usize,
    kind: u8,
    bytes: &[u8],
) -> Result<Option<(Head, usize)>, EchoError> {
    if kind != GROUP && kind != GROUP_PRIORITY {
        return Err(EchoError::Protocol(format!("unknown frame type {kind:#04x}")));
    }
    let Some(count) = bytes.get(..2) else { return Ok(None) };
    let samples = usize::from(u16::from_le_bytes([count[0], count[1]]));
    if samples == 0 || samples > max_samples {
        return Err(EchoError::Protocol(format!(
            "a group frame of {samples} samples; this server takes 1 to {max_samples} (its \
             batch size)"
        )));
    }
    let len = head_len(spec, kind, samples);
    let Some(head) = bytes.get(..len) else { return Ok(None) };
    let mut at = 2;
    let priority = if kind == GROUP_PRIORITY {
        let p = f64::from_le_bytes(head[2..10].try_into().expect("8 bytes"));
        if !p.is_finite() || p < 0.0 {
            return Err(EchoError::Protocol(format!(
                "a priority must be finite and >= 0, got {p}"
            )));
        }
        at = 10;
        Some(p)
    } else {
        None
    };
    let columns = spec.columns();
    let mut rows = Vec::with_capacity(samples * columns.len());
    let mut body_len = 0usize;
    for _ in 0..samples {
        let start = rows.len();
        for column in columns {
            let n = if column.is_ragged() {
                let n = u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
                at += 4;
                n as usize
            } else {
                1
            };
            rows.push(n);
        }
        // Lengths and groups, before any size is computed from them.
        let sample = &rows[start..];
        spec.check_with(|i| sample[i], |i| columns[i].row_bytes().saturating_mul(sample[i]))?;
        // Checked: each leaf's rows are within its max_len, so no product overflows.
        body_len += columns.iter().zip(sample).map(|(c, &n)| c.row_bytes() * n).sum::<usize>();
    }
    Ok(Some((Head { samples, priority, rows, body_len }, len)))
}

/// What lies at the front of a stream read in place (a worker's shared-memory pipe), as a
/// pump sees it without consuming anything: [`peek_frame`].
#[derive(Debug, Clone, PartialEq)]
pub enum Peeked {
    /// Nothing, or part of a frame: look again once more bytes are there.
    Partial,
    /// A heartbeat byte, to skip.
    Heartbeat,
    /// A whole group frame: its header, the header's bytes after the kind byte, and the
    /// frame's bytes in all (kind byte, header and body).
    Whole {
        /// The decoded header.
        head: Head,
        /// Bytes of the header after the kind byte.
        head_bytes: usize,
        /// Bytes of the whole frame.
        total: usize,
    },
    /// What a pump leaves to the blocking reader, which handles (and reports) it: another
    /// kind of byte (a goodbye, or one it refuses), a header it refuses, or a frame of more
    /// than the stream's `limit` bytes (which streams through).
    Elsewhere,
}

/// Looks at the front of a stream of which `ready` bytes are there, read by `copy_ahead(at,
/// out)` (`out.len()` bytes from `at`, never past `ready`), without consuming anything: a
/// pump's view of a shared-memory pipe of `limit` bytes. `head` is scratch space (reused,
/// so a pump allocates no header buffer per frame).
///
/// A header is checked by [`decode_head`] itself, and only once all of it is there; its
/// sample count is checked before the header's size is computed from it, so no peer-chosen
/// size is allocated or read beyond `limit`.
pub fn peek_frame(
    spec: &RaggedSpec,
    max_samples: usize,
    ready: usize,
    limit: usize,
    head: &mut Vec<u8>,
    copy_ahead: impl Fn(usize, &mut [u8]),
) -> Peeked {
    if ready == 0 {
        return Peeked::Partial;
    }
    let mut kind = [0u8; 1];
    copy_ahead(0, &mut kind);
    match kind[0] {
        v2::HEARTBEAT => return Peeked::Heartbeat,
        GROUP | GROUP_PRIORITY => {}
        _ => return Peeked::Elsewhere,
    }
    if ready < 3 {
        return Peeked::Partial;
    }
    head.resize(2, 0);
    copy_ahead(1, head);
    let n = usize::from(u16::from_le_bytes([head[0], head[1]]));
    if n == 0 || n > max_samples {
        return Peeked::Elsewhere; // the reader refuses it, saying why
    }
    let head_bytes = head_len(spec, kind[0], n);
    if 1 + head_bytes > limit {
        return Peeked::Elsewhere;
    }
    if ready < 1 + head_bytes {
        return Peeked::Partial;
    }
    head.resize(head_bytes, 0);
    copy_ahead(1, head);
    let Ok(Some((frame, _))) = decode_head(spec, max_samples, kind[0], head) else {
        return Peeked::Elsewhere; // refused: the reader refuses it again
    };
    let total = 1 + head_bytes + frame.body_len;
    if total > limit {
        Peeked::Elsewhere
    } else if ready < total {
        Peeked::Partial // the worker is still writing it
    } else {
        Peeked::Whole { head: frame, head_bytes, total }
    }
}

/// One sample to encode: each leaf's rows and bytes, in leaf order.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    /// Rows per leaf (fixed leaves: ignored).
    pub rows: &'a [usize],
    /// Bytes per leaf.
    pub leaves: &'a [&'a [u8]],
}

/// The header of a group frame (kind byte included) for `samples` of `spec`; the body is
/// each sample's leaves in order, which the caller writes after it.
///
/// # Errors
/// [`EchoError::Sample`] for an empty group, more than 65,535 samples, or a leaf with more
/// than `u32::MAX` rows.
pub fn encode_head(
    spec: &RaggedSpec,
    samples: &[Outgoing<'_>],
    priority: Option<f64>,
) -> Result<Vec<u8>, EchoError> {
    let n = u16::try_from(samples.len()).ok().filter(|&n| n > 0).ok_or_else(|| {
        EchoError::Sample(format!("a group frame holds 1 to 65535 samples, got {}", samples.len()))
    })?;
    let kind = if priority.is_some() { GROUP_PRIORITY } else { GROUP };
    let mut out = Vec::with_capacity(1 + head_len(spec, kind, samples.len()));
    out.push(kind);
    out.extend_from_slice(&n.to_le_bytes());
    if let Some(p) = priority {
        out.extend_from_slice(&p.to_le_bytes());
    }
    for sample in samples {
        for (column, &rows) in spec.columns().iter().zip(sample.rows) {
            if column.is_ragged() {
                let rows = u32::try_from(rows).map_err(|_| {
                    EchoError::Sample(format!(
                        "leaf {}: {rows} rows do not fit a u32",
                        column.name()
                    ))
                })?;
                out.extend_from_slice(&rows.to_le_bytes());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ragged::{LeafDecl, RaggedDecl};
    use crate::spec::ArraySpec;

    fn spec() -> RaggedSpec {
        RaggedSpec::new(vec![
            LeafDecl {
                name: "['tokens']".into(),
                array: ArraySpec::new(vec![], 4).unwrap(),
                ragged: Some(RaggedDecl { max_len: 100, group: Some("c".into()) }),
            },
            LeafDecl {
                name: "['logp']".into(),
                array: ArraySpec::new(vec![], 4).unwrap(),
                ragged: Some(RaggedDecl { max_len: 100, group: Some("c".into()) }),
            },
            LeafDecl {
                name: "['r']".into(),
                array: ArraySpec::new(vec![2], 4).unwrap(),
                ragged: None,
            },
        ])
        .unwrap()
    }

    #[test]
    fn a_head_round_trips_and_sizes_its_body() {
        let spec = spec();
        let a: [&[u8]; 3] = [&[0; 12], &[0; 12], &[0; 8]];
        let b: [&[u8]; 3] = [&[], &[], &[0; 8]];
        let samples =
            [Outgoing { rows: &[3, 3, 1], leaves: &a }, Outgoing { rows: &[0, 0, 1], leaves: &b }];
        let head = encode_head(&spec, &samples, Some(2.5)).unwrap();
        assert_eq!(head[0], GROUP_PRIORITY);
        // Byte by byte it is incomplete, then whole.
        for cut in 0..head.len() - 1 {
            assert_eq!(decode_head(&spec, 8, head[0], &head[1..1 + cut]).unwrap(), None);
        }
        let (got, used) = decode_head(&spec, 8, head[0], &head[1..]).unwrap().unwrap();
        assert_eq!(used, head.len() - 1);
        assert_eq!(got.samples, 2);
        assert_eq!(got.priority, Some(2.5));
        assert_eq!(got.rows, vec![3, 3, 1, 0, 0, 1]);
        assert_eq!(got.body_len, 12 + 12 + 8 + 8);
    }

    #[test]
    fn hostile_heads_are_refused_before_anything_is_sized() {
        let spec = spec();
        let frame = |n: u16, rows: &[u32]| {
            let mut out = n.to_le_bytes().to_vec();
            for r in rows {
                out.extend_from_slice(&r.to_le_bytes());
            }
            out
        };
        assert!(matches!(
            decode_head(&spec, 8, GROUP, &frame(0, &[])),
            Err(EchoError::Protocol(_))
        ));
        assert!(matches!(
            decode_head(&spec, 8, GROUP, &frame(9, &[])),
            Err(EchoError::Protocol(_))
        ));
        let err = decode_head(&spec, 8, GROUP, &frame(1, &[u32::MAX, u32::MAX])).unwrap_err();
        assert!(err.to_string().contains("more than its max_len 100"), "{err}");
        let err = decode_head(&spec, 8, GROUP, &frame(1, &[3, 4])).unwrap_err();
        assert!(err.to_string().contains("has 3 rows but leaf ['logp'] has 4"), "{err}");
        let mut bad = 1u16.to_le_bytes().to_vec();
        bad.extend_from_slice(&f64::NAN.to_le_bytes());
        bad.extend_from_slice(&[0; 8]);
        assert!(matches!(decode_head(&spec, 8, GROUP_PRIORITY, &bad), Err(EchoError::Protocol(_))));
        assert!(matches!(decode_head(&spec, 8, 0x10, &bad), Err(EchoError::Protocol(_))));
    }
}
