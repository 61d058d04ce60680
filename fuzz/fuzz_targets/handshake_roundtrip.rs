//! A random small spec (up to 8 arrays of up to 8 dimensions; any `u32` dims and dtype sizes,
//! sometimes values past `u32`) through `ArraySpec::new`/`DataSpec::new`, `encode_handshake`
//! and back.
//!
//! - The constructors accept exactly the specs whose sizes fit (checked products and sum,
//!   dtype size >= 1, at least one byte in all), and report the rest as errors.
//! - A spec the wire format can express encodes to exactly 9 + 8 * arrays + 4 * dims bytes
//!   and reads back equal (by `read_handshake` and `parse_handshake`, which also ignore
//!   whatever follows); one it cannot (a value past `u32`) is a `Config` error.
//! - Every truncation of the encoding is "out of bytes": an `UnexpectedEof` error from
//!   `read_handshake`, "need more" from `parse_handshake`.
#![no_main]

use std::io;

use arbitrary::Arbitrary;
use echo::transport::wire::{encode_handshake, parse_handshake, read_handshake};
use echo::{ArraySpec, DataSpec, EchoError};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Array {
    dtype_size: Value,
    dims: Vec<Value>,
}

/// Mostly small, sometimes any `u32`, rarely past `u32` (which the wire cannot carry).
#[derive(Debug, Arbitrary)]
enum Value {
    Small(u8),
    Wide(u32),
    Huge(u64),
}

impl Value {
    fn get(&self) -> usize {
        match *self {
            Value::Small(v) => usize::from(v),
            Value::Wide(v) => v as usize,
            Value::Huge(v) => usize::try_from(v).unwrap_or(usize::MAX),
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    arrays: Vec<Array>,
    /// Bytes after the handshake (the client must not consume them).
    trailing: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let mut arrays = Vec::new();
    for array in input.arrays.iter().take(8) {
        let dims: Vec<usize> = array.dims.iter().take(8).map(Value::get).collect();
        let dtype_size = array.dtype_size.get();
        let expected = dims.iter().try_fold(dtype_size, |acc, &d| acc.checked_mul(d));
        match (ArraySpec::new(dims.clone(), dtype_size), expected) {
            (Ok(a), Some(bytes)) if dtype_size >= 1 => {
                assert_eq!(
                    (a.num_bytes(), a.shape(), a.dtype_size()),
                    (bytes, &dims[..], dtype_size)
                );
                arrays.push(a);
            }
            (Err(EchoError::Config(_)), None) => return,
            (Err(EchoError::Config(_)), Some(_)) if dtype_size == 0 => return,
            (got, expected) => {
                panic!("ArraySpec::new({dims:?}, {dtype_size}): {got:?}, expected {expected:?}")
            }
        }
    }
    let total = arrays.iter().try_fold(0usize, |acc, a| acc.checked_add(a.num_bytes()));
    let spec = match (DataSpec::new(arrays.clone()), total) {
        (Ok(spec), Some(total)) if total > 0 => {
            assert_eq!(spec.payload_size(), total);
            spec
        }
        (Err(EchoError::Config(_)), None) => return,
        (Err(EchoError::Config(_)), Some(0)) => return,
        (got, total) => panic!("DataSpec::new: {got:?}, expected payload {total:?}"),
    };
    let fits = spec.arrays().iter().all(|a| {
        u32::try_from(a.dtype_size()).is_ok() && a.shape().iter().all(|&d| u32::try_from(d).is_ok())
    });
    let bytes = match encode_handshake(&spec) {
        Ok(bytes) if fits => bytes,
        Err(EchoError::Config(_)) if !fits => return,
        other => panic!("encode_handshake (fits the wire: {fits}): {other:?}"),
    };
    let dims: usize = spec.arrays().iter().map(|a| a.shape().len()).sum();
    assert_eq!(bytes.len(), 9 + 8 * spec.len() + 4 * dims);
    assert_eq!(read_handshake(&mut &bytes[..]).expect("read back"), spec);

    let mut stream = bytes.clone();
    stream.extend_from_slice(&input.trailing);
    let mut rest = &stream[..];
    assert_eq!(read_handshake(&mut rest).expect("read back with trailing bytes"), spec);
    assert_eq!(rest, &input.trailing[..], "read_handshake consumed past the handshake");
    match parse_handshake(&stream) {
        Ok(Some((parsed, len))) => assert_eq!((parsed, len), (spec.clone(), bytes.len())),
        other => panic!("parse_handshake: {other:?}"),
    }

    for cut in 0..bytes.len() {
        match read_handshake(&mut &bytes[..cut]) {
            Err(EchoError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {}
            other => panic!("truncated at {cut} of {}: {other:?}", bytes.len()),
        }
        match parse_handshake(&bytes[..cut]) {
            Ok(None) => {}
            other => panic!("parse_handshake, truncated at {cut} of {}: {other:?}", bytes.len()),
        }
    }
});
