//! A ragged worker's connections: dialling and the handshake ([`Dial`]), one connection's
//! socket and pipe ([`Link`]), and the thread that reads what the server sends back
//! ([`read_acks`]).

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{
    pipe, retryable, Codecs, SenderOptions, Shared, Terms, View, FIRST_PAUSE, LONGEST_PAUSE,
};
use crate::error::EchoError;
use crate::transport::wire::params;
use crate::transport::wire::v2::{self, Closing, Hello, Layout, Offer, Reply};

/// One connection: its socket, its pipe, the thread reading what the server sends.
pub(super) struct Link {
    pub(super) stream: TcpStream,
    pub(super) pipe: Option<pipe::Writer>,
    pub(super) view: View,
    pub(super) reader: Option<JoinHandle<()>>,
}

impl Link {
    /// Writes one frame (`parts`), through the pipe or the socket. A deadline is only
    /// looked at before the frame starts (the pipe's room).
    pub(super) fn write(
        &mut self,
        parts: &[&[u8]],
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        if let Some(pipe) = &mut self.pipe {
            let view = &self.view;
            return pipe.write_frame(parts, deadline, &|| view.failure().is_some()).map_err(
                |stop| match stop {
                    pipe::Stop::TimedOut => EchoError::TimedOut,
                    pipe::Stop::Lost => view.failure().unwrap_or_else(|| {
                        EchoError::Disconnected("the server closed the connection".into())
                    }),
                },
            );
        }
        // One vectored write: the header, then every leaf straight from the caller's arrays.
        let mut slices: Vec<IoSlice<'_>> =
            parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)).collect();
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            let written = match self.stream.write_vectored(rest) {
                Ok(n) => n,
                Err(e) => return Err(self.view.failure().unwrap_or(EchoError::Io(e))),
            };
            if written == 0 {
                return Err(EchoError::Disconnected("the server stopped reading".into()));
            }
            IoSlice::advance_slices(&mut rest, written);
        }
        Ok(())
    }

    /// Says goodbye (if `bye`) and closes the connection; joins its reader.
    pub(super) fn close(&mut self, bye: bool) {
        if bye {
            if let Some(pipe) = &mut self.pipe {
                // The goodbye goes through the pipe, after every frame; the learner reads
                // the pipe to its end either way once the socket closes.
                let soon = Some(Instant::now() + Duration::from_secs(1));
                let view = &self.view;
                let _ = pipe.write_frame(&[&[v2::BYE]], soon, &|| view.failure().is_some());
            } else {
                let _ = self.stream.write_all(&[v2::BYE]);
            }
        }
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
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

/// Where to connect and as what: the same for every connection of a sender.
pub(super) struct Dial {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) layout: Layout,
    pub(super) options: SenderOptions,
    /// The session id every connection of the sender presents.
    pub(super) session: [u8; 16],
    /// The address of the last attempt and why it failed, for the resolver.
    pub(super) last: Mutex<Option<(String, u16, String)>>,
    /// The latest version of the learner's parameters any connection heard announced.
    pub(super) announced: Arc<AtomicU64>,
}

impl Dial {
    /// Connects (to the address the resolver names, if there is one) and completes the
    /// handshake, presenting `first_seq` (the samples of the session seen acknowledged).
    /// Returns the connection (its view's `base` is the server's `resume_seq`: the samples
    /// of the session it has stored) and the server's largest group.
    ///
    /// # Errors
    /// As [`RaggedSender::connect`]; a resolver's error as [`EchoError::Protocol`] (not to
    /// be retried); no address yet as [`EchoError::Disconnected`].
    pub(super) fn open(&self, first_seq: u64) -> Result<(Link, Terms), EchoError> {
        let (host, port) = match &self.options.resolver {
            None => (self.host.clone(), self.port),
            Some(resolver) => {
                let last = self.last.lock().clone();
                let asked = last.as_ref().map(|(h, p, why)| (h.as_str(), *p, why.as_str()));
                match resolver.0.resolve(asked) {
                    Ok(Some(address)) => address,
                    Ok(None) => {
                        return Err(EchoError::Disconnected(
                            "no server to connect to yet (the resolver named none)".into(),
                        ))
                    }
                    Err(err) => return Err(EchoError::Protocol(err.to_string())),
                }
            }
        };
        let opened = self.open_at(&host, port, first_seq);
        *self.last.lock() = match &opened {
            Err(err) if retryable(err) => Some((host, port, err.to_string())),
            _ => None,
        };
        opened
    }

