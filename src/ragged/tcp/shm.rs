//! The same-host shared-memory path: a byte pipe the worker writes its frames into
//! ([`crate::transport::shm::pipe`]), read with the same parser as TCP; its
//! acknowledgements, errors and closing notices still go over TCP, whose end (the worker
//! gone, or the server closing) ends the pipe's stream.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use super::Shared;
use crate::error::EchoError;
use crate::transport::shm::pipe::{
    Attached, PipeOffer, PipeReader, PIPE_CAPACITY, PIPE_SEGMENT_LEN,
};
use crate::transport::shm::same_host;
use crate::transport::wire::v2::{self, ShmOffer};

/// How long a client has to attach the pipe it was offered.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);

/// A pipe offered in the reply.
pub(super) struct Offered(PipeOffer);

impl Offered {
    /// The offer as the reply carries it.
    pub(super) fn wire(&self) -> ShmOffer {
        ShmOffer { name: self.0.name.clone(), nonce: self.0.nonce }
    }
}

/// A pipe's bytes held against the server's bound on pipes; given back when dropped.
pub(super) struct Held<'a>(&'a Shared);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        *self.0.segments.lock() -= PIPE_SEGMENT_LEN;
    }
}

/// A worker's frames through its pipe (no buffer: reading the pipe is a copy out of
/// memory already); acknowledgements as the count of samples stored, in the pipe's
/// segment, so neither side makes a system call for them.
pub(super) struct PipeInput {
    pipe: PipeReader,
    stored: u64,
}

impl PipeInput {
    pub(super) fn pipe(&self) -> &PipeReader {
        &self.pipe
    }

    pub(super) fn pipe_mut(&mut self) -> &mut PipeReader {
        &mut self.pipe
    }

    /// Acknowledges `n` more samples, stored (what [`super::Input::ack`] does).
    pub(super) fn ack_stored(&mut self, n: usize) -> io::Result<()> {
        super::Input::ack(self, n)
    }
}

impl Read for PipeInput {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.pipe.read(buf)
    }
}

impl super::Input for PipeInput {
    fn pumped(&self) -> bool {
        true
    }
    fn dry(&self) -> bool {
        // Each frame's samples are acknowledged as soon as they are stored.
        true
    }
    fn ack(&mut self, n: usize) -> io::Result<()> {
        self.stored += n as u64;
        self.pipe.acknowledge(self.stored);
        Ok(())
    }
    fn ahead(&self, len: usize) -> io::Result<Option<&dyn super::Ahead>> {
        let ready = self.pipe.ready()?;
        Ok((ready >= len as u64).then_some(&self.pipe as &dyn super::Ahead))
    }
    fn consume(&mut self, len: usize) {
        self.pipe.skip(len as u64);
    }
}

impl super::Ahead for PipeReader {
    fn copy_ahead(&self, offset: usize, out: &mut [u8]) {
        PipeReader::copy_ahead(self, offset as u64, out);
    }
}

/// Which way a worker's frames come.
pub(super) enum Path<'a> {
    /// Through its pipe.
    Pipe(PipeInput, Held<'a>),
    /// Over TCP: it declined the pipe.
    Tcp,
    /// Nowhere: it left (or said goodbye) before attaching.
    Ended,
}

/// A pipe for the client on `stream`, or why it cannot have one (the reply's note).
pub(super) fn offer(shared: &Shared, stream: &TcpStream) -> Result<Offered, String> {
    if !shared.shared_memory {
        return Err("the server has shared memory turned off \
                    (TcpTransport(shared_memory=False))"
            .into());
    }
    let (peer, local) = (stream.peer_addr(), stream.local_addr());
    let (Ok(peer), Ok(local)) = (peer, local) else {
        return Err("the connection has no addresses".into());
    };
    if !same_host(peer.ip(), local.ip()) {
        return Err(format!(
            "the client ({}) is not on the learner's host ({})",
            peer.ip(),
            local.ip()
        ));
    }
    let held = *shared.segments.lock();
    if held + PIPE_SEGMENT_LEN > shared.max_segments {
        return Err(format!(
            "the learner's shared-memory pipes already hold {held} of the {} bytes they \
             may (half of max_buffered_bytes); a pipe needs {PIPE_SEGMENT_LEN}",
            shared.max_segments
        ));
    }
    PipeOffer::new().map(Offered)
}

/// Waits for the client to attach its pipe, decline it or leave. `leftover` holds what
/// it sent after its hello (a decline, then frames); what is read from the socket here
/// is added to it.
pub(super) fn attach<'a>(
    shared: &'a Shared,
    Offered(offer): Offered,
    stream: &mut TcpStream,
    leftover: &mut Vec<u8>,
) -> Result<Path<'a>, EchoError> {
    if leftover.is_empty() {
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        // The learner's parameter region goes with the pipe: the worker copies a version
        // from it instead of fetching it in chunks over its socket.
        let region = shared.params.as_ref().and_then(|p| p.region());
        match offer.wait(stream.as_fd(), PIPE_CAPACITY, deadline, region.map(|r| r.fd())) {
            Ok(Attached::Pipe(mut pipe)) => {
                // Counted now (the offer only looked): a few concurrent attaches may
                // pass the bound by a pipe or two.
                *shared.segments.lock() += PIPE_SEGMENT_LEN;
                let held = Held(shared);
                pipe.watch(stream.as_fd())?;
                return Ok(Path::Pipe(PipeInput { pipe, stored: 0 }, held));
            }
            Ok(Attached::Socket) => {}
            Err(why) => return Err(EchoError::Protocol(why)),
        }
        let mut byte = [0u8; 1];
        if stream.read(&mut byte)? == 0 {
            return Ok(Path::Ended);
        }
        leftover.push(byte[0]);
    }
    match leftover[0] {
        v2::SHM_DECLINE => {
            leftover.remove(0);
            Ok(Path::Tcp)
        }
        v2::BYE => Ok(Path::Ended),
        other => Err(EchoError::Protocol(format!(
            "frame type {other:#04x} before the shared memory was attached or declined"
        ))),
    }
}
