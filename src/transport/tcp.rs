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

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

use super::wire::v2::{
    self, Beat, Closing, FrameMeta, Hello, Layout, Mode, Offer, Opening, Refusal, Reply,
};
use super::wire::{encode_handshake, ACK};
use crate::backend::Backend;
use crate::codec::{Codec, LeafCodecs};
use crate::error::EchoError;
use crate::ingress::{Connection, Ingress, SpaceWaker, StepMark, TransportEvent};

/// Bytes read from a socket at a time for small samples.
const STAGING: usize = 64 * 1024;
/// The most tokio worker threads a server starts (they are started at once).
const MAX_THREADS: usize = 1024;
/// How long `shutdown` waits for the runtime's tasks to stop.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long [`TcpServer::close`] waits for the connections to take their closing notice
/// (each flushes its acks, says why, and reads until its client hangs up).
const NOTICE_GRACE: Duration = Duration::from_secs(1);
/// A sleep that stands for "no heartbeat timer" in a `select!` whose branch is disabled.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

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
        let layout =
            config.layout.clone().unwrap_or_else(|| Layout::untyped(ingress.backend().spec()));
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
        });
        runtime.spawn(reap_sessions(Arc::clone(&shared)));
        runtime.spawn(accept_loop(listener, Arc::clone(&shared), admission));
        Ok(Self { runtime: Some(runtime), local_addr, shared })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
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
        let deadline = Instant::now() + NOTICE_GRACE;
        while !self.shared.served.lock().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
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

/// How often refusals and evictions are logged: one record per interval, with a count.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// How long an accepted connection waits for the slot of the connection evicted for it.
const EVICTION_GRACE: Duration = Duration::from_secs(1);

/// What a connection's task tells the accept loop about it.
#[derive(Debug, Default)]
struct Activity {
    /// Milliseconds since the server started at its last read of a byte.
    last_read_ms: AtomicU64,
    /// Whether it has queued (and acknowledged) a whole sample.
    completed: AtomicBool,
}

impl Activity {
    fn read(&self, epoch: Instant) {
        let ms = u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        // ORDERING: Relaxed — a heuristic for choosing whom to evict; it guards no memory.
        self.last_read_ms.store(ms, Relaxed);
    }

    fn complete(&self) {
        // ORDERING: Relaxed — as above.
        self.completed.store(true, Relaxed);
    }

    /// `Some(last read)` if this connection may be evicted: it has not completed a sample.
    /// (Silence is no reason once it has: a worker held back by backpressure is silent too.)
    fn evictable(&self) -> Option<u64> {
        // ORDERING: Relaxed — as above.
        let (last, completed) = (self.last_read_ms.load(Relaxed), self.completed.load(Relaxed));
        (!completed).then_some(last)
    }
}

/// Every served connection's activity and the handle that ends its task, by id.
type Registry = Arc<Mutex<HashMap<u64, (Arc<Activity>, AbortHandle)>>>;

/// Who gets one of the `max_connections` slots. The policy, when every slot is taken: evict
/// the connection that has been silent longest among those that have not completed a sample
/// yet, and give its slot to the newcomer; refuse the newcomer only when every connection has
/// completed one. So idle connections, however many, cannot lock a worker out, and a working
/// connection (also one held back by backpressure) is never dropped for a newcomer.
struct Admission {
    limit: Arc<Semaphore>,
    max: usize,
    epoch: Instant,
    next_id: AtomicU64,
    /// Every served connection's activity and the handle that ends its task.
    served: Registry,
    /// Refusals and evictions since the last log record, and when that was.
    unlogged: (u64, u64),
    logged_at: Option<Instant>,
}

impl Admission {
    fn new(max: usize) -> Self {
        Self {
            limit: Arc::new(Semaphore::new(max)),
            max,
            epoch: Instant::now(),
            next_id: AtomicU64::new(0),
            served: Arc::default(),
            unlogged: (0, 0),
            logged_at: None,
        }
    }

    /// A slot for a new connection: a free one, or the slot of a connection evicted for it.
    async fn admit(&mut self, ingress: &Ingress) -> Option<OwnedSemaphorePermit> {
        if let Ok(permit) = Arc::clone(&self.limit).try_acquire_owned() {
            return Some(permit);
        }
        if self.evict_one() {
            ingress.note_evicted();
            self.unlogged.1 += 1;
            let slot =
                tokio::time::timeout(EVICTION_GRACE, Arc::clone(&self.limit).acquire_owned());
            if let Ok(Ok(permit)) = slot.await {
                self.log_now_and_then();
                return Some(permit);
            }
        }
        ingress.note_refused();
        self.unlogged.0 += 1;
        self.log_now_and_then();
        None
    }

    /// Ends the task of the longest-silent evictable connection; whether there was one.
    fn evict_one(&self) -> bool {
        let mut served = self.served.lock();
        let victim = served
            .iter()
            .filter_map(|(&id, (activity, _))| activity.evictable().map(|last| (last, id)))
            .min();
        let Some((_, id)) = victim else { return false };
        if let Some((_, task)) = served.remove(&id) {
            // Dropping the task's future releases its slot and closes its connection.
            task.abort();
        }
        true
    }

