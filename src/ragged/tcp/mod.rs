//! The TCP ingress of a ragged table: wire v2's handshake, then group frames
//! ([`super::wire`]), each stored with [`RaggedTable::insert_group`] and acknowledged one byte
//! per sample once stored.
//!
//! One thread per connection, blocking sockets: a connection whose table is full stops
//! reading, and TCP's flow control holds its worker back. A same-host worker's
//! shared-memory pipe is served by a pump (`pump.rs`: a few threads for every pipe) while its
//! frames come whole, and by its connection's thread otherwise. The frame header is checked
//! against the spec before the body is read, so a connection holds at most one valid frame
//! (a batch of the largest samples) in memory. v1 clients (id-echo 0.2.1) cannot describe a
//! ragged leaf: the server sends them no v1 handshake and refuses what they send, naming the
//! ragged leaves in its log.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::spec::Column;
use super::table::{GroupSource, RaggedExport, RaggedTable, SampleIn};
use super::wire::Head;
use super::wire::{
    decode_head, head_len, is_packed, GROUP, GROUP_PACKED, GROUP_PACKED_PRIORITY, GROUP_PRIORITY,
};
use crate::codec::Codec;
use crate::error::EchoError;
use crate::params::Params;
use crate::transport::wire::params;
use crate::transport::wire::v2::{self, Closing, Layout};

/// How long a write to a worker may block before the connection is given up.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client has to complete its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The most bytes of body buffer a connection keeps between frames.
const IDLE_BODY: usize = 64 * 1024;
/// A connection's read buffer: many small frames per `recv`.
const READ_BUFFER: usize = 64 * 1024;
/// Acknowledgements sent at the latest after this many samples, even while frames keep
/// arriving.
const ACK_BATCH: usize = 256;
/// How often a connection blocked on a full table looks at whether the server is closing.
const INSERT_SLICE: Duration = Duration::from_millis(100);

/// How a ragged TCP ingress serves its workers.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// The secret clients must prove, if any.
    pub token: Option<Vec<u8>>,
    /// Connections served at once.
    pub max_connections: usize,
    /// The bytes of frame bodies being read, for all connections together (one frame at a
    /// time beyond it); shared-memory pipes may take half of it besides.
    pub max_buffered_bytes: usize,
    /// Offer same-host workers a shared-memory pipe (Linux).
    pub shared_memory: bool,
    /// How long a worker's session (how many of its samples are stored) outlives its
    /// connection, so that a worker that reconnects resends exactly what was not stored.
    pub session_timeout: Duration,
    /// Sessions to start with (a restored checkpoint's, see [`RaggedTcp::snapshot`]): each
    /// worker's session id and the samples of it stored.
    pub sessions: SessionCounts,
    /// The learner's published parameters, which workers fetch (`None`: none served).
    pub params: Option<Arc<Params>>,
    /// How long a frame's body may go without a byte once its header came (its bytes are
    /// held in the ingress's budget meanwhile): a worker stalled mid-frame longer (a host
    /// gone, a hostile peer) is taken for dead and its bytes given back. `None`: for ever.
    pub body_silence: Option<Duration>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            token: None,
            max_connections: 4096,
            max_buffered_bytes: 1 << 30,
            shared_memory: true,
            session_timeout: Duration::from_secs(300),
            sessions: Vec::new(),
            params: None,
            body_silence: Some(Duration::from_secs(10)),
        }
    }
}

/// Counters of a ragged TCP ingress.
#[derive(Debug, Default)]
pub struct TcpCounters {
    /// Connections accepted (handshake completed).
    pub accepted: AtomicU64,
    /// Connections open now.
    pub active: AtomicU64,
    /// Hellos refused: a v1 client, a wrong token, another layout, a malformed hello.
    pub refused: AtomicU64,
    /// Samples received and stored.
    pub samples: AtomicU64,
    /// Connections whose frames came through a shared-memory pipe.
    pub shm: AtomicU64,
    /// Handshakes that resumed a session the server knew (a worker that reconnected).
    pub resumed: AtomicU64,
    /// Connections that had stored nothing, closed to admit a newcomer at the limit.
    pub evicted: AtomicU64,
    /// Samples that arrived in compressed frames (the worker compressed the leaves the
    /// table's `compress=` names).
    pub compressed_samples: AtomicU64,
    /// Bytes of those frames' bodies, as they came.
    pub compressed_bytes: AtomicU64,
}

