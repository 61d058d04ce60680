//! The learner's side of one channel ([`Reader`]): its own `head`, the data bell it waits on,
//! the space bell it rings; slot headers copied out before they are checked; and
//! [`Samples`], the committed samples as a `SampleSource` a backend copies straight out of the
//! segment.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use super::bell::EventFd;
use super::layout::{slot_stride, slots_for, FLAG_PRIORITY, FLAG_STEP, HEADER_LEN, SLOT_HEADER};
use super::ring::{Corrupt, Indices};
use super::segment::Segment;
use crate::source::{EpisodeEnd, StepTag};
use crate::transport::wire::v2::FrameMeta;

/// What a slot's header says, once copied out and checked: what a sample frame says.
pub type SlotMeta = FrameMeta;

/// The learner's side of one channel: the segment, its own `head`, the data bell it waits on
/// and the space bell it rings.
pub struct Reader {
    segment: Segment,
    slots: usize,
    stride: usize,
    payload_size: usize,
    head: u64,
    /// Rung by the worker after a commit while we sleep.
    pub data: EventFd,
    /// Rung by us after we take samples while the worker waits.
    space: EventFd,
}

impl Reader {
    /// A new channel for samples of `payload_size` bytes.
    ///
    /// # Errors
    /// As [`Segment::create`] and [`EventFd::new`].
    pub fn new(payload_size: usize) -> io::Result<Self> {
        let slots = slots_for(payload_size)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "sample too large"))?;
        Self::with_slots(payload_size, slots)
    }

    /// A new channel of exactly `slots` slots (at least 1), for tests.
    ///
    /// # Errors
    /// As [`Reader::new`].
    #[doc(hidden)]
    pub fn with_slots(payload_size: usize, slots: usize) -> io::Result<Self> {
        let slots = slots.max(1);
        let segment = Segment::create(slots, payload_size)?;
        let stride = slot_stride(payload_size).expect("checked by Segment::create");
        Ok(Self {
            segment,
            slots,
            stride,
            payload_size,
            head: 0,
            data: EventFd::new()?,
            space: EventFd::new()?,
        })
    }

    /// The descriptors a worker needs, in order: segment, data bell, space bell.
    pub fn fds(&self) -> [RawFd; 3] {
        [self.segment.fd().as_raw_fd(), self.data.as_raw_fd(), self.space.as_raw_fd()]
    }

    /// Slots in the ring.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Samples taken so far.
    pub fn head(&self) -> u64 {
        self.head
    }

    fn indices(&self) -> Indices<'_> {
        self.segment.indices(self.slots)
    }

    /// Committed samples not yet taken.
    ///
    /// # Errors
    /// [`Corrupt`] if the worker wrote an impossible tail.
    pub fn available(&self) -> Result<u64, Corrupt> {
        Ok(self.indices().committed(self.head)? - self.head)
    }

    /// Copies the next committed sample (the caller checked [`Reader::available`]) into
    /// `out` (`payload_size` bytes), then checks the slot's header as copied.
    ///
    /// # Errors
    /// What is wrong with the slot (the worker broke the protocol).
    pub fn copy_next(&self, out: &mut [u8]) -> Result<SlotMeta, String> {
        if out.len() != self.payload_size {
            return Err(format!("buffer of {} bytes for {}", out.len(), self.payload_size));
        }
        // The header first, then the payload: both are copies, checked only as copied.
        let meta = self.check(self.head)?;
        self.copy_payload(self.head, 0, out);
        Ok(meta)
    }

    /// Hands the slot of the sample copied by [`Reader::copy_next`] back to the worker.
    pub fn advance(&mut self) {
        self.advance_by(1);
    }

    /// Hands the slots of the next `n` samples back to the worker (they were checked with
    /// [`Reader::check`] and copied with [`Samples`]).
    pub fn advance_by(&mut self, n: u64) {
        if n > 0 {
            self.head += n;
            self.segment.indices(self.slots).release(self.head, &self.space);
        }
    }

    /// Copies the header of committed sample `seq` (the caller checked it is committed and
    /// not yet taken) out of its slot and checks it.
    ///
    /// # Errors
    /// What is wrong with the slot (the worker broke the protocol).
    pub fn check(&self, seq: u64) -> Result<SlotMeta, String> {
        let mut header = [0u8; SLOT_HEADER];
        self.segment.get(self.slot_offset(seq), &mut header);
        // Checked on our copy only: the worker cannot change it under us.
        let got = u64::from_le_bytes(header[0..8].try_into().expect("8 bytes"));
        let flags = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        let priority = f64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        if got != seq {
            return Err(format!("slot of sample {seq} holds sample {got}"));
        }
        if flags & !(FLAG_PRIORITY | FLAG_STEP) != 0 {
            return Err(format!("sample {seq}: unknown slot flags {flags:#x}"));
        }
        let mut meta = SlotMeta {
            priority: (flags & FLAG_PRIORITY != 0).then_some(priority),
            ..SlotMeta::default()
        };
        if flags & FLAG_STEP != 0 {
            meta.row = u32::from_le_bytes(header[24..28].try_into().expect("4 bytes"));
            meta.end = EpisodeEnd::from_code(header[28]).ok_or_else(|| {
                format!("sample {seq}: episode flag {} is not 0, 1 or 2", header[28])
            })?;
        }
        Ok(meta)
    }

    /// The segment offset of the slot holding sample `seq`: computed from our own geometry
    /// only, so always inside the segment (`Segment::get` checks again regardless).
    fn slot_offset(&self, seq: u64) -> usize {
        let index = usize::try_from(seq % self.slots as u64).expect("< slots");
        HEADER_LEN + index * self.stride
    }

    /// Copies `dst.len()` payload bytes of sample `seq`, from byte `offset` of its payload,
    /// into `dst` (one raw copy out of the segment). Nothing is copied if the range is not
    /// inside the payload (a caller's bug; `dst` keeps its bytes).
    pub fn copy_payload(&self, seq: u64, offset: usize, dst: &mut [u8]) {
        if offset.checked_add(dst.len()).is_some_and(|end| end <= self.payload_size) {
            self.segment.get(self.slot_offset(seq) + SLOT_HEADER + offset, dst);
        }
    }

    /// Announces that we are about to sleep on `data` (see [`Indices::sleep_begin`]); look
    /// again with [`Reader::available`] before sleeping, and call [`Reader::sleep_end`] after.
    pub fn sleep_begin(&self) {
        Indices::sleep_begin(self.indices().reader_sleeping);
    }

    /// Lowers our sleeping flag.
    pub fn sleep_end(&self) {
        Indices::sleep_end(self.indices().reader_sleeping);
    }

    /// Writes `bytes` into the raw segment at `offset` (clamped to the segment): what a
    /// hostile worker can do, for tests and the fuzz target.
    #[doc(hidden)]
    pub fn scribble(&self, offset: usize, bytes: &[u8]) {
        let offset = offset.min(self.segment.len);
        let n = bytes.len().min(self.segment.len - offset);
        self.segment.put(offset, &bytes[..n]);
    }
}

