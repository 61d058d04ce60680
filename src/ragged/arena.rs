//! The bytes of a ragged table: one pre-allocated region cut into equal *blocks*, shared by
//! every column.
//!
//! Each column appends its samples' bytes to a block of its own (its *head*); when the head
//! is full it takes a free block. A block counts the extents in it (and the head's own claim,
//! and the pins of batches being copied out of it); at zero it goes back on the free stack.
//! So samples removed in any order give their memory back block by block, a column's
//! consecutive samples lie side by side (a FIFO batch of them is one contiguous range), and
//! the memory taken is the live bytes plus at most one partly filled block per column and the
//! tail each block could not fit.
//!
//! Free blocks are a stack: the block freed last is reused first, so a table that never fills
//! its region only ever touches (and so only takes from the OS) the blocks it needs at once.
//! The region is an anonymous mapping whose pages cost memory only once written.

use crate::error::EchoError;
use crate::slots::Buffer;

/// Where one sample's bytes of one column lie. `block == EMPTY` for no bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    pub(crate) block: u32,
    pub(crate) offset: u32,
    pub(crate) bytes: u32,
}

/// The block of an extent with no bytes.
pub(crate) const EMPTY: u32 = u32::MAX;

impl Extent {
    pub(crate) const NONE: Self = Self { block: EMPTY, offset: 0, bytes: 0 };

    /// Whether `next` starts where this one ends, in the same block.
    pub(crate) fn is_followed_by(&self, next: &Extent) -> bool {
        next.bytes == 0
            || (self.block == next.block
                && self.offset as usize + self.bytes as usize == next.offset as usize)
    }
}

/// The region itself; shared with the numpy views into it, which keep it mapped.
#[derive(Debug)]
pub(crate) struct ArenaMemory {
    buffer: Buffer,
    block_bytes: usize,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes)", self.len())
    }
}

impl ArenaMemory {
    /// The first byte of `extent` (dangling for an empty one).
    pub(crate) fn ptr(&self, extent: Extent) -> *mut u8 {
        if extent.block == EMPTY {
            return self.buffer.as_mut_ptr();
        }
        let at = extent.block as usize * self.block_bytes + extent.offset as usize;
        debug_assert!(at + extent.bytes as usize <= self.buffer.len());
        // SAFETY: `at` is inside the region (an extent is handed out only inside a block).
        unsafe { self.buffer.as_mut_ptr().add(at) }
    }
}

#[derive(Debug, Clone, Copy)]
struct Head {
    block: u32,
    used: usize,
}

/// The blocks' bookkeeping (behind the table's lock).
#[derive(Debug)]
pub(crate) struct Arena {
    memory: std::sync::Arc<ArenaMemory>,
    block_bytes: usize,
    blocks: usize,
    free: Vec<u32>,
    refs: Vec<u32>,
    heads: Vec<Option<Head>>,
    live_bytes: usize,
}

fn align_up(at: usize, align: usize) -> usize {
    at.div_ceil(align.max(1)) * align.max(1)
}

/// The preferred block size: large enough that a block's unfillable tail is small against it.
const BLOCK_BYTES: usize = 1 << 20;

impl Arena {
    /// A region of about `total` bytes for `columns` columns whose largest sample is
    /// `largest` bytes.
    ///
    /// # Errors
    /// [`EchoError::Config`] if `total` cannot hold a block per column and one more of the
    /// largest sample, or a sample exceeds 4 GiB; [`EchoError::OutOfMemory`] if the region
    /// cannot be mapped.
    pub(crate) fn new(total: usize, columns: usize, largest: usize) -> Result<Self, EchoError> {
        if largest > u32::MAX as usize / 2 {
            return Err(EchoError::Config(format!(
                "one leaf of one sample may take up to {largest} bytes (max_len x its row's \
                 bytes); the most is {} (2 GiB - 1)",
                u32::MAX / 2
            )));
        }
        let floor = align_up(largest.max(1), 64);
        // Prefer 1 MiB blocks, but keep at least 4 per column where the region is small.
        let wanted = (total / (4 * columns.max(1))).clamp(4096, BLOCK_BYTES);
        let block_bytes = align_up(wanted.max(floor), 64);
        let blocks = total / block_bytes;
        if blocks < columns + 1 {
            return Err(EchoError::Config(format!(
                "max_bytes {total} is too small: {columns} leaves whose largest sample takes \
                 up to {largest} bytes need at least {} bytes",
                (columns + 1) * block_bytes
            )));
        }
        let memory = Buffer::with_prefault(block_bytes, blocks)?;
        Ok(Self {
            memory: std::sync::Arc::new(ArenaMemory { buffer: memory, block_bytes }),
            block_bytes,
            blocks,
            free: (0..blocks as u32).rev().collect(),
            refs: vec![0; blocks],
            heads: vec![None; columns],
            live_bytes: 0,
        })
    }

    pub(crate) fn memory(&self) -> &std::sync::Arc<ArenaMemory> {
        &self.memory
    }

