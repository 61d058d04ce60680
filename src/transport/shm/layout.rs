//! The segment's byte layout, as constants (see the diagram in [`super`]), and the sizes a
//! segment takes for a given payload size.

/// The first bytes of a segment.
pub const MAGIC: &[u8; 8] = b"ECHOSHM\x01";
/// The segment format's version.
pub const VERSION: u32 = 1;
/// Bytes before slot 0.
pub const HEADER_LEN: usize = 4096;
/// Bytes of a slot's header, before its payload.
pub const SLOT_HEADER: usize = 64;
/// Offset of the version (u32).
pub const OFF_VERSION: usize = 8;
/// Offset of the header length (u32).
pub const OFF_HEADER_LEN: usize = 12;
/// Offset of the slot count (u64).
pub const OFF_SLOTS: usize = 16;
/// Offset of the slot stride (u64).
pub const OFF_STRIDE: usize = 24;
/// Offset of the payload size (u64).
pub const OFF_PAYLOAD: usize = 32;
/// Offset of `tail` (atomic u64, the worker's).
pub const OFF_TAIL: usize = 64;
/// Offset of `head` (atomic u64, the learner's).
pub const OFF_HEAD: usize = 128;
/// Offset of `reader_sleeping` (atomic u32, the learner's).
pub const OFF_READER_SLEEPING: usize = 192;
/// Offset of `writer_sleeping` (atomic u32, the worker's).
pub const OFF_WRITER_SLEEPING: usize = 256;
/// Offset of `stored` (atomic u64, the learner's; byte pipes only): samples of the pipe's
/// frames stored, the worker's acknowledgements.
pub const OFF_STORED: usize = 320;
/// Offset of `ack_sleeping` (atomic u32, the worker's; byte pipes only): non-zero while the
/// worker sleeps (or is about to) until `stored` reaches `ack_target`.
pub const OFF_ACK_SLEEPING: usize = 384;
/// Offset of `ack_target` (atomic u64, the worker's; byte pipes only).
pub const OFF_ACK_TARGET: usize = 448;
/// Slot flag: the slot's priority field is set.
pub const FLAG_PRIORITY: u32 = 1;
/// Slot flag: the sample is a step of a row (its row and episode flag are set), for a
/// sequence table.
pub const FLAG_STEP: u32 = 2;
/// What a segment aims to hold: as many slots as fit (between [`MIN_SLOTS`] and
/// [`MAX_SLOTS`]).
pub const SEGMENT_TARGET: usize = 8 << 20;
/// The fewest slots of a segment.
pub const MIN_SLOTS: usize = 2;
/// The most slots of a segment.
pub const MAX_SLOTS: usize = 1024;
/// The bytes the learner sends with the descriptors.
pub const ATTACH_MESSAGE: &[u8; 8] = b"ECHOSHM\x01";
/// Length of the nonce a worker presents on the Unix socket.
pub const NONCE_LEN: usize = 16;
/// The prefix of every channel's abstract socket name.
pub const NAME_PREFIX: &str = "echo-shm-";
/// Environment variable (tests only): `N:PID` makes the worker process `PID` stop itself
/// (`SIGSTOP`) after writing half of sample number N into its slot, before committing it, so
/// a test can kill it there. Naming the process keeps the hook inert everywhere else (an
/// inherited or stray setting never matches another process).
pub const STOP_AT_ENV: &str = "ECHO_SHM_TEST_STOP_AT";

/// Bytes of one slot for samples of `payload_size` bytes: header and payload, rounded up to
/// 64 bytes; `None` on overflow.
pub fn slot_stride(payload_size: usize) -> Option<usize> {
    SLOT_HEADER.checked_add(payload_size)?.checked_next_multiple_of(64)
}

/// Slots of a segment for samples of `payload_size` bytes (see [`SEGMENT_TARGET`]).
pub fn slots_for(payload_size: usize) -> Option<usize> {
    let stride = slot_stride(payload_size)?;
    Some((SEGMENT_TARGET / stride).clamp(MIN_SLOTS, MAX_SLOTS))
}

/// Bytes of a [`Reader::new`](super::Reader::new) segment for samples of `payload_size`
/// bytes; `None` on overflow.
pub fn segment_len(payload_size: usize) -> Option<usize> {
    slot_stride(payload_size)?.checked_mul(slots_for(payload_size)?)?.checked_add(HEADER_LEN)
}
