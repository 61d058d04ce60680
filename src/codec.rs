//! Compression of sample leaves: which leaves a table stores compressed ([`LeafCodecs`]), the
//! two codecs ([`Codec`]: zstd, the field's default for ratio, and LZ4, for speed), and the
//! packed form of one item's compressed leaves.
//!
//! Both are the reference C libraries (libzstd through `zstd-safe`, liblz4 through `lz4-sys`),
//! built from source with the crate. For LZ4 that is a measured choice: on preprocessed Atari
//! frames, mostly long runs of one byte, liblz4 decompresses several times faster than the
//! pure-Rust `lz4_flex` (whose matches at offset 1 are copied a byte at a time), and it
//! compresses MsPacman frames to twice the ratio; its `LZ4_decompress_safe` is the decoder
//! liblz4 hardens for untrusted input (never reads or writes outside the buffers it is given).
//!
//! A packed item is one allocation: a header of one little-endian `u32` length per compressed
//! leaf, in leaf order, then those leaves' compressed bytes back to back. Every compressed leaf
//! decompresses to exactly its spec's byte size: decompression writes into a slice of that
//! size and fails, rather than growing anything, when the data claims more (a decompression
//! bomb) or yields less (truncated).
//!
//! Compression runs on the inserting thread before the table lock is taken, so writers
//! compress in parallel, and an insert of more than 256 KiB (a `submit_batch` of image
//! observations) is split over several threads; each thread keeps one zstd context and one
//! scratch buffer.

use std::cell::RefCell;

use crate::error::EchoError;
use crate::source::SampleSource;
use crate::spec::DataSpec;

/// The zstd levels accepted: the fast negative levels down to -7, and 1 to 22 (0 is zstd's
/// "default level", 3; say 3).
pub const ZSTD_LEVELS: (i32, i32) = (-7, 22);

/// The largest leaf LZ4 compresses (liblz4's `LZ4_MAX_INPUT_SIZE`).
pub const LZ4_MAX_INPUT: usize = 0x7E00_0000;

/// Raw bytes per thread when decompression is split over threads: starting a thread costs
/// tens of microseconds, decompressing a MiB a few hundred, so a thread pays off from about
/// a MiB.
pub(crate) const DECOMPRESS_BYTES_PER_THREAD: usize = 1 << 20;

/// Raw bytes per thread when compression is split over threads: compression runs at a third
/// to a half of decompression's speed, so a thread pays off from a quarter of the bytes.
pub(crate) const COMPRESS_BYTES_PER_THREAD: usize = 1 << 18;

/// How many threads (de)compress `raw` bytes made of `items` units of work: one per `per`
/// bytes ([`DECOMPRESS_BYTES_PER_THREAD`], [`COMPRESS_BYTES_PER_THREAD`]), at most `most`
/// and `items`, at least one.
pub(crate) fn threads_for(raw: usize, per: usize, items: usize, most: usize) -> usize {
    (raw / per.max(1)).clamp(1, most.max(1)).min(items.max(1))
}

/// `f(first, part)` for each of `threads` consecutive parts of `items` (`first`: the index
/// of the part's first item), in order: the calling thread takes the first part and a scoped
/// thread each other one. With one thread (or item), one plain call.
pub(crate) fn in_parts<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(usize, &[T]) -> R + Sync,
) -> Vec<R> {
    if threads <= 1 || items.len() <= 1 {
        return vec![f(0, items)];
    }
    let per = items.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let f = &f;
        let mut parts = items.chunks(per).enumerate();
        let (_, mine) = parts.next().expect("two items or more");
        let others: Vec<_> = parts.map(|(p, part)| scope.spawn(move || f(p * per, part))).collect();
        let mut out = Vec::with_capacity(others.len() + 1);
        out.push(f(0, mine));
        // A panic in a part (a broken invariant) goes on up this thread.
        out.extend(
            others.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))),
        );
        out
    })
}

