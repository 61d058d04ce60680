//! `echo._echo.ReplayTable`: the native half of `echo.Server` with a replay sampler. Inserts
//! are checked like `RingServer`'s; batches are gathered in Rust (GIL released) into the
//! table's double-buffered batch area and handed out as read-only views, followed by three
//! per-item arrays: keys (`uint64`), probabilities (`float64`), times sampled (`uint32`).

use std::path::PathBuf;
use std::time::Instant;

use numpy::{PyArrayDescr, PyReadonlyArray1, PyUntypedArray};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PySequence, PyString};

use super::common::{batch_layouts, insert_blocking, sample_blocking, TcpSlot};
use super::errors::{to_pyerr, ServerClosedError};
use super::info::{HistSnapshot, SampleInfo};
use super::leaves::{byte_slices, LeafSpecs};
use super::views::{copies_from, views_at, LeafLayout, RingLease};
use super::{deadline_from_timeout, detach};
use crate::replay::{
    RateLimit, RemoverKind, ReplayConfig, ReplayConsumer, SamplerKind, Table, META_LEAVES,
};
use crate::store::{Leaves, StoreStats};
use crate::sync::Arc;

/// A replay table: `submit` flattened leaves, `sample` gathered batches.
#[pyclass(frozen, module = "echo._echo", name = "ReplayTable")]
pub(crate) struct PyReplayTable {
    table: Arc<Table>,
    consumer: Mutex<ReplayConsumer>,
    leaves: LeafSpecs,
    /// The sample's leaves, then keys, probabilities and times sampled.
    layouts: Vec<LeafLayout>,
    lease: Py<RingLease>,
    zero_hist: Py<HistSnapshot>,
    tcp: TcpSlot,
}

fn sampler_kind(name: &str, exponent: f64) -> PyResult<SamplerKind> {
    match name {
        "uniform" => Ok(SamplerKind::Uniform),
        "prioritized" => Ok(SamplerKind::Prioritized { exponent }),
        "lifo" => Ok(SamplerKind::Lifo),
        _ => Err(PyValueError::new_err(format!(
            "sampler must be 'uniform', 'prioritized' or 'lifo', got {name:?}"
        ))),
    }
}

fn remover_kind(name: &str) -> PyResult<RemoverKind> {
    match name {
        "fifo" => Ok(RemoverKind::Fifo),
        "lifo" => Ok(RemoverKind::Lifo),
        "min_priority" => Ok(RemoverKind::MinPriority),
        _ => Err(PyValueError::new_err(format!(
            "remover must be 'fifo', 'lifo' or 'min_priority', got {name:?}"
        ))),
    }
}

fn rate_limit(
    name: &str,
    spi: f64,
    min_size: u64,
    min_diff: f64,
    max_diff: f64,
) -> PyResult<RateLimit> {
    match name {
        "min_size" => Ok(RateLimit::MinSize(min_size)),
        "queue" => Ok(RateLimit::Queue(min_size)),
        "ratio" => Ok(RateLimit::SampleToInsertRatio {
            samples_per_insert: spi,
            min_size_to_sample: min_size,
            min_diff,
            max_diff,
        }),
        _ => Err(PyValueError::new_err(format!(
            "rate limiter must be 'min_size', 'queue' or 'ratio', got {name:?}"
        ))),
    }
}

/// The numpy descriptor of a plain numpy scalar type (`"uint64"`, ...).
fn descr<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyArrayDescr>> {
    PyArrayDescr::new(py, name)
}

