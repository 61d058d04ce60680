//! Where a transport writes into the backend itself instead of pushing into the ingress for
//! a drainer to insert. The ingress ([`crate::ingress`]) is the one way in otherwise; each
//! path here exists to save a copy, and each counts its samples as a drainer would
//! (`Connection::try_insert_in_place`, `Connection::direct`).
//!
//! - [`insert_in_place`] (TCP, FIFO ring only): a large sample whose bytes the kernel already
//!   holds is read from the socket straight into a free ring slot, skipping the pooled buffer
//!   and the drainer's copy. Only when nothing of the connection is still queued, so the
//!   connection's order holds; the read cannot wait, so a slow peer never holds a slot.
//! - [`insert_from_segment`] (shared memory, Linux, every backend): committed samples go from
//!   the worker's segment straight into the backend, one copy, without waiting; what does not
//!   fit stays in the segment, which is that connection's queue and its backpressure. The
//!   shared-memory task also waits on the backend's insert bell and records the backend's
//!   blocked time itself (`crate::transport::shm::server`).
//!
//! Everything else a transport asks of the backend is read-only: its spec, codecs, whether it
//! takes priorities or steps, and the checks of a frame's fields.

use std::io;
#[cfg(unix)]
use std::time::{Duration, Instant};

use tokio::net::tcp::OwnedReadHalf;

#[cfg(target_os = "linux")]
use crate::backend::Backend;
#[cfg(target_os = "linux")]
use crate::error::EchoError;
use crate::ingress::Connection;
#[cfg(target_os = "linux")]
use crate::source::SampleSource;
#[cfg(target_os = "linux")]
use crate::transport::shm::Samples;

/// How long `fill_in_place` waits for bytes FIONREAD promised and a read did not return.
#[cfg(unix)]
const IN_PLACE_GRACE: Duration = Duration::from_secs(1);

/// Reads the next sample into a free slot of the FIFO ring
/// ([`Connection::try_insert_in_place`]): first `staged` (bytes of it already read), then the
/// rest from `reader`'s socket, which already holds them. `None` when nothing was read (no
/// free slot, another backend, or something of this connection still queued); otherwise how
/// the read went: the slot is committed either way (see `fill_in_place`).
pub(crate) fn insert_in_place(
    conn: &Connection,
    reader: &OwnedReadHalf,
    staged: &[u8],
) -> Option<io::Result<()>> {
    let mut read = Ok(());
    if !conn.try_insert_in_place(|leaves| read = fill_in_place(reader, staged, leaves)) {
        return None;
    }
    Some(read)
}

/// Inserts a shared-memory segment's committed `samples` into `backend`, without waiting
/// (the insert gives up at once when there is no room), counted on `conn` as the backend
/// takes them. Returns how many went in and, if not all, why not.
#[cfg(target_os = "linux")]
pub(crate) fn insert_from_segment(
    backend: &Backend,
    conn: &Connection,
    samples: Samples<'_>,
) -> (usize, Option<EchoError>) {
    let count = samples.num_samples();
    match backend.insert(&conn.direct(samples), None, Some(Instant::now())) {
        Ok(()) => (count, None),
        Err(e) => (e.inserted, Some(e.error)),
    }
}

/// Fills `leaves` (one ring slot of every leaf, in order) with `staged` and then bytes read
/// from `reader`'s socket, which already holds them (see `Link::read_in_place`). Reads with
/// `readv` on the non-blocking descriptor, bypassing tokio's readiness (tokio finds out at
/// its next read, which then waits for the next event as usual). Should the kernel return
/// fewer bytes than it said it had, waits up to [`IN_PLACE_GRACE`] for the rest; failing
/// that the rest is zeroed and an error returned (the slot must be committed either way).
#[cfg(unix)]
fn fill_in_place(
    reader: &OwnedReadHalf,
    staged: &[u8],
    leaves: &mut [&mut [u8]],
) -> io::Result<()> {
    use std::io::IoSliceMut;
    use std::os::fd::AsRawFd;
    let fd = reader.as_ref().as_raw_fd();
    // Skip past the staged bytes, copying them in.
    let (mut leaf, mut at) = (0, 0);
    let mut rest = staged;
    while !rest.is_empty() {
        let dst = &mut leaves[leaf][at..];
        let n = dst.len().min(rest.len());
        dst[..n].copy_from_slice(&rest[..n]);
        (rest, at) = (&rest[n..], at + n);
        if at == leaves[leaf].len() {
            (leaf, at) = (leaf + 1, 0);
        }
    }
    let deadline = Instant::now() + IN_PLACE_GRACE;
    loop {
        while leaf < leaves.len() && at == leaves[leaf].len() {
            (leaf, at) = (leaf + 1, 0);
        }
        if leaf == leaves.len() {
            return Ok(());
        }
        let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(leaves.len() - leaf);
        let (first, later) = leaves[leaf..].split_at_mut(1);
        slices.push(IoSliceMut::new(&mut first[0][at..]));
        slices.extend(later.iter_mut().map(|l| IoSliceMut::new(l)));
        // At most IOV_MAX (1024 on Linux and macOS) slices per call.
        let count = slices.len().min(1024) as libc::c_int;
        // SAFETY: `IoSliceMut` is ABI-compatible with `iovec` on unix; the slices are
        // `count` valid, writable, non-overlapping buffers borrowed for this call.
        let got = unsafe { libc::readv(fd, slices.as_ptr().cast::<libc::iovec>(), count) };
        drop(slices);
        let err = match got {
            n if n > 0 => {
                let mut n = n as usize;
                while n > 0 {
                    let room = leaves[leaf].len() - at;
                    let step = room.min(n);
                    (at, n) = (at + step, n - step);
                    if at == leaves[leaf].len() && n > 0 {
                        (leaf, at) = (leaf + 1, 0);
                    }
                }
                continue;
            }
            0 => io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed mid-sample"),
            _ => io::Error::last_os_error(),
        };
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock if Instant::now() < deadline => {
                let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid `pollfd`; a bounded wait on a descriptor we own.
                unsafe { libc::poll(&mut poll, 1, 10) };
            }
            _ => {
                for rest in leaves[leaf..].iter_mut() {
                    rest[at..].fill(0);
                    at = 0;
                }
                return Err(err);
            }
        }
    }
}

#[cfg(not(unix))]
fn fill_in_place(_: &OwnedReadHalf, _: &[u8], _: &mut [&mut [u8]]) -> io::Result<()> {
    unreachable!("Link::readable_bytes is None off unix, so nothing is read in place")
}
