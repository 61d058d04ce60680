//! `echo._echo.RaggedCore`: the binding of a [`RaggedTable`]. Python checks each leaf's
//! dtype and inner shape and hands C-contiguous numpy arrays; the core checks lengths,
//! groups and budgets, stores, and lays batches out. Waits release the GIL in slices, so
//! Ctrl-C stays prompt.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};
use std::time::Duration;

use numpy::npyffi::npy_intp;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::to_pyerr;
use super::ragged_leaves::{
    raw_samples, read_leaves, sample_views, spec_of, LeafArg, LeafType, SampleReader,
    DETACH_INSERT_BYTES,
};
use super::views::{new_array, LeafLayout, RingLease};
use super::{deadline_from_timeout, wait_detached};
use crate::error::EchoError;
use crate::params::Params;
use crate::ragged::tcp::{RaggedTcp, TcpOptions};
use crate::ragged::{
    BatchLayout, BufPool, ColumnData, GroupBatch, OutBuf, RaggedBatch, RaggedConfig, RaggedSampler,
    RaggedTable, DROPPED,
};
use crate::sync::Arc;
use crate::transport::wire::v2::{Closing, Layout};
use crate::versions::{Admission, VersionsConfig, VERSION_BYTES};

/// The ragged table behind a Python `Server` whose example has ragged leaves.
#[pyclass(frozen, module = "echo._echo", name = "RaggedCore")]
pub(crate) struct RaggedCore {
    table: Arc<RaggedTable>,
    leaves: Vec<LeafType>,
    /// The samples as a hello describes them (ragged leaves as `ragged_dims`).
    layout: Layout,
    submitted: AtomicU64,
    /// The latest version `publish()` published.
    published: AtomicU64,
    /// The published parameters, which workers fetch.
    params: Arc<Params>,
    /// The TCP ingress, once started. Never held across a release of the GIL (its `Arc` is
    /// cloned out first): a thread holding it while it waits for the GIL, and one holding
    /// the GIL while it waits for it, would wait for each other.
    tcp: Mutex<Option<Arc<RaggedTcp>>>,
    /// The TCP ingress once closed: its counters stay in `stats()`.
    closed_tcp: Mutex<Option<Arc<RaggedTcp>>>,
    /// How `submit` reads a sample: its keys in leaf order when the example is a flat dict,
    /// and the Python layout's flatten for anything else.
    reader: std::sync::OnceLock<SampleReader>,
}

/// `submit_group`'s `version`: one for every sample, or one each.
#[derive(FromPyObject)]
enum VersionArg {
    One(u64),
    Each(Vec<u64>),
}

/// The numpy `base` of a gathered or padded part of a ragged batch: owns its buffer and
/// gives it back to the table's pool when the last array over it is collected.
#[pyclass(frozen, module = "echo._echo", name = "RaggedCopy")]
pub(crate) struct RaggedCopy {
    buf: Mutex<Option<OutBuf>>,
    pool: Weak<BufPool>,
}

#[pymethods]
impl RaggedCopy {
    fn __repr__(&self) -> String {
        let len = self.buf.lock().map_or(0, |b| b.as_ref().map_or(0, OutBuf::len));
        format!("RaggedCopy({len} bytes)")
    }
}

impl Drop for RaggedCopy {
    fn drop(&mut self) {
        let buf = self.buf.get_mut().map_or(None, Option::take);
        if let (Some(buf), Some(pool)) = (buf, self.pool.upgrade()) {
            pool.give_back(buf);
        }
    }
}

fn sampler_of(name: &str, exponent: f64) -> PyResult<RaggedSampler> {
    match name {
        "fifo" => Ok(RaggedSampler::Fifo),
        "uniform" => Ok(RaggedSampler::Uniform),
        "prioritized" => Ok(RaggedSampler::Prioritized { exponent }),
        other => Err(PyValueError::new_err(format!(
            "a ragged table samples with fifo, uniform or prioritized, got {other}"
        ))),
    }
}

