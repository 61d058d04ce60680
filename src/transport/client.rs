//! A blocking TCP client for rollout workers: connect, negotiate wire v1 or v2, stream samples.
//!
//! Each sample goes out with one vectored write straight from the caller's leaf buffers (no
//! joined copy), unless the client reconnects: then it keeps a copy of every unacknowledged
//! sample to send again. A background thread reads the acks and counts them (and, on v2,
//! sends heartbeats and watches the server's); `send` blocks while `max_inflight` samples are
//! unacknowledged, and `wait` until every sample is. When the server goes away, every blocked
//! call returns [`EchoError::Disconnected`] promptly, or, with reconnection on, blocks while
//! the client reconnects and resends.
//!
//! Negotiation ([`super::wire::v2`]): an echo server greets with the v1 handshake and then a
//! v2 offer (or the offer alone when it has a token); id-echo 0.2.1 sends the handshake
//! alone. With [`Protocol::Auto`] the client waits [`OFFER_GRACE`] after a v1 handshake for
//! an offer; without one it speaks v1, so it never writes a v2 byte to a v1 server.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::wire::v2::{self, Beat, Closing, FrameMeta, Hello, Layout, Mode, Offer, Reply};
use super::wire::{parse_handshake, ACK, MAGIC};
use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::source::{Leaves, Rows, SampleSource};
use crate::spec::DataSpec;
use crate::sync::{Arc, AtomicBool, AtomicU64, AtomicU8, Signal};

use std::sync::atomic::Ordering::{Acquire, Release};

#[cfg(target_os = "linux")]
use super::shm::{EventFd as LossBell, Writer as ShmWriter};
#[cfg(not(target_os = "linux"))]
use no_shm::{LossBell, ShmWriter};

/// Stand-ins where there is no shared-memory path: never constructed.
#[cfg(not(target_os = "linux"))]
mod no_shm {
    use std::time::Instant;

    pub(super) enum ShmWriter {}
    pub(super) enum LossBell {}

    impl ShmWriter {
        pub(super) fn taken(&self) -> u64 {
            match *self {}
        }
        pub(super) fn committed(&self) -> u64 {
            match *self {}
        }
        pub(super) fn slots(&self) -> usize {
            match *self {}
        }
        pub(super) fn try_send(&mut self, _: &[&[u8]], _: &super::FrameMeta) -> bool {
            match *self {}
        }
        pub(super) fn wait_taken(&self, _: u64, _: Instant) -> bool {
            match *self {}
        }
    }

    impl crate::transport::shm::ring::Bell for LossBell {
        fn ring(&self) {
            match *self {}
        }
    }
}

/// How long a client in [`Protocol::Auto`] waits after a v1 handshake for a v2 offer. An echo
/// server writes both at once, so only a lost segment delays the offer this long.
pub const OFFER_GRACE: Duration = Duration::from_millis(100);
/// How long a client waits on the shared-memory space bell before it checks its deadline and
/// the connection again.
const SHM_SLICE: Duration = Duration::from_millis(50);
/// The most iovecs one vectored write takes (Linux's `IOV_MAX`).
const MAX_IOVECS: usize = 1024;
/// How long one blocking write may take before `send` checks its deadline again.
const WRITE_SLICE: Duration = Duration::from_millis(50);
/// How long [`TcpSender::connect`] waits in one [`Connecting::poll`].
const CONNECT_SLICE: Duration = Duration::from_millis(50);
/// First and largest pause between reconnection attempts (each is jittered to 50-100%).
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Which wire protocol to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// v2 when the server offers it, else v1.
    Auto,
    /// v1 only (as id-echo 0.2.1).
    V1,
    /// v2 only.
    V2,
}

/// Whether to send through same-host shared memory (see [`super::shm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedMemory {
    /// TCP only.
    Off,
    /// Shared memory when the server offers it (same host, v2, Linux), else TCP.
    Auto,
    /// Shared memory or an [`EchoError::SharedMemory`] saying why not.
    Required,
}

/// A client's settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Server host.
    pub host: String,
    /// Server port.
    pub port: u16,
    /// Our samples: dtypes, names, shapes.
    pub layout: Layout,
    /// Unacknowledged samples allowed before `send` waits.
    pub max_inflight: u64,
    /// Which protocol to speak.
    pub protocol: Protocol,
    /// The shared secret to prove (v2); `None`: none.
    pub token: Option<Vec<u8>>,
    /// The server is dead after this long without a byte from it (v2); `None`: never.
    pub heartbeat_timeout: Option<Duration>,
    /// Reconnect (v2) for up to this long after the connection drops; `None`: do not.
    pub reconnect_timeout: Option<Duration>,
    /// Whether to send through same-host shared memory.
    pub shared_memory: SharedMemory,
    /// Where to connect, asked before every connection attempt (the first and each
    /// reconnection) when set: `host` and `port` are then only its fallback. A client follows
    /// a server that moves this way (a learner restarted on another node and port).
    pub resolver: Option<Resolver>,
    /// How the client names itself in its log lines (besides the server's address).
    pub name: Option<String>,
    /// Compress the leaves the server names in its reply (v2 over TCP; never over shared
    /// memory, which copies raw).
    pub wire_compression: bool,
}

/// Where a client connects next ([`ClientConfig::resolver`]).
pub trait Resolve: Send + Sync {
    /// The address to try now. `last` is the address of the previous attempt or connection
    /// and why it ended (`None` before the first attempt). `Ok(None)`: no server to try yet;
    /// the client backs off and asks again until its deadline.
    ///
    /// # Errors
    /// Any error ends the client's attempts: it becomes the error of the call that was
    /// connecting (the first connect, or the `send`/`wait` that was reconnecting).
    fn resolve(&self, last: Option<(&str, u16, &str)>) -> Result<Option<(String, u16)>, EchoError>;
}

/// A shared [`Resolve`] (cloned with the settings).
#[derive(Clone)]
pub struct Resolver(pub std::sync::Arc<dyn Resolve>);

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolver(..)")
    }
}

impl ClientConfig {
    /// Settings for `host:port` sending samples of `layout`, with the defaults: 32 in
    /// flight, [`Protocol::Auto`], no token, 10 s heartbeat timeout, no reconnection, TCP
    /// only ([`SharedMemory::Off`]; the Python client defaults to `Auto`).
    pub fn new(host: impl Into<String>, port: u16, layout: Layout) -> Self {
        Self {
            host: host.into(),
            port,
            layout,
            max_inflight: 32,
            protocol: Protocol::Auto,
            token: None,
            heartbeat_timeout: Some(Duration::from_secs(10)),
            reconnect_timeout: None,
            shared_memory: SharedMemory::Off,
            resolver: None,
            name: None,
            wire_compression: true,
        }
    }

    /// Whether the hello asks for shared memory: not on v1, only on Linux. With reconnection
    /// too: each new connection asks again, and the copies kept for resending go through
    /// whichever path it has.
    fn wants_shm(&self) -> bool {
        self.shared_memory != SharedMemory::Off
            && self.protocol != Protocol::V1
            && cfg!(target_os = "linux")
    }

    /// Whether a failed first connection is tried again (until the deadline): with
    /// reconnection (the server may not be up yet) or a resolver (it may know none yet).
    fn retries(&self) -> bool {
        self.reconnect_timeout.is_some() || self.resolver.is_some()
    }

    /// How log lines name this client talking to `address`: `name (address)`, or the address.
    fn who(&self, address: &str) -> String {
        match &self.name {
            Some(name) => format!("{name} ({address})"),
            None => address.to_owned(),
        }
    }

    fn validate(&self) -> Result<(), EchoError> {
        if self.max_inflight == 0 {
            return Err(EchoError::Config(
                "the in-flight window must allow at least 1 sample, got 0".into(),
            ));
        }
        if self.token.as_ref().is_some_and(Vec::is_empty) {
            return Err(EchoError::Config("the token must not be empty".into()));
        }
        if self.protocol == Protocol::V1 && self.token.is_some() {
            return Err(EchoError::Config(
                "a token needs wire protocol 2 (protocol=1 cannot prove it)".into(),
            ));
        }
        if self.protocol == Protocol::V1 && self.reconnect_timeout.is_some() {
            return Err(EchoError::Config(
                "reconnecting needs wire protocol 2 (v1 has no sequence numbers to resume from)"
                    .into(),
            ));
        }
        if self.shared_memory == SharedMemory::Required {
            let why = if !cfg!(target_os = "linux") {
                Some("the shared-memory path is Linux-only")
            } else if self.protocol == Protocol::V1 {
                Some("shared memory needs wire protocol 2 (protocol=1 cannot negotiate it)")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(EchoError::SharedMemory(format!("shared_memory=True: {why}")));
            }
        }
        self.layout.spec().map(drop)
    }
}

