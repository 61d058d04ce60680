//! The leaves of ragged samples as Python hands them over: the spec and hello layout of a
//! declared example, and each sample's arrays read (GIL held) into addresses and rows that
//! the core copies from with the GIL released.

use numpy::npyffi::{self, npy_intp, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::errors::to_pyerr;
use crate::ragged::wire::ragged_dims;
use crate::ragged::{LeafDecl, RaggedDecl, RaggedSpec, SampleIn};
use crate::spec::ArraySpec;
use crate::transport::wire::v2::{DType, Layout, LeafType as WireLeaf};
use crate::versions::{version_leaf, VERSION_BYTES, VERSION_LEAF_NAME};

/// A leaf's dtype and its shape after the leading dimension(s).
pub(super) struct LeafType {
    pub(super) descr: Py<PyArrayDescr>,
    pub(super) inner: Vec<usize>,
    /// The dtype's bytes per element.
    pub(super) itemsize: usize,
}

/// What `RaggedCore::submit` needs from the Python layout.
pub(super) struct SampleReader {
    pub(super) keys: Option<Vec<Py<pyo3::types::PyString>>>,
    /// `RaggedLayout.flatten`: a sample to its leaves as C-contiguous arrays.
    pub(super) flatten: Py<PyAny>,
}

/// A sample's leaves in order: a flat dict's by key when each is a C-contiguous numpy
/// array (the core checks their dtypes and shapes), anything else through the Python
/// layout's `flatten`.
pub(super) fn read_leaves<'py>(
    py: Python<'py>,
    reader: Option<&SampleReader>,
    sample: &Bound<'py, PyAny>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let Some(reader) = reader else {
        return Err(PyValueError::new_err("not set up: no sample reader (set_reader)"));
    };
    if let (Some(keys), Ok(dict)) = (&reader.keys, sample.cast_exact::<pyo3::types::PyDict>()) {
        if dict.len() == keys.len() {
            // SAFETY: `get_type_object` only reads numpy's API table, which `PY_ARRAY_API`
            // imports on first use (the GIL is held).
            let ndarray_type =
                unsafe { PY_ARRAY_API.get_type_object(py, npyffi::NpyTypes::PyArray_Type) };
            let mut leaves = Vec::with_capacity(keys.len());
            for key in keys {
                match dict.get_item(key.bind(py))? {
                    // Exactly an ndarray and C-contiguous (numpy's `PyArray_IS_C_CONTIGUOUS`);
                    // anything else (a subclass, a tensor, a scalar) goes through `flatten`.
                    Some(v)
                        if v.get_type_ptr() == ndarray_type && {
                            // SAFETY: `v` is exactly a numpy.ndarray (its type checked just
                            // before), a live `PyArrayObject`; the GIL is held.
                            let fields = unsafe { &*v.as_ptr().cast::<npyffi::PyArrayObject>() };
                            fields.flags & npyffi::NPY_ARRAY_C_CONTIGUOUS != 0
                        } =>
                    {
                        leaves.push(v);
                    }
                    _ => break,
                }
            }
            if leaves.len() == keys.len() {
                return Ok(leaves);
            }
        }
    }
    reader.flatten.bind(py).call1((sample,))?.extract()
}

