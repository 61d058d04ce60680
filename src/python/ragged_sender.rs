//! `echo._echo.RaggedSender`: the binding of a ragged worker's [`RaggedSender`] (what
//! `echo.TcpClient` runs on when its example has ragged leaves). Samples are read and
//! checked as `RaggedCore.submit` reads them; sends and waits release the GIL.

use std::time::Duration;

use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;

use super::client::PyResolver;
use super::deadline_from_timeout;
use super::errors::{error_in, to_pyerr, Call};
use super::ragged_leaves::{
    raw_samples, read_leaves, slices, spec_of, LeafArg, LeafType, SampleReader,
};
use crate::error::EchoError;
use crate::ragged::client::{RaggedSender, SenderOptions};
use crate::ragged::wire::Outgoing;
use crate::sync::Arc;
use crate::transport::client::Resolver;
use crate::transport::wire::v2::Closing;

/// A worker's connection to a ragged server (`echo.TcpClient` with a ragged example).
#[pyclass(frozen, module = "echo._echo", name = "RaggedSender")]
pub(crate) struct PyRaggedSender {
    sender: RaggedSender,
    leaves: Vec<LeafType>,
    reader: std::sync::OnceLock<SampleReader>,
    /// What the resolver raised, if it did: the call that was connecting raises it.
    raised: Arc<parking_lot::Mutex<Option<PyErr>>>,
}

impl PyRaggedSender {
    /// `err` as its exception: what the resolver raised, if that was it.
    fn error(&self, err: EchoError) -> PyErr {
        if let Some(raised) = self.raised.lock().take() {
            return raised;
        }
        match (&err, self.sender.take_held_back()) {
            (EchoError::TimedOut, Some((ours, latest, bound))) => PyTimeoutError::new_err(format!(
                "send(): timed out waiting for newer weights: this worker acts with version \
                 {ours} and the learner is at {latest}, more than max_staleness={bound} behind \
                 (admission='block'); set policy_version once it acts with newer ones"
            )),
            (EchoError::TimedOut, None) => PyTimeoutError::new_err(
                "timed out waiting for the learner's acknowledgements (its table is full and \
                 it has not taken a batch, or other workers' frames fill its ingress)",
            ),
            _ => to_pyerr(err),
        }
    }

    /// `err` of a parameter fetch as its exception (a timeout says what was waited for, as
    /// a fixed-shape worker's `params()` does).
    fn params_error(&self, err: EchoError) -> PyErr {
        match err {
            EchoError::TimedOut => error_in(Call::Params, err),
            other => self.error(other),
        }
    }
}

