//! `echo._echo.ServerCore`: the native half of `echo.Server`, one class over both backends
//! ([`Backend`]: the FIFO ring or a replay table). It receives flattened leaves (the Python
//! layer owns the pytree structure), checks everything memory safety depends on (leaf count,
//! dtype, shape, contiguity, byte sizes), runs the TCP ingress when asked, and hands batches
//! out as numpy views. Which backend it drives is decided once, from the settings, in Rust.
//!
//! `SampleWriter` (`Server.writer()`) is its companion for single samples given as their
//! leaves, positionally: it skips what `submit` pays for a pytree (the Python method's frame,
//! keyword parsing, the walk of the tree) and keeps every check memory safety depends on.

use std::path::PathBuf;
use std::time::Instant;

use numpy::npyffi::npy_intp;
use numpy::{PyArrayDescr, PyReadonlyArray1};
use parking_lot::MutexGuard;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyList, PyTuple};

use super::checkpoint::{
    example_of, npy_descrs, version_example_leaf, ExtraArrays, PyOpenedCheckpoint,
};
use super::config::{ServerConfig, TcpArg};
use super::errors::{error_in, sample_timed_out, submit_timed_out, to_pyerr, Call};
use super::info::{HistSnapshot, SampleInfo};
use super::leaves::{byte_slices, episode_end, EpisodeFlags, LeafSpecs, MAX_SCALAR_BYTES};
use super::views::{batch_copies, batch_views, CopyPool, LeafLayout, RingLease};
use super::{already_passed, deadline_from_timeout, detach, wait_detached};
use crate::backend::{Backend, BatchConsumer, BatchRef};
use crate::checkpoint::{Extra, ExtraArray, Stage};
use crate::error::EchoError;
use crate::server::{Server, ServerConfig as CoreServerConfig, Snapshot};
use crate::source::{EpisodeEnd, Rows, StepLeaves, StepTag};
use crate::sync::Arc;
use crate::transport::wire::v2::Closing;

/// Samples at or above this many bytes are copied with the GIL released.
const DETACH_COPY_BYTES: usize = 64 * 1024;

/// Samples of at most this many leaves go through `submit` and `SampleWriter` with their
/// byte slices on the stack.
const INLINE_LEAVES: usize = 16;

/// Room for the values of an inline sample's numpy scalars.
type ScalarScratch = [[u8; MAX_SCALAR_BYTES]; INLINE_LEAVES];

/// An empty [`ScalarScratch`] and slice array for [`PyServerCore::inline_leaves`].
fn inline_scratch<'a>() -> (ScalarScratch, [&'a [u8]; INLINE_LEAVES]) {
    ([[0; MAX_SCALAR_BYTES]; INLINE_LEAVES], [&[]; INLINE_LEAVES])
}

/// What `sample` hands back: the sample's leaves, the counters, the per-item arrays.
type SampleOut<'py> = (Bound<'py, PyList>, SampleInfo, Bound<'py, PyTuple>);

/// A server: `submit` flattened leaves, `sample` batches of views.
#[pyclass(frozen, module = "echo._echo", name = "ServerCore")]
pub(crate) struct PyServerCore {
    /// The server itself: backend, consumer, ingress and transport, and their lifecycle.
    server: Server,
    /// The server's backend (`server.backend()`), cloned for the hot paths' brevity.
    backend: Backend,
    leaves: LeafSpecs,
    /// Every leaf of a handed-out batch: the sample's, then the backend's per-item values.
    layouts: Vec<LeafLayout>,
    lease: Py<RingLease>,
    /// Buffers for `copy=True` batches, reused once their arrays are collected.
    copies: Arc<CopyPool>,
    /// Shared all-zero histogram for builds without `detailed-metrics`.
    zero_hist: Py<HistSnapshot>,
    /// `num_buffers=3` or `max_size=..., sampler=...`, for `repr`.
    description: String,
    /// The rate limiter's repr, for timeout messages (replay tables only use it).
    limiter_repr: String,
    /// Whether samples carry their policy version: the backend's last leaf, handed out as
    /// the `versions` array before the backend's per-item ones.
    versioned: bool,
}

/// A `stream=` argument as the caller gave it: any int, so that one beyond `u64` (negative, or
/// 2**70) gets the same out-of-range message as one beyond `Sequence(max_streams)`, not a
/// bare `OverflowError` that names neither the argument nor its range.
pub(crate) enum StreamArg {
    Id(u64),
    /// An int outside `u64`, as Python writes it.
    Beyond(String),
}

impl FromPyObject<'_, '_> for StreamArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
            let kind = obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
            return Err(PyTypeError::new_err(format!("stream must be an int, got {kind}")));
        }
        Ok(match obj.extract::<u64>() {
            Ok(id) => Self::Id(id),
            Err(_) => Self::Beyond(obj.str().map_or_else(|_| "?".to_owned(), |s| s.to_string())),
        })
    }
}

