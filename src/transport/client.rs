//! A blocking TCP client for rollout workers: connect, check the handshake, stream samples.
//!
//! Each sample goes out with one vectored write straight from the caller's leaf buffers (no
//! joined copy). A background thread reads the one-byte acks and counts them; `send` blocks
//! while `max_inflight` samples are unacknowledged, and `wait` until every sample is. When
//! the server goes away, every blocked call returns [`EchoError::Disconnected`] promptly.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::wire::{parse_handshake, ACK};
use crate::error::EchoError;
use crate::spec::DataSpec;
use crate::sync::{Arc, AtomicBool, AtomicU64, Signal};

use std::sync::atomic::Ordering::{Acquire, Release};

/// Ack bookkeeping shared with the reader thread.
#[derive(Default)]
struct Acks {
    /// Acknowledgements received.
    acked: AtomicU64,
    /// Set (with `reason`) when the connection is gone.
    lost: AtomicBool,
    reason: Mutex<String>,
    changed: Signal,
}

impl Acks {
    fn lose(&self, reason: String) {
        let mut slot = self.reason.lock();
        if slot.is_empty() {
            *slot = reason;
        }
        drop(slot);
        // ORDERING: Release pairs with `is_lost`'s Acquire: the reason is written first.
        self.lost.store(true, Release);
        self.changed.notify_all();
    }

    fn is_lost(&self) -> bool {
        // ORDERING: Acquire pairs with the Release in `lose`.
        self.lost.load(Acquire)
    }

    fn acked(&self) -> u64 {
        // ORDERING: Acquire pairs with the reader's Release `fetch_add` (only counts matter,
        // but Acquire keeps "acked" meaningful to callers reading other state after it).
        self.acked.load(Acquire)
    }

    fn closed_error(&self) -> EchoError {
        EchoError::Disconnected(self.reason.lock().clone())
    }
}

/// A connection to an echo server.
pub struct TcpSender {
    stream: TcpStream,
    spec: DataSpec,
    acks: Arc<Acks>,
    sent: u64,
    max_inflight: u64,
    reader: Option<JoinHandle<()>>,
    closed: bool,
    /// Bytes of the current sample already written; non-zero only between a
    /// [`EchoError::Stalled`] and the `send` that finishes the sample.
    in_progress: usize,
}

/// How long one blocking write may take before `send` checks its deadline again.
const WRITE_SLICE: Duration = Duration::from_millis(50);
/// How long [`TcpSender::connect`] waits in one [`Connecting::poll`].
const CONNECT_SLICE: Duration = Duration::from_millis(50);

/// A connection being opened ([`TcpSender::connecting`]). Each [`Connecting::poll`] waits at
/// most until the time it is given, so a caller can check for interrupts (Ctrl-C) between
/// polls; the deadline given to `connecting` bounds the whole connect and handshake. Dropping
/// it abandons the connect (its thread ends on its own, at the latest at the deadline).
pub struct Connecting {
    /// `host:port`, for messages.
    address: String,
    max_inflight: u64,
    started: Instant,
    deadline: Option<Instant>,
    /// The result of the TCP connect, from its thread.
    connected: Receiver<io::Result<TcpStream>>,
    /// Connected, reading the handshake.
    stream: Option<TcpStream>,
    /// Handshake bytes received so far.
    received: Vec<u8>,
}

