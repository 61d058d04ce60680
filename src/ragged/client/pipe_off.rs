//! Off Linux a ragged worker has no pipe: every frame goes over TCP.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::EchoError;
use crate::transport::wire::v2;

pub(super) const SUPPORTED: bool = false;

pub(super) enum Writer {}
pub(super) enum Acks {}
#[allow(dead_code)] // matched on by the caller; nothing stops off Linux
pub(super) enum Stop {
    TimedOut,
    Lost,
}
pub(super) struct Bell;
/// The learner's parameter region: none off Linux.
pub(super) enum Region {}
/// What a read of the region found (as Linux's `ViewRead`).
#[allow(dead_code)] // matched on by the caller; never made off Linux
pub(super) enum ViewRead {
    Copied(u64),
    Empty,
    Size(u64),
    Busy,
}

impl Region {
    pub(super) fn read(&mut self, _: &mut [u8], _: usize) -> Result<ViewRead, String> {
        match *self {}
    }
}

impl Acks {
    pub(super) fn stored(&self) -> u64 {
        match *self {}
    }
    pub(super) fn wait_stored(
        &self,
        _: u64,
        _: Option<Instant>,
        _: &dyn Fn() -> bool,
    ) -> Result<(), Stop> {
        match *self {}
    }
}

impl Writer {
    pub(super) fn space_bell(&self) -> std::io::Result<Bell> {
        match *self {}
    }
    pub(super) fn acks(&self) -> std::io::Result<Acks> {
        match *self {}
    }
    pub(super) fn write_frame(
        &mut self,
        _: &[&[u8]],
        _: Option<Instant>,
        _: &dyn Fn() -> bool,
    ) -> Result<(), Stop> {
        match *self {}
    }
}

pub(super) fn ring(_: &Bell) {}

pub(super) fn attach(
    _: &v2::Accept,
    _: &mut TcpStream,
    address: &str,
    required: bool,
    _: Duration,
) -> Result<Option<(Writer, Option<Region>)>, EchoError> {
    if required {
        return Err(EchoError::SharedMemory(format!(
            "shared_memory=True: shared memory needs Linux (the server at {address})"
        )));
    }
    Ok(None)
}
