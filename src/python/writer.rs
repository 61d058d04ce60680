//! `echo._echo.SampleWriter`: `Server.writer()`, a writer cached for the server's fixed
//! layout that takes one sample's leaves positionally, in the example's flattened order. It
//! skips what `submit` pays for a pytree (the Python method's frame, keyword parsing, the
//! walk of the tree) and keeps every check memory safety depends on (each leaf's type,
//! dtype, shape and contiguity).

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::server::PyServerCore;

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
