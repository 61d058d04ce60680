//! `SampleInfo` and `HistSnapshot`: frozen per-batch snapshots of the server's counters.
//!
//! Both are plain values: `==` compares every field (a replay batch's per-item arrays by
//! their dtype, shape and elements), `hash` agrees with `==`, `repr` shows `field=value`,
//! and a pickle round trip gives back an equal object.

use std::hash::{Hash, Hasher};

use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use crate::backend::BackendStats;
use crate::ingress::IngressSnapshot;
use crate::metrics::HistSummary;
use crate::server::{LastCheckpoint, Snapshot};

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

impl HistSnapshot {
    /// Every field, `mean_ns` as its bits (with `-0.0` as `0.0`, which `==` calls equal).
    fn key(&self) -> [u64; 7] {
        let mean = if self.mean_ns == 0.0 { 0.0f64 } else { self.mean_ns };
        [
            self.count,
            self.min_ns,
            self.max_ns,
            mean.to_bits(),
            self.p50_ns,
            self.p90_ns,
            self.p99_ns,
        ]
    }

    /// Field by field, `mean_ns` as a float (a NaN mean is unequal, as in Python).
    #[allow(clippy::float_cmp)] // value equality is what `==` means here
    fn same(&self, other: &Self) -> bool {
        let ints = |h: &Self| [h.count, h.min_ns, h.max_ns, h.p50_ns, h.p90_ns, h.p99_ns];
        self.mean_ns == other.mean_ns && ints(self) == ints(other)
    }
}

