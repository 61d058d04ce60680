//! A byte pipe over a shared-memory segment: what a ragged server's same-host worker writes
//! its frames into instead of its TCP socket. The frames are the very bytes it would send
//! over TCP (a ragged sample's size varies, so a ring of fixed slots does not fit it), and
//! the learner reads them with the same parser, which checks every length before it
//! allocates: what arrives through the pipe is as untrusted as what arrives over TCP.
//!
//! ```text
//!  segment: the ring's header (see `super`) with slots = 1 and payload_size = the pipe's
//!           capacity; slot 0's payload is the pipe: byte `i` of the stream lies at
//!           payload offset i % capacity.
//!  tail, head: bytes committed by the worker, bytes taken by the learner ([`Indices`] with
//!           the byte as its unit: `committed` checks 0 <= tail - head <= capacity).
//! ```
//!
//! The worker writes a frame's bytes as far as there is room and commits at the end of the
//! frame, or earlier when the pipe is full (a frame larger than the pipe streams through
//! it). A deadline is only ever checked before a frame starts, so the stream never holds
//! half a frame the worker gave up on; a worker that dies half-way leaves half a frame that
//! the learner, at the end of the stream, drops, as it drops half a frame cut off over TCP.
//!
//! The learner's reads sleep on the data bell and on the TCP socket at once: the worker
//! sends nothing over TCP once attached, so the socket turns readable only when the worker
//! is gone (end of stream) or the server shut it down; the pipe is then read to its
//! committed end, and the read after returns 0.

use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::attach::{listen, own_uid, peer_uid, random_name, send_fds};
use super::bell::EventFd;
use super::layout::{ATTACH_MESSAGE, HEADER_LEN, NONCE_LEN, SLOT_HEADER};
use super::ring::{spans, Indices};
use super::segment::Segment;
use super::writer::{refused, request};

/// A pipe's capacity: room for several frames of large rollouts, so a worker rarely waits
/// for the learner to read.
pub const PIPE_CAPACITY: usize = 4 << 20;
/// Segment bytes of a pipe of [`PIPE_CAPACITY`].
pub const PIPE_SEGMENT_LEN: usize = HEADER_LEN + SLOT_HEADER + PIPE_CAPACITY;
/// How long one wait on a bell lasts before the waiter looks again anyway.
const WAIT_SLICE: Duration = Duration::from_millis(200);

/// Where the pipe's bytes start in the segment.
pub const DATA: usize = HEADER_LEN + SLOT_HEADER;

/// The learner's side of a pipe: reads the worker's bytes in order.
pub struct PipeReader {
    segment: Segment,
    capacity: usize,
    head: u64,
    data: EventFd,
    space: EventFd,
    /// The worker's TCP socket (a duplicate), watched for its end while the pipe is empty.
    watch: Option<std::os::fd::OwnedFd>,
    /// The worker's TCP socket ended: what is committed is the last of the stream.
    lost: bool,
}

impl PipeReader {
    /// A new pipe of `capacity` bytes (at least 1).
    ///
    /// # Errors
    /// As [`Segment::create`] and [`EventFd::new`].
    pub fn new(capacity: usize) -> io::Result<Self> {
        let capacity = capacity.max(1);
        Ok(Self {
            segment: Segment::create(1, capacity)?,
            capacity,
            head: 0,
            data: EventFd::new()?,
            space: EventFd::new()?,
            watch: None,
            lost: false,
        })
    }

    /// The descriptors a worker needs, in order: segment, data bell, space bell.
    pub fn fds(&self) -> [RawFd; 3] {
        [self.segment.fd().as_raw_fd(), self.data.as_raw_fd(), self.space.as_raw_fd()]
    }

    /// Watches `socket` (the worker's TCP connection) while the pipe is empty: its end ends
    /// the stream once every committed byte is read.
    ///
    /// # Errors
    /// The descriptor's duplication.
    pub fn watch(&mut self, socket: BorrowedFd<'_>) -> io::Result<()> {
        self.watch = Some(socket.try_clone_to_owned()?);
        Ok(())
    }

