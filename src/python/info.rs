//! `SampleInfo` and `HistSnapshot`: frozen per-batch snapshots of the server's counters.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::backend::BackendStats;
use crate::ingress::IngressSnapshot;
use crate::metrics::{DetailedSnapshot, HistSummary};

/// A latency histogram snapshot, in nanoseconds. All zero without `detailed-metrics`, so
/// `if info.memcpy.count > 0:` works in every build.
#[pyclass(frozen, get_all, module = "echo._echo", name = "HistSnapshot")]
#[derive(Debug, Clone, Default)]
pub(crate) struct HistSnapshot {
    count: u64,
    min_ns: u64,
    max_ns: u64,
    mean_ns: f64,
    p50_ns: u64,
    p90_ns: u64,
    p99_ns: u64,
}

impl From<HistSummary> for HistSnapshot {
    fn from(h: HistSummary) -> Self {
        Self {
            count: h.count,
            min_ns: h.min_ns,
            max_ns: h.max_ns,
            mean_ns: h.mean_ns,
            p50_ns: h.p50_ns,
            p90_ns: h.p90_ns,
            p99_ns: h.p99_ns,
        }
    }
}

#[pymethods]
impl HistSnapshot {
    /// The fields as a plain dict.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("count", self.count)?;
        d.set_item("min_ns", self.min_ns)?;
        d.set_item("max_ns", self.max_ns)?;
        d.set_item("mean_ns", self.mean_ns)?;
        d.set_item("p50_ns", self.p50_ns)?;
        d.set_item("p90_ns", self.p90_ns)?;
        d.set_item("p99_ns", self.p99_ns)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "HistSnapshot(count={}, min_ns={}, max_ns={}, mean_ns={:.1}, p50_ns={}, p90_ns={}, p99_ns={})",
            self.count, self.min_ns, self.max_ns, self.mean_ns, self.p50_ns, self.p90_ns, self.p99_ns
        )
    }
}

/// What the server looked like when a batch was handed out.
#[pyclass(frozen, get_all, module = "echo._echo", name = "SampleInfo")]
#[derive(Debug)]
pub(crate) struct SampleInfo {
    /// Committed samples not yet handed to the consumer.
    store_size: u64,
    /// Open transport connections.
    active_connections: u64,
    /// Samples waiting in ingress queues (sum and largest single queue).
    queue_depth_sum: u64,
    queue_depth_max: u64,
    /// Times a transport task found its queue full and had to wait.
    push_blocked_count: u64,
    /// Samples moved into the ring by drainers (`submit()` is not counted).
    samples_inserted_total: u64,
    /// Bytes of sample buffers the TCP ingress holds now (queued samples and buffer pools).
    buffered_bytes: u64,
    /// Connections refused because every slot was taken by a working connection.
    connections_refused_total: u64,
    /// Idle connections closed to admit new ones.
    connections_evicted_total: u64,
    /// Samples acknowledged to TCP workers and not yet in the ring (queued in the ingress).
    samples_pending: u64,
    /// TCP connections that negotiated wire protocol v1 / v2.
    v1_connections_total: u64,
    v2_connections_total: u64,
    /// v2 reconnections that resumed a session, and the samples they did not need to resend
    /// because they were already queued.
    sessions_resumed_total: u64,
    samples_deduplicated_total: u64,
    /// Handshakes refused: malformed or v1 at a server with a token; missing or wrong token;
    /// samples of another layout (dtype, leaf name or shape).
    handshakes_refused_protocol_total: u64,
    handshakes_refused_auth_total: u64,
    handshakes_refused_layout_total: u64,
    /// Consumer wake-ups: one per completed batch.
    notify_count: u64,
    cas_success_total: u64,
    cas_failure_total: u64,
    reservation_retries_total: u64,
    drain_round: Py<HistSnapshot>,
    memcpy: Py<HistSnapshot>,
    queue_dwell: Py<HistSnapshot>,
    /// Replay tables only (0 for FIFO): items handed out (a batch counts `batch_size`).
    items_sampled_total: u64,
    /// Replay tables only: items evicted by the remover because the table was full.
    evicted_total: u64,
    /// Replay tables only: items removed after `max_times_sampled` draws.
    removed_max_times_sampled_total: u64,
    /// Replay tables only: priorities changed, and keys ignored as unknown or removed.
    priority_updates_total: u64,
    unknown_keys_total: u64,
    /// Replay tables only: nanoseconds inserts spent waiting for the rate limiter.
    insert_blocked_ns_total: u64,
    /// Replay tables only: nanoseconds `sample()` spent waiting for items or the limiter.
    sample_blocked_ns_total: u64,
    /// Nanoseconds the consumer waited inside `sample()` for this batch.
    wait_ns: u64,
    /// 0-based number of this batch since the server started.
    sequence: u64,
}

/// Every counter of a server at one moment, before it becomes a [`SampleInfo`].
pub(crate) struct Snapshot {
    pub(crate) backend: BackendStats,
    /// Zero before a transport started.
    pub(crate) ingress: IngressSnapshot,
    /// `None` in the default build (no `detailed-metrics`).
    pub(crate) detailed: Option<DetailedSnapshot>,
}