/// The spec, the hello's layout and the numpy types of `leaves`; with `versions`, the spec
/// and the types end with the policy-version leaf (a `uint64` the hello does not describe:
/// workers append it when the server says it keeps versions).
pub(super) fn spec_of(
    py: Python<'_>,
    leaves: Vec<LeafArg<'_>>,
    versions: bool,
) -> PyResult<(RaggedSpec, Layout, Vec<LeafType>)> {
    let mut decls = Vec::with_capacity(leaves.len());
    let mut types = Vec::with_capacity(leaves.len());
    let mut wire = Vec::with_capacity(leaves.len());
    // Each ragged leaf's length group as the hello says it: the first leaf of the group.
    let groups: Vec<Option<(bool, &str)>> = leaves
        .iter()
        .map(|(name, _, _, ragged)| {
            ragged.as_ref().map(|(_, group)| match group {
                Some(group) => (true, group.as_str()),
                None => (false, name.as_str()),
            })
        })
        .collect();
    let firsts: Vec<usize> = groups
        .iter()
        .map(|g| g.and_then(|g| groups.iter().position(|h| *h == Some(g))).unwrap_or(0))
        .collect();
    for ((name, shape, descr, ragged), first) in leaves.into_iter().zip(firsts) {
        let array = ArraySpec::new(shape.clone(), descr.itemsize()).map_err(to_pyerr)?;
        let order = match descr.byteorder() {
            b'=' if cfg!(target_endian = "little") => b'<',
            b'=' => b'>',
            other => other,
        };
        let dtype = DType {
            order,
            kind: descr.kind(),
            size: u32::try_from(descr.itemsize()).unwrap_or(u32::MAX),
        };
        let dims = match &ragged {
            Some((max_len, _)) => ragged_dims(*max_len, first, &shape),
            None => shape.clone(),
        };
        wire.push(WireLeaf { name: name.clone(), dtype, shape: dims });
        let ragged = ragged.map(|(max_len, group)| RaggedDecl { max_len, group });
        decls.push(LeafDecl { name, array, ragged });
        let itemsize = descr.itemsize();
        types.push(LeafType { descr: descr.unbind(), inner: shape, itemsize });
    }
    if versions {
        let name = VERSION_LEAF_NAME.to_owned();
        decls.push(LeafDecl { name, array: version_leaf(), ragged: None });
        let descr = numpy::dtype::<u64>(py).unbind();
        types.push(LeafType { descr, inner: Vec::new(), itemsize: VERSION_BYTES });
    }
    Ok((RaggedSpec::new(decls).map_err(to_pyerr)?, Layout(wire), types))
}

/// Each sample's leaves as (address, bytes) and rows, read from C-contiguous arrays with
/// the GIL held (the caller keeps `samples` alive while the addresses are used).
pub(super) fn raw_samples(
    spec: &RaggedSpec,
    types: &[LeafType],
    samples: &[Vec<Bound<'_, PyAny>>],
) -> PyResult<Vec<RawSample>> {
    let py = match samples.first().and_then(|s| s.first()) {
        Some(leaf) => leaf.py(),
        None => return Ok(Vec::new()),
    };
    // SAFETY: `get_type_object` only reads numpy's API table, which `PY_ARRAY_API` imports on
    // first use (the GIL is held).
    let ndarray_type =
        unsafe { PY_ARRAY_API.get_type_object(py, npyffi::NpyTypes::PyArray_Type) } as usize;
    let mut raw = Vec::with_capacity(samples.len());
    for sample in samples {
        // `types`: the sample's own leaves (a table that keeps policy versions has one more
        // column, which the caller appends).
        if sample.len() != types.len() {
            return Err(PyValueError::new_err(format!(
                "expected {} leaves, got {}",
                types.len(),
                sample.len()
            )));
        }
        let mut leaves = Vec::with_capacity(sample.len());
        let mut rows = Vec::with_capacity(sample.len());
        for ((leaf, column), ty) in sample.iter().zip(spec.columns()).zip(types) {
            if let Some((data, bytes, n)) = exact_leaf(leaf, ty, column.is_ragged(), ndarray_type) {
                leaves.push((data, bytes));
                rows.push(n);
                continue;
            }
            let array = leaf.cast::<PyUntypedArray>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "leaf {}: expected a numpy array, got {}",
                    column.name(),
                    leaf.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
                ))
            })?;
            let descr = ty.descr.bind(py);
            if !array.dtype().is_equiv_to(descr) {
                return Err(PyTypeError::new_err(format!(
                    "leaf {}: expected dtype {}, got {}",
                    column.name(),
                    descr.str()?,
                    array.dtype().str()?
                )));
            }
            let shape = array.shape();
            let fits = if column.is_ragged() {
                shape.len() == ty.inner.len() + 1 && shape[1..] == ty.inner[..]
            } else {
                shape == &ty.inner[..]
            };
            if !fits {
                let text = |dims: &[usize]| {
                    let inner: Vec<String> = dims.iter().map(usize::to_string).collect();
                    inner.join(", ")
                };
                let want = if column.is_ragged() {
                    let rest = if ty.inner.is_empty() {
                        String::new()
                    } else {
                        format!(", {}", text(&ty.inner))
                    };
                    format!("(n{rest}) with n <= {}", column.max_rows())
                } else if ty.inner.len() == 1 {
                    format!("({},)", ty.inner[0])
                } else {
                    format!("({})", text(&ty.inner))
                };
                let got = if shape.len() == 1 {
                    format!("({},)", shape[0])
                } else {
                    format!("({})", text(shape))
                };
                return Err(PyValueError::new_err(format!(
                    "leaf {}: expected shape {want}, got {got}",
                    column.name()
                )));
            }
            if !array.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "leaf {}: the array must be C-contiguous",
                    column.name()
                )));
            }
            let bytes = array.shape().iter().product::<usize>() * array.dtype().itemsize();
            let n =
                if column.is_ragged() { array.shape().first().copied().unwrap_or(1) } else { 1 };
            // SAFETY: `array` is a live ndarray (held by `samples`); reading its `data` field
            // is what numpy's `PyArray_DATA` macro does.
            let data = unsafe { (*array.as_array_ptr()).data } as usize;
            leaves.push((data, bytes));
            rows.push(n);
        }
        raw.push((leaves, rows));
    }
    Ok(raw)
}

