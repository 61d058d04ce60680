//! Checkpoints from Python: the example and the `extra` tree's arrays converted for the core
//! (`crate::checkpoint` writes and reads every file, the manifest included), an opened
//! checkpoint's settings handed back as the `echo.replay` and `echo.compression` objects a
//! `Server` takes, and the leftovers of a replaced checkpoint removed.

use std::path::PathBuf;

use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;

use super::config::{codec_object, strategy_class};
use super::detach;
use super::errors::to_pyerr;
use crate::checkpoint::directory::clean_leftovers;
use crate::checkpoint::manifest::Strategy;
use crate::checkpoint::{Example, ExampleLeaf, Kind, OpenedCheckpoint, Verify};

/// `numpy.lib.format.dtype_to_descr`.
fn dtype_to_descr<'py>(dtype: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    static FUNCTION: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let py = dtype.py();
    let f = FUNCTION.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("numpy.lib.format")?.getattr("dtype_to_descr")?.unbind())
    })?;
    f.bind(py).call1((dtype,))
}

/// A JSON value of `obj` (None, bool, int, float, str, and lists or tuples of these).
fn to_json(obj: &Bound<'_, PyAny>) -> Option<Value> {
    if obj.is_none() {
        return Some(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Some(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj
            .extract::<i64>()
            .map(Value::from)
            .or_else(|_| obj.extract::<u64>().map(Value::from))
            .ok();
    }
    if obj.is_instance_of::<PyFloat>() {
        return obj
            .extract::<f64>()
            .ok()
            .and_then(|f| serde_json::Number::from_f64(f).map(Value::Number));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return s.to_str().ok().map(|s| Value::String(s.to_owned()));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items: Option<Vec<Value>> =
            obj.try_iter().ok()?.map(|item| item.ok().and_then(|i| to_json(&i))).collect();
        return items.map(Value::Array);
    }
    None
}

/// The Python value of a JSON value (arrays as lists).
fn to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_pyobject(py)?.into_any(),
            (_, Some(u)) => u.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            PyList::new(py, items.iter().map(|v| to_py(py, v)).collect::<PyResult<Vec<_>>>()?)?
                .into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, to_py(py, v)?)?;
            }
            dict.into_any()
        }
    })
}

/// A dtype descr back from JSON, as numpy takes it: a structured dtype is a list of tuples
/// `(name, descr[, shape])`, its shapes tuples.
fn descr_to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    let Value::Array(fields) = value else { return to_py(py, value) };
    let mut out = Vec::with_capacity(fields.len());
    for field in fields {
        let Value::Array(parts) = field else {
            out.push(to_py(py, field)?);
            continue;
        };
        let parts = parts
            .iter()
            .enumerate()
            .map(|(i, part)| match (i, part) {
                (1, Value::Array(_)) => descr_to_py(py, part),
                (2, Value::Array(dims)) => Ok(PyTuple::new(
                    py,
                    dims.iter().map(|d| to_py(py, d)).collect::<PyResult<Vec<_>>>()?,
                )?
                .into_any()),
                _ => to_py(py, part),
            })
            .collect::<PyResult<Vec<_>>>()?;
        out.push(PyTuple::new(py, parts)?.into_any());
    }
    Ok(PyList::new(py, out)?.into_any())
}