/// `value` (`None`: false) as a bool, refusing truthy stand-ins: `{name} must be a bool`.
fn strict_bool(name: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
    let Some(value) = value else { return Ok(false) };
    match value.cast::<PyBool>() {
        Ok(flag) => Ok(flag.is_true()),
        Err(_) => {
            Err(PyTypeError::new_err(format!("{name} must be a bool, got {}", type_name(value))))
        }
    }
}

/// `value`'s type as a user reads it: `int`, or `numpy.bool` (numpy's bool is also called
/// `bool`).
fn type_name(value: &Bound<'_, PyAny>) -> String {
    let ty = value.get_type();
    match (ty.module(), ty.qualname()) {
        (Ok(module), Ok(name)) if module.to_str().is_ok_and(|m| m != "builtins") => {
            format!("{module}.{name}")
        }
        (_, Ok(name)) => name.to_string(),
        _ => "?".to_owned(),
    }
}

/// `submit`'s `stream`: an int (or anything with `__index__`, as numpy's integers), not a
/// bool, at least 0.
fn stream_arg(value: &Bound<'_, PyAny>) -> PyResult<StreamArg> {
    let py = value.py();
    if value.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err("stream must be an int, got bool"));
    }
    if value.is_instance_of::<PyInt>() {
        // The common case first: one conversion, no comparison call.
        if let Ok(id) = value.extract::<u64>() {
            return Ok(StreamArg::Id(id));
        }
    }
    let index = if value.is_instance_of::<PyInt>() {
        value.clone()
    } else {
        let operator = py.import(intern!(py, "operator"))?;
        operator.call_method1(intern!(py, "index"), (value,)).map_err(|_| {
            PyTypeError::new_err(format!("stream must be an int, got {}", type_name(value)))
        })?
    };
    if index.lt(0)? {
        return Err(PyValueError::new_err(format!("stream must be >= 0, got {index}")));
    }
    index.as_borrowed().extract::<StreamArg>()
}

#[pymethods]
impl PyServerCore {
    /// `layout`: the example's `TreeLayout`; `config`: `echo.server._ServerConfig`.
    #[new]
    fn new(py: Python<'_>, layout: &Bound<'_, PyAny>, config: ServerConfig) -> PyResult<Self> {
        let leaves = LeafSpecs::new(layout)?;
        let backend_config = config.backend()?;
        let description = config.describe(&backend_config);
        let limiter_repr = config.limiter_repr();
        let spec = leaves.spec.clone();
        let core_config = CoreServerConfig {
            backend: backend_config,
            num_drainers: config.num_drainers,
            producer_queue_size: config.producer_queue_size,
            wire_codecs: config.wire_codecs().to_vec(),
            name: Some(config.name.clone()),
            versions: config.versions,
        };
        let server = detach(py, || Server::new(spec, core_config)).map_err(to_pyerr)?;
        let backend = server.backend().clone();
        let versioned = server.policy_versions().is_some();
        let layouts = batch_layouts(py, &leaves, &backend, versioned)?;
        Ok(Self {
            lease: Py::new(py, RingLease::new(&backend))?,
            copies: CopyPool::new(leaves.len()),
            zero_hist: Py::new(py, HistSnapshot::default())?,
            server,
            backend,
            leaves,
            layouts,
            description,
            limiter_repr,
            versioned,
        })
    }

    /// Samples per batch.
    #[getter]
    fn batch_size(&self) -> usize {
        self.backend.batch_size()
    }

    /// Batches the FIFO ring holds; `None` for a replay table.
    #[getter]
    fn num_buffers(&self) -> Option<usize> {
        self.backend.num_batches()
    }

    /// The most samples the server holds at once (FIFO: `num_buffers * batch_size`; a
    /// replay table's items; a sequence table's steps).
    #[getter]
    fn capacity(&self) -> usize {
        self.server.capacity()
    }

    /// Items a replay table holds (steps, for a sequence table); `None` for the FIFO ring.
    #[getter]
    fn max_size(&self) -> Option<usize> {
        self.backend.max_size()
    }