    /// The first refusal or eviction is logged at once, later ones once per [`LOG_EVERY`] with
    /// a count: a flood of connections must not slow accepting (or the learner, whose GIL
    /// every Python log record takes).
    fn log_now_and_then(&mut self) {
        if self.logged_at.is_some_and(|at| at.elapsed() < LOG_EVERY) {
            return;
        }
        let (refused, evicted) = std::mem::take(&mut self.unlogged);
        if refused > 0 {
            log::warn!(
                "refused {refused} connection(s): all {} connections are working ones",
                self.max
            );
        }
        if evicted > 0 {
            log::info!(
                "evicted {evicted} idle connection(s) to admit new ones ({} connections open)",
                self.max
            );
        }
        self.logged_at = Some(Instant::now());
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut admission: Admission) {
    let mut closing = shared.closing.subscribe();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = closed(&mut closing) => return, // drops the listener: newcomers are refused
        };
        match accepted {
            Ok((stream, peer)) => {
                let Some(permit) = admission.admit(&shared.ingress).await else {
                    drop(stream);
                    continue;
                };
                // ORDERING: Relaxed — only this loop hands out ids; they only need to differ.
                let id = admission.next_id.fetch_add(1, Relaxed);
                let activity = Arc::new(Activity::default());
                activity.read(admission.epoch);
                let (shared, mine) = (Arc::clone(&shared), Arc::clone(&activity));
                // Registered before the task can finish (the lock is held), and the task takes
                // itself out of the registry however it ends.
                let mut registry = admission.served.lock();
                let task = tokio::spawn(async move {
                    let _leave = Leave { served: Arc::clone(&shared.served), id };
                    serve(stream, peer, &shared, id, &mine).await;
                    drop(permit);
                });
                registry.insert(id, (activity, task.abort_handle()));
            }
            Err(err) => {
                // Out of file descriptors and the like: back off instead of spinning.
                log::warn!("accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Takes a finished (or aborted) connection task out of the admission registry.
struct Leave {
    served: Registry,
    id: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        self.served.lock().remove(&self.id);
    }
}

/// Wakes a connection task waiting for a free buffer or queue slot.
struct NotifyWaker(Arc<Notify>);

impl SpaceWaker for NotifyWaker {
    fn wake(&self) {
        // `notify_one` stores a permit when nobody waits, so a wake between the task's failed
        // attempt and its `notified().await` is not lost.
        self.0.notify_one();
    }
}

/// Marks the connection closed however the task ends (error, EOF, or runtime shutdown).
struct CloseOnDrop(Arc<Connection>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// What every connection task of a server shares.
struct Shared {
    ingress: Arc<Ingress>,
    /// The v1 handshake (open servers), sent before the v2 offer; empty with a token.
    v1_handshake: Vec<u8>,
    token: Option<Vec<u8>>,
    layout: Layout,
    /// The largest hello body accepted (sized from `layout`).
    max_hello: usize,
    heartbeat: Option<Duration>,
    sessions: Sessions,
    session_timeout: Duration,
    /// Detached sessions kept at most (the oldest go first).
    max_sessions: usize,
    served: Registry,
    epoch: Instant,
    failures: Throttled,
    /// Offer the shared-memory path to clients on this host.
    shared_memory: bool,
    /// 0 while open; then the [`Closing`] reason of [`TcpServer::close`].
    closing: watch::Sender<u8>,
    /// The leaves v2 clients that take codecs send compressed over TCP.
    codecs: Option<Arc<LeafCodecs>>,
    /// The backend stores those leaves compressed so: queue the packed bytes with the
    /// decompressed sample, and it keeps them as they arrived.
    keep_packed: bool,
}

impl Shared {
    fn mode(&self) -> Mode {
        if self.token.is_some() {
            Mode::Token
        } else {
            Mode::Open
        }
    }
}

/// A v2 client's session: its ingress queue and how many of its samples are queued. It
/// outlives its connections, so a reconnecting client keeps its order and is deduplicated.
struct Session {
    conn: Arc<Connection>,
    space: Arc<Notify>,
    /// Sequence number of the next sample: samples of this session queued so far. Written
    /// only by the task that holds `owner`.
    next_seq: AtomicU64,
    /// Held by the one task that serves the session.
    owner: Arc<tokio::sync::Mutex<()>>,
    /// The admission id of that task, to end it when the client reconnects.
    serving: Mutex<Option<u64>>,
    /// When its last connection ended (`None` while one is served).
    detached_at: Mutex<Option<Instant>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Forgotten (expired, said goodbye, or the server stopped): what it queued is still
        // inserted; the queue is pruned once empty.
        self.conn.close();
    }
}

/// Every session by its id.
#[derive(Default)]
struct Sessions(Mutex<HashMap<[u8; 16], Arc<Session>>>);

/// How long a reconnecting client waits for its session's previous connection to end.
const TAKEOVER_GRACE: Duration = Duration::from_secs(5);
/// A strict prefix of a hello that stalls this long is taken as v1 sample data.
const PREFIX_GRACE: Duration = Duration::from_millis(200);
/// How long a client may take to send its hello once it started.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Forgets sessions whose client has not come back within `session_timeout`, and the oldest
/// detached ones beyond `max_sessions`.
async fn reap_sessions(shared: Arc<Shared>) {
    let period =
        (shared.session_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    loop {
        tokio::time::sleep(period).await;
        let mut sessions = shared.sessions.0.lock();
        let mut detached: Vec<(Instant, [u8; 16])> = sessions
            .iter()
            .filter_map(|(key, s)| s.detached_at.lock().map(|at| (at, *key)))
            .collect();
        detached.sort_unstable();
        let excess = detached.len().saturating_sub(shared.max_sessions);
        for (rank, (at, key)) in detached.into_iter().enumerate() {
            if rank < excess || at.elapsed() >= shared.session_timeout {
                sessions.remove(&key);
            }
        }
    }
}

/// Counts a connection in `active_connections` while its task runs.
struct Open<'a>(&'a Ingress);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.connection_ended();
    }
}

async fn serve(stream: TcpStream, peer: SocketAddr, shared: &Shared, id: u64, activity: &Activity) {
    shared.ingress.connection_opened();
    let _open = Open(&shared.ingress);
    match serve_inner(stream, peer, shared, id, activity).await {
        Ok(()) => log::debug!("{peer}: connection closed"),
        Err(err) if is_disconnect(&err) => log::debug!("{peer}: connection lost: {err}"),
        Err(err) => shared.failures.log(&format!("{peer}: connection failed: {err}")),
    }
}

/// Connection failures (refused handshakes, dead peers, protocol errors) logged at most once
/// per [`LOG_EVERY`] at WARNING, with how many were not: a peer retrying a wrong token must
/// not make the learner log (and take the GIL) once per attempt. The rest go to DEBUG; every
/// one is counted in the statistics.
#[derive(Default)]
struct Throttled(Mutex<(Option<Instant>, u64)>);

impl Throttled {
    fn log(&self, message: &str) {
        let mut state = self.0.lock();
        let (last, unlogged) = &mut *state;
        if last.is_some_and(|at| at.elapsed() < LOG_EVERY) {
            *unlogged += 1;
            log::debug!("{message}");
            return;
        }
        let more = std::mem::take(unlogged);
        *last = Some(Instant::now());
        drop(state);
        if more > 0 {
            log::warn!("{message} (and {more} more failed connections in the last {LOG_EVERY:?})");
        } else {
            log::warn!("{message}");
        }
    }
}

fn is_disconnect(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

async fn serve_inner(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    activity: &Activity,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let (reader, writer) = stream.into_split();
    let payload_size = shared.ingress.backend().spec().payload_size();
    let mut link = Link {
        reader,
        writer,
        staging: Vec::new(),
        lo: 0,
        hi: 0,
        // Allocated at the first read, so a connection that never sends holds no staging
        // memory.
        staging_len: STAGING.min(payload_size.saturating_mul(64)).max(1),
        acks: 0,
        beat: None,
        last_write: Instant::now(),
        last_heard: Instant::now(),
        activity,
        epoch: shared.epoch,
        closing: shared.closing.subscribe(),
    };
    let offer = Offer::new(shared.mode()).map_err(|e| io::Error::other(e.to_string()))?;
    let mut greeting = shared.v1_handshake.clone();
    greeting.extend_from_slice(&offer.encode());
    link.write(&greeting).await?;
    let ingress = &shared.ingress;
    match negotiate(&mut link, &offer, shared.max_hello).await {
        Ok(None) => Ok(()),
        Ok(Some(Opening::V1)) if shared.token.is_some() => {
            // It did not read our greeting as v1 (there was no v1 handshake), yet sends data.
            ingress.note(TransportEvent::RefusedProtocol);
            Err(invalid("sent v1 data to a server with a token (v2 only)".into()))
        }
        Ok(Some(Opening::V1)) => {
            ingress.note(TransportEvent::V1);
            let space = Arc::new(Notify::new());
            let conn = ingress.register(Box::new(NotifyWaker(Arc::clone(&space))));
            let _closer = CloseOnDrop(Arc::clone(&conn));
            match serve_v1(&mut link, &conn, &space).await {
                Err(err) if is_closing(&err) => {
                    link.closing_notice(false).await;
                    Ok(())
                }
                other => other,
            }
        }
        Ok(Some(Opening::Hello(hello, body, _))) => {
            match serve_v2(&mut link, peer, shared, id, &offer, &hello, &body).await {
                Err(err) if is_closing(&err) => {
                    link.closing_notice(hello.notices).await;
                    Ok(())
                }
                other => other,
            }
        }
        Ok(Some(Opening::NeedMore)) => unreachable!("negotiate returns whole openings"),
        // The peer went away (or reset) before it said anything we could judge.
        Err(EchoError::Io(err)) => Err(err),
        Err(err) => {
            ingress.note(TransportEvent::RefusedProtocol);
            link.refuse(Refusal::Protocol, &err.to_string()).await;
            Err(invalid(format!("refused: {err}")))
        }
    }
}

/// Reads the client's first bytes until they are v1 data or a whole v2 hello. `None`: the
/// client closed without sending anything.
async fn negotiate(
    link: &mut Link<'_>,
    offer: &Offer,
    max_hello: usize,
) -> Result<Option<Opening>, EchoError> {
    let mut received = Vec::new();
    let mut first_bytes_at = Instant::now();
    loop {
        match v2::parse_opening(&received, offer, max_hello)? {
            Opening::NeedMore => {}
            Opening::V1 => {
                link.stage(received);
                return Ok(Some(Opening::V1));
            }
            Opening::Hello(hello, body, len) => {
                link.stage(received.split_off(len));
                return Ok(Some(Opening::Hello(hello, body, len)));
            }
        }
        let mut chunk = [0u8; 4096];
        let read = link.reader.read(&mut chunk);
        // Nothing yet: a v1 worker may compute for a long time before its first sample.
        // Part of the nonce: a v2 client writes its hello at once, so a stall means v1 data
        // that happens to start like the nonce. The whole nonce (32 random hex digits, which
        // v1 data matches with probability 2^-128): a hello, however slowly it arrives, up to
        // HELLO_TIMEOUT after its first bytes.
        let n = if received.is_empty() {
            let n = read.await?;
            first_bytes_at = Instant::now();
            n
        } else if received.len() < v2::NONCE_LEN {
            match tokio::time::timeout(PREFIX_GRACE, read).await {
                Ok(n) => n?,
                Err(_) => {
                    link.stage(received);
                    return Ok(Some(Opening::V1));
                }
            }
        } else {
            let left = HELLO_TIMEOUT.saturating_sub(first_bytes_at.elapsed());
            match tokio::time::timeout(left, read).await {
                Ok(n) => n?,
                Err(_) => {
                    return Err(EchoError::Protocol(format!(
                        "the hello did not arrive within {HELLO_TIMEOUT:?} ({} bytes of it did)",
                        received.len()
                    )))
                }
            }
        };
        link.activity.read(link.epoch);
        if n == 0 {
            if received.is_empty() {
                return Ok(None);
            }
            if received.len() >= v2::NONCE_LEN {
                return Err(EchoError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("peer closed in its hello ({} bytes of it)", received.len()),
                )));
            }
            // v1 data that happens to start like the nonce, then the end of the stream: its
            // whole samples are still queued, the rest discarded, as for any v1 client.
            link.stage(received);
            return Ok(Some(Opening::V1));
        }
        received.extend_from_slice(&chunk[..n]);
    }
}

