//! The wire protocol, defined once: v1 here (compatible both ways with id-echo 0.2.1), v2 in
//! [`v2`] (negotiated next to v1: typed layouts, tokens, priorities, sessions, heartbeats).
//!
//! ```text
//! server -> client, on accept:   b"ECHO" | version: u8 = 1 | n_arrays: u32 LE
//!                                then per array: dtype_size: u32 LE | ndim: u32 LE | ndim x dim: u32 LE
//! client -> server, repeated:    one sample = payload_size raw bytes (leaves concatenated in
//!                                flattened order, C-contiguous); no framing
//! server -> client, per sample:  one byte 0x01 once the sample is queued
//! ```
//!
//! Decoding is defensive: array and dimension counts are capped before anything is allocated,
//! and sizes are recomputed with overflow checks, so a hostile peer gets an error, not an OOM.

mod layout;
pub mod params;
mod reader;
pub mod v2;

use std::io::{self, Read};

use crate::error::EchoError;
use crate::spec::{ArraySpec, DataSpec};

/// First bytes of every handshake.
pub const MAGIC: &[u8; 4] = b"ECHO";
/// The protocol version this module speaks.
pub const VERSION: u8 = 1;
/// The acknowledgement byte, one per queued sample.
pub const ACK: u8 = 0x01;
/// Most arrays a handshake may announce.
pub const MAX_ARRAYS: u32 = 1 << 16;
/// Most dimensions one array may have (numpy's own limit is 64).
pub const MAX_DIMS: u32 = 64;

/// Encodes the handshake announcing `spec`.
///
/// # Errors
/// [`EchoError::Config`] if a count, dimension or dtype size does not fit in a `u32`.
pub fn encode_handshake(spec: &DataSpec) -> Result<Vec<u8>, EchoError> {
    let to_u32 = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| {
            EchoError::Config(format!("{what} {v} does not fit the wire format's u32"))
        })
    };
    let mut out = Vec::with_capacity(9 + spec.len() * 16);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&to_u32(spec.len(), "array count")?.to_le_bytes());
    for array in spec.arrays() {
        out.extend_from_slice(&to_u32(array.dtype_size(), "dtype size")?.to_le_bytes());
        out.extend_from_slice(&to_u32(array.shape().len(), "dimension count")?.to_le_bytes());
        for &dim in array.shape() {
            out.extend_from_slice(&to_u32(dim, "dimension")?.to_le_bytes());
        }
    }
    Ok(out)
}

/// Reads and validates a handshake from `reader`.
///
/// # Errors
/// [`EchoError::Protocol`] for a wrong magic or version, absurd counts or a spec that holds
/// no data; [`EchoError::Io`] if the stream ends or fails.
pub fn read_handshake(reader: &mut impl Read) -> Result<DataSpec, EchoError> {
    let mut head = [0u8; 9];
    reader.read_exact(&mut head[..4])?;
    check_magic(&head[..4])?;
    reader.read_exact(&mut head[4..])?;
    if head[4] != VERSION {
        return Err(EchoError::Protocol(format!(
            "unsupported protocol version: expected {VERSION}, got {}",
            head[4]
        )));
    }
    let n_arrays = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes"));
    if n_arrays > MAX_ARRAYS {
        return Err(EchoError::Protocol(format!(
            "handshake announces {n_arrays} arrays, more than the {MAX_ARRAYS} allowed"
        )));
    }
    // Not `n_arrays` itself: 9 bytes of a hostile peer must not reserve megabytes (the client
    // re-parses a trickled handshake on every read). The vector grows as arrays really arrive.
    let mut arrays = Vec::with_capacity((n_arrays as usize).min(64));
    for index in 0..n_arrays {
        let dtype_size = read_u32(reader)?;
        let ndim = read_u32(reader)?;
        if ndim > MAX_DIMS {
            return Err(EchoError::Protocol(format!(
                "array {index} has {ndim} dimensions, more than the {MAX_DIMS} allowed"
            )));
        }
        let shape = (0..ndim)
            .map(|_| read_u32(reader).map(|d| d as usize))
            .collect::<Result<Vec<_>, _>>()?;
        let array = ArraySpec::new(shape, dtype_size as usize)
            .map_err(|e| EchoError::Protocol(format!("array {index}: {e}")))?;
        arrays.push(array);
    }
    DataSpec::new(arrays).map_err(|e| EchoError::Protocol(e.to_string()))
}

