//! The bell of one direction of a channel ([`EventFd`]): an eventfd, rung by one side and
//! waited on (polled, or registered with tokio) by the other. It implements the ring's
//! [`Bell`]; a ring before the wait stays in the eventfd's count, so none is lost.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use super::ring::Bell;
use super::segment::cvt;

/// An eventfd used as a bell (non-blocking; the flag is shared with the peer's copy).
#[derive(Debug)]
pub struct EventFd(pub(super) OwnedFd);

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
