//! The server: one storage backend, the ingress that feeds it and the transport in front of
//! the ingress, with their lifecycle in one place.
//!
//! A [`Server`] is what `echo.Server` is, without Python: it is built from a [`DataSpec`] and
//! a [`ServerConfig`], starts a TCP transport on demand ([`Server::start`]), takes in-process
//! samples ([`Server::insert`]), hands batches to its one consumer ([`Server::sample_slice`]),
//! closes at once or after draining what was acknowledged ([`Server::close`]), and reports
//! every counter at one moment ([`Server::snapshot`]). The bindings (`src/python/server.rs`)
//! convert arguments, release the GIL around these calls, map errors to exceptions and build
//! numpy views; they decide nothing about the lifecycle.
//!
//! The order of a close is the one invariant here: the backend is marked closed first (so
//! drainers blocked on a full backend return, and a `start` racing the close sees it), then
//! the transport is shut down and its threads joined, then what never reached the learner is
//! counted, once ([`Server::dropped_at_close`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};

mod checkpoint;

use crate::backend::{Backend, BackendConfig, BackendStats, BatchConsumer, BatchRef};
use crate::codec::Codec;
use crate::error::EchoError;
use crate::error::InsertError;
use crate::ingress::{Ingress, IngressConfig, IngressSnapshot};
use crate::metrics::{self, DetailedSnapshot};
use crate::params::{ParamCounts, Params};
use crate::queued::{QueuedSamples, SessionMark};
use crate::replay::{InsertHoldback, SampleHoldback};
use crate::source::SampleSource;
use crate::spec::DataSpec;
use crate::sync::Arc;
use crate::transport::tcp::TcpConfig;
use crate::transport::wire::v2::Closing;
use crate::transport::TcpIngress;
use crate::versions::{version_leaf, PolicyVersions, StaleCounts, Stamped, VersionsConfig};

/// How a [`Server`] is built: its backend, and the ingress its transport will feed.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The FIFO ring, a replay table or a sequence table, and their settings.
    pub backend: BackendConfig,
    /// Drainer threads of the ingress (when a transport starts).
    pub num_drainers: usize,
    /// Samples each connection's queue holds; `None`: sized from the payload
    /// ([`IngressConfig::queue_size_for`]).
    pub producer_queue_size: Option<usize>,
    /// Per leaf, the codec v2 clients compress it with over TCP (`None` or empty: raw).
    pub wire_codecs: Vec<Option<Codec>>,
    /// The server's name: what labels its metrics (`echo.Server(name=...)`), recorded by
    /// its checkpoints so that a restored server keeps it. `None`: none to record.
    pub name: Option<String>,
    /// Whether samples carry the version of the policy that made them, and the staleness
    /// bound (`None`: they do not; the spec is the sample's alone).
    pub versions: Option<VersionsConfig>,
}

/// When the last checkpoint completed (Unix seconds), how long it took (seconds) and the
/// bytes its files hold; all zero before the first.
#[derive(Debug, Clone, Copy, Default)]
pub struct LastCheckpoint {
    /// Completion time, Unix seconds.
    pub unix_s: f64,
    /// Seconds from start to completion.
    pub duration_s: f64,
    /// Bytes the checkpoint's files hold.
    pub bytes: u64,
}

/// Every counter of a server at one moment.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The backend's counters.
    pub backend: BackendStats,
    /// The ingress's; zero before a transport started.
    pub ingress: IngressSnapshot,
    /// `None` in the default build (no `detailed-metrics`).
    pub detailed: Option<DetailedSnapshot>,
    /// The last completed checkpoint; all zero before one.
    pub last_checkpoint: LastCheckpoint,
    /// Samples in-process inserts ([`Server::insert`] and its batch form) put in.
    pub submitted: u64,
    /// Bytes of one sample (every leaf raw).
    pub payload_bytes: u64,
    /// Samples kept from the learner for their policy version, by cause, and the lag of
    /// those handed out; zero without versions.
    pub stale: StaleCounts,
    /// The parameter channel's version and what it published and served.
    pub params: ParamCounts,
}

