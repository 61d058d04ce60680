//! `echo._echo.RingServer`: the native half of `echo.Server`. It receives flattened leaves
//! (the Python layer owns the pytree structure), checks everything memory safety depends on
//! (leaf count, dtype, shape, contiguity, byte sizes), and hands batches out as numpy views.

use std::time::Instant;

use numpy::npyffi::npy_intp;
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use parking_lot::{Mutex, MutexGuard};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PySequence};

use super::errors::{insert_error, sample_timeout, to_pyerr, ServerClosedError};
use super::info::{HistSnapshot, SampleInfo};
use super::views::{batch_copies, batch_views, LeafLayout, RingLease};
use super::{deadline_from_timeout, wait_detached};
use crate::spec::{ArraySpec, DataSpec};
use crate::store::{Consumer, InsertError, Leaves, SampleError, Store};
use crate::sync::Arc;

/// Samples at or above this many bytes are copied with the GIL released.
const DETACH_COPY_BYTES: usize = 64 * 1024;

/// The in-process ring: `submit` flattened leaves, `sample` batches of views.
#[pyclass(frozen, module = "echo._echo", name = "RingServer")]
pub(crate) struct PyRingServer {
    store: Arc<Store>,
    /// The single consumer. The mutex serialises `sample()` calls from several Python threads
    /// (it is always taken with the GIL released, so it cannot deadlock against the GIL).
    consumer: Mutex<Consumer>,
    layouts: Vec<LeafLayout>,
    /// Leaf paths, for error messages.
    names: Vec<String>,
    /// Leaf shapes without the batch dimension.
    shapes: Vec<Vec<usize>>,
    lease: Py<RingLease>,
    /// Shared all-zero histogram for builds without `detailed-metrics`.
    zero_hist: Py<HistSnapshot>,
}