/// Ack bookkeeping of one connection, shared with its reader thread.
#[derive(Default)]
struct Acks {
    /// Acknowledgements received on this connection.
    acked: AtomicU64,
    /// Set (with `reason`) when the connection is gone.
    lost: AtomicBool,
    /// Set with `lost` when reconnecting would not help (the server refused what we sent).
    fatal: AtomicBool,
    /// The [`v2::Closing`] reason the server gave before it closed (0: none).
    closing: AtomicU8,
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

    fn reason(&self) -> String {
        self.reason.lock().clone()
    }
}

/// What the writer and the heartbeat (on the reader thread) share.
struct Writing {
    /// A frame is partly written: no heartbeat may go in between.
    mid_frame: bool,
    last_write: Instant,
}

/// One established connection.
struct Link {
    stream: TcpStream,
    /// 1 or 2.
    version: u8,
    /// Sequence number of the first sample sent on this connection.
    base: u64,
    acks: Arc<Acks>,
    writing: Arc<Mutex<Writing>>,
    reader: Option<JoinHandle<()>>,
    /// The shared-memory channel samples go through, if one was attached.
    shm: Option<ShmWriter>,
    /// The leaves this connection sends compressed (v2 over TCP, as the reply named them).
    codecs: Option<Arc<LeafCodecs>>,
}

impl Link {
    fn acked_total(&self) -> u64 {
        // On shared memory "acknowledged" is "taken by the server": it copied the sample
        // into its queue, as a TCP ack says.
        self.base + self.shm.as_ref().map_or_else(|| self.acks.acked(), ShmWriter::taken)
    }

    /// Closes the socket and joins the reader.
    fn shut(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shut();
    }
}

/// What a finished handshake gives.
struct Established {
    stream: TcpStream,
    version: u8,
    spec: DataSpec,
    accept: Option<v2::Accept>,
    /// Bytes received after the handshake (acks or heartbeats), for the reader.
    leftover: Vec<u8>,
    /// v1 by [`Protocol::Auto`]'s choice: a late offer is possible and skipped.
    skip_offer: bool,
    /// The shared-memory channel attached during the handshake.
    shm: Option<ShmWriter>,
}

/// A connection being opened ([`TcpSender::connecting`]). Each [`Connecting::poll`] waits at
/// most until the time it is given, so a caller can check for interrupts (Ctrl-C) between
/// polls; the deadline given to `connecting` bounds the whole connect and handshake. Dropping
/// it abandons the connect (its thread ends on its own, at the latest at the deadline).
pub struct Connecting {
    config: Arc<ClientConfig>,
    /// Where this attempt connects, and the same as `host:port`.
    target: (String, u16),
    address: String,
    started: Instant,
    deadline: Option<Instant>,
    session: [u8; 16],
    first_seq: u64,
    /// The result of the TCP connect, from its thread.
    connected: Receiver<io::Result<TcpStream>>,
    /// Connected, negotiating.
    stream: Option<TcpStream>,
    /// Bytes received and not yet used.
    received: Vec<u8>,
    /// When the v1 handshake was complete (Auto and V2 then wait for an offer).
    v1_at: Option<Instant>,
    /// The v2 hello we sent and the offer it answers, once sent.
    sent_hello: Option<(Offer, Hello)>,
}