    /// Bytes read so far.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Acknowledges the first `stored` samples of the pipe's frames (a count that only
    /// grows): the worker reads it instead of acknowledgements over TCP, and is woken if it
    /// waits for it.
    pub fn acknowledge(&self, stored: u64) {
        let (indices, target) = self.segment.acks();
        indices.release_to(stored, target, &self.space);
    }

    fn indices(&self) -> Indices<'_> {
        self.segment.indices(self.capacity)
    }

    /// Committed bytes not read yet.
    fn available(&self) -> io::Result<u64> {
        let tail = self
            .indices()
            .committed(self.head)
            .map_err(|corrupt| io::Error::new(io::ErrorKind::InvalidData, corrupt.to_string()))?;
        Ok(tail - self.head)
    }

    /// Whether the watched socket has ended (or sent bytes it must not: an error).
    fn socket_ended(socket: RawFd) -> io::Result<bool> {
        let mut byte = [0u8; 1];
        // SAFETY: reads at most 1 byte into our 1-byte buffer, without consuming it.
        let n = unsafe {
            libc::recv(socket, byte.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        match n {
            0 => Ok(true),
            1.. => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the worker sent a byte ({:#04x}) over TCP after attaching its shared memory",
                    byte[0]
                ),
            )),
            _ => {
                let err = io::Error::last_os_error();
                match err.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(false),
                    // Reset, or anything else: the worker is gone.
                    _ => Ok(true),
                }
            }
        }
    }

    /// Waits (one slice at most) for the data bell or the socket. Call with the sleeping
    /// flag raised and the pipe found empty after raising it.
    fn wait(&mut self) -> io::Result<()> {
        let mut polls = [
            libc::pollfd { fd: self.data.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd {
                fd: self.watch.as_ref().map_or(-1, AsRawFd::as_raw_fd),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            },
        ];
        let ms = libc::c_int::try_from(WAIT_SLICE.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: two valid pollfds (a negative fd is ignored by poll).
        let ready = unsafe { libc::poll(polls.as_mut_ptr(), 2, ms) };
        if ready <= 0 {
            return Ok(());
        }
        if polls[0].revents != 0 {
            self.data.drain();
        }
        if polls[1].revents != 0 && Self::socket_ended(polls[1].fd)? {
            self.lost = true;
        }
        Ok(())
    }

    /// Copies `len` bytes from stream position `pos` into `out`.
    fn copy_out(&self, pos: u64, out: &mut [u8]) {
        let mut at = 0;
        for (start, len) in spans(pos, out.len(), self.capacity) {
            if len > 0 {
                self.segment.get(DATA + start, &mut out[at..at + len]);
                at += len;
            }
        }
    }

    /// Writes `bytes` into the raw segment at `offset` (clamped to the segment): what a
    /// hostile worker can do, for tests.
    #[doc(hidden)]
    pub fn scribble(&self, offset: usize, bytes: &[u8]) {
        let offset = offset.min(self.segment.len);
        let n = bytes.len().min(self.segment.len - offset);
        self.segment.put(offset, &bytes[..n]);
    }
}

impl PipeReader {
    /// Committed bytes not read yet (without waiting).
    ///
    /// # Errors
    /// `InvalidData` if the worker wrote an impossible tail.
    pub fn ready(&self) -> io::Result<u64> {
        self.available()
    }

    /// Copies `out.len()` bytes from `offset` bytes past what was read, without reading
    /// them; they must be committed (`offset + out.len() <= ready()`), so the worker does
    /// not write them (a hostile one that does only makes the copied bytes arbitrary).
    pub fn copy_ahead(&self, offset: u64, out: &mut [u8]) {
        self.copy_out(self.head + offset, out);
    }

    /// Reads past the next `n` committed bytes (copied with [`PipeReader::copy_ahead`]),
    /// giving their room back to the worker.
    pub fn skip(&mut self, n: u64) {
        self.head += n;
        self.indices().release(self.head, &self.space);
    }

    /// Raises the reader's sleeping flag before a last look at [`PipeReader::ready`]: a
    /// worker that commits after it rings the data bell ([`PipeReader::data_fd`]). For a
    /// caller that waits on many pipes at once; end with [`PipeReader::sleep_end`].
    pub fn sleep_begin(&self) {
        Indices::sleep_begin(self.indices().reader_sleeping);
    }

    /// Ends a [`PipeReader::sleep_begin`], and takes the data bell's rings.
    pub fn sleep_end(&self) {
        Indices::sleep_end(self.indices().reader_sleeping);
        self.data.drain();
    }

    /// The data bell: readable once the worker committed bytes after
    /// [`PipeReader::sleep_begin`].
    pub fn data_fd(&self) -> RawFd {
        self.data.as_raw_fd()
    }

    /// The watched socket ([`PipeReader::watch`]), if any: readable or hung up once the
    /// worker is gone (or sent a byte it must not).
    pub fn watch_fd(&self) -> Option<RawFd> {
        self.watch.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Reads what the worker committed, without waiting: 0 when nothing is.
    ///
    /// # Errors
    /// `InvalidData` if the worker wrote an impossible tail.
    pub fn try_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let available = self.available()?;
        let n = buf.len().min(usize::try_from(available).unwrap_or(usize::MAX));
        if n > 0 {
            self.copy_out(self.head, &mut buf[..n]);
            self.head += n as u64;
            self.indices().release(self.head, &self.space);
        }
        Ok(n)
    }
}

impl Read for PipeReader {
    /// Reads what the worker committed (at least one byte, waiting for it), or 0 once its
    /// socket has ended and every committed byte was read.
    ///
    /// # Errors
    /// `InvalidData` if the worker wrote an impossible tail or sent bytes over TCP.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let n = self.try_read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            if self.lost {
                return Ok(0);
            }
            let indices = self.indices();
            Indices::sleep_begin(indices.reader_sleeping);
            let result = if self.available()? == 0 { self.wait() } else { Ok(()) };
            Indices::sleep_end(self.indices().reader_sleeping);
            result?;
        }
    }
}