/// `NotImplemented` unless `op` is `==` or `!=` and `other` is a `T`; then `same`'s answer.
fn compare<T: pyo3::PyClass>(
    py: Python<'_>,
    other: &Bound<'_, PyAny>,
    op: CompareOp,
    same: impl FnOnce(&Bound<'_, T>) -> PyResult<bool>,
) -> PyResult<Py<PyAny>> {
    let Ok(other) = other.cast::<T>() else { return Ok(py.NotImplemented()) };
    let equal = match op {
        CompareOp::Eq => same(other)?,
        CompareOp::Ne => !same(other)?,
        _ => return Ok(py.NotImplemented()),
    };
    Ok(equal.into_pyobject(py)?.to_owned().into_any().unbind())
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
    /// A snapshot with these values (what unpickling calls; echo builds its own).
    #[new]
    #[pyo3(signature = (count=0, min_ns=0, max_ns=0, mean_ns=0.0, p50_ns=0, p90_ns=0, p99_ns=0))]
    fn py_new(
        count: u64,
        min_ns: u64,
        max_ns: u64,
        mean_ns: f64,
        p50_ns: u64,
        p90_ns: u64,
        p99_ns: u64,
    ) -> Self {
        Self { count, min_ns, max_ns, mean_ns, p50_ns, p90_ns, p99_ns }
    }

    /// Pickle support: the class and its fields in constructor order.
    #[allow(clippy::type_complexity)]
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (Bound<'py, PyType>, (u64, u64, u64, f64, u64, u64, u64)) {
        let h = slf.get();
        (slf.get_type(), (h.count, h.min_ns, h.max_ns, h.mean_ns, h.p50_ns, h.p90_ns, h.p99_ns))
    }

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

    /// Equal when every field is (another type: `NotImplemented`).
    fn __richcmp__(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
        compare::<Self>(py, other, op, |other| Ok(self.same(other.get())))
    }

    fn __hash__(&self) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.key().hash(&mut hasher);
        hasher.finish()
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
    /// Nanoseconds transport tasks spent in those waits (backpressure time).
    push_blocked_ns_total: u64,
    /// FIFO: nanoseconds writers spent waiting for free ring slots (0 for replay tables,
    /// whose waits are `insert_blocked_ns_total`).
    ring_blocked_ns_total: u64,
    /// Samples moved into the ring by drainers (`submit()` is not counted).
    samples_inserted_total: u64,
    /// Samples put in by in-process `submit()`/`submit_batch()`, counted as each returns.
    samples_submitted_total: u64,
    /// Samples a staleness bound kept from the learner: dropped as they went in, and replay
    /// items removed when a draw met them stale.
    samples_stale_at_insert_total: u64,
    samples_stale_at_sample_total: u64,
    /// Samples handed out with a policy version, the sum of their lags behind the latest
    /// version then, and the largest lag.
    samples_versioned_total: u64,
    version_lag_total: u64,
    version_lag_max: u64,
    /// The parameter channel: the latest version, publishes, chunks and bytes served.
    params_version: u64,
    params_published_total: u64,
    params_chunks_served_total: u64,
    params_bytes_served_total: u64,
    /// Bytes of sample buffers the TCP ingress holds now (queued samples and buffer pools).
    buffered_bytes: u64,
    /// Connections refused because every slot was taken by a working connection.
    connections_refused_total: u64,
    /// Idle connections closed to admit new ones.
    connections_evicted_total: u64,
    /// Samples acknowledged to TCP workers and not yet in the ring (queued in the ingress).
    samples_pending: u64,
    /// Of `samples_inserted_total`, samples read from their socket straight into the ring.
    samples_received_in_place_total: u64,
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
    /// v2 connections whose samples came through same-host shared memory, and those that
    /// wanted it and sent over TCP instead.
    shm_connections_total: u64,
    shm_fallbacks_total: u64,
    /// Samples that arrived in compressed frames (wire v2, a learner with `compress=`), and
    /// the bytes those frames' bodies took on the wire.
    samples_received_compressed_total: u64,
    compressed_bytes_received_total: u64,
    /// Consumer wake-ups: one per completed batch.
    notify_count: u64,
    cas_success_total: u64,
    cas_failure_total: u64,
    reservation_retries_total: u64,
    /// The last completed checkpoint (manual or periodic; 0 until one completes): when it
    /// completed (Unix seconds), how long it took (seconds) and the bytes its files hold.
    last_checkpoint_unix_s: f64,
    last_checkpoint_duration_s: f64,
    last_checkpoint_bytes: u64,
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
    /// Sequence tables only (0 otherwise): steps stored now, ever inserted, and evicted to
    /// make room (`store_size` and the replay counters above count windows there).
    steps_stored: u64,
    steps_inserted_total: u64,
    steps_evicted_total: u64,
    /// Sequence tables only: streams with an open episode, and episodes ended so far.
    streams_open: u64,
    episodes_ended_total: u64,
    /// Sequence tables only: windows that can be sampled now (the same as `store_size`
    /// there, under the name the sequence guide uses), windows made, and windows removed
    /// because a step of theirs was evicted (also in `evicted_total`).
    windows_stored: u64,
    windows_inserted_total: u64,
    windows_evicted_total: u64,
    /// Bytes the data held now takes as stored, and the same data raw: they differ for a
    /// replay table with `compress=` (its items' compressed leaves); otherwise both are the
    /// bytes of the samples (FIFO: committed, not yet handed out), items or steps held.
    stored_bytes: u64,
    raw_bytes: u64,
    /// Nanoseconds the consumer waited inside `sample()` for this batch.
    wait_ns: u64,
    /// 0-based number of this batch since the server started.
    sequence: u64,
    /// Replay batches only (`None` for FIFO and `stats()`): the batch's per-item arrays, the
    /// same objects as `Sample.keys`, `probabilities` and `times_sampled`, so that
    /// `batch, info = sample` keeps them.
    keys: Option<Py<PyAny>>,
    probabilities: Option<Py<PyAny>>,
    times_sampled: Option<Py<PyAny>>,
}

/// Every `u64` counter of [`SampleInfo`], in `as_dict` order: the one list `as_dict`,
/// pickling and unpickling read, so a new counter cannot be forgotten by one of them.
macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        impl SampleInfo {
            const COUNTERS: usize = [$(stringify!($name)),*].len();

            fn counters(&self) -> [(&'static str, u64); Self::COUNTERS] {
                [$((stringify!($name), self.$name)),*]
            }

            /// Sets the counter called `name`; `false` if there is none (a newer echo's).
            fn set_counter(&mut self, name: &str, value: u64) -> bool {
                match name {
                    $(stringify!($name) => self.$name = value,)*
                    _ => return false,
                }
                true
            }
        }
    };
}