impl Connecting {
    fn start(
        config: Arc<ClientConfig>,
        target: (String, u16),
        session: [u8; 16],
        first_seq: u64,
        deadline: Option<Instant>,
    ) -> Result<Self, EchoError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let address = format!("{}:{}", target.0, target.1);
        // std has no non-blocking connect: it runs on a short-lived thread of its own, bounded
        // by `deadline`, and `poll` waits for its result in slices.
        let (host, port) = target.clone();
        thread::Builder::new().name("echo-client-connect".into()).spawn(move || {
            let _ = tx.send(open_stream(&host, port, deadline));
        })?;
        Ok(Self {
            address,
            target,
            config,
            started: Instant::now(),
            deadline,
            session,
            first_seq,
            connected: rx,
            stream: None,
            received: Vec::new(),
            v1_at: None,
            sent_hello: None,
        })
    }

    /// Waits until `until` (or the deadline, if sooner) for the connection and the handshake.
    /// `Ok(None)`: not yet, call again.
    ///
    /// # Errors
    /// [`EchoError::Io`] if connecting fails (`TimedOut` once the deadline passes, naming
    /// what was missing); [`EchoError::Protocol`] if the peer is not an echo server (from its
    /// first wrong byte on), speaks only v1 when v2 is required, or refuses our layout;
    /// [`EchoError::Auth`] for a token problem; [`EchoError::Disconnected`] if it closes the
    /// connection during the handshake (an echo server at `max_connections` does that).
    pub fn poll(&mut self, until: Instant) -> Result<Option<TcpSender>, EchoError> {
        Ok(self.poll_established(until)?.map(|est| TcpSender::from_established(self, est)))
    }

    fn poll_established(&mut self, until: Instant) -> Result<Option<Established>, EchoError> {
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
        loop {
            if let Some(done) = self.advance()? {
                return Ok(Some(done));
            }
            // Wait for more bytes, at most until `until` (or the end of the offer grace).
            let mut wait_until = until;
            if let Some(at) = self.v1_at {
                wait_until = wait_until.min(at + OFFER_GRACE);
            }
            let wait = wait_until.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                if self.v1_at.is_some_and(|at| at.elapsed() >= OFFER_GRACE) {
                    continue; // `advance` decides: no offer came.
                }
                return self.not_yet("sent no complete echo handshake");
            }
            let stream = self.stream.as_mut().expect("connected above");
            stream.set_read_timeout(Some(wait))?;
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(EchoError::Disconnected(format!(
                        "{} closed the connection during the handshake (too many connections?)",
                        self.address
                    )))
                }
                Ok(n) => self.received.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Takes the negotiation as far as the bytes received allow.
    fn advance(&mut self) -> Result<Option<Established>, EchoError> {
        if self.sent_hello.is_some() {
            return self.read_reply();
        }
        let received = &self.received;
        // A server with a token sends its offer alone.
        if received.len() > 4 && received[..4] == MAGIC[..] && received[4] == v2::VERSION {
            let Some(offer) = Offer::parse(received)? else { return Ok(None) };
            self.check_nothing_after(v2::OFFER_LEN, "its offer")?;
            if self.config.protocol == Protocol::V1 {
                return Err(EchoError::Auth(format!(
                    "the server at {} requires a token and wire protocol 2; this client was \
                     created with protocol=1",
                    self.address
                )));
            }
            return self.answer(offer);
        }
        let Some((spec, len)) = parse_handshake(received)? else { return Ok(None) };
        let rest = &received[len..];
        if rest.is_empty() {
            let at = *self.v1_at.get_or_insert_with(Instant::now);
            if self.config.protocol == Protocol::V1 {
                return self.speak_v1(spec, len, true);
            }
            if at.elapsed() < OFFER_GRACE {
                return Ok(None);
            }
            if self.config.protocol == Protocol::V2 {
                return Err(EchoError::Protocol(format!(
                    "the server at {} speaks only wire protocol 1 (id-echo 0.2.1 or older), \
                     and this client requires protocol 2",
                    self.address
                )));
            }
            return self.speak_v1(spec, len, true);
        }
        let parsed = Offer::parse(rest).map_err(|e| {
            EchoError::Protocol(format!(
                "{} sent {} bytes after its handshake that are not an echo v2 offer ({e}): not an \
                 echo server",
                self.address,
                rest.len()
            ))
        })?;
        let Some(offer) = parsed else { return Ok(None) };
        self.check_nothing_after(len + v2::OFFER_LEN, "its offer")?;
        if self.config.protocol == Protocol::V1 {
            return self.speak_v1(spec, len + v2::OFFER_LEN, false);
        }
        self.answer(offer)
    }

    fn check_nothing_after(&self, len: usize, what: &str) -> Result<(), EchoError> {
        if self.received.len() > len {
            return Err(EchoError::Protocol(format!(
                "{} sent {} bytes after {what}, before any sample: not an echo server",
                self.address,
                self.received.len() - len
            )));
        }
        Ok(())
    }

    /// Settles on v1 with the server's handshake (`len` bytes of greeting consumed).
    fn speak_v1(
        &mut self,
        spec: DataSpec,
        len: usize,
        skip_offer: bool,
    ) -> Result<Option<Established>, EchoError> {
        if self.config.token.is_some() {
            return Err(EchoError::Auth(format!(
                "the server at {} speaks only wire protocol 1 and cannot check the token this \
                 client has (unset ECHO_TOKEN or token= to send to it)",
                self.address
            )));
        }
        check_v1_layout(&self.config.layout, &spec, &self.address)?;
        if self.config.reconnect_timeout.is_some() {
            log::warn!(
                "{}: the server speaks only wire protocol 1; this client will not reconnect",
                self.address
            );
        }
        if self.config.shared_memory == SharedMemory::Required {
            return Err(EchoError::SharedMemory(format!(
                "shared_memory=True: the server at {} speaks only wire protocol 1 (id-echo \
                 0.2.1, or an old echo), which has no shared-memory path",
                self.address
            )));
        }
        let leftover = self.received.split_off(len);
        let stream = self.stream.take().expect("connected");
        Ok(Some(Established {
            stream,
            version: 1,
            spec,
            accept: None,
            leftover,
            skip_offer,
            shm: None,
        }))
    }

    /// Sends our hello in answer to `offer`.
    fn answer(&mut self, offer: Offer) -> Result<Option<Established>, EchoError> {
        if offer.mode == Mode::Token && self.config.token.is_none() {
            return Err(EchoError::Auth(format!(
                "the server at {} requires a token: pass token= or set ECHO_TOKEN",
                self.address
            )));
        }
        let hello = Hello {
            session: self.session,
            first_seq: self.first_seq,
            heartbeat_ms: self
                .config
                .heartbeat_timeout
                .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)),
            client_nonce: v2::random()?,
            layout: self.config.layout.clone(),
            mac: None,
            shm: self.config.wants_shm(),
            notices: true,
            codecs: self.config.wire_compression,
        };
        let bytes = hello.encode(&offer, self.config.token.as_deref())?;
        let stream = self.stream.as_mut().expect("connected");
        let left = self.deadline.map(|d| d.saturating_duration_since(Instant::now()));
        stream.set_write_timeout(left.map(|l| l.max(Duration::from_millis(1))))?;
        stream.write_all(&bytes)?;
        self.received.clear();
        self.sent_hello = Some((offer, hello));
        self.read_reply()
    }

    fn read_reply(&mut self) -> Result<Option<Established>, EchoError> {
        let Some((reply, len)) = Reply::parse(&self.received)? else { return Ok(None) };
        let (offer, hello) = self.sent_hello.as_ref().expect("hello sent");
        let accept = match reply {
            Reply::Refused(why, message) => return Err(why.into_error(message)),
            Reply::Accepted(accept) => accept,
        };
        if let Some(token) = &self.config.token {
            if accept.mac.is_none() {
                return Err(EchoError::Auth(format!(
                    "the server at {} did not prove the token: it has none (set ECHO_TOKEN for \
                     the learner too, or unset it for this client)",
                    self.address
                )));
            }
            if !accept.verify(token, hello, offer) {
                return Err(EchoError::Auth(format!(
                    "the server at {} does not know this client's token",
                    self.address
                )));
            }
        }
        if accept.resume_seq < self.first_seq {
            return Err(EchoError::Protocol(format!(
                "the server at {} resumed at sample {} before the {} acknowledged",
                self.address, accept.resume_seq, self.first_seq
            )));
        }
        let spec = self.config.layout.spec()?;
        if let Some(codecs) = &accept.codecs {
            LeafCodecs::new(&spec, codecs.clone()).map_err(|e| {
                EchoError::Protocol(format!(
                    "the server at {} names codecs this layout cannot take: {e}",
                    self.address
                ))
            })?;
        }
        let shm = self.attach_shm(&accept, spec.payload_size())?;
        let leftover = self.received.split_off(len);
        let stream = self.stream.take().expect("connected");
        Ok(Some(Established {
            stream,
            version: 2,
            spec,
            accept: Some(accept),
            leftover,
            skip_offer: false,
            shm,
        }))
    }

    /// Attaches the shared memory the server offered, if we asked for it. When it is not
    /// offered, or attaching fails: TCP ([`SharedMemory::Auto`]; the server is told with
    /// `SHM_DECLINE`), or the reason as an error ([`SharedMemory::Required`]; the session
    /// ends with a goodbye).
    fn attach_shm(
        &mut self,
        accept: &v2::Accept,
        payload_size: usize,
    ) -> Result<Option<ShmWriter>, EchoError> {
        if !self.config.wants_shm() {
            return Ok(None);
        }
        let required = self.config.shared_memory == SharedMemory::Required;
        let why = match &accept.shm {
            None if accept.note.is_empty() => format!(
                "the server at {} does not offer shared memory (an echo server without it)",
                self.address
            ),
            None => format!("the server at {} did not offer it: {}", self.address, accept.note),
            Some(offer) => {
                let left = self
                    .deadline
                    .map_or(SHM_ATTACH_TIMEOUT, |d| d.saturating_duration_since(Instant::now()));
                match attach(offer, payload_size, left) {
                    Ok(writer) => return Ok(Some(writer)),
                    Err(why) => {
                        format!("cannot attach the shared memory of {}: {why}", self.address)
                    }
                }
            }
        };
        let stream = self.stream.as_mut().expect("connected");
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

    /// `Ok(None)` before the deadline; after it, a `TimedOut` error saying what was missing.
    fn not_yet<T>(&self, what: &str) -> Result<Option<T>, EchoError> {
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

/// How long attaching a shared-memory channel may take without a connect deadline.
const SHM_ATTACH_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(target_os = "linux")]
fn attach(
    offer: &v2::ShmOffer,
    payload_size: usize,
    timeout: Duration,
) -> Result<ShmWriter, String> {
    ShmWriter::attach(&offer.name, &offer.nonce, payload_size, timeout)
}

#[cfg(not(target_os = "linux"))]
fn attach(_: &v2::ShmOffer, _: usize, _: Duration) -> Result<ShmWriter, String> {
    Err("the shared-memory path is Linux-only".into())
}

/// A v1 server's handshake must describe our samples: same count, element sizes and shapes
/// (v1 carries no dtypes or names).
fn check_v1_layout(ours: &Layout, theirs: &DataSpec, address: &str) -> Result<(), EchoError> {
    let mismatch = |detail: String| {
        EchoError::Protocol(format!(
            "the server at {address} stores samples of another layout: {detail}"
        ))
    };
    if theirs.len() != ours.0.len() {
        return Err(mismatch(format!(
            "it has {} leaves, data_sample has {}",
            theirs.len(),
            ours.0.len()
        )));
    }
    for (mine, server) in ours.0.iter().zip(theirs.arrays()) {
        if mine.shape != server.shape() || mine.dtype.size as usize != server.dtype_size() {
            return Err(mismatch(format!(
                "leaf {}: server expects shape {:?} with {}-byte elements, data_sample has shape \
                 {:?} with {}-byte elements",
                mine.name,
                server.shape(),
                server.dtype_size(),
                mine.shape,
                mine.dtype.size
            )));
        }
    }
    Ok(())
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
            // Nobody listens on a port of this host inside the ephemeral range (a learner
            // restarting on its old port, say): the kernel may pick that very port as our
            // source port and connect the socket to itself (TCP simultaneous open). It would
            // then wait for a handshake that never comes; it is a refused connection.
            Ok(stream) if is_self_connected(&stream) => {
                last_err = Some(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    "nobody listens there (the socket connected to itself)",
                ));
            }
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

/// Whether `stream`'s two ends are the same address (see `open_stream`).
fn is_self_connected(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(local), Ok(peer)) if local == peer)
}

/// A first connection being made ([`TcpSender::connecting`]).
///
/// Without retries it is one [`Connecting`] attempt, whose error is the connect's. A client
/// that reconnects, or has a resolver, also retries its first connection: a worker started
/// before its learner listens (or before any learner is registered) waits for it. Refused,
/// reset or timed-out attempts and closed handshakes are tried again after the reconnection
/// backoff, asking the resolver each time, until the deadline; then the error is a
/// `TimedOut` one naming the last address and why it failed. Errors that another attempt
/// would only repeat (a layout, token or protocol refusal, `SharedMemory::Required` not
/// met, the resolver's own) end it at once.
pub struct Dialing {
    config: Arc<ClientConfig>,
    session: [u8; 16],
    retry: bool,
    started: Instant,
    deadline: Option<Instant>,
    attempt_timeout: Option<Duration>,
    /// Failed attempts so far.
    attempt: u32,
    next_try: Instant,
    current: Option<Connecting>,
    /// The previous attempt's address and why it failed.
    last: Option<((String, u16), String)>,
}

