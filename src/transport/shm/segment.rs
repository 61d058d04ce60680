//! A mapped `memfd` segment ([`Segment`]): created, sized, sealed and mapped by the learner,
//! attached (checked, then mapped) by the worker. The only code that touches the mapping:
//! volatile copies in and out, and the header's atomics as the ring's [`Indices`].

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use super::layout::{
    slot_stride, HEADER_LEN, MAGIC, OFF_ACK_SLEEPING, OFF_ACK_TARGET, OFF_HEAD, OFF_HEADER_LEN,
    OFF_PAYLOAD, OFF_READER_SLEEPING, OFF_SLOTS, OFF_STORED, OFF_STRIDE, OFF_TAIL, OFF_VERSION,
    OFF_WRITER_SLEEPING, SLOT_HEADER, VERSION,
};
use super::ring::Indices;

pub(super) fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A mapped `memfd` segment. Dropping it unmaps it and closes the descriptor.
pub struct Segment {
    fd: OwnedFd,
    base: NonNull<u8>,
    pub(super) len: usize,
}

// SAFETY: `Segment` owns its mapping and its descriptor; the mapping is only touched through
// raw pointers (volatile copies) and atomics, which any thread may use. Nothing in it is tied
// to the thread that created it.
unsafe impl Send for Segment {}
// SAFETY: as above: `&Segment` only gives atomics and raw-pointer copies, both thread-safe.
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping `map` created, unmapped only here.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

impl Segment {
    /// Maps `len` bytes of `fd`, shared and writable.
    fn map(fd: OwnedFd, len: usize) -> io::Result<Self> {
        // SAFETY: a fresh mapping of an open descriptor; the kernel picks the address and
        // checks the length against the file (sealed against shrinking by the learner).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave 0"))?;
        Ok(Self { fd, base, len })
    }

