//! The native half of the sample contract, shared by `ServerCore.submit` and `TcpSender.send`:
//! the example's leaves (dtype, shape, name) and the checks that turn a list of numpy arrays
//! into byte slices that are safe to copy from.

use numpy::npyffi::{self, PY_ARRAY_API};
use numpy::{
    PyArrayDescr, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    IntoPyDict, PyByteArray, PyBytes, PyDict, PyMemoryView, PySequence, PyString, PyType,
};

use pyo3::intern;

use super::config::LayoutArg;
use super::errors::to_pyerr;
use crate::source::EpisodeEnd;
use crate::spec::{ArraySpec, DataSpec};
use crate::transport::wire::v2::{DType, Layout, LeafType};

/// Checks leaf `i` of a sample and returns it as what to copy from (`T`: a [`Leaf`], or a
/// batch's array).
type CheckLeaf<'c, 'py, T> = dyn FnMut(usize, &Bound<'py, PyAny>) -> PyResult<T> + 'c;

/// A checked leaf of one sample, to copy from ([`byte_slices`]).
pub(crate) enum Leaf<'py> {
    /// A C-contiguous array of the leaf's dtype and shape.
    Array(Bound<'py, PyUntypedArray>),
    /// The value of a numpy scalar of exactly the leaf's type (`np.float32(1.0)` for a
    /// float32 leaf of shape `()`): its `len` bytes, read without making an array of it.
    Scalar { bytes: [u8; MAX_SCALAR_BYTES], len: usize },
}

/// The largest numpy scalar read without an array: every fixed-size number but the complex
/// long double.
pub(crate) const MAX_SCALAR_BYTES: usize = 16;

/// A leaf of shape `()` whose numpy scalars are read directly: its scalar type and size.
struct ScalarLeaf {
    ty: Py<PyType>,
    size: usize,
    /// Where an instance holds its value: numpy's scalar objects are `{PyObject_HEAD; T
    /// obval}` (its public `arrayscalars.h`, read by `PyArrayScalar_VAL`), so the header's
    /// size rounded up to `T`'s alignment.
    value_offset: usize,
}

/// The example's leaves in flattened order.
pub(crate) struct LeafSpecs {
    pub(crate) descrs: Vec<Py<PyArrayDescr>>,
    pub(crate) shapes: Vec<Vec<usize>>,
    pub(crate) names: Vec<String>,
    pub(crate) spec: DataSpec,
    /// For an example that is a flat dict of arrays: its keys in leaf order, so samples can be
    /// looked up by key without flattening them in Python.
    flat_keys: Option<Vec<Py<PyString>>>,
    /// The example's `echo._pytree.TreeLayout`: flattens other samples, explains mismatches.
    layout: Py<PyAny>,
    /// Per leaf: its numpy scalar type when a scalar of that exact type is read directly
    /// (shape `()`, a number of native byte order: bool, int, uint, float or complex, of at
    /// most [`MAX_SCALAR_BYTES`]). Other scalars become arrays first (`numpy.asarray`).
    scalars: Vec<Option<ScalarLeaf>>,
    /// The address of `numpy.ndarray` itself (only ever compared with): a leaf of exactly
    /// this type takes [`LeafSpecs::exact_bytes`].
    ndarray_type: usize,
}

impl LeafSpecs {
    /// The example's `echo._pytree.TreeLayout`.
    pub(crate) fn tree_layout(&self) -> &Py<PyAny> {
        &self.layout
    }

    /// Validates the leaves of `tree_layout` (an `echo._pytree.TreeLayout`: no object dtypes,
    /// sizes that fit) into a [`DataSpec`].
    pub(crate) fn new(tree_layout: &Bound<'_, PyAny>) -> PyResult<Self> {
        let layout: LayoutArg<'_> = tree_layout.extract()?;
        let count = layout.leaves.len();
        if layout.flat_keys.as_ref().is_some_and(|k| k.len() != count) {
            return Err(PyValueError::new_err("flat_keys must have one key per leaf"));
        }
        let (mut shapes, mut dtypes, mut names) = (Vec::new(), Vec::new(), Vec::new());
        for leaf in layout.leaves {
            shapes.push(leaf.shape);
            dtypes.push(leaf.dtype);
            names.push(leaf.name);
        }
        let flat_keys = layout.flat_keys;
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
        let scalars = dtypes
            .iter()
            .zip(&shapes)
            .map(|(dtype, shape)| {
                let direct = shape.is_empty()
                    && b"biufc".contains(&dtype.kind())
                    && dtype.is_native_byteorder() != Some(false)
                    && dtype.itemsize() <= MAX_SCALAR_BYTES;
                let value_offset =
                    std::mem::size_of::<pyo3::ffi::PyObject>().next_multiple_of(dtype.alignment());
                direct.then(|| ScalarLeaf {
                    ty: dtype.typeobj().unbind(),
                    size: dtype.itemsize(),
                    value_offset,
                })
            })
            .collect();
        let descrs = dtypes.into_iter().map(Bound::unbind).collect();
        let flat_keys = flat_keys.map(|keys| keys.into_iter().map(Bound::unbind).collect());
        let layout = tree_layout.clone().unbind();
        // SAFETY: `get_type_object` only reads numpy's API table, which `PY_ARRAY_API`
        // imports on first use (the GIL is held).
        let ndarray_type = unsafe {
            PY_ARRAY_API.get_type_object(tree_layout.py(), npyffi::NpyTypes::PyArray_Type)
        } as usize;
        Ok(Self { descrs, shapes, names, spec, flat_keys, layout, scalars, ndarray_type })
    }

    /// The leaves with their dtypes and names, as wire v2 checks them.
    pub(crate) fn typed_layout(&self, py: Python<'_>) -> Layout {
        let leaves = self.descrs.iter().zip(&self.shapes).zip(&self.names);
        Layout(
            leaves
                .map(|((descr, shape), name)| {
                    let descr = descr.bind(py);
                    let order = match descr.byteorder() {
                        b'=' if cfg!(target_endian = "little") => b'<',
                        b'=' => b'>',
                        other => other,
                    };
                    LeafType {
                        name: name.clone(),
                        dtype: DType {
                            order,
                            kind: descr.kind(),
                            size: u32::try_from(descr.itemsize()).unwrap_or(u32::MAX),
                        },
                        shape: shape.clone(),
                    }
                })
                .collect(),
        )
    }

    /// Number of leaves.
    pub(crate) fn len(&self) -> usize {
        self.shapes.len()
    }

    /// Checks `sample`, a pytree like the example, and returns its leaves as C-contiguous
    /// arrays to copy from (numpy scalars converted, non-contiguous inputs copied). The caller
    /// keeps them alive while it uses [`byte_slices`].
    ///
    /// A flat dict with the example's keys is looked up here; anything else is flattened by
    /// the `TreeLayout` (a `ValueError` for another structure). A leaf of the wrong type that
    /// is really a structural difference (a container where an array belongs) is reported as
    /// the structure error it is.
    pub(crate) fn arrays<'py>(&self, sample: &Bound<'py, PyAny>) -> PyResult<Vec<Leaf<'py>>> {
        self.walk(sample, &mut |i, item| self.check_leaf(i, item))
    }

    /// [`LeafSpecs::arrays`] for a batch of samples (`submit_batch`, `send_batch`): every leaf
    /// has a leading dimension `n`, the same for all, one sample per row; `priority` is one
    /// number for every row or one per row.
    pub(crate) fn batch<'py>(
        &self,
        tree: &Bound<'py, PyAny>,
        priority: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Batch<'py>> {
        let mut rows: Option<(usize, usize)> = None;
        let arrays = self.walk(tree, &mut |i, item| self.check_rows(i, item, &mut rows))?;
        let n = rows.map_or(0, |(n, _)| n);
        let priorities = priority.map(|p| row_priorities(p, n)).transpose()?;
        Ok(Batch { n, arrays, priorities })
    }

    /// The leaves of `sample` (a flat dict looked up by key, anything else flattened by the
    /// `TreeLayout`), each checked by `check`; a wrong type that is really a structural
    /// difference is reported as the structure error it is.
    fn walk<'py, T>(
        &self,
        sample: &Bound<'py, PyAny>,
        check: &mut CheckLeaf<'_, 'py, T>,
    ) -> PyResult<Vec<T>> {
        let py = sample.py();
        let layout = self.layout.bind(py);
        let checked = match self.check_flat_dict(sample, check) {
            Ok(Some(arrays)) => Ok(arrays),
            Ok(None) => {
                let leaves = layout.call_method1(intern!(py, "flatten"), (sample,))?;
                self.check(leaves.cast::<PySequence>()?, check)
            }
            Err(err) => Err(err),
        };
        match checked {
            Err(err) if err.is_instance_of::<PyTypeError>(py) => {
                layout.call_method1(intern!(py, "check_structure"), (sample,))?;
                Err(err)
            }
            other => other,
        }
    }

    /// Checks every leaf of `leaves` (the sample flattened), as [`LeafSpecs::arrays`].
    fn check<'py, T>(
        &self,
        leaves: &Bound<'py, PySequence>,
        check: &mut CheckLeaf<'_, 'py, T>,
    ) -> PyResult<Vec<T>> {
        let count = leaves.len()?;
        if count != self.len() {
            return Err(PyValueError::new_err(format!(
                "expected {} leaves, got {count}",
                self.len()
            )));
        }
        (0..count).map(|i| check(i, &leaves.get_item(i)?)).collect()
    }

    /// The fast path for flat-dict examples: if `sample` is a dict with exactly the example's
    /// keys, checks its values like [`LeafSpecs::check`]. `None` if the example is not a flat
    /// dict or `sample` does not have its keys (the caller then flattens in Python).
    fn check_flat_dict<'py, T>(
        &self,
        sample: &Bound<'py, PyAny>,
        check: &mut CheckLeaf<'_, 'py, T>,
    ) -> PyResult<Option<Vec<T>>> {
        let Some(keys) = &self.flat_keys else { return Ok(None) };
        let Ok(dict) = sample.cast_exact::<PyDict>() else { return Ok(None) };
        if dict.len() != keys.len() {
            return Ok(None);
        }
        let mut arrays = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            let Some(value) = dict.get_item(key.bind(sample.py()))? else { return Ok(None) };
            arrays.push(check(i, &value)?);
        }
        Ok(Some(arrays))
    }

    /// Fills `held` with the leaves of `sample` when it is a dict of exactly the example's
    /// flat keys (a `dict`, not a subclass); `false` otherwise (and `held` is then partly
    /// filled). The values are owned: a dict may change while an insert waits without the
    /// GIL, and its leaves must outlive the copy.
    pub(crate) fn flat_dict_leaves<'py>(
        &self,
        sample: &Bound<'py, PyAny>,
        held: &mut [Option<Bound<'py, PyAny>>],
    ) -> PyResult<bool> {
        let Some(keys) = &self.flat_keys else { return Ok(false) };
        let Ok(dict) = sample.cast_exact::<PyDict>() else { return Ok(false) };
        if dict.len() != keys.len() || held.len() < keys.len() {
            return Ok(false);
        }
        for (key, slot) in keys.iter().zip(held.iter_mut()) {
            let Some(value) = dict.get_item(key.bind(sample.py()))? else { return Ok(false) };
            *slot = Some(value);
        }
        Ok(true)
    }

    /// Leaf `i` given on its own (a `SampleWriter`'s positional leaves), checked as a
    /// sample's leaf is.
    pub(crate) fn checked_leaf<'py>(
        &self,
        i: usize,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Leaf<'py>> {
        self.check_leaf(i, item)
    }

    /// Checks leaf `i`: an ndarray (or numpy scalar) of the example's dtype and shape.
    fn check_leaf<'py>(&self, i: usize, item: &Bound<'py, PyAny>) -> PyResult<Leaf<'py>> {
        if self.exact_bytes(i, item.as_borrowed()).is_some() {
            // SAFETY: exactly a numpy.ndarray (`exact_bytes` checked its type).
            return Ok(Leaf::Array(unsafe { item.clone().cast_into_unchecked() }));
        }
        let array = match item.cast::<PyUntypedArray>() {
            Ok(array) => array.clone(),
            // A numpy scalar of exactly the leaf's type: its value, with no array made.
            Err(_) => {
                let mut bytes = [0u8; MAX_SCALAR_BYTES];
                if let Some(len) = self.scalar_value(i, item.as_borrowed(), &mut bytes) {
                    return Ok(Leaf::Scalar { bytes, len });
                }
                return self.other_leaf(i, item);
            }
        };
        self.check_array(i, &array)?;
        self.contiguous(i, array, &mut |array| self.check_array(i, array)).map(Leaf::Array)
    }

    /// The value of `item` as leaf `i` when it is a numpy scalar of exactly the leaf's type
    /// (`np.float32(1.0)` for a float32 leaf of shape `()`), copied into `out`: its length.
    pub(crate) fn scalar_value(
        &self,
        i: usize,
        item: Borrowed<'_, '_, PyAny>,
        out: &mut [u8; MAX_SCALAR_BYTES],
    ) -> Option<usize> {
        let scalar = self.scalars[i].as_ref()?;
        if item.get_type_ptr() != scalar.ty.as_ptr().cast() {
            return None;
        }
        // `item` is an instance of exactly the numpy scalar type of a fixed-size number of the
        // leaf's dtype (bool, int, uint, float or complex, checked when the leaf's spec was
        // made; not a subclass, whose layout could differ), which numpy lays out as
        // `{PyObject_HEAD; T obval}`: `size` bytes of value at `value_offset`.
        let value = item.as_ptr().cast::<u8>().wrapping_add(scalar.value_offset);
        // SAFETY: `value` points at those `size` bytes inside the live object (the GIL is held
        // and `item` keeps it alive); `out` holds at least `size` (at most MAX_SCALAR_BYTES)
        // bytes and is not inside the object.
        unsafe { std::ptr::copy_nonoverlapping(value, out.as_mut_ptr(), scalar.size) };
        Some(scalar.size)
    }

    /// Leaf `i` when it is neither an ndarray nor a numpy scalar of exactly its type: another
    /// numpy scalar (made an array), or an array-like.
    fn other_leaf<'py>(&self, i: usize, item: &Bound<'py, PyAny>) -> PyResult<Leaf<'py>> {
        let py = item.py();
        let name = &self.names[i];
        // A numpy scalar (`np.float32(1.0)`) is a 0-d array in all but type.
        let array = if item.is_instance(numpy_generic(py)?)? {
            let array = numpy_module(py)?.call_method1("asarray", (item,))?;
            let array = array.cast_into::<PyUntypedArray>().map_err(PyErr::from)?;
            if array.ndim() != 0 {
                // Its `__array__` (a subclass may override it) did not return a scalar.
                return Err(PyTypeError::new_err(format!(
                    "leaf {name}: the numpy scalar ({}) converted to an array of shape {}, \
                     not to a 0-d array",
                    item.get_type().name()?,
                    py_shape(array.shape())
                )));
            }
            array
        } else {
            match self.array_like(i, item)? {
                Some(array) => array,
                None => {
                    return Err(PyTypeError::new_err(format!(
                        "leaf {name}: expected a numpy.ndarray (or an array with __dlpack__, \
                         __array_interface__ or the buffer protocol), got {}",
                        item.get_type().name()?
                    )))
                }
            }
        };
        self.check_array(i, &array)?;
        self.contiguous(i, array, &mut |array| self.check_array(i, array)).map(Leaf::Array)
    }

    /// Checks leaf `i` of a batch: an ndarray of the example's dtype and shape `(n, *shape)`,
    /// with `n` the same for every leaf (`rows`: `n` and the leaf that set it).
    fn check_rows<'py>(
        &self,
        i: usize,
        item: &Bound<'py, PyAny>,
        rows: &mut Option<(usize, usize)>,
    ) -> PyResult<Bound<'py, PyUntypedArray>> {
        let name = &self.names[i];
        let converted;
        let array = match item.cast::<PyUntypedArray>() {
            Ok(array) => array,
            // A numpy scalar has no rows; anything else that shares its memory as an array
            // (a torch or JAX CPU array) is read as one.
            Err(_) if !item.is_instance(numpy_generic(item.py())?)? => {
                match self.array_like(i, item)? {
                    Some(array) => {
                        converted = array;
                        &converted
                    }
                    None => return Err(not_rows(name, item)),
                }
            }
            Err(_) => return Err(not_rows(name, item)),
        };
        let check = |array: &Bound<'_, PyUntypedArray>| -> PyResult<usize> {
            let expected = self.descrs[i].bind(array.py());
            let dtype = array.dtype();
            if !dtype.is_equiv_to(expected) {
                return Err(PyTypeError::new_err(format!(
                    "leaf {name}: expected dtype {expected}, got {dtype}"
                )));
            }
            let shape = array.shape();
            let leaf = self.shapes[i].as_slice();
            if shape.len() != leaf.len() + 1 || &shape[1..] != leaf {
                let dims: Vec<String> = std::iter::once("N".to_owned())
                    .chain(leaf.iter().map(usize::to_string))
                    .collect();
                let expected = if leaf.is_empty() {
                    "(N,)".to_owned()
                } else {
                    format!("({})", dims.join(", "))
                };
                return Err(PyValueError::new_err(format!(
                    "leaf {name}: expected shape {expected} with one row per sample, got {}",
                    py_shape(shape)
                )));
            }
            Ok(shape[0])
        };
        let n = check(array)?;
        match *rows {
            None => *rows = Some((n, i)),
            Some((m, first)) if m != n => {
                return Err(PyValueError::new_err(format!(
                    "leaf {name} has {n} rows, leaf {} has {m}: every leaf of a batch needs the \
                     same leading dimension (one row per sample)",
                    self.names[first]
                )))
            }
            Some(_) => {}
        }
        self.contiguous(i, array.clone(), &mut |array| check(array).map(drop))
    }

    /// `array` itself if C-contiguous, else a C-contiguous copy made by numpy, which `recheck`
    /// checks again.
    fn contiguous<'py>(
        &self,
        i: usize,
        array: Bound<'py, PyUntypedArray>,
        recheck: &mut dyn FnMut(&Bound<'py, PyUntypedArray>) -> PyResult<()>,
    ) -> PyResult<Bound<'py, PyUntypedArray>> {
        let (py, name) = (array.py(), &self.names[i]);
        if array.is_c_contiguous() {
            return Ok(array);
        }
        // Copied by numpy itself into a plain ndarray: never by the object's own `copy`, which
        // a subclass may override to return anything. And memory safety never rests on what a
        // conversion returned: the copy is checked like the original.
        let kwargs = [(intern!(py, "order"), "C")].into_py_dict(py)?;
        let copy =
            numpy_module(py)?.getattr(intern!(py, "array"))?.call((&array,), Some(&kwargs))?;
        let copy = copy.cast_into::<PyUntypedArray>().map_err(PyErr::from)?;
        recheck(&copy)?;
        if !copy.is_c_contiguous() {
            return Err(PyTypeError::new_err(format!(
                "leaf {name}: could not make a C-contiguous copy of it"
            )));
        }
        Ok(copy)
    }

    /// A leaf `item` that is not an ndarray but shares its memory as an array: through DLPack
    /// (`__dlpack__`: torch and JAX CPU arrays, via `np.from_dlpack`), the array interface
    /// (`np.asarray`) or the buffer protocol (`np.asarray(memoryview(item))`), as an ndarray
    /// over the same memory; the caller checks it like any ndarray (and copies it if it is not
    /// C-contiguous). `None` for anything else (lists, Python numbers, strings).
    ///
    /// # Errors
    /// `TypeError` when the object offers an array but numpy cannot read it (a GPU tensor, a
    /// torch tensor that requires grad, a dtype numpy lacks), with numpy's error as the cause.
    fn array_like<'py>(
        &self,
        i: usize,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyUntypedArray>>> {
        let py = item.py();
        let numpy = numpy_module(py)?;
        let converted = if item.hasattr(intern!(py, "__dlpack__"))? {
            numpy.call_method1(intern!(py, "from_dlpack"), (item,))
        } else if item.hasattr(intern!(py, "__array_interface__"))?
            || item.hasattr(intern!(py, "__array_struct__"))?
        {
            numpy.call_method1(intern!(py, "asarray"), (item,))
        } else if is_byte_string(item)? {
            // Raw bytes are data, not an array: numpy itself reads `bytes` as one string.
            return Ok(None);
        } else {
            match PyMemoryView::from(item) {
                Ok(view) => numpy.call_method1(intern!(py, "asarray"), (view,)),
                Err(_) => return Ok(None), // not a buffer either
            }
        };
        let name = &self.names[i];
        let kind = item.get_type().name()?;
        let converted = converted.map_err(|cause| {
            let err = PyTypeError::new_err(format!(
                "leaf {name}: numpy could not read the {kind} as an array: {cause}"
            ));
            err.set_cause(py, Some(cause));
            err
        })?;
        match converted.cast_into::<PyUntypedArray>() {
            Ok(array) => Ok(Some(array)),
            Err(_) => Err(PyTypeError::new_err(format!(
                "leaf {name}: the {kind} did not convert to a numpy.ndarray"
            ))),
        }
    }

    /// The bytes of `item` as leaf `i` when it is the common case, checked with a few reads
    /// of its fields: exactly a `numpy.ndarray` (no subclass), with the example's own dtype
    /// object (numpy shares one per built-in type), its shape, and C-contiguous. `None`:
    /// anything else, which [`LeafSpecs::check_leaf`] checks in full. The bytes stay valid
    /// while `item` (borrowed for `'a`) keeps the array alive.
    pub(crate) fn exact_bytes<'a>(
        &self,
        i: usize,
        item: Borrowed<'a, '_, PyAny>,
    ) -> Option<&'a [u8]> {
        if item.get_type_ptr() as usize != self.ndarray_type {
            return None;
        }
        let shape = self.shapes[i].as_slice();
        // SAFETY: `item` is exactly a numpy.ndarray (its type checked above), so it is a
        // live `PyArrayObject`, whose fields are read here as numpy's own accessor macros
        // read them; the GIL is held and `item` keeps it alive for `'a`.
        let fields = unsafe { &*item.as_ptr().cast::<npyffi::PyArrayObject>() };
        let dims: &[npyffi::npy_intp] = match usize::try_from(fields.nd) {
            Ok(0) if shape.is_empty() => &[],
            Ok(nd) if nd == shape.len() => {
                // SAFETY: `dimensions` holds `nd` entries (numpy's `PyArray_DIMS`).
                unsafe { std::slice::from_raw_parts(fields.dimensions, nd) }
            }
            _ => return None,
        };
        let same = fields.descr.cast::<pyo3::ffi::PyObject>() == self.descrs[i].as_ptr()
            && fields.flags & npyffi::NPY_ARRAY_C_CONTIGUOUS != 0
            && dims.iter().zip(shape).all(|(&d, &dim)| usize::try_from(d).is_ok_and(|d| d == dim));
        if !same {
            return None;
        }
        let len = self.spec.arrays()[i].num_bytes();
        if len == 0 {
            return Some(&[]);
        }
        // Another Python thread could write to the array concurrently, exactly as with
        // numpy's own GIL-released copies: the bytes may then be torn, never out of bounds.
        // SAFETY: a C-contiguous array of the leaf's dtype and shape (checked above) holds
        // exactly `len` bytes at `data`, alive for `'a`.
        Some(unsafe { std::slice::from_raw_parts(fields.data.cast::<u8>(), len) })
    }

    /// Checks that `array` (an ndarray, as numpy's C struct describes it: neither its dtype
    /// nor its shape come from Python attributes) has leaf `i`'s dtype and shape.
    fn check_array(&self, i: usize, array: &Bound<'_, PyUntypedArray>) -> PyResult<()> {
        let (py, name) = (array.py(), &self.names[i]);
        let expected = self.descrs[i].bind(py);
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
        Ok(())
    }
}