counters!(
    store_size,
    active_connections,
    queue_depth_sum,
    queue_depth_max,
    push_blocked_count,
    push_blocked_ns_total,
    ring_blocked_ns_total,
    samples_inserted_total,
    samples_submitted_total,
    samples_stale_at_insert_total,
    samples_stale_at_sample_total,
    samples_versioned_total,
    version_lag_total,
    version_lag_max,
    params_version,
    params_published_total,
    params_chunks_served_total,
    params_bytes_served_total,
    buffered_bytes,
    connections_refused_total,
    connections_evicted_total,
    samples_pending,
    samples_received_in_place_total,
    v1_connections_total,
    v2_connections_total,
    sessions_resumed_total,
    samples_deduplicated_total,
    handshakes_refused_protocol_total,
    handshakes_refused_auth_total,
    handshakes_refused_layout_total,
    shm_connections_total,
    shm_fallbacks_total,
    samples_received_compressed_total,
    compressed_bytes_received_total,
    notify_count,
    cas_success_total,
    cas_failure_total,
    reservation_retries_total,
    items_sampled_total,
    evicted_total,
    removed_max_times_sampled_total,
    priority_updates_total,
    unknown_keys_total,
    insert_blocked_ns_total,
    sample_blocked_ns_total,
    steps_stored,
    steps_inserted_total,
    steps_evicted_total,
    streams_open,
    episodes_ended_total,
    windows_stored,
    windows_inserted_total,
    windows_evicted_total,
    last_checkpoint_bytes,
    stored_bytes,
    raw_bytes,
    wait_ns,
    sequence,
);

/// The `f64` fields of [`SampleInfo`], by name, in `as_dict` order (after the counters).
const FLOATS: [&str; 2] = ["last_checkpoint_unix_s", "last_checkpoint_duration_s"];

/// The histogram fields of [`SampleInfo`], by name.
const HISTOGRAMS: [&str; 3] = ["drain_round", "memcpy", "queue_dwell"];
/// The replay-only per-item arrays of [`SampleInfo`], by name.
const REPLAY_ARRAYS: [&str; 3] = ["keys", "probabilities", "times_sampled"];

