//! What a server's connection tasks share ([`Shared`]), with the pieces it is made of: each
//! task's [`Activity`] as the accept loop sees it, the [`Registry`] of running tasks, and the
//! [`Throttled`] failure log; and the v2 sessions that outlive their connections
//! ([`Session`]): a session owns its ingress queue and counts the samples queued, so a
//! reconnecting client keeps its order and a resent sample is never queued twice. Detached
//! sessions are forgotten after `session_timeout` ([`reap_sessions`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use tokio::sync::{watch, Notify};
use tokio::task::AbortHandle;

use crate::codec::LeafCodecs;
use crate::ingress::{Connection, Ingress, SpaceWaker};
use crate::params::Params;
use crate::queued::SessionMark;
use crate::transport::wire::v2::{Layout, Mode};

/// The `log` target of everything the TCP server logs: the logger `echo.transport.tcp` in Python,
/// whichever file of the module the record comes from (the user guides name it).
pub(crate) const LOG_TARGET: &str = "echo::transport::tcp";

/// Wakes a connection task waiting for a free buffer or queue slot.
pub(super) struct NotifyWaker(pub(super) Arc<Notify>);

impl SpaceWaker for NotifyWaker {
    fn wake(&self) {
        // `notify_one` stores a permit when nobody waits, so a wake between the task's failed
        // attempt and its `notified().await` is not lost.
        self.0.notify_one();
    }
}

/// Marks the connection closed however the task ends (error, EOF, or runtime shutdown).
pub(super) struct CloseOnDrop(pub(super) Arc<Connection>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// What a connection's task tells the accept loop about it.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    /// Milliseconds since the server started at its last read of a byte.
    pub(super) last_read_ms: AtomicU64,
    /// Whether it has queued (and acknowledged) a whole sample.
    pub(super) completed: AtomicBool,
}

impl Activity {
    pub(super) fn read(&self, epoch: Instant) {
        let ms = u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        // ORDERING: Relaxed — a heuristic for choosing whom to evict; it guards no memory.
        self.last_read_ms.store(ms, Relaxed);
    }

    pub(crate) fn complete(&self) {
        // ORDERING: Relaxed — as above.
        self.completed.store(true, Relaxed);
    }

    /// `Some(last read)` if this connection may be evicted: it has not completed a sample.
    /// (Silence is no reason once it has: a worker held back by backpressure is silent too.)
    pub(super) fn evictable(&self) -> Option<u64> {
        // ORDERING: Relaxed — as above.
        let (last, completed) = (self.last_read_ms.load(Relaxed), self.completed.load(Relaxed));
        (!completed).then_some(last)
    }
}

/// Every served connection's activity and the handle that ends its task, by id.
pub(super) type Registry = Arc<Served>;

/// The running connection tasks, and a condition variable signalled whenever a task's
/// leaving empties the map, which [`TcpServer::close`](super::TcpServer::close) waits on.
#[derive(Default)]
pub(super) struct Served {
    tasks: Mutex<HashMap<u64, (Arc<Activity>, AbortHandle)>>,
    emptied: Condvar,
}

impl Served {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<u64, (Arc<Activity>, AbortHandle)>> {
        self.tasks.lock()
    }

    /// Takes a finished (or aborted) task out, and wakes [`Served::wait_empty`] if it was the
    /// last.
    pub(super) fn leave(&self, id: u64) {
        let mut tasks = self.tasks.lock();
        tasks.remove(&id);
        if tasks.is_empty() {
            // Under the lock: a waiter checks the map and parks under that same lock, so it
            // either sees the map empty or is parked before this notify (no lost wake-up).
            self.emptied.notify_all();
        }
    }

    /// Blocks (a thread outside the runtime) until no task runs or `deadline`; whether none
    /// runs.
    pub(super) fn wait_empty(&self, deadline: Instant) -> bool {
        let mut tasks = self.tasks.lock();
        // Bounded: each pass parks until a notify or the deadline, whichever comes first.
        while !tasks.is_empty() {
            if self.emptied.wait_until(&mut tasks, deadline).timed_out() {
                return tasks.is_empty();
            }
        }
        true
    }
}