/// Per worker session: its id and how many of its samples are stored (or persisted).
pub type SessionCounts = Vec<([u8; 16], u64)>;

/// A notice for a worker (persisted, a version) and the connection it goes to.
type Notice = (Arc<Mutex<TcpStream>>, Vec<u8>);

/// An open connection: its id, its write half, and the notices its worker takes.
struct OpenConn {
    id: u64,
    writer: Arc<Mutex<TcpStream>>,
    /// It understands closing notices.
    closing: bool,
    /// Durable: it hears how far its session is persisted.
    durable: bool,
    /// It hears of each version the learner publishes.
    versions: bool,
    /// Its worker's heartbeat timeout asked for heartbeats: one every third of it, the next
    /// due then.
    beat: Option<(Duration, Instant)>,
    /// It has stored a frame ([`Owned::worked`]).
    worked: Arc<AtomicBool>,
}

struct Shared {
    table: Arc<RaggedTable>,
    layout: Layout,
    token: Option<Vec<u8>>,
    max_connections: usize,
    budget: Budget,
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))] // off Linux no pipe is offered
    shared_memory: bool,
    /// The workers' sessions by session id.
    sessions: Mutex<std::collections::HashMap<[u8; 16], Arc<Session>>>,
    session_timeout: Duration,
    /// See [`TcpOptions::body_silence`].
    body_silence: Option<Duration>,
    /// Bytes of the shared-memory pipes attached now, and the most they may take.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    segments: Mutex<usize>,
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    max_segments: usize,
    closing: AtomicBool,
    /// The latest version the learner published, told to each new connection that hears of
    /// versions.
    announced: AtomicU64,
    /// The learner's published parameters, which workers fetch.
    params: Option<Arc<Params>>,
    /// Turns to copy their chunks out (a few at once).
    fetch_turns: fetched::Turns,
    /// Notices for workers (persisted, versions), and the notifier thread's wake-up.
    notices: Mutex<Vec<Notice>>,
    noticed: parking_lot::Condvar,
    /// Open connections: their write halves (for the closing notice and the shutdown), and
    /// whether the client understands closing notices.
    conns: Mutex<Vec<OpenConn>>,
    /// Connections accepted whose handshake is not done: their ids and a clone of each
    /// socket, to close one for a newcomer at the connection limit (see `admit`).
    handshaking: Mutex<Vec<(u64, TcpStream)>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    counters: TcpCounters,
    /// The threads that serve the shared-memory pipes (`pump`).
    #[cfg(target_os = "linux")]
    pumps: pump::Pumps,
}

/// The bytes all connections may hold in frame bodies not yet stored: taken and given back
/// with one atomic operation each while there is room (every frame does it); only a
/// connection that finds the budget spent takes the lock, to wait.
struct Budget {
    max: usize,
    used: AtomicUsize,
    /// Connections waiting for room (under `lock`), so that giving back wakes them only
    /// when there are some.
    waiting: AtomicUsize,
    lock: Mutex<()>,
    freed: parking_lot::Condvar,
}

/// Bytes taken from a [`Budget`], given back when dropped.
struct Hold<'a> {
    budget: &'a Budget,
    bytes: usize,
}

impl Budget {
    fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            used: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            lock: Mutex::new(()),
            freed: parking_lot::Condvar::new(),
        }
    }

    /// Takes `bytes` if they fit (or nothing else is held: a frame larger than the whole
    /// budget goes alone).
    fn try_take(&self, bytes: usize) -> bool {
        // ORDERING: AcqRel on success, Acquire on failure — the count is the only thing
        // shared; it guards no other data, but Acquire/Release keeps take and give back in
        // one order with the waiters' re-checks under the lock.
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used == 0 || used + bytes <= self.max).then_some(used + bytes)
            })
            .is_ok()
    }

    /// Takes `bytes`, waiting while the budget is spent; `None` once `closing` is set.
    fn acquire<'a>(&'a self, bytes: usize, closing: &AtomicBool) -> Option<Hold<'a>> {
        if !self.try_take(bytes) {
            let mut guard = self.lock.lock();
            // ORDERING: SeqCst — with the SeqCst load in `drop`: either that load sees this
            // waiter, or our `try_take` below sees the bytes it gave back.
            self.waiting.fetch_add(1, Ordering::SeqCst);
            let taken = loop {
                if self.try_take(bytes) {
                    break true;
                }
                // ORDERING: SeqCst — pairs with `RaggedTcp::close`.
                if closing.load(Ordering::SeqCst) {
                    break false;
                }
                let _ = self.freed.wait_for(&mut guard, INSERT_SLICE);
            };
            // ORDERING: SeqCst — as above.
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            if !taken {
                return None;
            }
        }
        Some(Hold { budget: self, bytes })
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        // ORDERING: SeqCst — the giving back comes before the look at `waiting` (see
        // `acquire`).
        self.budget.used.fetch_sub(self.bytes, Ordering::SeqCst);
        // ORDERING: SeqCst — see `acquire`.
        if self.budget.waiting.load(Ordering::SeqCst) > 0 {
            // Under the lock: a waiter between its last look and its wait cannot miss it.
            let _guard = self.budget.lock.lock();
            self.budget.freed.notify_all();
        }
    }
}