impl Dialing {
    /// Waits until `until` (or the deadline, if sooner) for a connection. `Ok(None)`: not
    /// yet, call again.
    ///
    /// # Errors
    /// As [`Connecting::poll`]; with retries, a `TimedOut` [`EchoError::Io`] once the
    /// deadline passes, and whatever the resolver returned.
    pub fn poll(&mut self, until: Instant) -> Result<Option<TcpSender>, EchoError> {
        loop {
            let now = Instant::now();
            let until = self.deadline.map_or(until, |d| d.min(until));
            let Some(connecting) = &mut self.current else {
                if self.deadline.is_some_and(|d| now >= d) && self.last.is_some() {
                    return Err(self.timed_out());
                }
                if now < self.next_try {
                    if now >= until {
                        return Ok(None);
                    }
                    thread::sleep(self.next_try.min(until) - now);
                    continue;
                }
                let last = self.last.as_ref().map(|((h, p), why)| (h.as_str(), *p, why.as_str()));
                let target = match &self.config.resolver {
                    None => Some((self.config.host.clone(), self.config.port)),
                    Some(resolver) => resolver.0.resolve(last)?,
                };
                let Some(target) = target else {
                    let fallback = (self.config.host.clone(), self.config.port);
                    let target = self.last.take().map_or(fallback, |(target, _)| target);
                    self.failed(target, "no server to connect to yet".into());
                    continue;
                };
                let mut deadline = self.deadline;
                if self.retry {
                    if let Some(each) = self.attempt_timeout {
                        let end = now.checked_add(each);
                        deadline = match (deadline, end) {
                            (Some(d), Some(e)) => Some(d.min(e)),
                            (d, e) => d.or(e),
                        };
                    }
                }
                let config = Arc::clone(&self.config);
                self.current = Some(Connecting::start(config, target, self.session, 0, deadline)?);
                continue;
            };
            match connecting.poll_established(until) {
                Ok(None) if Instant::now() < until => {}
                Ok(None) => return Ok(None),
                Ok(Some(est)) => return Ok(Some(TcpSender::from_established(connecting, est))),
                Err(err @ (EchoError::Io(_) | EchoError::Disconnected(_))) if self.retry => {
                    let target = connecting.target.clone();
                    self.current = None;
                    self.failed(target, err.to_string());
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Records a failed attempt at `target` and when to try again.
    fn failed(&mut self, target: (String, u16), why: String) {
        self.attempt += 1;
        let address = format!("{}:{}", target.0, target.1);
        log::debug!("{}: connecting failed ({why}); trying again", self.config.who(&address));
        self.last = Some((target, why));
        self.next_try = Instant::now() + backoff(self.attempt);
    }

    fn timed_out(&self) -> EchoError {
        let (address, why) = match &self.last {
            Some(((host, port), why)) => (format!("{host}:{port}"), why.as_str()),
            None => (format!("{}:{}", self.config.host, self.config.port), "no attempt"),
        };
        EchoError::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "could not connect to {address} within {:.1?} ({} attempts; the last: {why})",
                self.started.elapsed(),
                self.attempt
            ),
        ))
    }
}

/// A sample kept until it is acknowledged, to send again after a reconnect.
struct Retained {
    /// The frame's bytes: header, then payload.
    frame: Box<[u8]>,
}

/// A reconnection in progress.
struct Recovery {
    since: Instant,
    attempt: u32,
    next_try: Instant,
    connecting: Option<Connecting>,
    last_error: String,
}

/// A connection to an echo server.
pub struct TcpSender {
    config: Arc<ClientConfig>,
    /// The server's address (the last one connected to, or being reconnected to), and the
    /// same as `host:port` for messages.
    target: (String, u16),
    address: String,
    spec: DataSpec,
    session: [u8; 16],
    /// The connection; `None` while reconnecting, or after `close`.
    link: Option<Link>,
    version: u8,
    replay: bool,
    /// `Some(max_rows)` when the server is a sequence table (it takes step frames).
    steps: Option<u32>,
    /// Samples accepted by `send` (the sequence number of the next one).
    sent: u64,
    /// Samples wholly written on the current connection (retention only; else `sent`).
    written: u64,
    /// Bytes of the frame at `written` (or of the sample being sent) already written.
    in_progress: usize,
    /// Acknowledged samples of past connections (their total when the last one dropped).
    acked_floor: u64,
    /// With reconnection: every sample from `retained_base` to `sent`, as frames.
    retained: VecDeque<Retained>,
    retained_base: u64,
    /// Buffers of acknowledged frames, reused by the next retained ones.
    spare: Vec<Box<[u8]>>,
    reconnect: bool,
    recovery: Option<Recovery>,
    /// Why the client can no longer send (reconnection gave up, or was never on).
    failed: Option<String>,
    /// `failed` because the server closed for good (with reconnection on, which then stops).
    final_close: bool,
    /// What the server's last closing notice said, if one came.
    server_closing: Option<Closing>,
    closed: bool,
    reconnects: u64,
    resent: u64,
    /// A sample accepted into `retained` by a `send` that returned before it was written.
    carry: bool,
    /// Whether samples go through shared memory.
    shm: bool,
    /// The compressed frame being written (from byte `in_progress` on), when the connection
    /// sends compressed frames; kept across calls so a stalled write finishes the same bytes.
    packing: Vec<u8>,
}

impl TcpSender {
    /// Connects, negotiates and starts the ack reader, all within `timeout`.
    ///
    /// # Errors
    /// As [`TcpSender::connecting`] and [`Connecting::poll`].
    pub fn connect(config: ClientConfig, timeout: Duration) -> Result<Self, EchoError> {
        let mut dialing = Self::connecting(config, Instant::now().checked_add(timeout), None)?;
        loop {
            if let Some(sender) = dialing.poll(Instant::now() + CONNECT_SLICE)? {
                return Ok(sender);
            }
        }
    }

    /// Starts connecting; drive it with [`Dialing::poll`] until it returns the client.
    /// `deadline` bounds everything (name resolution, the TCP connect, the whole handshake,
    /// and with retries every attempt and pause); `None` waits as long as it takes.
    /// `attempt_timeout` bounds each attempt when the client retries (with reconnection or a
    /// resolver, see [`Dialing`]); `None`: each may take until the deadline.
    ///
    /// # Errors
    /// [`EchoError::Config`] for bad settings.
    pub fn connecting(
        config: ClientConfig,
        deadline: Option<Instant>,
        attempt_timeout: Option<Duration>,
    ) -> Result<Dialing, EchoError> {
        config.validate()?;
        let now = Instant::now();
        Ok(Dialing {
            retry: config.retries(),
            config: Arc::new(config),
            session: v2::random()?,
            started: now,
            deadline,
            attempt_timeout,
            attempt: 0,
            next_try: now,
            current: None,
            last: None,
        })
    }

    fn from_established(connecting: &Connecting, est: Established) -> Self {
        let config = Arc::clone(&connecting.config);
        let reconnect = est.version == 2 && config.reconnect_timeout.is_some();
        let replay = est.accept.as_ref().is_some_and(|a| a.replay);
        let steps = est.accept.as_ref().and_then(|a| a.steps);
        let mut sender = Self {
            target: connecting.target.clone(),
            address: connecting.address.clone(),
            spec: est.spec.clone(),
            session: connecting.session,
            link: None,
            version: est.version,
            replay,
            steps,
            sent: 0,
            written: 0,
            in_progress: 0,
            acked_floor: 0,
            retained: VecDeque::new(),
            retained_base: 0,
            spare: Vec::new(),
            reconnect,
            recovery: None,
            failed: None,
            final_close: false,
            server_closing: None,
            closed: false,
            reconnects: 0,
            resent: 0,
            carry: false,
            shm: est.shm.is_some(),
            packing: Vec::new(),
            config,
        };
        match sender.install(est) {
            Ok(()) => {}
            Err(err) => sender.failed = Some(err.to_string()),
        }
        sender
    }

    /// Starts the reader on an established connection and makes it the current one.
    fn install(&mut self, est: Established) -> Result<(), EchoError> {
        let Established { stream, version, accept, leftover, skip_offer, shm, .. } = est;
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(Some(WRITE_SLICE))?;
        let base = accept.as_ref().map_or(0, |a| a.resume_seq);
        let beat =
            accept.as_ref().and_then(|a| Beat::new(self.config.heartbeat_timeout, a.heartbeat_ms));
        let acks = Arc::new(Acks::default());
        let writing =
            Arc::new(Mutex::new(Writing { mid_frame: false, last_write: Instant::now() }));
        let reader = {
            let mut reading = Reading {
                stream: stream.try_clone()?,
                acks: Arc::clone(&acks),
                writing: Arc::clone(&writing),
                beat,
                version,
                skip_offer,
                pending: leftover,
                last_heard: Instant::now(),
                wake_on_loss: match &shm {
                    Some(writer) => Some(loss_bell(writer)?),
                    None => None,
                },
            };
            thread::Builder::new().name("echo-client-acks".into()).spawn(move || reading.run())?
        };
        self.shm = shm.is_some();
        // Compressed frames only over TCP, and only if we asked (the reply names codecs only
        // then, but a server may be wrong).
        let codecs = match (accept.and_then(|a| a.codecs), &shm) {
            (Some(codecs), None) if self.config.wire_compression => {
                Some(Arc::new(LeafCodecs::new(&self.spec, codecs)?))
                    .filter(|codecs| codecs.max_body() <= u32::MAX as usize)
            }
            _ => None,
        };
        self.link =
            Some(Link { stream, version, base, acks, writing, reader: Some(reader), shm, codecs });
        Ok(())
    }