/// Connection failures (refused handshakes, dead peers, protocol errors) logged at most once
/// per [`LOG_EVERY`] at WARNING, with how many were not: a peer retrying a wrong token must
/// not make the learner log (and take the GIL) once per attempt. The rest go to DEBUG; every
/// one is counted in the statistics.
#[derive(Default)]
pub(super) struct Throttled(pub(super) Mutex<(Option<Instant>, u64)>);

impl Throttled {
    pub(super) fn log(&self, message: &str) {
        let mut state = self.0.lock();
        let (last, unlogged) = &mut *state;
        if last.is_some_and(|at| at.elapsed() < LOG_EVERY) {
            *unlogged += 1;
            log::debug!(target: LOG_TARGET, "{message}");
            return;
        }
        let more = std::mem::take(unlogged);
        *last = Some(Instant::now());
        drop(state);
        if more > 0 {
            log::warn!(target: LOG_TARGET, "{message} (and {more} more failed connections in the last {LOG_EVERY:?})");
        } else {
            log::warn!(target: LOG_TARGET, "{message}");
        }
    }
}

/// What every connection task of a server shares.
pub(crate) struct Shared {
    pub(crate) ingress: Arc<Ingress>,
    /// The v1 handshake (open servers), sent before the v2 offer; empty with a token.
    pub(super) v1_handshake: Vec<u8>,
    pub(super) token: Option<Vec<u8>>,
    pub(super) layout: Layout,
    /// The largest hello body accepted (sized from `layout`).
    pub(super) max_hello: usize,
    pub(super) heartbeat: Option<Duration>,
    pub(super) sessions: Sessions,
    pub(super) session_timeout: Duration,
    /// Detached sessions kept at most (the oldest go first).
    pub(super) max_sessions: usize,
    pub(super) served: Registry,
    pub(super) epoch: Instant,
    pub(super) failures: Throttled,
    /// Offer the shared-memory path to clients on this host.
    pub(crate) shared_memory: bool,
    /// 0 while open; then the [`Closing`](crate::transport::wire::v2::Closing) reason of
    /// [`TcpServer::close`](super::TcpServer::close).
    pub(super) closing: watch::Sender<u8>,
    /// The leaves v2 clients that take codecs send compressed over TCP.
    pub(super) codecs: Option<Arc<LeafCodecs>>,
    /// The samples' policy versions, when the server keeps them (the layout ends with the
    /// version leaf, which clients must send).
    pub(super) versions: Option<Arc<crate::versions::PolicyVersions>>,
    /// The backend stores those leaves compressed so: queue the packed bytes with the
    /// decompressed sample, and it keeps them as they arrived.
    pub(super) keep_packed: bool,
    /// Whether a wire v1 client of a sequence table was warned about (once per server).
    pub(super) warned_v1_sequence: std::sync::atomic::AtomicBool,
    /// Bumped when a checkpoint completes: durable connections then tell their clients how
    /// far their session is persisted ([`Session::persisted`]).
    pub(super) persisted: watch::Sender<u64>,
    /// The learner's parameters, fetched by clients that ask.
    pub(super) params: Option<Arc<Params>>,
}

impl Shared {
    /// Every durable session's mark at the checkpoint whose capture just ran: its first
    /// sample past the samples of its queue that the capture counted. Call it after
    /// [`Ingress::capture`] and before the next one (checkpoints run one at a time).
    pub(crate) fn marks(&self) -> Vec<SessionMark> {
        self.sessions
            .0
            .lock()
            .iter()
            // ORDERING: Relaxed — set before the session's first sample from a durable
            // client was queued; a session marked after the capture has nothing counted.
            .filter(|(_, s)| s.durable.load(Relaxed))
            .map(|(id, s)| SessionMark { id: *id, seq: s.base + s.conn.captured() })
            .collect()
    }

