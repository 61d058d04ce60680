//! Arbitrary bytes into the parameter channel's parsers: a FETCH as a hostile worker sends it
//! to the learner, and a CHUNK header and a VERSION notice as a hostile learner sends them to
//! a worker.
//!
//! Never a panic, and:
//! - a FETCH that decodes asks for at most a chunk, within the parameters' size, and
//!   re-encodes to the bytes it came from;
//! - a CHUNK or PACKED header that parses is complete, of the layout's size, and either
//!   answers exactly what was asked or says the version is gone (no bytes, offset 0): a client
//!   never takes bytes it did not ask for; a PACKED one answers bytes asked for, with no more
//!   compressed bytes than its codec's bound (what the client allocates); it re-encodes to
//!   the bytes it came from;
//! - a VERSION notice that parses re-encodes to its bytes.
//!
//! The first 8 bytes are the parameters' size, the next 20 the fields of a FETCH the client
//! sent (its length made 1..=a chunk), the rest the message.
#![no_main]

use echo::transport::wire::params::{
    self, Chunk, Fetch, CHUNK_HEADER_LEN, FETCH_LEN, MAX_CHUNK, PACKED_HEADER_LEN, VERSION_LEN,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((size, rest)) = data.split_first_chunk::<8>() else { return };
    let size = u64::from_le_bytes(*size);
    let Some((raw, message)) = rest.split_first_chunk::<{ FETCH_LEN - 1 }>() else { return };
    if let Ok(fetch) = Fetch::decode(message.get(..FETCH_LEN - 1).unwrap_or(message), size) {
        assert!(fetch.len <= MAX_CHUNK);
        assert!(fetch.offset + u64::from(fetch.len) <= size);
        assert_eq!(&fetch.encode()[1..], &message[..FETCH_LEN - 1]);
    }
    // The client's own request: within a chunk, and never empty.
    let asked = Fetch {
        version: u64::from_le_bytes(raw[..8].try_into().unwrap()),
        offset: u64::from_le_bytes(raw[8..16].try_into().unwrap()),
        len: (u32::from_le_bytes(raw[16..20].try_into().unwrap()) % MAX_CHUNK).max(1),
    };
    if let Ok(Some(chunk)) = Chunk::parse(message, &asked, size) {
        assert!(message.len() >= CHUNK_HEADER_LEN);
        assert!(chunk.size == size || (chunk.version, chunk.size, chunk.len) == (0, 0, 0));
        let exact = (asked.version == 0 || chunk.version == asked.version)
            && (chunk.offset, chunk.len) == (asked.offset, asked.len);
        assert!(exact || (chunk.len == 0 && chunk.offset == 0), "{chunk:?} for {asked:?}");
        if let Some((codec, packed)) = chunk.packed {
            assert!(exact && chunk.len > 0, "{chunk:?} for {asked:?}");
            assert!(packed > 0 && packed as usize <= codec.bound(chunk.len as usize));
            assert_eq!(chunk.header_len(), PACKED_HEADER_LEN);
        }
        assert_eq!(&chunk.encode()[..], &message[..chunk.header_len()]);
    }
    if let Some(version) = params::parse_version(message) {
        assert_eq!(&params::encode_version(version)[..], &message[..VERSION_LEN]);
    }
});