impl SampleInfo {
    /// `SampleInfo` of batch `sequence`, which the consumer waited `wait_ns` for. Without
    /// detailed metrics every histogram is the shared all-zero `zero_hist`.
    ///
    /// The FIFO ring and replay tables count in their own terms; the always-on fields mean
    /// the same for both: `store_size` is what the consumer could be handed now (committed
    /// samples not yet handed out / items in the table), `notify_count` the batches
    /// completed (FIFO) or handed out (replay). The replay-only fields are 0 for FIFO.
    ///
    /// `meta`: a replay batch's `(keys, probabilities, times_sampled)` arrays.
    pub(crate) fn new(
        py: Python<'_>,
        snap: &Snapshot,
        sequence: u64,
        wait_ns: u64,
        zero_hist: &Py<HistSnapshot>,
        meta: Option<[Py<PyAny>; 3]>,
    ) -> PyResult<Self> {
        let hist = |h: Option<HistSummary>| match h {
            Some(h) => Py::new(py, HistSnapshot::from(h)),
            None => Ok(zero_hist.clone_ref(py)),
        };
        let ring_blocked_ns = match &snap.backend {
            BackendStats::Fifo(fifo) => fifo.insert_blocked_ns,
            _ => 0,
        };
        let (store_size, notify_count, replay, seq) = match snap.backend {
            BackendStats::Fifo(fifo) => {
                (fifo.store_size, fifo.notify_count, Default::default(), None)
            }
            BackendStats::Replay(replay) => (replay.size, replay.batches, replay, None),
            BackendStats::Sequence(seq) => {
                (seq.windows.size, seq.windows.batches, seq.windows, Some(seq))
            }
        };
        let (stored_bytes, raw_bytes) = match &snap.backend {
            BackendStats::Fifo(fifo) => {
                let held = fifo.store_size * snap.payload_bytes;
                (held, held)
            }
            BackendStats::Replay(replay) => (replay.stored_bytes, replay.raw_bytes),
            BackendStats::Sequence(seq) => (seq.windows.stored_bytes, seq.windows.raw_bytes),
        };
        let seq_windows = seq.map(|s| s.windows).unwrap_or_default();
        let seq = seq.unwrap_or_default();
        let (ingress, detailed) = (&snap.ingress, snap.detailed.as_ref());
        let d = detailed.copied().unwrap_or_default();
        let [keys, probabilities, times_sampled] = meta.map_or([None, None, None], |m| m.map(Some));
        Ok(Self {
            store_size,
            active_connections: ingress.active_connections,
            queue_depth_sum: ingress.queue_depth_sum,
            queue_depth_max: ingress.queue_depth_max,
            push_blocked_count: ingress.push_blocked_count,
            push_blocked_ns_total: ingress.push_blocked_ns_total,
            ring_blocked_ns_total: ring_blocked_ns,
            samples_inserted_total: ingress.samples_inserted_total,
            samples_submitted_total: snap.submitted,
            samples_stale_at_insert_total: snap.stale.at_insert,
            samples_stale_at_sample_total: snap.stale.at_sample,
            samples_versioned_total: snap.stale.handed,
            version_lag_total: snap.stale.lag_sum,
            version_lag_max: snap.stale.lag_max,
            params_version: snap.params.version,
            params_published_total: snap.params.published,
            params_chunks_served_total: snap.params.chunks_served,
            params_bytes_served_total: snap.params.bytes_served,
            buffered_bytes: ingress.buffered_bytes,
            connections_refused_total: ingress.connections_refused_total,
            connections_evicted_total: ingress.connections_evicted_total,
            samples_pending: ingress.samples_pending,
            samples_received_in_place_total: ingress.samples_received_in_place_total,
            v1_connections_total: ingress.v1_connections_total,
            v2_connections_total: ingress.v2_connections_total,
            sessions_resumed_total: ingress.sessions_resumed_total,
            samples_deduplicated_total: ingress.samples_deduplicated_total,
            handshakes_refused_protocol_total: ingress.handshakes_refused_protocol_total,
            handshakes_refused_auth_total: ingress.handshakes_refused_auth_total,
            handshakes_refused_layout_total: ingress.handshakes_refused_layout_total,
            shm_connections_total: ingress.shm_connections_total,
            shm_fallbacks_total: ingress.shm_fallbacks_total,
            samples_received_compressed_total: ingress.samples_received_compressed_total,
            compressed_bytes_received_total: ingress.compressed_bytes_received_total,
            notify_count,
            cas_success_total: d.cas_success_total,
            cas_failure_total: d.cas_failure_total,
            reservation_retries_total: d.reservation_retries_total,
            last_checkpoint_unix_s: snap.last_checkpoint.unix_s,
            last_checkpoint_duration_s: snap.last_checkpoint.duration_s,
            last_checkpoint_bytes: snap.last_checkpoint.bytes,
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
            steps_stored: seq.steps,
            steps_inserted_total: seq.steps_inserted,
            steps_evicted_total: seq.steps_evicted,
            streams_open: seq.streams_open,
            episodes_ended_total: seq.episodes_ended,
            windows_stored: seq_windows.size,
            windows_inserted_total: seq_windows.inserted,
            windows_evicted_total: seq_windows.evicted,
            stored_bytes,
            raw_bytes,
            wait_ns,
            sequence,
            keys,
            probabilities,
            times_sampled,
        })
    }

    /// All counters 0, histograms empty, no replay arrays: where unpickling starts.
    fn zeroed(py: Python<'_>) -> PyResult<Self> {
        let snap = Snapshot {
            backend: BackendStats::Fifo(Default::default()),
            ingress: IngressSnapshot::default(),
            detailed: None,
            last_checkpoint: LastCheckpoint::default(),
            submitted: 0,
            payload_bytes: 0,
            stale: Default::default(),
            params: Default::default(),
        };
        Self::new(py, &snap, 0, 0, &Py::new(py, HistSnapshot::default())?, None)
    }

