//! Opening one connection ([`Connecting`]): the TCP connect, the server's greeting, choosing
//! v1 or v2, the v2 hello, reply and session, and the shared-memory attach the reply offers;
//! each poll waits at most until the time it is given.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use super::link::Established;
use super::options::LOG_TARGET;
use super::options::{ClientConfig, Protocol, SharedMemory};
use super::{TcpSender, OFFER_GRACE};
use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::spec::DataSpec;
use crate::sync::Arc;
use crate::transport::shm::worker::{attach, ShmWriter};
use crate::transport::wire::v2::{self, Hello, Layout, Mode, Offer, Reply};
use crate::transport::wire::{parse_handshake, MAGIC};

/// A connection being opened ([`TcpSender::connecting`]). Each [`Connecting::poll`] waits at
/// most until the time it is given, so a caller can check for interrupts (Ctrl-C) between
/// polls; the deadline given to `connecting` bounds the whole connect and handshake. Dropping
/// it abandons the connect (its thread ends on its own, at the latest at the deadline).
pub struct Connecting {
    pub(super) config: Arc<ClientConfig>,
    /// Where this attempt connects, and the same as `host:port`.
    pub(super) target: (String, u16),
    pub(super) address: String,
    pub(super) started: Instant,
    pub(super) deadline: Option<Instant>,
    pub(super) session: [u8; 16],
    pub(super) first_seq: u64,
    /// The result of the TCP connect, from its thread.
    pub(super) connected: Receiver<io::Result<TcpStream>>,
    /// Connected, negotiating.
    pub(super) stream: Option<TcpStream>,
    /// Bytes received and not yet used.
    pub(super) received: Vec<u8>,
    /// When the v1 handshake was complete (Auto and V2 then wait for an offer).
    pub(super) v1_at: Option<Instant>,
    /// The v2 hello we sent and the offer it answers, once sent.
    pub(super) sent_hello: Option<(Offer, Hello)>,
}

impl Connecting {
    pub(super) fn start(
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

    pub(super) fn poll_established(
        &mut self,
        until: Instant,
    ) -> Result<Option<Established>, EchoError> {
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
    pub(super) fn advance(&mut self) -> Result<Option<Established>, EchoError> {
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
                target: LOG_TARGET, "{}: the server speaks only wire protocol 1; this client will not reconnect",
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
    pub(super) fn answer(&mut self, offer: Offer) -> Result<Option<Established>, EchoError> {
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
            durable: self.config.durable.is_some(),
            // Version notices and chunks come only when asked for (never over v1).
            params: true,
            // Versions go on the payloads only when the server keeps them.
            versions: true,
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
        if self.config.durable.is_some() && !accept.durable {
            return Err(EchoError::Protocol(format!(
                "the server at {} does not offer durable acknowledgements (an echo server \
                 older than this client): connect without durable=True",
                self.address
            )));
        }
        if accept.resume_seq < self.first_seq && accept.durable {
            return Err(EchoError::Protocol(format!(
                "the server at {} resumed this session at sample {}, but had said the samples \
                 before {} were persisted: it was restored from an older checkpoint than its \
                 latest, and samples {} to {} are lost (restore the latest checkpoint)",
                self.address,
                accept.resume_seq,
                self.first_seq,
                accept.resume_seq,
                self.first_seq - 1
            )));
        }
        if accept.resume_seq < self.first_seq {
            return Err(EchoError::Protocol(format!(
                "the server at {} resumed at sample {} before the {} acknowledged",
                self.address, accept.resume_seq, self.first_seq
            )));
        }
        let spec = self.config.layout.spec()?;
        // What the payloads hold on this connection: the sample's leaves, and the policy
        // version when the server keeps versions.
        let wire = match accept.versions {
            Some(_) => self.config.layout.with_policy_version().spec()?,
            None => spec.clone(),
        };
        if let Some(codecs) = &accept.codecs {
            LeafCodecs::new(&wire, codecs.clone()).map_err(|e| {
                EchoError::Protocol(format!(
                    "the server at {} names codecs this layout cannot take: {e}",
                    self.address
                ))
            })?;
        }
        let shm = self.attach_shm(&accept, wire.payload_size())?;
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
        log::debug!(target: LOG_TARGET, "{why}; sending over TCP");
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