/// A ragged table's TCP listener and its connections.
pub struct RaggedTcp {
    port: u16,
    shared: Arc<Shared>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for RaggedTcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RaggedTcp(port {})", self.port)
    }
}

impl RaggedTcp {
    /// Listens on `host:port` (0: any free port) for workers sending samples of `layout`
    /// (the hello's: ragged leaves as [`super::wire::ragged_dims`]) into `table`, served as
    /// `options` say.
    ///
    /// # Errors
    /// [`EchoError::Io`] if the address cannot be bound.
    pub fn start(
        table: Arc<RaggedTable>,
        layout: Layout,
        host: &str,
        port: u16,
        options: TcpOptions,
    ) -> Result<Self, EchoError> {
        let TcpOptions {
            token,
            max_connections,
            max_buffered_bytes,
            shared_memory,
            session_timeout,
            sessions,
            params,
            body_silence,
        } = options;
        let now = Instant::now();
        let sessions = sessions
            .into_iter()
            .map(|(id, stored)| {
                let session = Session {
                    stored: AtomicU64::new(stored),
                    persisted: AtomicU64::new(stored),
                    idle_since: Mutex::new(Some(now)),
                    ..Session::default()
                };
                (id, Arc::new(session))
            })
            .collect();
        let addr = (host, port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| EchoError::Config(format!("cannot resolve {host}:{port}")))?;
        let listener = TcpListener::bind(addr)?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            table,
            layout,
            token,
            max_connections: max_connections.max(1),
            budget: Budget::new(max_buffered_bytes),
            shared_memory,
            sessions: Mutex::new(sessions),
            session_timeout,
            body_silence,
            segments: Mutex::new(0),
            max_segments: max_buffered_bytes / 2,
            closing: AtomicBool::new(false),
            announced: AtomicU64::new(0),
            params,
            fetch_turns: fetched::Turns::default(),
            notices: Mutex::new(Vec::new()),
            noticed: parking_lot::Condvar::new(),
            conns: Mutex::new(Vec::new()),
            handshaking: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
            counters: TcpCounters::default(),
            #[cfg(target_os = "linux")]
            pumps: pump::Pumps::default(),
        });
        let notifying = shared.clone();
        let notifier = std::thread::Builder::new()
            .name("echo-ragged-notify".into())
            .spawn(move || notify::notify_loop(&notifying))?;
        shared.threads.lock().push(notifier);
        let accepting = shared.clone();
        let accept = std::thread::Builder::new()
            .name("echo-ragged-accept".into())
            .spawn(move || accept_loop(&listener, &accepting))?;
        Ok(Self { port, shared, accept: Mutex::new(Some(accept)) })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its counters.
    pub fn counters(&self) -> &TcpCounters {
        &self.shared.counters
    }

    /// A copy of the table's entries (for a checkpoint) with every session's count of
    /// samples stored, which match it exactly: a restored server with these sessions tells
    /// each reconnecting worker to resend precisely the frames the checkpoint lacks. The
    /// counts are read under the table's lock, which each frame's count is raised under
    /// with its entry: no worker's insert is waited for, not even one blocked on a full
    /// table.
    ///
    /// # Errors
    /// As [`RaggedTable::export`].
    pub fn snapshot(&self) -> Result<(RaggedExport, SessionCounts), EchoError> {
        self.shared.table.export_with(|| {
            // Under the table's lock; nothing takes the table's lock holding this one.
            let sessions = self.shared.sessions.lock();
            sessions
                .iter()
                // ORDERING: Relaxed — raised and read under the table's lock, which orders
                // them.
                .map(|(id, session)| (*id, session.stored.load(Ordering::Relaxed)))
                .collect()
        })
    }

    /// A checkpoint holding `sessions` (as [`RaggedTcp::snapshot`] counted them) completed:
    /// each session is persisted that far, and a durable worker's connection is told (a
    /// [`v2::PERSISTED`] notice), so that it lets go of the frames the checkpoint holds.
    pub fn persisted(&self, sessions: &[([u8; 16], u64)]) {
        let mut notices = Vec::new();
        {
            let map = self.shared.sessions.lock();
            for (id, count) in sessions {
                let Some(session) = map.get(id) else { continue };
                // ORDERING: SeqCst — see `Session::owner`.
                let persisted = session.persisted.fetch_max(*count, Ordering::SeqCst).max(*count);
                let owner = session.owner();
                if owner != 0 {
                    notices.push((owner, persisted));
                }
            }
        }
        let sends: Vec<Notice> = {
            let conns = self.shared.conns.lock();
            notices
                .into_iter()
                .filter_map(|(owner, persisted)| {
                    let conn = conns.iter().find(|c| c.id == owner && c.durable)?;
                    Some((conn.writer.clone(), v2::encode_persisted(persisted).to_vec()))
                })
                .collect()
        };
        self.notify(sends);
    }

    /// The learner published `version`: every worker that hears of versions is told (a
    /// VERSION notice), so that it knows how far behind the weights it acts with are (and,
    /// with `admission="block"`, waits for newer ones when too far).
    pub fn announce(&self, version: u64) {
        // ORDERING: Relaxed — read on its own by new connections (see `serve`).
        self.shared.announced.fetch_max(version, Ordering::Relaxed);
        let notice = crate::transport::wire::params::encode_version(version).to_vec();
        let sends = self
            .shared
            .conns
            .lock()
            .iter()
            .filter(|c| c.versions)
            .map(|c| (c.writer.clone(), notice.clone()))
            .collect();
        self.notify(sends);
    }

    /// Hands each notice to the notifier thread, which writes it to its connection: a
    /// worker that stopped reading could hold a write for the write timeout, and the learner
    /// (its checkpoint, its publish) waits for no worker. A connection that fails to take its
    /// notice is ending: its worker reconnects and hears the latest at once.
    fn notify(&self, sends: Vec<Notice>) {
        if sends.is_empty() {
            return;
        }
        self.shared.notices.lock().extend(sends);
        self.shared.noticed.notify_one();
    }

    /// Stops accepting, tells every client that understands it that the server closes
    /// (`why`), closes every connection and joins the threads. Samples already acknowledged
    /// are in the table.
    pub fn close(&self, why: Closing) {
        // ORDERING: SeqCst — the flag is set before the sockets are shut down, so a thread
        // that sees its socket closed also sees the flag.
        if self.shared.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the notifier (under its lock: it cannot be between its look and its wait) and
        // the accept loop.
        {
            let _notices = self.shared.notices.lock();
            self.shared.noticed.notify_all();
        }
        let _ = TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_millis(200),
        );
        for conn in self.shared.conns.lock().iter() {
            let mut writer = conn.writer.lock();
            if conn.closing {
                let _ = writer.write_all(&[v2::CLOSING, why as u8]);
            }
            let _ = writer.shutdown(Shutdown::Both);
        }
        if let Some(accept) = self.accept.lock().take() {
            let _ = accept.join();
        }
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        for thread in threads {
            let _ = thread.join();
        }
    }
}