    /// The names of the per-item arrays `sample` returns after the leaves, in order: `()`
    /// for FIFO, `(keys, probabilities, times_sampled)` for replay, and for a sequence table
    /// those and `mask`, `episode`, `start`, `stream`, `terminated`, `truncated`.
    /// With policy versions, `versions` comes first.
    #[getter]
    fn meta_names(&self) -> Vec<&'static str> {
        let versions = self.versioned.then_some("versions");
        versions.into_iter().chain(self.backend.batch_meta().iter().map(|m| m.name)).collect()
    }

    /// Steps per window of a sequence table; `None` otherwise.
    #[getter]
    fn sequence_length(&self) -> Option<usize> {
        self.backend.sequence().map(|s| s.length)
    }

    /// Ends the open episode of in-process stream `stream` of a sequence table as truncated
    /// (`terminated=False`) or terminated, after its last step; returns whether it had one.
    fn end_stream(&self, py: Python<'_>, stream: StreamArg, terminated: bool) -> PyResult<bool> {
        let stream = self.check_steps(Some(stream), true, 1)?;
        let end = if terminated { EpisodeEnd::Terminated } else { EpisodeEnd::Truncated };
        let backend = &self.backend;
        Ok(detach(py, || backend.end_stream(stream, end)))
    }

    /// Capacity of each connection's ingress queue, in samples (the one given, or chosen).
    #[getter]
    fn producer_queue_size(&self) -> usize {
        self.server.ingress_config().queue_size
    }

    /// Bytes of one sample.
    #[getter]
    fn payload_size(&self) -> usize {
        self.backend.spec().payload_size()
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.backend.is_closed()
    }

    /// Page-locks the batch memory (the FIFO ring, or a replay table's batch area) with
    /// `cudaHostRegister`, loading the CUDA runtime from the first path of `cuda_runtimes`
    /// that opens. RuntimeError if none loads, there is no device, or registration fails.
    fn pin_host_memory(&self, py: Python<'_>, cuda_runtimes: Vec<PathBuf>) -> PyResult<()> {
        let backend = &self.backend;
        // SAFETY: the paths come from `echo.server._cuda_runtime_candidates`, which only names
        // CUDA runtime libraries (or the file the user put in $ECHO_CUDART).
        let pinned = detach(py, || unsafe { backend.pin_host_memory(&cuda_runtimes) });
        pinned.map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Whether the batch memory is page-locked.
    #[getter]
    fn pinned(&self) -> bool {
        self.backend.is_pinned()
    }

    /// Starts the drainer pool and the TCP server described by `transport` (an
    /// `echo.TcpTransport`); returns the bound port. Binding happens here, so a port in use
    /// raises `OSError` naming it.
    fn start(&self, py: Python<'_>, transport: TcpArg) -> PyResult<u16> {
        let tcp = transport.tcp_config(self.leaves.typed_layout(py))?;
        // With the GIL released: a `close` holding the transport lock needs it.
        let started = detach(py, || self.server.start(tcp, transport.max_buffered_bytes));
        started.map_err(|err| match err {
            EchoError::Closed => error_in(Call::Start, EchoError::Closed),
            EchoError::Config(msg) => PyValueError::new_err(format!("start(): {msg}")),
            other => to_pyerr(other),
        })
    }

    /// Copies one sample (a pytree like the example) into the backend, as a new item with
    /// `priority` (replay; default: the largest priority seen so far). Blocks (GIL released,
    /// Ctrl-C honoured) while the ring is full or the rate limiter holds inserts back. A
    /// sequence table takes it as a step of `stream` (default 0); `end_episode` says whether
    /// it ends its episode (`truncated`: cut short). `Server.submit` is this method itself
    /// (no Python frame in between), so it checks its arguments as the Python API does.
    #[pyo3(signature = (sample, *, timeout=None, priority=None, stream=None, end_episode=None,
        truncated=None, version=None))]
    #[allow(clippy::too_many_arguments)] // the Python keywords, one each
    fn submit(
        &self,
        sample: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        priority: Option<f64>,
        stream: Option<&Bound<'_, PyAny>>,
        end_episode: Option<&Bound<'_, PyAny>>,
        truncated: Option<&Bound<'_, PyAny>>,
        version: Option<u64>,
    ) -> PyResult<()> {
        let truncated = strict_bool("truncated", truncated)?;
        let end_episode = strict_bool("end_episode", end_episode)?;
        let stream = stream.map(stream_arg).transpose()?;
        let deadline = deadline_from_timeout(timeout)?;
        self.check_submit(priority.is_some())?;
        let end = episode_end(end_episode, truncated);
        let first = self.check_steps(stream, end != EpisodeEnd::No, 1)?;
        let (py, tag) = (sample.py(), StepTag { stream: first, end });
        // The common case, with nothing allocated: a dict of the example's keys (its leaves
        // held, see `flat_dict_leaves`) whose every leaf is read where it lies.
        let mut held: [Option<Bound<'_, PyAny>>; INLINE_LEAVES] = Default::default();
        let (mut scratch, mut inline) = inline_scratch();
        let n = self.leaves.len();
        if n <= INLINE_LEAVES
            && self.leaves.flat_dict_leaves(sample, &mut held)?
            && self.inline_leaves(
                held[..n].iter().flatten().map(Bound::as_borrowed),
                &mut scratch,
                &mut inline,
            )
        {
            return self.insert(py, &inline[..n], priority, deadline, tag, version);
        }
        let arrays = self.leaves.arrays(sample)?;
        self.insert(py, &byte_slices(&self.leaves, &arrays), priority, deadline, tag, version)
    }

    /// A `SampleWriter` into this server (FIFO or replay: a sequence table's steps need a
    /// stream and episode ends, which `submit` takes). Each call waits up to `timeout`.
    #[pyo3(signature = (timeout=None))]
    fn writer(slf: Bound<'_, Self>, timeout: Option<f64>) -> PyResult<PySampleWriter> {
        deadline_from_timeout(timeout)?;
        if slf.get().backend.sequence().is_some() {
            return Err(PyValueError::new_err(
                "writer() takes samples of a FIFO or replay server; a sequence table's steps \
                 go in with submit(step, stream=..., end_episode=...)",
            ));
        }
        Ok(PySampleWriter::new(slf.unbind(), timeout))
    }

    /// The example's leaves' names (`['obs']`) in flattened order: the order a
    /// `SampleWriter` takes them in.
    #[getter]
    pub(crate) fn leaf_names(&self) -> Vec<String> {
        self.leaves.names.clone()
    }

    /// Copies one sample given as its leaves, positionally in the example's flattened order
    /// (`SampleWriter`): no pytree to walk, no keyword to parse. Blocks like `submit` (until
    /// `timeout` seconds; `None`: as long as it takes).
    pub(crate) fn push_leaves(
        &self,
        leaves: &Bound<'_, PyTuple>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let py = leaves.py();
        if leaves.len() != self.leaves.len() {
            return Err(PyValueError::new_err(format!(
                "SampleWriter: expected {} leaves ({}), got {}",
                self.leaves.len(),
                self.leaves.names.join(", "),
                leaves.len()
            )));
        }
        if self.server.is_closed_to_inserts() {
            return Err(error_in(Call::Submit, EchoError::Closed));
        }
        let deadline = deadline_from_timeout(timeout)?;
        let tag = StepTag { stream: 0, end: EpisodeEnd::No };
        // The common case, with nothing allocated: every leaf read where it lies (a tuple
        // cannot change while the insert waits).
        let (mut scratch, mut inline) = inline_scratch();
        if self.inline_leaves(leaves.iter_borrowed(), &mut scratch, &mut inline) {
            return self.insert(py, &inline[..leaves.len()], None, deadline, tag, None);
        }
        let arrays = leaves
            .iter()
            .enumerate()
            .map(|(i, leaf)| self.leaves.checked_leaf(i, &leaf))
            .collect::<PyResult<Vec<_>>>()?;
        self.insert(py, &byte_slices(&self.leaves, &arrays), None, deadline, tag, None)
    }

    /// Copies a batch of samples, one per row of every leaf (all with the same leading
    /// dimension `n`), in order, as if submitted one by one, with the rows checked together
    /// and inserted in as few reservations as the backend allows. `priority`: one number for
    /// every row, or one per row (replay). Returns `n`. A timeout after some rows went in
    /// says how many.
    /// A sequence table takes row `i` as a step of stream `stream + i` (default 0), ending its
    /// episode as `end_episode` and `truncated` say (each a bool for every row or one per
    /// row; `None`: false).
    #[pyo3(signature = (tree, timeout=None, priority=None, stream=None, end_episode=None,
        truncated=None, version=None))]
    #[allow(clippy::too_many_arguments)] // the Python keywords, one each
    fn submit_batch(
        &self,
        tree: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        priority: Option<&Bound<'_, PyAny>>,
        stream: Option<StreamArg>,
        end_episode: Option<&Bound<'_, PyAny>>,
        truncated: Option<&Bound<'_, PyAny>>,
        version: Option<u64>,
    ) -> PyResult<usize> {
        let py = tree.py();
        let flags = EpisodeFlags::new(py, end_episode, truncated)?;
        let deadline = deadline_from_timeout(timeout)?;
        self.check_submit(priority.is_some())?;
        let batch = self.leaves.batch(tree, priority)?;
        let n = batch.n;
        let first = self.check_steps(stream, flags.is_some(), n)?;
        let ends = flags.map(|flags| flags.ends(n)).transpose()?;
        if n == 0 {
            return Ok(0);
        }
        let slices = batch.slices(&self.leaves);
        let rows = Rows::new(&self.leaves.spec, &slices, n, batch.priorities())
            .and_then(|rows| rows.with_steps(first, ends.as_deref()))
            .map_err(to_pyerr)?;
        let server = &self.server;
        let mut done = 0;
        let outcome = wait_detached(py, deadline, |slice_end| {
            match server.insert_versioned(&rows.skip(done), None, Some(slice_end), version) {
                Ok(()) => {
                    done = n;
                    Some(Ok(()))
                }
                Err(err) => {
                    done += err.inserted;
                    (!matches!(err.error, EchoError::TimedOut)).then_some(Err(err.error))
                }
            }
        })?;
        match outcome {
            Some(Ok(())) => Ok(n),
            Some(Err(err)) => Err(error_in(Call::Submit, err)),
            None => {
                let holdback = self.backend.insert_holdback();
                let inserted = (done > 0).then_some((done, n));
                let call = if inserted.is_some() { "submit_batch()" } else { "submit()" };
                Err(submit_timed_out(call, inserted, holdback.as_ref(), &self.limiter_repr))
            }
        }
    }

    /// Waits for the next batch (GIL released, Ctrl-C honoured) and returns `(leaves, info,
    /// meta)`: the sample's leaves, the counters, and the per-item arrays of a replay table
    /// (`(keys, probabilities, times_sampled)`; `()` for FIFO). `None` once closed. With
    /// `writable`, the leaves' views are writeable (the per-item arrays stay read-only).
    #[pyo3(signature = (timeout=None, copy=false, writable=false))]
    fn sample<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        copy: bool,
        writable: bool,
    ) -> PyResult<Option<SampleOut<'py>>> {
        let deadline = deadline_from_timeout(timeout)?;
        let started = Instant::now();
        let Some((guard, batch, snap)) = self.sample_blocking(py, deadline)? else {
            return Ok(None);
        };
        let wait_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut arrays = if copy {
            batch_copies(py, &guard, &batch, &self.layouts, &self.copies)?
        } else {
            let writeable = if writable { self.leaves.len() } else { 0 };
            batch_views(py, &self.backend, &batch, &self.layouts, &self.lease, writeable)?
        };
        drop(guard);
        let meta = arrays.split_off(self.leaves.len());
        // A replay or sequence batch's (keys, probabilities, times_sampled), its first three
        // per-item arrays (after the versions), go into `info` as well.
        let meta_arrays = meta
            .get(usize::from(self.versioned)..)
            .and_then(|per_item| per_item.get(..3))
            .and_then(|first| <[Bound<'py, PyAny>; 3]>::try_from(first.to_vec()).ok())
            .map(|arrays| arrays.map(Bound::unbind));
        let meta = if meta.is_empty() { PyTuple::empty(py) } else { PyTuple::new(py, meta)? };
        let leaves = PyList::new(py, arrays)?;
        let info =
            SampleInfo::new(py, &snap, batch.sequence, wait_ns, &self.zero_hist, meta_arrays)?;
        Ok(Some((leaves, info, meta)))
    }

    /// Sets the priorities of the items with these keys (GIL released); unknown or removed
    /// keys are skipped. Returns how many were skipped.
    fn update_priorities(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, u64>,
        priorities: PyReadonlyArray1<'_, f64>,
    ) -> PyResult<u64> {
        if !self.backend.has_priorities() {
            return Err(PyValueError::new_err(
                "update_priorities() needs a replay sampler; this server is FIFO",
            ));
        }
        let keys = keys.as_slice().map_err(|e| PyValueError::new_err(format!("keys: {e}")))?;
        let priorities =
            priorities.as_slice().map_err(|e| PyValueError::new_err(format!("priorities: {e}")))?;
        let backend = &self.backend;
        detach(py, || backend.update_priorities(keys, priorities)).map_err(to_pyerr)
    }

    /// Writes a checkpoint of this server to `path` (`crate::checkpoint`): every file,
    /// the manifest included, written and fsynced with the GIL released while inserts and
    /// sampling go on, then swapped in atomically. `extra`: the learner's encoded tree
    /// (`extra.json`'s bytes) and its arrays `(descr literal, shape, C-order bytes)`.
    /// `hook(stage)` runs at each stage (tests observe and kill the process there); what it
    /// raises abandons the checkpoint. Returns the bytes its files hold.
    #[pyo3(signature = (path, extra=None, hook=None))]
    fn _checkpoint(
        &self,
        py: Python<'_>,
        path: PathBuf,
        extra: Option<(Vec<u8>, ExtraArrays<'_>)>,
        hook: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let example = self.example(py)?;
        let extra = match &extra {
            None => None,
            Some((tree, arrays)) => Some(Extra {
                tree,
                arrays: arrays
                    .iter()
                    .map(|(descr, shape, data)| {
                        Ok(ExtraArray {
                            descr: descr.clone(),
                            shape: shape.clone(),
                            data: data.as_slice().map_err(|e| {
                                PyValueError::new_err(format!("checkpoint(): extra: {e}"))
                            })?,
                        })
                    })
                    .collect::<PyResult<Vec<_>>>()?,
            }),
        };
        let server = &self.server;
        let mut raised: Option<PyErr> = None;
        let written = detach(py, || {
            let mut run_hook = |stage: Stage| {
                let Some(hook) = &hook else { return Ok(()) };
                Python::attach(|py| hook.call1(py, (stage.name(),)).map(drop)).map_err(|e| {
                    raised = Some(e);
                    EchoError::Busy(format!("checkpoint: abandoned at {}", stage.name()))
                })
            };
            server.checkpoint(&path, &example, extra, &mut run_hook)
        });
        match (written, raised) {
            (_, Some(e)) => Err(e),
            (written, None) => written.map_err(to_pyerr),
        }
    }

    /// Publishes the learner's parameters: `leaves` as `(shape, itemsize, bytes)` (C order)
    /// in the pytree's order, as `version` or the latest plus one; the bytes are copied into
    /// the server's parameter store with the GIL released. Returns the version. Python checks
    /// the pytree's structure and dtypes; the core checks the layout's sizes.
    /// `description`: the pytree's description workers without a layout fetch (set before
    /// the version is published, so that whoever hears of it finds it). `compress`: a codec
    /// (`echo.Zstd(...)`, `echo.Lz4()`) the version is compressed with for TCP workers.
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
        let server = &self.server;
        if let Some(description) = description {
            server.params().describe(description);
        }
        detach(py, || server.publish(&specs, &bytes, version, codec)).map_err(to_pyerr)
    }

    /// The latest version of the published parameters (0: none yet).
    #[getter]
    fn params_version(&self) -> u64 {
        self.server.params().latest()
    }

    /// Fills this new server (built from `opened`'s settings and an example that matches
    /// it) with the checkpoint's data: a replay table's items and state, a sequence table's
    /// steps and windows, a FIFO ring's samples, then the ingress's samples before anything
    /// new (from a background thread as `sample()` makes room: `_is_restoring`).
    /// `CheckpointError` naming what does not fit; nothing is inserted then.
    fn _restore(&self, py: Python<'_>, opened: PyRef<'_, PyOpenedCheckpoint>) -> PyResult<()> {
        let mut descrs = npy_descrs(py, &self.leaves.descrs)?;
        if self.versioned {
            descrs.push(version_example_leaf().npy_descr);
        }
        let server = &self.server;
        let opened = &opened.inner;
        detach(py, || server.restore(opened, &descrs)).map_err(to_pyerr)
    }

    /// Whether a restore's samples are still going in (other inserts wait for them).
    #[getter]
    fn _is_restoring(&self) -> bool {
        self.backend.is_restoring()
    }

    /// The priority of the item with `key`, `None` if it is not in the table (or FIFO).
    fn priority(&self, py: Python<'_>, key: u64) -> Option<f64> {
        // The table's lock may be held for long (a large `update_priorities`).
        let backend = &self.backend;
        detach(py, || backend.priority(key))
    }

    /// A snapshot of the counters without sampling (`sequence` and `wait_ns` are 0).
    fn stats(&self, py: Python<'_>) -> PyResult<SampleInfo> {
        self.info(py, 0, 0)
    }

    /// Clears the timing histograms (counters stay). Nothing to clear without
    /// `detailed-metrics`.
    fn reset_histograms(&self, py: Python<'_>) {
        detach(py, || self.server.reset_histograms());
    }

    /// Closes the server: stops the transport (closing every connection), wakes a blocked
    /// `sample()` (it returns `None`) and a blocked `submit()` (it raises
    /// `ServerClosedError`), and joins every thread. Idempotent.
    ///
    /// With `drain`: stops accepting and reading (every connection is closed, nothing more is
    /// acknowledged) and refuses `submit()`, but lets what was acknowledged reach the backend:
    /// `sample()` keeps handing out full batches, and returns `None` (the server then closes
    /// for good) once the ingress is empty and no full batch is left (FIFO), or once the
    /// ingress is empty (replay).
    ///
    /// The TCP clients are told why, before their connections close: for good, or, with
    /// `restarting`, that the server comes back (reconnecting clients keep trying).
    #[pyo3(signature = (drain=false, restarting=false))]
    fn close(&self, py: Python<'_>, drain: bool, restarting: bool) {
        let why = if restarting { Closing::Restarting } else { Closing::Final };
        detach(py, || self.server.close(drain, why));
    }

    /// Acknowledged or submitted samples that never reached the learner, counted when the
    /// server closed for good (`None` before): what was still queued in the ingress, plus, for
    /// FIFO, what was committed to the ring but never handed out.
    #[getter]
    fn dropped_at_close(&self) -> Option<u64> {
        self.server.dropped_at_close()
    }

    /// `(inserts, samples)` parked in the backend right now (for tests that must know a call
    /// is blocked; the replay table's count waits for its lock, so detached).
    fn _waiting(&self, py: Python<'_>) -> (u64, u64) {
        let backend = &self.backend;
        detach(py, || backend.waiting())
    }

    /// `num_buffers=3` or `max_size=100, sampler=Uniform()`.
    fn describe(&self) -> &str {
        &self.description
    }

    fn __repr__(&self) -> String {
        format!(
            "ServerCore(leaves={}, batch_size={}, {}, closed={})",
            self.leaves.len(),
            self.backend.batch_size(),
            self.description,
            self.backend.is_closed()
        )
    }
}