    /// The server's sample layout.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// The wire protocol spoken: 1 or 2.
    pub fn protocol(&self) -> u8 {
        self.version
    }

    /// Which path samples take: `"shm"` (same-host shared memory) or `"tcp"`.
    pub fn transport_path(&self) -> &'static str {
        if self.shm {
            "shm"
        } else {
            "tcp"
        }
    }

    /// `Some(max_rows)` when the server is a sequence table: samples are steps of rows
    /// `0..max_rows` of this client, and may end their episode.
    pub fn takes_steps(&self) -> Option<u32> {
        self.steps
    }

    /// Whether the server takes priorities (v2 with a replay table).
    pub fn takes_priorities(&self) -> bool {
        self.replay
    }

    /// Samples sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Samples acknowledged so far.
    pub fn acked(&self) -> u64 {
        match &self.link {
            Some(link) => link.acked_total().max(self.acked_floor),
            None => self.acked_floor,
        }
    }

    /// What the server said the last time it closed a connection of this client: for good
    /// ([`Closing::Final`]) or restarting; `None` if it never did (it is up, or it vanished
    /// without a word, as a crash does).
    pub fn server_closing(&self) -> Option<Closing> {
        let latest = self.link.as_ref().and_then(|link| {
            // ORDERING: Acquire pairs with the reader's Release store (see `recover`).
            Closing::from_byte(link.acks.closing.load(Acquire))
        });
        latest.or(self.server_closing)
    }

    /// Successful reconnections so far.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// Samples sent again after reconnections.
    pub fn resent(&self) -> u64 {
        self.resent
    }

    /// Bytes of a sample written so far by a `send` that returned [`EchoError::Stalled`]
    /// (with reconnection: non-zero while an accepted sample is not yet written).
    pub fn in_progress(&self) -> usize {
        if self.carry {
            self.in_progress.max(1)
        } else {
            self.in_progress
        }
    }

    /// Sends one sample given as its leaves (sizes are checked against the spec here), with
    /// `priority` (v2 replay servers only). Waits first while `max_inflight` samples are
    /// unacknowledged; returns [`EchoError::TimedOut`] if `deadline` passes while waiting
    /// (nothing was sent).
    ///
    /// Once the first byte is written the sample must be finished, or the stream would be
    /// misaligned: if `deadline` passes mid-write this returns [`EchoError::Stalled`], and
    /// the next `send` (with the same leaves) continues where it stopped. [`TcpSender::abort`]
    /// gives up instead (the server discards the partial sample). With reconnection the
    /// sample is kept until acknowledged and a dropped connection is reconnected first.
    ///
    /// # Errors
    /// [`EchoError::Disconnected`] once the connection is gone (and reconnecting gave up);
    /// [`EchoError::Protocol`]/[`EchoError::Priority`] for leaves or a priority the server
    /// cannot take.
    pub fn send(
        &mut self,
        leaves: &[&[u8]],
        meta: FrameMeta,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        self.ensure_usable()?;
        if self.carry {
            self.drive(deadline)?;
            self.carry = false;
            return Ok(());
        }
        if self.shm && !self.reconnect {
            self.check_leaves(leaves)?;
            self.check_meta(&meta)?;
            return self.send_shm(leaves, &meta, deadline);
        }
        if self.in_progress == 0 {
            self.check_leaves(leaves)?;
            self.check_meta(&meta)?;
            loop {
                self.drive(deadline)?;
                let target = (self.sent + 1).saturating_sub(self.config.max_inflight);
                match self.wait_for_acks(target, deadline) {
                    Err(EchoError::Disconnected(_)) if self.reconnect => {}
                    other => break other?,
                }
            }
        }
        let (header, header_len) = frame_header(self.version, &meta, false);
        let header = &header[..header_len];
        if self.reconnect {
            self.retain(header, leaves);
            self.sent += 1;
            self.carry = true;
            self.drive(deadline)?;
            self.carry = false;
            return Ok(());
        }
        self.write_sample(&meta, header, leaves, deadline)?;
        self.sent += 1;
        self.written = self.sent;
        Ok(())
    }

    /// The leaves the current connection sends compressed, as the server's reply named them;
    /// `None` when it sends them raw (v1, shared memory, no codecs offered or wanted).
    pub fn wire_codecs(&self) -> Option<&LeafCodecs> {
        self.link.as_ref().and_then(|link| link.codecs.as_deref())
    }

    /// Writes one sample (`header` + `leaves`, whose fields are `meta`) on the current
    /// connection from byte `in_progress` on, as [`TcpSender::write_frame`]: compressed when
    /// the connection sends compressed frames. The compressed frame is made once, when its
    /// first byte is due, and kept until it is wholly written.
    fn write_sample(
        &mut self,
        meta: &FrameMeta,
        header: &[u8],
        leaves: &[&[u8]],
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let Some(codecs) = self.link.as_ref().and_then(|link| link.codecs.clone()) else {
            return self.write_frame(header, leaves, deadline);
        };
        if self.in_progress == 0 {
            pack_frame(&codecs, meta, leaves, &mut self.packing);
        }
        // Taken out while it is written (`write_frame` borrows the sender), then put back.
        let frame = std::mem::take(&mut self.packing);
        let result = self.write_frame(&[], &[&frame], deadline);
        self.packing = frame;
        result
    }

    /// Sends the rows of `rows` from `*done` on, in order, advancing `*done` as each is wholly
    /// written: as many frames per vectored write as the in-flight window has room for (one
    /// system call for a window-full, not one per sample). Waits for room like
    /// [`TcpSender::send`]; on [`EchoError::TimedOut`] or [`EchoError::Stalled`] call again
    /// with the same `rows` and `done` to continue (a row half written is finished first).
    /// With reconnection each row goes through [`TcpSender::send`] (it is kept until
    /// acknowledged).
    ///
    /// # Errors
    /// As [`TcpSender::send`], for the row at `*done`.
    pub fn send_rows(
        &mut self,
        rows: &Rows<'_>,
        done: &mut usize,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let n = rows.num_samples();
        let leaf_count = self.spec.len();
        if *done == 0 && self.in_progress == 0 && !self.carry {
            for i in 0..n {
                self.check_meta(&self.row_meta(rows, i))?;
            }
        }
        let mut row: Vec<&[u8]> = Vec::with_capacity(leaf_count);
        if self.reconnect || self.shm || self.wire_codecs().is_some() {
            while *done < n {
                row.clear();
                row.extend((0..leaf_count).map(|leaf| rows.row_leaf(*done, leaf)));
                self.send(&row, self.row_meta(rows, *done), deadline)?;
                *done += 1;
            }
            return Ok(());
        }
        self.ensure_usable()?;
        // Every frame of the batch has the same header length: step frames throughout for a
        // sequence table (row 0 too), priorities for all rows or none.
        let steps = self.steps.is_some();
        let header_len = frame_header(self.version, &self.row_meta(rows, 0), steps).1;
        let frame_len = header_len + self.spec.payload_size();
        // At most this many frames per write (each is a header and the leaves' rows).
        let per_write = (MAX_IOVECS / (leaf_count + 1)).max(1);
        while *done < n {
            if self.in_progress == 0 {
                let target = (self.sent + 1).saturating_sub(self.config.max_inflight);
                self.wait_for_acks(target, deadline)?;
            }
            let in_flight = self.sent.saturating_sub(self.acked());
            let room = usize::try_from(self.config.max_inflight.saturating_sub(in_flight))
                .unwrap_or(usize::MAX)
                .max(1);
            let k = room.min(n - *done).min(per_write);
            let headers: Vec<([u8; FrameMeta::MAX_HEADER], usize)> = (0..k)
                .map(|j| frame_header(self.version, &self.row_meta(rows, *done + j), steps))
                .collect();
            let mut parts: Vec<&[u8]> = Vec::with_capacity(k * (leaf_count + 1));
            for (j, (header, len)) in headers.iter().enumerate() {
                parts.push(&header[..*len]);
                parts.extend((0..leaf_count).map(|leaf| rows.row_leaf(*done + j, leaf)));
            }
            let result = self.write_frame(&[], &parts, deadline);
            // `write_frame` counts bytes across the frames: whole ones are sent.
            let written = match &result {
                Ok(()) => k * frame_len,
                Err(_) => self.in_progress,
            };
            let whole = written / frame_len;
            self.sent += whole as u64;
            self.written = self.sent;
            *done += whole;
            self.in_progress = written % frame_len;
            result?;
        }
        Ok(())
    }

