//! The same-host shared-memory channel (Linux): a worker on the learner's machine writes each
//! sample straight into a ring of fixed-size slots in a `memfd` segment, and the learner's
//! connection task copies it once, straight into the backend's ring ([`Samples`] is the
//! segment as a `SampleSource`); while the ring is full the samples wait in the segment and
//! the worker's `send` waits for a free slot. The TCP connection stays open for liveness
//! (heartbeats), the goodbye and errors.
//!
//! ```text
//!  segment (created, sized, sealed and mapped by the learner; mapped by the worker):
//!  0     magic b"ECHOSHM\x01" | version: u32 = 1 | header_len: u32 = 4096
//!  16    slots: u64 | slot_stride: u64 | payload_size: u64
//!  64    tail: u64 (atomic; the worker's)          128  head: u64 (atomic; the learner's)
//!  192   reader_sleeping: u32 (the learner's)      256  writer_sleeping: u32 (the worker's)
//!  4096  slot 0 | slot 1 | ... (each slot_stride bytes, a multiple of 64)
//!  slot: seq: u64 (the sample's number) | flags: u32 (bit 0: priority; bit 1: a step of a
//!        row) | 0: u32 | priority: f64 | row: u32 | end: u8 (0 goes on, 1 terminated,
//!        2 truncated) | 35 reserved bytes | payload (payload_size bytes)
//! ```
//!
//! All integers are little-endian (the machine's: both sides run on it). The index protocol
//! (who stores what with which ordering, and how each side sleeps on its eventfd) is
//! [`ring`]'s. The learner creates the segment with `memfd_create`, reserves its
//! pages (`fallocate`), and seals it against shrinking and growing before the worker sees it,
//! so nothing the worker does can make the learner's accesses fault. It never trusts what it
//! reads back: its own `head` is the only index it keeps, a `tail` out of range ends the
//! channel, and a slot is copied out before its header is checked (a slot torn by its writer
//! only corrupts that worker's own sample).
//!
//! Attaching: the learner listens on a fresh abstract-namespace Unix socket (`echo-shm-` and
//! 32 random hex digits, so nothing is left on any file system), names it and a 16-byte
//! nonce in its TCP reply, and hands the segment and two eventfds (data: worker -> learner;
//! space: learner -> worker) with `SCM_RIGHTS` to the first peer that presents the nonce and
//! runs under the learner's own uid (`SO_PEERCRED`).
//!
//! | module        | holds                                                                  |
//! |---------------|------------------------------------------------------------------------|
//! | [`ring`]      | the ring's index protocol (tail, head, sleep flags), loom-checked; all OSes |
//! | `layout`      | the segment's offsets and flags as constants; sizes for a payload size  |
//! | `segment`     | the mapped `memfd` segment: create, seal, attach, volatile copies       |
//! | `bell`        | [`EventFd`], the bell of one direction                                  |
//! | `reader`      | the learner's side of the ring ([`Reader`], [`Samples`])                |
//! | `writer`      | the worker's side of the ring ([`Writer`])                              |
//! | `attach`      | same-host check, abstract Unix socket, peer uid, `SCM_RIGHTS` handover  |
//! | `server`      | the learner's connection task on the shared-memory path                 |
//! | `worker`      | what the TCP client uses: attaching an offer, the writer, the loss bell |
//! | [`pipe`]      | a byte pipe over a segment: a ragged worker's frames, as over TCP     |
//! | [`seqlock`]   | the sequence lock of a published-parameters slot, loom-checked; all OSes |
//! | `params`      | the published parameters' region: the learner's slots, a worker's view  |
//!
//! Off Linux only [`ring`] exists here, and `server` and `worker` are stand-ins
//! (`unsupported`): the server declines every request and the client never attaches, so
//! samples go over TCP. How the client drives a [`Writer`] (the window of samples in flight,
//! resending after a reconnect) is the client's, in [`crate::transport::client`].
//!
//! One word for a wake-up primitive here: a **bell** (the data bell, worker to learner; the
//! space bell, learner to worker; [`ring::Bell`]; the backend's insert bell it waits on).

#[doc(hidden)]
pub mod ring;
#[doc(hidden)]
pub mod seqlock;

#[cfg(all(target_os = "linux", not(loom)))]
mod attach;
#[cfg(all(target_os = "linux", not(loom)))]
pub(crate) mod bell;
#[cfg(all(target_os = "linux", not(loom)))]
mod layout;
#[cfg(all(target_os = "linux", not(loom)))]
#[doc(hidden)]
pub mod params;
#[cfg(all(target_os = "linux", not(loom)))]
pub mod pipe;
#[cfg(all(target_os = "linux", not(loom)))]
mod reader;
#[cfg(all(target_os = "linux", not(loom)))]
mod segment;
#[cfg(all(target_os = "linux", not(loom)))]
pub(crate) mod server;
#[cfg(all(not(target_os = "linux"), not(loom)))]
mod unsupported;
#[cfg(all(not(target_os = "linux"), not(loom)))]
pub(crate) use unsupported::{server, worker};
#[cfg(all(target_os = "linux", not(loom)))]
pub(crate) mod worker;
#[cfg(all(target_os = "linux", not(loom)))]
mod writer;

#[cfg(all(target_os = "linux", not(loom)))]
pub use attach::{listen, own_uid, peer_uid, random_name, recv_fds, same_host, send_fds};
#[cfg(all(target_os = "linux", not(loom)))]
pub use bell::EventFd;
#[cfg(all(target_os = "linux", not(loom)))]
pub use layout::{
    segment_len, slot_stride, slots_for, ATTACH_MESSAGE, FLAG_PRIORITY, FLAG_STEP, HEADER_LEN,
    MAGIC, MAX_SLOTS, MIN_SLOTS, NAME_PREFIX, NONCE_LEN, OFF_HEAD, OFF_HEADER_LEN, OFF_PAYLOAD,
    OFF_READER_SLEEPING, OFF_SLOTS, OFF_STRIDE, OFF_TAIL, OFF_VERSION, OFF_WRITER_SLEEPING,
    SEGMENT_TARGET, SLOT_HEADER, STOP_AT_ENV, VERSION,
};
#[cfg(all(target_os = "linux", not(loom)))]
pub use reader::{Reader, Samples, SlotMeta};
#[cfg(all(target_os = "linux", not(loom)))]
pub use segment::Segment;
#[cfg(all(target_os = "linux", not(loom)))]
pub use writer::Writer;

/// Why a server started with `TcpTransport(shared_memory=False)` offers no shared memory.
#[cfg(not(loom))]
const SHM_OFF: &str = "the server has shared memory turned off (TcpTransport(shared_memory=False))";

/// How the shared-memory part of a connection ended (off Linux only ever `Declined`).
#[cfg(not(loom))]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) enum ShmEnd {
    /// The client closed the connection (every committed sample was taken).
    Closed,
    /// The client said goodbye (every committed sample was taken).
    Goodbye,
    /// The client could not attach; it sends frames instead.
    Declined,
}