impl Drop for RaggedTcp {
    fn drop(&mut self) {
        self.close(Closing::Final);
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        // ORDERING: SeqCst — pairs with `close`.
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        shared.threads.lock().retain(|t| !t.is_finished());
        if !admit::admit(shared) {
            let mut stream = stream;
            let _ = stream.write_all(&v2::encode_error(&format!(
                "the server serves no more connections: all {} are working ones",
                shared.max_connections
            )));
            continue;
        }
        next_id += 1;
        let (id, serving) = (next_id, shared.clone());
        if let Ok(clone) = stream.try_clone() {
            shared.handshaking.lock().push((id, clone));
        }
        let thread = std::thread::Builder::new().name("echo-ragged-conn".into()).spawn(move || {
            // ORDERING: Relaxed — a gauge.
            serving.counters.active.fetch_add(1, Ordering::Relaxed);
            if let Err(err) = serve(&serving, id, stream) {
                log::debug!("ragged connection ended: {err}");
            }
            serving.handshaking.lock().retain(|(h, _)| *h != id);
            serving.conns.lock().retain(|conn| conn.id != id);
            // ORDERING: Relaxed — a gauge.
            serving.counters.active.fetch_sub(1, Ordering::Relaxed);
        });
        if let Ok(thread) = thread {
            shared.threads.lock().push(thread);
        }
    }
}