    /// [`Dial::open`], retrying a lost or refused connection (or no address yet) until
    /// `until`, with pauses doubling from [`FIRST_PAUSE`] to [`LONGEST_PAUSE`].
    pub(super) fn open_retrying(
        &self,
        first_seq: u64,
        until: Instant,
    ) -> Result<(Link, Terms), EchoError> {
        let mut pause = FIRST_PAUSE;
        let started = Instant::now();
        let mut attempt = 0u64;
        loop {
            attempt += 1;
            let err = match self.open(first_seq) {
                Ok(opened) => return Ok(opened),
                Err(err) if retryable(&err) => err,
                Err(err) => return Err(err),
            };
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let address = match self.last.lock().as_ref() {
                    Some((host, port, _)) => format!("{host}:{port}"),
                    None => format!("{}:{}", self.host, self.port),
                };
                return Err(EchoError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "could not connect to {address} within {:.1?} ({attempt} attempts; the \
                         last: {err})",
                        started.elapsed()
                    ),
                )));
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
    }

    /// [`Dial::open`] at `host:port`.
    fn open_at(&self, host: &str, port: u16, first_seq: u64) -> Result<(Link, Terms), EchoError> {
        let SenderOptions { token, timeout, shared_memory, .. } = &self.options;
        let timeout = *timeout;
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
        // A server at its connection limit says so where the offer would be.
        if received[0] == v2::ERROR {
            while received.len() < 5 {
                read_some(&mut stream, &mut received)?;
            }
            let len = u32::from_le_bytes(received[1..5].try_into().expect("4 bytes")) as usize;
            while received.len() < 5 + len.min(4096) {
                if read_some(&mut stream, &mut received).is_err() {
                    break;
                }
            }
            let end = received.len().min(5 + len);
            let why = String::from_utf8_lossy(&received[5..end]).into_owned();
            return Err(EchoError::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                format!("the server at {host}:{port} refused the connection: {why}"),
            )));
        }
        let offer = loop {
            if let Some(offer) = Offer::parse(&received)? {
                received.drain(..v2::OFFER_LEN);
                break offer;
            }
            read_some(&mut stream, &mut received)?;
        };
        let hello = Hello {
            session: self.session,
            first_seq,
            // The server beats every third of it, so that silence means a lost connection.
            heartbeat_ms: self
                .options
                .heartbeat
                .map_or(0, |t| u32::try_from(t.as_millis()).unwrap_or(u32::MAX).max(1)),
            client_nonce: v2::random()?,
            layout: self.layout.clone(),
            mac: None,
            shm: *shared_memory != Some(false) && pipe::SUPPORTED,
            notices: true,
            codecs: self.options.wire_compression,
            durable: self.options.durable.is_some(),
            params: true,
            versions: true,
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
        if self.options.durable.is_some() && !accept.durable {
            return Err(EchoError::Protocol(
                "durable=True: the server sends no persisted notices (not a ragged echo \
                 server that checkpoints)"
                    .into(),
            ));
        }
        let max_group = accept.steps.ok_or_else(|| {
            EchoError::Protocol(
                "the server accepted the layout but is not a ragged server (no group size)".into(),
            )
        })? as usize;
        let (pipe, region) = match shared_memory {
            Some(false) => (None, None),
            wanted => {
                let address = format!("{host}:{port}");
                match pipe::attach(&accept, &mut stream, &address, *wanted == Some(true), timeout)?
                {
                    Some((pipe, region)) => (Some(pipe), region.map(|r| Arc::new(Mutex::new(r)))),
                    None => (None, None),
                }
            }
        };
        // The reader waits at most the heartbeat timeout for a byte (the server beats).
        stream.set_read_timeout(self.options.heartbeat)?;
        let shared = Arc::new(Shared::default());
        let mut reading = stream.try_clone()?;
        let counting = shared.clone();
        let announced = self.announced.clone();
        let loss = pipe.as_ref().map(pipe::Writer::space_bell).transpose()?;
        let acks = pipe.as_ref().map(pipe::Writer::acks).transpose()?.map(Arc::new);
        let reader =
            std::thread::Builder::new().name("echo-ragged-acks".into()).spawn(move || {
                read_acks(&mut reading, received, &counting, &announced);
                // A send waiting for room in the pipe wakes up and sees the loss.
                if let Some(bell) = loss {
                    pipe::ring(&bell);
                }
            })?;
        // The leaves to compress: over TCP only, one codec per leaf of the frames (the
        // version leaf too, when the server keeps versions).
        let leaves = self.layout.0.len() + usize::from(accept.versions.is_some());
        let codecs: Codecs = match accept.codecs {
            Some(codecs) if pipe.is_none() => {
                if codecs.len() != leaves {
                    return Err(EchoError::Protocol(format!(
                        "the server named codecs for {} leaves; this worker's frames have {leaves}",
                        codecs.len()
                    )));
                }
                codecs.into()
            }
            _ => Arc::from(Vec::new()),
        };
        let view = View { shared, acks, base: accept.resume_seq, codecs, region };
        let terms = Terms { max_group, versions: accept.versions, replay: accept.replay };
        Ok((Link { stream, pipe, view, reader: Some(reader) }, terms))
    }
}

