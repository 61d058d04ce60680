//! A ragged batch, laid out as the learner asked:
//!
//! - *packed*: each ragged leaf's rows of the whole batch one after another, `(T, *inner)`,
//!   with `cu_seqlens` (`(B + 1,)` int32) per length group, what variable-length attention
//!   kernels take. A FIFO batch whose rows lie side by side in the arena is a view of it, no
//!   copy; otherwise the rows are gathered once.
//! - *padded*: `(B, L, *inner)` with `L` the batch's longest length rounded up to a multiple,
//!   zeros past each sample's length, its `lengths` (`(B,)` int32) and a `mask` (`(B, L)`).
//!
//! Fixed leaves are `(B, *shape)` in both. Owned parts come from a [`BufPool`] and go back to
//! it once the arrays over them are gone, so a steady learner reuses memory it has touched.

use super::arena::{ArenaMemory, Extent};
use super::spec::RaggedSpec;
use crate::codec::Codec;
use crate::error::EchoError;

/// How a batch's ragged leaves are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchLayout {
    /// Concatenated rows plus `cu_seqlens`.
    Packed,
    /// `(B, L, ...)` plus lengths and a mask; `L` rounded up to a multiple of `multiple`.
    Padded {
        /// Round `L` up to a multiple of this (at least 1).
        multiple: usize,
    },
}

/// What the table picked for a batch: per sample, its extents and rows per column.
#[derive(Debug, Default)]
pub struct Picked {
    pub(crate) columns: usize,
    /// `sample * columns + column`.
    pub(crate) extents: Vec<Extent>,
    pub(crate) rows: Vec<u32>,
    pub(crate) keys: Vec<u64>,
    pub(crate) probabilities: Vec<f64>,
    pub(crate) times_sampled: Vec<u32>,
}

impl Picked {
    pub(crate) fn with_columns(columns: usize) -> Self {
        Self { columns, ..Default::default() }
    }

    pub(crate) fn samples(&self) -> usize {
        self.keys.len()
    }
}

/// Memory of an owned part of a batch: 8-byte aligned (any numpy dtype up to 8 bytes).
#[derive(Debug)]
pub struct OutBuf {
    words: Vec<u64>,
    len: usize,
}

impl OutBuf {
    /// The first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.words.as_mut_ptr().cast()
    }

    /// The bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: `words` holds at least `len` initialised bytes (`take` resized it to
        // `len.div_ceil(8)` words), and `&mut self` makes this the only view of them.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }

    /// The bytes, to read.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes (as in `bytes_mut`).
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Buffers kept for reuse.
const KEEP: usize = 16;

/// Owned batch memory, reused.
#[derive(Debug, Default)]
pub struct BufPool {
    free: parking_lot::Mutex<Vec<Vec<u64>>>,
}

impl BufPool {
    pub(crate) fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self::default())
    }

    /// A buffer of `len` bytes (its contents are whatever it held before).
    fn take(&self, len: usize) -> OutBuf {
        let words = len.div_ceil(8);
        let mut free = self.free.lock();
        // The smallest kept buffer that is large enough.
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= words)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(at, _)| at);
        let mut vec = match best {
            Some(at) => free.swap_remove(at),
            None => Vec::new(),
        };
        drop(free);
        vec.resize(words, 0);
        OutBuf { words: vec, len }
    }

    /// Takes `buf` back for a later batch.
    pub fn give_back(&self, buf: OutBuf) {
        let mut free = self.free.lock();
        if free.len() < KEEP {
            free.push(buf.words);
        } else if let Some(smallest) = free.iter_mut().min_by_key(|v| v.capacity()) {
            if smallest.capacity() < buf.words.capacity() {
                *smallest = buf.words;
            }
        }
    }
}

/// A leaf's bytes in a batch.
#[derive(Debug)]
pub enum ColumnData {
    /// A range of the arena (a FIFO batch's rows side by side): `len` bytes at `addr`.
    View {
        /// The address of the first byte.
        addr: usize,
        /// Bytes.
        len: usize,
    },
    /// Gathered or padded bytes.
    Owned(OutBuf),
}

/// One leaf of a batch.
#[derive(Debug)]
pub struct ColumnBatch {
    /// Its bytes.
    pub data: ColumnData,
    /// The dimensions before the leaf's own (inner) shape: fixed `[B]`, packed `[T]`,
    /// padded `[B, L]`.
    pub lead: Vec<usize>,
}

/// One length group of a batch.
#[derive(Debug)]
pub enum GroupBatch {
    /// Packed: `cu_seqlens[i]..cu_seqlens[i + 1]` are sample `i`'s rows.
    Packed {
        /// `(B + 1,)`, starting at 0.
        cu_seqlens: Vec<i32>,
    },
    /// Padded to `len` rows.
    Padded {
        /// `L`.
        len: usize,
        /// `(B,)`.
        lengths: Vec<i32>,
        /// `(B, L)`: true for real rows.
        mask: Vec<bool>,
    },
}