async fn serve_v1(link: &mut Link<'_>, conn: &Arc<Connection>, space: &Notify) -> io::Result<()> {
    let payload_size = conn.payload_size();
    loop {
        if link.read_in_place(conn).await? {
            link.acks += 1;
            link.activity.complete();
            continue;
        }
        let mut buf = link.buffer(conn, space).await?;
        if !link.fill(buf.bytes(), payload_size).await? {
            return Ok(());
        }
        link.push(conn, space, buf, None, None, StepMark::default()).await?;
        link.acks += 1;
        link.activity.complete();
    }
}

/// Ends a session's service when its task ends however it ends: the session waits for its
/// client to come back (or is forgotten after a goodbye).
struct Serving<'a> {
    shared: &'a Shared,
    key: [u8; 16],
    session: Arc<Session>,
    id: u64,
    goodbye: bool,
}

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        let mut serving = self.session.serving.lock();
        if *serving == Some(self.id) {
            *serving = None;
            if self.goodbye {
                self.shared.sessions.0.lock().remove(&self.key);
            } else {
                *self.session.detached_at.lock() = Some(Instant::now());
                self.session.conn.detach();
            }
        }
    }
}

async fn serve_v2(
    link: &mut Link<'_>,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    offer: &Offer,
    hello: &Hello,
    body: &[u8],
) -> io::Result<()> {
    let ingress = &shared.ingress;
    if let Some(token) = &shared.token {
        let why = if hello.mac.is_none() {
            Some("this echo server requires a token: pass token= or set ECHO_TOKEN")
        } else if !hello.verify(offer, token, body) {
            Some("wrong token: the client's proof does not match this server's token")
        } else {
            None
        };
        if let Some(why) = why {
            ingress.note(TransportEvent::RefusedAuth);
            link.refuse(Refusal::Auth, why).await;
            return Err(invalid(format!("refused: {why}")));
        }
    }
    if let Some(why) = shared.layout.mismatch(&hello.layout) {
        ingress.note(TransportEvent::RefusedLayout);
        let message =
            format!("the server at {} stores samples of another layout: {why}", link.local());
        link.refuse(Refusal::Layout, &message).await;
        return Err(invalid(format!("refused: {why}")));
    }
    // The session: created, or taken over from the connection that served it before.
    let (session, existed) = {
        let mut sessions = shared.sessions.0.lock();
        match sessions.get(&hello.session) {
            Some(session) => (Arc::clone(session), true),
            None => {
                let space = Arc::new(Notify::new());
                let conn = ingress.register(Box::new(NotifyWaker(Arc::clone(&space))));
                let session = Arc::new(Session {
                    conn,
                    space,
                    next_seq: AtomicU64::new(hello.first_seq),
                    owner: Arc::new(tokio::sync::Mutex::new(())),
                    serving: Mutex::new(None),
                    detached_at: Mutex::new(None),
                });
                sessions.insert(hello.session, Arc::clone(&session));
                (session, false)
            }
        }
    };
    let previous = session.serving.lock().take();
    if let Some(previous) = previous {
        if let Some((_, task)) = shared.served.lock().get(&previous) {
            // Its socket is half dead (the client already reconnected): end it. Its guard
            // releases `owner` once it stops at an await point.
            task.abort();
        }
    }
    let Ok(_owner) =
        tokio::time::timeout(TAKEOVER_GRACE, Arc::clone(&session.owner).lock_owned()).await
    else {
        return Err(invalid("the session's previous connection did not end in time".into()));
    };
    *session.serving.lock() = Some(id);
    *session.detached_at.lock() = None;
    let mut serving =
        Serving { shared, key: hello.session, session: Arc::clone(&session), id, goodbye: false };
    // ORDERING: Relaxed — `next_seq` is written only under `owner`, which we hold; the mutex
    // orders it after the previous holder's writes.
    let queued = session.next_seq.load(Relaxed);
    let resume_seq = queued.max(hello.first_seq);
    session.next_seq.store(resume_seq, Relaxed);
    ingress.note(TransportEvent::V2);
    if existed {
        ingress.note(TransportEvent::Resumed { deduplicated: resume_seq - hello.first_seq });
    }
    let own_ms = shared.heartbeat.map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX));
    let signed = shared.token.as_deref().map(|token| (token, hello, offer));
    let mut accept =
        v2::Accept::new(ingress.backend().has_priorities(), resume_seq, own_ms, signed);
    accept.steps = max_rows(ingress.backend());
    let mut channel = None;
    // Compressed frames over TCP to a client that takes them; a shared-memory client copies
    // raw (should it decline the channel, its frames come raw too).
    let codecs = shared.codecs.as_ref().filter(|_| hello.codecs && !hello.shm);
    accept.codecs = codecs.map(|c| c.as_slice().to_vec());
    if hello.shm {
        match shm_path::prepare(shared, peer, link) {
            Ok(prepared) => {
                accept.shm = Some(prepared.offer.clone());
                channel = Some(prepared);
            }
            Err(why) => {
                log::debug!("{peer}: no shared memory: {why}");
                ingress.note(TransportEvent::ShmFallback);
                accept.note = why;
            }
        }
    }
    link.write(&Reply::Accepted(accept).encode()).await?;
    link.beat = Beat::new(shared.heartbeat, hello.heartbeat_ms);
    log::debug!("{peer}: v2 session resumed at sample {resume_seq} (resumed: {existed})");
    if let Some(prepared) = channel {
        match shm_path::serve(link, shared, &session, prepared).await? {
            ShmEnd::Closed => return Ok(()),
            ShmEnd::Goodbye => {
                serving.goodbye = true;
                return Ok(());
            }
            ShmEnd::Declined => {
                log::debug!("{peer}: the client declined shared memory; frames over TCP");
                ingress.note(TransportEvent::ShmFallback);
            }
        }
    }
    serve_frames(link, shared, &session, &mut serving, codecs.map(|c| &**c)).await
}