impl PyServerCore {
    /// The bytes of every leaf of `leaves` (the example's, in order) into `out`, with
    /// nothing allocated, when each is the common case: exactly a C-contiguous ndarray of its
    /// dtype and shape ([`LeafSpecs::exact_bytes`]), or a numpy scalar of exactly its type
    /// (its value copied into `scratch`). `false` when any leaf is not, or there are more than
    /// [`INLINE_LEAVES`]: the caller then checks them in full.
    fn inline_leaves<'a>(
        &self,
        leaves: impl Iterator<Item = Borrowed<'a, 'a, PyAny>>,
        scratch: &'a mut ScalarScratch,
        out: &mut [&'a [u8]; INLINE_LEAVES],
    ) -> bool {
        let mut count = 0;
        for (i, ((leaf, slot), scalar)) in leaves.zip(out.iter_mut()).zip(scratch).enumerate() {
            if i >= self.leaves.len() {
                return false;
            }
            *slot = match self.leaves.exact_bytes(i, leaf) {
                Some(bytes) => bytes,
                None => match self.leaves.scalar_value(i, leaf, scalar) {
                    Some(len) => {
                        let value: &'a [u8; MAX_SCALAR_BYTES] = scalar;
                        &value[..len]
                    }
                    None => return false,
                },
            };
            count += 1;
        }
        count == self.leaves.len()
    }

