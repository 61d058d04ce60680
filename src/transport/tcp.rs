//! The TCP transport: a tokio runtime of its own, an accept loop, and one task per connection
//! that sends the handshake, reads exact-size samples into recycled buffers, queues them and
//! acknowledges each queued sample with one byte.
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
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

use super::wire::{encode_handshake, ACK};
use crate::error::EchoError;
use crate::ingress::{Connection, Ingress, SpaceWaker};

/// Bytes read from a socket at a time for small samples.
const STAGING: usize = 64 * 1024;
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
}

/// A running TCP server feeding an [`Ingress`].
pub struct TcpServer {
    runtime: Option<Runtime>,
    local_addr: SocketAddr,
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
        let handshake: Arc<[u8]> = encode_handshake(ingress.backend().spec())?.into();
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
        runtime.spawn(accept_loop(listener, ingress, handshake, admission));
        Ok(Self { runtime: Some(runtime), local_addr })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every connection and joins the runtime's threads. Idempotent.
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

async fn accept_loop(
    listener: TcpListener,
    ingress: Arc<Ingress>,
    handshake: Arc<[u8]>,
    mut admission: Admission,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let Some(permit) = admission.admit(&ingress).await else {
                    drop(stream);
                    continue;
                };
                // ORDERING: Relaxed — only this loop hands out ids; they only need to differ.
                let id = admission.next_id.fetch_add(1, Relaxed);
                let activity = Arc::new(Activity::default());
                activity.read(admission.epoch);
                let served = Arc::clone(&admission.served);
                let (ingress, handshake) = (Arc::clone(&ingress), Arc::clone(&handshake));
                let (epoch, mine) = (admission.epoch, Arc::clone(&activity));
                // Registered before the task can finish (the lock is held), and the task takes
                // itself out of the registry however it ends.
                let mut registry = admission.served.lock();
                let task = tokio::spawn(async move {
                    let _leave = Leave { served, id };
                    serve(stream, peer, &ingress, &handshake, &mine, epoch).await;
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

async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    ingress: &Ingress,
    handshake: &[u8],
    activity: &Activity,
    epoch: Instant,
) {
    match serve_inner(stream, ingress, handshake, activity, epoch).await {
        Ok(()) => log::debug!("{peer}: connection closed"),
        Err(err) if is_disconnect(&err) => log::debug!("{peer}: connection lost: {err}"),
        Err(err) => log::warn!("{peer}: connection failed: {err}"),
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

async fn serve_inner(
    stream: TcpStream,
    ingress: &Ingress,
    handshake: &[u8],
    activity: &Activity,
    epoch: Instant,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    writer.write_all(handshake).await?;
    let space = Arc::new(Notify::new());
    let conn = ingress.register(Box::new(NotifyWaker(Arc::clone(&space))));
    let _closer = CloseOnDrop(Arc::clone(&conn));
    let payload_size = ingress.backend().spec().payload_size();
    // Allocated at the first read, so a connection that never sends holds no staging memory.
    let staging_len = STAGING.min(payload_size.saturating_mul(64)).max(1);
    let mut staging = Vec::new();
    let (mut lo, mut hi) = (0usize, 0usize);
    let mut acks = 0usize;
    loop {
        let mut buf = match conn.take_buffer() {
            Some(buf) => buf,
            None => {
                flush_acks(&mut writer, &mut acks).await?;
                conn.note_blocked();
                loop {
                    space.notified().await;
                    if let Some(buf) = conn.take_buffer() {
                        break buf;
                    }
                }
            }
        };
        let mut filled = 0;
        while filled < payload_size {
            if lo < hi {
                let n = (hi - lo).min(payload_size - filled);
                buf[filled..filled + n].copy_from_slice(&staging[lo..lo + n]);
                (lo, filled) = (lo + n, filled + n);
                continue;
            }
            // About to block on the socket: first let the client know what we have queued.
            flush_acks(&mut writer, &mut acks).await?;
            let direct = payload_size - filled >= staging_len / 2;
            if !direct && staging.is_empty() {
                staging = vec![0u8; staging_len];
            }
            let n = if direct {
                reader.read(&mut buf[filled..]).await?
            } else {
                reader.read(&mut staging).await?
            };
            activity.read(epoch);
            if n == 0 {
                // EOF: clean between samples; a partial sample is discarded, never queued.
                conn.return_buffer(buf);
                return if filled == 0 {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("peer closed mid-sample ({filled} of {payload_size} bytes)"),
                    ))
                };
            }
            if direct {
                filled += n;
            } else {
                (lo, hi) = (0, n);
            }
        }
        let mut pending = buf;
        while let Err(back) = conn.try_push(pending) {
            pending = back;
            flush_acks(&mut writer, &mut acks).await?;
            conn.note_blocked();
            space.notified().await;
        }
        acks += 1;
        activity.complete();
    }
}

async fn flush_acks(writer: &mut OwnedWriteHalf, acks: &mut usize) -> io::Result<()> {
    const ACKS: [u8; 4096] = [ACK; 4096];
    while *acks > 0 {
        let n = (*acks).min(ACKS.len());
        writer.write_all(&ACKS[..n]).await?;
        *acks -= n;
    }
    Ok(())
}
