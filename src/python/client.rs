//! `echo._echo.TcpSender`: the native half of `echo.TcpClient`. Connects, checks the server's
//! handshake against the example, and sends each sample straight from its numpy buffers with
//! one vectored write; every wait releases the GIL and honours Ctrl-C.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use super::config::{codec_object, resolve_token, seconds};
use super::errors::{error_in, to_pyerr, Call};
use super::leaves::{byte_slices, episode_end, EpisodeFlags, Leaf, LeafSpecs};
use super::{
    already_passed, deadline_after, deadline_from_timeout, detach, reattach, wait_detached,
};
use crate::error::EchoError;
use crate::source::Rows;
use crate::transport::client::{
    ClientConfig, Protocol, Resolve, Resolver, SharedMemory, TcpSender,
};
use crate::transport::wire::v2::{Closing, FrameMeta};

/// Samples at or above this many bytes are written with the GIL released.
const DETACH_WRITE_BYTES: usize = 64 * 1024;

/// A connection to an echo server that sends samples given as flattened leaves.
#[pyclass(frozen, module = "echo._echo", name = "TcpSender")]
pub(crate) struct PyTcpSender {
    leaves: LeafSpecs,
    sender: Mutex<TcpSender>,
    /// What the resolver raised, if it did: the call that was connecting raises it.
    raised: Arc<Mutex<Option<PyErr>>>,
}

/// A Python callable as the client's [`Resolve`]: `resolver(last)` with `last` `None` or
/// `(host, port, why the previous attempt ended)`, returning `(host, port)` or `None` (no
/// server yet). Called with the GIL re-taken before each connection attempt.
pub(crate) struct PyResolver {
    callable: Py<PyAny>,
    raised: Arc<Mutex<Option<PyErr>>>,
}

impl PyResolver {
    /// `callable` as a resolver that keeps what it raises in `raised`.
    pub(crate) fn new(callable: Py<PyAny>, raised: Arc<Mutex<Option<PyErr>>>) -> Self {
        Self { callable, raised }
    }
}

impl Resolve for PyResolver {
    fn resolve(&self, last: Option<(&str, u16, &str)>) -> Result<Option<(String, u16)>, EchoError> {
        reattach(|py| {
            let answer = self
                .callable
                .call1(py, (last,))
                .and_then(|out| out.extract::<Option<(String, u16)>>(py));
            answer.map_err(|err| {
                let message = format!("the address resolver raised {err}");
                *self.raised.lock() = Some(err);
                EchoError::Disconnected(message)
            })
        })
    }
}

/// `echo.client._ClientSettings`: a `TcpClient`'s settings, whose types Python has checked.
#[derive(FromPyObject)]
struct ClientSettings {
    max_inflight: u64,
    connect_timeout: f64,
    protocol: ProtocolArg,
    token: Option<String>,
    /// `None` without reconnection.
    reconnect_timeout: Option<f64>,
    heartbeat_timeout: Option<f64>,
    /// `None`: shared memory where it can be used (`SharedMemory::Auto`).
    shared_memory: Option<bool>,
    /// What bounds the first connection when it is retried; `None`: `connect_timeout`.
    dial_timeout: Option<f64>,
    name: Option<String>,
    wire_compression: bool,
    /// Durable acknowledgements' byte budget; `None`: plain acknowledgements.
    durable_bytes: Option<usize>,
}

impl ClientSettings {
    /// Checks the settings and writes them into `config`; returns `connect_timeout`.
    ///
    /// # Errors
    /// `ValueError` for a value out of range, or reconnection over protocol 1.
    fn apply(&self, config: &mut ClientConfig) -> PyResult<f64> {
        if self.max_inflight == 0 {
            return Err(PyValueError::new_err("max_inflight_msgs must be >= 1, got 0"));
        }
        let connect_timeout = self.connect_timeout;
        if connect_timeout.is_nan() || connect_timeout <= 0.0 {
            return Err(PyValueError::new_err(format!(
                "connect_timeout must be a positive number of seconds, got {connect_timeout}"
            )));
        }
        if self.reconnect_timeout.is_some() && self.protocol.0 == Protocol::V1 {
            return Err(PyValueError::new_err(
                "reconnect=True needs protocol 2 (v1 has no sequence numbers)",
            ));
        }
        config.max_inflight = self.max_inflight;
        config.protocol = self.protocol.0;
        // With a token "auto" still settles for v1 at a v1-only server, which then fails
        // with the token problem it is (PermissionError), not a protocol one.
        config.token = resolve_token(self.token.as_deref())?;
        config.heartbeat_timeout = seconds("heartbeat_timeout", self.heartbeat_timeout)?;
        config.reconnect_timeout = seconds("reconnect_timeout", self.reconnect_timeout)?;
        config.shared_memory = match self.shared_memory {
            None => SharedMemory::Auto,
            Some(false) => SharedMemory::Off,
            Some(true) => SharedMemory::Required,
        };
        config.name.clone_from(&self.name);
        config.wire_compression = self.wire_compression;
        config.durable = self.durable_bytes;
        Ok(connect_timeout)
    }
}