impl Connecting {
    /// Waits until `until` (or the deadline, if sooner) for the connection and the handshake.
    /// `Ok(None)`: not yet, call again.
    ///
    /// # Errors
    /// [`EchoError::Io`] if connecting fails (`TimedOut` once the deadline passes, naming
    /// what was missing); [`EchoError::Protocol`] if the peer is not an echo v1 server (from
    /// its first wrong byte on); [`EchoError::Disconnected`] if it closes the connection
    /// during the handshake (an echo server at `max_connections` does that).
    pub fn poll(&mut self, until: Instant) -> Result<Option<TcpSender>, EchoError> {
        let until = self.deadline.map_or(until, |d| d.min(until));
        if self.stream.is_none() {
            let wait = until.saturating_duration_since(Instant::now());
            match self.connected.recv_timeout(wait) {
                Ok(stream) => self.stream = Some(stream?),
                Err(RecvTimeoutError::Timeout) => return self.not_yet("could not connect"),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(EchoError::Io(io::Error::other(format!(
                        "connecting to {}: the connect thread ended without a result",
                        self.address
                    ))))
                }
            }
        }
        let stream = self.stream.as_mut().expect("connected above");
        let mut chunk = [0u8; 512];
        loop {
            if let Some((spec, len)) = parse_handshake(&self.received)? {
                if len != self.received.len() {
                    // A v1 server sends nothing after its handshake until a sample arrives
                    // (then one ack each): anything else is not echo's protocol.
                    return Err(EchoError::Protocol(format!(
                        "{} sent {} bytes after its handshake, before any sample: not an echo \
                         v1 server",
                        self.address,
                        self.received.len() - len
                    )));
                }
                let stream = self.stream.take().expect("connected above");
                return TcpSender::start(stream, spec, self.max_inflight).map(Some);
            }
            let wait = until.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return self.not_yet("sent no complete echo handshake");
            }
            stream.set_read_timeout(Some(wait))?;
            match stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(EchoError::Disconnected(format!(
                        "{} closed the connection during the handshake (too many connections?)",
                        self.address
                    )))
                }
                Ok(n) => self.received.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    return self.not_yet("sent no complete echo handshake");
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// `Ok(None)` before the deadline; after it, a `TimedOut` error saying what was missing.
    fn not_yet(&self, what: &str) -> Result<Option<TcpSender>, EchoError> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(EchoError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{} {what} within the connect timeout ({:.1?}: the handshake had {} bytes)",
                    self.address,
                    self.started.elapsed(),
                    self.received.len()
                ),
            )));
        }
        Ok(None)
    }
}

/// Resolves `host` and connects to the first address that answers, before `deadline`.
fn open_stream(host: &str, port: u16, deadline: Option<Instant>) -> io::Result<TcpStream> {
    let mut last_err = None;
    for addr in (host, port).to_socket_addrs()? {
        let attempt = match deadline {
            None => TcpStream::connect(addr),
            Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => TcpStream::connect_timeout(&addr, left),
                _ => Err(io::Error::new(io::ErrorKind::TimedOut, "the connect timeout passed")),
            },
        };
        match attempt {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) => last_err = Some(e),
        }
    }
    let err = last_err.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"));
    Err(io::Error::new(err.kind(), format!("cannot connect to {host}:{port}: {err}")))
}

impl TcpSender {
    /// Connects to `host:port`, reads the server's handshake and starts the ack reader, all
    /// within `timeout`. Returns the client; compare [`TcpSender::spec`] with yours.
    ///
    /// # Errors
    /// As [`Connecting::poll`].
    pub fn connect(
        host: &str,
        port: u16,
        max_inflight: u64,
        timeout: Duration,
    ) -> Result<Self, EchoError> {
        let mut connecting =
            Self::connecting(host, port, max_inflight, Instant::now().checked_add(timeout))?;
        loop {
            if let Some(sender) = connecting.poll(Instant::now() + CONNECT_SLICE)? {
                return Ok(sender);
            }
        }
    }