/// A batch of a ragged table.
#[derive(Debug)]
pub struct RaggedBatch {
    /// 0 for the first batch, then 1, 2, ...
    pub sequence: u64,
    /// Samples in the batch.
    pub samples: usize,
    /// Per leaf.
    pub columns: Vec<ColumnBatch>,
    /// Per length group.
    pub groups: Vec<GroupBatch>,
    /// Per sample: its entry's key (the samples of one group share it, side by side).
    pub keys: Vec<u64>,
    /// Replay: per sample, the probability its entry was drawn with (empty for FIFO).
    pub probabilities: Vec<f64>,
    /// Replay: per sample, its entry's draws including this one (empty for FIFO).
    pub times_sampled: Vec<u32>,
    /// Samples the table held when the batch was made (FIFO: not yet handed out).
    pub store_size: usize,
}

impl RaggedBatch {
    /// Column `c`'s bytes (a fixed leaf's: `samples` values side by side).
    pub fn column_bytes(&self, c: usize) -> &[u8] {
        match &self.columns[c].data {
            ColumnData::Owned(buf) => buf.bytes(),
            // SAFETY: a view is a FIFO batch's range of the arena, which its consumer holds
            // (no writer is handed those bytes) until its next `sample`, and the arena's
            // memory lives as long as the table that made this batch.
            ColumnData::View { addr, len } => unsafe {
                std::slice::from_raw_parts(*addr as *const u8, *len)
            },
        }
    }
}

/// The non-empty extents of column `c`, and whether they lie side by side.
fn column_extents(picked: &Picked, c: usize) -> (Vec<Extent>, bool) {
    let extents: Vec<Extent> = (0..picked.samples())
        .map(|b| picked.extents[b * picked.columns + c])
        .filter(|e| e.bytes > 0)
        .collect();
    let adjacent = extents.windows(2).all(|w| w[0].is_followed_by(&w[1]));
    (extents, adjacent)
}

/// Copies every extent of `extents` one after another into `out` from `at`.
///
/// # Safety
/// Each extent must be the batch's (held by the consumer or pinned), so no writer is handed
/// its bytes during the copy, and `out` must have room.
unsafe fn gather(memory: &ArenaMemory, extents: &[Extent], out: *mut u8) {
    // A replay batch's extents lie anywhere in the arena: the first lines of each are a
    // wait for memory that the copies before it can hide.
    for extent in extents.iter().take(PREFETCH_AHEAD) {
        prefetch(memory, *extent);
    }
    let mut at = 0usize;
    for (i, extent) in extents.iter().enumerate() {
        if let Some(ahead) = extents.get(i + PREFETCH_AHEAD) {
            prefetch(memory, *ahead);
        }
        // SAFETY: by the contract: the source is the batch's live bytes, the destination
        // is an owned buffer with room for all of them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                memory.ptr(*extent),
                out.wrapping_add(at),
                extent.bytes as usize,
            );
        }
        at += extent.bytes as usize;
    }
}

/// How many extents ahead of its copy [`gather`] asks for an extent's first lines.
const PREFETCH_AHEAD: usize = 8;
/// The bytes of an extent asked for ahead (the hardware prefetcher follows the rest).
const PREFETCH_BYTES: usize = 1024;

/// Asks the CPU to bring `extent`'s first lines into its cache: a hint, which reads nothing
/// and can never fault.
#[inline]
fn prefetch(memory: &ArenaMemory, extent: Extent) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = memory.ptr(extent);
        for offset in (0..(extent.bytes as usize).min(PREFETCH_BYTES)).step_by(64) {
            // SAFETY: a prefetch is a hint that neither reads nor faults, whatever the
            // address; SSE (which has it) is part of x86_64's baseline.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    start.wrapping_add(offset).cast::<i8>(),
                );
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (memory, extent);
}

/// Decompresses `extent` (a compressed leaf's sample) into `len` bytes of `out` from `at`.
fn unpack(
    memory: &ArenaMemory,
    codec: Option<Codec>,
    extent: Extent,
    out: &mut OutBuf,
    at: usize,
    len: usize,
) -> Result<(), EchoError> {
    let Some(codec) = codec.filter(|_| len > 0) else { return Ok(()) };
    // SAFETY: the extent is the batch's (held or pinned), so no writer touches its bytes.
    let packed = unsafe { std::slice::from_raw_parts(memory.ptr(extent), extent.bytes as usize) };
    let dst = &mut out.bytes_mut()[at..at + len];
    codec
        .decompress_into(packed, dst)
        .map_err(|why| EchoError::Sample(format!("a stored sample does not decompress: {why}")))
}

