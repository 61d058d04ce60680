//! The same-host shared-memory channel (Linux): a worker on the learner's machine writes each
//! sample straight into a ring of fixed-size slots in a `memfd` segment, and the learner's
//! connection task copies it once, straight into the backend's ring ([`Samples`] is the
//! segment as a `SampleSource`); while the ring is full the samples wait in the segment and
//! the worker's `send` waits for a free slot. The TCP connection stays open for liveness
//! (heartbeats), the goodbye and errors.
//!
//! ```text
//!  segment (created, sized, sealed and mapped by the learner; mapped by the worker):
//!  0     magic b"ECHOSHM\x01" | version: u32 = 1 | header_len: u32 = 4096
//!  16    slots: u64 | slot_stride: u64 | payload_size: u64
//!  64    tail: u64 (atomic; the worker's)          128  head: u64 (atomic; the learner's)
//!  192   reader_sleeping: u32 (the learner's)      256  writer_sleeping: u32 (the worker's)
//!  4096  slot 0 | slot 1 | ... (each slot_stride bytes, a multiple of 64)
//!  slot: seq: u64 (the sample's number) | flags: u32 (bit 0: priority; bit 1: a step of a
//!        row) | 0: u32 | priority: f64 | row: u32 | end: u8 (0 goes on, 1 terminated,
//!        2 truncated) | 35 reserved bytes | payload (payload_size bytes)
//! ```
//!
//! All integers are little-endian (the machine's: both sides run on it). The index protocol
//! (who stores what with which ordering, and how each side sleeps on its eventfd) is
//! [`crate::shmring`]'s. The learner creates the segment with `memfd_create`, reserves its
//! pages (`fallocate`), and seals it against shrinking and growing before the worker sees it,
//! so nothing the worker does can make the learner's accesses fault. It never trusts what it
//! reads back: its own `head` is the only index it keeps, a `tail` out of range ends the
//! channel, and a slot is copied out before its header is checked (a slot torn by its writer
//! only corrupts that worker's own sample).
//!
//! Attaching: the learner listens on a fresh abstract-namespace Unix socket (`echo-shm-` and
//! 32 random hex digits, so nothing is left on any file system), names it and a 16-byte
//! nonce in its TCP reply, and hands the segment and two eventfds (data: worker -> learner;
//! space: learner -> worker) with `SCM_RIGHTS` to the first peer that presents the nonce and
//! runs under the learner's own uid (`SO_PEERCRED`).

use std::io::{self, Write};
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::{Duration, Instant};

use crate::shmring::{Bell, Corrupt, Indices};
use crate::source::{EpisodeEnd, StepTag};
use crate::transport::wire::v2::FrameMeta;

/// The first bytes of a segment.
pub const MAGIC: &[u8; 8] = b"ECHOSHM\x01";
/// The segment format's version.
pub const VERSION: u32 = 1;
/// Bytes before slot 0.
pub const HEADER_LEN: usize = 4096;
/// Bytes of a slot's header, before its payload.
pub const SLOT_HEADER: usize = 64;
/// Offset of the version (u32).
pub const OFF_VERSION: usize = 8;
/// Offset of the header length (u32).
pub const OFF_HEADER_LEN: usize = 12;
/// Offset of the slot count (u64).
pub const OFF_SLOTS: usize = 16;
/// Offset of the slot stride (u64).
pub const OFF_STRIDE: usize = 24;
/// Offset of the payload size (u64).
pub const OFF_PAYLOAD: usize = 32;
/// Offset of `tail` (atomic u64, the worker's).
pub const OFF_TAIL: usize = 64;
/// Offset of `head` (atomic u64, the learner's).
pub const OFF_HEAD: usize = 128;
/// Offset of `reader_sleeping` (atomic u32, the learner's).
pub const OFF_READER_SLEEPING: usize = 192;
/// Offset of `writer_sleeping` (atomic u32, the worker's).
pub const OFF_WRITER_SLEEPING: usize = 256;
/// Slot flag: the slot's priority field is set.
pub const FLAG_PRIORITY: u32 = 1;
/// Slot flag: the sample is a step of a row (its row and episode flag are set), for a
/// sequence table.
pub const FLAG_STEP: u32 = 2;
/// What a segment aims to hold: as many slots as fit (between [`MIN_SLOTS`] and
/// [`MAX_SLOTS`]).
pub const SEGMENT_TARGET: usize = 8 << 20;
/// The fewest slots of a segment.
pub const MIN_SLOTS: usize = 2;
/// The most slots of a segment.
pub const MAX_SLOTS: usize = 1024;
/// The bytes the learner sends with the descriptors.
pub const ATTACH_MESSAGE: &[u8; 8] = b"ECHOSHM\x01";
/// Length of the nonce a worker presents on the Unix socket.
pub const NONCE_LEN: usize = 16;
/// The prefix of every channel's abstract socket name.
pub const NAME_PREFIX: &str = "echo-shm-";
/// Environment variable (tests only): `N:PID` makes the worker process `PID` stop itself
/// (`SIGSTOP`) after writing half of sample number N into its slot, before committing it, so
/// a test can kill it there. Naming the process keeps the hook inert everywhere else (an
/// inherited or stray setting never matches another process).
pub const STOP_AT_ENV: &str = "ECHO_SHM_TEST_STOP_AT";