    /// Starts connecting to `host:port`; drive it with [`Connecting::poll`] until it returns
    /// the client. `deadline` bounds everything (name resolution, the TCP connect, the whole
    /// handshake); `None` waits as long as it takes.
    ///
    /// # Errors
    /// [`EchoError::Config`] if `max_inflight` is 0; [`EchoError::Io`] if no thread can start.
    pub fn connecting(
        host: &str,
        port: u16,
        max_inflight: u64,
        deadline: Option<Instant>,
    ) -> Result<Connecting, EchoError> {
        if max_inflight == 0 {
            return Err(EchoError::Config(
                "the in-flight window must allow at least 1 sample, got 0".into(),
            ));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let target = (host.to_owned(), port);
        // std has no non-blocking connect: it runs on a short-lived thread of its own, bounded
        // by `deadline`, and `poll` waits for its result in slices.
        thread::Builder::new().name("echo-client-connect".into()).spawn(move || {
            let _ = tx.send(open_stream(&target.0, target.1, deadline));
        })?;
        Ok(Connecting {
            address: format!("{host}:{port}"),
            max_inflight,
            started: Instant::now(),
            deadline,
            connected: rx,
            stream: None,
            received: Vec::new(),
        })
    }

    /// Starts the ack reader on a connected stream whose handshake announced `spec`.
    fn start(stream: TcpStream, spec: DataSpec, max_inflight: u64) -> Result<Self, EchoError> {
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(Some(WRITE_SLICE))?;
        let acks = Arc::new(Acks::default());
        let reader = {
            let (mut stream, acks) = (stream.try_clone()?, Arc::clone(&acks));
            thread::Builder::new()
                .name("echo-client-acks".into())
                .spawn(move || read_acks(&mut stream, &acks))?
        };
        Ok(Self {
            stream,
            spec,
            acks,
            sent: 0,
            max_inflight,
            reader: Some(reader),
            closed: false,
            in_progress: 0,
        })
    }

    /// The server's sample layout.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// Samples sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Samples acknowledged so far.
    pub fn acked(&self) -> u64 {
        self.acks.acked()
    }

    /// Sends one sample given as its leaves (sizes are checked against the spec here). Waits
    /// first while `max_inflight` samples are unacknowledged; returns
    /// [`EchoError::TimedOut`] if `deadline` passes while waiting (nothing was sent).
    ///
    /// Once the first byte is written the sample must be finished, or the stream would be
    /// misaligned: if `deadline` passes mid-write this returns [`EchoError::Stalled`], and
    /// the next `send` (with the same leaves) continues where it stopped. [`TcpSender::abort`]
    /// gives up instead (the server discards the partial sample).
    ///
    /// # Errors
    /// [`EchoError::Disconnected`] once the connection is gone; [`EchoError::Protocol`] if the
    /// leaves do not match the spec.
    pub fn send(&mut self, leaves: &[&[u8]], deadline: Option<Instant>) -> Result<(), EchoError> {
        self.ensure_open()?;
        if self.in_progress == 0 {
            self.check_leaves(leaves)?;
            self.wait_for_acks((self.sent + 1).saturating_sub(self.max_inflight), deadline)?;
        }
        self.write_sample(leaves, deadline)?;
        self.sent += 1;
        Ok(())
    }

    /// Bytes of a sample written so far by a `send` that returned [`EchoError::Stalled`].
    pub fn in_progress(&self) -> usize {
        self.in_progress
    }

    /// Closes the connection in the middle of a sample (after an interrupt): the server
    /// discards the partial sample; every later call returns [`EchoError::Disconnected`].
    pub fn abort(&mut self, reason: &str) {
        // The reason first: the reader thread reports its own once the socket shuts down.
        self.acks.lose(reason.to_owned());
        let _ = self.stream.shutdown(Shutdown::Both);
        self.in_progress = 0;
    }

    fn check_leaves(&self, leaves: &[&[u8]]) -> Result<(), EchoError> {
        if leaves.len() != self.spec.len() {
            return Err(EchoError::LeafCount { expected: self.spec.len(), got: leaves.len() });
        }
        for (i, (leaf, array)) in leaves.iter().zip(self.spec.arrays()).enumerate() {
            if leaf.len() != array.num_bytes() {
                return Err(EchoError::SizeMismatch {
                    leaf: i,
                    expected: array.num_bytes(),
                    got: leaf.len(),
                });
            }
        }
        Ok(())
    }

    /// Waits until every sent sample is acknowledged (or `deadline`).
    ///
    /// # Errors
    /// [`EchoError::Disconnected`] if the connection goes away first, [`EchoError::TimedOut`].
    pub fn wait(&self, deadline: Option<Instant>) -> Result<(), EchoError> {
        self.wait_for_acks(self.sent, deadline)
    }

    /// Waits until at least `target` acks have arrived.
    fn wait_for_acks(&self, target: u64, deadline: Option<Instant>) -> Result<(), EchoError> {
        let acks = &self.acks;
        let reached =
            acks.changed.wait_until(|| acks.acked() >= target || acks.is_lost(), deadline);
        if acks.acked() >= target {
            Ok(())
        } else if acks.is_lost() {
            Err(acks.closed_error())
        } else {
            debug_assert!(!reached);
            Err(EchoError::TimedOut)
        }
    }

    /// Writes the sample from byte `in_progress` on, until done or `deadline` passes.
    fn write_sample(
        &mut self,
        leaves: &[&[u8]],
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let mut slices: Vec<IoSlice<'_>> =
            leaves.iter().filter(|l| !l.is_empty()).map(|l| IoSlice::new(l)).collect();
        let mut remaining = &mut slices[..];
        IoSlice::advance_slices(&mut remaining, self.in_progress);
        while !remaining.is_empty() {
            match self.stream.write_vectored(remaining) {
                Ok(0) => {
                    self.acks.lose("the server stopped reading (write returned 0)".into());
                    return Err(self.acks.closed_error());
                }
                Ok(n) => {
                    self.in_progress += n;
                    IoSlice::advance_slices(&mut remaining, n);
                }
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    // The server is applying backpressure; keep going unless it vanished or
                    // the caller wants control back.
                    self.ensure_open()?;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(if self.in_progress == 0 {
                            EchoError::TimedOut
                        } else {
                            EchoError::Stalled
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.acks.lose(format!("sending failed: {e}"));
                    return Err(self.acks.closed_error());
                }
            }
        }
        self.in_progress = 0;
        Ok(())
    }

    fn ensure_open(&self) -> Result<(), EchoError> {
        if self.closed {
            return Err(EchoError::Disconnected("the client was closed".into()));
        }
        if self.acks.is_lost() {
            return Err(self.acks.closed_error());
        }
        Ok(())
    }

    /// Flushes (waits for every ack, until `deadline`), then closes the socket and joins the
    /// ack reader. Idempotent. Returns whether every sent sample was acknowledged.
    pub fn close(&mut self, deadline: Option<Instant>) -> bool {
        if self.closed {
            return self.acks.acked() >= self.sent;
        }
        let flushed = self.wait(deadline).is_ok();
        self.closed = true;
        let _ = self.stream.shutdown(Shutdown::Both);
        self.acks.lose("the client was closed".into());
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        flushed
    }
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        // Do not wait for acks on drop; just release the socket and the thread.
        if !self.closed {
            self.closed = true;
            let _ = self.stream.shutdown(Shutdown::Both);
            if let Some(reader) = self.reader.take() {
                let _ = reader.join();
            }
        }
    }
}

fn read_acks(stream: &mut TcpStream, acks: &Acks) {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return acks.lose("the server closed the connection".into()),
            Ok(n) => {
                if let Some(bad) = buf[..n].iter().find(|&&b| b != ACK) {
                    return acks
                        .lose(format!("protocol error: expected ack byte 0x01, got {bad:#04x}"));
                }
                // ORDERING: Release pairs with the Acquire in `Acks::acked`.
                acks.acked.fetch_add(n as u64, Release);
                acks.changed.notify_all();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return acks.lose(format!("the connection failed: {e}")),
        }
    }
}