/// Lays `picked` out as `layout`. `views`: the extents stay the caller's after this returns
/// (a FIFO batch until the next `sample`), so side-by-side rows may be handed out as views.
///
/// The extents must be the batch's, held or pinned, for the duration of the call.
#[allow(clippy::too_many_arguments)]
pub(crate) fn build(
    spec: &RaggedSpec,
    codecs: &[Option<Codec>],
    memory: &ArenaMemory,
    pool: &BufPool,
    picked: &Picked,
    layout: BatchLayout,
    views: bool,
    sequence: u64,
) -> Result<RaggedBatch, EchoError> {
    let n = picked.samples();
    let ncols = picked.columns;
    let rows = |b: usize, c: usize| picked.rows[b * ncols + c] as usize;
    let mut groups = Vec::with_capacity(spec.groups().len());
    for group in spec.groups() {
        let first = group.columns()[0];
        match layout {
            BatchLayout::Packed => {
                let mut cu = Vec::with_capacity(n + 1);
                let mut total = 0usize;
                cu.push(0);
                for b in 0..n {
                    total += rows(b, first);
                    let at = i32::try_from(total).map_err(|_| {
                        EchoError::Sample(format!(
                            "a packed batch of length group {:?} holds more than {} rows, \
                             beyond int32 cu_seqlens",
                            group.name(),
                            i32::MAX
                        ))
                    })?;
                    cu.push(at);
                }
                groups.push(GroupBatch::Packed { cu_seqlens: cu });
            }
            BatchLayout::Padded { multiple } => {
                let longest = (0..n).map(|b| rows(b, first)).max().unwrap_or(0);
                let len = longest.next_multiple_of(multiple.max(1));
                let lengths: Vec<i32> = (0..n).map(|b| rows(b, first) as i32).collect();
                let mut mask = vec![false; n * len];
                for (b, &l) in lengths.iter().enumerate() {
                    mask[b * len..b * len + l as usize].fill(true);
                }
                groups.push(GroupBatch::Padded { len, lengths, mask });
            }
        }
    }
    let mut columns = Vec::with_capacity(ncols);
    for (c, column) in spec.columns().iter().enumerate() {
        let (extents, adjacent) = column_extents(picked, c);
        let total: usize = extents.iter().map(|e| e.bytes as usize).sum();
        let padded = match (column.group(), &groups) {
            (Some(g), groups) => match &groups[g] {
                GroupBatch::Padded { len, .. } => Some(*len),
                GroupBatch::Packed { .. } => None,
            },
            (None, _) => None,
        };
        let lead = match (column.group(), padded) {
            (None, _) => vec![n],
            (Some(_), None) => vec![(0..n).map(|b| rows(b, c)).sum()],
            (Some(_), Some(len)) => vec![n, len],
        };
        let row = column.row_bytes();
        let codec = codecs.get(c).copied().flatten();
        let data = match padded {
            None if codec.is_some() => {
                let raw: usize = (0..n).map(|b| rows(b, c) * row).sum();
                let mut out = pool.take(raw);
                let mut at = 0;
                for b in 0..n {
                    let len = rows(b, c) * row;
                    unpack(memory, codec, picked.extents[b * ncols + c], &mut out, at, len)?;
                    at += len;
                }
                ColumnData::Owned(out)
            }
            None if views && adjacent && !extents.is_empty() => {
                ColumnData::View { addr: memory.ptr(extents[0]) as usize, len: total }
            }
            None => {
                let mut out = pool.take(total);
                // SAFETY: the extents are the batch's (the caller's contract), `out` has
                // `total` bytes.
                unsafe { gather(memory, &extents, out.as_mut_ptr()) };
                ColumnData::Owned(out)
            }
            Some(len) => {
                let stride = len * row;
                let mut out = pool.take(n * stride);
                let base = out.as_mut_ptr();
                for b in 0..n {
                    let extent = picked.extents[b * ncols + c];
                    let bytes = rows(b, c) * row;
                    let dst = base.wrapping_add(b * stride);
                    if codec.is_some() {
                        unpack(memory, codec, extent, &mut out, b * stride, bytes)?;
                    } else if bytes > 0 {
                        // SAFETY: as above; sample `b`'s `bytes <= stride` bytes go to its row
                        // of the padded buffer (`n * stride` bytes).
                        unsafe { std::ptr::copy_nonoverlapping(memory.ptr(extent), dst, bytes) };
                    }
                    // SAFETY: the rest of that row, inside the buffer, is zeroed.
                    unsafe { std::ptr::write_bytes(dst.wrapping_add(bytes), 0, stride - bytes) };
                }
                ColumnData::Owned(out)
            }
        };
        columns.push(ColumnBatch { data, lead });
    }
    Ok(RaggedBatch {
        sequence,
        samples: n,
        columns,
        groups,
        keys: picked.keys.clone(),
        probabilities: picked.probabilities.clone(),
        times_sampled: if picked.probabilities.is_empty() {
            Vec::new()
        } else {
            picked.times_sampled.clone()
        },
        store_size: 0,
    })
}
