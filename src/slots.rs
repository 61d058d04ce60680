//! Raw slot memory: one pre-allocated, 64-byte aligned, zero-initialised buffer per leaf,
//! each `capacity` slots long. Buffers of at least [`MAP_BYTES`] are mapped straight from the
//! kernel (anonymous `mmap`), whose pages are zero and only take memory once written: a
//! million-step table is built at once and costs memory as it fills; on Linux, a thread keeps
//! the pages ahead of the writers faulted in, off their thread (`crate::prefault`). (The allocator's
//! `alloc_zeroed` would write every byte first: for alignments above 16 it cannot use
//! `calloc`.) The FIFO store's ring, a replay table's item storage and its
//! batch area are all [`Slots`]. This is the only module that touches slot memory; every
//! access goes through an `unsafe fn` whose `# Safety` section states the exclusivity it
//! needs, and the owner's protocol (the [`Store`](crate::store::Store)'s cursors, the replay
//! table's slot states) is what provides it.
//!
//! Slot `s` of leaf `l` lives at `leaves[l].base + s * slot_bytes(l)`, so slots `[a, b)` of a
//! leaf are one contiguous, stride-free byte range: a batch is a plain C-contiguous array.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::error::EchoError;
use crate::spec::{ArraySpec, DataSpec};
use crate::sync::SlotTracker;

/// Alignment of every leaf buffer: a cache line, and enough for any numpy dtype.
pub const RING_ALIGN: usize = 64;

/// Buffers at least this large are mapped (`mmap`) rather than allocated, on Unix.
pub(crate) const MAP_BYTES: usize = 1 << 20;

/// Where a leaf buffer's bytes come from, and so how they are given back.
#[derive(Debug, Clone, Copy)]
enum Backing {
    /// Nothing (an empty leaf).
    None,
    /// `alloc_zeroed` with this layout.
    Heap(Layout),
    /// An anonymous private mapping of this many bytes.
    #[cfg_attr(any(loom, miri, not(unix)), allow(dead_code))]
    Mapped(usize),
}

#[derive(Debug)]
struct LeafBuf {
    /// Start of `capacity * slot_bytes` bytes owned by this buffer (dangling but aligned when
    /// the leaf is empty, in which case `backing` is `None` and nothing is allocated).
    base: NonNull<u8>,
    slot_bytes: usize,
    backing: Backing,
}

impl LeafBuf {
    /// `total` zeroed bytes, `RING_ALIGN`-aligned (mapped from `MAP_BYTES` on, where it can).
    fn allocate(total: usize, slot_bytes: usize) -> Result<Self, EchoError> {
        if total == 0 {
            return Ok(Self { base: dangling_aligned(), slot_bytes, backing: Backing::None });
        }
        #[cfg(all(unix, not(loom), not(miri)))]
        if total >= MAP_BYTES {
            let base = map_anonymous(total)?;
            return Ok(Self { base, slot_bytes, backing: Backing::Mapped(total) });
        }
        let layout = Layout::from_size_align(total, RING_ALIGN)
            .map_err(|_| EchoError::Config(format!("ring buffer of {total} bytes is too large")))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let base = NonNull::new(raw).ok_or(EchoError::OutOfMemory { bytes: total })?;
        Ok(Self { base, slot_bytes, backing: Backing::Heap(layout) })
    }

    /// Bytes the buffer owns.
    fn len(&self) -> usize {
        match self.backing {
            Backing::None => 0,
            Backing::Heap(layout) => layout.size(),
            Backing::Mapped(len) => len,
        }
    }
}

/// `total` bytes of a fresh anonymous private mapping, reading as zeros and taking memory only
/// once written (on Linux, a prefault thread then keeps the pages ahead of the writers
/// populated: `crate::prefault`).
///
/// Transparent huge pages (`MADV_HUGEPAGE`) were tried for the first fill's page faults: one
/// fault per 2 MiB made a second table in a process fill near the steady rate, but the first
/// one's faults waited for the kernel to compact memory into huge pages (the system's `defrag`
/// setting compacts synchronously for advised ranges): 10x slower than small pages on a host
/// with a busy page cache. So the mapping keeps the system's default.
#[cfg(all(unix, not(loom), not(miri)))]
fn map_anonymous(total: usize) -> Result<NonNull<u8>, EchoError> {
    // SAFETY: a fresh anonymous private mapping: no address hint, no file; the kernel returns
    // page-aligned memory (so `RING_ALIGN`-aligned) that reads as zeros, or MAP_FAILED,
    // checked below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(EchoError::OutOfMemory { bytes: total });
    }
    NonNull::new(raw.cast::<u8>()).ok_or(EchoError::OutOfMemory { bytes: total })
}