/// The bytes of each checked leaf (from [`LeafSpecs::arrays`]), in order.
pub(crate) fn byte_slices<'a>(specs: &LeafSpecs, leaves: &'a [Leaf<'_>]) -> Vec<&'a [u8]> {
    leaves
        .iter()
        .zip(specs.spec.arrays())
        .map(|(leaf, spec)| {
            let len = spec.num_bytes();
            let array = match leaf {
                Leaf::Array(array) => array,
                // `len` is the leaf's size, the scalar's (the same type).
                Leaf::Scalar { bytes, len: size } => return &bytes[..len.min(*size)],
            };
            if len == 0 {
                return &[][..];
            }
            // SAFETY: reading the `data` field of a live ndarray is what numpy's `PyArray_DATA`
            // macro does.
            let data = unsafe { (*array.as_array_ptr()).data };
            // Another Python thread could write to the array concurrently, exactly as with
            // numpy's own GIL-released copies: the bytes may then be torn, never out of bounds.
            // SAFETY: `LeafSpecs::check` verified `array` is C-contiguous with the spec's dtype
            // and shape, so `data` holds exactly `len` bytes; `arrays` keeps it alive for `'a`.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
        })
        .collect()
}

/// A checked batch ([`LeafSpecs::batch`]): `n` rows of every leaf, C-contiguous, and the
/// rows' priorities if any.
pub(crate) struct Batch<'py> {
    pub(crate) n: usize,
    arrays: Vec<Bound<'py, PyUntypedArray>>,
    priorities: Option<Vec<f64>>,
}

