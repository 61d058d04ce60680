//! The learner's published parameters in a `memfd` region (Linux), which workers on the same
//! host map and copy from directly instead of pulling chunks through their socket.
//!
//! ```text
//!  region (created by the learner at its first publish or first shared-memory worker, grown
//!  once, at the first publish, to hold two versions; never shrunk):
//!  0     magic b"ECHOPRM\x01" | size: u64 (bytes of one version; 0 until the first publish)
//!  64    slot 0: seq: u64 | version: u64            128  slot 1: seq: u64 | version: u64
//!  4096  slot 0's bytes | slot 1's bytes (each `stride`: size rounded up to a page)
//! ```
//!
//! The two slots are the [`ParamStore`](crate::params::ParamStore)'s own (the learner keeps
//! no other copy): a publish rewrites the slot that does not hold the latest version inside
//! one pass of its [sequence lock](super::seqlock), under the store's write lock, which keeps
//! the learner's own chunk readers out. A worker copies the slot with the newer version and
//! keeps the copy only if no pass overlapped it ([`ParamView::read`]). Workers map the region
//! read-only, and check its size and header before they copy: a region that is not one is an
//! error, never a fault.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use std::sync::OnceLock;

use parking_lot::Mutex;

use super::segment::cvt;
use super::seqlock::{read_with, write_with};

const MAGIC: &[u8; 8] = b"ECHOPRM\x01";
const OFF_SIZE: usize = 8;
const OFF_SLOT: [usize; 2] = [64, 128];
const HEADER_LEN: usize = 4096;

/// Bytes of one slot for versions of `size` bytes: whole pages.
fn stride(size: usize) -> Option<usize> {
    size.checked_next_multiple_of(HEADER_LEN)
}

/// One shared mapping of a region.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Self> {
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks the address
        // and checks the length against the file (callers map at most its size).
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave 0"))?;
        Ok(Self { base, len })
    }

    fn ptr(&self, offset: usize, len: usize) -> *mut u8 {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "out of the region");
        // SAFETY: `offset + len <= self.len` (checked above): inside the mapping.
        unsafe { self.base.as_ptr().add(offset) }
    }

    fn atomic(&self, offset: usize) -> &AtomicU64 {
        let ptr = self.ptr(offset, 8).cast::<u64>();
        // SAFETY: in bounds (checked), 8-aligned (the mapping is page-aligned and every offset
        // a multiple of 8), valid while `self` lives. Every access to these words, in every
        // process, is atomic.
        unsafe { AtomicU64::from_ptr(ptr) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping `new` made, unmapped only here.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

// SAFETY: the mapping is only touched through raw-pointer copies and atomics, which any thread
// may use; nothing in it is tied to the thread that made it.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

/// The learner's side: the region, its header's mapping, and its whole mapping once it holds
/// versions (made once, by `hold`).
pub struct ParamRegion {
    fd: OwnedFd,
    /// Serialises `hold`.
    growing: Mutex<()>,
    map: OnceLock<Mapping>,
}

impl std::fmt::Debug for ParamRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = self.map.get().map_or(HEADER_LEN, |m| m.len);
        f.debug_struct("ParamRegion").field("len", &len).finish_non_exhaustive()
    }
}