/// The v2 frame loop: samples (with or without a priority), heartbeats and the goodbye.
async fn serve_frames(
    link: &mut Link<'_>,
    shared: &Shared,
    session: &Session,
    serving: &mut Serving<'_>,
    codecs: Option<&LeafCodecs>,
) -> io::Result<()> {
    let ingress = &shared.ingress;
    let (conn, space) = (&session.conn, &*session.space);
    let payload_size = conn.payload_size();
    // A compressed frame's body, read whole before it is decompressed into a buffer.
    let mut body = Vec::new();
    loop {
        let Some(kind) = link.next_byte().await? else { return Ok(()) };
        let len = match kind {
            v2::HEARTBEAT => continue,
            v2::BYE => {
                serving.goodbye = true;
                return Ok(());
            }
            other => match FrameMeta::rest_len(other & !packed_bit(other)) {
                Some(len) => len,
                None => return Err(link.fail(&format!("unknown frame type {other:#04x}")).await),
            },
        };
        let packed = packed_bit(kind) != 0;
        let kind = kind & !packed_bit(kind);
        let mut raw = [0u8; FrameMeta::MAX_HEADER];
        if len > 0 && !link.fill(&mut raw, len).await? {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
        }
        let meta = match check_frame(ingress.backend(), kind, &raw[..len]) {
            Ok(meta) => meta,
            Err(why) => return Err(link.fail(&why).await),
        };
        let (priority, mark) = (meta.priority, StepMark { row: meta.row, end: meta.end });
        if packed {
            let Some(codecs) = codecs else {
                let why = "a compressed frame, but this connection agreed on no codecs";
                return Err(link.fail(why).await);
            };
            let keep = shared.keep_packed;
            let (buf, kept) = match read_packed(link, conn, space, codecs, keep, &mut body).await? {
                Ok(read) => read,
                Err(why) => return Err(link.fail(&why).await),
            };
            ingress.note_compressed(body.len());
            link.push(conn, space, buf, kept, priority, mark).await?;
            // ORDERING: Relaxed — as below.
            session.next_seq.fetch_add(1, Relaxed);
            link.acks += 1;
            link.activity.complete();
            continue;
        }
        if priority.is_none() && !meta.is_step() && link.read_in_place(conn).await? {
            // ORDERING: Relaxed — as below.
            session.next_seq.fetch_add(1, Relaxed);
            link.acks += 1;
            link.activity.complete();
            continue;
        }
        let mut buf = link.buffer(conn, space).await?;
        if !link.fill(buf.bytes(), payload_size).await? {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
        }
        link.push(conn, space, buf, None, priority, mark).await?;
        // ORDERING: Relaxed — see above; pushed and counted with no await in between, so an
        // abort cannot separate them.
        session.next_seq.fetch_add(1, Relaxed);
        link.acks += 1;
        link.activity.complete();
    }
}

/// [`v2::PACKED`] if `kind` is a compressed sample frame (0x14..=0x17), else 0.
fn packed_bit(kind: u8) -> u8 {
    if (v2::SAMPLE | v2::PACKED..=v2::STEP_PRIORITY | v2::PACKED).contains(&kind) {
        v2::PACKED
    } else {
        0
    }
}

/// Reads a compressed frame's `body_len` and body (into `body`, reused) and decompresses it
/// into a pooled buffer. Returns the buffer and, with `keep`, the packed bytes (what a table
/// that stores the leaves compressed keeps; copied out only then), or, as `Err` inside, why
/// the frame is refused: a length above what these codecs can produce, or a body that does
/// not decompress to exactly the sample. Nothing beyond the cap is ever allocated.
async fn read_packed<'c>(
    link: &mut Link<'_>,
    conn: &'c Arc<Connection>,
    space: &Notify,
    codecs: &LeafCodecs,
    keep: bool,
    body: &mut Vec<u8>,
) -> io::Result<Result<(Pooled<'c>, Option<Box<[u8]>>), String>> {
    let mut len = [0u8; 4];
    if !link.fill(&mut len, 4).await? {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
    }
    let len = u32::from_le_bytes(len) as usize;
    let max = codecs.max_body();
    if len > max {
        return Ok(Err(format!(
            "a compressed frame of {len} bytes: these leaves compress to at most {max}"
        )));
    }
    body.resize(len, 0);
    if !link.fill(body, len).await? {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-frame"));
    }
    let mut buf = link.buffer(conn, space).await?;
    match codecs.unpack_body(body, buf.bytes()) {
        Ok(at) => Ok(Ok((buf, keep.then(|| Box::from(&body[at..]))))),
        Err(why) => Ok(Err(format!("a compressed frame that does not decode: {why}"))),
    }
}

/// The rows a client may send steps of: a sequence table's `max_streams` (capped to the
/// wire's u32); `None` for the other backends, which take no step frames.
fn max_rows(backend: &Backend) -> Option<u32> {
    backend.sequence().map(|s| u32::try_from(s.max_streams).unwrap_or(u32::MAX))
}

/// A sample frame's fields (the `rest_len` bytes after its kind), checked against what the
/// backend takes: a priority it accepts, steps only for a sequence table, rows below its
/// `max_rows`. The error says what was wrong, for the error frame.
fn check_frame(backend: &Backend, kind: u8, rest: &[u8]) -> Result<FrameMeta, String> {
    let meta = FrameMeta::decode(kind, rest).map_err(|e| e.to_string())?;
    check_meta(backend, &meta)?;
    Ok(meta)
}

/// What [`check_frame`] checks of a sample's fields, for frames and shared-memory slots alike.
fn check_meta(backend: &Backend, meta: &FrameMeta) -> Result<(), String> {
    if let Some(priority) = meta.priority {
        backend.check_priority(priority).map_err(|e| e.to_string())?;
    }
    if !meta.is_step() {
        return Ok(());
    }
    match max_rows(backend) {
        None => Err("steps of episodes (a row or an episode end) need a sequence table; this \
                     server did not offer them"
            .to_owned()),
        Some(max) if meta.row >= max => Err(format!(
            "row {} out of range: this sequence table takes rows 0 to {} per client \
             (Sequence(max_streams={max}))",
            meta.row,
            max - 1
        )),
        Some(_) => Ok(()),
    }
}

/// Fills `leaves` (one ring slot of every leaf, in order) with `staged` and then bytes read
/// from `reader`'s socket, which already holds them (see `Link::read_in_place`). Reads with
/// `readv` on the non-blocking descriptor, bypassing tokio's readiness (tokio finds out at
/// its next read, which then waits for the next event as usual). Should the kernel return
/// fewer bytes than it said it had, waits up to [`IN_PLACE_GRACE`] for the rest; failing
/// that the rest is zeroed and an error returned (the slot must be committed either way).
#[cfg(unix)]
fn fill_in_place(
    reader: &OwnedReadHalf,
    staged: &[u8],
    leaves: &mut [&mut [u8]],
) -> io::Result<()> {
    use std::io::IoSliceMut;
    use std::os::fd::AsRawFd;
    let fd = reader.as_ref().as_raw_fd();
    // Skip past the staged bytes, copying them in.
    let (mut leaf, mut at) = (0, 0);
    let mut rest = staged;
    while !rest.is_empty() {
        let dst = &mut leaves[leaf][at..];
        let n = dst.len().min(rest.len());
        dst[..n].copy_from_slice(&rest[..n]);
        (rest, at) = (&rest[n..], at + n);
        if at == leaves[leaf].len() {
            (leaf, at) = (leaf + 1, 0);
        }
    }
    let deadline = Instant::now() + IN_PLACE_GRACE;
    loop {
        while leaf < leaves.len() && at == leaves[leaf].len() {
            (leaf, at) = (leaf + 1, 0);
        }
        if leaf == leaves.len() {
            return Ok(());
        }
        let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(leaves.len() - leaf);
        let (first, later) = leaves[leaf..].split_at_mut(1);
        slices.push(IoSliceMut::new(&mut first[0][at..]));
        slices.extend(later.iter_mut().map(|l| IoSliceMut::new(l)));
        let count = slices.len().min(1024) as libc::c_int; // IOV_MAX on Linux and macOS
                                                           // SAFETY: `IoSliceMut` is ABI-compatible with `iovec` on unix; the slices are
                                                           // `count` valid, writable, non-overlapping buffers borrowed for this call.
        let got = unsafe { libc::readv(fd, slices.as_ptr().cast::<libc::iovec>(), count) };
        drop(slices);
        let err = match got {
            n if n > 0 => {
                let mut n = n as usize;
                while n > 0 {
                    let room = leaves[leaf].len() - at;
                    let step = room.min(n);
                    (at, n) = (at + step, n - step);
                    if at == leaves[leaf].len() && n > 0 {
                        (leaf, at) = (leaf + 1, 0);
                    }
                }
                continue;
            }
            0 => io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed mid-sample"),
            _ => io::Error::last_os_error(),
        };
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock if Instant::now() < deadline => {
                let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid `pollfd`; a bounded wait on a descriptor we own.
                unsafe { libc::poll(&mut poll, 1, 10) };
            }
            _ => {
                for rest in leaves[leaf..].iter_mut() {
                    rest[at..].fill(0);
                    at = 0;
                }
                return Err(err);
            }
        }
    }
}