/// `TcpClient(protocol=)`: `"auto"`, `1` or `2`, read as the user gave it.
struct ProtocolArg(Protocol);

impl FromPyObject<'_, '_> for ProtocolArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let protocol = if obj.is_instance_of::<PyString>() {
            (obj.extract::<&str>()? == "auto").then_some(Protocol::Auto)
        } else if obj.is_instance_of::<PyBool>() {
            None
        } else {
            match obj.extract::<i64>() {
                Ok(1) => Some(Protocol::V1),
                Ok(2) => Some(Protocol::V2),
                _ => None,
            }
        };
        protocol.map(Self).ok_or_else(|| {
            let given = obj.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string());
            PyValueError::new_err(format!("protocol must be \"auto\", 1 or 2, got {given}"))
        })
    }
}

#[pymethods]
impl PyTcpSender {
    /// Connects to `host:port`, negotiates the wire protocol and checks that the server stores
    /// samples shaped like ours (`layout`, the example's `TreeLayout`), as `settings` say.
    /// `resolver(last)` names the address before each connection attempt (`echo.ray`).
    #[new]
    #[pyo3(signature = (host, port, layout, settings, resolver=None))]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        layout: &Bound<'_, PyAny>,
        settings: ClientSettings,
        resolver: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let leaves = LeafSpecs::new(layout)?;
        let mut config = ClientConfig::new(host, port, leaves.typed_layout(py));
        let connect_timeout = settings.apply(&mut config)?;
        let dial_timeout = settings.dial_timeout.unwrap_or(connect_timeout);
        let raised = Arc::new(Mutex::new(None));
        config.resolver = resolver.map(|callable| {
            Resolver(Arc::new(PyResolver { callable, raised: Arc::clone(&raised) }))
        });
        // One deadline for the whole connect and handshake, retries included (too large for a
        // `Duration`: none).
        let deadline = deadline_after("connect_timeout", Some(dial_timeout))?;
        let each = Duration::try_from_secs_f64(connect_timeout).ok();
        let mut dialing = TcpSender::connecting(config, deadline, each).map_err(to_pyerr)?;
        // Polled in slices with the GIL released, so Ctrl-C interrupts a slow connect.
        let sender = wait_detached(py, None, |slice_end| dialing.poll(slice_end).transpose())?
            .expect("waits without a deadline until the connect succeeds or fails")
            .map_err(|e| raised.lock().take().unwrap_or_else(|| to_pyerr(e)))?;
        Ok(Self { leaves, sender: Mutex::new(sender), raised })
    }

    /// Sends one sample (a pytree like the example), with `priority` (v2 replay servers);
    /// `end_episode` or `truncated` ends its episode (a sequence table). Blocks
    /// while `max_inflight` samples are unacknowledged (or while reconnecting); raises
    /// `TimeoutError` if `timeout` passes first (nothing sent).
    /// `version`: the policy version the sample carries when the server keeps them
    /// (`None`: the client's `policy_version`).
    #[pyo3(signature = (sample, timeout=None, priority=None, end_episode=false, truncated=false,
        version=None))]
    #[allow(clippy::too_many_arguments)] // the Python keywords, one each
    fn send(
        &self,
        py: Python<'_>,
        sample: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        priority: Option<f64>,
        end_episode: bool,
        truncated: bool,
        version: Option<u64>,
    ) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let end = episode_end(end_episode, truncated);
        let arrays = self.leaves.arrays(sample)?;
        self.send_arrays(py, &arrays, FrameMeta { priority, row: 0, end }, deadline, version)
    }

    /// The version samples carry when a send names none: the newest `fetch_params` got, or
    /// what was set (0 at first).
    #[getter]
    fn policy_version(&self, py: Python<'_>) -> u64 {
        self.read(py, TcpSender::policy_version)
    }

    #[setter]
    fn set_policy_version(&self, py: Python<'_>, version: u64) {
        let sender = &self.sender;
        detach(py, || sender.lock().set_policy_version(version));
    }

    /// `Some(admit)` when the server keeps policy versions (`u64::MAX`: no blocking
    /// admission), `None` otherwise.
    #[getter]
    fn policy_versions(&self, py: Python<'_>) -> Option<u64> {
        self.read(py, TcpSender::policy_versions)
    }

    /// `(fetches, seconds)`: whole versions fetched, and the time they took in all.
    #[getter]
    fn params_fetches(&self, py: Python<'_>) -> (u64, f64) {
        self.read(py, TcpSender::params_fetches)
    }

    /// `(sends, seconds)` that waited for newer parameters (blocking admission).
    #[getter]
    fn admission_waits(&self, py: Python<'_>) -> (u64, f64) {
        self.read(py, TcpSender::admission_waits)
    }

    /// `Some(max_rows)` when the server is a sequence table (rows are streams of this client).
    #[getter]
    fn takes_steps(&self, py: Python<'_>) -> Option<u32> {
        self.read(py, TcpSender::takes_steps)
    }

    /// Sends a batch of samples, one per row of every leaf (all with the same leading
    /// dimension `n`), in order, as if sent one by one: checked together, and written with
    /// one vectored write per window-full of frames. `priority`: one number for every row or
    /// one per row (v2 replay servers). Returns `n`.
    /// To a sequence table row `i` is a step of this client's stream `i`, ending its episode
    /// as `end_episode` and `truncated` say (each a bool for every row or one per row;
    /// `None`: false).
    #[pyo3(signature = (tree, timeout=None, priority=None, end_episode=None, truncated=None,
        version=None))]
    #[allow(clippy::too_many_arguments)] // the Python keywords, one each
    fn send_batch(
        &self,
        py: Python<'_>,
        tree: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        priority: Option<&Bound<'_, PyAny>>,
        end_episode: Option<&Bound<'_, PyAny>>,
        truncated: Option<&Bound<'_, PyAny>>,
        version: Option<u64>,
    ) -> PyResult<usize> {
        let mut deadline = deadline_from_timeout(timeout)?;
        let flags = EpisodeFlags::new(py, end_episode, truncated)?;
        let batch = self.leaves.batch(tree, priority)?;
        let n = batch.n;
        let ends = flags.map(|flags| flags.ends(n)).transpose()?;
        if n == 0 {
            return Ok(0);
        }
        let slices = batch.slices(&self.leaves);
        let rows = Rows::new(&self.leaves.spec, &slices, n, batch.priorities())
            .and_then(|rows| rows.with_steps(0, ends.as_deref()))
            .map_err(to_pyerr)?;
        let sender = &self.sender;
        let mut done = 0usize;
        loop {
            let outcome = wait_detached(py, deadline, |slice_end| {
                let mut sender = sender.try_lock_until(slice_end)?;
                match sender.send_rows_as(&rows, &mut done, Some(slice_end), version) {
                    Err(EchoError::TimedOut | EchoError::Stalled) => None,
                    other => Some(other),
                }
            });
            match outcome {
                Ok(Some(result)) => {
                    return result.map(|()| n).map_err(|e| self.error(Call::Send, e))
                }
                // The timeout only bounds waiting for window room: a row whose first bytes
                // are on the wire is finished (or the stream would be misaligned).
                Ok(None) if sender.lock().in_progress() > 0 => deadline = None,
                Ok(None) if done == 0 => return Err(send_timed_out(&sender.lock())),
                Ok(None) => {
                    return Err(PyTimeoutError::new_err(format!(
                        "send_batch(): timed out after sending {done} of the {n} rows (the \
                         first {done}, in order); send the rest again"
                    )))
                }
                Err(interrupted) => {
                    let mut sender = sender.lock();
                    if sender.in_progress() > 0 {
                        sender.abort("interrupted in the middle of a sample");
                    }
                    return Err(interrupted);
                }
            }
        }
    }

    /// Waits until every sent sample is acknowledged (reconnecting and resending meanwhile
    /// if the client does).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        let done = wait_detached(py, deadline, |slice_end| {
            let mut sender = sender.try_lock_until(slice_end)?;
            match sender.wait(Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            }
        })?;
        done.unwrap_or(Err(EchoError::TimedOut)).map_err(|e| self.error(Call::Wait, e))
    }

    /// Fetches a whole version of the learner's parameters, at least `min_version`, of
    /// `size` bytes (the client's parameter layout): its version and its bytes, a fresh
    /// array the caller owns. Waits (GIL released, Ctrl-C honoured) for a version to be
    /// published until `timeout`.
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
        let mut resume = false;
        let done = wait_detached(py, deadline, |slice_end| {
            let mut sender = sender.try_lock_until(slice_end)?;
            let fetched = sender.fetch_params(buffer, min_version, Some(slice_end), resume);
            resume = true;
            match fetched {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            }
        })?;
        let version =
            done.unwrap_or(Err(EchoError::TimedOut)).map_err(|e| self.error(Call::Params, e))?;
        Ok((version, numpy::PyArray1::from_vec(py, out)))
    }

    /// The description of the learner's parameters (its pytree's structure, dtypes and
    /// shapes, as `echo._params` encodes them; empty when it gave none), waiting (GIL
    /// released) until something is published or `timeout`.
    #[pyo3(signature = (timeout=None))]
    fn fetch_params_description<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        let done = wait_detached(py, deadline, |slice_end| {
            let mut sender = sender.try_lock_until(slice_end)?;
            match sender.fetch_params_description(Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            }
        })?;
        let bytes =
            done.unwrap_or(Err(EchoError::TimedOut)).map_err(|e| self.error(Call::Params, e))?;
        Ok(pyo3::types::PyBytes::new(py, &bytes))
    }

    /// The latest version of the learner's parameters the server announced (0: none).
    #[getter]
    fn params_version(&self, py: Python<'_>) -> u64 {
        self.read(py, TcpSender::params_version)
    }

    /// Durable acknowledgements: waits until every sent sample is in a checkpoint the server
    /// completed (reconnecting and resending meanwhile).
    #[pyo3(signature = (timeout=None))]
    fn wait_persisted(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        let done = wait_detached(py, deadline, |slice_end| {
            let mut sender = sender.try_lock_until(slice_end)?;
            match sender.wait_persisted(Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            }
        })?;
        done.unwrap_or(Err(EchoError::TimedOut)).map_err(|e| self.error(Call::Persisted, e))
    }

    /// Flushes (waits for the acks of everything sent, and with durable acknowledgements for
    /// it to be persisted, at most `timeout` seconds), then closes the connection and joins
    /// its thread. Idempotent. Returns whether everything sent was acknowledged (persisted).
    #[pyo3(signature = (timeout=None))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        // Flush in slices so Ctrl-C still works, then close for real.
        let flushed = wait_detached(py, deadline, |slice_end| {
            let mut sender = sender.try_lock_until(slice_end)?;
            match sender.flush(Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                Ok(()) => Some(true),
                Err(_) => Some(false),
            }
        })?
        .unwrap_or(false);
        detach(py, || sender.lock().close(Some(Instant::now())));
        Ok(flushed)
    }

    /// Samples sent so far.
    #[getter]
    fn sent(&self, py: Python<'_>) -> u64 {
        // The lock is held by a `send` waiting (GIL released) for room: wait detached too.
        self.read(py, TcpSender::sent)
    }

    /// Samples acknowledged so far.
    #[getter]
    fn acked(&self, py: Python<'_>) -> u64 {
        self.read(py, TcpSender::acked)
    }

    /// The wire protocol the connection speaks: 1 or 2.
    #[getter]
    fn protocol(&self, py: Python<'_>) -> u8 {
        self.read(py, TcpSender::protocol)
    }

    /// Which path samples take: "shm" (same-host shared memory) or "tcp".
    #[getter]
    fn transport_path(&self, py: Python<'_>) -> &'static str {
        self.read(py, TcpSender::transport_path)
    }

    /// Per leaf, the codec the connection sends it with: `None` raw, else `echo.Zstd(...)` or
    /// `echo.Lz4()`;
    /// `None` altogether when every leaf goes raw (v1, shared memory, a server that names no
    /// codecs, or `wire_compression=False`).
    #[getter]
    fn wire_codecs(&self, py: Python<'_>) -> PyResult<Option<Vec<Option<Py<PyAny>>>>> {
        let codecs = self.read(py, |sender| sender.wire_codecs().map(|c| c.as_slice().to_vec()));
        codecs
            .map(|codecs| {
                codecs.into_iter().map(|c| c.map(|c| codec_object(py, c)).transpose()).collect()
            })
            .transpose()
    }

    /// What the server said the last time it closed this client's connection: "final",
    /// "restarting", or `None` (it never did).
    #[getter]
    fn server_closing(&self, py: Python<'_>) -> Option<&'static str> {
        self.read(py, TcpSender::server_closing).map(|why| match why {
            Closing::Final => "final",
            Closing::Restarting => "restarting",
        })
    }

    /// Successful reconnections so far.
    #[getter]
    fn reconnects(&self, py: Python<'_>) -> u64 {
        self.read(py, TcpSender::reconnects)
    }

    /// Samples sent again after reconnections.
    #[getter]
    fn resent(&self, py: Python<'_>) -> u64 {
        self.read(py, TcpSender::resent)
    }

    /// Durable acknowledgements: every sample before this one is persisted (0 before the
    /// first checkpoint's notice, and without).
    #[getter]
    fn persisted(&self, py: Python<'_>) -> u64 {
        self.read(py, TcpSender::persisted)
    }

    /// Bytes of the samples kept to resend.
    #[getter]
    fn retained_bytes(&self, py: Python<'_>) -> usize {
        self.read(py, TcpSender::retained_bytes)
    }

    /// Sends that waited for the durable byte budget, and the seconds they waited in all.
    #[getter]
    fn durable_waits(&self, py: Python<'_>) -> (u64, f64) {
        self.read(py, TcpSender::durable_waits)
    }

    /// The sample the latest reconnection resumed at (`None` before any).
    #[getter]
    fn resumed_from(&self, py: Python<'_>) -> Option<u64> {
        self.read(py, TcpSender::resumed_from)
    }

    /// Bytes of one sample on the wire.
    #[getter]
    fn payload_size(&self) -> usize {
        self.leaves.spec.payload_size()
    }
}

impl PyTcpSender {
    /// `err`, raised by `call`, as its exception: what the resolver raised, if that was it.
    fn error(&self, call: Call, err: EchoError) -> PyErr {
        self.raised.lock().take().unwrap_or_else(|| error_in(call, err))
    }

    /// Reads one value off the sender, waiting (detached) while a `send` holds it.
    fn read<T: Send>(&self, py: Python<'_>, get: impl FnOnce(&TcpSender) -> T + Send) -> T {
        let sender = &self.sender;
        detach(py, || get(&sender.lock()))
    }

    fn send_arrays(
        &self,
        py: Python<'_>,
        arrays: &[Leaf<'_>],
        meta: FrameMeta,
        deadline: Option<Instant>,
        version: Option<u64>,
    ) -> PyResult<()> {
        let slices = byte_slices(&self.leaves, arrays);
        if self.leaves.spec.payload_size() < DETACH_WRITE_BYTES {
            // Fast path: room in the window, the write is one short syscall.
            if let Some(mut sender) = self.sender.try_lock() {
                match sender.send_as(&slices, meta, Some(already_passed()), version) {
                    // No room yet, or the socket filled mid-sample: the loop below waits, and
                    // resumes a started sample where it stopped.
                    Err(EchoError::TimedOut | EchoError::Stalled) => {}
                    other => return other.map_err(|e| self.error(Call::Send, e)),
                }
            }
        }
        let sender = &self.sender;
        let mut deadline = deadline;
        loop {
            let done = wait_detached(py, deadline, |slice_end| {
                let mut sender = sender.try_lock_until(slice_end)?;
                match sender.send_as(&slices, meta, Some(slice_end), version) {
                    Err(EchoError::TimedOut | EchoError::Stalled) => None,
                    other => Some(other),
                }
            });
            match done {
                Ok(Some(result)) => return result.map_err(|e| self.error(Call::Send, e)),
                // The user's timeout only bounds the wait for window room: a sample whose
                // first bytes are on the wire is finished (or the stream would be misaligned).
                Ok(None) if sender.lock().in_progress() > 0 => deadline = None,
                Ok(None) => return Err(send_timed_out(&sender.lock())),
                Err(interrupted) => {
                    let mut sender = sender.lock();
                    if sender.in_progress() > 0 {
                        // Ctrl-C mid-sample: drop the connection; the server discards the
                        // partial sample.
                        sender.abort("interrupted in the middle of a sample");
                    }
                    return Err(interrupted);
                }
            }
        }
    }
}

/// A send's timeout: waiting for acknowledgements, or (blocking admission) for this worker to
/// have parameters new enough.
fn send_timed_out(sender: &TcpSender) -> PyErr {
    match sender.held_back() {
        Some((ours, latest, admit)) => PyTimeoutError::new_err(format!(
            "send(): timed out waiting for newer parameters: this worker acts with version \
             {ours} and the learner is at {latest}, more than max_staleness={admit} behind \
             (admission='block'); fetch newer ones with params(), before sending or on \
             another thread"
        )),
        None => error_in(Call::Send, EchoError::TimedOut),
    }
}
