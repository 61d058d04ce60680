//! Arbitrary bytes from a (possibly hostile) server into the client's handshake parsers,
//! `read_handshake` (blocking reader) and `parse_handshake` (what `TcpSender` calls on the
//! bytes received so far).
//!
//! Never a panic, and:
//! - a handshake that parses re-encodes to exactly the bytes it was read from (the format is
//!   canonical), and those re-read to an equal spec;
//! - its sizes are the overflow-checked products and sums, within the caps, never zero;
//! - `parse_handshake` agrees with `read_handshake`: a complete handshake is the same spec and
//!   length, running out of bytes is "need more", any other error is the same error;
//! - fed a growing prefix, as the client does, `parse_handshake` says "need more" until the
//!   first byte that decides, and from then on the same answer for every longer prefix.
#![no_main]

use std::io;

use echo::transport::wire::{
    encode_handshake, parse_handshake, read_handshake, MAX_ARRAYS, MAX_DIMS,
};
use echo::{DataSpec, EchoError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    let read = read_handshake(&mut rest);
    let consumed = data.len() - rest.len();
    let parsed = parse_handshake(data);
    match &read {
        Ok(spec) => {
            check_spec(spec);
            let bytes = encode_handshake(spec).expect("a spec read off the wire re-encodes");
            assert_eq!(bytes, &data[..consumed], "re-encoding differs from the bytes read");
            assert_eq!(&read_handshake(&mut &bytes[..]).expect("re-read"), spec);
            match &parsed {
                Ok(Some((p, len))) => assert_eq!((p, *len), (spec, consumed)),
                other => panic!("read_handshake: Ok, parse_handshake: {other:?}"),
            }
        }
        Err(EchoError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => match &parsed {
            Ok(None) => {}
            // A wrong magic is reported from its first byte on; read_handshake needs 9.
            Err(EchoError::Protocol(m)) if m.contains("not an echo server") => {
                assert!(data.len() < 9, "parse: {m}, read: out of bytes after {}", data.len());
            }
            other => panic!("read_handshake: out of bytes, parse_handshake: {other:?}"),
        },
        Err(EchoError::Protocol(m)) => match &parsed {
            Err(EchoError::Protocol(p)) => assert_eq!(p, m),
            other => panic!("read_handshake: {m}, parse_handshake: {other:?}"),
        },
        Err(other) => panic!("read_handshake: unexpected error kind {other:?}"),
    }
    check_prefixes(data, &parsed);
});

/// The invariants `DataSpec` promises, recomputed independently.
fn check_spec(spec: &DataSpec) {
    assert!(!spec.is_empty() && spec.len() <= MAX_ARRAYS as usize);
    let mut total = 0usize;
    for (i, array) in spec.arrays().iter().enumerate() {
        assert!(array.dtype_size() >= 1 && array.shape().len() <= MAX_DIMS as usize);
        let bytes = array.shape().iter().try_fold(array.dtype_size(), |acc, &d| acc.checked_mul(d));
        assert_eq!(bytes, Some(array.num_bytes()), "array {i}: wrong or overflowed size");
        assert_eq!(spec.leaf_range(i), total..total + array.num_bytes());
        total = total.checked_add(array.num_bytes()).expect("payload size overflows");
    }
    assert!(total > 0);
    assert_eq!(spec.payload_size(), total);
}

/// The client re-parses its growing buffer after every read: every prefix before the
/// deciding byte is "need more", every longer one gives the final answer (the same spec and
/// length, or a protocol error). Checked at the first 32 cuts, every 29th, and both sides of
/// the deciding byte (a parse can allocate for up to `MAX_ARRAYS` arrays, so not at all cuts).
fn check_prefixes(data: &[u8], whole: &Result<Option<(DataSpec, usize)>, EchoError>) {
    let decided_at = match whole {
        Ok(None) => data.len() + 1,
        Ok(Some((_, len))) => *len,
        Err(_) => {
            // The shortest erring prefix, by bisection (erring is monotone; the cuts check it).
            let (mut lo, mut hi) = (0, data.len());
            while lo < hi {
                let mid = (lo + hi) / 2;
                if parse_handshake(&data[..mid]).is_err() {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            lo
        }
    };
    let cuts = (0..=data.len().min(32))
        .chain((0..=data.len()).step_by(29))
        .chain([decided_at.saturating_sub(1), decided_at, data.len()])
        .filter(|&c| c <= data.len());
    for cut in cuts {
        let got = parse_handshake(&data[..cut]);
        if cut < decided_at {
            assert!(matches!(got, Ok(None)), "prefix {cut} < {decided_at}: {got:?}");
        } else {
            match (&got, whole) {
                (Ok(Some(a)), Ok(Some(b))) => assert_eq!(a, b, "prefix {cut}"),
                // Same kind; the text may differ (a wrong magic quotes the bytes seen so far).
                (Err(EchoError::Protocol(_)), Err(EchoError::Protocol(_))) => {}
                _ => panic!("prefix {cut} >= {decided_at}: {got:?}, whole input: {whole:?}"),
            }
        }
    }
}
