//! The parameter channel's messages on a wire v2 connection: a worker pulls the learner's
//! published parameters ([`crate::params::ParamStore`]) one chunk per request, and hears of
//! new versions without a transfer.
//!
//! ```text
//! client -> server:  0x32 FETCH   | version: u64 (0: the latest) | offset: u64 | len: u32
//! server -> client:  0x06 CHUNK   | version: u64 | size: u64 | offset: u64 | len: u32 | len bytes
//!                    0x07 VERSION | version: u64   (a new version was published)
//! ```
//!
//! A FETCH asks for bytes `offset..offset + len` of `version`, at most [`MAX_CHUNK`]; the
//! server answers each with one CHUNK of that version, whose `size` is the bytes of a whole
//! version. When the version asked for is no longer held (two publishes overtook the fetch),
//! the CHUNK carries the latest version, offset 0 and no bytes: the client starts that version
//! over. Before the first publish it carries version 0, size 0 and no bytes. Decoding is defensive: a length is checked
//! against the request and the layout's size before anything is allocated.
//!
//! A FETCH of version [`DESCRIPTION`] asks for bytes of the parameters' description instead
//! (the learner's pytree structure, leaf dtypes and shapes, as the Python layer encodes
//! them), answered by CHUNKs of that version whose `size` is the description's: a worker
//! without a layout of its own learns it first. A learner without one answers a size of 0.

use super::reader::Cursor;
use crate::error::EchoError;

/// Client frame: a request for one chunk of the parameters.
pub const FETCH: u8 = 0x32;
/// Server byte: one chunk of the parameters follows.
pub const CHUNK: u8 = 0x06;
/// Server byte: a new version of the parameters was published (its number follows).
pub const VERSION: u8 = 0x07;
/// The version a FETCH asks for to get the parameters' description, not a version of them.
pub const DESCRIPTION: u64 = u64::MAX;
/// The most bytes one chunk carries.
pub const MAX_CHUNK: u32 = 1 << 20;
/// Bytes of a FETCH, its kind byte included.
pub const FETCH_LEN: usize = 1 + 8 + 8 + 4;
/// Bytes of a CHUNK's header, its kind byte included (its bytes follow).
pub const CHUNK_HEADER_LEN: usize = 1 + 8 + 8 + 8 + 4;
/// Bytes of a VERSION notice, its kind byte included.
pub const VERSION_LEN: usize = 1 + 8;

/// What a FETCH asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    /// The version (0: the latest).
    pub version: u64,
    /// The first byte wanted.
    pub offset: u64,
    /// How many bytes.
    pub len: u32,
}

