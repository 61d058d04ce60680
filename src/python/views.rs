//! Batches as numpy arrays: zero-copy views into the ring (read-only, or writeable on request),
//! or private copies.
//!
//! The memory rule: every view's numpy `base` is a [`RingLease`], which owns the backend's
//! memory ([`Backend::memory_owner`]: the FIFO store or the replay table). That memory therefore
//! lives as long as the last view, even if the `Server` is long gone: a view kept too long may
//! show newer samples (documented), but it never reads freed memory.

use std::ffi::c_int;
use std::ptr;

use numpy::npyffi::{
    self, npy_intp, NPY_ARRAY_ALIGNED, NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_WRITEABLE, PY_ARRAY_API,
};
use numpy::{PyArrayDescr, PyArrayDescrMethods};
use pyo3::prelude::*;

use crate::backend::{Backend, BatchConsumer, BatchRef};
use crate::sync::Arc;

/// Keeps the ring alive for as long as a numpy view into it exists (it is the views' `base`).
#[pyclass(frozen, module = "echo._echo", name = "RingLease")]
pub(crate) struct RingLease {
    /// The FIFO store or the replay table whose memory the views point into.
    _owner: Arc<dyn std::any::Any + Send + Sync>,
    what: &'static str,
}

#[pymethods]
impl RingLease {
    fn __repr__(&self) -> String {
        format!("RingLease({})", self.what)
    }
}

impl RingLease {
    /// A lease on `backend`'s batch memory.
    pub(crate) fn new(backend: &Backend) -> Self {
        let what = if backend.has_priorities() { "replay batch area" } else { "FIFO ring" };
        Self { _owner: backend.memory_owner(), what }
    }
}

/// How one leaf of a batch looks to numpy.
pub(crate) struct LeafLayout {
    /// The example leaf's dtype.
    pub(crate) descr: Py<PyArrayDescr>,
    /// `[batch_size, *leaf_shape]`.
    pub(crate) dims: Vec<npy_intp>,
}

/// Creates a 1-leaf array of `layout` over `data` (or freshly allocated memory if `data` is
/// null), C-contiguous; writeable when numpy allocates it, or when `writeable` is set.
fn new_array<'py>(
    py: Python<'py>,
    layout: &LeafLayout,
    data: *mut u8,
    writeable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let flags: c_int = match (data.is_null(), writeable) {
        (true, _) => 0,
        (false, false) => NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED,
        (false, true) => NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE,
    };
    // `PyArray_NewFromDescr` steals a reference to the descriptor: hand it a new one.
    let descr = layout.descr.clone_ref(py).into_bound(py).into_dtype_ptr();
    // SAFETY: `get_type_object` only reads numpy's API table, which `PY_ARRAY_API` imports on
    // first use with the GIL held (we hold it: `py`).
    let subtype = unsafe { PY_ARRAY_API.get_type_object(py, npyffi::NpyTypes::PyArray_Type) };
    // `data` is either null (numpy allocates) or a batch start inside the ring: aligned to at
    // least the element size (leaf buffers are 64-byte aligned, slots are whole elements).
    // SAFETY: `descr` is an owned reference (stolen), `dims` has `nd` entries, null strides mean
    // C order; a non-null `data` has `product(dims) * itemsize` bytes kept alive by the
    // `RingLease` the caller sets as base before the array escapes.
    let raw = unsafe {
        PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            subtype,
            descr,
            layout.dims.len() as c_int,
            layout.dims.as_ptr().cast_mut(),
            ptr::null_mut(),
            data.cast(),
            flags,
            ptr::null_mut(),
        )
    };
    // SAFETY: `raw` is a new (owned) reference or null with a Python error set.
    unsafe { Bound::from_owned_ptr_or_err(py, raw) }
}

/// Views of every leaf of `batch` (each `layouts[i]`-shaped), each with `lease` (a lease on
/// `backend`) as its numpy base. The first `writeable` leaves are writeable, the rest
/// read-only.
///
/// Writeable views are what `sample(writable=True)` asks for, so that consumers that cannot
/// take read-only memory (`torch.as_tensor`, DLPack importers without the versioned protocol)
/// alias the ring without a copy or a warning. Memory safety is the same either way: the
/// lease keeps the memory allocated; what a late write (after the next `sample()`) can do is
/// garble a sample being written, as a late read can see one, which the docs say.
pub(crate) fn batch_views<'py>(
    py: Python<'py>,
    backend: &Backend,
    batch: &BatchRef,
    layouts: &[LeafLayout],
    lease: &Py<RingLease>,
    writeable: usize,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut list = Vec::with_capacity(layouts.len());
    for (leaf, layout) in layouts.iter().enumerate() {
        let data = backend.batch_ptr(batch, leaf).cast_mut();
        let array = new_array(py, layout, data, leaf < writeable)?;
        // `PyArray_SetBaseObject` steals a reference to the base (also on failure).
        let base = lease.clone_ref(py).into_ptr();
        // SAFETY: `array` is a freshly created ndarray with no base yet; `base` is an owned
        // reference that the call takes over.
        let status = unsafe { PY_ARRAY_API.PyArray_SetBaseObject(py, array.as_ptr().cast(), base) };
        if status != 0 {
            return Err(PyErr::fetch(py));
        }
        list.push(array);
    }
    Ok(list)
}

/// Private, writeable copies of every leaf of `batch`, which `consumer` just handed out.
pub(crate) fn batch_copies<'py>(
    py: Python<'py>,
    consumer: &BatchConsumer,
    batch: &BatchRef,
    layouts: &[LeafLayout],
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut list = Vec::with_capacity(layouts.len());
    for (leaf, layout) in layouts.iter().enumerate() {
        let array = new_array(py, layout, ptr::null_mut(), true)?;
        let array_ptr = array.as_ptr().cast::<npyffi::PyArrayObject>();
        // SAFETY: `array` is a live ndarray we just created; reading its `data` field is how
        // numpy's own C macros (`PyArray_DATA`) access it.
        let dst = unsafe { (*array_ptr).data }.cast::<u8>();
        let expected: usize = layout.dims.iter().map(|&d| d as usize).product::<usize>()
            * layout.descr.bind(py).itemsize();
        consumer.read_leaf(batch, leaf, |src: &[u8]| {
            assert_eq!(src.len(), expected, "batch bytes do not match the numpy layout");
            // SAFETY: numpy allocated `expected` bytes at `dst` and `src.len() == expected`
            // (asserted); the new array is not shared yet, and ring or batch-area memory never
            // overlaps a numpy allocation.
            unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
        });
        list.push(array);
    }
    Ok(list)
}