#[pymethods]
impl PyReplayTable {
    /// `shapes`, `dtypes`, `names`, `flat_keys`: as for `RingServer`. The rate limiter is
    /// `(limiter, samples_per_insert, min_size, min_diff, max_diff)` with `min_size` the
    /// queue size for `'queue'`.
    #[new]
    #[pyo3(signature = (
        shapes, dtypes, names, batch_size, max_size, sampler, exponent, remover, limiter,
        samples_per_insert, min_size, min_diff, max_diff, max_times_sampled, seed=None,
        flat_keys=None
    ))]
    #[allow(clippy::too_many_arguments)] // one per Python argument
    fn new(
        py: Python<'_>,
        shapes: Vec<Vec<usize>>,
        dtypes: Vec<Bound<'_, PyArrayDescr>>,
        names: Vec<String>,
        batch_size: usize,
        max_size: usize,
        sampler: &str,
        exponent: f64,
        remover: &str,
        limiter: &str,
        samples_per_insert: f64,
        min_size: u64,
        min_diff: f64,
        max_diff: f64,
        max_times_sampled: u32,
        seed: Option<u64>,
        flat_keys: Option<Vec<Bound<'_, PyString>>>,
    ) -> PyResult<Self> {
        let leaves = LeafSpecs::new(shapes, dtypes, names, flat_keys)?;
        let config = ReplayConfig {
            batch_size,
            max_size,
            sampler: sampler_kind(sampler, exponent)?,
            remover: remover_kind(remover)?,
            rate_limit: rate_limit(limiter, samples_per_insert, min_size, min_diff, max_diff)?,
            max_times_sampled,
            seed,
        };
        let spec = leaves.spec.clone();
        let table = detach(py, || Table::new(spec, config)).map_err(to_pyerr)?;
        let consumer = table.consumer().expect("a new table has no consumer yet");
        let mut layouts = batch_layouts(py, &leaves, batch_size)?;
        for name in ["uint64", "float64", "uint32"] {
            let dims = layouts[0].dims[..1].to_vec();
            layouts.push(LeafLayout { descr: descr(py, name)?.unbind(), dims });
        }
        debug_assert_eq!(layouts.len(), leaves.len() + META_LEAVES);
        Ok(Self {
            lease: Py::new(py, RingLease::new(Arc::clone(&table) as _, "replay batch area"))?,
            zero_hist: Py::new(py, HistSnapshot::default())?,
            table,
            consumer: Mutex::new(consumer),
            leaves,
            layouts,
            tcp: TcpSlot::default(),
        })
    }

    /// Items per batch.
    #[getter]
    fn batch_size(&self) -> usize {
        self.table.config().batch_size
    }

    /// Items the table holds before evicting.
    #[getter]
    fn max_size(&self) -> usize {
        self.table.config().max_size
    }

    /// Bytes of one sample.
    #[getter]
    fn payload_size(&self) -> usize {
        self.table.spec().payload_size()
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.table.is_closed()
    }

    /// Page-locks the batch area; see `RingServer.pin_host_memory`.
    fn pin_host_memory(&self, py: Python<'_>, cuda_runtimes: Vec<PathBuf>) -> PyResult<()> {
        let table = &self.table;
        // SAFETY: the paths come from `echo.server._cuda_runtime_candidates`, which only names
        // CUDA runtime libraries (or the file the user put in $ECHO_CUDART).
        let pinned = detach(py, || unsafe { table.pin_host_memory(&cuda_runtimes) });
        pinned.map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Whether the batch area is page-locked.
    #[getter]
    fn pinned(&self) -> bool {
        self.table.is_pinned()
    }

    /// Starts the drainer pool and the TCP server; returns the bound port.
    #[pyo3(signature = (host, port, num_threads, max_connections, num_drainers, queue_size))]
    #[allow(clippy::too_many_arguments)] // one per Python keyword argument
    fn start_tcp(
        &self,
        py: Python<'_>,
        host: String,
        port: u16,
        num_threads: usize,
        max_connections: usize,
        num_drainers: usize,
        queue_size: usize,
    ) -> PyResult<u16> {
        self.tcp.start(
            py,
            Arc::clone(&self.table) as _,
            self.table.is_closed(),
            host,
            port,
            num_threads,
            max_connections,
            num_drainers,
            queue_size,
        )
    }

    /// Inserts one sample (its flattened leaves) as a new item with `priority` (default: the
    /// largest priority seen so far). Blocks (GIL released, Ctrl-C honoured) while the rate
    /// limiter says so.
    #[pyo3(signature = (leaves, timeout=None, priority=None))]
    fn submit(
        &self,
        py: Python<'_>,
        leaves: &Bound<'_, PySequence>,
        timeout: Option<f64>,
        priority: Option<f64>,
    ) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        self.ensure_open()?;
        let arrays = self.leaves.check(leaves)?;
        self.insert(py, &arrays, priority, deadline)
    }

    /// `submit` for a flat-dict example; `False` (nothing done) if `sample` is not one.
    #[pyo3(signature = (sample, timeout=None, priority=None))]
    fn submit_flat(
        &self,
        py: Python<'_>,
        sample: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        priority: Option<f64>,
    ) -> PyResult<bool> {
        let deadline = deadline_from_timeout(timeout)?;
        self.ensure_open()?;
        let Some(arrays) = self.leaves.check_flat_dict(sample)? else { return Ok(false) };
        self.insert(py, &arrays, priority, deadline)?;
        Ok(true)
    }

    /// Draws and gathers the next batch (GIL released, Ctrl-C honoured). Returns
    /// `(leaves + [keys, probabilities, times_sampled], info)`, or `None` once closed.
    #[pyo3(signature = (timeout=None, copy=false))]
    fn sample<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        copy: bool,
    ) -> PyResult<Option<(Bound<'py, PyList>, SampleInfo)>> {
        let deadline = deadline_from_timeout(timeout)?;
        let started = Instant::now();
        let Some((guard, batch)) = sample_blocking(py, &self.consumer, deadline)? else {
            return Ok(None);
        };
        let wait_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let table = &self.table;
        let leaves = if copy {
            let batch_size = table.config().batch_size;
            copies_from(py, &self.layouts, |leaf, copy| {
                let bytes = batch_size * self.leaf_bytes(leaf);
                // SAFETY: we hold the consumer (`guard`), so no `sample` can rewrite this half
                // while we copy; `batch_ptr` points at `batch_size` values of this leaf.
                let src =
                    unsafe { std::slice::from_raw_parts(table.batch_ptr(batch.half, leaf), bytes) };
                copy(src);
            })?
        } else {
            views_at(py, &self.layouts, &self.lease, |leaf| table.batch_ptr(batch.half, leaf))?
        };
        drop(guard);
        Ok(Some((leaves, self.info(py, batch.sequence, wait_ns)?)))
    }

    /// Sets the priorities of the items with these keys (GIL released); unknown or removed
    /// keys are skipped. Returns how many were skipped.
    fn update_priorities(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, u64>,
        priorities: PyReadonlyArray1<'_, f64>,
    ) -> PyResult<u64> {
        let keys = keys.as_slice().map_err(|e| PyValueError::new_err(format!("keys: {e}")))?;
        let priorities =
            priorities.as_slice().map_err(|e| PyValueError::new_err(format!("priorities: {e}")))?;
        let table = &self.table;
        detach(py, || table.update_priorities(keys, priorities)).map_err(to_pyerr)
    }

    /// The priority of the item with `key`, `None` if it is not in the table.
    fn priority(&self, key: u64) -> Option<f64> {
        self.table.priority(key)
    }

    /// A snapshot of the counters without sampling (`sequence` and `wait_ns` are 0).
    fn stats(&self, py: Python<'_>) -> PyResult<SampleInfo> {
        self.info(py, 0, 0)
    }

    /// Clears the ingress timing histograms (the table has none).
    fn reset_histograms(&self) {
        self.tcp.reset_histograms();
    }

    /// Closes the table and its transport; see `RingServer.close`.
    fn close(&self, py: Python<'_>) {
        let table = &self.table;
        self.tcp.close(py, || table.close());
    }

    fn __repr__(&self) -> String {
        let config = self.table.config();
        format!(
            "ReplayTable(leaves={}, batch_size={}, max_size={}, sampler={:?}, remover={:?}, closed={})",
            self.leaves.len(),
            config.batch_size,
            config.max_size,
            config.sampler,
            config.remover,
            self.table.is_closed()
        )
    }
}

