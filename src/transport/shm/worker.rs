//! The worker's side of a channel as the TCP client uses it: the [`Writer`](super::Writer) it
//! writes samples into (`ShmWriter`), attaching what the server offered, and the bell its
//! reader thread rings when the connection is lost (`LossBell`: a second descriptor of the
//! space bell, so a sender waiting for a free slot wakes up and sees the loss).

use std::io;
use std::time::Duration;

pub(crate) use super::{EventFd as LossBell, Writer as ShmWriter};
use crate::transport::wire::v2;

/// Attaches the channel `offer` names (see [`Writer::attach`](super::Writer::attach)), within
/// `timeout`.
pub(crate) fn attach(
    offer: &v2::ShmOffer,
    payload_size: usize,
    timeout: Duration,
) -> Result<ShmWriter, String> {
    ShmWriter::attach(&offer.name, &offer.nonce, payload_size, timeout)
}

/// A second descriptor of `writer`'s space bell, for the reader thread.
pub(crate) fn loss_bell(writer: &ShmWriter) -> io::Result<LossBell> {
    writer.space_bell()
}
