//! A worker's connection to a ragged server: wire v2's handshake, then one group frame per
//! `send_group` ([`super::wire`]), over TCP or, on the learner's host, through a
//! shared-memory pipe the server offers (the same bytes; see
//! [`crate::transport::shm::pipe`]). Samples are checked against the spec before they are
//! sent (lengths, length groups, the server's largest group), so a bad sample raises at
//! the caller and nothing of it goes out. A reader thread counts the acknowledgements (over
//! TCP on either path) and keeps the server's error or closing notice for the next call.

use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::spec::RaggedSpec;
use super::wire::{encode_head, Outgoing};
use crate::error::EchoError;
use crate::transport::wire::v2::{self, Closing, Hello, Layout, Offer, Reply};

#[derive(Debug, Default)]
struct State {
    sent: u64,
    acked: u64,
    error: Option<String>,
    closing: Option<Closing>,
    ended: bool,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    /// Waits for a change, or fails once `deadline` has passed.
    fn wait(
        &self,
        state: &mut parking_lot::MutexGuard<'_, State>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        match deadline {
            Some(d) if Instant::now() >= d => return Err(EchoError::TimedOut),
            Some(d) => {
                let _ = self.changed.wait_until(state, d);
            }
            None => self.changed.wait(state),
        }
        Ok(())
    }
}

/// How a [`RaggedSender`] connects.
#[derive(Debug, Clone)]
pub struct SenderOptions {
    /// The server's secret, if it has one.
    pub token: Option<Vec<u8>>,
    /// How long connecting (and attaching shared memory) may take.
    pub timeout: Duration,
    /// At most this many samples wait for their acknowledgement at once.
    pub max_inflight: usize,
    /// The same-host shared-memory pipe: `None` when the server offers it, `Some(true)`
    /// required (an error without it), `Some(false)` never.
    pub shared_memory: Option<bool>,
}

impl Default for SenderOptions {
    fn default() -> Self {
        Self {
            token: None,
            timeout: Duration::from_secs(10),
            max_inflight: 256,
            shared_memory: None,
        }
    }
}

/// The sending side of a worker.
pub struct RaggedSender {
    spec: RaggedSpec,
    stream: Mutex<TcpStream>,
    /// The shared-memory pipe frames go through, when attached.
    pipe: Option<Mutex<pipe::Writer>>,
    /// Its acknowledgements (the samples the server stored), read out of the pipe's
    /// segment: a pipe's are not sent over TCP.
    acks: Option<pipe::Acks>,
    shared: Arc<Shared>,
    reader: Mutex<Option<JoinHandle<()>>>,
    max_group: usize,
    max_inflight: u64,
}

fn read_some(stream: &mut TcpStream, received: &mut Vec<u8>) -> Result<(), EchoError> {
    let mut chunk = [0u8; 4096];
    let n = stream.read(&mut chunk)?;
    if n == 0 {
        return Err(EchoError::Disconnected("the server closed during the handshake".into()));
    }
    received.extend_from_slice(&chunk[..n]);
    Ok(())
}