    /// The float field called `name` (one of [`FLOATS`]).
    fn float_field(&mut self, name: &str) -> &mut f64 {
        match name {
            "last_checkpoint_unix_s" => &mut self.last_checkpoint_unix_s,
            _ => &mut self.last_checkpoint_duration_s,
        }
    }

    /// The histogram called `name` (one of [`HISTOGRAMS`]).
    fn histogram(&self, name: &str) -> &Py<HistSnapshot> {
        match name {
            "drain_round" => &self.drain_round,
            "memcpy" => &self.memcpy,
            _ => &self.queue_dwell,
        }
    }

    /// The replay array called `name` (one of [`REPLAY_ARRAYS`]).
    fn replay_array(&mut self, name: &str) -> &mut Option<Py<PyAny>> {
        match name {
            "keys" => &mut self.keys,
            "probabilities" => &mut self.probabilities,
            _ => &mut self.times_sampled,
        }
    }

    /// The replay arrays, in [`REPLAY_ARRAYS`] order.
    fn replay_arrays(&self) -> [&Option<Py<PyAny>>; 3] {
        [&self.keys, &self.probabilities, &self.times_sampled]
    }

    /// The float fields, in [`FLOATS`] order.
    fn floats(&self) -> [f64; 2] {
        [self.last_checkpoint_unix_s, self.last_checkpoint_duration_s]
    }

