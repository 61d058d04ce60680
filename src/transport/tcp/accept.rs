//! Admission: the accept loop, the connection limit and evicting an idle connection for a
//! newcomer at that limit, and the registry of running connection tasks (what
//! [`super::TcpServer::close`] waits on).

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::connection::serve;
use super::link::closed;
use super::session::LOG_TARGET;
use super::session::{Activity, Registry, Shared, LOG_EVERY};
use crate::ingress::Ingress;

/// How long an accepted connection waits for the slot of the connection evicted for it.
const EVICTION_GRACE: Duration = Duration::from_secs(1);

/// Who gets one of the `max_connections` slots. The policy, when every slot is taken: evict
/// the connection that has been silent longest among those that have not completed a sample
/// yet, and give its slot to the newcomer; refuse the newcomer only when every connection has
/// completed one. So idle connections, however many, cannot lock a worker out, and a working
/// connection (also one held back by backpressure) is never dropped for a newcomer.
pub(super) struct Admission {
    pub(super) limit: Arc<Semaphore>,
    pub(super) max: usize,
    pub(super) epoch: Instant,
    pub(super) next_id: AtomicU64,
    /// Every served connection's activity and the handle that ends its task.
    pub(super) served: Registry,
    /// Refusals and evictions since the last log record, and when that was.
    pub(super) unlogged: (u64, u64),
    pub(super) logged_at: Option<Instant>,
}

impl Admission {
    pub(super) fn new(max: usize) -> Self {
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
                target: LOG_TARGET, "refused {refused} connection(s): all {} connections are working ones",
                self.max
            );
        }
        if evicted > 0 {
            log::info!(
                target: LOG_TARGET, "evicted {evicted} idle connection(s) to admit new ones ({} connections open)",
                self.max
            );
        }
        self.logged_at = Some(Instant::now());
    }
}

pub(super) async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut admission: Admission,
) {
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
                log::warn!(target: LOG_TARGET, "accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Takes a finished (or aborted) connection task out of the admission registry.
struct Leave {
    pub(super) served: Registry,
    pub(super) id: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        self.served.leave(self.id);
    }
}