/// A prefault thread for the mapped buffers among `leaves`, when they map enough to be worth
/// one ([`crate::prefault::PREFAULT_MIN_BYTES`]).
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
fn prefault_for(leaves: &[LeafBuf], capacity: usize) -> Option<crate::prefault::Prefault> {
    let regions: Vec<crate::prefault::Region> = leaves
        .iter()
        .filter(|leaf| matches!(leaf.backing, Backing::Mapped(_)))
        .map(|leaf| crate::prefault::Region {
            base: leaf.base.as_ptr() as usize,
            slot_bytes: leaf.slot_bytes,
        })
        .collect();
    let mapped: usize = regions.iter().map(|r| r.slot_bytes * capacity).sum();
    if mapped < crate::prefault::PREFAULT_MIN_BYTES {
        return None;
    }
    // SAFETY: each region is a mapping of `capacity * slot_bytes` bytes owned by a `LeafBuf`
    // of the `Slots` this prefault is stored in, declared after it, so the prefault (and its
    // thread) is dropped before any buffer is unmapped.
    unsafe { crate::prefault::Prefault::start(regions, capacity) }
}

/// The bytes a [`Buffer::with_prefault`] buffer keeps populated ahead of its highest block:
/// a quarter of a table's window, since an arena's memory is meant to stay near its payload.
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
const ARENA_WINDOW: usize = 16 << 20;

/// One zeroed, [`RING_ALIGN`]-aligned buffer of `len` bytes outside any table, allocated as a
/// leaf buffer is (mapped from [`MAP_BYTES`] on, so it costs no `memset`): the memory of a
/// `copy=True` batch's leaf (`crate::python::views`) and of a ragged table's arena
/// (`crate::ragged`).
pub(crate) struct Buffer {
    /// Populates the pages ahead of the blocks taken (see [`Buffer::with_prefault`]). First,
    /// so that it is dropped (its thread joined) before the mapping goes.
    #[cfg(all(target_os = "linux", not(loom), not(miri)))]
    prefault: Option<crate::prefault::Prefault>,
    leaf: LeafBuf,
}

impl Buffer {
    /// # Errors
    /// [`EchoError::OutOfMemory`] if the memory cannot be had.
    pub(crate) fn new(len: usize) -> Result<Self, EchoError> {
        Ok(Self {
            #[cfg(all(target_os = "linux", not(loom), not(miri)))]
            prefault: None,
            leaf: LeafBuf::allocate(len, len)?,
        })
    }

    /// A buffer of `blocks` blocks of `block_bytes`, taken in order of their index the first
    /// time (a ragged arena): when it is mapped and large enough, a prefault thread keeps the
    /// pages a window ([`ARENA_WINDOW`]) ahead of the highest block taken ([`Buffer::note`])
    /// populated, from the first block taken on, so the first writes into each block do not
    /// take its page faults (as for a table's slots). Its memory is then at most that window
    /// more than the blocks taken.
    ///
    /// # Errors
    /// As [`Buffer::new`].
    pub(crate) fn with_prefault(block_bytes: usize, blocks: usize) -> Result<Self, EchoError> {
        #[cfg_attr(not(all(target_os = "linux", not(loom), not(miri))), allow(unused_mut))]
        let mut buffer = Self::new(block_bytes * blocks)?;
        #[cfg(all(target_os = "linux", not(loom), not(miri)))]
        if matches!(buffer.leaf.backing, Backing::Mapped(_))
            && block_bytes * blocks >= crate::prefault::PREFAULT_MIN_BYTES
        {
            let region = crate::prefault::Region {
                base: buffer.as_mut_ptr() as usize,
                slot_bytes: block_bytes,
            };
            // SAFETY: the region is the buffer's own mapping of `blocks * block_bytes` bytes,
            // which stays mapped while the prefault lives: it is a field of the same
            // `Buffer`, declared before the mapping's, so it is dropped (its thread joined)
            // first.
            buffer.prefault = unsafe {
                crate::prefault::Prefault::start_with(vec![region], blocks, ARENA_WINDOW, false)
            };
        }
        Ok(buffer)
    }