/// Checks the start of a handshake as far as it has arrived: the bytes so far must begin the
/// magic. So a peer that is not an echo server is recognised from its first byte, not only
/// once a whole handshake's worth has arrived (it may never send that many).
///
/// # Errors
/// [`EchoError::Protocol`] ("not an echo server") if they differ.
pub fn check_magic(start: &[u8]) -> Result<(), EchoError> {
    let n = start.len().min(MAGIC.len());
    if start[..n] == MAGIC[..n] {
        return Ok(());
    }
    Err(EchoError::Protocol(format!(
        "not an echo server: expected magic {:?}, got {:?}",
        String::from_utf8_lossy(MAGIC),
        String::from_utf8_lossy(&start[..n])
    )))
}

/// Parses a handshake from the bytes received so far. `Ok(None)`: valid so far, more bytes
/// needed. `Ok(Some((spec, len)))`: complete, the first `len` bytes were the handshake.
///
/// # Errors
/// As [`read_handshake`], except that running out of bytes is `Ok(None)`; a wrong magic is
/// reported as soon as its first wrong byte is in.
pub fn parse_handshake(received: &[u8]) -> Result<Option<(DataSpec, usize)>, EchoError> {
    check_magic(received)?;
    let mut rest = received;
    match read_handshake(&mut rest) {
        Ok(spec) => Ok(Some((spec, received.len() - rest.len()))),
        Err(EchoError::Io(err)) if err.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
        Err(err) => Err(err),
    }
}

fn read_u32(reader: &mut impl Read) -> io::Result<u32> {
    let mut buf = [0u8; 4];
    reader.read_exact(&mut buf)?;
    Ok(u32::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> DataSpec {
        DataSpec::new(vec![
            ArraySpec::new(vec![4], 4).unwrap(),
            ArraySpec::new(vec![], 8).unwrap(),
            ArraySpec::new(vec![2, 3], 1).unwrap(),
        ])
        .unwrap()
    }

    #[test]
    fn handshake_bytes_are_exactly_v1() {
        let bytes = encode_handshake(&spec()).unwrap();
        let mut expected = b"ECHO".to_vec();
        expected.push(1);
        for word in [3u32, 4, 1, 4, 8, 0, 1, 2, 2, 3] {
            expected.extend_from_slice(&word.to_le_bytes());
        }
        assert_eq!(bytes, expected);
    }

    #[test]
    fn handshake_round_trips() {
        let bytes = encode_handshake(&spec()).unwrap();
        assert_eq!(read_handshake(&mut &bytes[..]).unwrap(), spec());
    }

    #[test]
    fn wrong_magic_version_and_truncation_are_errors() {
        let mut bytes = encode_handshake(&spec()).unwrap();
        bytes[0] = b'X';
        let err = read_handshake(&mut &bytes[..]).unwrap_err();
        assert!(matches!(err, EchoError::Protocol(m) if m.contains("magic")));
        let mut bytes = encode_handshake(&spec()).unwrap();
        bytes[4] = 2;
        let err = read_handshake(&mut &bytes[..]).unwrap_err();
        assert!(matches!(err, EchoError::Protocol(m) if m.contains("version")));
        let bytes = encode_handshake(&spec()).unwrap();
        for cut in 0..bytes.len() {
            assert!(read_handshake(&mut &bytes[..cut]).is_err(), "truncated at {cut}");
        }
    }

    #[test]
    fn a_partial_handshake_needs_more_bytes_and_a_wrong_first_byte_is_not_echo() {
        let bytes = encode_handshake(&spec()).unwrap();
        for cut in 0..bytes.len() {
            assert!(matches!(parse_handshake(&bytes[..cut]), Ok(None)), "cut at {cut}");
        }
        let (parsed, len) = parse_handshake(&bytes).unwrap().unwrap();
        assert_eq!((parsed, len), (spec(), bytes.len()));
        for wrong in [&b"N"[..], b"EX", b"ECHX", b"HTTP/1.1"] {
            let err = parse_handshake(wrong).unwrap_err();
            assert!(matches!(&err, EchoError::Protocol(m) if m.contains("not an echo server")));
        }
    }

    #[test]
    fn absurd_counts_are_rejected_before_allocating() {
        let mut bytes = b"ECHO\x01".to_vec();
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(read_handshake(&mut &bytes[..]), Err(EchoError::Protocol(_))));
        let mut bytes = b"ECHO\x01".to_vec();
        for word in [1u32, 4, 1000] {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        assert!(matches!(read_handshake(&mut &bytes[..]), Err(EchoError::Protocol(_))));
    }
}