/// The sample number [`STOP_AT_ENV`] names for this process, if it names this process.
fn stop_at_from_env() -> Option<u64> {
    let value = std::env::var(STOP_AT_ENV).ok()?;
    let (sample, pid) = value.split_once(':')?;
    (pid.parse::<u32>().ok()? == std::process::id()).then(|| sample.parse().ok()).flatten()
}

/// Whether a TCP peer at `peer`, connected to our address `local`, runs on this host: a
/// loopback address, or our own address (a connection to one of the host's own addresses
/// comes from that same address). IPv4-mapped IPv6 addresses count as IPv4.
pub fn same_host(peer: IpAddr, local: IpAddr) -> bool {
    let canonical = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 @ IpAddr::V4(_) => v4,
    };
    let (peer, local) = (canonical(peer), canonical(local));
    peer.is_loopback() || peer == local
}

/// Bytes of one slot for samples of `payload_size` bytes: header and payload, rounded up to
/// 64 bytes; `None` on overflow.
pub fn slot_stride(payload_size: usize) -> Option<usize> {
    SLOT_HEADER.checked_add(payload_size)?.checked_next_multiple_of(64)
}

/// Slots of a segment for samples of `payload_size` bytes (see [`SEGMENT_TARGET`]).
pub fn slots_for(payload_size: usize) -> Option<usize> {
    let stride = slot_stride(payload_size)?;
    Some((SEGMENT_TARGET / stride).clamp(MIN_SLOTS, MAX_SLOTS))
}

/// Bytes of a [`Reader::new`] segment for samples of `payload_size` bytes; `None` on overflow.
pub fn segment_len(payload_size: usize) -> Option<usize> {
    slot_stride(payload_size)?.checked_mul(slots_for(payload_size)?)?.checked_add(HEADER_LEN)
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
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
    len: usize,
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
        if payload != payload_size as u64 {
            return Err(format!(
                "the segment holds samples of {payload} bytes, this client sends {payload_size}"
            ));
        }
        let fits = usize::try_from(slots).ok().zip(usize::try_from(stride).ok()).filter(
            |&(slots, stride)| {
                slots >= 1
                    && stride >= SLOT_HEADER + payload_size
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
        Ok((segment, slots, stride))
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
    fn put(&self, offset: usize, bytes: &[u8]) {
        let dst = self.ptr(offset, bytes.len());
        // SAFETY: `dst..dst + len` is inside our mapping (checked by `ptr`), which no Rust
        // reference covers, so the copy aliases nothing; `bytes` is a separate buffer. The
        // peer may write the same bytes concurrently: shared memory is outside the Rust
        // memory model's data-race rules for our purposes (we only copy bytes, and never
        // assume they keep a value), as with any memory another process maps.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
    }

    /// Copies `out.len()` bytes out of the segment at `offset` (bounds checked as `put`).
    fn get(&self, offset: usize, out: &mut [u8]) {
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

    fn indices(&self, slots: usize) -> Indices<'_> {
        Indices {
            tail: self.atomic_u64(OFF_TAIL),
            head: self.atomic_u64(OFF_HEAD),
            reader_sleeping: self.atomic_u32(OFF_READER_SLEEPING),
            writer_sleeping: self.atomic_u32(OFF_WRITER_SLEEPING),
            slots: slots as u64,
        }
    }
}

/// An eventfd used as a doorbell (non-blocking; the flag is shared with the peer's copy).
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd with count 0.
    ///
    /// # Errors
    /// The system call's.
    pub fn new() -> io::Result<Self> {
        // SAFETY: valid flags; the result is checked.
        let raw = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: `raw` was just returned by eventfd and is owned by nobody else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(raw) }))
    }

    /// Takes (and resets) the count; whether it was rung.
    pub fn drain(&self) -> bool {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into our 8-byte buffer.
        let n = unsafe { libc::read(self.0.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        n == 8
    }

    /// Waits until it is rung (or `timeout`), then resets it. Whether it was rung.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut poll = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX).max(1);
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut poll, 1, ms) };
        ready > 0 && self.drain()
    }

    /// A second descriptor of the same eventfd.
    ///
    /// # Errors
    /// The system call's.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Self(self.0.try_clone()?))
    }
}