    /// Writes one sample into a free shared-memory slot and commits it, waiting (until
    /// `deadline`) while `min(max_inflight, slots)` samples are not yet taken by the server.
    /// A sample is never half sent: it is written whole, then committed.
    fn send_shm(
        &mut self,
        leaves: &[&[u8]],
        meta: &FrameMeta,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        self.write_shm(leaves, meta, deadline)?;
        self.sent += 1;
        self.written = self.sent;
        Ok(())
    }

    /// [`TcpSender::send_shm`]'s write and wait, counting nothing.
    fn write_shm(
        &mut self,
        leaves: &[&[u8]],
        meta: &FrameMeta,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let max_inflight = self.config.max_inflight;
        loop {
            let failure = self.failure();
            let link = self.link.as_mut().ok_or(EchoError::Disconnected(failure))?;
            if link.acks.is_lost() {
                return Err(EchoError::Disconnected(link.acks.reason()));
            }
            let writer = link.shm.as_mut().expect("a shared-memory link");
            let window = max_inflight.min(writer.slots() as u64);
            let in_flight = writer.committed() - writer.taken();
            if in_flight < window && writer.try_send(leaves, meta) {
                return Ok(());
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(EchoError::TimedOut);
            }
            let until = deadline.map_or(now + SHM_SLICE, |d| d.min(now + SHM_SLICE));
            writer.wait_taken(writer.committed() + 1 - window, until);
        }
    }

    /// Keeps a copy of the frame `header` + `leaves` until it is acknowledged, in a buffer
    /// of an acknowledged frame of the same size when there is one (so a steady stream
    /// allocates nothing per sample).
    fn retain(&mut self, header: &[u8], leaves: &[&[u8]]) {
        let len = header.len() + self.spec.payload_size();
        let mut frame = match self.spare.iter().position(|f| f.len() == len) {
            Some(i) => self.spare.swap_remove(i),
            None => vec![0u8; len].into_boxed_slice(),
        };
        let mut at = header.len();
        frame[..at].copy_from_slice(header);
        for leaf in leaves {
            frame[at..at + leaf.len()].copy_from_slice(leaf);
            at += leaf.len();
        }
        self.retained.push_back(Retained { frame });
    }

    /// Forgets the oldest retained frame (acknowledged), keeping its buffer for reuse.
    fn release_front(&mut self) {
        if let Some(old) = self.retained.pop_front() {
            // At most two buffers: one of each frame size (with and without a priority).
            if self.spare.len() < 2 {
                self.spare.push(old.frame);
            }
        }
    }

    /// Row `i` of `rows` as a frame's fields: its priority and, for a sequence table, its row
    /// (row `i` of the batch is this client's stream `i`) and episode flag.
    fn row_meta(&self, rows: &Rows<'_>, i: usize) -> FrameMeta {
        let step = rows.step(i);
        let row =
            if self.steps.is_some() { u32::try_from(step.stream).unwrap_or(u32::MAX) } else { 0 };
        FrameMeta { priority: rows.row_priority(i), row, end: step.end }
    }

    /// Checks what a sample frame would carry: a priority the server takes, and steps (a row
    /// other than 0, an episode end) only for a sequence table, rows within its `max_rows`.
    fn check_meta(&self, meta: &FrameMeta) -> Result<(), EchoError> {
        self.check_priority(meta.priority)?;
        if !meta.is_step() {
            return Ok(());
        }
        match self.steps {
            None => Err(EchoError::Protocol(format!(
                "end_episode/truncated and rows of episodes need a sequence table at the server; \
                 the server at {} {}",
                self.address,
                if self.version == 1 {
                    "speaks wire protocol 1, which has no episodes"
                } else if self.replay {
                    "is a replay table without sequence="
                } else {
                    "is a FIFO server"
                }
            ))),
            Some(max) if meta.row >= max => Err(EchoError::Protocol(format!(
                "row {} out of range: the sequence table at {} takes rows 0 to {} per client \
                 (its Sequence(max_streams={max}))",
                meta.row,
                self.address,
                max - 1
            ))),
            Some(_) => Ok(()),
        }
    }

    fn check_priority(&self, priority: Option<f64>) -> Result<(), EchoError> {
        let Some(priority) = priority else { return Ok(()) };
        if self.version == 1 {
            return Err(EchoError::Protocol(format!(
                "a priority needs wire protocol 2, and the server at {} speaks 1",
                self.address
            )));
        }
        if !self.replay {
            return Err(EchoError::Priority(
                "the server's FIFO ring has no priorities: a priority needs a replay table".into(),
            ));
        }
        if !(priority.is_finite() && priority >= 0.0) {
            return Err(EchoError::Priority(format!(
                "priority must be a finite number >= 0, got {priority}"
            )));
        }
        Ok(())
    }

    /// Closes the connection in the middle of a sample (after an interrupt): the server
    /// discards the partial sample; every later call returns [`EchoError::Disconnected`].
    pub fn abort(&mut self, reason: &str) {
        self.failed.get_or_insert_with(|| reason.to_owned());
        if let Some(link) = &mut self.link {
            // The reason first: the reader thread reports its own once the socket shuts down.
            link.acks.lose(reason.to_owned());
            link.shut();
        }
        self.in_progress = 0;
        self.carry = false;
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

    /// Waits until every sent sample is acknowledged (or `deadline`), reconnecting and
    /// resending meanwhile if the client does.
    ///
    /// # Errors
    /// [`EchoError::Disconnected`] if the connection goes away first (and reconnecting gave
    /// up), [`EchoError::TimedOut`].
    pub fn wait(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        loop {
            if self.acked() >= self.sent {
                return Ok(());
            }
            self.ensure_usable()?;
            self.drive(deadline)?;
            match self.wait_for_acks(self.sent, deadline) {
                Err(EchoError::Disconnected(_)) if self.reconnect => {}
                other => return other,
            }
        }
    }

    /// Waits until at least `target` acks have arrived on the current connection.
    fn wait_for_acks(&self, target: u64, deadline: Option<Instant>) -> Result<(), EchoError> {
        if self.acked() >= target {
            return Ok(());
        }
        let Some(link) = &self.link else {
            return Err(EchoError::Disconnected(self.failure()));
        };
        let acks = &link.acks;
        if let Some(writer) = &link.shm {
            loop {
                if link.acked_total() >= target {
                    return Ok(());
                }
                if acks.is_lost() {
                    return Err(EchoError::Disconnected(acks.reason()));
                }
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    return Err(EchoError::TimedOut);
                }
                let until = deadline.map_or(now + SHM_SLICE, |d| d.min(now + SHM_SLICE));
                writer.wait_taken(target.saturating_sub(link.base), until);
            }
        }
        let reached =
            acks.changed.wait_until(|| link.acked_total() >= target || acks.is_lost(), deadline);
        if link.acked_total() >= target {
            Ok(())
        } else if acks.is_lost() {
            Err(EchoError::Disconnected(acks.reason()))
        } else {
            debug_assert!(!reached);
            Err(EchoError::TimedOut)
        }
    }

    fn failure(&self) -> String {
        if let Some(failed) = &self.failed {
            return failed.clone();
        }
        self.link.as_ref().map_or_else(|| "the connection is gone".into(), |l| l.acks.reason())
    }

    fn ensure_usable(&self) -> Result<(), EchoError> {
        if self.closed {
            return Err(EchoError::Disconnected("the client was closed".into()));
        }
        if let Some(failed) = &self.failed {
            if self.final_close {
                return Err(EchoError::ServerClosed(failed.clone()));
            }
            return Err(EchoError::Disconnected(failed.clone()));
        }
        if !self.reconnect {
            if let Some(link) = &self.link {
                if link.acks.is_lost() {
                    return Err(EchoError::Disconnected(link.acks.reason()));
                }
            }
        }
        Ok(())
    }

    /// With reconnection: reconnects if the connection dropped, then writes every retained
    /// sample not yet written on this connection. Without: checks the connection.
    fn drive(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        if !self.reconnect {
            return self.ensure_usable();
        }
        loop {
            self.recover(deadline)?;
            match self.pump(deadline) {
                Err(EchoError::Disconnected(_)) if self.failed.is_none() => {}
                other => return other,
            }
        }
    }