    /// Copies checked arrays (from `LeafSpecs`) into the backend: first without releasing the
    /// GIL when the sample is small (the common case of free room costs no thread switch),
    /// then in GIL-free slices that honour Ctrl-C, until `deadline`.
    fn insert(
        &self,
        py: Python<'_>,
        slices: &[&[u8]],
        priority: Option<f64>,
        deadline: Option<Instant>,
        tag: StepTag,
        version: Option<u64>,
    ) -> PyResult<()> {
        let source = StepLeaves(slices, tag);
        let server = &self.server;
        let insert = |d: Option<Instant>| server.insert_versioned(&source, priority, d, version);
        // Small samples are tried once with the GIL held (detaching costs more than the copy);
        // not when they are compressed first, which takes longer than the GIL should be held.
        if self.backend.spec().payload_size() < DETACH_COPY_BYTES && !self.backend.compresses() {
            match insert(Some(already_passed())) {
                Err(err) if err.is_timeout_before_any() => {}
                done => return done.map_err(|e| error_in(Call::Submit, e.error)),
            }
        }
        let done = wait_detached(py, deadline, |slice_end| match insert(Some(slice_end)) {
            Err(err) if err.is_timeout_before_any() => None,
            done => Some(done),
        })?;
        let Some(result) = done else {
            let holdback = self.backend.insert_holdback();
            return Err(submit_timed_out("submit()", None, holdback.as_ref(), &self.limiter_repr));
        };
        result.map_err(|e| error_in(Call::Submit, e.error))
    }