    /// Block `block` of a [`Buffer::with_prefault`] buffer is about to be written.
    pub(crate) fn note(&self, block: usize) {
        #[cfg(all(target_os = "linux", not(loom), not(miri)))]
        if let Some(prefault) = &self.prefault {
            prefault.note(block);
        }
        let _ = block;
    }

    /// The first byte (dangling but aligned when `len` is 0).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.leaf.base.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.leaf.len()
    }
}

// SAFETY: the buffer is plain memory owned by this value alone; what writes it (a copy into a
// numpy array whose base owns the buffer) is the owner's protocol, as for `Slots`.
unsafe impl Send for Buffer {}
// SAFETY: a shared `&Buffer` only reads its pointer and length.
unsafe impl Sync for Buffer {}

impl Drop for LeafBuf {
    fn drop(&mut self) {
        match self.backing {
            Backing::None => {}
            // SAFETY: `base` was returned by `alloc_zeroed(layout)` in `allocate` and is freed
            // exactly once, here; the owning `Slots` is being dropped, so no views into it
            // are being created.
            Backing::Heap(layout) => unsafe { alloc::dealloc(self.base.as_ptr(), layout) },
            #[cfg(all(unix, not(loom), not(miri)))]
            Backing::Mapped(len) => {
                // SAFETY: `base..base + len` is the mapping `allocate` made, unmapped exactly
                // once, here (as for `Heap`).
                let done = unsafe { libc::munmap(self.base.as_ptr().cast(), len) };
                debug_assert_eq!(done, 0, "munmap of a mapping we own");
            }
            #[cfg(not(all(unix, not(loom), not(miri))))]
            Backing::Mapped(_) => unreachable!("only Unix maps"),
        }
    }
}

/// Raw storage for `capacity` samples of a [`DataSpec`], leaf by leaf.
#[derive(Debug)]
pub(crate) struct Slots {
    /// Populates large mapped buffers ahead of the writers (`crate::prefault`). First, so that
    /// it is dropped (its thread joined) before the buffers are unmapped.
    #[cfg(all(target_os = "linux", not(loom), not(miri)))]
    prefault: Option<crate::prefault::Prefault>,
    leaves: Box<[LeafBuf]>,
    capacity: usize,
    /// One tracker per slot; zero-sized (so this box allocates nothing) outside loom builds.
    trackers: Box<[SlotTracker]>,
}

// SAFETY: `Slots` owns its allocations exclusively, like a `Box<[u8]>`; moving it to another
// thread moves that ownership. Nothing in it is tied to a thread.
unsafe impl Send for Slots {}
// SAFETY: shared access only hands out raw pointers (harmless) or goes through `unsafe fn`s
// whose contracts require the caller to own the slots it touches (write reservation or consumer
// hold), which the store's cursor protocol guarantees. Like `UnsafeCell<[u8]>` behind such a
// protocol (crossbeam's `ArrayQueue`), `&Slots` is then safe to share.
unsafe impl Sync for Slots {}

impl Slots {
    /// Allocates zeroed storage for `capacity` samples of `spec`.
    pub(crate) fn new(spec: &DataSpec, capacity: usize) -> Result<Self, EchoError> {
        Self::of_arrays(spec.arrays(), capacity)
    }