    /// Writes retained frames from `written` to `sent`.
    fn pump(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        while self.written < self.sent {
            // Drop what is acknowledged: it is never needed again.
            let acked = self.acked();
            while self.retained_base < acked && !self.retained.is_empty() {
                self.release_front();
                self.retained_base += 1;
            }
            let index = usize::try_from(self.written - self.retained_base).expect("retained");
            if self.shm {
                self.pump_shm(index, deadline)?;
                self.written += 1;
                continue;
            }
            // Taken out while it is written (`write_frame` borrows the sender), then put back:
            // it stays retained until acknowledged. Retained raw; compressed as it is written
            // on a connection that sends compressed frames.
            let frame = std::mem::take(&mut self.retained[index].frame);
            let result = if self.wire_codecs().is_some() {
                let (meta, payload) =
                    FrameMeta::split(&frame).expect("a retained frame is well formed");
                let leaves: Vec<&[u8]> =
                    (0..self.spec.len()).map(|leaf| &payload[self.spec.leaf_range(leaf)]).collect();
                self.write_sample(&meta, &[], &leaves, deadline)
            } else {
                self.write_frame(&[], &[&frame[..]], deadline)
            };
            self.retained[index].frame = frame;
            result?;
            self.written += 1;
        }
        Ok(())
    }

    /// Writes the retained frame `index` into a free shared-memory slot of the current
    /// connection and commits it, waiting (until `deadline`) as [`TcpSender::send_shm`] does.
    fn pump_shm(&mut self, index: usize, deadline: Option<Instant>) -> Result<(), EchoError> {
        // Taken out while it is written (`write_shm` borrows the sender), then put back.
        let frame = std::mem::take(&mut self.retained[index].frame);
        let (meta, payload) = FrameMeta::split(&frame).expect("a retained frame is well formed");
        let result = self.write_shm(&[payload], &meta, deadline);
        self.retained[index].frame = frame;
        result
    }

    /// Makes sure there is a live connection, reconnecting (until `deadline` in this call,
    /// until `reconnect_timeout` in all) if it dropped.
    fn recover(&mut self, deadline: Option<Instant>) -> Result<(), EchoError> {
        if let Some(link) = &self.link {
            if !link.acks.is_lost() {
                return Ok(());
            }
            // ORDERING: Acquire pairs with the reader's Release store of `fatal`, made before
            // it set `lost` (which we saw).
            if link.acks.fatal.load(Acquire) {
                let reason = link.acks.reason();
                self.failed = Some(reason.clone());
                return Err(EchoError::Disconnected(reason));
            }
            // ORDERING: Acquire pairs with the reader's Release store of `closing`, made
            // before it set `lost` (which we saw).
            let closing = Closing::from_byte(link.acks.closing.load(Acquire));
            self.server_closing = closing.or(self.server_closing);
            if closing == Some(Closing::Final) && self.config.resolver.is_none() {
                let reason = format!("{}: {}", self.address, link.acks.reason());
                self.failed = Some(reason.clone());
                self.final_close = true;
                return Err(EchoError::ServerClosed(reason));
            }
        }
        if let Some(mut link) = self.link.take() {
            // ORDERING: the reader has stopped counting once `lost` is set (Acquire above).
            self.acked_floor = self.acked_floor.max(link.acked_total());
            let reason = link.acks.reason();
            link.shut();
            log::warn!(
                "{}: connection lost ({reason}); reconnecting",
                self.config.who(&self.address)
            );
            self.recovery = Some(Recovery {
                since: Instant::now(),
                attempt: 0,
                next_try: Instant::now(),
                connecting: None,
                last_error: reason,
            });
        }
        let timeout = self.config.reconnect_timeout.unwrap_or_default();
        loop {
            let recovery = self.recovery.as_mut().expect("reconnecting");
            let now = Instant::now();
            if now.duration_since(recovery.since) >= timeout {
                let reason = format!(
                    "could not reconnect to {} within {timeout:?}: {}",
                    self.address, recovery.last_error
                );
                self.failed = Some(reason.clone());
                return Err(EchoError::Disconnected(reason));
            }
            if deadline.is_some_and(|d| now >= d) {
                return Err(EchoError::TimedOut);
            }
            let slice_end = deadline.map_or(now + CONNECT_SLICE, |d| d.min(now + CONNECT_SLICE));
            let Some(connecting) = &mut recovery.connecting else {
                if now < recovery.next_try {
                    thread::sleep(recovery.next_try.min(slice_end) - now);
                    continue;
                }
                let until = recovery.since + timeout;
                let target = match &self.config.resolver {
                    None => Some(self.target.clone()),
                    Some(resolver) => {
                        let last = Some((self.target.0.as_str(), self.target.1, ""));
                        let last = last.map(|(h, p, _)| (h, p, recovery.last_error.as_str()));
                        match resolver.0.resolve(last) {
                            Ok(target) => target,
                            Err(err) => {
                                self.failed = Some(err.to_string());
                                return Err(err);
                            }
                        }
                    }
                };
                let Some(target) = target else {
                    recovery.last_error = "no server to connect to yet".into();
                    recovery.attempt += 1;
                    recovery.next_try = Instant::now() + backoff(recovery.attempt);
                    continue;
                };
                if target != self.target {
                    log::info!(
                        "{}: reconnecting to {}:{} instead",
                        self.config.who(&self.address),
                        target.0,
                        target.1
                    );
                    self.address = format!("{}:{}", target.0, target.1);
                    self.target = target.clone();
                }
                recovery.connecting = Some(Connecting::start(
                    Arc::clone(&self.config),
                    target,
                    self.session,
                    self.acked_floor,
                    Some(until),
                )?);
                continue;
            };
            match connecting.poll_established(slice_end) {
                Ok(None) => {}
                Ok(Some(est)) => return self.resume(est),
                Err(err @ (EchoError::Auth(_) | EchoError::Protocol(_))) => {
                    self.failed = Some(err.to_string());
                    return Err(err);
                }
                Err(err) => {
                    recovery.last_error = err.to_string();
                    recovery.attempt += 1;
                    recovery.connecting = None;
                    recovery.next_try = Instant::now() + backoff(recovery.attempt);
                }
            }
        }
    }

    /// Continues on a new connection: drops what the server already has, resends the rest.
    fn resume(&mut self, est: Established) -> Result<(), EchoError> {
        let Some(accept) = &est.accept else {
            let reason = format!(
                "reconnected to {}, which now speaks only wire protocol 1: cannot resume",
                self.address
            );
            self.failed = Some(reason.clone());
            return Err(EchoError::Disconnected(reason));
        };
        let resume = accept.resume_seq;
        if resume > self.sent {
            let reason = format!(
                "the server at {} resumed at sample {resume}, past the {} sent",
                self.address, self.sent
            );
            self.failed = Some(reason.clone());
            return Err(EchoError::Disconnected(reason));
        }
        self.replay = accept.replay;
        self.steps = accept.steps;
        while self.retained_base < resume && !self.retained.is_empty() {
            self.release_front();
            self.retained_base += 1;
        }
        self.acked_floor = resume;
        self.written = resume;
        self.in_progress = 0;
        self.resent += self.sent - resume;
        self.reconnects += 1;
        self.recovery = None;
        log::info!(
            "{}: reconnected; resending {} samples from sample {resume}",
            self.config.who(&self.address),
            self.sent - resume
        );
        self.install(est)
    }

    /// Writes one frame (`header`, then `parts`) from byte `in_progress` on, until done or
    /// `deadline` passes.
    fn write_frame(
        &mut self,
        header: &[u8],
        parts: &[&[u8]],
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let link =
            self.link.as_mut().ok_or_else(|| EchoError::Disconnected("no connection".into()))?;
        let mut slices: Vec<IoSlice<'_>> = std::iter::once(header)
            .chain(parts.iter().copied())
            .filter(|l| !l.is_empty())
            .map(IoSlice::new)
            .collect();
        let mut remaining = &mut slices[..];
        IoSlice::advance_slices(&mut remaining, self.in_progress);
        let mut writing = link.writing.lock();
        while !remaining.is_empty() {
            match link.stream.write_vectored(remaining) {
                Ok(0) => {
                    link.acks.lose("the server stopped reading (write returned 0)".into());
                    return Err(EchoError::Disconnected(link.acks.reason()));
                }
                Ok(n) => {
                    self.in_progress += n;
                    writing.mid_frame = true;
                    writing.last_write = Instant::now();
                    IoSlice::advance_slices(&mut remaining, n);
                }
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    // The server is applying backpressure; keep going unless it vanished or
                    // the caller wants control back.
                    if link.acks.is_lost() {
                        return Err(EchoError::Disconnected(link.acks.reason()));
                    }
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
                    link.acks.lose(format!("sending failed: {e}"));
                    return Err(EchoError::Disconnected(link.acks.reason()));
                }
            }
        }
        writing.mid_frame = false;
        self.in_progress = 0;
        Ok(())
    }

    /// Flushes (waits for every ack, until `deadline`), says goodbye (v2: the server forgets
    /// the session), closes the socket and joins the ack reader. Idempotent. Returns whether
    /// every sent sample was acknowledged.
    pub fn close(&mut self, deadline: Option<Instant>) -> bool {
        if self.closed {
            return self.acked() >= self.sent;
        }
        let flushed = self.wait(deadline).is_ok();
        self.closed = true;
        if let Some(mut link) = self.link.take() {
            self.acked_floor = self.acked_floor.max(link.acked_total());
            if link.version == 2 && flushed && !link.acks.is_lost() {
                let _guard = link.writing.lock();
                let _ = link.stream.write_all(&[v2::BYE]);
            }
            link.acks.lose("the client was closed".into());
            link.shut();
        }
        flushed
    }
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        // Do not wait for acks on drop; say goodbye (v2, between frames: the server forgets the
        // session, which no reconnect will resume), release the socket and the thread.
        self.closed = true;
        if let Some(link) = self.link.take() {
            if link.version == 2 && self.in_progress == 0 && !link.acks.is_lost() {
                let _guard = link.writing.lock();
                let _ = (&link.stream).write_all(&[v2::BYE]);
            }
        }
    }
}