    /// A new segment of `slots` slots for samples of `payload_size` bytes, its pages
    /// reserved and its size sealed, with the header written.
    ///
    /// # Errors
    /// The failing system call's error, or `InvalidInput` if the size overflows.
    pub fn create(slots: usize, payload_size: usize) -> io::Result<Self> {
        let too_big = || io::Error::new(io::ErrorKind::InvalidInput, "segment size overflows");
        let stride = slot_stride(payload_size).ok_or_else(too_big)?;
        let len = stride
            .checked_mul(slots)
            .and_then(|n| n.checked_add(HEADER_LEN))
            .ok_or_else(too_big)?;
        let size = libc::off_t::try_from(len).map_err(|_| too_big())?;
        // The system call, not glibc's wrapper: that arrived in glibc 2.27, and the manylinux2014
        // wheel (glibc 2.17) would then hold an unversioned reference to it that fails to load
        // on older systems (Linux has had the call since 3.17).
        // SAFETY: memfd_create(name, flags) with a C string literal and valid flags; the
        // result (a descriptor or -1) is checked.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_memfd_create,
                c"echo-shm".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        let raw = cvt(libc::c_int::try_from(ret).unwrap_or(-1))?;
        // SAFETY: `raw` is a descriptor memfd_create just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain system calls on our own descriptor.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), size) })?;
        // Reserve every page now: touching a page of a memfd whose memory cannot be
        // allocated later would be a SIGBUS on the learner.
        // SAFETY: as above.
        let err = unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, size) };
        if err != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
        let segment = Self::map(fd, len)?;
        segment.put(0, MAGIC);
        segment.put(OFF_VERSION, &VERSION.to_le_bytes());
        segment.put(OFF_HEADER_LEN, &(HEADER_LEN as u32).to_le_bytes());
        segment.put(OFF_SLOTS, &(slots as u64).to_le_bytes());
        segment.put(OFF_STRIDE, &(stride as u64).to_le_bytes());
        segment.put(OFF_PAYLOAD, &(payload_size as u64).to_le_bytes());
        Ok(segment)
    }

    /// Maps a segment received from a learner and checks its header against samples of
    /// `payload_size` bytes. Returns it with its slot count and stride.
    ///
    /// # Errors
    /// A message saying what is wrong with it.
    pub fn attach(fd: OwnedFd, payload_size: usize) -> Result<(Self, usize, usize), String> {
        Self::attach_checked(fd, Some(payload_size))
            .map(|(segment, slots, stride, _)| (segment, slots, stride))
    }

    /// Maps a byte pipe's segment received from a learner (one slot, whose payload is the
    /// pipe; see [`super::pipe`]) and checks its header. Returns it with the pipe's capacity.
    ///
    /// # Errors
    /// A message saying what is wrong with it.
    pub fn attach_pipe(fd: OwnedFd) -> Result<(Self, usize), String> {
        let (segment, slots, _, payload) = Self::attach_checked(fd, None)?;
        if slots != 1 || payload == 0 {
            return Err(format!(
                "the segment is not a byte pipe ({slots} slots of {payload} bytes)"
            ));
        }
        Ok((segment, payload))
    }

    /// [`Segment::attach`], with the payload size checked if `expected`; returns the slot
    /// count, stride and payload size too.
    fn attach_checked(
        fd: OwnedFd,
        expected: Option<usize>,
    ) -> Result<(Self, usize, usize, usize), String> {
        // SAFETY: `stat` is plain data; fstat fills it or fails.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a valid out-pointer.
        cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) })
            .map_err(|e| format!("cannot stat the segment: {e}"))?;
        let len = usize::try_from(stat.st_size).unwrap_or(0);
        if len < HEADER_LEN {
            return Err(format!("the segment has {len} bytes, less than its header"));
        }
        // SAFETY: a plain system call on our descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("the segment is not sealed against shrinking".into());
        }
        let segment = Self::map(fd, len).map_err(|e| format!("cannot map the segment: {e}"))?;
        let mut magic = [0u8; 8];
        segment.get(0, &mut magic);
        let word = |off| {
            let mut b = [0u8; 8];
            segment.get(off, &mut b);
            u64::from_le_bytes(b)
        };
        let (version_and_len, slots, stride, payload) =
            (word(OFF_VERSION), word(OFF_SLOTS), word(OFF_STRIDE), word(OFF_PAYLOAD));
        let version = (version_and_len & 0xffff_ffff) as u32;
        let header_len = (version_and_len >> 32) as usize;
        if &magic != MAGIC || version != VERSION || header_len != HEADER_LEN {
            return Err(format!(
                "the segment is not an echo ring (magic {magic:?}, version {version})"
            ));
        }
        let payload_size = match expected {
            Some(want) if payload != want as u64 => {
                return Err(format!(
                    "the segment holds samples of {payload} bytes, this client sends {want}"
                ));
            }
            Some(want) => want,
            None => {
                usize::try_from(payload).map_err(|_| format!("a payload of {payload} bytes"))?
            }
        };
        let fits = usize::try_from(slots).ok().zip(usize::try_from(stride).ok()).filter(
            |&(slots, stride)| {
                slots >= 1
                    && SLOT_HEADER.checked_add(payload_size).is_some_and(|n| stride >= n)
                    && stride % 64 == 0
                    && stride.checked_mul(slots).and_then(|n| n.checked_add(HEADER_LEN))
                        <= Some(len)
            },
        );
        let Some((slots, stride)) = fits else {
            return Err(format!(
                "the segment's geometry does not fit it ({slots} slots of {stride} bytes in \
                 {len} bytes)"
            ));
        };
        Ok((segment, slots, stride, payload_size))
    }

    /// The segment's descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn ptr(&self, offset: usize, len: usize) -> *mut u8 {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "out of the segment");
        // SAFETY: `offset + len <= self.len` (checked above), so the pointer stays in the
        // mapping.
        unsafe { self.base.as_ptr().add(offset) }
    }

    /// Copies `bytes` into the segment at `offset` (bounds checked: panics outside, a bug).
    pub(super) fn put(&self, offset: usize, bytes: &[u8]) {
        let dst = self.ptr(offset, bytes.len());
        // SAFETY: `dst..dst + len` is inside our mapping (checked by `ptr`), which no Rust
        // reference covers, so the copy aliases nothing; `bytes` is a separate buffer. The
        // peer may write the same bytes concurrently: shared memory is outside the Rust
        // memory model's data-race rules for our purposes (we only copy bytes, and never
        // assume they keep a value), as with any memory another process maps.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
    }

    /// Copies `out.len()` bytes out of the segment at `offset` (bounds checked as `put`).
    pub(super) fn get(&self, offset: usize, out: &mut [u8]) {
        let src = self.ptr(offset, out.len());
        // SAFETY: as in `put`: in bounds, no reference to the mapping exists, and whatever
        // the peer writes meanwhile only makes the copied bytes arbitrary, which every
        // caller treats as untrusted.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    }

    fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        let ptr = self.ptr(offset, 8).cast::<u64>();
        // SAFETY: in bounds (checked), 8-aligned (the mapping is page-aligned and every
        // offset a multiple of 64), valid as long as `self` (the mapping lives until drop).
        // Every access to these words, on both sides, is atomic.
        unsafe { AtomicU64::from_ptr(ptr) }
    }

    fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        let ptr = self.ptr(offset, 4).cast::<u32>();
        // SAFETY: as in `atomic_u64` (4-aligned).
        unsafe { AtomicU32::from_ptr(ptr) }
    }

    pub(super) fn indices(&self, slots: usize) -> Indices<'_> {
        Indices {
            tail: self.atomic_u64(OFF_TAIL),
            head: self.atomic_u64(OFF_HEAD),
            reader_sleeping: self.atomic_u32(OFF_READER_SLEEPING),
            writer_sleeping: self.atomic_u32(OFF_WRITER_SLEEPING),
            slots: slots as u64,
        }
    }

    /// A byte pipe's acknowledgements as [`Indices`] and the worker's target: `head` is the
    /// count of samples stored (the learner publishes it with [`Indices::release_to`], the
    /// worker reads it with [`Indices::taken`] and sleeps on `ack_sleeping` with
    /// [`Indices::sleep_for`], on the same bell as for room); `tail` is the pipe's (unused
    /// here).
    pub(super) fn acks(&self) -> (Indices<'_>, &AtomicU64) {
        let indices = Indices {
            head: self.atomic_u64(OFF_STORED),
            writer_sleeping: self.atomic_u32(OFF_ACK_SLEEPING),
            slots: u64::MAX,
            ..self.indices(1)
        };
        (indices, self.atomic_u64(OFF_ACK_TARGET))
    }
}
