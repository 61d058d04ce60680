//! `echo._echo.RaggedCore`: the binding of a [`RaggedTable`]. Python checks each leaf's
//! dtype and inner shape and hands C-contiguous numpy arrays; the core checks lengths,
//! groups and budgets, stores, and lays batches out. Waits release the GIL in slices, so
//! Ctrl-C stays prompt.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;

use numpy::npyffi::npy_intp;
use numpy::{
    PyArray1, PyArrayDescr, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::to_pyerr;
use super::views::{new_array, LeafLayout, RingLease};
use super::{deadline_from_timeout, wait_detached};
use crate::error::EchoError;
use crate::ragged::{
    BatchLayout, BufPool, ColumnData, GroupBatch, LeafDecl, OutBuf, RaggedBatch, RaggedConfig,
    RaggedDecl, RaggedSampler, RaggedSpec, RaggedTable, SampleIn,
};
use crate::spec::ArraySpec;
use crate::sync::Arc;

/// The numpy `base` of a gathered or padded part of a ragged batch: owns its buffer and
/// gives it back to the table's pool when the last array over it is collected.
#[pyclass(frozen, module = "echo._echo", name = "RaggedCopy")]
pub(crate) struct RaggedCopy {
    buf: std::sync::Mutex<Option<OutBuf>>,
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

/// A leaf's dtype and its shape after the leading dimension(s).
struct LeafType {
    descr: Py<PyArrayDescr>,
    inner: Vec<usize>,
}

/// The ragged table behind a Python `Server` whose example has ragged leaves.
#[pyclass(frozen, module = "echo._echo", name = "RaggedCore")]
pub(crate) struct RaggedCore {
    table: Arc<RaggedTable>,
    leaves: Vec<LeafType>,
    submitted: AtomicU64,
}

/// A sample's leaves as (address, bytes), and its rows per leaf.
type RawSample = (Vec<(usize, usize)>, Vec<usize>);

/// One leaf as Python declares it: (name, shape (inner for ragged), dtype, ragged).
type LeafArg<'py> = (String, Vec<usize>, Bound<'py, PyArrayDescr>, Option<(usize, Option<String>)>);

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
    #[pyo3(signature = (leaves, sampler, exponent, batch_size, max_size, max_bytes, batch_tokens, min_size, max_times_sampled, seed))]
    #[allow(clippy::too_many_arguments)]
    fn new(
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
    ) -> PyResult<Self> {
        let mut decls = Vec::with_capacity(leaves.len());
        let mut types = Vec::with_capacity(leaves.len());
        for (name, shape, descr, ragged) in leaves {
            let array = ArraySpec::new(shape.clone(), descr.itemsize()).map_err(to_pyerr)?;
            let ragged = ragged.map(|(max_len, group)| RaggedDecl { max_len, group });
            decls.push(LeafDecl { name, array, ragged });
            types.push(LeafType { descr: descr.unbind(), inner: shape });
        }
        let spec = RaggedSpec::new(decls).map_err(to_pyerr)?;
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
        };
        let table = RaggedTable::new(spec, config).map_err(to_pyerr)?;
        Ok(Self { table: Arc::new(table), leaves: types, submitted: AtomicU64::new(0) })
    }

    /// Inserts `samples` (each a list of C-contiguous arrays in leaf order) as one entry;
    /// returns its key.
    #[pyo3(signature = (samples, timeout=None, priority=None))]
    fn submit_group(
        &self,
        py: Python<'_>,
        samples: Vec<Vec<Bound<'_, PyUntypedArray>>>,
        timeout: Option<f64>,
        priority: Option<f64>,
    ) -> PyResult<u64> {
        let deadline = deadline_from_timeout(timeout)?;
        // (address, bytes) per leaf and rows per leaf, read with the GIL held; the arrays
        // stay referenced by `samples` for the whole call.
        let mut raw: Vec<RawSample> = Vec::with_capacity(samples.len());
        for sample in &samples {
            if sample.len() != self.leaves.len() {
                return Err(PyValueError::new_err(format!(
                    "expected {} leaves, got {}",
                    self.leaves.len(),
                    sample.len()
                )));
            }
            let mut leaves = Vec::with_capacity(sample.len());
            let mut rows = Vec::with_capacity(sample.len());
            for (array, column) in sample.iter().zip(self.table.spec().columns()) {
                if !array.is_c_contiguous() {
                    return Err(PyValueError::new_err(format!(
                        "leaf {}: the array must be C-contiguous",
                        column.name()
                    )));
                }
                let bytes = array.shape().iter().product::<usize>() * array.dtype().itemsize();
                let n = if column.is_ragged() {
                    array.shape().first().copied().unwrap_or(1)
                } else {
                    1
                };
                // SAFETY: `array` is a live ndarray (held by `samples`); reading its `data`
                // field is what numpy's `PyArray_DATA` macro does.
                let data = unsafe { (*array.as_array_ptr()).data } as usize;
                leaves.push((data, bytes));
                rows.push(n);
            }
            raw.push((leaves, rows));
        }
        let table = &self.table;
        let got = wait_detached(py, deadline, |slice_end| {
            let views: Vec<SampleIn<'_>> = raw
                .iter()
                .map(|(leaves, rows)| SampleIn {
                    leaves: leaves
                        .iter()
                        .map(|&(addr, len)| {
                            if len == 0 {
                                return &[][..];
                            }
                            // SAFETY: `addr` is the data of a C-contiguous array of `len`
                            // bytes that `samples` keeps alive until this call returns;
                            // nothing writes it meanwhile (the caller hands it to us).
                            unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
                        })
                        .collect(),
                    rows: rows.clone(),
                })
                .collect();
            match table.insert_group(&views, priority, Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            }
        })?;
        match got {
            Some(Ok(key)) => {
                // ORDERING: Relaxed — a statistics counter, read alone.
                self.submitted.fetch_add(samples.len() as u64, Ordering::Relaxed);
                Ok(key)
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
                return Err(PyTimeoutError::new_err(
                    "no batch within the timeout: not enough samples arrived",
                ))
            }
        };
        self.to_python(py, batch).map(Some)
    }

    /// Sets the priorities of the entries `keys` name; returns how many were updated.
    fn update_priorities(
        &self,
        keys: PyReadonlyArray1<'_, u64>,
        priorities: PyReadonlyArray1<'_, f64>,
    ) -> PyResult<u64> {
        let keys = keys.as_slice()?;
        let priorities = priorities.as_slice()?;
        self.table.update_priorities(keys, priorities).map_err(to_pyerr)
    }

    /// Counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.table.stats();
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
        d.set_item("arena_bytes_in_use", s.arena_bytes_in_use)?;
        d.set_item("arena_capacity", s.arena_capacity)?;
        d.set_item("insert_blocked_ns", s.insert_blocked_ns)?;
        Ok(d)
    }

    /// Closes the table (with `drain`, FIFO hands out what is left first).
    #[pyo3(signature = (drain=false))]
    fn close(&self, drain: bool) {
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
                    let base = Py::new(
                        py,
                        RaggedCopy { buf: std::sync::Mutex::new(Some(buf)), pool: pool.clone() },
                    )?;
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