#[pymethods]
impl PyRaggedSender {
    #[new]
    #[pyo3(signature = (
        host, port, leaves, token=None, connect_timeout=10.0, max_inflight=256,
        shared_memory=None, reconnect_timeout=None, resolver=None, dial_timeout=None,
        durable_bytes=None, wire_compression=true, heartbeat_timeout=None,
    ))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        py: Python<'_>,
        host: &str,
        port: u16,
        leaves: Vec<LeafArg<'_>>,
        token: Option<Vec<u8>>,
        connect_timeout: f64,
        max_inflight: usize,
        shared_memory: Option<bool>,
        reconnect_timeout: Option<f64>,
        resolver: Option<Py<PyAny>>,
        dial_timeout: Option<f64>,
        durable_bytes: Option<usize>,
        wire_compression: bool,
        heartbeat_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let (spec, layout, types) = spec_of(py, leaves, false)?;
        if durable_bytes.is_some() && reconnect_timeout.is_none() {
            return Err(PyValueError::new_err(
                "a durable sender reconnects: give reconnect_timeout",
            ));
        }
        let seconds = |name: &str, t: Option<f64>| match t {
            Some(t) if !t.is_finite() || t <= 0.0 => Err(PyValueError::new_err(format!(
                "{name} must be a positive number of seconds, got {t}"
            ))),
            Some(t) => Ok(Some(Duration::from_secs_f64(t.min(1e6)))),
            None => Ok(None),
        };
        let reconnect = seconds("reconnect_timeout", reconnect_timeout)?;
        let dial = seconds("dial_timeout", dial_timeout)?;
        let heartbeat = seconds("heartbeat_timeout", heartbeat_timeout)?;
        let raised = Arc::new(parking_lot::Mutex::new(None));
        let resolver = resolver.map(|callable| {
            Resolver(std::sync::Arc::new(PyResolver::new(callable, Arc::clone(&raised))))
        });
        if !connect_timeout.is_finite() || connect_timeout <= 0.0 {
            return Err(PyValueError::new_err(format!(
                "connect_timeout must be a positive number of seconds, got {connect_timeout}"
            )));
        }
        let timeout = Duration::from_secs_f64(connect_timeout.min(1e6));
        let options = SenderOptions {
            token,
            timeout,
            max_inflight,
            shared_memory,
            reconnect,
            resolver,
            dial,
            durable: durable_bytes,
            wire_compression,
            heartbeat,
        };
        let sender = py
            .detach(|| RaggedSender::connect(host, port, spec, layout, options))
            .map_err(|err| raised.lock().take().unwrap_or_else(|| to_pyerr(err)))?;
        Ok(Self { sender, leaves: types, reader: std::sync::OnceLock::new(), raised })
    }

    /// Sets how `send` reads samples (see `RaggedCore.set_reader`).
    fn set_reader(&self, keys: Option<Vec<Py<pyo3::types::PyString>>>, flatten: Py<PyAny>) {
        let _ = self.reader.set(SampleReader { keys, flatten });
    }

    /// Sends one sample (a flat dict read by key, natively; anything else flattened).
    #[pyo3(signature = (sample, priority=None, timeout=None, version=None))]
    fn send(
        &self,
        py: Python<'_>,
        sample: &Bound<'_, PyAny>,
        priority: Option<f64>,
        timeout: Option<f64>,
        version: Option<u64>,
    ) -> PyResult<()> {
        let leaves = read_leaves(py, self.reader.get(), sample)?;
        self.send_group(py, vec![leaves], priority, timeout, version)
    }

    /// Sends `samples` (each a list of C-contiguous arrays in leaf order) as one group.
    #[pyo3(signature = (samples, priority=None, timeout=None, version=None))]
    fn send_group(
        &self,
        py: Python<'_>,
        samples: Vec<Vec<Bound<'_, PyAny>>>,
        priority: Option<f64>,
        timeout: Option<f64>,
        version: Option<u64>,
    ) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let raw = raw_samples(self.sender.spec(), &self.leaves, &samples)?;
        let sender = &self.sender;
        py.detach(|| {
            let leaves: Vec<Vec<&[u8]>> =
                // SAFETY: `samples` keeps the arrays alive until this call returns, and the
                // caller hands them to us unwritten.
                raw.iter().map(|(leaves, _)| unsafe { slices(leaves) }).collect();
            let out: Vec<Outgoing<'_>> = raw
                .iter()
                .zip(&leaves)
                .map(|((_, rows), leaves)| Outgoing { rows, leaves })
                .collect();
            sender.send_group(&out, priority, version, deadline)
        })
        .map_err(|err| self.error(err))
    }

    /// Waits until every sample sent is in a checkpoint the server completed (durable).
    #[pyo3(signature = (timeout=None))]
    fn wait_persisted(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        py.detach(|| sender.wait_persisted(deadline)).map_err(|err| match err {
            EchoError::TimedOut => error_in(Call::Persisted, err),
            other => self.error(other),
        })
    }

    /// Samples in a checkpoint the server completed, as its latest notice said (durable).
    #[getter]
    fn persisted(&self) -> u64 {
        self.sender.persisted()
    }

    /// Fetches a whole version of the learner's parameters (`size` bytes), at least
    /// `min_version`, waiting (GIL released) until `timeout`: `(version, uint8 array)`.
    #[pyo3(signature = (size, min_version=0, timeout=None))]
    fn fetch_params<'py>(
        &self,
        py: Python<'py>,
        size: usize,
        min_version: u64,
        timeout: Option<f64>,
    ) -> PyResult<(u64, Bound<'py, numpy::PyArray1<u8>>)> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        let mut out = vec![0u8; size];
        let buffer = &mut out;
        let version = py
            .detach(|| sender.fetch_params(buffer, min_version, deadline))
            .map_err(|err| self.params_error(err))?;
        Ok((version, numpy::PyArray1::from_vec(py, out)))
    }

    /// The description of the learner's parameters (empty when it gave none), waiting
    /// (GIL released) until something is published or `timeout`.
    #[pyo3(signature = (timeout=None))]
    fn fetch_params_description<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        let bytes = py
            .detach(|| sender.fetch_description(deadline))
            .map_err(|err| self.params_error(err))?;
        Ok(pyo3::types::PyBytes::new(py, &bytes))
    }

    /// `(fetches, seconds)`: whole versions fetched, and the time they took in all.
    #[getter]
    fn params_fetches(&self) -> (u64, f64) {
        self.sender.params_fetches()
    }

    /// The latest version of the learner's parameters it announced (0: none yet).
    #[getter]
    fn params_version(&self) -> u64 {
        self.sender.params_version()
    }

    /// Sends that waited for newer weights (`admission="block"`), and the seconds they
    /// waited in all.
    #[getter]
    fn admission_waits(&self) -> (u64, f64) {
        self.sender.admission_waits()
    }

    /// The codec of each leaf this connection compresses (`None`: raw), or `None` when
    /// every leaf goes raw.
    #[getter]
    fn wire_codecs(&self, py: Python<'_>) -> PyResult<Option<Vec<Option<Py<PyAny>>>>> {
        let codecs = self.sender.wire_codecs();
        if codecs.is_empty() {
            return Ok(None);
        }
        codecs
            .into_iter()
            .map(|c| c.map(|c| super::config::codec_object(py, c)).transpose())
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }

    /// Durable sends that waited for room, and the seconds they waited in all.
    #[getter]
    fn durable_waits(&self) -> (u64, f64) {
        self.sender.durable_waits()
    }

    /// Whether the server keeps policy versions (every sample carries one).
    #[getter]
    fn keeps_versions(&self) -> bool {
        self.sender.keeps_versions()
    }

    /// The version a sample carries when its send names none.
    #[getter]
    fn get_policy_version(&self) -> u64 {
        self.sender.policy_version()
    }

    #[setter]
    fn set_policy_version(&self, version: u64) {
        self.sender.set_policy_version(version);
    }

    /// Waits until every sample sent is stored by the server.
    #[pyo3(signature = (timeout=None))]
    fn flush(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        py.detach(|| sender.flush(deadline)).map_err(|err| self.error(err))
    }

    /// Says goodbye and closes the connection.
    fn close(&self, py: Python<'_>) {
        let sender = &self.sender;
        py.detach(|| sender.close());
    }

    /// (sent, acknowledged) samples.
    /// Which path frames take: `"shm"` (a same-host shared-memory pipe) or `"tcp"`.
    #[getter]
    fn path(&self) -> &'static str {
        if self.sender.uses_shared_memory() {
            "shm"
        } else {
            "tcp"
        }
    }

    /// (reconnections, samples resent after one).
    #[getter]
    fn recoveries(&self) -> (u64, u64) {
        self.sender.recoveries()
    }

    #[getter]
    fn counts(&self) -> (u64, u64) {
        self.sender.counts()
    }

    /// What the server said the last time it closed a connection: `"final"`,
    /// `"restarting"`, or None.
    #[getter]
    fn server_closing(&self) -> Option<&'static str> {
        self.sender.server_closing().map(|why| match why {
            Closing::Final => "final",
            Closing::Restarting => "restarting",
        })
    }

    /// Where the latest reconnection resumed (the samples the server already had), or None.
    #[getter]
    fn resumed_from(&self) -> Option<u64> {
        self.sender.resumed_from()
    }

    /// Bytes of frames kept to resend.
    #[getter]
    fn retained_bytes(&self) -> usize {
        self.sender.retained_bytes()
    }
}