impl RaggedSender {
    /// Connects to `host:port` and completes the handshake for samples of `spec`, described
    /// as `layout`, as `options` say.
    ///
    /// # Errors
    /// [`EchoError::Io`] / [`EchoError::Disconnected`] if the server cannot be reached;
    /// [`EchoError::Protocol`] if it refuses the layout (naming the leaf) or is not a ragged
    /// server; [`EchoError::Auth`] for a wrong or missing token;
    /// [`EchoError::SharedMemory`] if shared memory is required and not to be had.
    pub fn connect(
        host: &str,
        port: u16,
        spec: RaggedSpec,
        layout: Layout,
        options: SenderOptions,
    ) -> Result<Self, EchoError> {
        let SenderOptions { token, timeout, max_inflight, shared_memory } = options;
        let token = token.as_deref();
        let addr = (host, port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| EchoError::Config(format!("cannot resolve {host}:{port}")))?;
        let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        let mut received = Vec::new();
        // An open fixed-shape server greets v1 clients first: skip its v1 handshake.
        while received.len() < 5 {
            read_some(&mut stream, &mut received)?;
        }
        if received[4] == crate::transport::wire::VERSION {
            loop {
                if let Some((_, used)) = crate::transport::wire::parse_handshake(&received)? {
                    received.drain(..used);
                    break;
                }
                read_some(&mut stream, &mut received)?;
            }
        }
        let offer = loop {
            if let Some(offer) = Offer::parse(&received)? {
                received.drain(..v2::OFFER_LEN);
                break offer;
            }
            read_some(&mut stream, &mut received)?;
        };
        let hello = Hello {
            session: v2::random()?,
            first_seq: 0,
            heartbeat_ms: 0,
            client_nonce: v2::random()?,
            layout,
            mac: None,
            shm: shared_memory != Some(false) && pipe::SUPPORTED,
            notices: true,
            codecs: false,
            durable: false,
            params: false,
            versions: false,
        };
        stream.write_all(&hello.encode(&offer, token)?)?;
        let reply = loop {
            if let Some((reply, used)) = Reply::parse(&received)? {
                received.drain(..used);
                break reply;
            }
            read_some(&mut stream, &mut received)?;
        };
        let accept = match reply {
            Reply::Accepted(accept) => accept,
            Reply::Refused(why, message) => return Err(why.into_error(message)),
        };
        if let Some(token) = token {
            if !accept.verify(token, &hello, &offer) {
                return Err(EchoError::Auth("the server did not prove the token".into()));
            }
        }
        let max_group = accept.steps.ok_or_else(|| {
            EchoError::Protocol(
                "the server accepted the layout but is not a ragged server (no group size)".into(),
            )
        })? as usize;
        let pipe = match shared_memory {
            Some(false) => None,
            wanted => {
                let address = format!("{host}:{port}");
                pipe::attach(&accept, &mut stream, &address, wanted == Some(true), timeout)?
            }
        };
        stream.set_read_timeout(None)?;
        let shared = Arc::new(Shared::default());
        let mut reading = stream.try_clone()?;
        let counting = shared.clone();
        let loss = pipe.as_ref().map(pipe::Writer::space_bell).transpose()?;
        let acks = pipe.as_ref().map(pipe::Writer::acks).transpose()?;
        let reader =
            std::thread::Builder::new().name("echo-ragged-acks".into()).spawn(move || {
                read_acks(&mut reading, received, &counting);
                // A send waiting for room in the pipe wakes up and sees the loss.
                if let Some(bell) = loss {
                    pipe::ring(&bell);
                }
            })?;
        Ok(Self {
            spec,
            stream: Mutex::new(stream),
            pipe: pipe.map(Mutex::new),
            acks,
            shared,
            reader: Mutex::new(Some(reader)),
            max_group,
            max_inflight: max_inflight.max(1) as u64,
        })
    }

    /// The spec samples are checked against.
    pub fn spec(&self) -> &RaggedSpec {
        &self.spec
    }

    /// Whether frames go through a shared-memory pipe (else over TCP).
    pub fn uses_shared_memory(&self) -> bool {
        self.pipe.is_some()
    }

    /// Whether the connection has failed, closed or ended (a send would fail).
    fn lost(&self) -> bool {
        Self::failure(&self.shared.state.lock()).is_some()
    }

    /// (sent, acknowledged) samples.
    pub fn counts(&self) -> (u64, u64) {
        let state = self.shared.state.lock();
        (state.sent, self.acks.as_ref().map_or(state.acked, pipe::Acks::stored))
    }

    /// The error of a pipe's wait that stopped.
    fn stopped(&self, stop: &pipe::Stop) -> EchoError {
        match stop {
            pipe::Stop::TimedOut => EchoError::TimedOut,
            pipe::Stop::Lost => Self::failure(&self.shared.state.lock()).unwrap_or_else(|| {
                EchoError::Disconnected("the server closed the connection".into())
            }),
        }
    }