/// The reader thread: acknowledgements, heartbeats, an error or a closing notice.
pub(super) fn read_acks(
    stream: &mut TcpStream,
    mut pending: Vec<u8>,
    shared: &Shared,
    announced: &AtomicU64,
) {
    let mut chunk = [0u8; 4096];
    loop {
        let mut at = 0;
        let mut acks = 0u64;
        let mut persisted = 0u64;
        let mut stop = None;
        while at < pending.len() {
            match pending[at] {
                v2::ACK => {
                    acks += 1;
                    at += 1;
                }
                v2::BEAT => at += 1,
                params::VERSION => match params::parse_version(&pending[at..]) {
                    Some(version) => {
                        // ORDERING: Relaxed — a version read on its own by the sender.
                        announced.fetch_max(version, Ordering::Relaxed);
                        at += params::VERSION_LEN;
                    }
                    None => break, // the rest of the notice is on its way
                },
                params::CHUNK | params::PACKED => match chunk_answer(&pending[at..], shared) {
                    Ok(Some(used)) => at += used,
                    Ok(None) => break, // the rest of the chunk is on its way
                    Err(err) => {
                        stop = Some(Ok(err.to_string()));
                        break;
                    }
                },
                v2::PERSISTED => match v2::parse_persisted(&pending[at..]) {
                    Some(seq) => {
                        persisted = persisted.max(seq);
                        at += v2::PERSISTED_LEN;
                    }
                    None => break, // the rest of the notice is on its way
                },
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
            state.persisted = state.persisted.max(persisted);
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
            Ok(0) => break,
            Ok(n) => pending.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                // Not even a heartbeat within the timeout: a half-open connection.
                let silent = stream.read_timeout().ok().flatten();
                shared.state.lock().silent = silent;
                let _ = stream.shutdown(Shutdown::Both);
                break;
            }
            Err(_) => break,
        }
    }
    shared.state.lock().ended = true;
    shared.changed.notify_all();
}

/// Reads the answer to the oldest fetch asked on the connection, at the start of `bytes`,
/// when all of it is there: kept with the fetch's id for the one waiting for it. Returns
/// the bytes it took.
///
/// # Errors
/// [`EchoError::Protocol`] for a chunk nobody asked for, or one that is not what was asked
/// (another size, offset or length: see [`params::Chunk::parse`]).
fn chunk_answer(bytes: &[u8], shared: &Shared) -> Result<Option<usize>, EchoError> {
    let mut state = shared.state.lock();
    let Some(&(id, asked, size)) = state.fetch.asked.front() else {
        return Err(EchoError::Protocol("a parameter chunk nobody asked for".into()));
    };
    let Some(chunk) = params::Chunk::parse(bytes, &asked, size)? else { return Ok(None) };
    let header = chunk.header_len();
    let body = if chunk.len > 0 { chunk.wire_len() } else { 0 };
    let Some(data) = bytes.get(header..header + body) else { return Ok(None) };
    state.fetch.asked.pop_front();
    state.fetch.answers.push_back((id, chunk, data.to_vec()));
    Ok(Some(header + body))
}