#[pymethods]
impl RaggedCore {
    #[new]
    #[pyo3(signature = (leaves, sampler, exponent, batch_size, max_size, max_bytes, batch_tokens, min_size, max_times_sampled, seed, compress=Vec::new(), policy_versions=false, max_staleness=None, admission="drop"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        leaves: Vec<LeafArg<'_>>,
        sampler: &str,
        exponent: f64,
        batch_size: usize,
        max_size: usize,
        max_bytes: Option<usize>,
        batch_tokens: Option<(String, usize)>,
        min_size: usize,
        max_times_sampled: u32,
        seed: Option<u64>,
        compress: Vec<Option<Bound<'_, PyAny>>>,
        policy_versions: bool,
        max_staleness: Option<u64>,
        admission: &str,
    ) -> PyResult<Self> {
        let admission = match (admission, max_staleness) {
            ("drop", _) => Admission::Drop,
            ("block", Some(_)) => Admission::Block,
            (other, _) => {
                return Err(PyValueError::new_err(format!(
                    "admission must be 'drop', or 'block' with max_staleness, got {other:?}"
                )))
            }
        };
        let codecs = compress
            .iter()
            .map(|c| c.as_ref().map(super::config::codec).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        let versions = (policy_versions || max_staleness.is_some())
            .then_some(VersionsConfig { max_staleness, admission });
        let mut codecs = codecs;
        if versions.is_some() && !codecs.is_empty() {
            codecs.push(None); // the version leaf is stored raw
        }
        let (spec, layout, types) = spec_of(py, leaves, versions.is_some())?;
        let batch_tokens = match batch_tokens {
            None => None,
            Some((group, rows)) => {
                let Some(at) = spec.group_named(&group) else {
                    let names: Vec<&str> = spec.groups().iter().map(|g| g.name()).collect();
                    return Err(PyValueError::new_err(format!(
                        "token_group {group:?} is no length group; the groups are {names:?}"
                    )));
                };
                Some((at, rows))
            }
        };
        let config = RaggedConfig {
            sampler: sampler_of(sampler, exponent)?,
            batch_size,
            max_size,
            max_bytes,
            batch_tokens,
            min_size,
            max_times_sampled,
            seed,
            codecs,
            versions,
        };
        let table = RaggedTable::new(spec, config).map_err(to_pyerr)?;
        Ok(Self {
            table: Arc::new(table),
            leaves: types,
            layout,
            submitted: AtomicU64::new(0),
            published: AtomicU64::new(0),
            params: Arc::new(Params::default()),
            tcp: Mutex::new(None),
            closed_tcp: Mutex::new(None),
            reader: std::sync::OnceLock::new(),
        })
    }

    /// Sets how `submit` reads samples: `keys` (a flat dict example's keys in leaf order, or
    /// `None`) and `flatten` (the layout's: a sample to its leaves as arrays).
    fn set_reader(&self, keys: Option<Vec<Py<pyo3::types::PyString>>>, flatten: Py<PyAny>) {
        let _ = self.reader.set(SampleReader { keys, flatten });
    }

    /// `Server.submit` of a ragged server, natively: reads the sample (a flat dict by key,
    /// numpy arrays as they are), checks and stores it.
    #[pyo3(signature = (sample, *, timeout=None, priority=None, stream=None, end_episode=false, truncated=false, version=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        sample: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        priority: Option<f64>,
        stream: Option<u64>,
        end_episode: bool,
        truncated: bool,
        version: Option<u64>,
    ) -> PyResult<()> {
        if stream.is_some() || end_episode || truncated {
            return Err(PyValueError::new_err(
                "a server with ragged leaves does not support stream=, end_episode= or \
                 truncated= yet",
            ));
        }
        let leaves = read_leaves(py, self.reader.get(), sample)?;
        self.submit_group(py, vec![leaves], timeout, priority, version.map(VersionArg::One))
            .map(drop)
    }

    /// Inserts `samples` (each a list of C-contiguous arrays in leaf order) as one entry;
    /// returns its key (`None`: dropped, stale already). `version`: the policy version of
    /// every sample (a table that keeps them; default the latest published), or a list of
    /// one per sample.
    #[pyo3(signature = (samples, timeout=None, priority=None, version=None))]
    fn submit_group(
        &self,
        py: Python<'_>,
        samples: Vec<Vec<Bound<'_, PyAny>>>,
        timeout: Option<f64>,
        priority: Option<f64>,
        version: Option<VersionArg>,
    ) -> PyResult<Option<u64>> {
        let deadline = deadline_from_timeout(timeout)?;
        let own = self.leaves.len() - usize::from(self.table.versions().is_some());
        let mut raw = raw_samples(self.table.spec(), &self.leaves[..own], &samples)?;
        // Each sample's version, where the appended leaf's bytes are read from (it outlives
        // the insert: declared before it, in this frame).
        let stamps: Vec<u64> = match (self.table.versions(), version) {
            (None, None) => Vec::new(),
            (None, Some(_)) => {
                return Err(PyValueError::new_err(
                    "version= needs a server that keeps policy versions \
                     (Server(..., policy_versions=True) or max_staleness=)",
                ))
            }
            (Some(kept), None) => vec![kept.latest(); samples.len()],
            (Some(_), Some(VersionArg::One(v))) => vec![v; samples.len()],
            (Some(_), Some(VersionArg::Each(each))) if each.len() == samples.len() => each,
            (Some(_), Some(VersionArg::Each(each))) => {
                return Err(PyValueError::new_err(format!(
                    "{} versions for {} samples",
                    each.len(),
                    samples.len()
                )))
            }
        };
        for ((leaves, rows), stamp) in raw.iter_mut().zip(&stamps) {
            leaves.push((std::ptr::from_ref(stamp) as usize, VERSION_BYTES));
            rows.push(1);
        }
        let stored = |key: u64| (key != DROPPED).then_some(key);
        // A small entry is tried once with the GIL held: releasing it costs a thread switch,
        // more than the copy (and, with several writers, hands the GIL around every sample).
        let bytes: usize = raw.iter().flat_map(|(leaves, _)| leaves.iter().map(|l| l.1)).sum();
        if bytes < DETACH_INSERT_BYTES {
            // SAFETY: `samples` keeps the arrays alive until this call returns, and the caller
            // hands them to us unwritten.
            let views = unsafe { sample_views(&raw) };
            match self.table.insert_group(&views, priority, Some(super::already_passed())) {
                Err(EchoError::TimedOut) => {}
                Ok(key) => {
                    // ORDERING: Relaxed — a statistics counter, read alone.
                    self.submitted.fetch_add(samples.len() as u64, Ordering::Relaxed);
                    return Ok(stored(key));
                }
                Err(err) => return Err(to_pyerr(err)),
            }
        }
        let table = &self.table;
        let got = wait_detached(py, deadline, |slice_end| {
            // SAFETY: `samples` keeps the arrays alive until this call returns, and the caller
            // hands them to us unwritten.
            let views = unsafe { sample_views(&raw) };
            match table.insert_group(&views, priority, Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            }
        })?;
        match got {
            Some(Ok(key)) => {
                // ORDERING: Relaxed — a statistics counter, read alone.
                self.submitted.fetch_add(samples.len() as u64, Ordering::Relaxed);
                Ok(stored(key))
            }
            Some(Err(err)) => Err(to_pyerr(err)),
            None => Err(PyTimeoutError::new_err(format!(
                "no room for {} sample(s) within the timeout: the table is full and the \
                 learner has not taken a batch",
                samples.len()
            ))),
        }
    }

    /// The next batch, or `None` once closed: (leaves, groups, keys, probabilities,
    /// times_sampled, samples, sequence). A leaf is an array; a group is `(cu_seqlens,)` or
    /// `(lengths, mask)`.
    #[pyo3(signature = (timeout=None, padded=false, multiple=1))]
    fn sample<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        padded: bool,
        multiple: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        if multiple == 0 {
            return Err(PyValueError::new_err("pad_to_multiple must be at least 1, got 0"));
        }
        let deadline = deadline_from_timeout(timeout)?;
        let layout = if padded { BatchLayout::Padded { multiple } } else { BatchLayout::Packed };
        let table = &self.table;
        let got =
            wait_detached(py, deadline, |slice_end| match table.sample(layout, Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            })?;
        let batch = match got {
            Some(Ok(Some(batch))) => batch,
            Some(Ok(None)) => return Ok(None),
            Some(Err(err)) => return Err(to_pyerr(err)),
            None => {
                // Not under the GIL: the table's lock may be a checkpoint's for a while.
                let why = py.detach(|| table.why_no_batch());
                return Err(PyTimeoutError::new_err(format!("no batch within the timeout: {why}")));
            }
        };
        self.to_python(py, batch).map(Some)
    }

    /// Sets the priorities of the entries `keys` name; returns how many were updated.
    fn update_priorities(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, u64>,
        priorities: PyReadonlyArray1<'_, f64>,
    ) -> PyResult<u64> {
        // Copied, then the table's lock taken without the GIL (a checkpoint may hold it).
        let keys = keys.as_slice()?.to_vec();
        let priorities = priorities.as_slice()?.to_vec();
        let table = &self.table;
        py.detach(|| table.update_priorities(&keys, &priorities)).map_err(to_pyerr)
    }

    /// Counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.table.stats());
        let d = PyDict::new(py);
        d.set_item("samples", s.samples)?;
        d.set_item("entries", s.entries)?;
        d.set_item("inserted", s.inserted)?;
        // ORDERING: Relaxed — a statistics counter.
        d.set_item("submitted", self.submitted.load(Ordering::Relaxed))?;
        d.set_item("groups_inserted", s.groups_inserted)?;
        d.set_item("batches", s.batches)?;
        d.set_item("sampled", s.sampled)?;
        d.set_item("evicted", s.evicted)?;
        d.set_item("removed_max_times_sampled", s.removed_max_times_sampled)?;
        d.set_item("payload_bytes", s.payload_bytes)?;
        d.set_item("raw_bytes", s.raw_bytes)?;
        d.set_item("arena_bytes_in_use", s.arena_bytes_in_use)?;
        d.set_item("arena_capacity", s.arena_capacity)?;
        d.set_item("insert_blocked_ns", s.insert_blocked_ns)?;
        let stale = self.table.versions().map(|v| v.counts()).unwrap_or_default();
        d.set_item("stale_at_insert", stale.at_insert)?;
        d.set_item("stale_at_sample", stale.at_sample)?;
        d.set_item("versions_handed", stale.handed)?;
        d.set_item("version_lag_sum", stale.lag_sum)?;
        d.set_item("version_lag_max", stale.lag_max)?;
        // The ingress's counters, running or closed (the totals of a closed server stay).
        let running = self.tcp.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let tcp =
            running.or_else(|| self.closed_tcp.lock().unwrap_or_else(|e| e.into_inner()).clone());
        let counters = tcp.as_deref().map(RaggedTcp::counters);
        // ORDERING: Relaxed — statistics counters, each read alone.
        let read = |f: fn(&crate::ragged::tcp::TcpCounters) -> &AtomicU64| {
            counters.map_or(0, |c| f(c).load(Ordering::Relaxed))
        };
        d.set_item("active_connections", read(|c| &c.active))?;
        d.set_item("connections_accepted", read(|c| &c.accepted))?;
        d.set_item("handshakes_refused", read(|c| &c.refused))?;
        d.set_item("samples_received", read(|c| &c.samples))?;
        d.set_item("shm_connections", read(|c| &c.shm))?;
        d.set_item("sessions_resumed", read(|c| &c.resumed))?;
        d.set_item("connections_evicted", read(|c| &c.evicted))?;
        d.set_item("compressed_samples", read(|c| &c.compressed_samples))?;
        let params = self.params.counts();
        d.set_item("params_published", params.published)?;
        d.set_item("params_chunks_served", params.chunks_served)?;
        d.set_item("params_bytes_served", params.bytes_served)?;
        d.set_item("compressed_bytes", read(|c| &c.compressed_bytes))?;
        Ok(d)
    }

    /// Every stored entry, oldest first, for a checkpoint: (values per leaf as uint8 arrays,
    /// rows (samples x leaves, int64), group sizes (int64), priorities, times sampled).
    #[allow(clippy::type_complexity)]
    fn export<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(
        Vec<Bound<'py, PyArray1<u8>>>,
        Bound<'py, PyArray1<i64>>,
        Bound<'py, PyArray1<i64>>,
        Bound<'py, PyArray1<f64>>,
        Bound<'py, PyArray1<u32>>,
        Vec<(Vec<u8>, u64)>,
    )> {
        let table = &self.table;
        let tcp = self.tcp.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (out, sessions) = py
            .detach(|| match tcp.as_ref() {
                // With workers: their sessions' counts, matching the entries exactly.
                Some(tcp) => tcp.snapshot(),
                None => table.export().map(|out| (out, Vec::new())),
            })
            .map_err(to_pyerr)?;
        let as_i64 = |v: Vec<usize>| v.into_iter().map(|x| x as i64).collect::<Vec<i64>>();
        Ok((
            out.values.into_iter().map(|v| PyArray1::from_vec(py, v)).collect(),
            PyArray1::from_vec(py, as_i64(out.rows)),
            PyArray1::from_vec(py, as_i64(out.group_sizes)),
            PyArray1::from_vec(py, out.priorities),
            PyArray1::from_vec(py, out.times_sampled),
            sessions.into_iter().map(|(id, n)| (id.to_vec(), n)).collect(),
        ))
    }

    /// Publishes the parameters `leaves` (shape, itemsize, bytes), as `ServerCore._publish`:
    /// workers fetch them, hear of the version, and the staleness bound judges samples by
    /// it from now on. Returns the version.
    #[pyo3(signature = (leaves, version=None, description=None, compress=None))]
    fn _publish(
        &self,
        py: Python<'_>,
        leaves: Vec<super::config::PublishedLeaf<'_>>,
        version: Option<u64>,
        description: Option<Vec<u8>>,
        compress: Option<Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let (specs, bytes, codec) = super::config::publish_args(&leaves, compress.as_ref())?;
        if let Some(description) = description {
            self.params.describe(description);
        }
        // Versions only grow, whichever way they were published (a restored checkpoint's
        // version has no parameters behind it).
        let latest = self.params_version();
        if let Some(v) = version.filter(|&v| v <= latest) {
            return Err(PyValueError::new_err(format!(
                "publish(): version {v} is not above the latest, {latest} (versions only grow)"
            )));
        }
        let version = match version {
            Some(v) => v,
            None => latest.checked_add(1).ok_or_else(|| {
                PyValueError::new_err("publish(): the version would pass 2**64 - 1")
            })?,
        };
        let params = &self.params;
        let published =
            py.detach(|| params.publish(&specs, &bytes, Some(version), codec)).map_err(to_pyerr)?;
        self.publish_version(Some(published), true)
    }

    /// Records a publish of `version`, above the latest (`None`: the latest plus one),
    /// without parameters (a restored checkpoint's); with `announce`, workers hear of it.
    /// Returns it. The staleness bound judges samples against it from now on.
    #[pyo3(signature = (version=None, announce=false))]
    fn publish_version(&self, version: Option<u64>, announce: bool) -> PyResult<u64> {
        let latest = self.params_version();
        let next = match version {
            None => latest.checked_add(1).ok_or_else(|| {
                PyValueError::new_err("publish(): the version would pass 2**64 - 1")
            })?,
            Some(v) if v > latest => v,
            Some(v) => {
                return Err(PyValueError::new_err(format!(
                    "publish(): version {v} is not above the latest, {latest} (versions only \
                     grow)"
                )))
            }
        };
        // ORDERING: Relaxed — publishes come from the learner's threads, each version read
        // on its own (as `PolicyVersions::latest`).
        self.published.fetch_max(next, Ordering::Relaxed);
        if let Some(kept) = self.table.versions() {
            kept.set_latest(next);
        }
        if announce {
            if let Some(tcp) = self.tcp.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                tcp.announce(next);
            }
        }
        Ok(next)
    }

    /// The latest published version (0: none yet).
    #[getter]
    fn params_version(&self) -> u64 {
        // ORDERING: Relaxed — see `publish_version`.
        self.published.load(Ordering::Relaxed)
    }

    /// Whether samples carry policy versions.
    #[getter]
    fn policy_versions(&self) -> bool {
        self.table.versions().is_some()
    }

    /// The staleness bound, if there is one.
    #[getter]
    fn max_staleness(&self) -> Option<u64> {
        self.table.versions().and_then(|v| v.max_staleness())
    }

    /// A checkpoint holding `sessions` (as `export` counted them) completed: durable workers
    /// are told how far their samples are persisted.
    fn note_persisted(&self, py: Python<'_>, sessions: Vec<(Vec<u8>, u64)>) {
        let marks: Vec<([u8; 16], u64)> = sessions
            .into_iter()
            .filter_map(|(id, n)| Some((<[u8; 16]>::try_from(id.as_slice()).ok()?, n)))
            .collect();
        let tcp = self.tcp.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(tcp) = tcp {
            py.detach(|| tcp.persisted(&marks));
        }
    }

    /// Sets the draw count of the entry `key` (restoring a checkpoint).
    fn set_times_sampled(&self, key: u64, times: u32) -> bool {
        self.table.set_times_sampled(key, times)
    }

    /// Listens for workers on `host:port` (0: a free port); returns the port.
    #[pyo3(signature = (
        host, port, token=None, max_connections=1024, max_buffered_bytes=1 << 30,
        shared_memory=true, session_timeout=300.0, sessions=None, heartbeat_timeout=Some(10.0),
    ))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn start_tcp(
        &self,
        py: Python<'_>,
        host: &str,
        port: u16,
        token: Option<Vec<u8>>,
        max_connections: usize,
        max_buffered_bytes: usize,
        shared_memory: bool,
        session_timeout: f64,
        sessions: Option<Vec<(Vec<u8>, u64)>>,
        heartbeat_timeout: Option<f64>,
    ) -> PyResult<u16> {
        let mut restored = Vec::new();
        for (id, stored) in sessions.unwrap_or_default() {
            let id: [u8; 16] = id.as_slice().try_into().map_err(|_| {
                PyValueError::new_err(format!("a session id has 16 bytes, got {}", id.len()))
            })?;
            restored.push((id, stored));
        }
        if let Some(running) = self.tcp.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            return Ok(running.port());
        }
        let (table, layout) = (self.table.clone(), self.layout.clone());
        let params = self.params.clone();
        let started = py
            .detach(|| {
                let options = TcpOptions {
                    params: Some(params),
                    token,
                    max_connections,
                    max_buffered_bytes,
                    shared_memory,
                    session_timeout: Duration::from_secs_f64(session_timeout.clamp(0.0, 1e9)),
                    sessions: restored,
                    body_silence: heartbeat_timeout
                        .map(|t| Duration::from_secs_f64(t.clamp(0.001, 1e9))),
                };
                RaggedTcp::start(table, layout, host, port, options)
            })
            .map_err(to_pyerr)?;
        // The latest version with parameters behind it, which workers can fetch.
        started.announce(self.params.latest());
        let mut tcp = self.tcp.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(running) = tcp.as_ref() {
            // Another thread started one meanwhile: that one serves.
            let port = running.port();
            drop(tcp);
            py.detach(|| started.close(Closing::Final));
            return Ok(port);
        }
        let port = started.port();
        *tcp = Some(Arc::new(started));
        Ok(port)
    }

    /// The TCP port, if listening.
    #[getter]
    fn port(&self) -> Option<u16> {
        self.tcp.lock().unwrap_or_else(|e| e.into_inner()).as_deref().map(RaggedTcp::port)
    }

    /// Closes the table (with `drain`, FIFO hands out what is left first), after the TCP
    /// ingress: its workers hear that the server closes (`restarting` or for good).
    #[pyo3(signature = (drain=false, restarting=false))]
    fn close(&self, py: Python<'_>, drain: bool, restarting: bool) {
        let tcp = self.tcp.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(tcp) = tcp {
            let why = if restarting { Closing::Restarting } else { Closing::Final };
            py.detach(|| tcp.close(why));
            *self.closed_tcp.lock().unwrap_or_else(|e| e.into_inner()) = Some(tcp);
        }
        self.table.close(drain);
    }

    #[getter]
    fn closed(&self) -> bool {
        self.table.is_closed()
    }

    /// The length groups' names, in order.
    #[getter]
    fn groups(&self) -> Vec<String> {
        self.table.spec().groups().iter().map(|g| g.name().to_owned()).collect()
    }

    /// Each leaf's length group index (`None` for a fixed leaf).
    #[getter]
    fn leaf_groups(&self) -> Vec<Option<usize>> {
        self.table.spec().columns().iter().map(|c| c.group()).collect()
    }

    /// The arena's bytes.
    #[getter]
    fn arena_capacity(&self) -> usize {
        self.table.stats().arena_capacity
    }
}