/// The example's layout (an `echo._pytree.TreeLayout`) as a checkpoint records it.
///
/// # Errors
/// `TypeError` for a leaf path whose keys a manifest cannot hold (JSON values only).
pub(crate) fn example_of(layout: &Bound<'_, PyAny>) -> PyResult<Example> {
    let treespec = layout.getattr("treespec")?.str()?.to_string();
    let paths = layout.getattr("paths")?;
    let mut leaves = Vec::new();
    for (leaf, path) in layout.getattr("leaves")?.try_iter()?.zip(paths.try_iter()?) {
        let (leaf, path) = (leaf?, path?);
        let name: String = leaf.getattr("name")?.extract()?;
        let descr = dtype_to_descr(&leaf.getattr("dtype")?)?;
        let path = path
            .try_iter()?
            .map(|key| {
                let key = key?;
                to_json(&key).ok_or_else(|| {
                    PyTypeError::new_err(format!(
                        "checkpoint(): leaf {name}: its path key {} ({}) cannot be recorded in \
                         the manifest (str, int, float, bool or None keys only)",
                        key.repr().map_or_else(|_| "?".into(), |r| r.to_string()),
                        key.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
                    ))
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        leaves.push(ExampleLeaf {
            dtype: to_json(&descr).ok_or_else(|| {
                PyTypeError::new_err(format!("checkpoint(): leaf {name}: its dtype has no descr"))
            })?,
            npy_descr: descr.repr()?.to_string(),
            shape: leaf.getattr("shape")?.extract()?,
            path,
            name,
        });
    }
    Ok(Example { treespec, leaves })
}

/// The version leaf of a server that keeps policy versions, as a checkpoint records it after
/// the example's leaves (its path is no key of the pytree: it is not one of its leaves).
pub(crate) fn version_example_leaf() -> ExampleLeaf {
    ExampleLeaf {
        name: crate::versions::VERSION_LEAF_NAME.to_owned(),
        path: vec![Value::from(crate::versions::VERSION_LEAF_NAME)],
        dtype: Value::from("<u8"),
        npy_descr: "'<u8'".to_owned(),
        shape: Vec::new(),
    }
}

/// Each leaf's dtype as a `.npy` header spells it.
pub(crate) fn npy_descrs(
    py: Python<'_>,
    descrs: &[Py<numpy::PyArrayDescr>],
) -> PyResult<Vec<String>> {
    descrs.iter().map(|d| Ok(dtype_to_descr(d.bind(py).as_any())?.repr()?.to_string())).collect()
}

/// The `extra` tree's arrays as `(descr literal, shape, bytes)` each.
pub(crate) type ExtraArrays<'py> = Vec<(String, Vec<usize>, PyReadonlyArray1<'py, u8>)>;

/// A leaf of an example of nested dicts: `(keys, shape, dtype descr)`.
type DictLeaf<'py> = (Vec<String>, Bound<'py, PyTuple>, Bound<'py, PyAny>);

/// A checkpoint, opened and checked (`echo._echo.open_checkpoint`).
#[pyclass(frozen, module = "echo._echo", name = "OpenedCheckpoint")]
pub(crate) struct PyOpenedCheckpoint {
    pub(crate) inner: OpenedCheckpoint,
}

/// A strategy dataclass (`echo.replay.<class>(**fields)`).
fn strategy_object<'py>(py: Python<'py>, strategy: &Strategy) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(py);
    if let Value::Object(fields) = serde_json::to_value(strategy).unwrap_or_default() {
        for (key, value) in fields.iter().filter(|(k, _)| *k != "type") {
            let value = to_py(py, value)?;
            let value = if key == "error_buffer" {
                PyTuple::new(py, value.try_iter()?.collect::<PyResult<Vec<_>>>()?)?.into_any()
            } else {
                value
            };
            kwargs.set_item(key, value)?;
        }
    }
    strategy_class(py, strategy.class())?.call((), Some(&kwargs))
}

#[pymethods]
impl PyOpenedCheckpoint {
    /// `replay`, `fifo` or `sequence`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.manifest().format.name()
    }

    /// `a replay table`, `a FIFO ring` or `a sequence table`.
    #[getter]
    fn kind_description(&self) -> &'static str {
        self.inner.manifest().format.describe()
    }

    /// The checkpoint's directory, its link resolved.
    #[getter]
    fn root(&self) -> PathBuf {
        self.inner.root().to_path_buf()
    }

    /// The extra's tree file, `None` without one.
    #[getter]
    fn extra(&self) -> Option<String> {
        self.inner.manifest().extra.clone()
    }

    /// Whether the manifest lists `name` (with a checksum).
    fn lists(&self, name: &str) -> bool {
        self.inner.manifest().files.contains_key(name)
    }

    /// For an example of nested dicts: each leaf's `(keys, shape, dtype descr)`.
    /// `CheckpointError` if a leaf is elsewhere (then `example=` is needed).
    fn dict_leaves<'py>(&self, py: Python<'py>) -> PyResult<Vec<DictLeaf<'py>>> {
        let mut paths = self.inner.dict_paths().map_err(to_pyerr)?;
        if self.policy_versions() {
            paths.pop();
        }
        paths
            .into_iter()
            .zip(&self.inner.manifest().layout.leaves)
            .map(|(keys, leaf)| {
                Ok((
                    keys.into_iter().map(str::to_owned).collect(),
                    PyTuple::new(py, &leaf.shape)?,
                    descr_to_py(py, &leaf.dtype)?,
                ))
            })
            .collect()
    }

    /// Checks `layout` (the example's `TreeLayout`) against the checkpoint's:
    /// `CheckpointError` saying what differs.
    /// The checkpoint's version leaf (of a server whose samples carry policy versions) is
    /// not the example's: it is checked after the example's leaves.
    fn check_example(&self, layout: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut example = example_of(layout)?;
        if self.policy_versions() {
            example.leaves.push(version_example_leaf());
        }
        self.inner.check_example(&example).map_err(to_pyerr)
    }

    /// Whether the checkpoint's server kept each sample's policy version (its layout ends
    /// with the version leaf).
    #[getter]
    fn policy_versions(&self) -> bool {
        let version = version_example_leaf();
        self.inner
            .manifest()
            .layout
            .leaves
            .last()
            .is_some_and(|leaf| leaf.name == version.name && leaf.path == version.path)
    }

    /// The settings that are part of the data, as `Server` keyword arguments.
    fn server_kwargs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner.manifest().settings;
        let kwargs = PyDict::new(py);
        kwargs.set_item("batch_size", s.batch_size)?;
        if self.inner.manifest().format == Kind::Fifo {
            kwargs.set_item("num_buffers", s.num_buffers)?;
            return Ok(kwargs);
        }
        kwargs.set_item("max_size", s.max_size)?;
        for (name, strategy) in
            [("sampler", &s.sampler), ("remover", &s.remover), ("rate_limiter", &s.rate_limiter)]
        {
            if let Some(strategy) = strategy {
                kwargs.set_item(name, strategy_object(py, strategy)?)?;
            }
        }
        kwargs.set_item("max_times_sampled", s.max_times_sampled)?;
        if let Some(sequence) = &s.sequence {
            kwargs.set_item("sequence", strategy_object(py, sequence)?)?;
        }
        Ok(kwargs)
    }

    /// The settings that only tune, as recorded: `num_drainers`, `producer_queue_size`
    /// (`None`: the automatic size), `compress` (a codec object or `None` per leaf),
    /// `max_bytes`, `name`; each only if the checkpoint recorded it.
    fn tuning<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &self.inner.manifest().tuning;
        let out = PyDict::new(py);
        if let Some(n) = t.num_drainers {
            out.set_item("num_drainers", n)?;
        }
        if let Some(size) = t.producer_queue_size {
            out.set_item("producer_queue_size", size)?;
        }
        if let Some(codecs) = &t.compress {
            let codecs = codecs
                .iter()
                .map(|c| c.map_or_else(|| Ok(py.None()), |c| codec_object(py, c.0)))
                .collect::<PyResult<Vec<_>>>()?;
            out.set_item("compress", codecs)?;
        }
        if let Some(max_bytes) = t.max_bytes {
            out.set_item("max_bytes", max_bytes)?;
        }
        if let Some(name) = &t.name {
            out.set_item("name", name)?;
        }
        if let Some(k) = t.max_staleness {
            out.set_item("max_staleness", k)?;
        }
        if let Some(admission) = &t.admission {
            out.set_item("admission", admission)?;
        }
        Ok(out)
    }
}

/// Opens the checkpoint at `path`: its manifest read and checked, and every file it lists
/// (only the extra's with `extra_only`) checked against its size and SHA-256 and mapped, with
/// the GIL released. `CheckpointError` naming the file otherwise.
#[pyfunction]
#[pyo3(signature = (path, extra_only=false))]
pub(crate) fn open_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    extra_only: bool,
) -> PyResult<PyOpenedCheckpoint> {
    let verify = if extra_only { Verify::ExtraOnly } else { Verify::All };
    let inner = detach(py, || OpenedCheckpoint::open(&path, verify)).map_err(to_pyerr)?;
    Ok(PyOpenedCheckpoint { inner })
}

/// Removes the data directories of checkpoint `name` in `parent` other than `keep`, and its
/// stray links (what killed or replaced checkpoints leave).
#[pyfunction]
#[pyo3(signature = (parent, name, keep=None))]
pub(crate) fn clean_checkpoint_leftovers(parent: PathBuf, name: &str, keep: Option<&str>) {
    clean_leftovers(&parent, name, keep);
}