    /// A checkpoint holding `marks` completed: each session still here is persisted that far,
    /// and its connection tells its client.
    pub(crate) fn persisted(&self, marks: &[SessionMark]) {
        {
            let sessions = self.sessions.0.lock();
            for mark in marks {
                if let Some(session) = sessions.get(&mark.id) {
                    // ORDERING: Relaxed — published to the connection tasks by the watch
                    // below (its lock orders this before their read).
                    session.persisted.fetch_max(mark.seq, Relaxed);
                }
            }
        }
        self.persisted.send_modify(|generation| *generation += 1);
    }

    /// Sessions a restored server's checkpoint held, detached and waiting for their clients:
    /// each resumes at its mark.
    pub(crate) fn seed(&self, marks: &[SessionMark]) {
        let mut sessions = self.sessions.0.lock();
        for mark in marks {
            let session = Session::new(&self.ingress, mark.seq, true);
            session.conn.detach();
            *session.detached_at.lock() = Some(Instant::now());
            // A restored session is persisted where it stands, and its client may claim any
            // resume point up to there (it may not have seen the last acks).
            // ORDERING: Relaxed — the session is published to the connection tasks by the
            // `sessions` mutex we hold.
            session.floor.store(0, Relaxed);
            // ORDERING: Relaxed — as above.
            session.persisted.store(mark.seq, Relaxed);
            sessions.insert(mark.id, Arc::new(session));
        }
    }

    pub(super) fn mode(&self) -> Mode {
        if self.token.is_some() {
            Mode::Token
        } else {
            Mode::Open
        }
    }
}

/// A v2 client's session: its ingress queue and how many of its samples are queued. It
/// outlives its connections, so a reconnecting client keeps its order and is deduplicated.
pub(crate) struct Session {
    pub(crate) conn: Arc<Connection>,
    pub(crate) space: Arc<Notify>,
    /// Sequence number of the next sample: samples of this session queued so far. Written
    /// only by the task that holds `owner`.
    pub(crate) next_seq: AtomicU64,
    /// The least `first_seq` a resuming client may present: the session's first sample, then
    /// the resume point of the latest connection that queued a sample (its client read that
    /// accept before it sent the sample, so it acknowledged everything before it); 0 for a
    /// restored session. Written only by the task that holds `owner`.
    pub(super) floor: AtomicU64,
    /// The resume point handed to the connection now (or last) served. Written only by the
    /// task that holds `owner`.
    pub(super) handed: AtomicU64,
    /// Held by the one task that serves the session.
    pub(super) owner: Arc<tokio::sync::Mutex<()>>,
    /// The admission id of that task, to end it when the client reconnects.
    pub(super) serving: Mutex<Option<u64>>,
    /// When its last connection ended (`None` while one is served).
    pub(super) detached_at: Mutex<Option<Instant>>,
    /// A durable client's: its samples go through `conn`'s queue only (never in place), so a
    /// checkpoint counts them exactly ([`Shared::marks`]), and it is told when they are
    /// persisted. Set by the first durable hello.
    pub(super) durable: AtomicBool,
    /// The sequence number of the first sample queued into `conn`.
    pub(super) base: u64,
    /// Every sample before this one is in a completed checkpoint (durable sessions).
    pub(super) persisted: AtomicU64,
}

impl Session {
    /// A new session whose next sample is `first_seq`, with its own ingress queue.
    pub(super) fn new(ingress: &Ingress, first_seq: u64, durable: bool) -> Self {
        let space = Arc::new(Notify::new());
        let conn = ingress.register(Box::new(NotifyWaker(Arc::clone(&space))));
        Self {
            conn,
            space,
            next_seq: AtomicU64::new(first_seq),
            floor: AtomicU64::new(first_seq),
            handed: AtomicU64::new(first_seq),
            owner: Arc::new(tokio::sync::Mutex::new(())),
            serving: Mutex::new(None),
            detached_at: Mutex::new(None),
            durable: AtomicBool::new(durable),
            base: first_seq,
            persisted: AtomicU64::new(0),
        }
    }