    /// Allocates zeroed storage for `capacity` samples of these leaves (which, unlike a
    /// [`DataSpec`]'s, may all be empty: a table whose every leaf is stored elsewhere).
    pub(crate) fn of_arrays(arrays: &[ArraySpec], capacity: usize) -> Result<Self, EchoError> {
        let mut leaves = Vec::with_capacity(arrays.len());
        for array in arrays {
            let slot_bytes = array.num_bytes();
            let total = slot_bytes.checked_mul(capacity).ok_or_else(|| {
                EchoError::Config(format!(
                    "ring of {capacity} slots of {slot_bytes} bytes overflows usize"
                ))
            })?;
            // Pushed right after allocating, so an early return frees what exists.
            leaves.push(LeafBuf::allocate(total, slot_bytes)?);
        }
        let trackers = (0..capacity).map(|_| SlotTracker::default()).collect();
        Ok(Self {
            #[cfg(all(target_os = "linux", not(loom), not(miri)))]
            prefault: prefault_for(&leaves, capacity),
            leaves: leaves.into_boxed_slice(),
            capacity,
            trackers,
        })
    }

    /// Tells the prefault thread (if any) that `slot` is about to be written.
    #[inline]
    fn note_write(&self, slot: usize) {
        #[cfg(all(target_os = "linux", not(loom), not(miri)))]
        if let Some(prefault) = &self.prefault {
            prefault.note(slot);
        }
        #[cfg(not(all(target_os = "linux", not(loom), not(miri))))]
        let _ = slot;
    }

    /// Every leaf buffer as `(start, length in bytes)` (for page-locking). Empty leaves have
    /// length 0.
    pub(crate) fn buffers(&self) -> Vec<(*mut u8, usize)> {
        self.leaves.iter().map(|l| (l.base.as_ptr(), l.len())).collect()
    }

    /// Bytes one slot of `leaf` holds.
    pub(crate) fn slot_bytes(&self, leaf: usize) -> usize {
        self.leaves[leaf].slot_bytes
    }

    /// Address of slot `slot` of `leaf`. Computing it is safe; reading or writing through it is
    /// governed by the same rules as [`Slots::write_slot`] and [`Slots::read_slots`].
    ///
    /// # Panics
    /// If `leaf` or `slot` is out of range (a bug in the caller, not bad input).
    pub(crate) fn slot_ptr(&self, leaf: usize, slot: usize) -> *const u8 {
        assert!(slot < self.capacity, "slot {slot} out of range (capacity {})", self.capacity);
        let leaf = &self.leaves[leaf];
        // `wrapping_add` keeps this safe; `slot * slot_bytes` is within the allocation (or 0 for
        // an empty leaf) because `slot < capacity` and the allocation is `capacity * slot_bytes`.
        leaf.base.as_ptr().wrapping_add(slot * leaf.slot_bytes)
    }

    /// Copies `src` into slot `slot` of `leaf`.
    ///
    /// # Safety
    /// The caller holds the write reservation for `slot`: no other thread reads or writes this
    /// slot of any leaf until the caller commits it. `src` must not overlap the ring.
    ///
    /// # Panics
    /// If `src.len()` is not the leaf's slot size or `slot` is out of range. Callers validate
    /// sizes before reserving, so this is a last line of defence against heap overflow.
    pub(crate) unsafe fn write_slot(&self, slot: usize, leaf: usize, src: &[u8]) {
        self.note_write(slot);
        let dst = self.slot_ptr(leaf, slot).cast_mut();
        let len = self.leaves[leaf].slot_bytes;
        assert_eq!(src.len(), len, "leaf {leaf}: slot holds {len} bytes, got {}", src.len());
        self.trackers[slot].writing(|| {
            // SAFETY: `dst..dst+len` lies inside this leaf's allocation (bounds checked by
            // `slot_ptr` and the length assert); the caller guarantees exclusive access to the
            // slot and that `src` (exactly `len` readable bytes) does not overlap it.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len) };
        });
    }

    /// Calls `f` with slot `slot` of every leaf, in leaf order, to write them in place.
    ///
    /// # Safety
    /// As [`Slots::write_slot`]: the caller holds the write reservation for `slot`.
    ///
    /// # Panics
    /// If `slot` is out of range.
    pub(crate) unsafe fn write_in_place<R>(
        &self,
        slot: usize,
        f: impl FnOnce(&mut [&mut [u8]]) -> R,
    ) -> R {
        self.note_write(slot);
        self.trackers[slot].writing(|| {
            let mut leaves: Vec<&mut [u8]> = (0..self.leaves.len())
                .map(|leaf| {
                    let len = self.leaves[leaf].slot_bytes;
                    let ptr = self.slot_ptr(leaf, slot).cast_mut();
                    // SAFETY: `ptr..ptr+len` is this leaf's slot `slot`, inside its allocation
                    // (`slot_ptr` checked the bounds; an empty leaf gives an empty slice at a
                    // dangling but aligned, non-null base). Different leaves are different
                    // allocations, so the slices do not overlap each other, and the caller's
                    // reservation means nobody else reads or writes them while they live.
                    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
                })
                .collect();
            f(&mut leaves)
        })
    }