/// The server: a backend, its single consumer, and the transport and ingress in front of it.
pub struct Server {
    backend: Backend,
    /// The settings it was built with, as a checkpoint records them.
    config: ServerConfig,
    /// The single consumer. The mutex serialises sampling callers; a batch stays valid while
    /// its guard is held (see [`Server::sample_slice`]).
    consumer: Mutex<BatchConsumer>,
    /// The ingress settings a transport starts with (`max_buffered_bytes` comes with it).
    ingress_config: IngressConfig,
    /// Per leaf, what v2 clients compress over TCP.
    wire_codecs: Vec<Option<Codec>>,
    /// The running transport; `None` before [`Server::start`] and after the close. Taken
    /// only with the backend's closed mark checked under it (see `start`).
    tcp: Mutex<Option<TcpIngress>>,
    /// The drainer pool behind `tcp`, set once when it starts and kept after the close (its
    /// counters stay readable).
    ingress: OnceLock<Arc<Ingress>>,
    /// Set by a draining close: nothing more comes in; sampling hands out what is left.
    draining: AtomicBool,
    /// Acknowledged or submitted samples that never reached the learner, set once when the
    /// server closes for good.
    dropped_at_close: OnceLock<u64>,
    /// The last checkpoint that completed, for [`Server::snapshot`].
    last_checkpoint: Mutex<LastCheckpoint>,
    /// Samples in-process inserts put in, counted as each call returns.
    submitted: AtomicU64,
    /// The durable sessions of the checkpoint this server was restored from, seeded into the
    /// transport when it starts.
    restored_sessions: Mutex<Vec<SessionMark>>,
    /// The parameters the learner publishes to its workers.
    params: Arc<Params>,
    /// The samples' policy versions, when they carry them (the backend's last leaf).
    versions: Option<Arc<PolicyVersions>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("batch_size", &self.backend.batch_size())
            .field("closed", &self.backend.is_closed())
            .finish_non_exhaustive()
    }
}

impl Server {
    /// A server storing samples of `spec` as `config` says. Pre-allocates the backend.
    ///
    /// # Errors
    /// [`EchoError::Config`] for settings the backend refuses, or the allocation's error.
    pub fn new(spec: DataSpec, config: ServerConfig) -> Result<Self, EchoError> {
        let queue_size = config
            .producer_queue_size
            .unwrap_or_else(|| IngressConfig::queue_size_for(spec.payload_size()));
        let ingress_config = IngressConfig::new(config.num_drainers, queue_size);
        let versions = config
            .versions
            .map(|v| Arc::new(PolicyVersions::new(spec.len(), v.max_staleness, v.admission)));
        let spec = match versions {
            Some(_) => {
                let mut arrays = spec.arrays().to_vec();
                arrays.push(version_leaf());
                DataSpec::new(arrays)?
            }
            None => spec,
        };
        let mut config = config;
        if versions.is_some() {
            // The version leaf is stored and sent raw.
            let compress = match &mut config.backend {
                BackendConfig::Replay(replay) | BackendConfig::Sequence(replay, _) => {
                    Some(&mut replay.compress)
                }
                BackendConfig::Fifo { .. } => None,
            };
            for codecs in compress.into_iter().chain([&mut config.wire_codecs]) {
                if !codecs.is_empty() {
                    codecs.push(None);
                }
            }
        }
        let (backend, mut consumer) = Backend::new(spec, config.backend.clone())?;
        if let Some(versions) = &versions {
            backend.set_policy_versions(Arc::clone(versions));
            consumer = consumer.judged_by(versions)?;
        }
        Ok(Self {
            backend,
            wire_codecs: config.wire_codecs.clone(),
            config,
            consumer: Mutex::new(consumer),
            ingress_config,
            tcp: Mutex::new(None),
            ingress: OnceLock::new(),
            draining: AtomicBool::new(false),
            dropped_at_close: OnceLock::new(),
            last_checkpoint: Mutex::new(LastCheckpoint::default()),
            submitted: AtomicU64::new(0),
            restored_sessions: Mutex::new(Vec::new()),
            params: Arc::new(Params::default()),
            versions,
        })
    }

