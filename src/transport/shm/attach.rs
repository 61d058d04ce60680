//! Attaching a channel: who may have one (a peer on this host), the learner's abstract Unix
//! socket and its name, the peer's credentials, and handing the segment and the bells over
//! with `SCM_RIGHTS`.

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr as UnixAddr;

use super::layout::NAME_PREFIX;
use super::segment::cvt;

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

/// A random abstract socket name for a new channel: [`NAME_PREFIX`] and 32 hex digits.
///
/// # Errors
/// If the OS has no randomness.
pub fn random_name() -> Result<Vec<u8>, crate::error::EchoError> {
    let raw: [u8; 16] = crate::transport::wire::v2::random()?;
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