impl ParamRegion {
    /// A region with its header alone (nothing published).
    ///
    /// # Errors
    /// The failing system call's error.
    pub fn create() -> io::Result<Self> {
        // The system call, not glibc's wrapper (see `Segment::create`).
        // SAFETY: memfd_create(name, flags) with a C string literal and valid flags; the
        // result (a descriptor or -1) is checked.
        let ret = unsafe {
            libc::syscall(libc::SYS_memfd_create, c"echo-params".as_ptr(), libc::MFD_CLOEXEC)
        };
        let raw = cvt(libc::c_int::try_from(ret).unwrap_or(-1))?;
        // SAFETY: `raw` is a descriptor memfd_create just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Self::size_file(&fd, HEADER_LEN)?;
        let head = Mapping::new(fd.as_fd(), HEADER_LEN, true)?;
        // SAFETY: the header's first 8 bytes, in the mapping (`ptr` checks), not yet shared.
        unsafe { std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), head.ptr(0, 8), 8) };
        Ok(Self { fd, growing: Mutex::new(()), map: OnceLock::new() })
    }

    fn size_file(fd: &OwnedFd, len: usize) -> io::Result<()> {
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region size overflows"))?;
        // SAFETY: plain system calls on our own descriptor.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), size) })?;
        // Every page reserved now: a page that cannot be allocated later would be a SIGBUS.
        // SAFETY: as above.
        if unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The descriptor workers get with their shared-memory channel.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Grows the region to hold two versions of `size` bytes (once, before the first
    /// publish writes a slot) and says so in its header.
    ///
    /// # Errors
    /// The failing system call's error, or `InvalidInput` if the size overflows or the region
    /// holds versions of another size already.
    pub fn hold(&self, size: usize) -> io::Result<()> {
        let too_big = || io::Error::new(io::ErrorKind::InvalidInput, "region size overflows");
        let len = stride(size)
            .and_then(|s| s.checked_mul(2))
            .and_then(|s| s.checked_add(HEADER_LEN))
            .ok_or_else(too_big)?;
        let _growing = self.growing.lock();
        if let Some(map) = self.map.get() {
            // ORDERING: Relaxed — our own store, below, under `growing`.
            return if map.atomic(OFF_SIZE).load(Relaxed) == size as u64 {
                Ok(())
            } else {
                Err(io::Error::new(io::ErrorKind::InvalidInput, "versions of another size"))
            };
        }
        Self::size_file(&self.fd, len)?;
        let grown = Mapping::new(self.fd.as_fd(), len, true)?;
        // Under `growing`, with nothing mapped yet: this is the mapping.
        let map = self.map.get_or_init(|| grown);
        // ORDERING: Release pairs with the workers' Acquire in `ParamView::read`: the region
        // was grown before they read a size that needs it.
        map.atomic(OFF_SIZE).store(size as u64, Release);
        Ok(())
    }

    /// Rewrites slot `slot` with `bytes` (the whole version) as `version`, as one pass of its
    /// sequence lock. The caller holds the store's write lock of that slot (one writer).
    ///
    /// # Panics
    /// If the region does not hold versions of `bytes.len()` (a bug: `hold` comes first).
    pub fn write(&self, slot: usize, version: u64, write: impl FnOnce(&mut [u8])) {
        let map = self.map.get().expect("hold comes first");
        // ORDERING: Relaxed — our own store, in `hold`.
        let size = map.atomic(OFF_SIZE).load(Relaxed) as usize;
        let at = HEADER_LEN + slot * stride(size).expect("checked by hold");
        let data = map.ptr(at, size);
        write_with(map.atomic(OFF_SLOT[slot]), || {
            // SAFETY: `data..data + size` is in the mapping (`ptr` checks) and only this
            // writer (the slot's write lock) writes it in this process; readers in other
            // processes copy it and discard what a pass overlapped (the sequence lock).
            let bytes = unsafe { std::slice::from_raw_parts_mut(data, size) };
            write(bytes);
            // ORDERING: Relaxed — inside the pass: published by its closing Release store.
            map.atomic(OFF_SLOT[slot] + 8).store(version, Relaxed);
        });
    }

    /// Calls `read` with slot `slot`'s bytes. The caller holds the store's read lock of that
    /// slot (no pass runs).
    pub fn read<R>(&self, slot: usize, read: impl FnOnce(&[u8]) -> R) -> R {
        let map = self.map.get().expect("hold comes first");
        // ORDERING: Relaxed — our own store, in `hold`.
        let size = map.atomic(OFF_SIZE).load(Relaxed) as usize;
        let at = HEADER_LEN + slot * stride(size).expect("checked by hold");
        // SAFETY: in the mapping (`ptr` checks); no writer in this process while the caller
        // holds the slot's read lock, and no other process writes the region.
        read(unsafe { std::slice::from_raw_parts(map.ptr(at, size), size) })
    }
}

/// A worker's side: the region it was handed, mapped read-only when it reads.
pub struct ParamView {
    fd: OwnedFd,
    map: Option<Mapping>,
}

impl std::fmt::Debug for ParamView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamView").finish_non_exhaustive()
    }
}