    /// What every submit checks first: a priority needs a replay table, and the server
    /// must be open.
    fn check_submit(&self, with_priority: bool) -> PyResult<()> {
        if with_priority && !self.backend.has_priorities() {
            return Err(PyValueError::new_err(
                "priority= needs a replay sampler; this server is FIFO",
            ));
        }
        if self.server.is_closed_to_inserts() {
            return Err(error_in(Call::Submit, EchoError::Closed));
        }
        Ok(())
    }

    /// What a sequence table's steps need: `stream` (first of `n` rows' streams) within the
    /// in-process streams `0..max_streams`; the episode arguments only for a sequence table.
    /// Returns the first stream (0 when not given).
    fn check_steps(&self, stream: Option<StreamArg>, ends: bool, n: usize) -> PyResult<u64> {
        let Some(sequence) = self.backend.sequence() else {
            if stream.is_some() || ends {
                let what = if stream.is_some() { "stream=" } else { "end_episode=/truncated=" };
                return Err(PyValueError::new_err(format!(
                    "{what} needs a sequence table: Server(..., sequence=Sequence(length=...), \
                     sampler=..., max_size=...)"
                )));
            }
            return Ok(0);
        };
        let max = sequence.max_streams as u64;
        let first = match stream {
            None => 0,
            Some(StreamArg::Id(id)) => id,
            Some(StreamArg::Beyond(given)) => {
                return Err(PyValueError::new_err(format!(
                    "stream {given} out of range: in-process streams are 0 to {} \
                     (Sequence(max_streams={max}))",
                    max - 1
                )));
            }
        };
        if first.checked_add(n.max(1) as u64).is_none_or(|end| end > max) {
            let streams = if n > 1 {
                format!("streams {first} to {} (one per row)", first.saturating_add(n as u64 - 1))
            } else {
                format!("stream {first}")
            };
            return Err(PyValueError::new_err(format!(
                "{streams} out of range: in-process streams are 0 to {} (Sequence(max_streams={max}))",
                max - 1
            )));
        }
        Ok(first)
    }

