//! Batches as numpy arrays: zero-copy views into the ring (read-only, or writeable on request),
//! or private copies.
//!
//! A copy's leaves live in buffers of a [`CopyPool`]: when the last array over one is
//! collected, the buffer goes back to the pool (up to [`KEEP_PER_LEAF`] a leaf) and the next
//! copy of that leaf reuses it. Memory the process already touched costs only the copy; fresh
//! memory from the OS costs a page fault per page, which took copies of multi-megabyte
//! batches to a fifth of memcpy's speed.
//!
//! The memory rule: every view's numpy `base` is a [`RingLease`], which owns the backend's
//! memory ([`Backend::memory_owner`]: the FIFO store or the replay table). That memory therefore
//! lives as long as the last view, even if the `Server` is long gone: a view kept too long may
//! show newer samples (documented), but it never reads freed memory.

use std::ffi::c_int;
use std::ptr;
use std::sync::{Mutex, Weak};

use numpy::npyffi::{
    self, npy_intp, NPY_ARRAY_ALIGNED, NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_WRITEABLE, PY_ARRAY_API,
};
use numpy::{PyArrayDescr, PyArrayDescrMethods};
use pyo3::prelude::*;

use super::errors::to_pyerr;
use crate::backend::{Backend, BatchConsumer, BatchRef};
use crate::slots::Buffer;
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
    /// A lease on `owner`, memory views point into (a ragged table's arena).
    pub(crate) fn owning(owner: Arc<dyn std::any::Any + Send + Sync>, what: &'static str) -> Self {
        Self { _owner: owner, what }
    }

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
pub(crate) fn new_array<'py>(
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

/// Copies of at least this many bytes in all are made with the GIL released (detaching
/// costs a thread switch, more than a small copy).
const DETACH_COPY_BYTES: usize = 64 * 1024;

/// Buffers a [`CopyPool`] keeps per leaf for reuse (a batch in the learner's hands, one
/// being copied and a prefetch queue's worth).
const KEEP_PER_LEAF: usize = 4;

/// Buffers for `copy=True` batches, per leaf, reused once the arrays over them are gone.
pub(crate) struct CopyPool {
    free: Vec<Mutex<Vec<Buffer>>>,
}

impl CopyPool {
    pub(crate) fn new(leaves: usize) -> Arc<Self> {
        Arc::new(Self { free: (0..leaves).map(|_| Mutex::new(Vec::new())).collect() })
    }

    /// A buffer of `len` bytes for `leaf`: one given back earlier, or a new one.
    fn take(&self, leaf: usize, len: usize) -> PyResult<Buffer> {
        let reused = self.free[leaf].lock().unwrap_or_else(|e| e.into_inner()).pop();
        match reused {
            Some(buffer) if buffer.len() == len => Ok(buffer),
            _ => Buffer::new(len).map_err(to_pyerr),
        }
    }

    fn give_back(&self, leaf: usize, buffer: Buffer) {
        let mut free = self.free[leaf].lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < KEEP_PER_LEAF {
            free.push(buffer);
        }
    }
}

/// The numpy `base` of a copied leaf: owns its buffer, and gives it back to the pool when the
/// last array over it is collected (or frees it, if the server is gone).
#[pyclass(frozen, module = "echo._echo", name = "BatchCopy")]
pub(crate) struct BatchCopy {
    buffer: Option<Buffer>,
    pool: Weak<CopyPool>,
    leaf: usize,
}

#[pymethods]
impl BatchCopy {
    fn __repr__(&self) -> String {
        format!(
            "BatchCopy(leaf {}, {} bytes)",
            self.leaf,
            self.buffer.as_ref().map_or(0, Buffer::len)
        )
    }
}

impl Drop for BatchCopy {
    fn drop(&mut self) {
        if let (Some(buffer), Some(pool)) = (self.buffer.take(), self.pool.upgrade()) {
            pool.give_back(self.leaf, buffer);
        }
    }
}

/// Where one leaf's copy goes: a raw pointer, sent to the thread that copies without the GIL.
struct CopyTarget(*mut u8, usize);

// SAFETY: each target is a distinct buffer no other thread touches until the copy is done
// (its array has not escaped yet: the caller holds it until `batch_copies` returns).
unsafe impl Send for CopyTarget {}

/// Private, writeable copies of every leaf of `batch`, which `consumer` just handed out, in
/// buffers from `pool` (made with the GIL released when large).
pub(crate) fn batch_copies<'py>(
    py: Python<'py>,
    consumer: &BatchConsumer,
    batch: &BatchRef,
    layouts: &[LeafLayout],
    pool: &Arc<CopyPool>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut list = Vec::with_capacity(layouts.len());
    let mut targets = Vec::with_capacity(layouts.len());
    for (leaf, layout) in layouts.iter().enumerate() {
        let len: usize = layout.dims.iter().map(|&d| d as usize).product::<usize>()
            * layout.descr.bind(py).itemsize();
        if len == 0 || leaf >= pool.free.len() {
            // Nothing to copy, or a per-item array (keys, probabilities): numpy's memory.
            let array = new_array(py, layout, ptr::null_mut(), true)?;
            let array_ptr = array.as_ptr().cast::<npyffi::PyArrayObject>();
            // SAFETY: `array` is a live ndarray we just created; reading its `data` field is
            // how numpy's own C macros (`PyArray_DATA`) access it.
            let dst = unsafe { (*array_ptr).data }.cast::<u8>();
            targets.push(CopyTarget(dst, len));
            list.push(array);
            continue;
        }
        let buffer = pool.take(leaf, len)?;
        let dst = buffer.as_mut_ptr();
        let base =
            Bound::new(py, BatchCopy { buffer: Some(buffer), pool: Arc::downgrade(pool), leaf })?;
        let array = new_array(py, layout, dst, true)?;
        // `PyArray_SetBaseObject` steals a reference to the base (also on failure).
        // SAFETY: `array` is a freshly created ndarray with no base yet; `base` (which owns
        // the `len` bytes at `dst` until it is collected) is an owned reference it takes over.
        let status = unsafe {
            PY_ARRAY_API.PyArray_SetBaseObject(py, array.as_ptr().cast(), base.into_ptr())
        };
        if status != 0 {
            return Err(PyErr::fetch(py));
        }
        targets.push(CopyTarget(dst, len));
        list.push(array);
    }
    let total: usize = targets.iter().map(|t| t.1).sum();
    let copy = move || {
        for (leaf, target) in targets.into_iter().enumerate() {
            consumer.read_leaf(batch, leaf, |src: &[u8]| {
                assert_eq!(src.len(), target.1, "batch bytes do not match the numpy layout");
                if src.is_empty() {
                    return;
                }
                // SAFETY: `target.0` holds `target.1` bytes (a pool buffer of that length, or
                // numpy's allocation for the layout) and `src.len() == target.1` (asserted);
                // the new arrays are not shared yet, and ring or batch-area memory never
                // overlaps them.
                unsafe { ptr::copy_nonoverlapping(src.as_ptr(), target.0, src.len()) }
            });
        }
    };
    if total >= DETACH_COPY_BYTES {
        super::detach(py, copy);
    } else {
        copy();
    }
    Ok(list)
}
