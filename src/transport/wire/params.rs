//! The parameter channel's messages on a wire v2 connection: a worker pulls the learner's
//! published parameters ([`crate::params::ParamStore`]) one chunk per request, and hears of
//! new versions without a transfer.
//!
//! ```text
//! client -> server:  0x32 FETCH   | version: u64 (0: the latest) | offset: u64 | len: u32
//! server -> client:  0x06 CHUNK   | version: u64 | size: u64 | offset: u64 | len: u32 | len bytes
//!                    0x08 PACKED  | version: u64 | size: u64 | offset: u64 | len: u32
//!                                 | codec: u8 (1 zstd, 2 lz4) | packed: u32 | packed bytes
//!                    0x07 VERSION | version: u64   (a new version was published)
//! ```
//!
//! A PACKED chunk answers a FETCH as a CHUNK does, its `len` bytes compressed into `packed`
//! bytes with the codec the learner published that version with (`Server.publish(...,
//! compress=)`): the server compresses each version once, in chunks of [`MAX_CHUNK`] raw
//! bytes, and answers a FETCH of exactly one of them (the client asks for no other) with it
//! when it shrank. `packed` is checked against the codec's bound for `len` before anything is
//! allocated, and decompression must yield exactly `len` bytes.
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
use crate::codec::Codec;
use crate::error::EchoError;

/// Client frame: a request for one chunk of the parameters.
pub const FETCH: u8 = 0x32;
/// Server byte: one chunk of the parameters follows.
pub const CHUNK: u8 = 0x06;
/// Server byte: a new version of the parameters was published (its number follows).
pub const VERSION: u8 = 0x07;
/// Server byte: one chunk of the parameters follows, compressed.
pub const PACKED: u8 = 0x08;
/// The version a FETCH asks for to get the parameters' description, not a version of them.
pub const DESCRIPTION: u64 = u64::MAX;
/// The most bytes one chunk carries.
pub const MAX_CHUNK: u32 = 1 << 20;
/// Bytes of a FETCH, its kind byte included.
pub const FETCH_LEN: usize = 1 + 8 + 8 + 4;
/// Bytes of a CHUNK's header, its kind byte included (its bytes follow).
pub const CHUNK_HEADER_LEN: usize = 1 + 8 + 8 + 8 + 4;
/// Bytes of a PACKED chunk's header, its kind byte included (its compressed bytes follow).
pub const PACKED_HEADER_LEN: usize = CHUNK_HEADER_LEN + 1 + 4;
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

/// A CHUNK's or PACKED chunk's header (its bytes follow it on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// The version the bytes are of (0: none published).
    pub version: u64,
    /// Bytes of a whole version.
    pub size: u64,
    /// Where the bytes go in the version.
    pub offset: u64,
    /// How many bytes of the version it carries.
    pub len: u32,
    /// A PACKED chunk: the codec and the compressed bytes that follow (which decompress to
    /// `len`); `None`, a CHUNK: `len` raw bytes follow.
    pub packed: Option<(Codec, u32)>,
}

/// A chunk's header as it goes on the wire: [`CHUNK_HEADER_LEN`] or [`PACKED_HEADER_LEN`]
/// bytes.
#[derive(Debug, Clone, Copy)]
pub struct Header {
    bytes: [u8; PACKED_HEADER_LEN],
    len: usize,
}

impl std::ops::Deref for Header {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl Chunk {
    /// A CHUNK's header: `len` raw bytes of `version` from `offset`.
    pub fn raw(version: u64, size: u64, offset: u64, len: u32) -> Self {
        Self { version, size, offset, len, packed: None }
    }

    /// The header's bytes.
    pub fn encode(&self) -> Header {
        let mut out = [0u8; PACKED_HEADER_LEN];
        out[0] = if self.packed.is_some() { PACKED } else { CHUNK };
        out[1..9].copy_from_slice(&self.version.to_le_bytes());
        out[9..17].copy_from_slice(&self.size.to_le_bytes());
        out[17..25].copy_from_slice(&self.offset.to_le_bytes());
        out[25..29].copy_from_slice(&self.len.to_le_bytes());
        let Some((codec, packed)) = self.packed else {
            return Header { bytes: out, len: CHUNK_HEADER_LEN };
        };
        out[29] = match codec {
            Codec::Zstd { .. } => 1,
            Codec::Lz4 => 2,
        };
        out[30..].copy_from_slice(&packed.to_le_bytes());
        Header { bytes: out, len: PACKED_HEADER_LEN }
    }

    /// The bytes of its header on the wire.
    pub fn header_len(&self) -> usize {
        if self.packed.is_some() {
            PACKED_HEADER_LEN
        } else {
            CHUNK_HEADER_LEN
        }
    }