/// What [`ParamView::read`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewRead {
    /// `out` holds this version, whole.
    Copied(u64),
    /// Nothing published yet.
    Empty,
    /// The learner's versions are of this many bytes, not `out`'s.
    Size(u64),
    /// Every try overlapped a publish: try again.
    Busy,
}

impl ParamView {
    /// The region received from the learner.
    pub fn new(fd: OwnedFd) -> Self {
        Self { fd, map: None }
    }

    /// The region mapped at its current size.
    fn mapping(&mut self) -> Result<&Mapping, String> {
        // SAFETY: fstat on our own descriptor into a zeroed struct it fills.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        cvt(unsafe { libc::fstat(self.fd.as_raw_fd(), &raw mut stat) })
            .map_err(|e| format!("the parameter region: {e}"))?;
        let len = usize::try_from(stat.st_size).unwrap_or(0);
        if len < HEADER_LEN {
            return Err(format!("the parameter region is {len} bytes, less than its header"));
        }
        if self.map.as_ref().is_none_or(|m| m.len != len) {
            self.map = None;
            let map = Mapping::new(self.fd.as_fd(), len, false)
                .map_err(|e| format!("cannot map the parameter region: {e}"))?;
            let mut magic = [0u8; 8];
            // SAFETY: the first 8 bytes of the mapping (`ptr` checks).
            unsafe { std::ptr::copy_nonoverlapping(map.ptr(0, 8), magic.as_mut_ptr(), 8) };
            if &magic != MAGIC {
                return Err("the learner's parameter region is not one".into());
            }
            self.map = Some(map);
        }
        Ok(self.map.as_ref().expect("mapped above"))
    }

    /// Copies the newest version the region holds into `out` (exactly one version's bytes),
    /// trying `tries` times while publishes overlap the copy.
    ///
    /// # Errors
    /// A region that cannot be mapped, or that is not one (its message).
    pub fn read(&mut self, out: &mut [u8], tries: usize) -> Result<ViewRead, String> {
        let map = self.mapping()?;
        // ORDERING: Acquire pairs with the learner's Release in `ParamRegion::hold`.
        let size = map.atomic(OFF_SIZE).load(Acquire);
        if size == 0 {
            return Ok(ViewRead::Empty);
        }
        if size != out.len() as u64 {
            return Ok(ViewRead::Size(size));
        }
        let size = out.len();
        let stride = stride(size).ok_or("the parameter region's size overflows")?;
        if HEADER_LEN + 2 * stride > map.len {
            // Grown after we mapped it: the next call maps it again.
            return Ok(ViewRead::Busy);
        }
        for _ in 0..tries {
            // The slot with the newer version (read outside the lock: a guess the lock
            // then checks).
            // ORDERING: Relaxed — a guess; the copy below is what the lock validates.
            let versions = OFF_SLOT.map(|off| map.atomic(off + 8).load(Relaxed));
            let slot = usize::from(versions[1] > versions[0]);
            let data = map.ptr(HEADER_LEN + slot * stride, size);
            let copied = read_with(map.atomic(OFF_SLOT[slot]), || {
                // SAFETY: `data..data + size` is in the mapping (`ptr` checks) and `out` is
                // ours; the learner may be rewriting the slot meanwhile, which only makes the
                // bytes arbitrary, and the sequence lock throws such a copy away.
                unsafe { std::ptr::copy_nonoverlapping(data, out.as_mut_ptr(), size) };
                // ORDERING: Relaxed — inside the pass the lock validates.
                map.atomic(OFF_SLOT[slot] + 8).load(Relaxed)
            });
            match copied {
                Some(version) if version > 0 => return Ok(ViewRead::Copied(version)),
                _ => std::hint::spin_loop(),
            }
        }
        Ok(ViewRead::Busy)
    }
}