    /// The least `first_seq` a resuming client may present now: `floor`, or the resume point
    /// last handed over if a sample was queued since (its client had read it).
    pub(super) fn floor(&self) -> u64 {
        // ORDERING: Relaxed — as in `refuse_resume`.
        let (handed, queued) = (self.handed.load(Relaxed), self.next_seq.load(Relaxed));
        if queued > handed {
            handed
        } else {
            // ORDERING: Relaxed — as above.
            self.floor.load(Relaxed)
        }
    }

    /// Why a resuming client's `first_seq` (the first sample it has not seen acknowledged)
    /// cannot be this session's: only what the session acknowledged may be claimed, from
    /// `floor` to `next_seq`. A claim past `next_seq` would skip samples the client still
    /// holds (they would be dropped unsent), and one below `floor` is no client's.
    pub(super) fn refuse_resume(&self, first_seq: u64, durable: bool) -> Option<String> {
        // A durable client claims only what it was told is persisted, and resends what it
        // kept past wherever the session stands (a restored server's stands where its
        // checkpoint does): any claim is its own.
        if durable {
            return None;
        }
        // ORDERING: Relaxed — under `owner` (see `next_seq`) the mutex orders these loads after
        // the previous holder's writes. Before `owner` is taken (the early check) a stale
        // `next_seq` can only be lower than the value under `owner`, which re-checks: an early
        // refusal of a resume that is valid once `owner` is held needs the previous task to
        // have queued a sample the client saw acknowledged but this load did not see, and the
        // ack reached the client through the socket, after the increment.
        let (floor, queued) = (self.floor(), self.next_seq.load(Relaxed));
        if first_seq > queued {
            Some(format!(
                "session resume refused: the client says sample {first_seq} is the first it has \
                 not seen acknowledged, but this session queued only {queued} samples (a resume \
                 may claim {floor} to {queued}); another client may be using this session id"
            ))
        } else if first_seq < floor {
            Some(format!(
                "session resume refused: the client says sample {first_seq} is the first it has \
                 not seen acknowledged, but this session's client was already told samples \
                 before {floor} were (a resume may claim {floor} to {queued}); another client \
                 may be using this session id"
            ))
        } else {
            None
        }
    }
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
pub(super) struct Sessions(pub(super) Mutex<HashMap<[u8; 16], Arc<Session>>>);

/// How often refusals and evictions are logged: one record per interval, with a count.
pub(super) const LOG_EVERY: Duration = Duration::from_secs(10);
/// How long a reconnecting client waits for its session's previous connection to end.
pub(super) const TAKEOVER_GRACE: Duration = Duration::from_secs(5);
/// A strict prefix of a hello that stalls this long is taken as v1 sample data.
pub(super) const PREFIX_GRACE: Duration = Duration::from_millis(200);
/// How long a client may take to send its hello once it started.
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Forgets sessions whose client has not come back within `session_timeout`, and the oldest
/// detached ones beyond `max_sessions`.
pub(super) async fn reap_sessions(shared: Arc<Shared>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry holding one parked task; the task's abort handle.
    fn one_task(runtime: &tokio::runtime::Runtime) -> Arc<Served> {
        let served = Arc::new(Served::default());
        let task = runtime.spawn(std::future::pending::<()>());
        served.lock().insert(7, (Arc::new(Activity::default()), task.abort_handle()));
        served
    }

    #[test]
    fn waiting_for_the_tasks_ends_when_the_last_one_leaves_not_at_the_deadline() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let served = one_task(&runtime);
        let leaver = Arc::clone(&served);
        let start = Instant::now();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            leaver.leave(7);
        });
        assert!(served.wait_empty(start + Duration::from_secs(30)));
        assert!(start.elapsed() < Duration::from_secs(10), "woken by the leave, not the deadline");
        thread.join().unwrap();
        // Nothing runs: no wait at all.
        assert!(served.wait_empty(Instant::now()));
    }

    #[test]
    fn waiting_for_the_tasks_gives_up_at_the_deadline_while_one_runs() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let served = one_task(&runtime);
        let start = Instant::now();
        assert!(!served.wait_empty(start + Duration::from_millis(100)));
        assert!(start.elapsed() >= Duration::from_millis(100));
    }
}