/// How one leaf is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Zstandard at `level`: about 50-70x on Pong or Breakout frames at level 1.
    Zstd {
        /// Compression level, [`ZSTD_LEVELS`].
        level: i32,
    },
    /// LZ4 (block format): about 0.6x zstd-1's ratio, 3-4x its decompression speed.
    Lz4,
}

impl Codec {
    /// The codec's name, as manifests and `repr`s spell it: `"zstd"` or `"lz4"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Zstd { .. } => "zstd",
            Self::Lz4 => "lz4",
        }
    }

    /// The codec's level (`0` for LZ4, which has none).
    pub fn level(self) -> i32 {
        match self {
            Self::Zstd { level } => level,
            Self::Lz4 => 0,
        }
    }

    /// The codec named `name` (as [`Codec::name`] spells it) at `level`.
    ///
    /// # Errors
    /// [`EchoError::Config`] for another name or a level out of range.
    pub fn from_name(name: &str, level: i32) -> Result<Self, EchoError> {
        let codec = match name {
            "zstd" => Self::Zstd { level },
            "lz4" => Self::Lz4,
            other => {
                return Err(EchoError::Config(format!(
                    "unknown codec {other:?}: expected \"zstd\" or \"lz4\""
                )))
            }
        };
        codec.validate()?;
        Ok(codec)
    }

    /// Checks the level.
    ///
    /// # Errors
    /// [`EchoError::Config`] naming the accepted range.
    pub fn validate(self) -> Result<(), EchoError> {
        let (low, high) = ZSTD_LEVELS;
        match self {
            Self::Zstd { level } if level == 0 || level < low || level > high => {
                Err(EchoError::Config(format!(
                    "Zstd(level) must be in {low}..-1 or 1..{high}, got {level}"
                )))
            }
            _ => Ok(()),
        }
    }

    /// The most bytes compressing `raw_len` bytes can take.
    pub fn bound(self, raw_len: usize) -> usize {
        match self {
            Self::Zstd { .. } => zstd_safe::compress_bound(raw_len),
            Self::Lz4 => {
                let len = i32::try_from(raw_len.min(LZ4_MAX_INPUT)).expect("below 2^31");
                // SAFETY: a pure function of its argument (no memory is touched).
                let bound = unsafe { lz4_sys::LZ4_compressBound(len) };
                usize::try_from(bound).unwrap_or(0)
            }
        }
    }

    /// A cheap check that `packed` can be this codec's data for `raw_len` bytes: a zstd frame
    /// must declare exactly that size (LZ4 blocks declare nothing: always `true`).
    pub fn plausible(self, packed: &[u8], raw_len: usize) -> bool {
        match self {
            Self::Zstd { .. } => {
                matches!(zstd_safe::get_frame_content_size(packed), Ok(Some(n)) if n == raw_len as u64)
            }
            Self::Lz4 => true,
        }
    }

    /// Compresses `raw` and appends the result to `out`.
    ///
    /// The codec writes into this thread's scratch buffer (sized once for the worst case), and
    /// only the compressed bytes are copied to `out`: `out` grows by what it keeps, with no
    /// worst-case allocation or zeroing per call.
    pub fn compress_append(self, raw: &[u8], out: &mut Vec<u8>) {
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let bound = self.bound(raw.len());
            if scratch.len() < bound {
                scratch.resize(bound, 0);
            }
            let dst = &mut scratch[..bound];
            let written = match self {
                Self::Zstd { level } => ZSTD.with(|cell| {
                    let mut contexts = cell.borrow_mut();
                    let cctx = contexts.0.get_or_insert_with(zstd_safe::CCtx::create);
                    cctx.compress(dst, raw, level)
                        .expect("a destination of compress_bound bytes is always large enough")
                }),
                Self::Lz4 => lz4_compress(raw, dst),
            };
            out.extend_from_slice(&scratch[..written]);
        });
    }

    /// Decompresses `packed` into `dst`, which it must fill exactly.
    ///
    /// # Errors
    /// What is wrong with `packed`: not valid data for this codec, more bytes than `dst` holds
    /// (nothing is written past `dst`), or fewer.
    pub fn decompress_into(self, packed: &[u8], dst: &mut [u8]) -> Result<(), String> {
        let expected = dst.len();
        let written = match self {
            Self::Zstd { .. } => {
                // A frame that declares its size is checked before any work: a bomb that
                // claims more than the leaf is refused at once.
                match zstd_safe::get_frame_content_size(packed) {
                    Ok(Some(claimed)) if claimed != expected as u64 => {
                        return Err(format!(
                            "zstd frame declares {claimed} bytes, the leaf holds {expected}"
                        ))
                    }
                    Err(_) => return Err("not a zstd frame".to_owned()),
                    Ok(_) => {}
                }
                ZSTD.with(|cell| {
                    let mut contexts = cell.borrow_mut();
                    let dctx = contexts.1.get_or_insert_with(zstd_safe::DCtx::create);
                    dctx.decompress(dst, packed).map_err(|code| {
                        format!("zstd: {} (the leaf holds {expected} bytes)", zstd_error(code))
                    })
                })?
            }
            Self::Lz4 => lz4_decompress(packed, dst).ok_or_else(|| {
                format!("lz4: malformed block, or more than the leaf's {expected} bytes")
            })?,
        };
        if written != expected {
            return Err(format!(
                "{} data decompressed to {written} bytes, the leaf holds {expected}",
                self.name()
            ));
        }
        Ok(())
    }
}

