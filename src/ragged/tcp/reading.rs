//! Reading a worker's frames off its socket: the wait between frames (as long as the worker
//! likes), a body's silence (at most [`super::TcpOptions::body_silence`]) and the body's
//! buffer, grown as its bytes come.

use std::io::{self, Read};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Input, Shared};
use crate::error::EchoError;

pub(super) fn read_exact_or_eof(reader: &mut impl Read, buf: &mut [u8]) -> Result<bool, EchoError> {
    match reader.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// How much of a frame's body is made room for at a time: a peer that announces a large
/// body and sends little of it commits no more memory than it sent and this.
const BODY_STEP: usize = 1 << 20;

/// Reads a frame's body of `len` bytes into `buffer` (grown a [`BODY_STEP`] at a time as
/// the bytes come, never shrunk: a connection's buffer is reused); `None` at the end of the
/// input.
///
/// # Errors
/// As a read.
pub(super) fn read_body<'b>(
    reader: &mut impl Read,
    buffer: &'b mut Vec<u8>,
    len: usize,
) -> Result<Option<&'b mut [u8]>, EchoError> {
    let mut have = 0;
    while have < len {
        let step = (len - have).min(BODY_STEP);
        if buffer.len() < have + step {
            buffer.resize(have + step, 0);
        }
        if !read_exact_or_eof(reader, &mut buffer[have..have + step])? {
            return Ok(None);
        }
        have += step;
    }
    Ok(Some(&mut buffer[..len]))
}

/// Reads the kind byte of the next frame: `Ok(false)` at the end of the input or once the
/// server closes. A worker may be idle between frames as long as it likes: the socket's read
/// timeout ([`TcpOptions::body_silence`], set for the middle of a frame) only has the
/// server look at whether it is closing.
pub(super) fn read_kind(
    shared: &Shared,
    reader: &mut impl Input,
    kind: &mut [u8; 1],
) -> Result<bool, EchoError> {
    loop {
        match reader.read(kind) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            Err(err)
                if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
            {
                // ORDERING: SeqCst — pairs with `close`.
                if shared.closing.load(Ordering::SeqCst) {
                    return Ok(false);
                }
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(err) => return Err(err.into()),
        }
    }
}

/// A read that waited out [`TcpOptions::body_silence`] as the error the worker is told.
pub(super) fn stalled(err: EchoError, limit: Option<Duration>) -> EchoError {
    match (err, limit) {
        (EchoError::Io(io), Some(limit))
            if matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
        {
            EchoError::Protocol(format!(
                "no byte of a frame's body for {limit:.1?}: the connection is taken for dead"
            ))
        }
        (err, _) => err,
    }
}