impl PyReplayTable {
    fn ensure_open(&self) -> PyResult<()> {
        if self.table.is_closed() {
            return Err(ServerClosedError::new_err("submit(): the server is closed"));
        }
        Ok(())
    }

    /// Bytes one item of batch-area leaf `leaf` takes (sample leaves, then the metadata).
    fn leaf_bytes(&self, leaf: usize) -> usize {
        match leaf.checked_sub(self.leaves.len()) {
            None => self.leaves.spec.arrays()[leaf].num_bytes(),
            Some(0 | 1) => 8,
            Some(_) => 4,
        }
    }

    fn insert(
        &self,
        py: Python<'_>,
        arrays: &[Bound<'_, PyUntypedArray>],
        priority: Option<f64>,
        deadline: Option<Instant>,
    ) -> PyResult<()> {
        let slices = byte_slices(&self.leaves, arrays);
        let source = Leaves(&slices);
        let table = &self.table;
        let payload_size = table.spec().payload_size();
        insert_blocking(py, payload_size, deadline, |d| table.insert(&source, priority, d))
    }

    fn info(&self, py: Python<'_>, sequence: u64, wait_ns: u64) -> PyResult<SampleInfo> {
        let replay = self.table.stats();
        let stats = StoreStats {
            store_size: replay.size,
            notify_count: replay.batches,
            write_cursor: replay.inserted,
            read_cursor: replay.sampled_items,
        };
        self.tcp.info(py, &stats, &replay, None, sequence, wait_ns, &self.zero_hist)
    }
}

impl Drop for PyReplayTable {
    fn drop(&mut self) {
        self.table.close();
        self.tcp.shutdown();
    }
}