impl Batch<'_> {
    /// Each leaf's bytes (`n` rows each), to build a [`crate::source::Rows`] from.
    pub(crate) fn slices(&self, specs: &LeafSpecs) -> Vec<&[u8]> {
        batch_byte_slices(specs, &self.arrays, self.n)
    }

    /// One priority per row, if the caller gave any.
    pub(crate) fn priorities(&self) -> Option<&[f64]> {
        self.priorities.as_deref()
    }
}

/// The bytes of each checked batch array: `n` rows each.
fn batch_byte_slices<'a>(
    specs: &LeafSpecs,
    arrays: &'a [Bound<'_, PyUntypedArray>],
    n: usize,
) -> Vec<&'a [u8]> {
    arrays
        .iter()
        .zip(specs.spec.arrays())
        .map(|(array, spec)| {
            let len = spec.num_bytes() * n;
            if len == 0 {
                return &[][..];
            }
            // SAFETY: as in `byte_slices`: reading the `data` field of a live ndarray.
            let data = unsafe { (*array.as_array_ptr()).data };
            // SAFETY: `LeafSpecs::batch_arrays` verified `array` is C-contiguous with the spec's
            // dtype and shape `(n, *shape)`, so `data` holds exactly `len` bytes (no overflow:
            // numpy allocated them); `arrays` keeps it alive for `'a`.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
        })
        .collect()
}

