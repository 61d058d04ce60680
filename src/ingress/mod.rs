//! Ingress: per-connection queues and the drainer pool that moves their samples into the
//! backend (the FIFO store or a replay table).
//!
//! ```text
//!  transport task (one per connection)         drainer thread (fixed pool, owns a subset)
//!  ───────────────────────────────────         ──────────────────────────────────────────
//!  buf = conn.free.pop() (or allocate,         every round, starting one queue further:
//!        up to the pool cap; else wait)          pop at most each queue's depth on arrival
//!  read exactly payload_size bytes into buf      backend.insert(all popped) (one call)
//!  conn.queue.push(buf)   (full: wait)           give buffers back to conn.free, wake conns
//!  ack once queued                               prune closed connections once drained
//!  wake the drainer if it sleeps                 nothing popped: sleep until woken
//! ```
//!
//! - Each queue has exactly one producer (its connection's task) and one consumer (its
//!   drainer), so producers never contend with each other.
//! - Buffers cycle between `free` and `queue`; a connection allocates at most
//!   `2 * queue_size + 1` of them over its life (queue + one drainer round + the one being
//!   filled), so the steady state allocates nothing.
//! - Per-connection order is kept: one drainer owns a connection, pops in FIFO order and inserts
//!   what it popped in order.
//! - A sample acknowledged to the client is in its queue; a closed connection is pruned only
//!   once its queue is empty, so acknowledged samples reach the backend even if the client
//!   disconnects right after.
//!
//! Checkpoints copy what the ingress holds at the backend's snapshot moment
//! ([`Ingress::capture`]; why that is every acknowledged sample, once, is in `capture.rs`).
//!
//! | file            | holds                                                              |
//! |-----------------|--------------------------------------------------------------------|
//! | `mod.rs`        | [`Ingress`]: starting the drainers, registering connections, shutdown |
//! | `config.rs`     | [`IngressConfig`] and its checks                                   |
//! | `connection.rs` | [`Connection`]: its queue, buffer pool, streams, direct inserts    |
//! | `budget.rs`     | the byte budget over all buffers, shared-memory segment reservations |
//! | `drainer.rs`    | the drainer threads and their rounds                               |
//! | `stats.rs`      | the counters, transport events, [`IngressSnapshot`]                |
//! | `capture.rs`    | a checkpoint's copy of the acknowledged samples the ingress holds  |

mod budget;
mod capture;
mod config;
mod connection;
mod drainer;
mod stats;

use std::collections::{HashSet, VecDeque};
use std::thread::{self, JoinHandle};

use crossbeam_queue::ArrayQueue;
use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::EchoError;
use crate::metrics::{Counter, HistSummary, Histo};
use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, AtomicUsize};

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use budget::ByteBudget;
use config::LOG_TARGET;
use connection::RowStreams;
use connection::{DrainerShared, DrainerState};
use drainer::Drainer;

pub use budget::{BudgetHold, Packed, SegmentReservation};
pub use config::IngressConfig;
pub use connection::{Connection, Direct, SpaceWaker, StepMark};
pub use stats::{IngressSnapshot, IngressStats, TransportEvent};

/// The drainer pool and connection registry.
pub struct Ingress {
    backend: Backend,
    config: IngressConfig,
    drainers: Vec<Arc<DrainerShared>>,
    handles: Mutex<Vec<JoinHandle<()>>>,
    shutdown: AtomicBool,
    stats: Arc<IngressStats>,
    /// Bytes of sample buffers all connections hold, bounded by `max_buffered_bytes`.
    budget: Arc<ByteBudget>,
    /// Shared by all drainers (zero-sized without `detailed-metrics`).
    drain_round: Histo,
    queue_dwell: Histo,
    /// Connections registered so far: numbers each one's streams.
    connections: AtomicU64,
}
impl Ingress {
    /// Starts `min(config.num_drainers, available CPUs)` drainer threads inserting into
    /// `backend`.
    ///
    /// # Errors
    /// [`EchoError::Config`] for bad settings, [`EchoError::Io`] if a thread cannot start.
    pub fn start(backend: Backend, config: IngressConfig) -> Result<Arc<Self>, EchoError> {
        config.validate(backend.spec().payload_size())?;
        let drainers: Vec<_> =
            (0..config.effective_drainers()).map(|_| Arc::new(DrainerShared::new())).collect();
        let ingress = Arc::new(Self {
            backend,
            config,
            drainers,
            handles: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            stats: Arc::new(IngressStats::default()),
            budget: Arc::new(ByteBudget::new(config.max_buffered_bytes)),
            drain_round: Histo::new(),
            queue_dwell: Histo::new(),
            connections: AtomicU64::new(0),
        });
        for (index, shared) in ingress.drainers.iter().enumerate() {
            let (ingress_ref, shared_ref) = (Arc::clone(&ingress), Arc::clone(shared));
            let spawned = thread::Builder::new()
                .name(format!("echo-drainer-{index}"))
                .spawn(move || Drainer::new(ingress_ref, shared_ref).run());
            match spawned {
                Ok(handle) => {
                    shared.bell.set_sleeper(handle.thread().clone());
                    ingress.handles.lock().push(handle);
                }
                Err(err) => {
                    ingress.shutdown();
                    return Err(EchoError::Io(err));
                }
            }
        }
        Ok(ingress)
    }