use handshake::handshake;
use reading::{read_body, read_exact_or_eof, read_kind, stalled};
use session::{Owned, Session};

fn serve(shared: &Arc<Shared>, id: u64, mut stream: TcpStream) -> Result<(), EchoError> {
    stream.set_nodelay(true)?;
    let shook = handshake(shared, &mut stream, id);
    shared.handshaking.lock().retain(|(h, _)| *h != id);
    let Some((hello, mut leftover, offered, owned)) = shook? else {
        return Ok(());
    };
    let writer = Arc::new(Mutex::new(stream.try_clone()?));
    shared.conns.lock().push(OpenConn {
        id,
        writer: writer.clone(),
        closing: hello.notices,
        durable: hello.durable,
        versions: hello.params,
        beat: notify::beat_for(&hello, Instant::now()),
        worked: owned.worked.clone(),
    });
    // ORDERING: Relaxed — a statistics counter.
    shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
    // ORDERING: SeqCst — pairs with `close`: a connection registered after `close` read the
    // list is shut down here.
    if shared.closing.load(Ordering::SeqCst) {
        return Ok(());
    }
    // What the reply named (as the handshake decided): none to a worker offered a pipe, even
    // one that then declines it.
    let codecs = packed::wire_codecs(shared, &hello, offered.is_some());
    let attached = match offered {
        Some(offered) => shm::attach(shared, offered, &mut stream, &mut leftover),
        None => Ok(shm::Path::Tcp),
    };
    // Notices after the pipe's exchange, which shares the socket.
    if hello.durable {
        // Where its session is persisted, at once: a restored session is persisted as far
        // as it stands.
        let persisted = owned.session.persisted();
        if persisted > 0 {
            writer.lock().write_all(&v2::encode_persisted(persisted))?;
        }
    }
    // ORDERING: Relaxed — a version read on its own; one published meanwhile is announced
    // to this connection too (it is in `conns` already).
    let latest = shared.announced.load(Ordering::Relaxed);
    if hello.params && latest > 0 {
        // The latest version, at once: later ones come as they are published.
        writer.lock().write_all(&crate::transport::wire::params::encode_version(latest))?;
    }
    let result = match attached {
        Ok(shm::Path::Pipe(pipe, _held)) => {
            // ORDERING: Relaxed — a statistics counter.
            shared.counters.shm.fetch_add(1, Ordering::Relaxed);
            serve_pipe(shared, pipe, owned, &writer)
        }
        Ok(shm::Path::Tcp) => tcp_frames(shared, &owned, leftover, stream, &writer, &codecs),
        Ok(shm::Path::Ended) => Ok(()),
        Err(err) => Err(err),
    };
    if let Err(EchoError::Sample(why) | EchoError::Protocol(why) | EchoError::Priority(why)) =
        &result
    {
        let _ = writer.lock().write_all(&v2::encode_error(why));
    }
    let _ = writer.lock().shutdown(Shutdown::Both);
    result
}

/// Serves a worker's attached pipe: on a pump while its frames come whole, then (its end, a
/// frame larger than the pipe, one refused) with the blocking reader.
#[cfg(target_os = "linux")]
fn serve_pipe(
    shared: &Arc<Shared>,
    mut pipe: shm::PipeInput,
    mut owned: Owned,
    writer: &Mutex<TcpStream>,
) -> Result<(), EchoError> {
    loop {
        // None: the pump's thread panicked, with the pipe; the worker sees its end.
        let Some(pump::Returned { mut input, owned: back, go_on }) =
            pump::serve(shared, pipe, owned)
        else {
            return Err(EchoError::Closed);
        };
        if !go_on {
            return Ok(()); // the worker reconnected: its newer connection goes on
        }
        // The blocking reader, until the end; or, after a parameter fetch it answered, back
        // to a pump (a worker that fetches keeps its pipe served by the pumps).
        match frames(shared, &back, &mut input, writer, &[])? {
            Ended::Done => return Ok(()),
            Ended::Fetched => (pipe, owned) = (input, back),
        }
    }
}

