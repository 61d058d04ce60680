//! `echo._echo.RingServer`: the native half of `echo.Server`. It receives flattened leaves
//! (the Python layer owns the pytree structure), checks everything memory safety depends on
//! (leaf count, dtype, shape, contiguity, byte sizes), runs the TCP ingress when asked, and
//! hands batches out as numpy views.

use std::path::PathBuf;
use std::time::Instant;

use numpy::{PyArrayDescr, PyUntypedArray};
use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PySequence, PyString};

use super::common::{batch_layouts, insert_blocking, sample_blocking, TcpSlot};
use super::errors::{to_pyerr, ServerClosedError};
use super::info::{HistSnapshot, SampleInfo};
use super::leaves::{byte_slices, LeafSpecs};
use super::views::{batch_copies, batch_views, LeafLayout, RingLease};
use super::{deadline_from_timeout, detach};
use crate::metrics;
use crate::replay::ReplayStats;
use crate::store::{Consumer, Leaves, Store};
use crate::sync::Arc;

/// The ring and its ingress: `submit` flattened leaves, `sample` batches of views.
#[pyclass(frozen, module = "echo._echo", name = "RingServer")]
pub(crate) struct PyRingServer {
    store: Arc<Store>,
    /// The single consumer. The mutex serialises `sample()` calls from several Python threads
    /// (it is always taken with the GIL released, so it cannot deadlock against the GIL).
    consumer: Mutex<Consumer>,
    leaves: LeafSpecs,
    layouts: Vec<LeafLayout>,
    lease: Py<RingLease>,
    /// Shared all-zero histogram for builds without `detailed-metrics`.
    zero_hist: Py<HistSnapshot>,
    tcp: TcpSlot,
}

#[pymethods]
impl PyRingServer {
    /// `shapes[i]`, `dtypes[i]` and `names[i]` describe leaf `i` in flattened order.
    #[new]
    /// `flat_keys`: the example's keys in leaf order when it is a flat dict of arrays.
    #[pyo3(signature = (shapes, dtypes, names, batch_size, num_buffers, flat_keys=None))]
    fn new(
        py: Python<'_>,
        shapes: Vec<Vec<usize>>,
        dtypes: Vec<Bound<'_, PyArrayDescr>>,
        names: Vec<String>,
        batch_size: usize,
        num_buffers: usize,
        flat_keys: Option<Vec<Bound<'_, PyString>>>,
    ) -> PyResult<Self> {
        let leaves = LeafSpecs::new(shapes, dtypes, names, flat_keys)?;
        let store = Store::new(leaves.spec.clone(), batch_size, num_buffers).map_err(to_pyerr)?;
        let consumer = store.consumer().expect("a new store has no consumer yet");
        let layouts = batch_layouts(py, &leaves, batch_size)?;
        Ok(Self {
            lease: Py::new(py, RingLease::new(Arc::clone(&store) as _, "FIFO ring"))?,
            zero_hist: Py::new(py, HistSnapshot::default())?,
            store,
            consumer: Mutex::new(consumer),
            leaves,
            layouts,
            tcp: TcpSlot::default(),
        })
    }

    /// Samples per batch.
    #[getter]
    fn batch_size(&self) -> usize {
        self.store.batch_size()
    }

    /// Batches the ring holds.
    #[getter]
    fn num_buffers(&self) -> usize {
        self.store.num_batches()
    }

    /// Bytes of one sample.
    #[getter]
    fn payload_size(&self) -> usize {
        self.store.spec().payload_size()
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.store.is_closed()
    }