    /// The storage backend (for what only it answers: its spec, settings and checkpoints).
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The ingress, once a transport has started.
    pub fn ingress(&self) -> Option<&Ingress> {
        self.ingress.get().map(Arc::as_ref)
    }

    /// The ingress's settings (each connection's queue size, the drainers).
    pub fn ingress_config(&self) -> &IngressConfig {
        &self.ingress_config
    }

    /// The most samples the server holds at once (see [`Backend::capacity`]).
    pub fn capacity(&self) -> usize {
        self.backend.capacity()
    }

    /// Starts the TCP transport with `tcp` (its codecs are the server's) and an ingress of
    /// the server's settings whose buffers hold at most `max_buffered_bytes`. Returns the
    /// port it bound.
    ///
    /// # Errors
    /// [`EchoError::Closed`] once the server is closed, [`EchoError::Config`] when a
    /// transport already runs (or ran), or the bind's error.
    pub fn start(&self, mut tcp: TcpConfig, max_buffered_bytes: usize) -> Result<u16, EchoError> {
        tcp.codecs.clone_from(&self.wire_codecs);
        tcp.restored_sessions.clone_from(&self.restored_sessions.lock());
        tcp.params = Some(Arc::clone(&self.params));
        tcp.versions.clone_from(&self.versions);
        let ingress_config = IngressConfig { max_buffered_bytes, ..self.ingress_config };
        // Under the transport lock. A close marks the backend closed before it takes the lock:
        // a start that gets the lock first is shut down by that close, one that gets it after
        // sees the mark and starts nothing.
        let mut slot = self.tcp.lock();
        if self.backend.is_closed() {
            return Err(EchoError::Closed);
        }
        if slot.is_some() || self.ingress.get().is_some() {
            return Err(EchoError::Config("the TCP transport is already running".into()));
        }
        let started = TcpIngress::start(self.backend.clone(), ingress_config, &tcp)?;
        let port = started.local_addr().port();
        let _ = self.ingress.set(started.ingress());
        *slot = Some(started);
        Ok(port)
    }

    /// Publishes parameters of layout `spec` (one byte slice per leaf) as `version`, or as
    /// the latest plus one: what the workers fetch from now on (see [`Params::publish`]),
    /// compressed with `codec` for those that fetch over TCP.
    /// Takes neither the backend's nor the ingress's locks.
    ///
    /// # Errors
    /// As [`Params::publish`]: a layout other than the first publish's, leaves that do not
    /// fit it, a version that does not grow.
    pub fn publish(
        &self,
        spec: &DataSpec,
        leaves: &[&[u8]],
        version: Option<u64>,
        codec: Option<crate::codec::Codec>,
    ) -> Result<u64, EchoError> {
        let version = self.params.publish(spec, leaves, version, codec)?;
        if let Some(versions) = &self.versions {
            versions.set_latest(version);
        }
        Ok(version)
    }

    /// The samples' policy versions, when they carry them.
    pub fn policy_versions(&self) -> Option<&Arc<PolicyVersions>> {
        self.versions.as_ref()
    }

