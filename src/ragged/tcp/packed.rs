//! Compressed group frames over TCP: the codecs a connection agrees on, and a compressed
//! frame read, checked (each leaf decompressed into exactly its size) and stored, its
//! compressed leaves kept as they came where the table stores them compressed.

use std::io::Read;
use std::ops::Range;
use std::sync::atomic::Ordering;

use super::{read_body, split_body, store, Owned, Shared};
use crate::codec::Codec;
use crate::error::EchoError;
use crate::ragged::table::{GroupSource, SampleIn};
use crate::ragged::wire::{unpack_body, Head};
use crate::transport::wire::v2::Hello;

/// The codecs a connection agrees on (one per leaf of the table; empty: none): the table's
/// own (its `compress=`), to a worker that can compress and is not offered shared memory
/// (which copies raw). A worker on another host asks for shared memory too, is not offered
/// it, and so compresses.
pub(super) fn wire_codecs(shared: &Shared, hello: &Hello, offered_shm: bool) -> Vec<Option<Codec>> {
    let codecs = &shared.table.config().codecs;
    if hello.codecs && !offered_shm && codecs.iter().any(Option::is_some) {
        codecs.clone()
    } else {
        Vec::new()
    }
}

/// A compressed frame's samples: each leaf raw (decompressed), and each compressed leaf's
/// bytes as they came, which the table keeps instead of compressing the leaf again.
struct Unpacked<'a> {
    samples: &'a [SampleIn<'a>],
    body: &'a [u8],
    /// Where each compressed leaf lies in `body`, sample-major over every leaf.
    packed: &'a [Option<Range<usize>>],
    columns: usize,
}

impl GroupSource for Unpacked<'_> {
    fn samples(&self) -> usize {
        self.samples.len()
    }
    fn rows(&self, s: usize) -> &[usize] {
        self.samples.rows(s)
    }
    fn leaves(&self, s: usize) -> usize {
        self.samples.leaves(s)
    }
    fn leaf_len(&self, s: usize, c: usize) -> usize {
        self.samples.leaf_len(s, c)
    }
    fn leaf(&self, s: usize, c: usize) -> Option<&[u8]> {
        self.samples.leaf(s, c)
    }
    fn copy_leaf(&self, s: usize, c: usize, dst: &mut [u8]) {
        self.samples.copy_leaf(s, c, dst);
    }
    fn packed(&self, s: usize, c: usize) -> Option<&[u8]> {
        let range = self.packed.get(s * self.columns + c)?.clone()?;
        self.body.get(range)
    }
}

/// Reads the body of the compressed `frame` from `reader`, checks it (each compressed leaf
/// decompressed into exactly its raw size, into `raw`) and stores it. `body` and `raw` are
/// the connection's buffers. `Ok(false)`: the connection ends quietly (as `store`).
///
/// # Errors
/// [`EchoError::Protocol`] naming the leaf whose bytes are not its codec's data for its size
/// (nothing of the frame is stored); a read's error; the table's.
pub(super) fn store_packed(
    shared: &Shared,
    owned: &Owned,
    reader: &mut impl Read,
    frame: &Head,
    codecs: &[Option<Codec>],
    body: &mut Vec<u8>,
    raw: &mut Vec<u8>,
) -> Result<bool, EchoError> {
    let spec = shared.table.spec();
    let columns = spec.columns();
    // Checked by `decode_head`: each leaf within its max_len, so no product overflows.
    let raw_len: usize = frame
        .rows
        .chunks(columns.len())
        .flat_map(|rows| columns.iter().zip(rows).map(|(c, &n)| c.row_bytes() * n))
        .sum();
    // The compressed body and its raw bytes come out of the ingress's budget together.
    let Some(_hold) = shared.budget.acquire(frame.body_len + raw_len, &shared.closing) else {
        return Ok(false);
    };
    let Some(body) = read_body(reader, body, frame.body_len)? else { return Ok(false) };
    let packed = unpack_body(spec, codecs, frame, body, raw)?;
    let samples = split_body(columns, frame, raw);
    let source = Unpacked { samples: &samples, body, packed: &packed, columns: columns.len() };
    if !store(shared, owned, &source, frame.priority)? {
        return Ok(false);
    }
    // ORDERING: Relaxed — statistics counters.
    shared.counters.compressed_samples.fetch_add(frame.samples as u64, Ordering::Relaxed);
    shared.counters.compressed_bytes.fetch_add(frame.body_len as u64, Ordering::Relaxed);
    Ok(true)
}