impl Bell for EventFd {
    fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // A full count (a peer that rang 2^64 - 2 times) fails with EAGAIN: the waiter is
        // woken anyway.
        // SAFETY: writes our 8-byte buffer.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// What a slot's header says, once copied out and checked: what a sample frame says.
pub type SlotMeta = FrameMeta;

/// The learner's side of one channel: the segment, its own `head`, the data bell it waits on
/// and the space bell it rings.
pub struct Reader {
    segment: Segment,
    slots: usize,
    stride: usize,
    payload_size: usize,
    head: u64,
    /// Rung by the worker after a commit while we sleep.
    pub data: EventFd,
    /// Rung by us after we take samples while the worker waits.
    space: EventFd,
}

impl Reader {
    /// A new channel for samples of `payload_size` bytes.
    ///
    /// # Errors
    /// As [`Segment::create`] and [`EventFd::new`].
    pub fn new(payload_size: usize) -> io::Result<Self> {
        let slots = slots_for(payload_size)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "sample too large"))?;
        Self::with_slots(payload_size, slots)
    }

    /// A new channel of exactly `slots` slots (at least 1), for tests.
    ///
    /// # Errors
    /// As [`Reader::new`].
    #[doc(hidden)]
    pub fn with_slots(payload_size: usize, slots: usize) -> io::Result<Self> {
        let slots = slots.max(1);
        let segment = Segment::create(slots, payload_size)?;
        let stride = slot_stride(payload_size).expect("checked by Segment::create");
        Ok(Self {
            segment,
            slots,
            stride,
            payload_size,
            head: 0,
            data: EventFd::new()?,
            space: EventFd::new()?,
        })
    }

    /// The descriptors a worker needs, in order: segment, data bell, space bell.
    pub fn fds(&self) -> [RawFd; 3] {
        [self.segment.fd().as_raw_fd(), self.data.as_raw_fd(), self.space.as_raw_fd()]
    }

    /// Slots in the ring.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Samples taken so far.
    pub fn head(&self) -> u64 {
        self.head
    }

    fn indices(&self) -> Indices<'_> {
        self.segment.indices(self.slots)
    }

    /// Committed samples not yet taken.
    ///
    /// # Errors
    /// [`Corrupt`] if the worker wrote an impossible tail.
    pub fn available(&self) -> Result<u64, Corrupt> {
        Ok(self.indices().committed(self.head)? - self.head)
    }

    /// Copies the next committed sample (the caller checked [`Reader::available`]) into
    /// `out` (`payload_size` bytes), then checks the slot's header as copied.
    ///
    /// # Errors
    /// What is wrong with the slot (the worker broke the protocol).
    pub fn copy_next(&self, out: &mut [u8]) -> Result<SlotMeta, String> {
        if out.len() != self.payload_size {
            return Err(format!("buffer of {} bytes for {}", out.len(), self.payload_size));
        }
        // The header first, then the payload: both are copies, checked only as copied.
        let meta = self.check(self.head)?;
        self.copy_payload(self.head, 0, out);
        Ok(meta)
    }

    /// Hands the slot of the sample copied by [`Reader::copy_next`] back to the worker.
    pub fn advance(&mut self) {
        self.advance_by(1);
    }

    /// Hands the slots of the next `n` samples back to the worker (they were checked with
    /// [`Reader::check`] and copied with [`Samples`]).
    pub fn advance_by(&mut self, n: u64) {
        if n > 0 {
            self.head += n;
            self.segment.indices(self.slots).release(self.head, &self.space);
        }
    }

    /// Copies the header of committed sample `seq` (the caller checked it is committed and
    /// not yet taken) out of its slot and checks it.
    ///
    /// # Errors
    /// What is wrong with the slot (the worker broke the protocol).
    pub fn check(&self, seq: u64) -> Result<SlotMeta, String> {
        let mut header = [0u8; SLOT_HEADER];
        self.segment.get(self.slot_offset(seq), &mut header);
        // Checked on our copy only: the worker cannot change it under us.
        let got = u64::from_le_bytes(header[0..8].try_into().expect("8 bytes"));
        let flags = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        let priority = f64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        if got != seq {
            return Err(format!("slot of sample {seq} holds sample {got}"));
        }
        if flags & !(FLAG_PRIORITY | FLAG_STEP) != 0 {
            return Err(format!("sample {seq}: unknown slot flags {flags:#x}"));
        }
        let mut meta = SlotMeta {
            priority: (flags & FLAG_PRIORITY != 0).then_some(priority),
            ..SlotMeta::default()
        };
        if flags & FLAG_STEP != 0 {
            meta.row = u32::from_le_bytes(header[24..28].try_into().expect("4 bytes"));
            meta.end = EpisodeEnd::from_code(header[28]).ok_or_else(|| {
                format!("sample {seq}: episode flag {} is not 0, 1 or 2", header[28])
            })?;
        }
        Ok(meta)
    }

    /// The segment offset of the slot holding sample `seq`: computed from our own geometry
    /// only, so always inside the segment (`Segment::get` checks again regardless).
    fn slot_offset(&self, seq: u64) -> usize {
        let index = usize::try_from(seq % self.slots as u64).expect("< slots");
        HEADER_LEN + index * self.stride
    }

    /// Copies `dst.len()` payload bytes of sample `seq`, from byte `offset` of its payload,
    /// into `dst` (one raw copy out of the segment). Nothing is copied if the range is not
    /// inside the payload (a caller's bug; `dst` keeps its bytes).
    pub fn copy_payload(&self, seq: u64, offset: usize, dst: &mut [u8]) {
        if offset.checked_add(dst.len()).is_some_and(|end| end <= self.payload_size) {
            self.segment.get(self.slot_offset(seq) + SLOT_HEADER + offset, dst);
        }
    }

    /// Announces that we are about to sleep on `data` (see [`Indices::sleep_begin`]); look
    /// again with [`Reader::available`] before sleeping, and call [`Reader::sleep_end`] after.
    pub fn sleep_begin(&self) {
        Indices::sleep_begin(self.indices().reader_sleeping);
    }

    /// Lowers our sleeping flag.
    pub fn sleep_end(&self) {
        Indices::sleep_end(self.indices().reader_sleeping);
    }

    /// Writes `bytes` into the raw segment at `offset` (clamped to the segment): what a
    /// hostile worker can do, for tests and the fuzz target.
    #[doc(hidden)]
    pub fn scribble(&self, offset: usize, bytes: &[u8]) {
        let offset = offset.min(self.segment.len);
        let n = bytes.len().min(self.segment.len - offset);
        self.segment.put(offset, &bytes[..n]);
    }
}