    /// Lets `fill` write slot `slot` of `leaf`: it gets the slot's bytes (exactly the leaf's
    /// slot size) as a mutable slice.
    ///
    /// # Safety
    /// As [`Slots::write_slot`]: the caller holds the write reservation for `slot`, so no other
    /// thread reads or writes this slot of any leaf until the caller commits it.
    ///
    /// # Panics
    /// If `slot` is out of range.
    pub(crate) unsafe fn fill_slot(&self, slot: usize, leaf: usize, fill: impl FnOnce(&mut [u8])) {
        self.note_write(slot);
        let dst = self.slot_ptr(leaf, slot).cast_mut();
        let len = self.leaves[leaf].slot_bytes;
        self.trackers[slot].writing(|| {
            // `dst..dst + len` is this slot of this leaf, inside the allocation (bounds
            // checked by `slot_ptr`; for an empty leaf `len` is 0 and `dst` aligned and
            // non-null) and initialised (allocated zeroed).
            // SAFETY: bounds and initialisation as above; the caller's reservation makes the
            // slot exclusively ours until it commits, and the slice does not escape `fill`.
            let bytes = unsafe { std::slice::from_raw_parts_mut(dst, len) };
            fill(bytes);
        });
    }

    /// Lets `fill` write bytes `range` of slot `slot` of `leaf` in place. Unlike
    /// [`Slots::fill_slot`], several threads may each fill their own part of one slot at once.
    ///
    /// # Safety
    /// No other thread reads or writes these bytes while `fill` runs (other bytes of the
    /// slot may be written by other threads meanwhile).
    ///
    /// # Panics
    /// If `slot` is out of range or `range` is not inside the slot.
    pub(crate) unsafe fn fill_part(
        &self,
        slot: usize,
        leaf: usize,
        range: std::ops::Range<usize>,
        fill: impl FnOnce(&mut [u8]),
    ) {
        let len = self.leaves[leaf].slot_bytes;
        assert!(
            range.start <= range.end && range.end <= len,
            "bytes {range:?} of a {len}-byte slot"
        );
        self.note_write(slot);
        let dst = self.slot_ptr(leaf, slot).cast_mut().wrapping_add(range.start);
        // SAFETY: `dst..dst + range.len()` is inside this slot of this leaf (bounds checked by
        // `slot_ptr` and the assert; an empty range is a valid empty slice at an in-bounds or
        // one-past address) and initialised (allocated zeroed); the caller guarantees no other
        // thread touches these bytes while the slice lives, and it does not escape `fill`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(dst, range.end - range.start) };
        fill(bytes);
    }

    /// Asks the CPU to bring the start of slots `first..first + n` of `leaf` into cache, for a
    /// gather that reads them soon. A hint: nothing is read, and any range is harmless.
    #[inline]
    pub(crate) fn prefetch(&self, leaf: usize, first: usize, n: usize) {
        if first < self.capacity {
            let len = self.leaves[leaf].slot_bytes.saturating_mul(n);
            prefetch_row(self.slot_ptr(leaf, first), len);
        }
    }

