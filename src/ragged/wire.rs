//! Ragged samples on wire v2. The handshake is v2's (offer, hello, reply); a ragged leaf's
//! shape in the hello's layout is [`ragged_dims`] (`[RAGGED_DIM, max_len, first leaf of its
//! length group, *inner_shape]`), so a client whose leaves are not ragged the same way is
//! refused, naming the leaf. Samples then travel in group frames:
//!
//! ```text
//! client -> server:  0x18 n: u16 | rows | body
//!                  | 0x19 n: u16 | priority: f64 | rows | body
//!                  | 0x1a n: u16 | rows+lens | packed body
//!                  | 0x1b n: u16 | priority: f64 | rows+lens | packed body
//!   rows:            for each of the n samples, for each ragged leaf (in leaf order): u32
//!   body:            for each sample, each leaf's bytes in leaf order (fixed leaves whole,
//!                    ragged leaves `rows * row_bytes`), C-contiguous
//!   rows+lens:       for each sample, its rows as above, then for each leaf the reply named
//!                    a codec for (in leaf order): u32, the bytes it takes compressed (0 for
//!                    a leaf of no bytes)
//!   packed body:     as body, with each such leaf compressed by its codec (one zstd frame
//!                    or LZ4 block of its bytes, as a table stores it)
//!                  | 0x20 (heartbeat) | 0x30 (bye)
//! server -> client:  0x01 per sample once its group is stored | 0x03 msg_len: u32 | msg
//!                    (error; the server then closes) | 0x04 reason: u8 (closing)
//! ```
//!
//! A frame of n > 1 samples is a group: stored atomically, handed out whole. Every count and
//! length is checked against the server's spec (`max_len`, length groups, the batch's size)
//! by [`decode_head`] before the body is read or anything is allocated for it, so a hostile
//! peer can make the server hold at most one valid frame. Compressed frames (0x1a, 0x1b) come
//! only over TCP after a reply that named codecs (the server's `compress=`); each compressed
//! length is capped by its codec's worst case for the leaf's raw bytes, and
//! [`unpack_body`] decompresses each leaf into exactly its raw size, so a bad body is refused
//! whole and nothing of it is stored.

use std::ops::Range;

use super::spec::RaggedSpec;
use crate::codec::Codec;
use crate::error::EchoError;
use crate::transport::wire::v2;

/// Client frame: a sample, or a group of samples, of a ragged server.
pub const GROUP: u8 = 0x18;
/// Client frame: the same with the group's priority (f64) after the count.
pub const GROUP_PRIORITY: u8 = 0x19;
/// Client frame: a group frame whose leaves with a codec come compressed (only after a
/// reply that named codecs).
pub const GROUP_PACKED: u8 = 0x1A;
/// The same with the group's priority (f64) after the count.
pub const GROUP_PACKED_PRIORITY: u8 = 0x1B;
/// The first dimension of a ragged leaf in a hello's layout.
pub const RAGGED_DIM: usize = u32::MAX as usize;

/// A ragged leaf's dimensions in a hello's layout: [`RAGGED_DIM`], its `max_len`, the index
/// of the first leaf of its length group (its own when it is alone in it), then its inner
/// shape. A client whose ragged leaves differ from the server's in any of these is refused
/// at the handshake, naming the leaf.
pub fn ragged_dims(max_len: usize, group_first: usize, inner: &[usize]) -> Vec<usize> {
    [RAGGED_DIM, max_len, group_first].into_iter().chain(inner.iter().copied()).collect()
}

/// A group frame's header.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    /// Samples in the group (at least 1).
    pub samples: usize,
    /// The group's priority, if it has one.
    pub priority: Option<f64>,
    /// Rows per sample per leaf (fixed leaves: 1), sample-major.
    pub rows: Vec<usize>,
    /// A compressed frame's bytes of each leaf with a codec, sample-major, in leaf order
    /// (empty for a frame that is not compressed).
    pub packed: Vec<usize>,
    /// Bytes of the body that follows.
    pub body_len: usize,
}

/// Whether `kind` is a compressed group frame's.
pub fn is_packed(kind: u8) -> bool {
    kind == GROUP_PACKED || kind == GROUP_PACKED_PRIORITY
}

/// Whether a group frame of `kind` carries a priority.
fn has_priority(kind: u8) -> bool {
    kind == GROUP_PRIORITY || kind == GROUP_PACKED_PRIORITY
}

/// The leaves with a codec among `codecs` (one per leaf, or none).
fn compressed_leaves(codecs: &[Option<Codec>]) -> usize {
    codecs.iter().filter(|c| c.is_some()).count()
}