/// The shared-memory path of a v2 connection: offered in the reply, attached over a Unix
/// socket, then inserted straight from the segment into the backend (queued while it is
/// full). See [`super::shm`].
/// Why a server started with `TcpTransport(shared_memory=False)` offers no shared memory.
const SHM_OFF: &str = "the server has shared memory turned off (TcpTransport(shared_memory=False))";

/// How the shared-memory part of a connection ended (off Linux only ever `Declined`).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
enum ShmEnd {
    /// The client closed the connection (every committed sample was taken).
    Closed,
    /// The client said goodbye (every committed sample was taken).
    Goodbye,
    /// The client could not attach; it sends frames instead.
    Declined,
}

#[cfg(target_os = "linux")]
mod shm_path {
    /// How long a channel refused by the backend waits for its bell before it tries again
    /// anyway (see `wait_for_room`).
    const ROOM_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

    use std::io;
    use std::net::SocketAddr;
    use std::os::fd::{AsFd, AsRawFd};
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::{Duration, Instant};

    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;
    use tokio::net::{UnixListener, UnixStream};

    use super::{
        check_meta, closed, Link, ServerClosing, Session, Shared, ShmEnd as End, Woke, NEVER,
        SHM_OFF,
    };
    use crate::error::EchoError;
    use crate::ingress::TransportEvent;
    use crate::ingress::{Connection, Ingress, SegmentReservation};
    use crate::sync::AsyncBell;
    use crate::transport::shm::{self, Reader, Samples};
    use crate::transport::wire::v2::{self, ShmOffer};

    /// How long a client has to attach the channel it was offered.
    const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
    /// How long an attaching peer has to present its nonce.
    const NONCE_TIMEOUT: Duration = Duration::from_secs(2);
    /// Peers refused (wrong uid or nonce) before the offer is withdrawn.
    const MAX_ATTEMPTS: usize = 8;

    /// A channel offered and not attached yet. The segment itself is created only for a
    /// peer that proved itself (`hand_over`): any local process can ask for an offer over
    /// TCP, and ~8 MiB of reserved pages per ask would be a cheap way to exhaust memory.
    pub(super) struct Prepared {
        pub(super) offer: ShmOffer,
        payload_size: usize,
        /// Bytes of the segment it will get ([`shm::segment_len`]).
        segment_len: usize,
        listener: UnixListener,
    }

    /// A channel for `peer`, or why it cannot have one.
    pub(super) fn prepare(
        shared: &Shared,
        peer: SocketAddr,
        link: &Link<'_>,
    ) -> Result<Prepared, String> {
        if !shared.shared_memory {
            return Err(SHM_OFF.into());
        }
        let local = link.local_addr().map_err(|e| format!("no local address: {e}"))?;
        if !shm::same_host(peer.ip(), local.ip()) {
            return Err(format!(
                "the client ({}) is not on the learner's host ({})",
                peer.ip(),
                local.ip()
            ));
        }
        let payload_size = shared.ingress.backend().spec().payload_size();
        let segment_len =
            shm::segment_len(payload_size).ok_or("samples too large for a segment")?;
        if let Some(why) = shared.ingress.segment_shortfall(segment_len) {
            return Err(why);
        }
        let name = shm::random_name().map_err(|e| e.to_string())?;
        let listener = shm::listen(&name)
            .and_then(UnixListener::from_std)
            .map_err(|e| format!("cannot listen on a Unix socket: {e}"))?;
        let nonce = v2::random().map_err(|e| e.to_string())?;
        Ok(Prepared { offer: ShmOffer { name, nonce }, payload_size, segment_len, listener })
    }

