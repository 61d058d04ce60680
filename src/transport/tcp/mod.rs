//! The TCP transport: a tokio runtime of its own, an accept loop, and one task per connection
//! that sends the greeting, negotiates wire protocol v1 or v2 (see [`super::wire::v2`]), reads
//! exact-size samples into recycled buffers, queues them and acknowledges each queued sample
//! with one byte.
//!
//! v2 connections belong to a session (the client's, kept across its reconnects): the
//! session owns the ingress queue, so a reconnecting client's samples stay in order, and
//! counts the samples queued, so a resent one is never queued twice.
//!
//! Reading: small samples arrive many per `read` into a staging buffer and are copied out;
//! samples of at least half the staging size are read straight into their payload buffer, so
//! large samples cost no extra copy. A connection that ends mid-sample has the partial sample
//! discarded: only whole samples are ever queued.
//!
//! Acks are written in runs, right before the task would block (on a read, or on a full
//! queue), so a client streaming many small samples gets one ack write per read, not one per
//! sample, and never waits for an ack that is sitting in our buffer.
//!
//! The modules form layers: each takes only from those below it in this table.
//!
//! | module       | holds                                                                    |
//! |--------------|--------------------------------------------------------------------------|
//! | this one     | [`TcpConfig`], [`TcpServer`]: settings, start, close, shutdown            |
//! | `accept`     | the accept loop, the connection limit, evicting an idle connection        |
//! | `connection` | one connection's task: greeting, negotiation, how it ended                |
//! | `frames`     | v1 payloads, a v2 session's attach and resume, v2 sample frames           |
//! | `link`       | a connection's socket: buffered reads, batched acks, heartbeats, pushes   |
//! | `checks`     | what a sample's fields must satisfy for the backend (frames and slots)    |
//! | `session`    | what connection tasks share (activity, failure log); v2 sessions          |
//!
//! The shared-memory side of a v2 connection lives with the rest of shared memory, in
//! [`super::shm`]; the two places where a connection writes into the backend itself
//! instead of through the ingress are in `super::direct`.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpSocket};
use tokio::runtime::Runtime;
use tokio::sync::{watch, Semaphore};

use super::wire::encode_handshake;
use super::wire::v2::{self, Closing, Layout, LeafType};
use crate::codec::{Codec, LeafCodecs};
use crate::error::EchoError;
use crate::ingress::Ingress;
use crate::params::Params;
use crate::queued::SessionMark;
use crate::versions::PolicyVersions;
use accept::{accept_loop, Admission};
use link::NOTICE_GRACE;
use session::{reap_sessions, Sessions, Shared, Throttled};

mod accept;
// `checks`, `link` and `session` are also what the shared-memory side of a connection
// (`crate::transport::shm::server`) builds on.
pub(crate) mod checks;
mod connection;
// `serve_fetch` serves parameter fetches on shared-memory connections too.
pub(crate) mod frames;
pub(crate) mod link;
pub(crate) mod session;

/// The most tokio worker threads a server starts (they are started at once).
const MAX_THREADS: usize = 1024;
/// How long `shutdown` waits for the runtime's tasks to stop.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// TCP transport settings.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Bind address (`0.0.0.0` for every interface, `127.0.0.1` for loopback only).
    pub host: String,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// Tokio worker threads.
    pub num_threads: usize,
    /// Connections served at once. At the limit an idle one (no completed sample yet) is
    /// evicted for a newcomer; if there is none, the newcomer is accepted and closed at once.
    pub max_connections: usize,
    /// The shared secret v2 clients must prove (HMAC-SHA256 challenge-response); `None`: an
    /// open server, which also speaks v1.
    pub token: Option<Vec<u8>>,
    /// How long a v2 peer may stay silent before it is taken for dead (heartbeats keep live
    /// ones talking); `None`: forever.
    pub heartbeat_timeout: Option<Duration>,
    /// How long a v2 session outlives its connection, waiting for the client to reconnect.
    pub session_timeout: Duration,
    /// The samples' dtypes and leaf names, which v2 clients must match; `None`: derived from
    /// the backend's byte layout ([`Layout::untyped`]).
    pub layout: Option<Layout>,
    /// Offer v2 clients on this host the shared-memory path (Linux; see [`super::shm`]).
    pub shared_memory: bool,
    /// The leaves v2 clients send compressed over TCP, per leaf (empty: none). A replay table
    /// that stores leaves compressed offers its own codecs whatever this says, and keeps the
    /// bytes as they arrive.
    pub codecs: Vec<Option<Codec>>,
    /// The durable sessions of the checkpoint this server was restored from: each waits for
    /// its client, resuming where the checkpoint holds its samples up to.
    pub restored_sessions: Vec<SessionMark>,
    /// The learner's parameter channel, served to v2 clients that ask; `None`: not served.
    pub params: Option<Arc<Params>>,
    /// The samples' policy versions, when the server keeps them: clients must send them (the
    /// layout gets the version leaf), and learn the admission bound.
    pub versions: Option<Arc<PolicyVersions>>,
}