/// Bytes of a group frame's header after its kind byte, for `n` samples of `spec`; a
/// compressed frame's lengths are those of `codecs`' leaves (the connection's codecs, one per
/// leaf; empty: none).
pub fn head_len(spec: &RaggedSpec, codecs: &[Option<Codec>], kind: u8, n: usize) -> usize {
    let ragged = spec.columns().iter().filter(|c| c.is_ragged()).count();
    let packed = if is_packed(kind) { compressed_leaves(codecs) } else { 0 };
    2 + if has_priority(kind) { 8 } else { 0 } + 4 * (ragged + packed) * n
}

/// Decodes the header of a group frame of `kind` from `bytes` (what follows the kind byte,
/// as much as has arrived): `Ok(None)` until all of it is there, else the header and its
/// length. `max_samples` caps the group (the server's batch size); `codecs` are the
/// connection's (one per leaf of `spec`; empty: none, and compressed frames are refused).
///
/// # Errors
/// [`EchoError::Protocol`] for an unknown kind, a compressed frame without codecs, a group of
/// 0 or more than `max_samples` samples, a priority that is not a finite number `>= 0`, or a
/// compressed length above its codec's worst case for the leaf (or not 0 for a leaf of no
/// bytes); [`EchoError::Sample`] for a ragged leaf longer than its `max_len` or unequal
/// lengths within a length group.
pub fn decode_head(
    spec: &RaggedSpec,
    codecs: &[Option<Codec>],
    max_samples: usize,
    kind: u8,
    bytes: &[u8],
) -> Result<Option<(Head, usize)>, EchoError> {
    let packed = is_packed(kind);
    if !packed && kind != GROUP && kind != GROUP_PRIORITY {
        return Err(EchoError::Protocol(format!("unknown frame type {kind:#04x}")));
    }
    if packed && compressed_leaves(codecs) == 0 {
        return Err(EchoError::Protocol(
            "a compressed group frame, but this connection agreed on no codecs".into(),
        ));
    }
    let Some(count) = bytes.get(..2) else { return Ok(None) };
    let samples = usize::from(u16::from_le_bytes([count[0], count[1]]));
    if samples == 0 || samples > max_samples {
        return Err(EchoError::Protocol(format!(
            "a group frame of {samples} samples; this server takes 1 to {max_samples} (its \
             batch size)"
        )));
    }
    let len = head_len(spec, codecs, kind, samples);
    let Some(head) = bytes.get(..len) else { return Ok(None) };
    let mut at = 2;
    let priority = if has_priority(kind) {
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
    let mut lens = Vec::with_capacity(if packed { samples * compressed_leaves(codecs) } else { 0 });
    let mut body_len = 0usize;
    let take = |at: &mut usize| {
        let n = u32::from_le_bytes(head[*at..*at + 4].try_into().expect("4 bytes"));
        *at += 4;
        n as usize
    };
    for _ in 0..samples {
        let start = rows.len();
        for column in columns {
            rows.push(if column.is_ragged() { take(&mut at) } else { 1 });
        }
        // Lengths and groups, before any size is computed from them.
        let sample = &rows[start..];
        spec.check_with(|i| sample[i], |i| columns[i].row_bytes().saturating_mul(sample[i]))?;
        // Checked: each leaf's rows are within its max_len, so no product overflows.
        for (c, (column, &n)) in columns.iter().zip(sample).enumerate() {
            let raw = column.row_bytes() * n;
            let codec = codecs.get(c).copied().flatten().filter(|_| packed);
            body_len += match codec {
                None => raw,
                Some(codec) => {
                    let len = take(&mut at);
                    let most = if raw == 0 { 0 } else { codec.bound(raw) };
                    if len > most || (raw > 0 && len == 0) {
                        return Err(EchoError::Protocol(format!(
                            "leaf {}: {len} compressed bytes for {raw} raw ones (a {} leaf \
                             of {raw} bytes takes 1 to {most})",
                            column.name(),
                            codec.name()
                        )));
                    }
                    lens.push(len);
                    len
                }
            };
        }
    }
    Ok(Some((Head { samples, priority, rows, packed: lens, body_len }, len)))
}

/// A compressed frame's `body` (of `head`, `codecs` the connection's) as a plain frame's
/// body in `raw` (cleared first): every leaf raw, in order, each compressed one decompressed
/// into exactly its size. Returns where each compressed leaf lies in `body`, sample-major
/// over every leaf (`None` for a leaf sent raw or of no bytes), so that a table storing it
/// compressed keeps the bytes as they came.
///
/// # Errors
/// [`EchoError::Protocol`] naming the leaf when its bytes are not its codec's data for
/// exactly its raw size (or `body` is not `head.body_len` bytes).
pub fn unpack_body(
    spec: &RaggedSpec,
    codecs: &[Option<Codec>],
    head: &Head,
    body: &[u8],
    raw: &mut Vec<u8>,
) -> Result<Vec<Option<Range<usize>>>, EchoError> {
    let columns = spec.columns();
    let short = || {
        EchoError::Protocol(format!(
            "a compressed body of {} bytes where its header says {}",
            body.len(),
            head.body_len
        ))
    };
    if body.len() != head.body_len || head.rows.len() != head.samples * columns.len() {
        return Err(short());
    }
    let raw_len: usize = head
        .rows
        .chunks(columns.len())
        .flat_map(|rows| columns.iter().zip(rows).map(|(c, &n)| c.row_bytes() * n))
        .sum();
    raw.clear();
    raw.resize(raw_len, 0);
    let mut where_packed = Vec::with_capacity(head.rows.len());
    let (mut at, mut out, mut k) = (0usize, 0usize, 0usize);
    for rows in head.rows.chunks(columns.len()) {
        for (c, (column, &n)) in columns.iter().zip(rows).enumerate() {
            let len = column.row_bytes() * n;
            let dst = &mut raw[out..out + len];
            match codecs.get(c).copied().flatten() {
                Some(codec) if !head.packed.is_empty() => {
                    let packed = head.packed.get(k).copied().unwrap_or(0);
                    k += 1;
                    let src = body.get(at..at + packed).ok_or_else(short)?;
                    if len > 0 {
                        codec.decompress_into(src, dst).map_err(|why| {
                            EchoError::Protocol(format!("leaf {}: {why}", column.name()))
                        })?;
                    }
                    where_packed.push((len > 0).then_some(at..at + packed));
                    at += packed;
                }
                _ => {
                    dst.copy_from_slice(body.get(at..at + len).ok_or_else(short)?);
                    where_packed.push(None);
                    at += len;
                }
            }
            out += len;
        }
    }
    Ok(where_packed)
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
    let head_bytes = head_len(spec, &[], kind[0], n);
    if 1 + head_bytes > limit {
        return Peeked::Elsewhere;
    }
    if ready < 1 + head_bytes {
        return Peeked::Partial;
    }
    head.resize(head_bytes, 0);
    copy_ahead(1, head);
    // A pipe carries no compressed frames: its connection agreed on no codecs.
    let Ok(Some((frame, _))) = decode_head(spec, &[], max_samples, kind[0], head) else {
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
    let kind = if priority.is_some() { GROUP_PRIORITY } else { GROUP };
    let mut out = Vec::with_capacity(1 + head_len(spec, &[], kind, samples.len()));
    encode_into(spec, &[], samples, priority, &mut out)?;
    Ok(out)
}

/// A whole compressed group frame for `samples` of `spec`: each leaf `codecs` names (one per
/// leaf, the connection's) compressed, the others raw.
///
/// # Errors
/// As [`encode_head`].
pub fn encode_packed(
    spec: &RaggedSpec,
    codecs: &[Option<Codec>],
    samples: &[Outgoing<'_>],
    priority: Option<f64>,
) -> Result<Vec<u8>, EchoError> {
    let raw: usize = samples.iter().flat_map(|s| s.leaves.iter().map(|l| l.len())).sum();
    let mut out = Vec::with_capacity(raw / 2 + 64);
    let slots = encode_into(spec, codecs, samples, priority, &mut out)?;
    let mut slots = slots.into_iter();
    for sample in samples {
        for (c, leaf) in sample.leaves.iter().enumerate() {
            match codecs.get(c).copied().flatten() {
                Some(codec) => {
                    let slot = slots.next().expect("a length slot per compressed leaf");
                    let before = out.len();
                    if !leaf.is_empty() {
                        codec.compress_append(leaf, &mut out);
                    }
                    let len = u32::try_from(out.len() - before).map_err(|_| {
                        EchoError::Sample(format!(
                            "leaf {}: {} bytes do not fit a frame",
                            spec.columns()[c].name(),
                            leaf.len()
                        ))
                    })?;
                    out[slot..slot + 4].copy_from_slice(&len.to_le_bytes());
                }
                None => out.extend_from_slice(leaf),
            }
        }
    }
    Ok(out)
}

/// Writes a group frame's kind byte and header to `out`; with `codecs` (one per leaf) a
/// compressed frame's, whose lengths are left 0 at the offsets returned, one per compressed
/// leaf in order.
fn encode_into(
    spec: &RaggedSpec,
    codecs: &[Option<Codec>],
    samples: &[Outgoing<'_>],
    priority: Option<f64>,
    out: &mut Vec<u8>,
) -> Result<Vec<usize>, EchoError> {
    let n = u16::try_from(samples.len()).ok().filter(|&n| n > 0).ok_or_else(|| {
        EchoError::Sample(format!("a group frame holds 1 to 65535 samples, got {}", samples.len()))
    })?;
    let packed = compressed_leaves(codecs) > 0;
    let kind = match (packed, priority.is_some()) {
        (false, false) => GROUP,
        (false, true) => GROUP_PRIORITY,
        (true, false) => GROUP_PACKED,
        (true, true) => GROUP_PACKED_PRIORITY,
    };
    out.push(kind);
    out.extend_from_slice(&n.to_le_bytes());
    if let Some(p) = priority {
        out.extend_from_slice(&p.to_le_bytes());
    }
    let mut slots = Vec::new();
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
        for _ in 0..compressed_leaves(codecs) {
            slots.push(out.len());
            out.extend_from_slice(&[0; 4]);
        }
    }
    Ok(slots)
}

/// A compressed group frame (`frame`, kind byte included, encoded with `codecs`) as the
/// plain frame of the same samples: what a connection that agreed on other codecs (or none)
/// takes.
///
/// # Errors
/// [`EchoError::Protocol`] for a frame that does not decode with `codecs`.
pub fn to_plain(
    spec: &RaggedSpec,
    codecs: &[Option<Codec>],
    frame: &[u8],
) -> Result<Vec<u8>, EchoError> {
    let (&kind, rest) =
        frame.split_first().ok_or_else(|| EchoError::Protocol("an empty frame".into()))?;
    let Some((head, used)) = decode_head(spec, codecs, usize::from(u16::MAX), kind, rest)? else {
        return Err(EchoError::Protocol("a truncated frame".into()));
    };
    let mut raw = Vec::new();
    unpack_body(spec, codecs, &head, &rest[used..], &mut raw)?;
    let columns = spec.columns().len();
    let none: Vec<&[u8]> = vec![&[]; columns];
    let samples: Vec<Outgoing<'_>> =
        head.rows.chunks(columns).map(|rows| Outgoing { rows, leaves: &none }).collect();
    let mut out = encode_head(spec, &samples, head.priority)?;
    out.extend_from_slice(&raw);
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
            assert_eq!(decode_head(&spec, &[], 8, head[0], &head[1..1 + cut]).unwrap(), None);
        }
        let (got, used) = decode_head(&spec, &[], 8, head[0], &head[1..]).unwrap().unwrap();
        assert_eq!(used, head.len() - 1);
        assert_eq!(got.samples, 2);
        assert_eq!(got.priority, Some(2.5));
        assert_eq!(got.rows, vec![3, 3, 1, 0, 0, 1]);
        assert_eq!(got.body_len, 12 + 12 + 8 + 8);
    }

    #[test]
    fn a_compressed_frame_round_trips_and_stores_its_leaves_as_they_came() {
        let spec = spec();
        let codecs = [Some(Codec::Zstd { level: 1 }), None, Some(Codec::Lz4)];
        let tokens = [7u8; 400];
        let logp: Vec<u8> = (0..400u32).map(|i| i as u8).collect();
        let a: [&[u8]; 3] = [&tokens, &logp, &[1; 8]];
        let b: [&[u8]; 3] = [&[], &[], &[2; 8]];
        let samples = [
            Outgoing { rows: &[100, 100, 1], leaves: &a },
            Outgoing { rows: &[0, 0, 1], leaves: &b },
        ];
        let frame = encode_packed(&spec, &codecs, &samples, Some(1.5)).unwrap();
        assert_eq!(frame[0], GROUP_PACKED_PRIORITY);
        assert!(frame.len() < 400 + 400, "the tokens shrink");
        // Without codecs the connection refuses it; with them it decodes.
        let err = decode_head(&spec, &[], 8, frame[0], &frame[1..]).unwrap_err();
        assert!(err.to_string().contains("agreed on no codecs"), "{err}");
        let (head, used) = decode_head(&spec, &codecs, 8, frame[0], &frame[1..]).unwrap().unwrap();
        assert_eq!(head.rows, vec![100, 100, 1, 0, 0, 1]);
        assert_eq!(head.packed.len(), 4, "two compressed leaves per sample");
        assert_eq!(head.packed[2], 0, "a leaf of no bytes takes none");
        let body = &frame[1 + used..];
        assert_eq!(body.len(), head.body_len);
        let mut raw = Vec::new();
        let packed = unpack_body(&spec, &codecs, &head, body, &mut raw).unwrap();
        assert_eq!(raw, [&tokens[..], &logp, &[1; 8], &[2; 8]].concat());
        let zstd = packed[0].clone().unwrap();
        let mut again = vec![0u8; 400];
        codecs[0].unwrap().decompress_into(&body[zstd], &mut again).unwrap();
        assert_eq!(again, tokens);
        assert_eq!(packed.iter().filter(|p| p.is_some()).count(), 3, "all but the empty one");
        // As a plain frame for a connection with other codecs: the same samples.
        let plain = to_plain(&spec, &codecs, &frame).unwrap();
        assert_eq!(plain[0], GROUP_PRIORITY);
        let (head, used) = decode_head(&spec, &[], 8, plain[0], &plain[1..]).unwrap().unwrap();
        assert_eq!((head.rows, head.priority), (vec![100, 100, 1, 0, 0, 1], Some(1.5)));
        assert_eq!(&plain[1 + used..], &raw[..]);
    }

    #[test]
    fn hostile_compressed_frames_are_refused_naming_the_leaf() {
        let spec = spec();
        let codecs = [Some(Codec::Zstd { level: 1 }), None, None];
        let frame = |rows: u32, len: u32| {
            let mut out = 1u16.to_le_bytes().to_vec();
            for r in [rows, rows] {
                out.extend_from_slice(&r.to_le_bytes());
            }
            out.extend_from_slice(&len.to_le_bytes());
            out
        };
        // A length above the codec's worst case for the leaf's bytes, before any allocation.
        let err = decode_head(&spec, &codecs, 8, GROUP_PACKED, &frame(10, u32::MAX)).unwrap_err();
        assert!(err.to_string().contains("leaf ['tokens']: 4294967295 compressed bytes"), "{err}");
        // Bytes for a leaf of none, and none for a leaf of some.
        assert!(decode_head(&spec, &codecs, 8, GROUP_PACKED, &frame(0, 5)).is_err());
        assert!(decode_head(&spec, &codecs, 8, GROUP_PACKED, &frame(10, 0)).is_err());
        // A body that is not the codec's data for exactly the leaf: refused, naming it.
        let (head, _) =
            decode_head(&spec, &codecs, 8, GROUP_PACKED, &frame(10, 12)).unwrap().unwrap();
        let mut raw = Vec::new();
        let body = vec![0xAB; head.body_len];
        let err = unpack_body(&spec, &codecs, &head, &body, &mut raw).unwrap_err();
        assert!(matches!(err, EchoError::Protocol(_)));
        assert!(err.to_string().contains("leaf ['tokens']"), "{err}");
        // A zstd frame of another size (a bomb's claim) is refused before decompressing.
        let mut other = Vec::new();
        codecs[0].unwrap().compress_append(&[0; 4000], &mut other);
        let mut lying = frame(10, other.len() as u32);
        lying.extend_from_slice(&other);
        lying.extend_from_slice(&[0; 40 + 8]);
        let (head, used) = decode_head(&spec, &codecs, 8, GROUP_PACKED, &lying).unwrap().unwrap();
        let err = unpack_body(&spec, &codecs, &head, &lying[used..], &mut raw).unwrap_err();
        assert!(err.to_string().contains("declares 4000 bytes, the leaf holds 40"), "{err}");
        // A body of another length than its header says.
        assert!(unpack_body(&spec, &codecs, &head, &lying[used + 1..], &mut raw).is_err());
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
            decode_head(&spec, &[], 8, GROUP, &frame(0, &[])),
            Err(EchoError::Protocol(_))
        ));
        assert!(matches!(
            decode_head(&spec, &[], 8, GROUP, &frame(9, &[])),
            Err(EchoError::Protocol(_))
        ));
        let err = decode_head(&spec, &[], 8, GROUP, &frame(1, &[u32::MAX, u32::MAX])).unwrap_err();
        assert!(err.to_string().contains("more than its max_len 100"), "{err}");
        let err = decode_head(&spec, &[], 8, GROUP, &frame(1, &[3, 4])).unwrap_err();
        assert!(err.to_string().contains("has 3 rows but leaf ['logp'] has 4"), "{err}");
        let mut bad = 1u16.to_le_bytes().to_vec();
        bad.extend_from_slice(&f64::NAN.to_le_bytes());
        bad.extend_from_slice(&[0; 8]);
        assert!(matches!(
            decode_head(&spec, &[], 8, GROUP_PRIORITY, &bad),
            Err(EchoError::Protocol(_))
        ));
        assert!(matches!(decode_head(&spec, &[], 8, 0x10, &bad), Err(EchoError::Protocol(_))));
    }
}
