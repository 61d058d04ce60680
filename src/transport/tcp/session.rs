//! What a server's connection tasks share ([`Shared`]), and the v2 sessions that outlive
//! their connections ([`Session`]): a session owns its ingress queue and counts the samples
//! queued, so a reconnecting client keeps its order and a resent sample is never queued twice.
//! Detached sessions are forgotten after `session_timeout` ([`reap_sessions`]).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{watch, Notify};

use super::accept::Registry;
use super::connection::Throttled;
use crate::codec::LeafCodecs;
use crate::ingress::{Connection, Ingress, SpaceWaker};
use crate::transport::wire::v2::{Layout, Mode};

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
    /// The backend stores those leaves compressed so: queue the packed bytes with the
    /// decompressed sample, and it keeps them as they arrived.
    pub(super) keep_packed: bool,
}

impl Shared {
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
    pub(super) space: Arc<Notify>,
    /// Sequence number of the next sample: samples of this session queued so far. Written
    /// only by the task that holds `owner`.
    pub(crate) next_seq: AtomicU64,
    /// Held by the one task that serves the session.
    pub(super) owner: Arc<tokio::sync::Mutex<()>>,
    /// The admission id of that task, to end it when the client reconnects.
    pub(super) serving: Mutex<Option<u64>>,
    /// When its last connection ended (`None` while one is served).
    pub(super) detached_at: Mutex<Option<Instant>>,
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