/// Why a [`PipeWriter`] stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum PipeStop {
    /// The deadline passed before the frame started: nothing of it was written.
    TimedOut,
    /// The connection is gone (the caller's `lost` said so).
    Lost,
}

/// The worker's side of a pipe.
pub struct PipeWriter {
    segment: Arc<Segment>,
    capacity: usize,
    /// Bytes written (committed or not).
    written: u64,
    data: EventFd,
    space: EventFd,
}

/// A worker's view of its pipe's acknowledgements (the samples the learner stored), apart
/// from the [`PipeWriter`] so that reading them does not wait for a write.
pub struct PipeAcks {
    segment: Arc<Segment>,
    space: EventFd,
}

impl PipeAcks {
    /// Samples the learner has stored.
    pub fn stored(&self) -> u64 {
        self.segment.acks().0.taken()
    }

    /// Waits until the learner has stored `target` samples, `deadline` at the latest
    /// (`None`: no limit) or until `lost()`.
    ///
    /// # Errors
    /// [`PipeStop::TimedOut`] or [`PipeStop::Lost`].
    pub fn wait_stored(
        &self,
        target: u64,
        deadline: Option<Instant>,
        lost: &dyn Fn() -> bool,
    ) -> Result<(), PipeStop> {
        let (indices, word) = self.segment.acks();
        let ready = || indices.taken() >= target;
        wait_until(&indices, Some((word, target)), &self.space, &ready, deadline, lost)
    }
}

/// Waits until `ready()`, `deadline` at the latest or until `lost()`, sleeping on the space
/// bell with the worker's flag of `indices` up (the learner rings it when it reads bytes,
/// or stores the samples `target` names, while the flag is up: it publishes, fences, then
/// looks at the flag, as [`Indices::release`] does). Two threads of a worker waiting at
/// once may take each other's ring: each waits a slice at most before it looks again.
fn wait_until(
    indices: &Indices<'_>,
    target: Option<(&AtomicU64, u64)>,
    space: &EventFd,
    ready: &dyn Fn() -> bool,
    deadline: Option<Instant>,
    lost: &dyn Fn() -> bool,
) -> Result<(), PipeStop> {
    loop {
        if ready() {
            return Ok(());
        }
        if lost() {
            return Err(PipeStop::Lost);
        }
        let mut slice = WAIT_SLICE;
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(PipeStop::TimedOut);
            }
            slice = slice.min(left);
        }
        match target {
            Some((word, want)) => Indices::sleep_for(indices.writer_sleeping, word, want),
            None => Indices::sleep_begin(indices.writer_sleeping),
        }
        if !ready() {
            space.wait(slice);
        }
        Indices::sleep_end(indices.writer_sleeping);
    }
}