    fn failure(state: &State) -> Option<EchoError> {
        if let Some(why) = &state.error {
            return Some(EchoError::Protocol(format!("the server refused a sample: {why}")));
        }
        match state.closing {
            Some(Closing::Final) => Some(EchoError::ServerClosed("the server closed".into())),
            Some(Closing::Restarting) => {
                Some(EchoError::Disconnected("the server is restarting".into()))
            }
            None if state.ended => {
                Some(EchoError::Disconnected("the server closed the connection".into()))
            }
            None => None,
        }
    }

    /// Sends `samples` as one group frame (a single sample when there is one), waiting until
    /// `deadline` while `max_inflight` samples are unacknowledged.
    ///
    /// # Errors
    /// [`EchoError::Sample`] for a sample the server would refuse (nothing is sent);
    /// [`EchoError::TimedOut`]; the server's error, closing or disconnection.
    pub fn send_group(
        &self,
        samples: &[Outgoing<'_>],
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        if samples.len() > self.max_group {
            return Err(EchoError::Sample(format!(
                "a group of {} samples is larger than a batch (batch_size {})",
                samples.len(),
                self.max_group
            )));
        }
        if let Some(p) = priority.filter(|p| !p.is_finite() || *p < 0.0) {
            return Err(EchoError::Priority(format!(
                "a priority must be finite and >= 0, got {p}"
            )));
        }
        for sample in samples {
            let bytes: Vec<usize> = sample.leaves.iter().map(|l| l.len()).collect();
            let rows: Vec<usize> = self
                .spec
                .columns()
                .iter()
                .zip(sample.rows)
                .map(|(c, &r)| if c.is_ragged() { r } else { 1 })
                .collect();
            self.spec.check(&rows, &bytes)?;
        }
        let head = encode_head(&self.spec, samples, priority)?;
        if let Some(acks) = &self.acks {
            let sent = {
                let state = self.shared.state.lock();
                if let Some(err) = Self::failure(&state) {
                    return Err(err);
                }
                state.sent
            };
            if sent - acks.stored().min(sent) >= self.max_inflight {
                // The window is full: wait until half of it is free (one wake-up for many
                // samples stored, not one each).
                let target = sent - self.max_inflight / 2;
                acks.wait_stored(target, deadline, &|| self.lost())
                    .map_err(|stop| self.stopped(&stop))?;
            }
        } else {
            let mut state = self.shared.state.lock();
            loop {
                if let Some(err) = Self::failure(&state) {
                    return Err(err);
                }
                if state.sent - state.acked < self.max_inflight {
                    break;
                }
                self.shared.wait(&mut state, deadline)?;
            }
        }
        if let Some(pipe) = &self.pipe {
            // The header, then every leaf straight from the caller's arrays into the pipe.
            let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + samples.len() * 4);
            parts.push(&head);
            parts.extend(samples.iter().flat_map(|s| s.leaves.iter().copied()));
            let written = pipe.lock().write_frame(&parts, deadline, &|| self.lost());
            written.map_err(|stop| self.stopped(&stop))?;
            self.shared.state.lock().sent += samples.len() as u64;
            return Ok(());
        }
        // One vectored write: the header, then every leaf straight from the caller's arrays.
        let mut parts: Vec<IoSlice<'_>> = Vec::with_capacity(1 + samples.len() * 4);
        parts.push(IoSlice::new(&head));
        parts.extend(
            samples
                .iter()
                .flat_map(|s| s.leaves.iter().filter(|l| !l.is_empty()).map(|l| IoSlice::new(l))),
        );
        let mut stream = self.stream.lock();
        let mut rest = &mut parts[..];
        while !rest.is_empty() {
            let written = stream.write_vectored(rest)?;
            if written == 0 {
                return Err(EchoError::Disconnected("the server stopped reading".into()));
            }
            IoSlice::advance_slices(&mut rest, written);
        }
        drop(stream);
        self.shared.state.lock().sent += samples.len() as u64;
        Ok(())
    }

