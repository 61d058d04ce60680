//! A ragged worker's shared-memory pipe on Linux: attached from the server's offer, written
//! frame by frame, its acknowledgements read from its segment.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use crate::error::EchoError;
pub(super) use crate::transport::shm::params::{ParamView as Region, ViewRead};
pub(super) use crate::transport::shm::pipe::{
    PipeAcks as Acks, PipeStop as Stop, PipeWriter as Writer,
};
use crate::transport::shm::ring::Bell;
use crate::transport::shm::EventFd;
use crate::transport::wire::v2;

/// Whether this build can attach a pipe.
pub(super) const SUPPORTED: bool = true;

/// Rings `bell`.
pub(super) fn ring(bell: &EventFd) {
    bell.ring();
}

/// Attaches the pipe `accept` offers, with the learner's parameter region when it hands one
/// over. Without one, or when attaching fails: TCP (the server is told with `SHM_DECLINE`
/// if it offered one), or the reason as an error when `required` (after a goodbye).
pub(super) fn attach(
    accept: &v2::Accept,
    stream: &mut TcpStream,
    address: &str,
    required: bool,
    timeout: Duration,
) -> Result<Option<(Writer, Option<Region>)>, EchoError> {
    let why = match &accept.shm {
        None if accept.note.is_empty() => {
            format!("the server at {address} does not offer shared memory")
        }
        None => format!("the server at {address} did not offer it: {}", accept.note),
        Some(offer) => match Writer::attach(&offer.name, &offer.nonce, timeout) {
            Ok((writer, region)) => return Ok(Some((writer, region.map(Region::new)))),
            Err(why) => format!("cannot attach the shared memory of {address}: {why}"),
        },
    };
    if required {
        let _ = stream.write_all(&[v2::BYE]);
        return Err(EchoError::SharedMemory(format!("shared_memory=True: {why}")));
    }
    log::debug!("{why}; sending over TCP");
    if accept.shm.is_some() {
        stream.write_all(&[v2::SHM_DECLINE])?;
    }
    Ok(None)
}