/// Compresses `raw` (at most [`LZ4_MAX_INPUT`] bytes, checked by [`LeafCodecs::new`]) into
/// `dst` (at least `LZ4_compressBound` bytes); returns the compressed length.
fn lz4_compress(raw: &[u8], dst: &mut [u8]) -> usize {
    let src_len = i32::try_from(raw.len()).expect("a leaf LZ4 compresses is below 2^31 bytes");
    let capacity = i32::try_from(dst.len()).unwrap_or(i32::MAX);
    // SAFETY: `raw` holds `src_len` readable bytes and `dst` at least `capacity` writable
    // ones; liblz4 reads and writes only within those bounds and keeps no pointer after it
    // returns (its state lives on its own stack).
    let written = unsafe {
        lz4_sys::LZ4_compress_default(
            raw.as_ptr().cast(),
            dst.as_mut_ptr().cast(),
            src_len,
            capacity,
        )
    };
    usize::try_from(written)
        .ok()
        .filter(|&n| n > 0 || raw.is_empty())
        .expect("a destination of LZ4_compressBound bytes is always large enough")
}

/// Decompresses the LZ4 block `packed` (untrusted) into `dst`; the bytes written, or `None`
/// for a malformed block or one that would not fit `dst`.
fn lz4_decompress(packed: &[u8], dst: &mut [u8]) -> Option<usize> {
    let src_len = i32::try_from(packed.len()).ok()?;
    let capacity = i32::try_from(dst.len()).ok()?;
    // SAFETY: `packed` holds `src_len` readable bytes and `dst` `capacity` writable ones.
    // `LZ4_decompress_safe` is liblz4's decoder for untrusted input: it never reads past
    // `src_len` bytes of the source nor writes past `capacity` bytes of the destination, and
    // returns a negative number for a malformed block or one that does not fit.
    let written = unsafe {
        lz4_sys::LZ4_decompress_safe(
            packed.as_ptr().cast(),
            dst.as_mut_ptr().cast(),
            src_len,
            capacity,
        )
    };
    usize::try_from(written).ok()
}

fn zstd_error(code: usize) -> &'static str {
    zstd_safe::get_error_name(code)
}

