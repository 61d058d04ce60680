//! Parameter fetches on a ragged worker's connection ([`crate::transport::wire::params`]):
//! one chunk of the version asked for, or of the parameters' description, per FETCH frame,
//! written back on the worker's socket (whichever way its frames come: a pipe's fetches
//! come through the pipe). At most [`TURNS`] chunks are copied out of the store at once,
//! whatever the number of connections.

use std::io::Write;
use std::net::TcpStream;

use parking_lot::{Condvar, Mutex};

use super::Shared;
use crate::error::EchoError;
use crate::params::ChunkBytes;
use crate::transport::wire::params::{Chunk, Fetch, DESCRIPTION};

/// Chunks copied out of the parameter store at once.
const TURNS: usize = 16;

/// Turns to copy a chunk: taken in turn, so that many fetching workers take at most
/// [`TURNS`] chunk buffers at once.
#[derive(Default)]
pub(super) struct Turns {
    taken: Mutex<usize>,
    freed: Condvar,
}

impl Turns {
    fn take(&self) -> Turn<'_> {
        let mut taken = self.taken.lock();
        while *taken >= TURNS {
            self.freed.wait(&mut taken);
        }
        *taken += 1;
        Turn(self)
    }
}

struct Turn<'a>(&'a Turns);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *self.0.taken.lock() -= 1;
        self.0.freed.notify_one();
    }
}

/// Answers one FETCH (`raw`: the frame after its kind byte) on `writer`.
///
/// # Errors
/// [`EchoError::Protocol`] for a fetch that asks for bytes outside the parameters (the
/// worker is told, and the connection ends) or a server that serves none; a failed write.
pub(super) fn serve(
    shared: &Shared,
    raw: &[u8],
    writer: &Mutex<TcpStream>,
) -> Result<(), EchoError> {
    let Some(published) = &shared.params else {
        return Err(EchoError::Protocol("this server serves no parameters".into()));
    };
    if raw[..8] == DESCRIPTION.to_le_bytes() {
        let description = published.description();
        let size = description.len() as u64;
        let fetch = Fetch::decode(raw, size)?;
        let header = Chunk::raw(DESCRIPTION, size, fetch.offset, fetch.len);
        // `decode` checked `offset + len <= size`.
        let start = usize::try_from(fetch.offset).expect("within the description");
        let mut writer = writer.lock();
        writer.write_all(&header.encode())?;
        writer.write_all(&description[start..start + fetch.len as usize])?;
        return Ok(());
    }
    let Some(store) = published.store() else {
        writer.lock().write_all(&Chunk::raw(0, 0, 0, 0).encode())?;
        return Ok(());
    };
    let size = store.size() as u64;
    let fetch = Fetch::decode(raw, size)?;
    let version = if fetch.version == 0 { store.latest() } else { fetch.version };
    // `decode` checked `offset + len <= size`.
    let offset = usize::try_from(fetch.offset).expect("within the parameters' size");
    let mut bytes = Vec::new();
    let read = {
        let _turn = shared.fetch_turns.take();
        store.read_chunk(version, offset, fetch.len as usize, &mut bytes)
    };
    let header = match read {
        Ok(ChunkBytes::Raw) => Chunk::raw(version, size, fetch.offset, fetch.len),
        Ok(ChunkBytes::Packed(codec)) => Chunk {
            packed: Some((codec, u32::try_from(bytes.len()).expect("below a chunk"))),
            ..Chunk::raw(version, size, fetch.offset, fetch.len)
        },
        Err(gone) => Chunk::raw(gone.latest, size, 0, 0),
    };
    let wire_len = if header.len > 0 { header.wire_len() } else { 0 };
    // Counted before it is written: a worker that has the chunk must find it counted
    // (a write that fails ends the connection, and its chunk counts as served).
    if wire_len > 0 {
        published.note_served(wire_len);
    }
    let mut out = writer.lock();
    out.write_all(&header.encode())?;
    out.write_all(&bytes[..wire_len])?;
    Ok(())
}