/// Committed samples of a [`Reader`] as a [`SampleSource`]: a backend copies each leaf
/// straight out of the segment into its ring ([`SampleSource::copy_leaf`], one raw copy per
/// leaf), so the learner copies each sample once. The slot headers were checked (copied out)
/// before; the payload bytes are the worker's and taken as they are.
///
/// [`SampleSource`]: crate::source::SampleSource
/// [`SampleSource::copy_leaf`]: crate::source::SampleSource::copy_leaf
pub struct Samples<'a> {
    reader: &'a Reader,
    /// Sequence number of the first sample.
    first: u64,
    /// Each sample's checked header.
    metas: &'a [SlotMeta],
    /// Each leaf's byte offset and length in the payload.
    leaves: &'a [(usize, usize)],
    /// [`SampleSource::leaf`](crate::source::SampleSource::leaf)'s private copies, made only if
    /// something asks for references.
    copies: std::cell::OnceCell<Vec<Box<[u8]>>>,
    /// The backend stream of row 0 of the worker's connection (see [`Samples::with_streams`]).
    stream_base: u64,
}

impl<'a> Samples<'a> {
    /// Samples `first..first + metas.len()` of `reader`, whose payloads are split into
    /// `leaves` (offset, length).
    pub fn new(
        reader: &'a Reader,
        first: u64,
        metas: &'a [SlotMeta],
        leaves: &'a [(usize, usize)],
    ) -> Self {
        Self { reader, first, metas, leaves, copies: std::cell::OnceCell::new(), stream_base: 0 }
    }

    /// The same samples as steps of the streams `stream_base | row` (a sequence table's
    /// streams of the worker's connection).
    #[must_use]
    pub fn with_streams(self, stream_base: u64) -> Self {
        Self { stream_base, ..self }
    }
}

impl crate::source::SampleSource for Samples<'_> {
    fn num_samples(&self) -> usize {
        self.metas.len()
    }
    fn num_leaves(&self, _sample: usize) -> usize {
        self.leaves.len()
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        // Never a reference into the segment: a private copy of every payload.
        let copies = self.copies.get_or_init(|| {
            (0..self.metas.len())
                .map(|i| {
                    let mut payload = vec![0u8; self.reader.payload_size].into_boxed_slice();
                    self.reader.copy_payload(self.first + i as u64, 0, &mut payload);
                    payload
                })
                .collect()
        });
        let (offset, len) = self.leaves[leaf];
        &copies[sample][offset..offset + len]
    }
    fn leaf_len(&self, _sample: usize, leaf: usize) -> usize {
        self.leaves[leaf].1
    }
    fn copy_leaf(&self, sample: usize, leaf: usize, dst: &mut [u8]) {
        self.reader.copy_payload(self.first + sample as u64, self.leaves[leaf].0, dst);
    }
    fn priority(&self, sample: usize) -> Option<f64> {
        self.metas[sample].priority
    }
    fn step(&self, sample: usize) -> StepTag {
        let meta = &self.metas[sample];
        StepTag { stream: self.stream_base | u64::from(meta.row), end: meta.end }
    }
}