/// A batch's priorities: `priority` as one number for all `n` rows, or one per row (any
/// 1-d array-like of `n` numbers).
///
/// # Errors
/// `ValueError` for another length or shape; `TypeError` for what is not numbers.
fn row_priorities(priority: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<f64>> {
    if let Ok(one) = priority.extract::<f64>() {
        return Ok(vec![one; n]);
    }
    let py = priority.py();
    let kwargs = [(intern!(py, "dtype"), "float64")].into_py_dict(py)?;
    let array = numpy_module(py)?.call_method("asarray", (priority,), Some(&kwargs))?;
    let array = array.cast_into::<PyUntypedArray>().map_err(PyErr::from)?;
    if array.shape() != [n] {
        return Err(PyValueError::new_err(format!(
            "priority must be one number or one per row ({n},), got shape {}",
            py_shape(array.shape())
        )));
    }
    array.call_method0(intern!(py, "tolist"))?.extract()
}

/// Whether `item` is a byte string (`bytes`, `bytearray`) or a memoryview of one: buffers,
/// but not arrays, so they stay the `TypeError` a non-array leaf gets.
fn is_byte_string(item: &Bound<'_, PyAny>) -> PyResult<bool> {
    let bytes = |obj: &Bound<'_, PyAny>| {
        obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyByteArray>()
    };
    if bytes(item) {
        return Ok(true);
    }
    match item.cast::<PyMemoryView>() {
        Ok(view) => Ok(bytes(&view.getattr(intern!(item.py(), "obj"))?)),
        Err(_) => Ok(false),
    }
}