    /// Value equality: every counter, float and histogram, and the replay arrays by dtype,
    /// shape and elements (`numpy.array_equal`).
    #[allow(clippy::float_cmp)] // value equality is what `==` means here
    fn same(&self, py: Python<'_>, other: &Self) -> PyResult<bool> {
        if self.counters() != other.counters() || self.floats() != other.floats() {
            return Ok(false);
        }
        for name in HISTOGRAMS {
            if !self.histogram(name).get().same(other.histogram(name).get()) {
                return Ok(false);
            }
        }
        let array_equal = PyModule::import(py, "numpy")?.getattr("array_equal")?;
        for (a, b) in self.replay_arrays().into_iter().zip(other.replay_arrays()) {
            let equal = match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => {
                    let (a, b) = (a.bind(py), b.bind(py));
                    a.getattr("dtype")?.eq(b.getattr("dtype")?)?
                        && array_equal.call1((a, b))?.is_truthy()?
                }
                _ => false,
            };
            if !equal {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A hash that agrees with [`SampleInfo::same`]: the counters, floats and histograms
    /// (the replay arrays are left out; equal objects still hash alike).
    fn hash_value(&self) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.counters().hash(&mut hasher);
        for x in self.floats() {
            // `-0.0 == 0.0`: one hash for both.
            let x = if x == 0.0 { 0.0f64 } else { x };
            x.to_bits().hash(&mut hasher);
        }
        for name in HISTOGRAMS {
            self.histogram(name).get().key().hash(&mut hasher);
        }
        hasher.finish()
    }

    /// `field=value` for every field that is not zero (empty histograms and absent arrays
    /// are zero too), `sequence` and `wait_ns` always; a histogram in full, an array as its
    /// dtype and shape; and how many fields were left out.
    fn repr(&self, py: Python<'_>) -> PyResult<String> {
        let mut parts =
            vec![format!("sequence={}", self.sequence), format!("wait_ns={}", self.wait_ns)];
        let mut zero = 0;
        for (name, value) in self.counters() {
            if name == "sequence" || name == "wait_ns" {
                continue;
            }
            if value == 0 {
                zero += 1;
            } else {
                parts.push(format!("{name}={value}"));
            }
        }
        for (name, value) in FLOATS.into_iter().zip(self.floats()) {
            if value == 0.0 {
                zero += 1;
            } else {
                parts.push(format!("{name}={value}"));
            }
        }
        for name in HISTOGRAMS {
            let hist = self.histogram(name).get();
            if hist.count == 0 {
                zero += 1;
            } else {
                parts.push(format!("{name}={}", hist.__repr__()));
            }
        }
        for (name, array) in REPLAY_ARRAYS.into_iter().zip(self.replay_arrays()) {
            match array {
                None => zero += 1,
                Some(array) => {
                    let array = array.bind(py);
                    let dtype = array.getattr("dtype")?.str()?;
                    let shape = array.getattr("shape")?.repr()?;
                    parts.push(format!("{name}=<{dtype} array of shape {shape}>"));
                }
            }
        }
        if zero > 0 {
            parts.push(format!("<{zero} more fields are 0>"));
        }
        Ok(format!("SampleInfo({})", parts.join(", ")))
    }
}

/// Rebuilds a [`SampleInfo`] from the state its `__reduce__` pickles: every field by name.
/// Fields the state lacks stay 0 / empty / `None` and names this build does not know are
/// skipped, so a logger process running another echo version still unpickles it.
#[pyfunction]
pub(crate) fn _sample_info(state: &Bound<'_, PyDict>) -> PyResult<SampleInfo> {
    let py = state.py();
    let mut info = SampleInfo::zeroed(py)?;
    for (name, value) in state.iter() {
        let name: String = name.extract()?;
        if let Some(&hist) = HISTOGRAMS.iter().find(|h| **h == name) {
            let value: Py<HistSnapshot> = value.extract()?;
            match hist {
                "drain_round" => info.drain_round = value,
                "memcpy" => info.memcpy = value,
                _ => info.queue_dwell = value,
            }
        } else if FLOATS.contains(&name.as_str()) {
            *info.float_field(&name) = value.extract()?;
        } else if REPLAY_ARRAYS.contains(&name.as_str()) {
            *info.replay_array(&name) = (!value.is_none()).then(|| value.unbind());
        } else if let Ok(counter) = value.extract::<u64>() {
            info.set_counter(&name, counter);
        }
    }
    Ok(info)
}

#[pymethods]
impl SampleInfo {
    /// Every public property as a plain dict (histograms as nested dicts), ready for a
    /// metrics logger: the counters, the float fields and `compression_ratio`. The replay
    /// arrays (`keys`, ...) are not counters and are left out.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (key, value) in self.counters() {
            d.set_item(key, value)?;
        }
        d.set_item(FLOATS[0], self.last_checkpoint_unix_s)?;
        d.set_item(FLOATS[1], self.last_checkpoint_duration_s)?;
        d.set_item("compression_ratio", self.compression_ratio())?;
        for name in HISTOGRAMS {
            d.set_item(name, self.histogram(name).get().as_dict(py)?)?;
        }
        Ok(d)
    }

    /// Pickle support (for a logger process or a Ray actor): `echo._echo._sample_info` and
    /// every field by name. Replay arrays are pickled as numpy pickles them (copies).
    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyDict>,))> {
        let state = PyDict::new(py);
        for (key, value) in self.counters() {
            state.set_item(key, value)?;
        }
        state.set_item(FLOATS[0], self.last_checkpoint_unix_s)?;
        state.set_item(FLOATS[1], self.last_checkpoint_duration_s)?;
        for name in HISTOGRAMS {
            state.set_item(name, self.histogram(name))?;
        }
        for (name, value) in
            REPLAY_ARRAYS.into_iter().zip([&self.keys, &self.probabilities, &self.times_sampled])
        {
            state.set_item(name, value)?;
        }
        let restore = PyModule::import(py, "echo._echo")?.getattr("_sample_info")?;
        Ok((restore, (state,)))
    }

    /// `raw_bytes / stored_bytes`: how many times less memory the data held takes than it
    /// would raw (1.0 when nothing is compressed, or nothing is held).
    #[getter]
    fn compression_ratio(&self) -> f64 {
        if self.stored_bytes == 0 {
            return 1.0;
        }
        self.raw_bytes as f64 / self.stored_bytes as f64
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        self.repr(py)
    }

    /// Equal when every field is (see `same`; another type: `NotImplemented`).
    fn __richcmp__(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
        compare::<Self>(py, other, op, |other| self.same(py, other.get()))
    }

    fn __hash__(&self) -> u64 {
        self.hash_value()
    }
}