    /// Waits for the client to attach (or decline), then serves the channel until the client
    /// leaves.
    pub(super) async fn serve(
        link: &mut Link<'_>,
        shared: &Shared,
        session: &Session,
        prepared: Prepared,
    ) -> io::Result<End> {
        let Prepared { offer, payload_size, segment_len, listener } = prepared;
        let deadline = tokio::time::Instant::now() + ATTACH_TIMEOUT;
        let mut attempts = 0;
        let (mut reader, _reservation) = loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, _) = accepted?;
                    let segment = (&*shared.ingress, segment_len);
                    match hand_over(&stream, &offer, payload_size, segment).await {
                        Ok(attached) => break attached,
                        Err(why) => {
                            log::warn!("refused a shared-memory attach: {why}");
                            attempts += 1;
                            if attempts >= MAX_ATTEMPTS {
                                return Err(link.fail("too many refused shared-memory attaches").await);
                            }
                        }
                    }
                }
                byte = link.next_byte() => match byte? {
                    None => return Ok(End::Closed),
                    Some(v2::HEARTBEAT) => {}
                    Some(v2::BYE) => return Ok(End::Goodbye),
                    Some(v2::SHM_DECLINE) => return Ok(End::Declined),
                    Some(other) => {
                        return Err(link
                            .fail(&format!("frame type {other:#04x} before the shared memory was attached"))
                            .await)
                    }
                },
                () = tokio::time::sleep_until(deadline) => {
                    return Err(link
                        .fail(&format!("the shared memory was not attached within {ATTACH_TIMEOUT:?}"))
                        .await)
                }
            }
        };
        drop(listener);
        shared.ingress.note(TransportEvent::Shm);
        drain(link, shared, session, &mut reader).await
    }

    /// Checks an attaching peer (same uid as ours, the right nonce), then reserves the
    /// segment's bytes in the ingress's budget, creates the segment and the bells, and sends
    /// them to it. The reservation lives as long as the segment.
    async fn hand_over(
        stream: &UnixStream,
        offer: &ShmOffer,
        payload_size: usize,
        (ingress, segment_len): (&Ingress, usize),
    ) -> Result<(Reader, SegmentReservation), String> {
        let uid = shm::peer_uid(stream.as_fd()).map_err(|e| format!("no peer credentials: {e}"))?;
        if uid != shm::own_uid() {
            return Err(format!("the peer runs as uid {uid}, the learner as {}", shm::own_uid()));
        }
        let mut nonce = [0u8; v2::SHM_NONCE_LEN];
        let read = async {
            let mut at = 0;
            while at < nonce.len() {
                stream.readable().await?;
                match stream.try_read(&mut nonce[at..]) {
                    Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                    Ok(n) => at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(NONCE_TIMEOUT, read).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("no nonce: {e}")),
            Err(_) => return Err(format!("no nonce within {NONCE_TIMEOUT:?}")),
        }
        // Constant time: every byte is compared.
        if nonce.iter().zip(&offer.nonce).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 {
            return Err("wrong nonce".into());
        }
        let reservation = ingress.reserve_segment(segment_len)?;
        let reader =
            Reader::new(payload_size).map_err(|e| format!("cannot create the segment: {e}"))?;
        let fds = reader.fds();
        loop {
            stream.writable().await.map_err(|e| e.to_string())?;
            match stream.try_io(Interest::WRITABLE, || {
                shm::send_fds(stream.as_raw_fd(), shm::ATTACH_MESSAGE, &fds)
            }) {
                Ok(()) => return Ok((reader, reservation)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(format!("cannot send the segment: {e}")),
            }
        }
    }

    /// Takes every committed sample, in order, and sleeps on the data bell (or the TCP
    /// connection) when there are none. Ends when the client leaves, once every committed
    /// sample is taken.
    ///
    /// A sample is taken (the worker's acknowledgement) when it is inserted into the backend,
    /// straight from the segment: one copy, always. While the backend has no room (or a
    /// restore or checkpoint holds inserts) the samples wait in the segment and this task on
    /// the backend's insert bell, never a thread; the worker's own ring then fills and its
    /// `send` waits, as a TCP worker's does when its window is full. The session's ingress
    /// queue is not used, so nothing of this connection is ever queued behind the backend.
    async fn drain(
        link: &mut Link<'_>,
        shared: &Shared,
        session: &Session,
        reader: &mut Reader,
    ) -> io::Result<End> {
        let ingress = &shared.ingress;
        let backend = ingress.backend();
        let conn = &session.conn;
        let mut leaves = Vec::new();
        let mut offset = 0;
        for array in backend.spec().arrays() {
            leaves.push((offset, array.num_bytes()));
            offset += array.num_bytes();
        }
        // SAFETY: the `EventFd` owns its descriptor (an `OwnedFd`, a fresh duplicate) and
        // neither closes nor replaces it while the `AsyncFd` owns it; `as_raw_fd` always
        // returns that one descriptor.
        let data = unsafe {
            AsyncFd::register_with_interest(reader.data.try_clone()?, Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        let mut metas = Vec::with_capacity(reader.slots());
        let mut ending = None;
        // The segment is this connection's queue: what it holds counts as queued and pending
        // (as of each look), and nothing once the channel ends, however it ends.
        let _look = SegmentLook(conn);
        loop {
            // A worker that keeps the segment busy never makes this task wait for it: the
            // server's closing is looked at here too.
            if *link.closing.borrow() != 0 {
                return Err(io::Error::other(ServerClosing));
            }
            let available = match reader.available() {
                Ok(n) => n,
                Err(corrupt) => return Err(link.fail(&corrupt.to_string()).await),
            };
            conn.note_segment_depth(available);
            if available > 0 {
                // Every header first (copied out, then checked): a bad one ends the channel
                // before any sample of this run goes in.
                metas.clear();
                for seq in reader.head()..reader.head() + available {
                    match reader.check(seq) {
                        Ok(meta) => metas.push(meta),
                        Err(why) => {
                            return Err(link.fail(&format!("shared-memory slot: {why}")).await)
                        }
                    }
                }
                for meta in &metas {
                    if let Err(why) = check_meta(backend, meta) {
                        return Err(link.fail(&why).await);
                    }
                    conn.note_row(meta.row);
                }
                let bell = backend.insert_bell();
                let mut done = 0;
                while done < metas.len() {
                    // Straight from the segment into the backend, without waiting. When it
                    // has no room the rest stay in the segment, untaken: the worker's ring
                    // fills and its `send` waits, which is the backpressure, and every
                    // sample is still copied once. The bell is read before the insert, so
                    // room freed in between is not missed.
                    let rung = bell.rung();
                    let samples = Samples::new(reader, reader.head(), &metas[done..], &leaves)
                        .with_streams(conn.stream(0));
                    // Counted as the backend takes them in, before the commit that can wake
                    // the consumer (as a drainer counts), never after the insert returns.
                    let (inserted, error) =
                        match backend.insert(&conn.direct(samples), None, Some(Instant::now())) {
                            Ok(()) => (metas.len() - done, None),
                            Err(e) => (e.inserted, Some(e.error)),
                        };
                    done += inserted;
                    if inserted > 0 {
                        // Working before the worker sees its samples taken (acknowledged):
                        // an acknowledged connection is never evicted as idle.
                        link.activity.complete();
                    }
                    reader.advance_by(inserted as u64);
                    // ORDERING: Relaxed — as in `serve_frames`: written only under `owner`.
                    session.next_seq.fetch_add(inserted as u64, Relaxed);
                    match error {
                        None => {}
                        Some(EchoError::TimedOut) => {
                            // What a drainer's insert would have spent waiting inside the
                            // backend, this task spends here: counted the same way (a replay
                            // table's `insert_blocked_ns`). A timeout that was only the
                            // table's lock being busy counts too; the wait is short then.
                            // The segment's depth as the wait starts and ends (what the
                            // worker committed meanwhile is queued too), as a drainer's round
                            // records its queues' depths.
                            look(reader, conn);
                            let waited = Instant::now();
                            let woke = wait_for_room(link, conn, bell, rung).await;
                            // The backend's wait (ring or rate limiter), and backpressure on
                            // the worker: its segment was not taken from meanwhile.
                            backend.note_insert_blocked(waited.elapsed());
                            conn.note_blocked_for(waited.elapsed());
                            woke?;
                            look(reader, conn);
                        }
                        Some(EchoError::Closed) => return Ok(End::Closed),
                        Some(other) => return Err(link.fail(&other.to_string()).await),
                    }
                    // Busy taking samples we write nothing else: heartbeats keep the client's
                    // watch quiet.
                    keep_beating(link).await;
                }
                continue;
            }
            if let Some(end) = ending {
                return Ok(end);
            }
            reader.sleep_begin();
            if reader.available().map_or(true, |n| n > 0) {
                reader.sleep_end();
                continue;
            }
            let byte = tokio::select! {
                byte = link.next_byte() => Some(byte?),
                ready = data.readable() => {
                    let mut guard = ready?;
                    reader.data.drain();
                    guard.clear_ready();
                    None
                }
            };
            reader.sleep_end();
            match byte {
                None | Some(Some(v2::HEARTBEAT)) => {}
                // Whatever the client committed before it left goes in first.
                Some(None) => ending = Some(End::Closed),
                Some(Some(v2::BYE)) => ending = Some(End::Goodbye),
                Some(Some(v2::SHM_DECLINE)) if reader.head() == 0 => {
                    if reader.available().map_or(true, |n| n > 0) {
                        return Err(link
                            .fail("declined shared memory after committing samples to it")
                            .await);
                    }
                    return Ok(End::Declined);
                }
                Some(Some(other)) => {
                    return Err(link
                        .fail(&format!("frame type {other:#04x} on a shared-memory connection"))
                        .await)
                }
            }
        }
    }

    /// Records how many samples `reader`'s segment holds committed and not yet taken (a
    /// corrupt tail is left to the next look, which ends the channel).
    fn look(reader: &Reader, conn: &Connection) {
        if let Ok(committed) = reader.available() {
            conn.note_segment_depth(committed);
        }
    }

    /// Zeroes its connection's segment depth when the channel's task ends (returns, fails or
    /// is cancelled): samples left in the segment never go in.
    struct SegmentLook<'a>(&'a Connection);

    impl Drop for SegmentLook<'_> {
        fn drop(&mut self) {
            self.0.note_segment_depth(0);
        }
    }

    /// Waits until the backend rings after `rung` (room, a thaw, the end of a restore, or
    /// its close), or [`ROOM_RETRY`] has passed, sending heartbeats meanwhile; the server's
    /// closing ends the wait (the error [`super::is_closing`] knows).
    ///
    /// The retry: an insert that does not wait also times out when the table's lock is
    /// merely busy, and then nothing may ring (the consumer that held it may be waiting for
    /// inserts itself). Trying again after a short while turns that into a delay, never a
    /// stall; a real refusal is seen under the lock and rung for as before.
    async fn wait_for_room(
        link: &mut Link<'_>,
        conn: &Connection,
        bell: &AsyncBell,
        rung: u64,
    ) -> io::Result<()> {
        conn.note_blocked();
        let retry = tokio::time::sleep(ROOM_RETRY);
        tokio::pin!(retry);
        loop {
            let every = link.beat.map(|beat| beat.every);
            let woke = tokio::select! {
                () = bell.rung_since(rung) => Woke::Done(()),
                () = &mut retry => Woke::Done(()),
                () = closed(&mut link.closing) => Woke::Closing,
                () = tokio::time::sleep(every.unwrap_or(NEVER)), if every.is_some() => Woke::Beat,
            };
            match woke {
                Woke::Done(()) => return Ok(()),
                Woke::Closing => return Err(io::Error::other(ServerClosing)),
                Woke::Beat => keep_beating(link).await,
            }
        }
    }

    /// A heartbeat if one is due. The samples a worker committed are taken even after its
    /// socket is gone (a worker killed while the ring was full, say), as TCP bytes already
    /// in the kernel are read after their sender died: a heartbeat that cannot be written
    /// stops the heartbeats, not the channel. The end of the stream ends it, once every
    /// committed sample is in.
    async fn keep_beating(link: &mut Link<'_>) {
        if let Err(err) = link.tick(false).await {
            log::debug!("the shared-memory worker's connection is gone ({err}); taking the rest");
            link.beat = None;
        }
    }
}

#[cfg(not(unix))]
fn fill_in_place(_: &OwnedReadHalf, _: &[u8], _: &mut [&mut [u8]]) -> io::Result<()> {
    unreachable!("Link::readable_bytes is None off unix, so nothing is read in place")
}

/// How long `fill_in_place` waits for bytes FIONREAD promised and a read did not return.
const IN_PLACE_GRACE: Duration = Duration::from_secs(1);

/// Platforms without the shared-memory path: every request falls back to TCP.
#[cfg(not(target_os = "linux"))]
mod shm_path {
    use std::io;
    use std::net::SocketAddr;

    use super::{Link, Session, Shared, ShmEnd as End, SHM_OFF};
    use crate::transport::wire::v2::ShmOffer;

    pub(super) struct Prepared {
        pub(super) offer: ShmOffer,
    }

    pub(super) fn prepare(
        shared: &Shared,
        _: SocketAddr,
        _: &Link<'_>,
    ) -> Result<Prepared, String> {
        Err(if shared.shared_memory {
            "the server's platform has no shared-memory path (Linux only)"
        } else {
            SHM_OFF
        }
        .into())
    }

    pub(super) async fn serve(
        _: &mut Link<'_>,
        _: &Shared,
        _: &Session,
        _: Prepared,
    ) -> io::Result<End> {
        Ok(End::Declined)
    }
}

/// A pooled buffer being filled; given back to its connection if the task stops first (an
/// aborted task must not keep its share of the byte budget).
struct Pooled<'c> {
    conn: &'c Connection,
    buf: Option<Box<[u8]>>,
}