#[pymethods]
impl PyRingServer {
    /// `shapes[i]`, `dtypes[i]` and `names[i]` describe leaf `i` in flattened order.
    #[new]
    #[pyo3(signature = (shapes, dtypes, names, batch_size, num_buffers))]
    fn new(
        py: Python<'_>,
        shapes: Vec<Vec<usize>>,
        dtypes: Vec<Bound<'_, PyArrayDescr>>,
        names: Vec<String>,
        batch_size: usize,
        num_buffers: usize,
    ) -> PyResult<Self> {
        if shapes.len() != dtypes.len() || shapes.len() != names.len() {
            return Err(PyValueError::new_err(format!(
                "shapes, dtypes and names must have the same length, got {}, {} and {}",
                shapes.len(),
                dtypes.len(),
                names.len()
            )));
        }
        let mut arrays = Vec::with_capacity(shapes.len());
        for ((shape, dtype), name) in shapes.iter().zip(&dtypes).zip(&names) {
            if dtype.has_object() {
                return Err(PyTypeError::new_err(format!(
                    "leaf {name}: dtype {dtype} holds Python objects, which cannot be stored in a ring buffer"
                )));
            }
            arrays.push(ArraySpec::new(shape.clone(), dtype.itemsize()).map_err(to_pyerr)?);
        }
        let spec = DataSpec::new(arrays).map_err(to_pyerr)?;
        let store = Store::new(spec, batch_size, num_buffers).map_err(to_pyerr)?;
        let consumer = store.consumer().expect("a new store has no consumer yet");
        let layouts = shapes
            .iter()
            .zip(dtypes)
            .map(|(shape, dtype)| {
                let dims = std::iter::once(batch_size)
                    .chain(shape.iter().copied())
                    .map(|d| {
                        npy_intp::try_from(d)
                            .map_err(|_| PyValueError::new_err("dimension too large"))
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(LeafLayout { descr: dtype.unbind(), dims })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            lease: Py::new(py, RingLease::new(Arc::clone(&store)))?,
            zero_hist: Py::new(py, HistSnapshot::default())?,
            store,
            consumer: Mutex::new(consumer),
            layouts,
            names,
            shapes,
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
        if self.store.is_closed() {
            return Err(ServerClosedError::new_err("submit(): the server is closed"));
        }
        let count = leaves.len()?;
        if count != self.layouts.len() {
            return Err(PyValueError::new_err(format!(
                "expected {} leaves, got {count}",
                self.layouts.len()
            )));
        }
        // The arrays to copy from (converted scalars and contiguous copies included) must
        // outlive the insert.
        let mut arrays = Vec::with_capacity(count);
        for i in 0..count {
            arrays.push(self.check_leaf(i, &leaves.get_item(i)?)?);
        }
        let mut slices: Vec<&[u8]> = Vec::with_capacity(count);
        for (i, array) in arrays.iter().enumerate() {
            let len = self.store.leaf_bytes(i);
            // SAFETY: `array` is a C-contiguous ndarray whose dtype and shape were checked
            // against the spec, so its buffer holds exactly `len` initialised bytes. It stays
            // alive until this function returns (`arrays` owns it). Another
            // Python thread could write to it concurrently, exactly as with numpy's own
            // GIL-released copies; the bytes are then torn, never out of bounds.
            let data = unsafe { (*array.as_array_ptr()).data };
            let slice = if len == 0 {
                &[][..]
            } else {
                // SAFETY: see above: `data` points at `len` readable bytes that outlive `slices`.
                unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
            };
            slices.push(slice);
        }
        let source = Leaves(&slices);
        // Fast path: small samples into a ring with room go in without releasing the GIL.
        if self.store.spec().payload_size() < DETACH_COPY_BYTES {
            match self.store.insert(&source, Some(Instant::now())) {
                Ok(()) => return Ok(()),
                Err(InsertError::TimedOut { inserted: 0 }) => {}
                Err(err) => return Err(insert_error(err)),
            }
        }
        let store = &self.store;
        let done = wait_detached(py, deadline, |slice_end| {
            match store.insert(&source, Some(slice_end)) {
                Ok(()) => Some(Ok(())),
                Err(InsertError::TimedOut { inserted: 0 }) => None,
                Err(err) => Some(Err(err)),
            }
        })?;
        match done {
            Some(Ok(())) => Ok(()),
            Some(Err(err)) => Err(insert_error(err)),
            None => Err(insert_error(InsertError::TimedOut { inserted: 0 })),
        }
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
        let consumer = &self.consumer;
        let got = wait_detached(py, deadline, |slice_end| {
            let mut guard = consumer.try_lock_until(slice_end)?;
            match guard.sample(Some(slice_end)) {
                Ok(batch) => Some(Ok((guard, batch))),
                Err(SampleError::Closed) => Some(Err(SampleError::Closed)),
                Err(SampleError::TimedOut) => None,
            }
        })?;
        let (guard, batch): (MutexGuard<'_, Consumer>, u64) = match got {
            Some(Ok(held)) => held,
            Some(Err(_closed)) => return Ok(None),
            None => return Err(sample_timeout(SampleError::TimedOut)),
        };
        let wait_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let leaves = if copy {
            batch_copies(py, &guard, &self.layouts)?
        } else {
            batch_views(py, &self.store, batch, &self.layouts, &self.lease)?
        };
        let stats = guard.stats();
        drop(guard);
        let info = SampleInfo::from_store(py, &stats, batch, wait_ns, &self.zero_hist);
        Ok(Some((leaves, info)))
    }

    /// A snapshot of the counters without sampling.
    fn stats(&self, py: Python<'_>) -> SampleInfo {
        let stats = self.store.stats();
        SampleInfo::from_store(py, &stats, 0, 0, &self.zero_hist)
    }

    /// Clears the timing histograms (counters stay). Nothing to clear without
    /// `detailed-metrics`.
    fn reset_histograms(&self) {}

    /// Closes the ring: a blocked `sample()` returns `None`, a blocked `submit()` raises
    /// `ServerClosedError`. Idempotent.
    fn close(&self) {
        self.store.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "RingServer(leaves={}, batch_size={}, num_buffers={}, closed={})",
            self.layouts.len(),
            self.store.batch_size(),
            self.store.num_batches(),
            self.store.is_closed()
        )
    }
}

impl PyRingServer {
    /// Checks leaf `i` against the spec: an ndarray (or numpy scalar) of the example's dtype
    /// and shape. Returns the array to copy from, C-contiguous.
    fn check_leaf<'py>(
        &self,
        i: usize,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyUntypedArray>> {
        let py = item.py();
        let name = &self.names[i];
        let array = match item.cast::<PyUntypedArray>() {
            Ok(array) => array.clone(),
            // A numpy scalar (`np.float32(1.0)`) is a 0-d array in all but type.
            Err(_) if item.is_instance(numpy_generic(py)?)? => {
                numpy_module(py)?.call_method1("asarray", (item,))?.cast_into::<PyUntypedArray>()?
            }
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "leaf {name}: expected a numpy.ndarray, got {}",
                    item.get_type().name()?
                )))
            }
        };
        let expected = self.layouts[i].descr.bind(py);
        let dtype = array.dtype();
        if !dtype.is_equiv_to(expected) {
            return Err(PyTypeError::new_err(format!(
                "leaf {name}: expected dtype {expected}, got {dtype}"
            )));
        }
        if array.shape() != self.shapes[i].as_slice() {
            return Err(PyValueError::new_err(format!(
                "leaf {name}: expected shape {}, got {}",
                py_shape(&self.shapes[i]),
                py_shape(array.shape())
            )));
        }
        if array.is_c_contiguous() {
            Ok(array)
        } else {
            Ok(array.call_method1("copy", ("C",))?.cast_into::<PyUntypedArray>()?)
        }
    }
}

fn numpy_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    NUMPY.get_or_try_init(py, || Ok(py.import("numpy")?.unbind())).map(|m| m.bind(py))
}

fn numpy_generic(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static GENERIC: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    GENERIC
        .get_or_try_init(py, || Ok(numpy_module(py)?.getattr("generic")?.unbind()))
        .map(|g| g.bind(py))
}

impl Drop for PyRingServer {
    fn drop(&mut self) {
        // Wakes any thread still blocked in this ring; views keep the memory alive.
        self.store.close();
    }
}

/// `(4,)`, `()`, `(2, 3)`: a shape the way Python prints it.
fn py_shape(shape: &[usize]) -> String {
    match shape {
        [] => "()".to_owned(),
        [one] => format!("({one},)"),
        _ => format!("({})", shape.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")),
    }
}