thread_local! {
    /// This thread's zstd compression and decompression contexts (made on first use; a
    /// context is reused across calls, which is most of zstd's speed on small inputs).
    static ZSTD: RefCell<(Option<zstd_safe::CCtx<'static>>, Option<zstd_safe::DCtx<'static>>)> =
        const { RefCell::new((None, None)) };
    /// Where a leaf is copied before compression (a source may not lend its bytes).
    static RAW: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// Where a codec compresses to: the worst case for the largest leaf this thread compressed.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// Where an item is packed before it gets its own allocation of exactly its size.
    static ITEM: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Which leaves of a layout are stored compressed, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafCodecs {
    /// One entry per leaf of the layout.
    codecs: Box<[Option<Codec>]>,
    /// The raw byte size of each leaf.
    sizes: Box<[usize]>,
    /// Where each leaf lies in a raw payload (every leaf back to back).
    ranges: Box<[std::ops::Range<usize>]>,
    /// The compressed leaves, in leaf order.
    packed: Box<[usize]>,
}

impl LeafCodecs {
    /// No leaf compressed.
    pub fn none(spec: &DataSpec) -> Self {
        Self::new(spec, vec![None; spec.len()]).expect("no codec is always valid")
    }

    /// `codecs[l]` for leaf `l` of `spec`.
    ///
    /// # Errors
    /// [`EchoError::Config`] if the lengths differ, a level is out of range, or a leaf to
    /// compress is empty.
    pub fn new(spec: &DataSpec, codecs: Vec<Option<Codec>>) -> Result<Self, EchoError> {
        if codecs.len() != spec.len() {
            return Err(EchoError::Config(format!(
                "one codec (or none) per leaf: the layout has {} leaves, got {}",
                spec.len(),
                codecs.len()
            )));
        }
        let sizes: Box<[usize]> = spec.arrays().iter().map(|a| a.num_bytes()).collect();
        for (leaf, codec) in codecs.iter().enumerate() {
            if let Some(codec) = codec {
                codec.validate()?;
                let most = match codec {
                    Codec::Zstd { .. } => u32::MAX as usize,
                    Codec::Lz4 => LZ4_MAX_INPUT,
                };
                if sizes[leaf] == 0 || sizes[leaf] > most {
                    return Err(EchoError::Config(format!(
                        "leaf {leaf} holds {} bytes: a leaf {} compresses holds 1 to {most}",
                        sizes[leaf],
                        codec.name()
                    )));
                }
            }
        }
        let packed = (0..codecs.len()).filter(|&l| codecs[l].is_some()).collect();
        let ranges = (0..spec.len()).map(|leaf| spec.leaf_range(leaf)).collect();
        Ok(Self { codecs: codecs.into_boxed_slice(), sizes, ranges, packed })
    }

    /// Whether no leaf is compressed.
    pub fn is_empty(&self) -> bool {
        self.packed.is_empty()
    }

    /// The codec of `leaf`, if it is compressed.
    pub fn get(&self, leaf: usize) -> Option<Codec> {
        self.codecs[leaf]
    }

    /// One entry per leaf.
    pub fn as_slice(&self) -> &[Option<Codec>] {
        &self.codecs
    }

    /// The compressed leaves, in leaf order.
    pub fn packed_leaves(&self) -> &[usize] {
        &self.packed
    }

    /// Raw bytes of one item's compressed leaves.
    pub fn raw_packed_bytes(&self) -> usize {
        self.packed.iter().map(|&l| self.sizes[l]).sum()
    }

    /// Compresses the compressed leaves of sample `sample` of `src` into one packed item.
    /// The source's sizes must have been validated.
    pub fn pack<S: SampleSource + ?Sized>(&self, src: &S, sample: usize) -> Box<[u8]> {
        ITEM.with(|item| {
            let mut item = item.borrow_mut();
            item.clear();
            self.pack_into(src, sample, &mut item);
            Box::from(&item[..])
        })
    }

    /// [`LeafCodecs::pack`], appending the packed item to `out`.
    pub fn pack_into<S: SampleSource + ?Sized>(&self, src: &S, sample: usize, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + 4 * self.packed.len(), 0);
        // A source of plain memory is compressed where it lies; any other (a shared-memory
        // ring another process may write) is copied out first.
        let plain = src.shared();
        RAW.with(|raw| {
            let mut raw = raw.borrow_mut();
            for (k, &leaf) in self.packed.iter().enumerate() {
                let codec = self.codecs[leaf].expect("a packed leaf has a codec");
                let bytes = match plain {
                    Some(plain) => plain.leaf(sample, leaf),
                    None => {
                        raw.resize(self.sizes[leaf], 0);
                        src.copy_leaf(sample, leaf, &mut raw);
                        &raw[..]
                    }
                };
                let before = out.len();
                codec.compress_append(bytes, out);
                let len = u32::try_from(out.len() - before).expect("bounded by 2^32 - 1 raw bytes");
                out[start + 4 * k..start + 4 * k + 4].copy_from_slice(&len.to_le_bytes());
            }
        });
    }

    /// Packs an item from raw bytes of any length per compressed leaf (a sequence table's
    /// chunk of steps): `with_raw(k, compress)` calls `compress` once with the raw bytes of
    /// compressed leaf number `k`. Returns `finish` of the packed item (the layout of
    /// [`LeafCodecs::pack`]), built in a per-thread buffer.
    pub fn pack_with<R>(
        &self,
        mut with_raw: impl FnMut(usize, &mut dyn FnMut(&[u8])),
        finish: impl FnOnce(&[u8]) -> R,
    ) -> R {
        ITEM.with(|item| {
            let mut out = item.borrow_mut();
            out.clear();
            out.resize(4 * self.packed.len(), 0);
            for (k, &leaf) in self.packed.iter().enumerate() {
                let codec = self.codecs[leaf].expect("a packed leaf has a codec");
                let before = out.len();
                with_raw(k, &mut |raw| codec.compress_append(raw, &mut out));
                let len = u32::try_from(out.len() - before).expect("bounded by 2^32 - 1 raw bytes");
                out[4 * k..4 * k + 4].copy_from_slice(&len.to_le_bytes());
            }
            finish(&out)
        })
    }

    /// Appends the body of a compressed wire frame for sample `sample` of `src` to `out`:
    /// the leaves left raw, in order, then the packed item.
    pub fn pack_body<S: SampleSource + ?Sized>(&self, src: &S, sample: usize, out: &mut Vec<u8>) {
        for leaf in 0..self.codecs.len() {
            if self.codecs[leaf].is_none() {
                let start = out.len();
                out.resize(start + self.sizes[leaf], 0);
                src.copy_leaf(sample, leaf, &mut out[start..]);
            }
        }
        self.pack_into(src, sample, out);
    }

    /// The most bytes a compressed frame's body may have: the raw leaves, the packed item's
    /// header and each compressed leaf's worst case.
    pub fn max_body(&self) -> usize {
        let raw: usize = (0..self.codecs.len())
            .filter(|&l| self.codecs[l].is_none())
            .map(|l| self.sizes[l])
            .sum();
        let packed: usize = self.packed.iter().map(|&l| self.bound(l)).sum();
        raw + 4 * self.packed.len() + packed
    }

    fn bound(&self, leaf: usize) -> usize {
        self.codecs[leaf].expect("a packed leaf has a codec").bound(self.sizes[leaf])
    }

    /// Decodes a compressed frame's body (untrusted bytes) into `payload` (one raw sample,
    /// every leaf back to back): the raw leaves copied, the compressed ones decompressed into
    /// exactly their place. Returns where the packed item starts in `body` (what a table that
    /// stores these leaves compressed keeps as it is).
    ///
    /// # Errors
    /// What is wrong with the body: too short for the raw leaves or the packed header, lengths
    /// that do not add up, a leaf that does not decompress to exactly its size. Nothing is
    /// allocated beyond `payload`, whatever the body claims.
    pub fn unpack_body(&self, body: &[u8], payload: &mut [u8]) -> Result<usize, String> {
        if payload.len() != self.ranges.last().map_or(0, |r| r.end) {
            return Err(format!("a payload of {} bytes for this layout", payload.len()));
        }
        let mut at = 0;
        for leaf in 0..self.codecs.len() {
            if self.codecs[leaf].is_some() {
                continue;
            }
            let size = self.sizes[leaf];
            let bytes = body.get(at..at + size).ok_or_else(|| {
                format!("the body ends inside raw leaf {leaf} ({} bytes)", body.len())
            })?;
            payload[self.ranges[leaf].clone()].copy_from_slice(bytes);
            at += size;
        }
        let item = &body[at..];
        for k in 0..self.packed.len() {
            let range = self.ranges[self.packed[k]].clone();
            self.unpack_into(item, k, &mut payload[range])?;
        }
        Ok(at)
    }

    /// Checks a packed item's header against its length.
    ///
    /// # Errors
    /// What does not add up.
    pub fn check_item(&self, item: &[u8]) -> Result<(), String> {
        let header = 4 * self.packed.len();
        if item.len() < header {
            return Err(format!(
                "a packed item of {} bytes has no room for its header",
                item.len()
            ));
        }
        let total: u64 = (0..self.packed.len()).map(|k| u64::from(item_len(item, k))).sum();
        if total != (item.len() - header) as u64 {
            return Err(format!(
                "the header claims {total} compressed bytes, the item has {}",
                item.len() - header
            ));
        }
        Ok(())
    }

    /// Decompresses compressed leaf number `k` (of [`LeafCodecs::packed_leaves`]) of `item`
    /// into `dst` (the leaf's raw size).
    ///
    /// # Errors
    /// What is wrong with the item.
    pub fn unpack_into(&self, item: &[u8], k: usize, dst: &mut [u8]) -> Result<(), String> {
        let bytes = self.packed_leaf(item, k)?;
        let leaf = self.packed[k];
        let codec = self.codecs[leaf].expect("a packed leaf has a codec");
        codec.decompress_into(bytes, dst).map_err(|msg| format!("leaf {leaf}: {msg}"))
    }

    /// The compressed bytes of compressed leaf number `k` of `item`.
    ///
    /// # Errors
    /// If the header does not fit the item ([`LeafCodecs::check_item`]).
    pub fn packed_leaf<'a>(&self, item: &'a [u8], k: usize) -> Result<&'a [u8], String> {
        self.check_item(item)?;
        let mut at = 4 * self.packed.len();
        for j in 0..k {
            at += item_len(item, j) as usize;
        }
        Ok(&item[at..at + item_len(item, k) as usize])
    }

    /// Checks that every compressed leaf of `item` decompresses to exactly its size.
    ///
    /// # Errors
    /// The first problem found.
    pub fn verify(&self, item: &[u8]) -> Result<(), String> {
        RAW.with(|raw| {
            let mut raw = raw.borrow_mut();
            for k in 0..self.packed.len() {
                raw.resize(self.sizes[self.packed[k]], 0);
                self.unpack_into(item, k, &mut raw)?;
            }
            Ok(())
        })
    }
}