    /// Sends `frame` as it is, counted as no sample: what a hostile worker can send, for
    /// tests.
    ///
    /// # Errors
    /// As [`RaggedSender::send_group`].
    #[doc(hidden)]
    pub fn send_raw(&self, frame: &[u8], deadline: Option<Instant>) -> Result<(), EchoError> {
        if let Some(pipe) = &self.pipe {
            return pipe
                .lock()
                .write_frame(&[frame], deadline, &|| self.lost())
                .map_err(|_| EchoError::Disconnected("the pipe is gone".into()));
        }
        Ok(self.stream.lock().write_all(frame)?)
    }

    /// Waits until every sample sent is acknowledged (stored by the server).
    ///
    /// # Errors
    /// [`EchoError::TimedOut`]; the server's error, closing or disconnection while samples
    /// are unacknowledged.
    pub fn flush(&self, deadline: Option<Instant>) -> Result<(), EchoError> {
        if let Some(acks) = &self.acks {
            let sent = self.shared.state.lock().sent;
            return acks.wait_stored(sent, deadline, &|| self.lost()).map_err(|s| self.stopped(&s));
        }
        let mut state = self.shared.state.lock();
        loop {
            if state.acked >= state.sent {
                return Ok(());
            }
            if let Some(err) = Self::failure(&state) {
                return Err(err);
            }
            self.shared.wait(&mut state, deadline)?;
        }
    }

    /// Says goodbye and closes the connection (without waiting for acknowledgements: call
    /// [`RaggedSender::flush`] first for that).
    pub fn close(&self) {
        if let Some(pipe) = &self.pipe {
            // The goodbye goes through the pipe, after every frame; the learner reads the
            // pipe to its end either way once the socket closes.
            let soon = Some(Instant::now() + Duration::from_secs(1));
            let _ = pipe.lock().write_frame(&[&[v2::BYE]], soon, &|| self.lost());
            let _ = self.stream.lock().shutdown(Shutdown::Both);
        }
        {
            let mut stream = self.stream.lock();
            let _ = stream.write_all(&[v2::BYE]);
            let _ = stream.shutdown(Shutdown::Both);
        }
        if let Some(reader) = self.reader.lock().take() {
            let _ = reader.join();
        }
    }
}

impl std::fmt::Debug for RaggedSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = if self.pipe.is_some() { "shm" } else { "tcp" };
        write!(f, "RaggedSender({path}, {:?})", self.counts())
    }
}

impl Drop for RaggedSender {
    fn drop(&mut self) {
        self.close();
    }
}

/// The reader thread: acknowledgements, heartbeats, an error or a closing notice.
fn read_acks(stream: &mut TcpStream, mut pending: Vec<u8>, shared: &Shared) {
    let mut chunk = [0u8; 4096];
    loop {
        let mut at = 0;
        let mut acks = 0u64;
        let mut stop = None;
        while at < pending.len() {
            match pending[at] {
                v2::ACK => {
                    acks += 1;
                    at += 1;
                }
                v2::BEAT => at += 1,
                v2::CLOSING => match pending.get(at + 1) {
                    Some(&why) => {
                        stop = Some(Err(Closing::from_byte(why).unwrap_or(Closing::Final)));
                        break;
                    }
                    None => break,
                },
                v2::ERROR => match v2::parse_error(&pending[at + 1..]) {
                    Ok(Some((message, _))) => {
                        stop = Some(Ok(message));
                        break;
                    }
                    Ok(None) => break,
                    Err(err) => {
                        stop = Some(Ok(err.to_string()));
                        break;
                    }
                },
                other => {
                    stop = Some(Ok(format!("an unknown byte {other:#04x} from the server")));
                    break;
                }
            }
        }
        pending.drain(..at);
        {
            let mut state = shared.state.lock();
            state.acked += acks;
            match stop.take() {
                Some(Ok(message)) => state.error = Some(message),
                Some(Err(closing)) => state.closing = Some(closing),
                None => {}
            }
        }
        shared.changed.notify_all();
        let done = {
            let state = shared.state.lock();
            state.error.is_some() || state.closing.is_some()
        };
        if done {
            break;
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => pending.extend_from_slice(&chunk[..n]),
        }
    }
    shared.state.lock().ended = true;
    shared.changed.notify_all();
}