    /// Bytes of one block.
    pub(crate) fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Bytes of the blocks in use (the region's memory that holds, or held, live samples).
    pub(crate) fn bytes_in_use(&self) -> usize {
        (self.blocks - self.free.len()) * self.block_bytes
    }

    /// Bytes of the live extents.
    pub(crate) fn live_bytes(&self) -> usize {
        self.live_bytes
    }

    /// Bytes the region spans.
    pub(crate) fn capacity(&self) -> usize {
        self.blocks * self.block_bytes
    }

    /// How many free blocks `demands` (column, bytes, alignment), allocated in that order,
    /// would take, and whether they fit now.
    pub(crate) fn fits(&self, demands: &[(usize, usize, usize)]) -> bool {
        let mut heads: Vec<Option<usize>> = self.heads.iter().map(|h| h.map(|h| h.used)).collect();
        let mut fresh = 0usize;
        for &(column, bytes, align) in demands {
            if bytes == 0 {
                continue;
            }
            let fits_head =
                heads[column].is_some_and(|used| align_up(used, align) + bytes <= self.block_bytes);
            if fits_head {
                let used = heads[column].unwrap_or(0);
                heads[column] = Some(align_up(used, align) + bytes);
            } else {
                fresh += 1;
                heads[column] = Some(bytes);
            }
        }
        fresh <= self.free.len()
    }

    /// Whether `demands` (as [`Arena::fits`]) would fit with every extent gone: each column
    /// keeps its head (a head changes only by allocation), every other block is free, and
    /// a head that a column leaves for a fresh block comes free just after (its last
    /// claim). An entry that fails this can never be stored, whatever is evicted.
    pub(crate) fn fits_alone(&self, demands: &[(usize, usize, usize)]) -> bool {
        // Per column: its head's bytes used, and whether this entry's bytes are in it.
        let mut heads: Vec<Option<(usize, bool)>> =
            self.heads.iter().map(|h| h.map(|h| (h.used, false))).collect();
        let mut free = self.blocks - heads.iter().flatten().count();
        for &(column, bytes, align) in demands {
            if bytes == 0 {
                continue;
            }
            match heads[column] {
                Some((used, _)) if align_up(used, align) + bytes <= self.block_bytes => {
                    heads[column] = Some((align_up(used, align) + bytes, true));
                }
                old => {
                    if free == 0 {
                        return false;
                    }
                    free -= 1;
                    // A head left with none of this entry's bytes comes free after.
                    if old.is_some_and(|(_, own)| !own) {
                        free += 1;
                    }
                    heads[column] = Some((bytes, true));
                }
            }
        }
        true
    }

    /// Room for `bytes` of `column` aligned to `align`, or `None` when no block is free.
    pub(crate) fn alloc(&mut self, column: usize, bytes: usize, align: usize) -> Option<Extent> {
        if bytes == 0 {
            return Some(Extent::NONE);
        }
        debug_assert!(bytes <= self.block_bytes);
        let offset = match self.heads[column] {
            Some(head) if align_up(head.used, align) + bytes <= self.block_bytes => {
                align_up(head.used, align)
            }
            old => {
                let block = self.free.pop()?;
                // Blocks are first taken in order of their index: the prefault thread keeps
                // the pages ahead of the highest populated.
                self.memory.buffer.note(block as usize);
                self.refs[block as usize] = 1; // the head's own claim
                if let Some(old) = old {
                    self.unref(old.block);
                }
                self.heads[column] = Some(Head { block, used: 0 });
                0
            }
        };
        let head = self.heads[column].as_mut()?;
        head.used = offset + bytes;
        self.refs[head.block as usize] += 1;
        self.live_bytes += bytes;
        Some(Extent { block: head.block, offset: offset as u32, bytes: bytes as u32 })
    }

    /// Keeps `extent`'s block from reuse until [`Arena::unpin`] (a batch being copied out).
    pub(crate) fn pin(&mut self, extent: Extent) {
        if extent.block != EMPTY {
            self.refs[extent.block as usize] += 1;
        }
    }

    /// Ends a [`Arena::pin`].
    pub(crate) fn unpin(&mut self, extent: Extent) {
        if extent.block != EMPTY {
            self.unref(extent.block);
        }
    }

    /// Gives an extent back.
    pub(crate) fn release(&mut self, extent: Extent) {
        if extent.block != EMPTY {
            self.live_bytes -= extent.bytes as usize;
            self.unref(extent.block);
        }
    }

    fn unref(&mut self, block: u32) {
        let refs = &mut self.refs[block as usize];
        debug_assert!(*refs > 0);
        *refs -= 1;
        if *refs == 0 {
            self.free.push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_column_fills_its_block_side_by_side_then_takes_another() {
        let mut arena = Arena::new(16 * 4096, 2, 1000).unwrap();
        let block = arena.block_bytes();
        assert_eq!(block, 8192);
        let a = arena.alloc(0, 1000, 4).unwrap();
        let b = arena.alloc(0, 1000, 4).unwrap();
        assert!(a.is_followed_by(&b));
        let c = arena.alloc(1, 6, 2).unwrap();
        assert_ne!(c.block, a.block);
        // Fill column 0's block: the 9th sample of 1000 bytes does not fit in 8192.
        let mut last = b;
        for _ in 0..6 {
            last = arena.alloc(0, 1000, 4).unwrap();
        }
        let next = arena.alloc(0, 1000, 4).unwrap();
        assert_ne!(next.block, last.block);
        assert!(!last.is_followed_by(&next));
        assert_eq!(arena.live_bytes(), 9 * 1000 + 6);
        assert_eq!(arena.bytes_in_use(), 3 * block);
    }

    #[test]
    fn blocks_come_back_when_their_last_extent_goes_and_are_reused_first() {
        let mut arena = Arena::new(4 * 4096, 1, 3000).unwrap();
        assert_eq!(arena.block_bytes(), 4096);
        let a = arena.alloc(0, 3000, 1).unwrap();
        let b = arena.alloc(0, 3000, 1).unwrap();
        assert_ne!(a.block, b.block);
        arena.pin(a);
        arena.release(a);
        // Still pinned: not free yet.
        assert_eq!(arena.bytes_in_use(), 2 * 4096);
        arena.unpin(a);
        assert_eq!(arena.bytes_in_use(), 4096);
        // The block freed last is the next one taken.
        let c = arena.alloc(0, 3000, 1).unwrap();
        assert_eq!(c.block, a.block);
        assert_eq!(arena.live_bytes(), 6000);
    }

    #[test]
    fn a_large_arena_written_while_its_prefault_thread_runs_ahead_keeps_every_byte() {
        // 96 MiB of 1 MiB blocks: mapped, with a prefault thread populating the pages ahead
        // of the highest block taken while these writes go on.
        let mut arena = Arena::new(96 << 20, 2, 64 << 10).unwrap();
        assert_eq!(arena.block_bytes(), 1 << 20);
        let memory = std::sync::Arc::clone(arena.memory());
        let mut written = Vec::new();
        for i in 0..1400u32 {
            let column = (i % 2) as usize;
            let extent = arena.alloc(column, 60_000, 4).unwrap();
            // SAFETY: a fresh extent of 60,000 bytes in the arena, written only here.
            let bytes = unsafe { std::slice::from_raw_parts_mut(memory.ptr(extent), 60_000) };
            bytes.fill((i % 251) as u8);
            written.push((i, extent));
        }
        assert!(arena.bytes_in_use() > 80 << 20, "the writes reach past the first window");
        for (i, extent) in written {
            // SAFETY: as above; nothing writes the arena any more.
            let bytes = unsafe { std::slice::from_raw_parts(memory.ptr(extent), 60_000) };
            assert!(bytes.iter().all(|&b| b == (i % 251) as u8), "extent {i}");
        }
    }

    #[test]
    fn fits_plans_fresh_blocks_and_alloc_fails_without_one() {
        let mut arena = Arena::new(3 * 4096, 2, 4096).unwrap();
        assert!(arena.fits(&[(0, 4096, 1), (1, 10, 1)]));
        assert!(arena.fits(&[(0, 4096, 1), (0, 4096, 1), (1, 1, 1)]));
        assert!(!arena.fits(&[(0, 4096, 1), (0, 4096, 1), (1, 1, 1), (1, 4096, 1)]));
        for _ in 0..3 {
            arena.alloc(0, 4096, 1).unwrap();
        }
        assert!(arena.alloc(1, 1, 1).is_none());
        assert_eq!(arena.alloc(1, 0, 1), Some(Extent::NONE));
        assert!(Arena::new(4096, 2, 4096).is_err());
    }

    #[test]
    fn fits_alone_counts_the_heads_that_stay_and_the_ones_left_behind() {
        let mut arena = Arena::new(3 * 4096, 2, 4096).unwrap();
        assert!(arena.fits_alone(&[(0, 4096, 1), (0, 4096, 1), (0, 4096, 1)]));
        assert!(!arena.fits_alone(&[(0, 4096, 1), (0, 4096, 1), (0, 4096, 1), (1, 1, 1)]));
        arena.alloc(1, 10, 1).unwrap();
        // Column 1's head stays (3 blocks, 1 taken by it); its room takes 4000 more.
        assert!(arena.fits_alone(&[(0, 4096, 1), (0, 4096, 1), (1, 4000, 1)]));
        assert!(!arena.fits_alone(&[(0, 4096, 1), (0, 4096, 1), (0, 4096, 1)]));
        // Leaving column 1's head for a fresh block frees it (none of the entry is in it).
        assert!(arena.fits_alone(&[(1, 4096, 1), (0, 4096, 1), (0, 4096, 1)]));
        // ... but not a head that holds the entry's own first bytes.
        assert!(!arena.fits_alone(&[(1, 100, 1), (1, 4096, 1), (0, 4096, 1), (0, 4096, 1)]));
        // Filling the arena changes nothing: every extent would be gone.
        arena.alloc(0, 4096, 1).unwrap();
        arena.alloc(0, 4096, 1).unwrap();
        assert!(arena.fits_alone(&[(0, 4096, 1), (0, 4096, 1), (1, 4000, 1)]));
    }
}