/// Off Linux no pipe is attached.
#[cfg(not(target_os = "linux"))]
fn serve_pipe(
    shared: &Arc<Shared>,
    mut pipe: shm::PipeInput,
    owned: Owned,
    writer: &Mutex<TcpStream>,
) -> Result<(), EchoError> {
    frames(shared, &owned, &mut pipe, writer, &[]).map(drop)
}

/// Reads the frames of a worker over TCP (after `leftover`, read with its hello).
fn tcp_frames(
    shared: &Shared,
    owned: &Owned,
    leftover: Vec<u8>,
    stream: TcpStream,
    writer: &Mutex<TcpStream>,
    codecs: &[Option<Codec>],
) -> Result<(), EchoError> {
    // A frame's body may go silent for at most this long (see `read_kind` for between frames).
    stream.set_read_timeout(shared.body_silence)?;
    let reader = io::BufReader::with_capacity(READ_BUFFER, io::Cursor::new(leftover).chain(stream));
    frames(shared, owned, &mut TcpInput { reader, writer }, writer, codecs).map(drop)
}

/// Writes `n` acknowledgements.
fn ack(writer: &Mutex<TcpStream>, mut n: usize) -> io::Result<()> {
    const ACKS: [u8; 512] = [v2::ACK; 512];
    let mut writer = writer.lock();
    while n > 0 {
        let now = n.min(ACKS.len());
        writer.write_all(&ACKS[..now])?;
        n -= now;
    }
    Ok(())
}

/// Reads frames and stores their samples. The acknowledgements of the frames stored go out
/// together when the read buffer runs dry (before the thread would wait for more), so a
/// worker that sends many small samples gets a few writes, not one per frame.
/// Why the blocking reader stopped: the connection's end (or the server's), or a parameter
/// fetch answered on a pipe, whose next frames a pump can take again.
enum Ended {
    Done,
    Fetched,
}

fn frames(
    shared: &Shared,
    owned: &Owned,
    input: &mut impl Input,
    writer: &Mutex<TcpStream>,
    codecs: &[Option<Codec>],
) -> Result<Ended, EchoError> {
    let mut unacked = 0usize;
    let result = frames_acked(shared, owned, input, writer, codecs, &mut unacked);
    if result.is_ok() && unacked > 0 {
        input.ack(unacked)?;
    }
    result
}

/// Where a connection's frames come from, and where their acknowledgements go.
trait Input: Read {
    /// Whether what was read ahead is used up (the next read may wait): the moment to send
    /// the acknowledgements held back.
    fn dry(&self) -> bool;
    /// Whether the input is a pipe a pump can serve again (after a parameter fetch).
    fn pumped(&self) -> bool {
        false
    }
    /// Acknowledges `n` more samples, stored.
    fn ack(&mut self, n: usize) -> io::Result<()>;
    /// The next `len` bytes where they lie, when all of them are there to be copied from
    /// (a pipe's committed bytes): a frame's body goes from there straight into the table,
    /// and [`Input::consume`] then reads past it. `None`: read them into a buffer.
    ///
    /// # Errors
    /// As a read.
    fn ahead(&self, _len: usize) -> io::Result<Option<&dyn Ahead>> {
        Ok(None)
    }
    /// Reads past the next `len` bytes, copied through [`Input::ahead`].
    fn consume(&mut self, _len: usize) {}
}

/// Bytes of an input not read yet, copied out from where they lie.
trait Ahead {
    /// Copies `out.len()` bytes from `offset` bytes past what was read.
    fn copy_ahead(&self, offset: usize, out: &mut [u8]);
}

/// A frame's samples over a body not read yet ([`Input::ahead`]): each leaf is copied from
/// there into the table's arena, the only copy the frame's bytes get.
struct InPlace<'a> {
    ahead: &'a dyn Ahead,
    frame: &'a Head,
    columns: usize,
    /// Each leaf's offset in the body, sample-major, and the body's length at the end.
    starts: Vec<usize>,
}