/// The `TypeError` for a batch leaf that is no array with rows.
fn not_rows(name: &str, item: &Bound<'_, PyAny>) -> PyErr {
    let kind = item.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
    PyTypeError::new_err(format!(
        "leaf {name}: expected a numpy.ndarray with one row per sample (or an array with \
         __dlpack__, __array_interface__ or the buffer protocol), got {kind}"
    ))
}

/// `(4,)`, `()`, `(2, 3)`: a shape the way Python prints it.
pub(crate) fn py_shape(shape: &[usize]) -> String {
    match shape {
        [] => "()".to_owned(),
        [one] => format!("({one},)"),
        _ => format!("({})", shape.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")),
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

/// A step's episode flags as `send()` and `submit()` take them: `truncated` ends the
/// episode too, cut short.
pub(crate) fn episode_end(end_episode: bool, truncated: bool) -> EpisodeEnd {
    match (end_episode, truncated) {
        (_, true) => EpisodeEnd::Truncated,
        (true, false) => EpisodeEnd::Terminated,
        (false, false) => EpisodeEnd::No,
    }
}

/// A batch's episode flags as `send_batch()` and `submit_batch()` take them: `end_episode`
/// and `truncated`, each a bool for every row or a 1-D bool array with one per row
/// (`None`: false), read when the call starts and matched to its rows by [`Self::ends`].
pub(crate) struct EpisodeFlags<'py> {
    end_episode: PyReadonlyArrayDyn<'py, bool>,
    truncated: PyReadonlyArrayDyn<'py, bool>,
}

impl<'py> EpisodeFlags<'py> {
    /// The flags given, or `None` when neither was.
    ///
    /// # Errors
    /// `TypeError` for a flag that is not a bool or bools, `ValueError` for one of more than
    /// one dimension, or two arrays of different lengths.
    pub(crate) fn new(
        py: Python<'py>,
        end_episode: Option<&Bound<'py, PyAny>>,
        truncated: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Self>> {
        if end_episode.is_none() && truncated.is_none() {
            return Ok(None);
        }
        let flags = Self {
            end_episode: Self::flag(py, "end_episode", end_episode)?,
            truncated: Self::flag(py, "truncated", truncated)?,
        };
        if let ([a], [b]) = (flags.end_episode.shape(), flags.truncated.shape()) {
            if a != b {
                return Err(PyValueError::new_err(format!(
                    "end_episode and truncated must have one flag per row each, got shapes \
                     ({a},) and ({b},)"
                )));
            }
        }
        Ok(Some(flags))
    }

    /// One flag: `value` as a bool array of at most one dimension (`None`: false).
    fn flag(
        py: Python<'py>,
        name: &str,
        value: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<PyReadonlyArrayDyn<'py, bool>> {
        let asarray = numpy_module(py)?.getattr("asarray")?;
        let array = match value {
            Some(value) => asarray.call1((value,))?,
            None => asarray.call1((false,))?,
        };
        let Ok(flags) = array.cast::<PyArrayDyn<bool>>() else {
            let kind = value
                .and_then(|v| v.get_type().name().ok())
                .map_or_else(|| "?".to_owned(), |n| n.to_string());
            return Err(PyTypeError::new_err(format!(
                "{name} must be a bool or an array of bools (one per row), got {kind} of dtype \
                 {}",
                array.getattr("dtype")?.str()?
            )));
        };
        if flags.ndim() > 1 {
            return Err(PyValueError::new_err(format!(
                "{name} must be a bool or 1-D (one per row), got shape {}",
                py_shape(flags.shape())
            )));
        }
        Ok(flags.readonly())
    }

    /// Each of `n` rows' episode end.
    ///
    /// # Errors
    /// `ValueError` for flags that are neither one bool nor one per row.
    pub(crate) fn ends(&self, n: usize) -> PyResult<Vec<EpisodeEnd>> {
        let rows = |flags: &PyReadonlyArrayDyn<'py, bool>| -> PyResult<Vec<bool>> {
            let values = flags.as_array();
            match flags.shape() {
                [] => Ok(vec![values.iter().copied().next().unwrap_or(false); n]),
                [rows] if *rows == n => Ok(values.iter().copied().collect()),
                shape => Err(PyValueError::new_err(format!(
                    "end_episode and truncated must be one bool or one per row ({n},), got \
                     shape {}",
                    py_shape(shape)
                ))),
            }
        };
        let (ended, cut) = (rows(&self.end_episode)?, rows(&self.truncated)?);
        Ok(ended.into_iter().zip(cut).map(|(e, t)| episode_end(e, t)).collect())
    }
}