    /// Page-locks every ring buffer with `cudaHostRegister`, loading the CUDA runtime from the
    /// first path of `cuda_runtimes` that opens. RuntimeError if none loads, there is no
    /// device, or registration fails.
    fn pin_host_memory(&self, py: Python<'_>, cuda_runtimes: Vec<PathBuf>) -> PyResult<()> {
        let store = &self.store;
        // SAFETY: the paths come from `echo.server._cuda_runtime_candidates`, which only names
        // CUDA runtime libraries (or the file the user put in $ECHO_CUDART).
        let pinned = detach(py, || unsafe { store.pin_host_memory(&cuda_runtimes) });
        pinned.map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Whether the ring is page-locked.
    #[getter]
    fn pinned(&self) -> bool {
        self.store.is_pinned()
    }

    /// Starts the drainer pool and the TCP server; returns the bound port. Binding happens
    /// here, so a port in use raises `OSError` naming it.
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
            Arc::clone(&self.store) as _,
            self.store.is_closed(),
            host,
            port,
            num_threads,
            max_connections,
            num_drainers,
            queue_size,
        )
    }

    /// Copies one sample, given as its flattened leaves, into the ring. Blocks (GIL released,
    /// Ctrl-C honoured) while the ring is full.
    #[pyo3(signature = (leaves, timeout=None))]
    fn submit(
        &self,
        py: Python<'_>,
        leaves: &Bound<'_, PySequence>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        self.ensure_open()?;
        let arrays = self.leaves.check(leaves)?;
        self.insert(py, &arrays, deadline)
    }

    /// `submit` for a flat-dict example, taking the sample dict itself. Returns `False`
    /// (nothing done) if the example is not a flat dict or `sample` lacks its exact keys.
    #[pyo3(signature = (sample, timeout=None))]
    fn submit_flat(
        &self,
        py: Python<'_>,
        sample: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<bool> {
        let deadline = deadline_from_timeout(timeout)?;
        self.ensure_open()?;
        let Some(arrays) = self.leaves.check_flat_dict(sample)? else { return Ok(false) };
        self.insert(py, &arrays, deadline)?;
        Ok(true)
    }

    /// Gives back the previous batch, waits for the next full one (GIL released, Ctrl-C
    /// honoured) and returns `(leaves, info)`, or `None` once the server is closed.
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
        let leaves = if copy {
            batch_copies(py, &guard, &self.layouts)?
        } else {
            batch_views(py, &self.store, batch, &self.layouts, &self.lease)?
        };
        drop(guard);
        Ok(Some((leaves, self.info(py, batch, wait_ns)?)))
    }

    /// A snapshot of the counters without sampling (`sequence` and `wait_ns` are 0).
    fn stats(&self, py: Python<'_>) -> PyResult<SampleInfo> {
        self.info(py, 0, 0)
    }

    /// Clears the timing histograms (counters stay). Nothing to clear without
    /// `detailed-metrics`.
    fn reset_histograms(&self) {
        self.store.reset_histograms();
        self.tcp.reset_histograms();
    }

    /// Closes the server: stops the transport (closing every connection), wakes a blocked
    /// `sample()` (it returns `None`) and a blocked `submit()` (it raises
    /// `ServerClosedError`), and joins every thread. Idempotent.
    fn close(&self, py: Python<'_>) {
        let store = &self.store;
        self.tcp.close(py, || store.close());
    }

    fn __repr__(&self) -> String {
        format!(
            "RingServer(leaves={}, batch_size={}, num_buffers={}, closed={})",
            self.leaves.len(),
            self.store.batch_size(),
            self.store.num_batches(),
            self.store.is_closed()
        )
    }
}

impl PyRingServer {
    fn ensure_open(&self) -> PyResult<()> {
        if self.store.is_closed() {
            return Err(ServerClosedError::new_err("submit(): the server is closed"));
        }
        Ok(())
    }

    /// Copies checked arrays (from `LeafSpecs`) into the ring, waiting for space.
    fn insert(
        &self,
        py: Python<'_>,
        arrays: &[Bound<'_, PyUntypedArray>],
        deadline: Option<Instant>,
    ) -> PyResult<()> {
        let slices = byte_slices(&self.leaves, arrays);
        let source = Leaves(&slices);
        let store = &self.store;
        insert_blocking(py, store.spec().payload_size(), deadline, |d| store.insert(&source, d))
    }

    fn info(&self, py: Python<'_>, sequence: u64, wait_ns: u64) -> PyResult<SampleInfo> {
        let detailed = metrics::ENABLED.then(|| self.store.detailed());
        let stats = self.store.stats();
        let replay = ReplayStats::default();
        self.tcp.info(py, &stats, &replay, detailed, sequence, wait_ns, &self.zero_hist)
    }
}

impl Drop for PyRingServer {
    fn drop(&mut self) {
        // Wakes any thread still blocked in this ring and stops the transport; views keep the
        // ring memory alive.
        self.store.close();
        self.tcp.shutdown();
    }
}