    /// A new connection, assigned to the least-loaded drainer. `waker` is called whenever a
    /// buffer or queue slot of this connection comes free.
    pub fn register(&self, waker: Box<dyn SpaceWaker>) -> Arc<Connection> {
        let drainer =
            self.drainers.iter().min_by_key(|d| d.load.get()).expect("at least one drainer");
        drainer.load.add(1);
        let payload_size = self.backend.spec().payload_size();
        // ORDERING: Relaxed — only numbers connections; nothing else is published with it.
        let number = self.connections.fetch_add(1, Relaxed);
        let conn = Arc::new(Connection {
            stream_base: (number + 1) << 32,
            rows_used: AtomicU32::new(0),
            streams: Mutex::new(RowStreams {
                rows: HashSet::new(),
                hold: BudgetHold::new(&self.budget),
            }),
            stream_cost: self.backend.stream_cost(),
            queue: ArrayQueue::new(self.config.queue_size),
            stash: Mutex::new(VecDeque::new()),
            stashed: AtomicUsize::new(0),
            dequeued: AtomicU64::new(0),
            inserted_direct: AtomicU64::new(0),
            captured: AtomicU64::new(0),
            free: ArrayQueue::new(2 * self.config.queue_size + 1),
            allocated: AtomicUsize::new(0),
            unfinished: AtomicUsize::new(0),
            backend: self.backend.clone(),
            budget: Arc::clone(&self.budget),
            payload_size,
            closed: AtomicBool::new(false),
            drainer: Arc::clone(drainer),
            waker,
            stats: Arc::clone(&self.stats),
            segment_depth: Counter::default(),
        });
        drainer.incoming.lock().push(Arc::clone(&conn));
        drainer.bell.wake();
        conn
    }

    /// A transport accepted a connection; [`Ingress::connection_ended`] when it ends. Counted
    /// as `active_connections` (connections open, whether or not they have sent anything).
    pub fn connection_opened(&self) {
        self.stats.active_connections.add(1);
    }

    /// A connection counted by [`Ingress::connection_opened`] ended.
    pub fn connection_ended(&self) {
        self.stats.active_connections.sub(1);
    }

    /// Number of drainer threads running.
    pub fn num_drainers(&self) -> usize {
        self.drainers.len()
    }

    /// The backend (FIFO store or replay table) the drainers insert into.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The drainers' `drain_round` and `queue_dwell` histograms (zero without
    /// `detailed-metrics`).
    pub fn detailed(&self) -> (HistSummary, HistSummary) {
        (self.drain_round.summary(), self.queue_dwell.summary())
    }

    /// Clears the drainers' histograms.
    pub fn reset_histograms(&self) {
        self.drain_round.reset();
        self.queue_dwell.reset();
    }

    /// Stops and joins every drainer. Close the backend first, so that a drainer blocked on a
    /// full ring returns. Samples still queued are dropped (the server is closing). Idempotent.
    /// Drainers hold the ingress alive, so this must be called; dropping is not enough.
    pub fn shutdown(&self) {
        // ORDERING: Release pairs with the drainers' Acquire loads of the flag.
        self.shutdown.store(true, Release);
        for d in &self.drainers {
            d.bell.wake();
        }
        let handles = std::mem::take(&mut *self.handles.lock());
        for handle in handles {
            if handle.join().is_err() {
                log::error!(target: LOG_TARGET, "an echo drainer thread panicked");
            }
        }
        // A connection registered while its drainer was blocked (on a full backend) was never
        // adopted, and `Connection -> DrainerShared -> incoming -> Connection` is a cycle:
        // break it, or the connection and its buffers outlive the server.
        for d in &self.drainers {
            d.incoming.lock().clear();
            // Adopted connections and a round's buffers sit in the drainer's shared state,
            // which each connection points back to: the same cycle.
            *d.state.write() = DrainerState::default();
        }
    }

    fn is_shutting_down(&self) -> bool {
        // ORDERING: Acquire pairs with the Release store in `shutdown`.
        self.shutdown.load(Acquire)
    }
}
