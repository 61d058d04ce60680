//! The worker's side of one channel ([`Writer`]): attaching the segment it was handed, writing
//! a sample whole into a free slot and committing it, and waiting on the space bell for the
//! learner to take samples.

use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::time::{Duration, Instant};

use super::attach::recv_fds;
use super::bell::EventFd;
use super::layout::{
    ATTACH_MESSAGE, FLAG_PRIORITY, FLAG_STEP, HEADER_LEN, NONCE_LEN, SLOT_HEADER, STOP_AT_ENV,
};
use super::params::ParamView;
use super::reader::SlotMeta;
use super::ring::Indices;
use super::segment::Segment;

/// The sample number [`STOP_AT_ENV`] names for this process, if it names this process.
fn stop_at_from_env() -> Option<u64> {
    let value = std::env::var(STOP_AT_ENV).ok()?;
    let (sample, pid) = value.split_once(':')?;
    (pid.parse::<u32>().ok()? == std::process::id()).then(|| sample.parse().ok()).flatten()
}

/// Connects to the learner's socket `name` (abstract namespace), presents `nonce` and
/// receives its answer: the bytes of its message, the message, and the descriptors.
///
/// # Errors
/// A message saying what failed.
pub(super) fn request(
    name: &[u8],
    nonce: &[u8; NONCE_LEN],
    timeout: Duration,
) -> Result<(usize, [u8; 8], Vec<std::os::fd::OwnedFd>), String> {
    let addr = UnixAddr::from_abstract_name(name)
        .map_err(|e| format!("bad socket name from the learner: {e}"))?;
    let mut stream = UnixStream::connect_addr(&addr).map_err(|e| {
        format!(
            "cannot reach the learner's shared-memory socket (another network namespace, e.g. \
             a container?): {e}"
        )
    })?;
    let timeout = timeout.max(Duration::from_millis(1));
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.write_all(nonce).map_err(|e| format!("cannot send the nonce: {e}"))?;
    let mut message = [0u8; 8];
    let (n, fds) = recv_fds(stream.as_raw_fd(), &mut message).map_err(|e| {
        format!("the learner sent no segment (another user, or the nonce was refused): {e}")
    })?;
    Ok((n, message, fds))
}

/// The error of an answer without a segment.
pub(super) fn refused(n: usize) -> String {
    format!(
        "the learner refused to attach this process (it runs under another user, or the nonce \
         did not match): got {n} bytes and no segment"
    )
}

/// The worker's side of one channel.
pub struct Writer {
    segment: Segment,
    slots: usize,
    stride: usize,
    payload_size: usize,
    /// Samples committed.
    tail: u64,
    /// Rung by us after a commit while the learner sleeps.
    data: EventFd,
    /// Rung by the learner when it takes samples while we wait.
    space: EventFd,
    /// Tests only: stop (SIGSTOP) half-way through writing this sample.
    stop_at: Option<u64>,
    /// The learner's published parameters, when it handed their region over.
    params: Option<ParamView>,
}

impl Writer {
    /// Connects to the learner's socket `name` (abstract namespace), presents `nonce`,
    /// receives the segment and bells, and checks the segment for samples of `payload_size`
    /// bytes; all within `timeout`.
    ///
    /// # Errors
    /// A message saying what failed.
    pub fn attach(
        name: &[u8],
        nonce: &[u8; NONCE_LEN],
        payload_size: usize,
        timeout: Duration,
    ) -> Result<Self, String> {
        let (n, message, fds) = request(name, nonce, timeout)?;
        let mut fds = fds.into_iter();
        // A fourth descriptor: the published parameters' region (a learner that serves them).
        let (Some(memfd), Some(data), Some(space), params, None) =
            (fds.next(), fds.next(), fds.next(), fds.next(), fds.next())
        else {
            return Err(refused(n));
        };
        if n != message.len() || &message != ATTACH_MESSAGE {
            return Err(format!("unexpected attach message {:?}", &message[..n]));
        }
        let (segment, slots, stride) = Segment::attach(memfd, payload_size)?;
        let stop_at = stop_at_from_env();
        let writer = Self {
            tail: 0,
            segment,
            slots,
            stride,
            payload_size,
            data: EventFd(data),
            space: EventFd(space),
            stop_at,
            params: params.map(ParamView::new),
        };
        // ORDERING: see `Indices::committed`; a learner's segment starts with tail 0.
        let tail = writer.indices().tail.load(std::sync::atomic::Ordering::Acquire);
        if tail != 0 {
            return Err(format!("a fresh segment starts at sample {tail}"));
        }
        Ok(writer)
    }

    fn indices(&self) -> Indices<'_> {
        self.segment.indices(self.slots)
    }

    /// Slots in the ring.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The learner's published parameters in shared memory, if it handed them over.
    pub fn params(&mut self) -> Option<&mut ParamView> {
        self.params.as_mut()
    }

    /// Samples committed.
    pub fn committed(&self) -> u64 {
        self.tail
    }

    /// Samples the learner has taken (in its ring; their slots are free again).
    pub fn taken(&self) -> u64 {
        self.indices().taken()
    }

    /// A descriptor of the space bell, for a thread that wakes waiters when the connection
    /// is lost.
    ///
    /// # Errors
    /// The system call's.
    pub fn space_bell(&self) -> io::Result<EventFd> {
        self.space.try_clone()
    }

    /// Writes one sample (its leaves, which the caller checked add up to the payload size)
    /// and commits it, if a slot is free. `false`: the ring is full.
    pub fn try_send(&mut self, leaves: &[&[u8]], meta: &SlotMeta) -> bool {
        let indices = self.segment.indices(self.slots);
        if !indices.has_room(self.tail) {
            return false;
        }
        let index = usize::try_from(self.tail % self.slots as u64).expect("< slots");
        let offset = HEADER_LEN + index * self.stride;
        let mut header = [0u8; SLOT_HEADER];
        header[0..8].copy_from_slice(&self.tail.to_le_bytes());
        let mut flags = if meta.priority.is_some() { FLAG_PRIORITY } else { 0 };
        if meta.is_step() {
            flags |= FLAG_STEP;
            header[24..28].copy_from_slice(&meta.row.to_le_bytes());
            header[28] = meta.end.code();
        }
        header[8..12].copy_from_slice(&flags.to_le_bytes());
        header[16..24].copy_from_slice(&meta.priority.unwrap_or(0.0).to_le_bytes());
        self.segment.put(offset, &header);
        let mut at = offset + SLOT_HEADER;
        let end = at + self.payload_size;
        for leaf in leaves {
            let n = leaf.len().min(end - at);
            if self.stop_at == Some(self.tail) {
                self.segment.put(at, &leaf[..n / 2]);
                // SAFETY: raising a signal on ourselves; SIGSTOP cannot be caught.
                unsafe { libc::raise(libc::SIGSTOP) };
            }
            self.segment.put(at, &leaf[..n]);
            at += n;
        }
        self.tail += 1;
        indices.commit(self.tail, &self.data);
        true
    }

    /// Waits until the learner has taken at least `target` samples, `until` at the latest
    /// (callers pass short slices, so they notice a lost connection). Whether it has.
    pub fn wait_taken(&self, target: u64, until: Instant) -> bool {
        let indices = self.indices();
        loop {
            if indices.taken() >= target {
                return true;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            Indices::sleep_begin(indices.writer_sleeping);
            if indices.taken() < target {
                self.space.wait(left);
            }
            Indices::sleep_end(indices.writer_sleeping);
        }
    }
}