/// Committed samples of a [`Reader`] as a [`SampleSource`]: a backend copies each leaf
/// straight out of the segment into its ring ([`SampleSource::copy_leaf`], one raw copy per
/// leaf), so the learner copies each sample once. The slot headers were checked (copied out)
/// before; the payload bytes are the worker's and taken as they are.
///
/// [`SampleSource`]: crate::source::SampleSource
/// [`SampleSource::copy_leaf`]: crate::source::SampleSource::copy_leaf
pub struct Samples<'a> {
    reader: &'a Reader,
    /// Sequence number of the first sample.
    first: u64,
    /// Each sample's checked header.
    metas: &'a [SlotMeta],
    /// Each leaf's byte offset and length in the payload.
    leaves: &'a [(usize, usize)],
    /// [`SampleSource::leaf`]'s private copies, made only if something asks for references.
    copies: std::cell::OnceCell<Vec<Box<[u8]>>>,
    /// The backend stream of row 0 of the worker's connection (see [`Samples::with_streams`]).
    stream_base: u64,
}

impl<'a> Samples<'a> {
    /// Samples `first..first + metas.len()` of `reader`, whose payloads are split into
    /// `leaves` (offset, length).
    pub fn new(
        reader: &'a Reader,
        first: u64,
        metas: &'a [SlotMeta],
        leaves: &'a [(usize, usize)],
    ) -> Self {
        Self { reader, first, metas, leaves, copies: std::cell::OnceCell::new(), stream_base: 0 }
    }