/// The worker's side of the shared-memory pipe (Linux), or its stand-in elsewhere.
#[cfg(target_os = "linux")]
mod pipe {
    use std::io::Write;
    use std::net::TcpStream;
    use std::time::Duration;

    use crate::error::EchoError;
    pub(super) use crate::transport::shm::pipe::{
        PipeAcks as Acks, PipeStop as Stop, PipeWriter as Writer,
    };
    use crate::transport::shm::ring::Bell;
    use crate::transport::shm::EventFd;
    use crate::transport::wire::v2;

    /// Whether this build can attach a pipe.
    pub(super) const SUPPORTED: bool = true;

    /// Rings `bell`.
    pub(super) fn ring(bell: &EventFd) {
        bell.ring();
    }

    /// Attaches the pipe `accept` offers. Without one, or when attaching fails: TCP (the
    /// server is told with `SHM_DECLINE` if it offered one), or the reason as an error when
    /// `required` (after a goodbye).
    pub(super) fn attach(
        accept: &v2::Accept,
        stream: &mut TcpStream,
        address: &str,
        required: bool,
        timeout: Duration,
    ) -> Result<Option<Writer>, EchoError> {
        let why = match &accept.shm {
            None if accept.note.is_empty() => {
                format!("the server at {address} does not offer shared memory")
            }
            None => format!("the server at {address} did not offer it: {}", accept.note),
            Some(offer) => match Writer::attach(&offer.name, &offer.nonce, timeout) {
                Ok(writer) => return Ok(Some(writer)),
                Err(why) => format!("cannot attach the shared memory of {address}: {why}"),
            },
        };
        if required {
            let _ = stream.write_all(&[v2::BYE]);
            return Err(EchoError::SharedMemory(format!("shared_memory=True: {why}")));
        }
        log::debug!("{why}; sending over TCP");
        if accept.shm.is_some() {
            stream.write_all(&[v2::SHM_DECLINE])?;
        }
        Ok(None)
    }
}

#[cfg(not(target_os = "linux"))]
mod pipe {
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    use crate::error::EchoError;
    use crate::transport::wire::v2;

    pub(super) const SUPPORTED: bool = false;

    pub(super) enum Writer {}
    pub(super) enum Acks {}
    #[allow(dead_code)] // matched on by the caller; nothing stops off Linux
    pub(super) enum Stop {
        TimedOut,
        Lost,
    }
    pub(super) struct Bell;

    impl Acks {
        pub(super) fn stored(&self) -> u64 {
            match *self {}
        }
        pub(super) fn wait_stored(
            &self,
            _: u64,
            _: Option<Instant>,
            _: &dyn Fn() -> bool,
        ) -> Result<(), Stop> {
            match *self {}
        }
    }

    impl Writer {
        pub(super) fn space_bell(&self) -> std::io::Result<Bell> {
            match *self {}
        }
        pub(super) fn acks(&self) -> std::io::Result<Acks> {
            match *self {}
        }
        pub(super) fn write_frame(
            &mut self,
            _: &[&[u8]],
            _: Option<Instant>,
            _: &dyn Fn() -> bool,
        ) -> Result<(), Stop> {
            match *self {}
        }
    }

    pub(super) fn ring(_: &Bell) {}

    pub(super) fn attach(
        _: &v2::Accept,
        _: &mut TcpStream,
        address: &str,
        required: bool,
        _: Duration,
    ) -> Result<Option<Writer>, EchoError> {
        if required {
            return Err(EchoError::SharedMemory(format!(
                "shared_memory=True: shared memory needs Linux (the server at {address})"
            )));
        }
        Ok(None)
    }
}