    /// Copies slot `slots[i]` of `leaf` into slot `into_start + i` of the same leaf of `into`
    /// (a batch area: same slot size), for every `i`. A batch drawn at random from a large
    /// table misses the cache on nearly every row, so the rows a few places ahead are
    /// prefetched while one is copied: overlapping the misses is most of the gather's speed.
    /// Rows of 1, 2, 4 or 8 bytes are copied inline rather than through `memcpy`.
    ///
    /// # Safety
    /// Every slot in `slots` is held by the caller as for [`Slots::read_slots`], and slots
    /// `into_start..into_start + slots.len()` of `into` as for [`Slots::write_slot`].
    ///
    /// # Panics
    /// If a slot is out of range or the two leaves' slot sizes differ.
    pub(crate) unsafe fn gather_into(
        &self,
        leaf: usize,
        slots: &[usize],
        into: &Slots,
        into_start: usize,
    ) {
        let len = self.leaves[leaf].slot_bytes;
        assert_eq!(len, into.leaves[leaf].slot_bytes, "leaf {leaf}: slot sizes differ");
        assert!(
            into_start.checked_add(slots.len()).is_some_and(|end| end <= into.capacity),
            "batch slots {into_start}..+{} out of range",
            slots.len()
        );
        if len == 0 {
            return;
        }
        for (i, &slot) in slots.iter().enumerate() {
            if let Some(&ahead) = slots.get(i + GATHER_AHEAD) {
                prefetch_row(self.slot_ptr(leaf, ahead), len);
            }
            let src = self.slot_ptr(leaf, slot);
            let dst = into.slot_ptr(leaf, into_start + i).cast_mut();
            self.trackers[slot].reading(|| ());
            into.trackers[into_start + i].writing(|| {
                // SAFETY: `src` and `dst` are `len`-byte slots inside their buffers (bounds
                // checked by `slot_ptr`, sizes equal by the assert), in different allocations
                // (a table's storage and its batch area), initialised (allocated zeroed); the
                // caller holds both as this function's contract says.
                unsafe { copy_row(src, dst, len) };
            });
        }
    }

    /// Calls `f` with the bytes of slots `slots` of `leaf`, one contiguous run.
    ///
    /// # Safety
    /// Every slot in `slots` is committed and held by the caller (the consumer): no writer
    /// writes them until the caller releases them, which happens after `f` returns.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub(crate) unsafe fn read_slots<R>(
        &self,
        leaf: usize,
        slots: std::ops::Range<usize>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> R {
        assert!(
            slots.start <= slots.end && slots.end <= self.capacity,
            "slots {slots:?} out of range"
        );
        for tracker in &self.trackers[slots.clone()] {
            tracker.reading(|| ());
        }
        let buf = &self.leaves[leaf];
        let start = buf.base.as_ptr().wrapping_add(slots.start * buf.slot_bytes);
        let len = (slots.end - slots.start) * buf.slot_bytes;
        // The range is inside the allocation (asserted above; for an empty leaf `len` is 0 and
        // `start` is aligned and non-null) and initialised (allocated zeroed, then only
        // overwritten by whole byte copies).
        // SAFETY: bounds and initialisation as above; the caller guarantees no writer mutates
        // these slots while the slice lives, and it does not escape `f`.
        let bytes = unsafe { std::slice::from_raw_parts(start, len) };
        f(bytes)
    }
}

/// Rows a gather prefetches ahead of the one it copies: enough to overlap several cache misses,
/// few enough that the prefetched lines are still in cache when their turn comes.
const GATHER_AHEAD: usize = 6;