impl PipeWriter {
    /// Takes over a pipe's descriptors (segment, data bell, space bell, as
    /// [`PipeReader::fds`] orders them) and checks the segment.
    ///
    /// # Errors
    /// What is wrong with the segment.
    pub fn new(
        segment: std::os::fd::OwnedFd,
        data: std::os::fd::OwnedFd,
        space: std::os::fd::OwnedFd,
    ) -> Result<Self, String> {
        let (segment, capacity) = Segment::attach_pipe(segment)?;
        let segment = Arc::new(segment);
        let writer =
            Self { segment, capacity, written: 0, data: EventFd(data), space: EventFd(space) };
        // ORDERING: see `Indices::committed`; a learner's pipe starts empty.
        let tail = writer.indices().tail.load(std::sync::atomic::Ordering::Acquire);
        if tail != 0 {
            return Err(format!("a fresh pipe starts at byte {tail}"));
        }
        Ok(writer)
    }

    fn indices(&self) -> Indices<'_> {
        self.segment.indices(self.capacity)
    }

    /// The pipe's capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// A second descriptor of the space bell: ringing it wakes a writer waiting for room
    /// (to see that the connection is lost).
    ///
    /// # Errors
    /// The system call's.
    pub fn space_bell(&self) -> io::Result<EventFd> {
        self.space.try_clone()
    }

    /// The pipe's acknowledgements, readable while a frame is being written.
    ///
    /// # Errors
    /// The space bell's duplication.
    pub fn acks(&self) -> io::Result<PipeAcks> {
        Ok(PipeAcks { segment: Arc::clone(&self.segment), space: self.space.try_clone()? })
    }

    /// Waits until `want` bytes are free, `deadline` at the latest (`None`: no limit) or
    /// until `lost()`.
    fn wait_room(
        &self,
        want: u64,
        deadline: Option<Instant>,
        lost: &dyn Fn() -> bool,
    ) -> Result<(), PipeStop> {
        let indices = self.indices();
        let ready = || indices.room(self.written) >= want;
        wait_until(&indices, None, &self.space, &ready, deadline, lost)
    }

    /// Writes one frame (`parts` in order) and commits it. Waits for room for the whole
    /// frame until `deadline` (a frame larger than the pipe: for the pipe to be empty);
    /// once the frame has started, only `lost()` stops it, so the stream never holds a
    /// frame given up half-way by a live worker.
    ///
    /// # Errors
    /// [`PipeStop::TimedOut`] (nothing written) or [`PipeStop::Lost`].
    pub fn write_frame(
        &mut self,
        parts: &[&[u8]],
        deadline: Option<Instant>,
        lost: &dyn Fn() -> bool,
    ) -> Result<(), PipeStop> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let capacity = self.capacity as u64;
        self.wait_room((total as u64).min(capacity), deadline, lost)?;
        for part in parts {
            let mut part: &[u8] = part;
            while !part.is_empty() {
                let mut room = self.indices().room(self.written);
                if room == 0 {
                    // Full half-way through the frame: hand the learner what is written
                    // and wait for it to read some.
                    self.indices().commit(self.written, &self.data);
                    self.wait_room(1, None, lost)?;
                    room = self.indices().room(self.written);
                }
                let n = part.len().min(usize::try_from(room).unwrap_or(usize::MAX));
                let mut at = 0;
                for (start, len) in spans(self.written, n, self.capacity) {
                    if len > 0 {
                        self.segment.put(DATA + start, &part[at..at + len]);
                        at += len;
                    }
                }
                self.written += n as u64;
                part = &part[n..];
            }
        }
        self.indices().commit(self.written, &self.data);
        Ok(())
    }

    /// Waits until the learner has read every byte written, `deadline` at the latest or
    /// until `lost()`. Whether it has.
    pub fn wait_read(&self, deadline: Option<Instant>, lost: &dyn Fn() -> bool) -> bool {
        self.wait_room(self.capacity as u64, deadline, lost).is_ok()
    }
}