    /// The same samples as steps of the streams `stream_base | row` (a sequence table's
    /// streams of the worker's connection).
    #[must_use]
    pub fn with_streams(self, stream_base: u64) -> Self {
        Self { stream_base, ..self }
    }
}

impl crate::source::SampleSource for Samples<'_> {
    fn num_samples(&self) -> usize {
        self.metas.len()
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.leaves.len()
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        // Never a reference into the segment: a private copy of every payload.
        let copies = self.copies.get_or_init(|| {
            (0..self.metas.len())
                .map(|i| {
                    let mut payload = vec![0u8; self.reader.payload_size].into_boxed_slice();
                    self.reader.copy_payload(self.first + i as u64, 0, &mut payload);
                    payload
                })
                .collect()
        });
        let (offset, len) = self.leaves[leaf];
        &copies[sample][offset..offset + len]
    }
    fn leaf_len(&self, _sample: usize, leaf: usize) -> usize {
        self.leaves[leaf].1
    }
    fn copy_leaf(&self, sample: usize, leaf: usize, dst: &mut [u8]) {
        self.reader.copy_payload(self.first + sample as u64, self.leaves[leaf].0, dst);
    }
    fn priority(&self, sample: usize) -> Option<f64> {
        self.metas[sample].priority
    }
    fn step(&self, sample: usize) -> StepTag {
        let meta = &self.metas[sample];
        StepTag { stream: self.stream_base | u64::from(meta.row), end: meta.end }
    }
}

/// The worker's side of one channel.
pub struct Writer {
    segment: Segment,
    slots: usize,
    stride: usize,
    payload_size: usize,
    /// Samples committed.
    tail: u64,
    /// Rung by us after a commit while the learner sleeps.
    data: EventFd,
    /// Rung by the learner when it takes samples while we wait.
    space: EventFd,
    /// Tests only: stop (SIGSTOP) half-way through writing this sample.
    stop_at: Option<u64>,
}

impl Writer {
    /// Connects to the learner's socket `name` (abstract namespace), presents `nonce`,
    /// receives the segment and bells, and checks the segment for samples of `payload_size`
    /// bytes; all within `timeout`.
    ///
    /// # Errors
    /// A message saying what failed.
    pub fn attach(
        name: &[u8],
        nonce: &[u8; NONCE_LEN],
        payload_size: usize,
        timeout: Duration,
    ) -> Result<Self, String> {
        let addr = UnixAddr::from_abstract_name(name)
            .map_err(|e| format!("bad socket name from the learner: {e}"))?;
        let mut stream = UnixStream::connect_addr(&addr).map_err(|e| {
            format!(
                "cannot reach the learner's shared-memory socket (another network namespace, \
                 e.g. a container?): {e}"
            )
        })?;
        let timeout = timeout.max(Duration::from_millis(1));
        stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
        stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
        stream.write_all(nonce).map_err(|e| format!("cannot send the nonce: {e}"))?;
        let mut message = [0u8; 8];
        let (n, fds) = recv_fds(stream.as_raw_fd(), &mut message).map_err(|e| {
            format!("the learner sent no segment (another user, or the nonce was refused): {e}")
        })?;
        let mut fds = fds.into_iter();
        let (Some(memfd), Some(data), Some(space), None) =
            (fds.next(), fds.next(), fds.next(), fds.next())
        else {
            return Err(format!(
                "the learner refused to attach this process (it runs under another user, or \
                 the nonce did not match): got {n} bytes and no segment"
            ));
        };
        if n != message.len() || &message != ATTACH_MESSAGE {
            return Err(format!("unexpected attach message {:?}", &message[..n]));
        }
        let (segment, slots, stride) = Segment::attach(memfd, payload_size)?;
        let stop_at = stop_at_from_env();
        let writer = Self {
            tail: 0,
            segment,
            slots,
            stride,
            payload_size,
            data: EventFd(data),
            space: EventFd(space),
            stop_at,
        };
        // ORDERING: see `Indices::committed`; a learner's segment starts with tail 0.
        let tail = writer.indices().tail.load(std::sync::atomic::Ordering::Acquire);
        if tail != 0 {
            return Err(format!("a fresh segment starts at sample {tail}"));
        }
        Ok(writer)
    }