/// Asks the CPU to bring the first cache lines (up to 512 bytes) of the row at `ptr` into
/// cache. A hint: it never faults, whatever the address.
#[inline(always)]
fn prefetch_row(ptr: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut offset = 0;
        while offset < len.min(512) {
            // SAFETY: a prefetch is a hint that never faults or reads into the program; SSE,
            // which it needs, is part of the x86-64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(offset).cast::<i8>()) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, len);
}

/// Copies `len` bytes from `src` to `dst`: 1, 2, 4 and 8 bytes as one move.
///
/// # Safety
/// `src` is readable and `dst` writable for `len` bytes, and the ranges do not overlap.
#[inline(always)]
unsafe fn copy_row(src: *const u8, dst: *mut u8, len: usize) {
    // A constant length lets the compiler emit one move instead of a call.
    match len {
        // SAFETY: the caller's contract, for exactly `len` bytes (every arm).
        1 => unsafe { std::ptr::copy_nonoverlapping(src, dst, 1) },
        // SAFETY: as above.
        2 => unsafe { std::ptr::copy_nonoverlapping(src, dst, 2) },
        // SAFETY: as above.
        4 => unsafe { std::ptr::copy_nonoverlapping(src, dst, 4) },
        // SAFETY: as above.
        8 => unsafe { std::ptr::copy_nonoverlapping(src, dst, 8) },
        // SAFETY: as above.
        _ => unsafe { std::ptr::copy_nonoverlapping(src, dst, len) },
    }
}

/// A non-null, `RING_ALIGN`-aligned pointer for zero-byte leaves (never dereferenced).
fn dangling_aligned() -> NonNull<u8> {
    #[repr(align(64))]
    struct Aligned;
    const _: () = assert!(std::mem::align_of::<Aligned>() == RING_ALIGN);
    NonNull::<Aligned>::dangling().cast()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ArraySpec;

    fn spec() -> DataSpec {
        DataSpec::new(vec![
            ArraySpec::new(vec![3], 4).unwrap(),
            ArraySpec::new(vec![0], 8).unwrap(),
            ArraySpec::new(vec![], 1).unwrap(),
        ])
        .unwrap()
    }

    #[test]
    fn slots_are_contiguous_aligned_and_zeroed() {
        let ring = Slots::new(&spec(), 4).unwrap();
        for leaf in 0..3 {
            assert_eq!(ring.slot_ptr(leaf, 0) as usize % RING_ALIGN, 0);
        }
        assert_eq!(ring.slot_ptr(0, 1) as usize - ring.slot_ptr(0, 0) as usize, 12);
        // SAFETY: single-threaded test; nothing writes concurrently.
        unsafe {
            ring.read_slots(0, 0..4, |b| assert!(b.len() == 48 && b.iter().all(|&x| x == 0)))
        };
    }

    #[test]
    fn written_slots_read_back_in_order() {
        let ring = Slots::new(&spec(), 4).unwrap();
        for slot in 0..4u8 {
            let bytes = [slot; 12];
            // SAFETY: single-threaded test: this thread owns every slot.
            unsafe { ring.write_slot(slot as usize, 0, &bytes) };
            // SAFETY: as above.
            unsafe { ring.write_slot(slot as usize, 1, &[]) };
            // SAFETY: as above.
            unsafe { ring.write_slot(slot as usize, 2, &[slot + 100]) };
        }
        // SAFETY: as above.
        unsafe {
            ring.read_slots(0, 1..3, |b| assert_eq!(b, [[1u8; 12], [2u8; 12]].concat()));
        }
        // SAFETY: as above.
        unsafe { ring.read_slots(2, 0..4, |b| assert_eq!(b, [100, 101, 102, 103])) };
        // SAFETY: as above.
        unsafe { ring.read_slots(1, 0..4, |b| assert!(b.is_empty())) };
    }

    #[test]
    #[should_panic(expected = "slot holds 12 bytes, got 11")]
    fn wrong_size_write_panics_instead_of_overflowing() {
        let ring = Slots::new(&spec(), 2).unwrap();
        // SAFETY: single-threaded test; the size check fires before any copy.
        unsafe { ring.write_slot(0, 0, &[0; 11]) };
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn out_of_range_slot_panics() {
        let ring = Slots::new(&spec(), 2).unwrap();
        let _ = ring.slot_ptr(0, 2);
    }

    #[test]
    fn absurd_capacity_is_an_error_not_an_abort() {
        let spec = DataSpec::new(vec![ArraySpec::new(vec![1 << 20], 8).unwrap()]).unwrap();
        assert!(Slots::new(&spec, usize::MAX / 4).is_err());
    }

    /// Resident bytes of this process (Linux), from `/proc/self/statm`.
    #[cfg(target_os = "linux")]
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn large_buffers_take_memory_only_as_they_are_written() {
        // 512 MiB of slots: mapped, zero, aligned, usable to the last byte, and resident only
        // where written (a generous bound: other tests of this binary allocate meanwhile).
        const SLOTS: usize = 1 << 16;
        let spec = DataSpec::new(vec![ArraySpec::new(vec![8192], 1).unwrap()]).unwrap();
        let before = resident_bytes();
        let ring = Slots::new(&spec, SLOTS).unwrap();
        assert_eq!(ring.buffers()[0].1, SLOTS * 8192);
        assert_eq!(ring.slot_ptr(0, 0) as usize % RING_ALIGN, 0);
        let last = [7u8; 8192];
        // SAFETY: single-threaded test: this thread owns every slot.
        unsafe { ring.write_slot(SLOTS - 1, 0, &last) };
        // SAFETY: as above.
        unsafe {
            ring.read_slots(0, SLOTS - 2..SLOTS, |b| assert_eq!(b, [[0u8; 8192], last].concat()))
        };
        let grown = resident_bytes().saturating_sub(before);
        assert!(grown < 128 << 20, "a 512 MiB ring made {grown} bytes resident before use");
        drop(ring);
    }

    /// A buffer large enough for a prefault thread, filled slot by slot while the thread runs
    /// ahead: every byte reads back as written (populating never touches a byte), and the
    /// thread ends, joined, when the slots are dropped part-way.
    #[cfg(all(target_os = "linux", not(loom), not(miri)))]
    #[test]
    fn slots_written_while_the_prefault_thread_runs_ahead_keep_their_bytes() {
        let capacity = 1 << 18;
        let spec = DataSpec::new(vec![
            ArraySpec::new(vec![256], 1).unwrap(),
            ArraySpec::new(vec![], 8).unwrap(),
        ])
        .unwrap();
        let slots = Slots::new(&spec, capacity).unwrap();
        assert!(slots.prefault.is_some(), "{} MiB mapped", (capacity * 264) >> 20);
        let row = |s: usize| -> [u8; 256] { std::array::from_fn(|i| (s * 7 + i) as u8) };
        for s in 0..capacity {
            // SAFETY: one thread writes and then reads; nothing else touches the slots.
            unsafe { slots.write_slot(s, 0, &row(s)) };
            // SAFETY: as above.
            unsafe { slots.write_slot(s, 1, &(s as u64).to_le_bytes()) };
        }
        for s in (0..capacity).step_by(997) {
            // SAFETY: as above.
            unsafe { slots.read_slots(0, s..s + 1, |b| assert_eq!(b, row(s), "slot {s}")) };
            // SAFETY: as above.
            unsafe { slots.read_slots(1, s..s + 1, |b| assert_eq!(b, (s as u64).to_le_bytes())) };
        }
        let fresh = Slots::new(&spec, capacity).unwrap();
        // SAFETY: as above.
        unsafe { fresh.write_slot(capacity / 2, 1, &7u64.to_le_bytes()) };
        drop(fresh); // joins its thread wherever it is
    }

    /// A gather copies each drawn slot, of every row size (the inline 1, 2, 4 and 8 bytes and
    /// the general copy), to its place in the batch, repeats included, and leaves the rest of
    /// the batch area alone.
    #[test]
    fn a_gather_copies_each_drawn_slot_to_its_place_in_the_batch() {
        let sizes = [1, 2, 4, 8, 13, 0];
        let arrays: Vec<ArraySpec> =
            sizes.iter().map(|&n| ArraySpec::new(vec![n], 1).unwrap()).collect();
        let table = Slots::of_arrays(&arrays, 64).unwrap();
        let area = Slots::of_arrays(&arrays, 16).unwrap();
        let row = |leaf: usize, slot: usize| -> Vec<u8> {
            (0..sizes[leaf]).map(|b| (leaf * 50 + slot * 3 + b) as u8).collect()
        };
        for leaf in 0..sizes.len() {
            for slot in 0..64 {
                // SAFETY: one thread; nothing else touches the slots.
                unsafe { table.write_slot(slot, leaf, &row(leaf, slot)) };
            }
        }
        let drawn = [63, 0, 17, 17, 5, 40, 2, 9, 33];
        for (leaf, size) in sizes.iter().enumerate() {
            // SAFETY: as above.
            unsafe { table.gather_into(leaf, &drawn, &area, 4) };
            for (i, &slot) in drawn.iter().enumerate() {
                // SAFETY: as above.
                unsafe { area.read_slots(leaf, 4 + i..5 + i, |b| assert_eq!(b, row(leaf, slot))) };
            }
            let zeros = vec![0u8; size * 4];
            // SAFETY: as above.
            unsafe { area.read_slots(leaf, 0..4, |b| assert_eq!(b, zeros)) };
        }
    }
}