impl TcpConfig {
    /// Settings for `host:port` with the defaults: 2 threads, 4096 connections, no token,
    /// 10 s heartbeat timeout, 300 s session timeout, shared memory offered.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
            num_threads: 2,
            max_connections: 4096,
            token: None,
            heartbeat_timeout: Some(Duration::from_secs(10)),
            session_timeout: Duration::from_secs(300),
            layout: None,
            shared_memory: true,
            codecs: Vec::new(),
            restored_sessions: Vec::new(),
            params: None,
            versions: None,
        }
    }
}

/// A running TCP server feeding an [`Ingress`].
pub struct TcpServer {
    runtime: Option<Runtime>,
    local_addr: SocketAddr,
    shared: Arc<Shared>,
}

impl TcpServer {
    /// Binds `config.host:config.port` (synchronously, so a port in use is reported here) and
    /// starts accepting.
    ///
    /// # Errors
    /// [`EchoError::Config`] for bad settings or a spec the wire format cannot express;
    /// [`EchoError::Io`] (naming the address) if binding or starting the runtime fails.
    pub fn start(config: &TcpConfig, ingress: Arc<Ingress>) -> Result<Self, EchoError> {
        if config.num_threads == 0 || config.num_threads > MAX_THREADS {
            return Err(EchoError::Config(format!(
                "num_threads must be in 1..={MAX_THREADS}, got {}",
                config.num_threads
            )));
        }
        if config.max_connections == 0 || config.max_connections > Semaphore::MAX_PERMITS {
            return Err(EchoError::Config(format!(
                "max_connections must be in 1..={}, got {}",
                Semaphore::MAX_PERMITS,
                config.max_connections
            )));
        }
        let layout = match &config.versions {
            // The sample's leaves (as given, or untyped), then the version leaf.
            Some(_) => {
                let mut layout = config
                    .layout
                    .clone()
                    .unwrap_or_else(|| Layout::untyped(ingress.backend().spec()).without_last());
                layout.0.push(LeafType::policy_version());
                layout
            }
            None => {
                config.layout.clone().unwrap_or_else(|| Layout::untyped(ingress.backend().spec()))
            }
        };
        if layout.spec()? != *ingress.backend().spec() {
            return Err(EchoError::Config(
                "the typed layout does not describe the backend's samples".into(),
            ));
        }
        if config.token.as_ref().is_some_and(Vec::is_empty) {
            return Err(EchoError::Config("the token must not be empty".into()));
        }
        // Only an open server greets v1 clients with the v1 handshake; one with a token sends
        // the v2 offer alone, which v1 clients refuse (version 2) before writing anything.
        let v1_handshake = match config.token {
            None => encode_handshake(ingress.backend().spec())?,
            Some(_) => Vec::new(),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.num_threads)
            .thread_name("echo-tcp")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = {
            let _entered = runtime.enter();
            listen(config).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot listen on {}:{}: {e}", config.host, config.port),
                )
            })?
        };
        let local_addr = listener.local_addr()?;
        let admission = Admission::new(config.max_connections);
        let backend = ingress.backend();
        let keep_packed = backend.stored_codecs().is_some();
        let codecs = match backend.stored_codecs() {
            Some(stored) => Some(stored.clone()),
            None if config.codecs.iter().any(Option::is_some) => {
                Some(LeafCodecs::new(backend.spec(), config.codecs.clone())?)
            }
            None => None,
        }
        .filter(|codecs| codecs.max_body() <= u32::MAX as usize)
        .map(Arc::new);
        let shared = Arc::new(Shared {
            max_hello: v2::max_hello_body(&layout),
            ingress,
            v1_handshake,
            token: config.token.clone(),
            layout,
            heartbeat: config.heartbeat_timeout,
            sessions: Sessions::default(),
            session_timeout: config.session_timeout,
            max_sessions: config.max_connections,
            served: Arc::clone(&admission.served),
            epoch: admission.epoch,
            failures: Throttled::default(),
            shared_memory: config.shared_memory,
            closing: watch::Sender::new(0),
            codecs,
            keep_packed,
            warned_v1_sequence: std::sync::atomic::AtomicBool::new(false),
            persisted: watch::Sender::new(0),
            params: config.params.clone(),
            versions: config.versions.clone(),
        });
        shared.seed(&config.restored_sessions);
        runtime.spawn(reap_sessions(Arc::clone(&shared)));
        runtime.spawn(accept_loop(listener, Arc::clone(&shared), admission));
        Ok(Self { runtime: Some(runtime), local_addr, shared })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What a checkpoint asks of the durable sessions: their marks, and that they be told.
    pub fn durability(&self) -> Durability {
        Durability(Arc::clone(&self.shared))
    }

    /// Closes telling the clients why: stops accepting, and each connection, at its next wait
    /// for its client or for space, flushes its acks, sends v2 clients that understand it a
    /// [`v2::CLOSING`] notice with `why`, and reads (discarding) until its client hangs up,
    /// so that no ack is lost to a reset. Waits for that at most 1 s (`NOTICE_GRACE`), then
    /// [`TcpServer::shutdown`]s. Idempotent.
    pub fn close(&mut self, why: Closing) {
        if self.runtime.is_none() {
            return;
        }
        self.shared.closing.send_if_modified(|state| {
            let first = *state == 0;
            if first {
                *state = why as u8;
            }
            first
        });
        // Each connection task leaves the registry as it ends (`Leave` in `accept`), and the
        // last one to leave wakes this wait: no polling, and still at most `NOTICE_GRACE`.
        self.shared.served.wait_empty(Instant::now() + NOTICE_GRACE);
        self.shutdown();
    }

    /// Stops accepting, closes every connection and joins the runtime's threads (no notice:
    /// to a client this looks like a crash). Idempotent.
    pub fn shutdown(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Cancels the accept loop and every connection task at its next await point;
            // their guards mark the connections closed. Joins the worker threads.
            runtime.shutdown_timeout(SHUTDOWN_GRACE);
        }
    }
}

/// A checkpoint's handle on a server's durable sessions ([`TcpServer::durability`]).
pub struct Durability(Arc<Shared>);

impl Durability {
    /// Every durable session's mark: call it right after [`Ingress::capture`], before the
    /// next one (checkpoints run one at a time).
    pub fn marks(&self) -> Vec<SessionMark> {
        self.0.marks()
    }

    /// The checkpoint holding `marks` completed: tell those sessions' clients.
    pub fn persisted(&self, marks: &[SessionMark]) {
        self.0.persisted(marks);
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Binds a listener whose accept backlog holds `max_connections` (the kernel caps it at its
/// own limit, `net.core.somaxconn`), so a burst of workers connecting at once is not refused
/// by the kernel before the accept loop sees it.
fn listen(config: &TcpConfig) -> io::Result<TcpListener> {
    let mut last_err = None;
    for addr in (config.host.as_str(), config.port).to_socket_addrs()? {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        let backlog = u32::try_from(config.max_connections).unwrap_or(u32::MAX).max(128);
        match socket.bind(addr).and_then(|()| socket.listen(backlog)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address")))
}