impl PipeWriter {
    /// Connects to the learner's socket `name` (abstract namespace), presents `nonce` and
    /// takes over the pipe it hands over, with the one more descriptor the learner may hand
    /// with it (its parameter region); all within `timeout`.
    ///
    /// # Errors
    /// A message saying what failed.
    pub fn attach(
        name: &[u8],
        nonce: &[u8; NONCE_LEN],
        timeout: Duration,
    ) -> Result<(Self, Option<OwnedFd>), String> {
        let (n, message, fds) = request(name, nonce, timeout)?;
        let mut fds = fds.into_iter();
        let (Some(segment), Some(data), Some(space), extra, None) =
            (fds.next(), fds.next(), fds.next(), fds.next(), fds.next())
        else {
            return Err(refused(n));
        };
        if n != message.len() || &message != ATTACH_MESSAGE {
            return Err(format!("unexpected attach message {:?}", &message[..n]));
        }
        Ok((Self::new(segment, data, space)?, extra))
    }
}

/// Peers of the learner's uid refused (wrong nonce, none in time) before an offer is
/// withdrawn. Another user's attaches are refused without counting (see the fixed-shape
/// server's `MAX_ATTEMPTS`).
const MAX_ATTEMPTS: usize = 8;
/// How long an attaching peer has to present its nonce.
const NONCE_TIMEOUT: Duration = Duration::from_secs(2);

/// A pipe offered to a worker and not attached yet: the abstract socket it attaches on and
/// the nonce it must present. The segment is created only for a peer that presented it.
pub struct PipeOffer {
    /// The socket's abstract name.
    pub name: Vec<u8>,
    /// What the worker must present.
    pub nonce: [u8; NONCE_LEN],
    listener: UnixListener,
}

/// How waiting for a worker to attach ended.
pub enum Attached {
    /// It attached: the learner's side of its pipe.
    Pipe(PipeReader),
    /// Its TCP socket turned readable first (a decline, a goodbye, its end): the caller
    /// reads it.
    Socket,
}

impl PipeOffer {
    /// A fresh offer: a random socket name, listening, and a random nonce.
    ///
    /// # Errors
    /// A message saying what failed.
    pub fn new() -> Result<Self, String> {
        let name = random_name().map_err(|e| e.to_string())?;
        let listener = listen(&name).map_err(|e| format!("cannot listen on a Unix socket: {e}"))?;
        let nonce = crate::transport::wire::v2::random().map_err(|e| e.to_string())?;
        Ok(Self { name, nonce, listener })
    }