impl Fetch {
    /// The frame's bytes.
    pub fn encode(&self) -> [u8; FETCH_LEN] {
        let mut out = [0u8; FETCH_LEN];
        out[0] = FETCH;
        out[1..9].copy_from_slice(&self.version.to_le_bytes());
        out[9..17].copy_from_slice(&self.offset.to_le_bytes());
        out[17..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// The fields after a FETCH's kind byte (`rest`, [`FETCH_LEN`] - 1 bytes), checked
    /// against parameters of `size` bytes.
    ///
    /// # Errors
    /// [`EchoError::Protocol`] for a wrong length, a chunk longer than [`MAX_CHUNK`], or one
    /// that reaches past `size`.
    pub fn decode(rest: &[u8], size: u64) -> Result<Self, EchoError> {
        if rest.len() != FETCH_LEN - 1 {
            return Err(EchoError::Protocol(format!(
                "a parameter fetch has {} bytes after its kind, expected {}",
                rest.len(),
                FETCH_LEN - 1
            )));
        }
        let mut reader = Cursor(rest);
        let fetch = Self { version: reader.u64()?, offset: reader.u64()?, len: reader.u32()? };
        if fetch.len > MAX_CHUNK {
            return Err(EchoError::Protocol(format!(
                "a parameter fetch of {} bytes, more than a chunk's {MAX_CHUNK}",
                fetch.len
            )));
        }
        if fetch.offset.checked_add(u64::from(fetch.len)).is_none_or(|end| end > size) {
            return Err(EchoError::Protocol(format!(
                "a parameter fetch of bytes {}..+{} of parameters of {size} bytes",
                fetch.offset, fetch.len
            )));
        }
        Ok(fetch)
    }
}

/// A CHUNK's header (its bytes follow it on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// The version the bytes are of (0: none published).
    pub version: u64,
    /// Bytes of a whole version.
    pub size: u64,
    /// Where the bytes go in the version.
    pub offset: u64,
    /// How many bytes follow.
    pub len: u32,
}

impl Chunk {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut out = [0u8; CHUNK_HEADER_LEN];
        out[0] = CHUNK;
        out[1..9].copy_from_slice(&self.version.to_le_bytes());
        out[9..17].copy_from_slice(&self.size.to_le_bytes());
        out[17..25].copy_from_slice(&self.offset.to_le_bytes());
        out[25..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// The header at the start of `bytes` (kind byte included), checked against what the
    /// client asked (`asked`) and the size of its layout's parameters (`size`; a fetch of no
    /// bytes is a probe, which learns whatever size the version has); `Ok(None)` until the
    /// whole header is there.
    ///
    /// # Errors
    /// [`EchoError::Protocol`] for a header that is not a CHUNK, a size other than the
    /// layout's, or bytes the client did not ask for (another offset or more bytes; a
    /// superseded answer carries offset 0 and none).
    pub fn parse(bytes: &[u8], asked: &Fetch, size: u64) -> Result<Option<Self>, EchoError> {
        let Some(header) = bytes.get(..CHUNK_HEADER_LEN) else { return Ok(None) };
        if header[0] != CHUNK {
            return Err(EchoError::Protocol(format!(
                "expected a parameter chunk (0x06), got {:#04x}",
                header[0]
            )));
        }
        let mut reader = Cursor(&header[1..]);
        let chunk = Self {
            version: reader.u64()?,
            size: reader.u64()?,
            offset: reader.u64()?,
            len: reader.u32()?,
        };
        if chunk.version == 0 {
            // Nothing published yet: no bytes, of no size.
            if (chunk.size, chunk.offset, chunk.len) != (0, 0, 0) {
                return Err(EchoError::Protocol(format!(
                    "a parameter chunk of no version with bytes {}..+{} of {}",
                    chunk.offset, chunk.len, chunk.size
                )));
            }
            return Ok(Some(chunk));
        }
        if asked.len == 0 {
            // A probe: it learns the latest version and its size, whatever they are, and no
            // bytes.
            if chunk.len != 0 {
                return Err(EchoError::Protocol(format!(
                    "a parameter chunk of {} bytes answering a fetch of none",
                    chunk.len
                )));
            }
            return Ok(Some(chunk));
        }
        if chunk.size != size {
            return Err(EchoError::Protocol(format!(
                "a parameter chunk of a version of {} bytes, but this layout's are {size}",
                chunk.size
            )));
        }
        let superseded = chunk.len == 0 && chunk.offset == 0;
        let same_version = asked.version == 0 || chunk.version == asked.version;
        let answers = same_version && chunk.offset == asked.offset && chunk.len == asked.len;
        if !(superseded || answers) {
            return Err(EchoError::Protocol(format!(
                "a parameter chunk of version {} bytes {}..+{}, but the client asked for \
                 version {} bytes {}..+{}",
                chunk.version, chunk.offset, chunk.len, asked.version, asked.offset, asked.len
            )));
        }
        Ok(Some(chunk))
    }

    /// Whether it says the version asked for is gone (or none is published): start
    /// `version` over (none when it is 0).
    pub fn superseded(&self, asked: &Fetch) -> bool {
        self.len == 0 && asked.len > 0
    }
}

/// A VERSION notice's bytes.
pub fn encode_version(version: u64) -> [u8; VERSION_LEN] {
    let mut out = [0u8; VERSION_LEN];
    out[0] = VERSION;
    out[1..].copy_from_slice(&version.to_le_bytes());
    out
}

/// The version a VERSION notice at the start of `bytes` carries; `None` until all
/// [`VERSION_LEN`] bytes are there, or if they are not one.
pub fn parse_version(bytes: &[u8]) -> Option<u64> {
    match bytes.get(..VERSION_LEN)? {
        [VERSION, version @ ..] => Some(u64::from_le_bytes(version.try_into().ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fetch_round_trips_and_one_past_the_parameters_is_refused() {
        let fetch = Fetch { version: 7, offset: 1000, len: 24 };
        let bytes = fetch.encode();
        assert_eq!(bytes[0], FETCH);
        assert_eq!(Fetch::decode(&bytes[1..], 1024).unwrap(), fetch);
        let err = Fetch::decode(&bytes[1..], 1023).unwrap_err().to_string();
        assert!(err.contains("bytes 1000..+24 of parameters of 1023 bytes"), "{err}");
        let huge = Fetch { len: MAX_CHUNK + 1, ..fetch }.encode();
        assert!(Fetch::decode(&huge[1..], u64::MAX).unwrap_err().to_string().contains("chunk"));
        let wrap = Fetch { offset: u64::MAX, ..fetch }.encode();
        assert!(Fetch::decode(&wrap[1..], u64::MAX).is_err(), "offset + len overflows");
        assert!(Fetch::decode(&bytes[1..FETCH_LEN - 1], 1024).is_err(), "short");
    }

    #[test]
    fn a_chunk_answers_what_was_asked_or_says_the_version_is_gone() {
        let asked = Fetch { version: 0, offset: 0, len: 16 };
        let chunk = Chunk { version: 3, size: 64, offset: 0, len: 16 };
        let bytes = chunk.encode();
        for cut in 0..CHUNK_HEADER_LEN {
            assert_eq!(Chunk::parse(&bytes[..cut], &asked, 64).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(Chunk::parse(&bytes, &asked, 64).unwrap(), Some(chunk));
        assert!(!chunk.superseded(&asked));
        // The next chunk of version 3; the answer that version 3 is gone (5 is the latest).
        let next = Fetch { version: 3, offset: 16, len: 16 };
        let gone = Chunk { version: 5, size: 64, offset: 0, len: 0 };
        let parsed = Chunk::parse(&gone.encode(), &next, 64).unwrap().unwrap();
        assert!(parsed.superseded(&next));
        // What was not asked for is refused: another version, offset, length or size.
        for bad in [
            Chunk { version: 4, ..Chunk { offset: 16, len: 16, ..chunk } },
            Chunk { offset: 32, len: 16, ..chunk },
            Chunk { offset: 16, len: 17, ..chunk },
            Chunk { size: 65, offset: 16, len: 16, ..chunk },
        ] {
            assert!(Chunk::parse(&bad.encode(), &next, 64).is_err(), "{bad:?}");
        }
        let mut wrong = bytes;
        wrong[0] = VERSION;
        assert!(Chunk::parse(&wrong, &asked, 64).is_err());
        // Nothing published: version 0 with no size and no bytes, and nothing else.
        let none = Chunk { version: 0, size: 0, offset: 0, len: 0 };
        assert_eq!(Chunk::parse(&none.encode(), &asked, 64).unwrap(), Some(none));
        assert!(none.superseded(&asked));
        let bogus = Chunk { len: 16, ..none };
        assert!(Chunk::parse(&bogus.encode(), &asked, 64).is_err());
    }

    #[test]
    fn a_version_notice_round_trips() {
        for version in [0, 1, u64::MAX] {
            let bytes = encode_version(version);
            assert_eq!(parse_version(&bytes), Some(version));
            assert_eq!(parse_version(&bytes[..VERSION_LEN - 1]), None);
        }
        assert_eq!(parse_version(&[CHUNK; VERSION_LEN]), None);
    }
}