/// A second descriptor of `writer`'s space bell, for the reader thread.
#[cfg(target_os = "linux")]
fn loss_bell(writer: &ShmWriter) -> io::Result<LossBell> {
    writer.space_bell()
}

#[cfg(not(target_os = "linux"))]
fn loss_bell(writer: &ShmWriter) -> io::Result<LossBell> {
    match *writer {}
}

/// The bytes before a sample's payload, on the stack (`header[..len]`): none on v1; the frame
/// type and fields on v2 ([`FrameMeta::encode`]; a step frame for any row with `step`).
fn frame_header(version: u8, meta: &FrameMeta, step: bool) -> ([u8; FrameMeta::MAX_HEADER], usize) {
    if version == 1 {
        return ([0u8; FrameMeta::MAX_HEADER], 0);
    }
    meta.encode_as(step)
}

/// The pause before reconnection attempt `attempt` (from 1): doubling from
/// [`BACKOFF_FIRST`] up to [`BACKOFF_MAX`], jittered to 50-100% so that a fleet of workers
/// does not reconnect in lockstep.
/// A compressed frame of the sample `leaves` with fields `meta` into `out` (cleared first):
/// its header with [`v2::PACKED`] set, the body's length, and the body ([`LeafCodecs`]).
fn pack_frame(codecs: &LeafCodecs, meta: &FrameMeta, leaves: &[&[u8]], out: &mut Vec<u8>) {
    out.clear();
    let (mut header, len) = meta.encode();
    header[0] |= v2::PACKED;
    out.extend_from_slice(&header[..len]);
    out.extend_from_slice(&[0; 4]);
    let body = out.len();
    codecs.pack_body(&Leaves(leaves), 0, out);
    let body_len = u32::try_from(out.len() - body).expect("a body is far below 4 GiB");
    out[body - 4..body].copy_from_slice(&body_len.to_le_bytes());
}

fn backoff(attempt: u32) -> Duration {
    let base = BACKOFF_FIRST.saturating_mul(1 << attempt.min(16)).min(BACKOFF_MAX);
    let jitter = v2::random::<1>().map_or(255, |b| b[0]);
    base / 2 + base.mul_f64(f64::from(jitter) / 510.0)
}

/// The reader thread's state: counts acks, answers and watches heartbeats (v2).
struct Reading {
    stream: TcpStream,
    acks: Arc<Acks>,
    writing: Arc<Mutex<Writing>>,
    beat: Option<Beat>,
    version: u8,
    /// v1 chosen by `Auto`: an offer may still arrive before the first ack; skip it.
    skip_offer: bool,
    /// Bytes received and not yet processed.
    pending: Vec<u8>,
    last_heard: Instant,
    /// On shared memory: the space bell, rung when the connection is lost so that a `send`
    /// or `wait` sleeping on it notices at once.
    wake_on_loss: Option<LossBell>,
}

impl Reading {
    fn run(&mut self) {
        if let Err(reason) = self.read_loop() {
            self.acks.lose(reason);
            if let Some(bell) = &self.wake_on_loss {
                crate::transport::shm::ring::Bell::ring(bell);
            }
        }
    }

    fn read_loop(&mut self) -> Result<(), String> {
        let every = self.beat.map(|b| b.every);
        self.stream.set_read_timeout(every).map_err(|e| e.to_string())?;
        let mut buf = [0u8; 4096];
        loop {
            self.process()?;
            match self.stream.read(&mut buf) {
                Ok(0) => return Err("the server closed the connection".into()),
                Ok(n) => {
                    self.last_heard = Instant::now();
                    self.pending.extend_from_slice(&buf[..n]);
                    // The server's own heartbeats (or acks) may arrive more often than our
                    // read timeout: ours are due by our last write, not by a quiet socket.
                    self.heartbeat()?;
                }
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    self.heartbeat()?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("the connection failed: {e}")),
            }
        }
    }

    /// Sends a heartbeat if nothing was written for a while; fails if the server has been
    /// silent too long.
    fn heartbeat(&mut self) -> Result<(), String> {
        let Some(beat) = self.beat else { return Ok(()) };
        if let Some(dead_after) = beat.dead_after {
            if self.last_heard.elapsed() >= dead_after {
                let _ = self.stream.shutdown(Shutdown::Both);
                return Err(format!("no heartbeat from the server for {dead_after:?}"));
            }
        }
        if let Some(mut writing) = self.writing.try_lock() {
            if !writing.mid_frame && writing.last_write.elapsed() >= beat.every {
                // A short write with the writer's lock held; a full socket buffer means data
                // is flowing anyway.
                if self.stream.write(&[v2::HEARTBEAT]).is_ok() {
                    writing.last_write = Instant::now();
                }
            }
        }
        Ok(())
    }

    /// Consumes the complete messages in `pending`.
    fn process(&mut self) -> Result<(), String> {
        let mut used = 0;
        let mut acked = 0u64;
        let result = loop {
            let Some(&byte) = self.pending.get(used) else { break Ok(()) };
            match byte {
                ACK => {
                    acked += 1;
                    used += 1;
                    self.skip_offer = false;
                }
                v2::BEAT if self.version == 2 => used += 1,
                v2::CLOSING if self.version == 2 => {
                    let Some(&why) = self.pending.get(used + 1) else { break Ok(()) };
                    used += 2;
                    let Some(closing) = Closing::from_byte(why) else {
                        break Err(format!("protocol error: a closing notice with reason {why}"));
                    };
                    // ORDERING: Release, before `lose` sets `lost`: whoever sees the loss sees
                    // why (Acquire in `TcpSender::recover`).
                    self.acks.closing.store(why, Release);
                    // Every ack came before the notice, and nothing more will: hang up, so
                    // the server need not wait for us.
                    let _ = self.stream.shutdown(Shutdown::Both);
                    break Err(match closing {
                        Closing::Final => "the server closed for good (Server.close())".into(),
                        Closing::Restarting => {
                            "the server is restarting (Server.close(restarting=True))".into()
                        }
                    });
                }
                v2::ERROR if self.version == 2 => {
                    match v2::parse_error(&self.pending[used + 1..]) {
                        Ok(Some((message, len))) => {
                            // ORDERING: Release, before `lose` sets `lost`: whoever sees
                            // the loss sees that it is fatal (Acquire in `recover`).
                            self.acks.fatal.store(true, Release);
                            used += 1 + len;
                            break Err(format!("the server closed the connection: {message}"));
                        }
                        Ok(None) => break Ok(()),
                        Err(e) => break Err(format!("protocol error: {e}")),
                    }
                }
                b'E' if self.skip_offer => match Offer::parse(&self.pending[used..]) {
                    Ok(Some(_)) => {
                        log::warn!(
                            "the server's offer of wire protocol 2 arrived after {OFFER_GRACE:?}; \
                             this connection speaks protocol 1"
                        );
                        used += v2::OFFER_LEN;
                        self.skip_offer = false;
                    }
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(format!("protocol error: {e}")),
                },
                bad => {
                    break Err(format!("protocol error: expected ack byte 0x01, got {bad:#04x}"));
                }
            }
        };
        self.pending.drain(..used);
        if acked > 0 {
            // ORDERING: Release pairs with the Acquire in `Acks::acked`.
            self.acks.acked.fetch_add(acked, Release);
            self.acks.changed.notify_all();
        }
        result
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};

    use super::is_self_connected;

    /// A socket bound to a loopback port and connected to that same port: what the kernel
    /// may hand `open_stream` when nobody listens on a port in the ephemeral range.
    fn self_connected() -> TcpStream {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build().unwrap();
        runtime.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
            let own = socket.local_addr().unwrap();
            socket.connect(own).await.unwrap().into_std().unwrap()
        })
    }

    #[test]
    fn a_socket_connected_to_itself_is_told_from_a_real_connection() {
        let looped = self_connected();
        assert_eq!(looped.local_addr().unwrap(), looped.peer_addr().unwrap());
        assert!(is_self_connected(&looped));
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
        let real = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!is_self_connected(&real));
    }
}