fn item_len(item: &[u8], k: usize) -> u32 {
    u32::from_le_bytes(item[4 * k..4 * k + 4].try_into().expect("4 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Leaves;
    use crate::spec::ArraySpec;

    fn frame(seed: u8) -> Vec<u8> {
        // Flat regions with a few edges, like a preprocessed Atari frame.
        (0..84 * 84)
            .map(|i: usize| if (i / 84 + seed as usize) % 21 < 3 { 200 } else { 40 })
            .collect()
    }

    fn spec() -> DataSpec {
        DataSpec::new(vec![
            ArraySpec::new(vec![84, 84], 1).unwrap(),
            ArraySpec::new(vec![], 8).unwrap(),
            ArraySpec::new(vec![84, 84], 1).unwrap(),
        ])
        .unwrap()
    }

    #[test]
    fn both_codecs_round_trip_bit_exact_and_compress_frames() {
        for codec in [Codec::Zstd { level: 1 }, Codec::Zstd { level: -3 }, Codec::Lz4] {
            let raw = frame(3);
            let mut packed = Vec::new();
            codec.compress_append(&raw, &mut packed);
            assert!(packed.len() * 8 < raw.len(), "{codec:?}: {} bytes", packed.len());
            let mut back = vec![0; raw.len()];
            codec.decompress_into(&packed, &mut back).unwrap();
            assert_eq!(back, raw, "{codec:?}");
        }
    }

    #[test]
    fn truncated_oversized_and_foreign_data_are_errors_not_panics() {
        for codec in [Codec::Zstd { level: 1 }, Codec::Lz4] {
            let raw = frame(1);
            let mut packed = Vec::new();
            codec.compress_append(&raw, &mut packed);
            let mut small = vec![0; raw.len() - 1];
            let err = codec.decompress_into(&packed, &mut small).unwrap_err();
            assert!(err.contains(&format!("{}", raw.len() - 1)), "{codec:?}: {err}");
            let mut big = vec![0; raw.len() + 1];
            assert!(codec.decompress_into(&packed, &mut big).is_err(), "{codec:?}: too short");
            let mut dst = vec![0; raw.len()];
            for cut in [0, 1, packed.len() / 2, packed.len() - 1] {
                assert!(codec.decompress_into(&packed[..cut], &mut dst).is_err(), "cut {cut}");
            }
            assert!(codec.decompress_into(&[0xff; 64], &mut dst).is_err(), "{codec:?}: garbage");
        }
    }

    #[test]
    fn a_zstd_bomb_is_refused_by_its_declared_size() {
        let raw = vec![0u8; 1 << 20];
        let mut packed = Vec::new();
        Codec::Zstd { level: 1 }.compress_append(&raw, &mut packed);
        let mut dst = vec![0; 7056];
        let err = Codec::Zstd { level: 1 }.decompress_into(&packed, &mut dst).unwrap_err();
        assert!(err.contains("declares 1048576 bytes"), "{err}");
    }

    #[test]
    fn levels_and_empty_leaves_are_checked() {
        assert!(Codec::Zstd { level: 0 }.validate().is_err());
        assert!(Codec::Zstd { level: 23 }.validate().is_err());
        assert!(Codec::Zstd { level: -8 }.validate().is_err());
        assert!(Codec::from_name("snappy", 1).is_err());
        let empty = DataSpec::new(vec![
            ArraySpec::new(vec![0], 1).unwrap(),
            ArraySpec::new(vec![], 1).unwrap(),
        ])
        .unwrap();
        assert!(LeafCodecs::new(&empty, vec![Some(Codec::Lz4), None]).is_err());
        assert!(LeafCodecs::new(&spec(), vec![None]).is_err());
    }

    #[test]
    fn a_packed_item_holds_each_compressed_leaf_in_order() {
        let spec = spec();
        let codecs =
            LeafCodecs::new(&spec, vec![Some(Codec::Zstd { level: 1 }), None, Some(Codec::Lz4)])
                .unwrap();
        let (a, b, c) = (frame(1), 7u64.to_le_bytes(), frame(9));
        let item = codecs.pack(&Leaves(&[&a, &b, &c]), 0);
        codecs.verify(&item).unwrap();
        let mut out = vec![0; a.len()];
        codecs.unpack_into(&item, 0, &mut out).unwrap();
        assert_eq!(out, a);
        codecs.unpack_into(&item, 1, &mut out).unwrap();
        assert_eq!(out, c);
        let mut bad = item.to_vec();
        bad[0] ^= 1;
        assert!(codecs.verify(&bad).is_err());
        assert!(codecs.verify(&item[..3]).is_err());
    }
}