impl<'a> InPlace<'a> {
    fn new(ahead: &'a dyn Ahead, frame: &'a Head, columns: &[Column]) -> Self {
        let mut starts = Vec::with_capacity(frame.rows.len() + 1);
        let mut at = 0usize;
        for (i, &rows) in frame.rows.iter().enumerate() {
            starts.push(at);
            // Checked by `decode_head`: within the leaf's max_len, so no overflow.
            at += columns[i % columns.len()].row_bytes() * rows;
        }
        starts.push(at);
        Self { ahead, frame, columns: columns.len(), starts }
    }
}

impl GroupSource for InPlace<'_> {
    fn samples(&self) -> usize {
        self.frame.samples
    }
    fn rows(&self, s: usize) -> &[usize] {
        &self.frame.rows[s * self.columns..(s + 1) * self.columns]
    }
    fn leaves(&self, _s: usize) -> usize {
        self.columns
    }
    fn leaf_len(&self, s: usize, c: usize) -> usize {
        let i = s * self.columns + c;
        self.starts[i + 1] - self.starts[i]
    }
    fn leaf(&self, _s: usize, _c: usize) -> Option<&[u8]> {
        None
    }
    fn copy_leaf(&self, s: usize, c: usize, dst: &mut [u8]) {
        self.ahead.copy_ahead(self.starts[s * self.columns + c], dst);
    }
}

/// A worker's frames over TCP, read through a buffer; acknowledgements one byte a sample.
struct TcpInput<'a, R> {
    reader: io::BufReader<R>,
    writer: &'a Mutex<TcpStream>,
}

impl<R: Read> Read for TcpInput<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
    fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.reader.read_exact(buf)
    }
}

impl<R: Read> Input for TcpInput<'_, R> {
    fn dry(&self) -> bool {
        self.reader.buffer().is_empty()
    }
    fn ack(&mut self, n: usize) -> io::Result<()> {
        ack(self.writer, n)
    }
}

fn frames_acked(
    shared: &Shared,
    owned: &Owned,
    reader: &mut impl Input,
    writer: &Mutex<TcpStream>,
    codecs: &[Option<Codec>],
    unacked: &mut usize,
) -> Result<Ended, EchoError> {
    let spec = shared.table.spec();
    let max_samples = shared.table.config().batch_size.min(usize::from(u16::MAX));
    let mut head = Vec::new();
    let mut body = Vec::new();
    let mut raw = Vec::new();
    loop {
        if *unacked > 0 && (reader.dry() || *unacked >= ACK_BATCH) {
            reader.ack(std::mem::take(unacked))?;
        }
        let mut kind = [0u8; 1];
        if !read_kind(shared, reader, &mut kind)? {
            return Ok(Ended::Done);
        }
        match kind[0] {
            v2::HEARTBEAT => continue,
            v2::BYE => return Ok(Ended::Done),
            GROUP | GROUP_PRIORITY | GROUP_PACKED | GROUP_PACKED_PRIORITY => {}
            params::FETCH => {
                let mut raw = [0u8; params::FETCH_LEN - 1];
                if !read_exact_or_eof(reader, &mut raw)? {
                    return Ok(Ended::Done);
                }
                if *unacked > 0 {
                    reader.ack(std::mem::take(unacked))?;
                }
                fetched::serve(shared, &raw, writer)?;
                if reader.pumped() {
                    return Ok(Ended::Fetched);
                }
                continue;
            }
            other => {
                return Err(EchoError::Protocol(format!(
                    "unknown frame type {other:#04x} (a ragged server takes group frames)"
                )))
            }
        }
        // The count, then the rest of the header it sizes.
        head.clear();
        head.resize(2, 0);
        if !read_exact_or_eof(reader, &mut head)? {
            return Ok(Ended::Done);
        }
        let (frame, _) = loop {
            match decode_head(spec, codecs, max_samples, kind[0], &head)? {
                Some(done) => break done,
                None => {
                    let at = head.len();
                    // The header's length follows from the count: read what is missing.
                    let n = usize::from(u16::from_le_bytes([head[0], head[1]]));
                    let want = head_len(spec, codecs, kind[0], n);
                    head.resize(want, 0);
                    if !read_exact_or_eof(reader, &mut head[at..])? {
                        return Ok(Ended::Done);
                    }
                }
            }
        };
        let stored =
            store_frame(shared, owned, reader, &frame, kind[0], codecs, &mut body, &mut raw);
        if !stored.map_err(|err| stalled(err, shared.body_silence))? {
            return Ok(Ended::Done);
        }
        // ORDERING: Relaxed — a statistics counter.
        shared.counters.samples.fetch_add(frame.samples as u64, Ordering::Relaxed);
        *unacked += frame.samples;
        if body.len() > IDLE_BODY {
            // An idle connection keeps no large buffer outside the budget.
            body = Vec::new();
        }
        if raw.capacity() > IDLE_BODY {
            raw = Vec::new();
        }
    }
}