impl Pooled<'_> {
    fn bytes(&mut self) -> &mut [u8] {
        self.buf.as_mut().expect("present until pushed")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.conn.return_buffer(buf);
        }
    }
}

/// One connection's socket: buffered reads, batched acks and heartbeats.
struct Link<'a> {
    reader: OwnedReadHalf,
    writer: OwnedWriteHalf,
    staging: Vec<u8>,
    /// Unread bytes are `staging[lo..hi]`.
    lo: usize,
    hi: usize,
    staging_len: usize,
    /// Samples queued and not yet acknowledged.
    acks: usize,
    beat: Option<Beat>,
    last_write: Instant,
    last_heard: Instant,
    activity: &'a Activity,
    epoch: Instant,
    /// The server's closing state (see [`TcpServer::close`]).
    closing: watch::Receiver<u8>,
}

/// Resolves once the server is closing (never, if its state is dropped first).
async fn closed(closing: &mut watch::Receiver<u8>) {
    if closing.wait_for(|state| *state != 0).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The error a connection ends with when the server closes (see [`is_closing`]).
#[derive(Debug)]
struct ServerClosing;

impl std::fmt::Display for ServerClosing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the server is closing")
    }
}

impl std::error::Error for ServerClosing {}

fn is_closing(err: &io::Error) -> bool {
    err.get_ref().is_some_and(|inner| inner.is::<ServerClosing>())
}

/// What a connection waiting for its client (or for space) woke up to.
enum Woke<T> {
    Done(T),
    Closing,
    Beat,
}