    /// Waits until `deadline` for the worker whose TCP connection is `socket` to attach a
    /// pipe of `capacity` bytes (or for its socket to turn readable), handing it `extra`
    /// too (the learner's parameter region) when given.
    ///
    /// # Errors
    /// A message saying why no pipe: the deadline passed, or too many refused attaches.
    pub fn wait(
        &self,
        socket: BorrowedFd<'_>,
        capacity: usize,
        deadline: Instant,
        extra: Option<BorrowedFd<'_>>,
    ) -> Result<Attached, String> {
        let mut attempts = 0;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("the shared memory was not attached in time".into());
            }
            let mut polls = [
                libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd {
                    fd: socket.as_raw_fd(),
                    events: libc::POLLIN | libc::POLLRDHUP,
                    revents: 0,
                },
            ];
            let ms = libc::c_int::try_from(left.min(WAIT_SLICE).as_millis()).unwrap_or(1).max(1);
            // SAFETY: two valid pollfds.
            let ready = unsafe { libc::poll(polls.as_mut_ptr(), 2, ms) };
            if ready <= 0 {
                continue;
            }
            if polls[1].revents != 0 {
                return Ok(Attached::Socket);
            }
            let Ok((stream, _)) = self.listener.accept() else { continue };
            let stranger = peer_uid(stream.as_fd()).is_ok_and(|uid| uid != own_uid());
            match self.hand_over(&stream, capacity, extra) {
                Ok(reader) => return Ok(Attached::Pipe(reader)),
                Err(why) if stranger => {
                    log::debug!("refused another user's shared-memory attach: {why}");
                }
                Err(why) => {
                    log::warn!("refused a shared-memory attach: {why}");
                    attempts += 1;
                    if attempts >= MAX_ATTEMPTS {
                        return Err("too many refused shared-memory attaches".into());
                    }
                }
            }
        }
    }

    /// Checks an attaching peer (our uid, the nonce), then creates the pipe and sends it.
    fn hand_over(
        &self,
        stream: &UnixStream,
        capacity: usize,
        extra: Option<BorrowedFd<'_>>,
    ) -> Result<PipeReader, String> {
        let uid = peer_uid(stream.as_fd()).map_err(|e| format!("no peer credentials: {e}"))?;
        if uid != own_uid() {
            return Err(format!("the peer runs as uid {uid}, the learner as {}", own_uid()));
        }
        let setup = |s: &UnixStream| {
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(NONCE_TIMEOUT))?;
            s.set_write_timeout(Some(NONCE_TIMEOUT))
        };
        setup(stream).map_err(|e| e.to_string())?;
        let mut nonce = [0u8; NONCE_LEN];
        (&*stream).read_exact(&mut nonce).map_err(|e| format!("no nonce: {e}"))?;
        // Constant time: every byte is compared.
        if nonce.iter().zip(&self.nonce).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 {
            return Err("wrong nonce".into());
        }
        let reader =
            PipeReader::new(capacity).map_err(|e| format!("cannot create the segment: {e}"))?;
        let mut fds = reader.fds().to_vec();
        fds.extend(extra.map(|fd| fd.as_raw_fd()));
        send_fds(stream.as_raw_fd(), ATTACH_MESSAGE, &fds)
            .map_err(|e| format!("cannot send the segment: {e}"))?;
        Ok(reader)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use std::time::{Duration, Instant};

    use super::{PipeReader, PipeStop, PipeWriter, DATA};

    /// A connected pair of loopback sockets: (the worker's, the learner's).
    fn sockets() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let worker = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (learner, _) = listener.accept().unwrap();
        (worker, learner)
    }

    /// A reader and the writer of the same pipe (the descriptors duplicated, as the
    /// attach hands them over).
    fn pipe(capacity: usize) -> (PipeReader, PipeWriter) {
        let reader = PipeReader::new(capacity).unwrap();
        let dup = |fd| {
            // SAFETY: dup of a descriptor the reader owns; the result is checked.
            let raw = unsafe { libc::dup(fd) };
            assert!(raw >= 0);
            // SAFETY: a fresh descriptor nobody else owns.
            unsafe { OwnedFd::from_raw_fd(raw) }
        };
        let [segment, data, space] = reader.fds().map(dup);
        let writer = PipeWriter::new(segment, data, space).unwrap();
        (reader, writer)
    }

    /// Frame `i`: `i % 251 + (i * 7919) % 5000` bytes, each `(i + k) as u8`.
    fn frame(i: usize) -> Vec<u8> {
        (0..i % 251 + (i * 7919) % 5000).map(|k| (i + k) as u8).collect()
    }

    #[test]
    fn frames_of_any_size_come_out_whole_and_in_order_across_the_wrap() {
        // 1000 bytes: most frames wrap, many are larger than the whole pipe.
        let (mut reader, mut writer) = pipe(1000);
        let (worker, learner) = sockets();
        reader.watch(learner.as_fd()).unwrap();
        let frames = 400;
        let producer = std::thread::spawn(move || {
            for i in 0..frames {
                let bytes = frame(i);
                let (a, b) = bytes.split_at(bytes.len() / 3);
                writer.write_frame(&[a, b], None, &|| false).unwrap();
            }
            assert!(writer.wait_read(Some(Instant::now() + Duration::from_secs(30)), &|| false));
            drop(worker); // the worker's end: the reader's stream ends after the last byte
        });
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        producer.join().unwrap();
        let want: Vec<u8> = (0..frames).flat_map(frame).collect();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "every byte, in order");
    }

    #[test]
    fn acknowledgements_in_the_segment_wake_a_worker_waiting_for_them() {
        let (reader, writer) = pipe(64);
        let acks = writer.acks().unwrap();
        assert_eq!(acks.stored(), 0);
        let soon = Some(Instant::now() + Duration::from_millis(20));
        assert_eq!(acks.wait_stored(1, soon, &|| false), Err(PipeStop::TimedOut));
        let learner = std::thread::spawn(move || {
            for n in 1..=100 {
                reader.acknowledge(n);
                if n % 10 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        let later = Some(Instant::now() + Duration::from_secs(30));
        acks.wait_stored(50, later, &|| false).unwrap();
        assert!(acks.stored() >= 50);
        acks.wait_stored(100, later, &|| false).unwrap();
        learner.join().unwrap();
        assert_eq!(acks.stored(), 100);
        assert_eq!(acks.wait_stored(101, None, &|| true), Err(PipeStop::Lost));
    }

    #[test]
    fn a_frame_that_does_not_fit_in_time_is_not_started() {
        let (mut reader, mut writer) = pipe(100);
        writer.write_frame(&[&[1; 80]], None, &|| false).unwrap();
        let soon = Some(Instant::now() + Duration::from_millis(50));
        assert_eq!(writer.write_frame(&[&[2; 30]], soon, &|| false), Err(PipeStop::TimedOut));
        assert_eq!(writer.write_frame(&[&[2; 30]], None, &|| true), Err(PipeStop::Lost));
        let mut got = [0u8; 100];
        assert_eq!(reader.read(&mut got).unwrap(), 80, "only the first frame is in the pipe");
        assert!(got[..80].iter().all(|&b| b == 1));
    }

    #[test]
    fn the_stream_ends_after_the_committed_bytes_once_the_socket_ends() {
        let (mut reader, mut writer) = pipe(64);
        let (worker, learner) = sockets();
        reader.watch(learner.as_fd()).unwrap();
        writer.write_frame(&[b"last words"], None, &|| false).unwrap();
        drop(worker);
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"last words");
    }

    #[test]
    fn a_byte_over_tcp_or_an_impossible_tail_is_an_error() {
        let (mut reader, _writer) = pipe(64);
        let (mut worker, learner) = sockets();
        reader.watch(learner.as_fd()).unwrap();
        std::io::Write::write_all(&mut worker, &[0x18]).unwrap();
        let err = reader.read(&mut [0u8; 8]).unwrap_err();
        assert!(err.to_string().contains("over TCP after attaching"), "{err}");

        let (mut reader, _writer) = pipe(64);
        // The worker claims 65 bytes committed in a pipe of 64.
        reader.scribble(crate::transport::shm::OFF_TAIL, &65u64.to_le_bytes());
        let err = reader.read(&mut [0u8; 8]).unwrap_err();
        assert!(err.to_string().contains("tail 65 with head 0"), "{err}");
        // Scribbling on the data only changes the bytes read, never where they are read.
        reader.scribble(DATA, &[9; 8]);
    }

    #[test]
    fn a_pipe_segment_is_checked_when_attached() {
        let reader = PipeReader::new(64).unwrap();
        let dup = |fd| {
            // SAFETY: as in `pipe`.
            let raw = unsafe { libc::dup(fd) };
            // SAFETY: as in `pipe`.
            unsafe { OwnedFd::from_raw_fd(raw) }
        };
        // A ring of fixed slots is not a pipe.
        let ring = crate::transport::shm::Reader::with_slots(16, 4).unwrap();
        let [segment, data, space] = ring.fds().map(dup);
        let err = PipeWriter::new(segment, data, space).err().unwrap();
        assert!(err.contains("not a byte pipe"), "{err}");
        // A pipe that already holds bytes is not fresh.
        reader.scribble(crate::transport::shm::OFF_TAIL, &3u64.to_le_bytes());
        let [segment, data, space] = reader.fds().map(dup);
        let err = PipeWriter::new(segment, data, space).err().unwrap();
        assert!(err.contains("a fresh pipe starts at byte 3"), "{err}");
    }
}