impl RaggedCore {
    fn to_python<'py>(&self, py: Python<'py>, batch: RaggedBatch) -> PyResult<Bound<'py, PyAny>> {
        let lease: Py<RingLease> =
            Py::new(py, RingLease::owning(self.table.memory_owner(), "ragged arena"))?;
        let pool = Arc::downgrade(self.table.pool());
        let mut leaves = Vec::with_capacity(batch.columns.len());
        for (column, leaf) in batch.columns.into_iter().zip(&self.leaves) {
            let dims: Vec<npy_intp> =
                column.lead.iter().chain(&leaf.inner).map(|&d| d as npy_intp).collect();
            let layout = LeafLayout { descr: leaf.descr.clone_ref(py), dims };
            let array = match column.data {
                ColumnData::View { addr, .. } => {
                    let array = new_array(py, &layout, addr as *mut u8, false)?;
                    set_base(&array, lease.clone_ref(py).into_any())?;
                    array
                }
                ColumnData::Owned(mut buf) => {
                    let ptr = buf.as_mut_ptr();
                    let base =
                        Py::new(py, RaggedCopy { buf: Mutex::new(Some(buf)), pool: pool.clone() })?;
                    let array = new_array(py, &layout, ptr, true)?;
                    set_base(&array, base.into_any())?;
                    array
                }
            };
            leaves.push(array);
        }
        let mut groups = Vec::with_capacity(batch.groups.len());
        for group in batch.groups {
            let item: Bound<'py, PyAny> = match group {
                GroupBatch::Packed { cu_seqlens } => {
                    (PyArray1::from_vec(py, cu_seqlens),).into_pyobject(py)?.into_any()
                }
                GroupBatch::Padded { len, lengths, mask } => {
                    let n = lengths.len();
                    let mask = PyArray1::from_vec(py, mask).reshape([n, len])?;
                    (PyArray1::from_vec(py, lengths), mask).into_pyobject(py)?.into_any()
                }
            };
            groups.push(item);
        }
        let replay =
            !batch.probabilities.is_empty() || self.table.config().sampler != RaggedSampler::Fifo;
        let probabilities = replay.then(|| PyArray1::from_vec(py, batch.probabilities));
        let times = replay.then(|| PyArray1::from_vec(py, batch.times_sampled));
        let out = (
            leaves,
            groups,
            PyArray1::from_vec(py, batch.keys),
            probabilities,
            times,
            batch.samples,
            batch.sequence,
            batch.store_size,
        );
        Ok(out.into_pyobject(py)?.into_any())
    }
}

/// Sets `base` as the numpy base of the fresh `array`.
fn set_base(array: &Bound<'_, PyAny>, base: Py<PyAny>) -> PyResult<()> {
    use numpy::npyffi::PY_ARRAY_API;
    let py = array.py();
    // `PyArray_SetBaseObject` steals a reference to the base (also on failure).
    // SAFETY: `array` is a freshly created ndarray with no base yet; `base` is an owned
    // reference that the call takes over.
    let status =
        unsafe { PY_ARRAY_API.PyArray_SetBaseObject(py, array.as_ptr().cast(), base.into_ptr()) };
    if status != 0 {
        return Err(PyErr::fetch(py));
    }
    Ok(())
}