    /// Waits for the consumer's next batch in GIL-free slices that honour Ctrl-C. Returns the
    /// consumer, still locked (so nobody samples over the batch while it is turned into
    /// arrays), the batch, and the counters right after it was handed out (taken while
    /// detached anyway); `None` once the server is closed.
    fn sample_blocking(
        &self,
        py: Python<'_>,
        deadline: Option<Instant>,
    ) -> PyResult<Option<(MutexGuard<'_, BatchConsumer>, BatchRef, Snapshot)>> {
        // What held the last timed-out slice back, for the message if the deadline passes.
        let mut holdback = None;
        // The consumer's mutex is only ever taken with the GIL released, so it cannot
        // deadlock against the GIL.
        let got = wait_detached(py, deadline, |slice_end| {
            self.server.sample_slice(slice_end, &mut holdback)
        })?;
        match got {
            Some(Ok(held)) => Ok(Some(held)),
            Some(Err(EchoError::Closed)) => Ok(None),
            Some(Err(other)) => Err(error_in(Call::Sample, other)),
            None => Err(sample_timed_out(holdback.as_ref(), &self.limiter_repr)),
        }
    }

    /// The example as a checkpoint records it: its leaves, then the version leaf when the
    /// samples carry versions.
    fn example(&self, py: Python<'_>) -> PyResult<crate::checkpoint::Example> {
        let mut example = example_of(self.leaves.tree_layout().bind(py))?;
        if self.versioned {
            example.leaves.push(version_example_leaf());
        }
        Ok(example)
    }