    fn indices(&self) -> Indices<'_> {
        self.segment.indices(self.slots)
    }

    /// Slots in the ring.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Samples committed.
    pub fn committed(&self) -> u64 {
        self.tail
    }

    /// Samples the learner has taken (in its ring; their slots are free again).
    pub fn taken(&self) -> u64 {
        self.indices().taken()
    }

    /// A descriptor of the space bell, for a thread that wakes waiters when the connection
    /// is lost.
    ///
    /// # Errors
    /// The system call's.
    pub fn space_bell(&self) -> io::Result<EventFd> {
        self.space.try_clone()
    }

    /// Writes one sample (its leaves, which the caller checked add up to the payload size)
    /// and commits it, if a slot is free. `false`: the ring is full.
    pub fn try_send(&mut self, leaves: &[&[u8]], meta: &SlotMeta) -> bool {
        let indices = self.segment.indices(self.slots);
        if !indices.has_room(self.tail) {
            return false;
        }
        let index = usize::try_from(self.tail % self.slots as u64).expect("< slots");
        let offset = HEADER_LEN + index * self.stride;
        let mut header = [0u8; SLOT_HEADER];
        header[0..8].copy_from_slice(&self.tail.to_le_bytes());
        let mut flags = if meta.priority.is_some() { FLAG_PRIORITY } else { 0 };
        if meta.is_step() {
            flags |= FLAG_STEP;
            header[24..28].copy_from_slice(&meta.row.to_le_bytes());
            header[28] = meta.end.code();
        }
        header[8..12].copy_from_slice(&flags.to_le_bytes());
        header[16..24].copy_from_slice(&meta.priority.unwrap_or(0.0).to_le_bytes());
        self.segment.put(offset, &header);
        let mut at = offset + SLOT_HEADER;
        let end = at + self.payload_size;
        for leaf in leaves {
            let n = leaf.len().min(end - at);
            if self.stop_at == Some(self.tail) {
                self.segment.put(at, &leaf[..n / 2]);
                // SAFETY: raising a signal on ourselves; SIGSTOP cannot be caught.
                unsafe { libc::raise(libc::SIGSTOP) };
            }
            self.segment.put(at, &leaf[..n]);
            at += n;
        }
        self.tail += 1;
        indices.commit(self.tail, &self.data);
        true
    }

    /// Waits until the learner has taken at least `target` samples, `until` at the latest
    /// (callers pass short slices, so they notice a lost connection). Whether it has.
    pub fn wait_taken(&self, target: u64, until: Instant) -> bool {
        let indices = self.indices();
        loop {
            if indices.taken() >= target {
                return true;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            Indices::sleep_begin(indices.writer_sleeping);
            if indices.taken() < target {
                self.space.wait(left);
            }
            Indices::sleep_end(indices.writer_sleeping);
        }
    }
}

/// A random abstract socket name for a new channel: [`NAME_PREFIX`] and 32 hex digits.
///
/// # Errors
/// If the OS has no randomness.
pub fn random_name() -> Result<Vec<u8>, crate::error::EchoError> {
    let raw: [u8; 16] = super::wire::v2::random()?;
    let mut name = NAME_PREFIX.as_bytes().to_vec();
    for b in raw {
        name.extend_from_slice(format!("{b:02x}").as_bytes());
    }
    Ok(name)
}