impl Link<'_> {
    /// Our address on this connection.
    #[cfg(target_os = "linux")]
    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.writer.local_addr()
    }

    fn local(&self) -> String {
        self.writer.local_addr().map_or_else(|_| "?".into(), |a| a.to_string())
    }

    /// Bytes read during negotiation that belong to the stream.
    fn stage(&mut self, bytes: Vec<u8>) {
        (self.lo, self.hi) = (0, bytes.len());
        if !bytes.is_empty() {
            self.staging = bytes;
            let len = self.staging_len.max(self.staging.len());
            self.staging.resize(len, 0);
        }
    }

    async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.writer.write_all(bytes).await?;
        self.last_write = Instant::now();
        Ok(())
    }

    /// Writes the pending acks, as runs of ack bytes.
    async fn flush(&mut self) -> io::Result<()> {
        const ACKS: [u8; 4096] = [ACK; 4096];
        while self.acks > 0 {
            let n = self.acks.min(ACKS.len());
            self.writer.write_all(&ACKS[..n]).await?;
            self.acks -= n;
            self.last_write = Instant::now();
        }
        Ok(())
    }

    /// Refuses the hello with `why` (best effort: the peer may be gone).
    async fn refuse(&mut self, why: Refusal, message: &str) {
        let _ = self.write(&Reply::Refused(why, message.into()).encode()).await;
        let _ = self.writer.shutdown().await;
    }

    /// Tells a v2 peer why we close (after its acks), and returns the error to end with.
    async fn fail(&mut self, message: &str) -> io::Error {
        if self.flush().await.is_ok() {
            let _ = self.write(&v2::encode_error(message)).await;
            let _ = self.writer.shutdown().await;
        }
        invalid(message.into())
    }

    /// Between awaits for the peer or for space: a heartbeat if we have been quiet, an error
    /// if the peer has been silent too long (`reading`: only while we wait for it).
    async fn tick(&mut self, reading: bool) -> io::Result<()> {
        let Some(beat) = self.beat else { return Ok(()) };
        if let Some(dead_after) = beat.dead_after {
            if reading && self.last_heard.elapsed() >= dead_after {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no heartbeat from the client for {dead_after:?}"),
                ));
            }
        }
        if self.last_write.elapsed() >= beat.every {
            self.flush().await?;
            self.write(&[v2::BEAT]).await?;
        }
        Ok(())
    }

    /// One socket read into `target`, or into the staging buffer when `target` is `None`;
    /// acks are flushed first (we are about to block). 0 at end of stream.
    async fn read(&mut self, mut target: Option<&mut [u8]>) -> io::Result<usize> {
        self.flush().await?;
        loop {
            let into: &mut [u8] = match target.as_deref_mut() {
                Some(t) => t,
                None => {
                    if self.staging.is_empty() {
                        self.staging = vec![0u8; self.staging_len];
                    }
                    &mut self.staging
                }
            };
            let every = self.beat.map(|beat| beat.every);
            let woke = tokio::select! {
                n = self.reader.read(into) => Woke::Done(n),
                () = closed(&mut self.closing) => Woke::Closing,
                () = tokio::time::sleep(every.unwrap_or(NEVER)), if every.is_some() => {
                    Woke::Beat
                }
            };
            let n = match woke {
                Woke::Done(n) => n?,
                Woke::Closing => return Err(io::Error::other(ServerClosing)),
                Woke::Beat => {
                    self.tick(true).await?;
                    continue;
                }
            };
            self.activity.read(self.epoch);
            self.last_heard = Instant::now();
            if target.is_none() {
                (self.lo, self.hi) = (0, n);
            }
            return Ok(n);
        }
    }

    /// The next byte of the stream; `None` at a clean end of stream.
    async fn next_byte(&mut self) -> io::Result<Option<u8>> {
        if self.lo == self.hi && self.read(None).await? == 0 {
            return Ok(None);
        }
        self.lo += 1;
        Ok(Some(self.staging[self.lo - 1]))
    }

    /// Fills `buf` (`len` bytes) from the stream: `false` if the stream ended before its
    /// first byte; an `UnexpectedEof` error if it ended after (a partial sample is never
    /// queued). Reads of at least half the staging size go straight into `buf`.
    async fn fill(&mut self, buf: &mut [u8], len: usize) -> io::Result<bool> {
        let mut filled = 0;
        while filled < len {
            if self.lo < self.hi {
                let n = (self.hi - self.lo).min(len - filled);
                buf[filled..filled + n].copy_from_slice(&self.staging[self.lo..self.lo + n]);
                (self.lo, filled) = (self.lo + n, filled + n);
                continue;
            }
            let direct = len - filled >= self.staging_len / 2;
            let n = if direct {
                self.read(Some(&mut buf[filled..len])).await?
            } else {
                self.read(None).await?
            };
            if n == 0 {
                return if filled == 0 {
                    Ok(false)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("peer closed mid-sample ({filled} of {len} bytes)"),
                    ))
                };
            }
            if direct {
                filled += n;
            }
        }
        Ok(true)
    }

    /// Reads the next sample from the socket straight into a free slot of the FIFO ring
    /// ([`Connection::try_insert_in_place`]), skipping the pooled buffer and the drainer's
    /// copy. Only for samples large enough to be read with their own system call anyway (at
    /// least half the staging buffer), and only when the kernel already holds all of the
    /// sample's bytes (FIONREAD, plus what is staged), so the read cannot wait: a slow peer
    /// never holds a ring slot. `false` (nothing read) when that does not hold, when the ring
    /// has no free slot or something of this connection is still queued: read it into a
    /// pooled buffer then.
    ///
    /// # Errors
    /// Only if the kernel returns fewer bytes than FIONREAD promised (it must not): the slot
    /// is committed anyway (it cannot be taken back), its missing bytes zero, the error
    /// logged, and the connection ends.
    async fn read_in_place(&mut self, conn: &Connection) -> io::Result<bool> {
        let len = conn.payload_size();
        if len < self.staging_len / 2 {
            return Ok(false);
        }
        let staged = self.hi - self.lo;
        let Some(mut in_kernel) = self.readable_bytes() else { return Ok(false) };
        if staged == 0 && in_kernel == 0 {
            // Idle: wait for the peer here rather than in a read into a pooled buffer, so a
            // sample that arrives whole (one segment, or a burst) still goes in place.
            self.wait_readable().await?;
            in_kernel = self.readable_bytes().unwrap_or(0);
        }
        if staged.saturating_add(in_kernel) < len {
            return Ok(false);
        }
        let from_staging = staged.min(len);
        let staging = &self.staging[self.lo..self.lo + from_staging];
        let reader = &self.reader;
        let mut read = Ok(());
        if !conn.try_insert_in_place(|leaves| read = fill_in_place(reader, staging, leaves)) {
            return Ok(false);
        }
        self.lo += from_staging;
        if from_staging < len {
            self.activity.read(self.epoch);
            self.last_heard = Instant::now();
        }
        if let Err(err) = &read {
            log::error!("echo: a sample read in place came up short and was zeroed: {err}");
        }
        read.map(|()| true)
    }

    /// Waits until the socket has something to read (or its end), flushing acks first and
    /// sending heartbeats meanwhile, like [`Link::read`].
    async fn wait_readable(&mut self) -> io::Result<()> {
        self.flush().await?;
        loop {
            let readable = self.reader.as_ref().readable();
            match self.beat {
                None => return readable.await,
                Some(beat) => match tokio::time::timeout(beat.every, readable).await {
                    Ok(ready) => return ready,
                    Err(_) => self.tick(true).await?,
                },
            }
        }
    }

    /// Bytes waiting in the socket's receive buffer (FIONREAD); `None` if it cannot say.
    #[cfg(unix)]
    fn readable_bytes(&self) -> Option<usize> {
        use std::os::fd::AsRawFd;
        let fd = self.reader.as_ref().as_raw_fd();
        let mut bytes: libc::c_int = 0;
        // SAFETY: FIONREAD on a socket descriptor we own writes one `c_int` to `bytes`.
        let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut bytes) };
        (rc == 0).then(|| usize::try_from(bytes).unwrap_or(0))
    }

    #[cfg(not(unix))]
    fn readable_bytes(&self) -> Option<usize> {
        None
    }

    /// Waits for space (a buffer or a queue slot), sending heartbeats meanwhile.
    async fn wait_space(&mut self, conn: &Connection, space: &Notify) -> io::Result<()> {
        self.flush().await?;
        conn.note_blocked();
        let waited = Instant::now();
        let every = self.beat.map(|beat| beat.every);
        let woke = tokio::select! {
            () = space.notified() => Woke::Done(()),
            () = closed(&mut self.closing) => Woke::Closing,
            () = tokio::time::sleep(every.unwrap_or(NEVER)), if every.is_some() => {
                Woke::Beat
            }
        };
        conn.note_blocked_for(waited.elapsed());
        match woke {
            Woke::Done(()) => Ok(()),
            Woke::Closing => Err(io::Error::other(ServerClosing)),
            Woke::Beat => self.tick(false).await,
        }
    }

    /// Ends the connection because the server closes: flushes the acks, tells a client that
    /// understands it why ([`v2::CLOSING`]), half-closes, and reads (discarding) until the
    /// client hangs up or [`NOTICE_GRACE`] passes, so that unread bytes do not make the
    /// kernel reset the connection over acks still on their way.
    async fn closing_notice(&mut self, notices: bool) {
        let why = *self.closing.borrow();
        if self.flush().await.is_err() {
            return;
        }
        if notices && self.write(&[v2::CLOSING, why]).await.is_err() {
            return;
        }
        let _ = self.writer.shutdown().await;
        let mut sink = [0u8; 4096];
        let _ = tokio::time::timeout(NOTICE_GRACE, async {
            while matches!(self.reader.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }

    /// A buffer to fill, waiting for one if the pool is empty.
    async fn buffer<'c>(
        &mut self,
        conn: &'c Arc<Connection>,
        space: &Notify,
    ) -> io::Result<Pooled<'c>> {
        loop {
            if let Some(buf) = conn.take_buffer() {
                return Ok(Pooled { conn, buf: Some(buf) });
            }
            self.wait_space(conn, space).await?;
        }
    }

    /// Queues a filled buffer (with `packed`, the sample's compressed leaves as they arrived,
    /// for a table that stores them so), waiting while the queue is full.
    async fn push(
        &mut self,
        conn: &Connection,
        space: &Notify,
        mut pooled: Pooled<'_>,
        mut packed: Option<Box<[u8]>>,
        priority: Option<f64>,
        mark: StepMark,
    ) -> io::Result<()> {
        let mut buf = pooled.buf.take().expect("present until pushed");
        loop {
            match conn.try_push_packed(buf, packed.take(), priority, mark) {
                Ok(()) => return Ok(()),
                Err((back, kept)) => {
                    packed = kept;
                    // Back in the guard while we wait: an abort gives it back to the pool.
                    pooled.buf = Some(back);
                    self.wait_space(conn, space).await?;
                    buf = pooled.buf.take().expect("put back above");
                }
            }
        }
    }
}