/// Reads `frame`'s body (its header read) and stores its samples; `Ok(false)`: the input
/// ended or the server closed first.
#[allow(clippy::too_many_arguments)] // the frame loop's buffers, lent
fn store_frame(
    shared: &Shared,
    owned: &Owned,
    reader: &mut impl Input,
    frame: &Head,
    kind: u8,
    codecs: &[Option<Codec>],
    body: &mut Vec<u8>,
    raw: &mut Vec<u8>,
) -> Result<bool, EchoError> {
    let spec = shared.table.spec();
    if is_packed(kind) {
        // Only over TCP (a pipe's connection agreed on no codecs).
        return packed::store_packed(shared, owned, reader, frame, codecs, body, raw);
    }
    if let Some(ahead) = reader.ahead(frame.body_len)? {
        // The body is all in the worker's pipe: copied from there into the arena.
        let source = InPlace::new(ahead, frame, spec.columns());
        if !store(shared, owned, &source, frame.priority)? {
            return Ok(false);
        }
        reader.consume(frame.body_len);
        return Ok(true);
    }
    // The body's bytes come out of the ingress's budget until the frame is stored, so many
    // connections announcing large frames wait rather than take the learner's memory.
    let Some(_hold) = shared.budget.acquire(frame.body_len, &shared.closing) else {
        return Ok(false);
    };
    let Some(body) = read_body(reader, body, frame.body_len)? else { return Ok(false) };
    let samples = split_body(spec.columns(), frame, body);
    store(shared, owned, samples.as_slice(), frame.priority)
}

/// A plain body (`frame`'s, every leaf raw, in order) as its samples' leaves.
fn split_body<'a>(columns: &[Column], frame: &Head, body: &'a [u8]) -> Vec<SampleIn<'a>> {
    let mut samples = Vec::with_capacity(frame.samples);
    let mut at = 0usize;
    for rows in frame.rows.chunks(columns.len()) {
        let mut leaves = Vec::with_capacity(columns.len());
        for (column, &n) in columns.iter().zip(rows) {
            // Checked by `decode_head`: within the leaf's max_len, so no overflow.
            let len = column.row_bytes() * n;
            leaves.push(&body[at..at + len]);
            at += len;
        }
        samples.push(SampleIn { leaves, rows: rows.to_vec() });
    }
    samples
}

/// Stores a frame's `samples`, waiting for room a slice at a time while the server is not
/// closing. `Ok(false)`: not stored, and the connection ends quietly (the server closed, or
/// the worker reconnected and its newer connection resends the frame).
fn store<S: GroupSource + ?Sized>(
    shared: &Shared,
    owned: &Owned,
    samples: &S,
    priority: Option<f64>,
) -> Result<bool, EchoError> {
    loop {
        let deadline = Some(Instant::now() + INSERT_SLICE);
        // Under the session's lock: a newer connection of the same worker takes the session
        // over between two tries, never during one.
        let _turn = owned.session.turn.lock();
        if owned.session.owner() != owned.id {
            return Ok(false);
        }
        let stored = || {
            // ORDERING: Relaxed — under the table's lock (see `Session::stored`).
            owned.session.stored.fetch_add(samples.samples() as u64, Ordering::Relaxed);
        };
        match shared.table.insert_from_then(samples, priority, deadline, stored) {
            Ok(_) => {
                owned.stored_one();
                return Ok(true);
            }
            // ORDERING: SeqCst — pairs with `close`.
            Err(EchoError::TimedOut) if !shared.closing.load(Ordering::SeqCst) => {}
            Err(EchoError::TimedOut | EchoError::Closed) => return Ok(false),
            Err(other) => return Err(other),
        }
    }
}

mod admit;
mod fetched;
mod handshake;
mod notify;
mod packed;
#[cfg(target_os = "linux")]
mod pump;
mod reading;
mod session;
#[cfg(target_os = "linux")]
mod shm;
#[cfg(not(target_os = "linux"))]
#[path = "shm_off.rs"]
mod shm;