/// Binds a listening Unix socket at abstract `name`, non-blocking.
///
/// # Errors
/// The bind's.
pub fn listen(name: &[u8]) -> io::Result<std::os::unix::net::UnixListener> {
    let addr = UnixAddr::from_abstract_name(name)?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The uid of the process on the other end of a Unix socket (`SO_PEERCRED`).
///
/// # Errors
/// The system call's.
pub fn peer_uid(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: u32::MAX };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a valid out-buffer of `len` bytes.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    })?;
    Ok(cred.uid)
}

/// Our effective uid.
pub fn own_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Room for the control message of up to 4 descriptors (u64s, so it is aligned for cmsghdr).
type CmsgBuf = [u64; 8];

/// Sends `data` with `fds` attached (`SCM_RIGHTS`) on the Unix socket `fd`.
///
/// # Errors
/// The system call's.
pub fn send_fds(fd: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    assert!(fds.len() <= 4, "room for 4 descriptors");
    let mut control: CmsgBuf = [0; 8];
    let fd_bytes = std::mem::size_of_val(fds) as libc::c_uint;
    let mut iov = libc::iovec { iov_base: data.as_ptr().cast_mut().cast(), iov_len: data.len() };
    // SAFETY: a zeroed msghdr is a valid empty one; we fill the fields below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(fd_bytes) } as _;
    // SAFETY: `msg_control` points at `control`, large enough for one header and 4 fds
    // (CMSG_SPACE(16) <= 64 bytes), so the first header is inside it.
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if cmsg.is_null() {
        return Err(io::Error::other("no room for the control message"));
    }
    // SAFETY: `cmsg` points at the start of `control` (checked non-null), aligned (u64s).
    let header = unsafe { &mut *cmsg };
    header.cmsg_level = libc::SOL_SOCKET;
    header.cmsg_type = libc::SCM_RIGHTS;
    // SAFETY: a pure size computation.
    header.cmsg_len = unsafe { libc::CMSG_LEN(fd_bytes) } as _;
    // SAFETY: CMSG_DATA of a header inside `control` points inside it, with room for the fds.
    let data_ptr = unsafe { libc::CMSG_DATA(cmsg) };
    // SAFETY: `fd_bytes` bytes fit after the header (CMSG_SPACE above); unaligned-safe copy.
    unsafe {
        std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), data_ptr, fd_bytes as usize)
    };
    // SAFETY: `msg` describes valid buffers for the duration of the call.
    let sent = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != data.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short send of the attach message"));
    }
    Ok(())
}

/// Receives into `buf` with any descriptors attached (`SCM_RIGHTS`, close-on-exec): the bytes
/// read and the descriptors (owned: closed when dropped, also when the caller rejects them).
///
/// # Errors
/// The system call's, or `InvalidData` if descriptors were cut off.
pub fn recv_fds(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut control: CmsgBuf = [0; 8];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: a zeroed msghdr is a valid empty one; we fill the fields below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of::<CmsgBuf>() as _;
    let received = loop {
        // SAFETY: `msg` describes valid buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR reads its control fields.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: a non-null header returned by CMSG_FIRSTHDR/NXTHDR lies inside `control`.
        let header = unsafe { &*cmsg };
        if header.cmsg_level == libc::SOL_SOCKET && header.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: a pure size computation.
            let start = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = (header.cmsg_len as usize).saturating_sub(start) / 4;
            // SAFETY: the data of a header inside `control`.
            let data = unsafe { libc::CMSG_DATA(cmsg) };
            for i in 0..count {
                // SAFETY: the kernel wrote `count` descriptors after the header, inside
                // `control` (it truncates, and flags MSG_CTRUNC, rather than overflow it), so
                // the i-th one's bytes are in bounds.
                let at = unsafe { data.add(i * 4) };
                // SAFETY: as above: 4 readable bytes at `at`; read unaligned.
                let raw = unsafe { at.cast::<RawFd>().read_unaligned() };
                // SAFETY: the kernel just installed `raw` in our table for us alone.
                fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
            }
        }
        // SAFETY: `cmsg` is a header inside the control buffer `msg` describes.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "descriptors were cut off"));
    }
    Ok((received, fds))
}