    /// The bytes that follow its header on the wire.
    pub fn wire_len(&self) -> usize {
        self.packed.map_or(self.len, |(_, packed)| packed) as usize
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
        let header_len = match bytes.first() {
            None => return Ok(None),
            Some(&CHUNK) => CHUNK_HEADER_LEN,
            Some(&PACKED) => PACKED_HEADER_LEN,
            Some(other) => {
                return Err(EchoError::Protocol(format!(
                    "expected a parameter chunk (0x06 or 0x08), got {other:#04x}"
                )))
            }
        };
        let Some(header) = bytes.get(..header_len) else { return Ok(None) };
        let mut reader = Cursor(&header[1..]);
        let mut chunk = Self::raw(reader.u64()?, reader.u64()?, reader.u64()?, reader.u32()?);
        if header_len == PACKED_HEADER_LEN {
            chunk.packed = Some(Self::packing(&mut reader, &chunk, asked)?);
        }
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

    /// A PACKED header's codec and compressed length (after `chunk`'s fields, in `reader`),
    /// checked: it answers a fetch of bytes (not a probe, nor the news that nothing is
    /// published or the version is gone), and its compressed bytes are no more than the
    /// codec's bound for `chunk.len`, nor none.
    fn packing(
        reader: &mut Cursor<'_>,
        chunk: &Self,
        asked: &Fetch,
    ) -> Result<(Codec, u32), EchoError> {
        let codec = match reader.u8()? {
            1 => Codec::Zstd { level: 1 },
            2 => Codec::Lz4,
            other => {
                return Err(EchoError::Protocol(format!(
                    "a compressed parameter chunk with unknown codec {other} (1 zstd, 2 lz4)"
                )))
            }
        };
        let packed = reader.u32()?;
        if chunk.version == 0 || chunk.len == 0 || asked.len == 0 {
            return Err(EchoError::Protocol(format!(
                "a compressed parameter chunk of version {} with {} bytes, answering a fetch \
                 of {}: only bytes asked for come compressed",
                chunk.version, chunk.len, asked.len
            )));
        }
        let bound = codec.bound(chunk.len as usize);
        if packed == 0 || packed as usize > bound {
            return Err(EchoError::Protocol(format!(
                "a parameter chunk of {} bytes compressed into {packed} bytes, expected 1 to \
                 {bound} ({})",
                chunk.len,
                codec.name()
            )));
        }
        Ok((codec, packed))
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
        let chunk = Chunk::raw(3, 64, 0, 16);
        let bytes = chunk.encode();
        for cut in 0..CHUNK_HEADER_LEN {
            assert_eq!(Chunk::parse(&bytes[..cut], &asked, 64).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(Chunk::parse(&bytes, &asked, 64).unwrap(), Some(chunk));
        assert!(!chunk.superseded(&asked));
        // The next chunk of version 3; the answer that version 3 is gone (5 is the latest).
        let next = Fetch { version: 3, offset: 16, len: 16 };
        let gone = Chunk::raw(5, 64, 0, 0);
        let parsed = Chunk::parse(&gone.encode(), &next, 64).unwrap().unwrap();
        assert!(parsed.superseded(&next));
        // What was not asked for is refused: another version, offset, length or size.
        for bad in [
            Chunk { version: 4, offset: 16, ..chunk },
            Chunk { offset: 32, len: 16, ..chunk },
            Chunk { offset: 16, len: 17, ..chunk },
            Chunk { size: 65, offset: 16, len: 16, ..chunk },
        ] {
            assert!(Chunk::parse(&bad.encode(), &next, 64).is_err(), "{bad:?}");
        }
        let mut wrong = bytes.to_vec();
        wrong[0] = VERSION;
        assert!(Chunk::parse(&wrong, &asked, 64).is_err());
        // Nothing published: version 0 with no size and no bytes, and nothing else.
        let none = Chunk::raw(0, 0, 0, 0);
        assert_eq!(Chunk::parse(&none.encode(), &asked, 64).unwrap(), Some(none));
        assert!(none.superseded(&asked));
        let bogus = Chunk { len: 16, ..none };
        assert!(Chunk::parse(&bogus.encode(), &asked, 64).is_err());
    }

    #[test]
    fn a_packed_chunk_answers_only_bytes_asked_for_within_its_codecs_bound() {
        let asked = Fetch { version: 0, offset: 0, len: 4096 };
        let packed = Chunk { packed: Some((Codec::Lz4, 100)), ..Chunk::raw(3, 8192, 0, 4096) };
        let bytes = packed.encode();
        assert_eq!((bytes.len(), bytes[0]), (PACKED_HEADER_LEN, PACKED));
        for cut in 0..PACKED_HEADER_LEN {
            assert_eq!(Chunk::parse(&bytes[..cut], &asked, 8192).unwrap(), None, "cut at {cut}");
        }
        let parsed = Chunk::parse(&bytes, &asked, 8192).unwrap().unwrap();
        assert_eq!(
            (parsed, parsed.header_len(), parsed.wire_len()),
            (packed, PACKED_HEADER_LEN, 100)
        );
        // zstd round-trips as zstd (its level is the learner's business).
        let zstd = Chunk { packed: Some((Codec::Zstd { level: 1 }, 7)), ..packed };
        assert_eq!(Chunk::parse(&zstd.encode(), &asked, 8192).unwrap(), Some(zstd));
        let refused = |chunk: Chunk, asked: &Fetch| {
            Chunk::parse(&chunk.encode(), asked, 8192).unwrap_err().to_string()
        };
        // More than the codec's bound (or nothing) is refused before anything is allocated.
        let bound = Codec::Lz4.bound(4096) as u32;
        let err = refused(Chunk { packed: Some((Codec::Lz4, bound + 1)), ..packed }, &asked);
        assert!(err.contains(&format!("expected 1 to {bound}")), "{err}");
        assert!(
            refused(Chunk { packed: Some((Codec::Lz4, 0)), ..packed }, &asked).contains("0 bytes")
        );
        // Only bytes asked for come compressed: not a probe's answer, nor "gone".
        let probe = Fetch { len: 0, ..asked };
        assert!(refused(packed, &probe).contains("only bytes asked for"));
        let gone = Chunk { len: 0, ..packed };
        assert!(refused(gone, &asked).contains("only bytes asked for"));
        // Another offset, and an unknown codec.
        assert!(refused(Chunk { offset: 4096, ..packed }, &asked).contains("asked for"));
        let mut unknown = bytes.to_vec();
        unknown[CHUNK_HEADER_LEN] = 3;
        let err = Chunk::parse(&unknown, &asked, 8192).unwrap_err().to_string();
        assert!(err.contains("unknown codec 3"), "{err}");
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