    /// The server's parameter channel.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// Inserts `source`'s samples (in-process), with `priority` (replay), waiting for room
    /// until `deadline`; counts what went in (see [`Snapshot::submitted`]).
    ///
    /// # Errors
    /// As [`Backend::insert`].
    pub fn insert(
        &self,
        source: &dyn SampleSource,
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> Result<(), InsertError> {
        self.insert_versioned(source, priority, deadline, None)
    }

    /// [`Server::insert`] of samples made by policy `version` (`None`: the latest published),
    /// when the server keeps versions: `source` has the sample's leaves, and the version leaf
    /// is appended. Without versions, `version` is ignored.
    ///
    /// # Errors
    /// As [`Backend::insert`].
    pub fn insert_versioned(
        &self,
        source: &dyn SampleSource,
        priority: Option<f64>,
        deadline: Option<Instant>,
        version: Option<u64>,
    ) -> Result<(), InsertError> {
        let stamped;
        let source = match &self.versions {
            Some(versions) => {
                stamped = Stamped::new(source, version.unwrap_or_else(|| versions.latest()));
                &stamped
            }
            None => source,
        };
        let done = self.backend.insert(source, priority, deadline);
        let inserted = match &done {
            Ok(()) => source.num_samples(),
            Err(err) => err.inserted,
        };
        if inserted > 0 {
            // ORDERING: Relaxed — a statistic, read on its own by `snapshot()`.
            self.submitted.fetch_add(inserted as u64, Relaxed);
        }
        done
    }

    /// What held the last insert back (a replay or sequence table's rate limiter or a full
    /// table), for a timeout's message; `None` for the FIFO ring.
    pub fn insert_holdback(&self) -> Option<InsertHoldback> {
        self.backend.insert_holdback()
    }

    /// Whether the server is closed, or draining (it takes nothing more in).
    pub fn is_closed_to_inserts(&self) -> bool {
        self.backend.is_closed() || self.is_draining()
    }

    /// Whether a draining close is under way.
    pub fn is_draining(&self) -> bool {
        // ORDERING: Relaxed — read only as a mode switch; the drain's end is decided on the
        // ingress's own counters.
        self.draining.load(Relaxed)
    }

    /// Closes the server, telling TCP clients why (`Closing::Restarting`: it comes back).
    ///
    /// At once (`drain` false): stops the transport (closing every connection), wakes
    /// blocked samplers (they see [`EchoError::Closed`]) and inserters, joins every thread
    /// and counts what was dropped. Idempotent.
    ///
    /// Draining: stops accepting and reading (nothing more is acknowledged) and refuses
    /// in-process inserts, but lets what was acknowledged reach the backend; sampling goes on
    /// until nothing more can come (see [`Server::sample_slice`]), then the server closes for
    /// good.
    pub fn close(&self, drain: bool, why: Closing) {
        if drain && !self.backend.is_closed() {
            // ORDERING: Relaxed — see `is_draining`.
            self.draining.store(true, Relaxed);
            if let Some(tcp) = self.tcp.lock().as_mut() {
                tcp.stop_accepting(why);
            }
            return;
        }
        // The clients first, while their connections' queued samples still go in.
        if let Some(tcp) = self.tcp.lock().as_mut() {
            tcp.stop_accepting(why);
        }
        self.close_now();
    }

    /// Closes for good (it joins threads): the backend first, so drainers blocked on a full
    /// backend return and a `start` racing this sees it, then the transport and the drainers;
    /// then counts what was dropped.
    fn close_now(&self) {
        self.backend.close();
        let tcp = self.tcp.lock().take();
        drop(tcp); // shuts the transport down and joins its threads
        let queued = self.ingress.get().map_or(0, |i| i.snapshot().samples_pending);
        let committed = match self.backend.stats() {
            BackendStats::Fifo(fifo) => fifo.store_size,
            // The items stay in the table, nothing is lost.
            BackendStats::Replay(_) | BackendStats::Sequence(_) => 0,
        };
        let dropped = queued + committed;
        if self.dropped_at_close.set(dropped).is_ok() && dropped > 0 {
            log::warn!(
                "closed with {dropped} samples that never reached the learner ({queued} still \
                 queued in the ingress, {committed} committed but fewer than a batch or not \
                 sampled); close(drain=True) hands out every full batch first"
            );
        }
    }

    /// Acknowledged or submitted samples that never reached the learner, counted when the
    /// server closed for good (`None` before): what was still queued in the ingress, plus, for
    /// FIFO, what was committed to the ring but never handed out.
    pub fn dropped_at_close(&self) -> Option<u64> {
        self.dropped_at_close.get().copied()
    }

    /// During a drain: whether nothing more can reach the consumer (the ingress is empty).
    fn drained(&self) -> bool {
        self.is_draining() && self.ingress.get().is_none_or(|i| i.snapshot().samples_pending == 0)
    }

    /// One slice of a wait for the consumer's next batch, until `slice_end`:
    /// - `Some(Ok(..))`: the consumer, still locked (nobody samples over the batch while the
    ///   caller reads it), the batch, and the counters right after it was handed out;
    /// - `Some(Err(EchoError::Closed))`: the server is closed, or a drain has ended (the
    ///   server is then closed for good);
    /// - `Some(Err(..))`: another failure;
    /// - `None`: no batch by `slice_end`; `holdback` says what held it back (a replay or
    ///   sequence table), for a timeout's message.
    ///
    /// Call it in a loop until a deadline (the bindings release the GIL between slices).
    #[allow(clippy::type_complexity)] // one result of three parts, named in the doc above
    pub fn sample_slice(
        &self,
        slice_end: Instant,
        holdback: &mut Option<SampleHoldback>,
    ) -> Option<Result<(MutexGuard<'_, BatchConsumer>, BatchRef, Snapshot), EchoError>> {
        let mut guard = self.consumer.try_lock_until(slice_end)?;
        // Checked before the wait: once drained, only what is committed now is left.
        let drained = self.drained();
        if drained && self.backend.has_priorities() {
            // Replay tables sample forever: a drain ends when the ingress is empty.
            self.close_now();
            return Some(Err(EchoError::Closed));
        }
        let wait_until = if drained { Instant::now() } else { slice_end };
        match guard.sample(Some(wait_until)) {
            Ok(batch) => {
                // The lag of what the learner trains on (a sequence table's windows hold
                // padding steps, of no version: not counted).
                if let Some(versions) =
                    self.versions.as_ref().filter(|_| self.backend.sequence().is_none())
                {
                    guard.read_leaf(&batch, versions.leaf(), |bytes| versions.note_handed(bytes));
                }
                Some(Ok((guard, batch, self.snapshot())))
            }
            Err(EchoError::TimedOut) if drained => {
                self.close_now(); // fewer than a batch left, and nothing more coming
                Some(Err(EchoError::Closed))
            }
            Err(EchoError::TimedOut) => {
                *holdback = guard.holdback();
                None
            }
            Err(other) => Some(Err(other)),
        }
    }

    /// What a checkpoint of the backend finds outside it at its snapshot moment: the
    /// acknowledged samples the ingress holds ([`Ingress::capture`]); none before a transport
    /// started. Pass it to [`Backend::checkpoint`] as its capture.
    pub fn queued_now(&self) -> QueuedSamples {
        self.ingress.get().map_or_else(
            || QueuedSamples::new(self.backend.spec().payload_size()),
            |ingress| ingress.capture(),
        )
    }

    /// Records a completed checkpoint, for [`Server::snapshot`].
    pub fn record_checkpoint(&self, last: LastCheckpoint) {
        *self.last_checkpoint.lock() = last;
    }

    /// Clears the timing histograms (counters stay). Nothing to clear without
    /// `detailed-metrics`.
    pub fn reset_histograms(&self) {
        self.backend.reset_histograms();
        if let Some(ingress) = self.ingress.get() {
            ingress.reset_histograms();
        }
    }

    /// Every counter now. May wait for a replay table's lock.
    pub fn snapshot(&self) -> Snapshot {
        let ingress = self.ingress.get();
        let detailed = metrics::ENABLED.then(|| {
            let mut d = self.backend.detailed();
            if let Some(ingress) = ingress {
                (d.drain_round, d.queue_dwell) = ingress.detailed();
            }
            d
        });
        Snapshot {
            backend: self.backend.stats(),
            ingress: ingress.map(|i| i.snapshot()).unwrap_or_default(),
            detailed,
            last_checkpoint: *self.last_checkpoint.lock(),
            // ORDERING: Relaxed — see `insert`.
            submitted: self.submitted.load(Relaxed),
            payload_bytes: self.backend.spec().payload_size() as u64,
            stale: self.versions.as_ref().map(|v| v.counts()).unwrap_or_default(),
            params: self.params.counts(),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Wakes any thread still blocked in this backend and stops the transport; batches
        // handed out keep their memory alive.
        self.backend.close();
        drop(self.tcp.lock().take());
    }
}