    fn info(&self, py: Python<'_>, sequence: u64, wait_ns: u64) -> PyResult<SampleInfo> {
        // Counters behind locks (a replay table's, the histograms'): taken with the GIL released.
        let snap = detach(py, || self.snapshot());
        SampleInfo::new(py, &snap, sequence, wait_ns, &self.zero_hist, None)
    }

    /// Every counter now. May wait for the replay table's lock: never call it attached.
    fn snapshot(&self) -> Snapshot {
        self.server.snapshot()
    }
}

/// The numpy layout of every leaf of a batch: `[batch_size, *leaf_shape]` with the leaf's
/// dtype (`[batch_size, length, *leaf_shape]` for a sequence table's windows), then
/// `[batch_size]` for each of the backend's per-item values (`[batch_size, length]` for the
/// per-step mask).
fn batch_layouts(
    py: Python<'_>,
    leaves: &LeafSpecs,
    backend: &Backend,
    versioned: bool,
) -> PyResult<Vec<LeafLayout>> {
    let batch_size = backend.batch_size();
    // A sequence table's windows are `length` steps: one more dimension after the batch's.
    let steps = backend.sequence().map(|s| s.length);
    let layout = |descr: &Bound<'_, PyArrayDescr>, per_step: bool, shape: &[usize]| {
        let dims = std::iter::once(batch_size)
            .chain(steps.filter(|_| per_step))
            .chain(shape.iter().copied())
            .map(|d| {
                npy_intp::try_from(d)
                    .map_err(|_| PyValueError::new_err(format!("dimension {d} is too large")))
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok::<_, PyErr>(LeafLayout { descr: descr.clone().unbind(), dims })
    };
    let mut layouts = Vec::with_capacity(leaves.len() + backend.batch_meta().len());
    for (shape, descr) in leaves.shapes.iter().zip(&leaves.descrs) {
        layouts.push(layout(descr.bind(py), true, shape)?);
    }
    if versioned {
        // The version leaf: one uint64 per sample (per step of a window).
        layouts.push(layout(&PyArrayDescr::new(py, "<u8")?, true, &[])?);
    }
    for meta in backend.batch_meta() {
        let descr = PyArrayDescr::new(py, format!("{}{}", meta.kind, meta.bytes).as_str())?;
        layouts.push(layout(&descr, meta.per_step, &[])?);
    }
    Ok(layouts)
}

/// Inserts single samples given as their leaves (`writer(obs, action, reward, done)`).
#[pyclass(frozen, module = "echo._echo", name = "SampleWriter")]
pub(crate) struct PySampleWriter {
    core: Py<PyServerCore>,
    timeout: Option<f64>,
}

impl PySampleWriter {
    /// A writer into `core`; each call waits up to `timeout` seconds for room.
    pub(crate) fn new(core: Py<PyServerCore>, timeout: Option<f64>) -> Self {
        Self { core, timeout }
    }
}

#[pymethods]
impl PySampleWriter {
    /// Copies one sample whose leaves are `leaves`, in the example's flattened order.
    #[pyo3(signature = (*leaves))]
    fn __call__(&self, leaves: &Bound<'_, PyTuple>) -> PyResult<()> {
        self.core.get().push_leaves(leaves, self.timeout)
    }

    /// The leaves' names (`['obs']`), in the order a call takes them.
    #[getter]
    fn leaves(&self) -> Vec<String> {
        self.core.get().leaf_names()
    }

    fn __repr__(&self) -> String {
        let timeout = self.timeout.map_or_else(|| "None".to_owned(), |t| t.to_string());
        format!("SampleWriter(leaves=[{}], timeout={timeout})", self.leaves().join(", "))
    }

    /// Seconds each call waits for room (`None`: as long as it takes).
    #[getter]
    fn timeout(&self) -> Option<f64> {
        self.timeout
    }
}
