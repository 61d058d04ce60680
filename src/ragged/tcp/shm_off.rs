//! Off Linux no pipe is offered: every worker sends over TCP.

use std::net::TcpStream;

use super::Shared;
use crate::error::EchoError;
use crate::transport::wire::v2::ShmOffer;

pub(super) enum Offered {}

impl Offered {
    pub(super) fn wire(&self) -> ShmOffer {
        match *self {}
    }
}

pub(super) enum PipeInput {}

impl std::io::Read for PipeInput {
    fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
        match *self {}
    }
}

impl super::Input for PipeInput {
    fn dry(&self) -> bool {
        match *self {}
    }
    fn ack(&mut self, _: usize) -> std::io::Result<()> {
        match *self {}
    }
}

#[allow(dead_code)] // matched on by the caller; only a pipe's attach makes one
pub(super) enum Path {
    Pipe(PipeInput, ()),
    Tcp,
    Ended,
}

pub(super) fn offer(_: &Shared, _: &TcpStream) -> Result<Offered, String> {
    Err("shared memory needs Linux".into())
}

pub(super) fn attach(
    _: &Shared,
    offered: Offered,
    _: &mut TcpStream,
    _: &mut Vec<u8>,
) -> Result<Path, EchoError> {
    match offered {}
}