/// The common leaf, read from numpy's C struct without a call into numpy: exactly an
/// `ndarray`, C-contiguous, of the leaf's very dtype object (numpy's built-in dtypes are
/// singletons) and shape. Its (address, bytes, rows); `None` sends it through the checks
/// that name what is wrong.
pub(super) fn exact_leaf(
    leaf: &Bound<'_, PyAny>,
    ty: &LeafType,
    ragged: bool,
    ndarray_type: usize,
) -> Option<(usize, usize, usize)> {
    if leaf.get_type_ptr() as usize != ndarray_type {
        return None;
    }
    // SAFETY: `leaf` is exactly a numpy.ndarray (its type checked above), so it is a live
    // `PyArrayObject`, whose fields are read as numpy's own accessor macros read them; the
    // GIL is held and `leaf` keeps it alive.
    let fields = unsafe { &*leaf.as_ptr().cast::<npyffi::PyArrayObject>() };
    if fields.descr.cast::<pyo3::ffi::PyObject>() != ty.descr.as_ptr()
        || fields.flags & npyffi::NPY_ARRAY_C_CONTIGUOUS == 0
    {
        return None;
    }
    let lead = usize::from(ragged);
    let nd = usize::try_from(fields.nd).ok()?;
    if nd != lead + ty.inner.len() {
        return None;
    }
    let dims: &[npy_intp] = if nd == 0 {
        &[]
    } else {
        // SAFETY: `dimensions` holds `nd` entries (numpy's `PyArray_DIMS`).
        unsafe { std::slice::from_raw_parts(fields.dimensions, nd) }
    };
    let (mut rows, mut elements) = (1, 1usize);
    for (k, &dim) in dims.iter().enumerate() {
        let dim = usize::try_from(dim).ok()?;
        if k < lead {
            rows = dim;
        } else if dim != ty.inner[k - lead] {
            return None;
        }
        elements = elements.checked_mul(dim)?;
    }
    Some((fields.data as usize, elements.checked_mul(ty.itemsize)?, rows))
}

/// [`SampleIn`]s over [`raw_samples`]' addresses.
///
/// # Safety
/// As [`slices`], for every sample.
pub(super) unsafe fn sample_views<'a>(raw: &[RawSample]) -> Vec<SampleIn<'a>> {
    raw.iter()
        .map(|(leaves, rows)| SampleIn {
            // SAFETY: the caller's contract.
            leaves: unsafe { slices(leaves) },
            rows: rows.clone(),
        })
        .collect()
}

/// Byte slices over [`raw_samples`]' addresses.
///
/// # Safety
/// The arrays the addresses came from must be alive and unwritten for `'a`.
pub(super) unsafe fn slices<'a>(leaves: &[(usize, usize)]) -> Vec<&'a [u8]> {
    leaves
        .iter()
        .map(|&(addr, len)| {
            if len == 0 {
                return &[][..];
            }
            // SAFETY: by the caller's contract, `len` bytes at `addr` live and stay unwritten.
            unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
        })
        .collect()
}

/// Entries of fewer bytes are first tried with the GIL held.
pub(super) const DETACH_INSERT_BYTES: usize = 64 * 1024;

/// A sample's leaves as (address, bytes), and its rows per leaf.
pub(super) type RawSample = (Vec<(usize, usize)>, Vec<usize>);

/// One leaf as Python declares it: (name, shape (inner for ragged), dtype, ragged).
pub(super) type LeafArg<'py> =
    (String, Vec<usize>, Bound<'py, PyArrayDescr>, Option<(usize, Option<String>)>);