impl SampleInfo {
    /// `SampleInfo` of batch `sequence`, which the consumer waited `wait_ns` for. Without
    /// detailed metrics every histogram is the shared all-zero `zero_hist`.
    ///
    /// The FIFO ring and replay tables count in their own terms; the always-on fields mean
    /// the same for both: `store_size` is what the consumer could be handed now (committed
    /// samples not yet handed out / items in the table), `notify_count` the batches
    /// completed (FIFO) or handed out (replay). The replay-only fields are 0 for FIFO.
    pub(crate) fn new(
        py: Python<'_>,
        snap: &Snapshot,
        sequence: u64,
        wait_ns: u64,
        zero_hist: &Py<HistSnapshot>,
    ) -> PyResult<Self> {
        let hist = |h: Option<HistSummary>| match h {
            Some(h) => Py::new(py, HistSnapshot::from(h)),
            None => Ok(zero_hist.clone_ref(py)),
        };
        let (store_size, notify_count, replay) = match snap.backend {
            BackendStats::Fifo(fifo) => (fifo.store_size, fifo.notify_count, Default::default()),
            BackendStats::Replay(replay) => (replay.size, replay.batches, replay),
        };
        let (ingress, detailed) = (&snap.ingress, snap.detailed.as_ref());
        let d = detailed.copied().unwrap_or_default();
        Ok(Self {
            store_size,
            active_connections: ingress.active_connections,
            queue_depth_sum: ingress.queue_depth_sum,
            queue_depth_max: ingress.queue_depth_max,
            push_blocked_count: ingress.push_blocked_count,
            samples_inserted_total: ingress.samples_inserted_total,
            buffered_bytes: ingress.buffered_bytes,
            connections_refused_total: ingress.connections_refused_total,
            connections_evicted_total: ingress.connections_evicted_total,
            samples_pending: ingress.samples_pending,
            v1_connections_total: ingress.v1_connections_total,
            v2_connections_total: ingress.v2_connections_total,
            sessions_resumed_total: ingress.sessions_resumed_total,
            samples_deduplicated_total: ingress.samples_deduplicated_total,
            handshakes_refused_protocol_total: ingress.handshakes_refused_protocol_total,
            handshakes_refused_auth_total: ingress.handshakes_refused_auth_total,
            handshakes_refused_layout_total: ingress.handshakes_refused_layout_total,
            notify_count,
            cas_success_total: d.cas_success_total,
            cas_failure_total: d.cas_failure_total,
            reservation_retries_total: d.reservation_retries_total,
            drain_round: hist(detailed.map(|d| d.drain_round))?,
            memcpy: hist(detailed.map(|d| d.memcpy))?,
            queue_dwell: hist(detailed.map(|d| d.queue_dwell))?,
            items_sampled_total: replay.sampled_items,
            evicted_total: replay.evicted,
            removed_max_times_sampled_total: replay.removed_max_times_sampled,
            priority_updates_total: replay.priority_updates,
            unknown_keys_total: replay.unknown_keys,
            insert_blocked_ns_total: replay.insert_blocked_ns,
            sample_blocked_ns_total: replay.sample_blocked_ns,
            wait_ns,
            sequence,
        })
    }
}

#[pymethods]
impl SampleInfo {
    /// The fields as a plain dict (histograms as nested dicts), ready for a metrics logger.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (key, value) in [
            ("store_size", self.store_size),
            ("active_connections", self.active_connections),
            ("queue_depth_sum", self.queue_depth_sum),
            ("queue_depth_max", self.queue_depth_max),
            ("push_blocked_count", self.push_blocked_count),
            ("samples_inserted_total", self.samples_inserted_total),
            ("buffered_bytes", self.buffered_bytes),
            ("connections_refused_total", self.connections_refused_total),
            ("connections_evicted_total", self.connections_evicted_total),
            ("samples_pending", self.samples_pending),
            ("v1_connections_total", self.v1_connections_total),
            ("v2_connections_total", self.v2_connections_total),
            ("sessions_resumed_total", self.sessions_resumed_total),
            ("samples_deduplicated_total", self.samples_deduplicated_total),
            ("handshakes_refused_protocol_total", self.handshakes_refused_protocol_total),
            ("handshakes_refused_auth_total", self.handshakes_refused_auth_total),
            ("handshakes_refused_layout_total", self.handshakes_refused_layout_total),
            ("notify_count", self.notify_count),
            ("cas_success_total", self.cas_success_total),
            ("cas_failure_total", self.cas_failure_total),
            ("reservation_retries_total", self.reservation_retries_total),
            ("items_sampled_total", self.items_sampled_total),
            ("evicted_total", self.evicted_total),
            ("removed_max_times_sampled_total", self.removed_max_times_sampled_total),
            ("priority_updates_total", self.priority_updates_total),
            ("unknown_keys_total", self.unknown_keys_total),
            ("insert_blocked_ns_total", self.insert_blocked_ns_total),
            ("sample_blocked_ns_total", self.sample_blocked_ns_total),
            ("wait_ns", self.wait_ns),
            ("sequence", self.sequence),
        ] {
            d.set_item(key, value)?;
        }
        d.set_item("drain_round", self.drain_round.get().as_dict(py)?)?;
        d.set_item("memcpy", self.memcpy.get().as_dict(py)?)?;
        d.set_item("queue_dwell", self.queue_dwell.get().as_dict(py)?)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "SampleInfo(sequence={}, store_size={}, notify_count={}, wait_ns={}, active_connections={}, samples_inserted_total={})",
            self.sequence,
            self.store_size,
            self.notify_count,
            self.wait_ns,
            self.active_connections,
            self.samples_inserted_total
        )
    }
}
