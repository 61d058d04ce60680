//! `echo._echo.TcpSender`: the native half of `echo.TcpClient`. Connects, checks the server's
//! handshake against the example, and sends each sample straight from its numpy buffers with
//! one vectored write; every wait releases the GIL and honours Ctrl-C.

use std::time::Instant;

use numpy::PyUntypedArray;
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::errors::{error_in, to_pyerr, Call};
use super::leaves::{byte_slices, py_shape, LeafSpecs};
use super::{deadline_after, deadline_from_timeout, detach, wait_detached};
use crate::error::EchoError;
use crate::spec::DataSpec;
use crate::transport::client::TcpSender;

/// Samples at or above this many bytes are written with the GIL released.
const DETACH_WRITE_BYTES: usize = 64 * 1024;

/// A connection to an echo server that sends samples given as flattened leaves.
#[pyclass(frozen, module = "echo._echo", name = "TcpSender")]
pub(crate) struct PyTcpSender {
    leaves: LeafSpecs,
    sender: Mutex<TcpSender>,
}

#[pymethods]
impl PyTcpSender {
    /// Connects to `host:port` and checks that the server stores samples shaped like ours.
    #[new]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        layout: &Bound<'_, PyAny>,
        max_inflight: u64,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        if max_inflight == 0 {
            return Err(PyValueError::new_err("max_inflight_msgs must be >= 1, got 0"));
        }
        if connect_timeout.is_nan() || connect_timeout <= 0.0 {
            return Err(PyValueError::new_err(format!(
                "connect_timeout must be a positive number of seconds, got {connect_timeout}"
            )));
        }
        let leaves = LeafSpecs::new(layout)?;
        // One deadline for the whole connect and handshake (too large for a `Duration`: none).
        let deadline = deadline_after("connect_timeout", Some(connect_timeout))?;
        let mut connecting =
            TcpSender::connecting(&host, port, max_inflight, deadline).map_err(to_pyerr)?;
        // Polled in slices with the GIL released, so Ctrl-C interrupts a slow connect.
        let sender = wait_detached(py, None, |slice_end| connecting.poll(slice_end).transpose())?
            .expect("waits without a deadline until the connect succeeds or fails")
            .map_err(to_pyerr)?;
        check_server_spec(&leaves, sender.spec(), &host, port)?;
        Ok(Self { leaves, sender: Mutex::new(sender) })
    }

    /// Sends one sample (a pytree like the example). Blocks while `max_inflight` samples are
    /// unacknowledged; raises `TimeoutError` if `timeout` passes first (nothing sent).
    #[pyo3(signature = (sample, timeout=None))]
    fn send(
        &self,
        py: Python<'_>,
        sample: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let arrays = self.leaves.arrays(sample)?;
        self.send_arrays(py, &arrays, deadline)
    }

    /// Waits until every sent sample is acknowledged.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        let done = wait_detached(py, deadline, |slice_end| {
            let sender = sender.try_lock_until(slice_end)?;
            match sender.wait(Some(slice_end)) {
                Err(EchoError::TimedOut) => None,
                other => Some(other),
            }
        })?;
        done.unwrap_or(Err(EchoError::TimedOut)).map_err(|e| error_in(Call::Wait, e))
    }

    /// Flushes (waits for the acks of everything sent, at most `timeout` seconds), then closes
    /// the connection and joins its thread. Idempotent. Returns whether everything sent was
    /// acknowledged.
    #[pyo3(signature = (timeout=None))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = deadline_from_timeout(timeout)?;
        let sender = &self.sender;
        // Flush in slices so Ctrl-C still works, then close for real.
        let flushed = wait_detached(py, deadline, |slice_end| {
            let sender = sender.try_lock_until(slice_end)?;
            match sender.wait(Some(slice_end)) {
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
        let sender = &self.sender;
        detach(py, || sender.lock().sent())
    }

    /// Samples acknowledged so far.
    #[getter]
    fn acked(&self, py: Python<'_>) -> u64 {
        let sender = &self.sender;
        detach(py, || sender.lock().acked())
    }

    /// Bytes of one sample on the wire.
    #[getter]
    fn payload_size(&self) -> usize {
        self.leaves.spec.payload_size()
    }
}

impl PyTcpSender {
    fn send_arrays(
        &self,
        py: Python<'_>,
        arrays: &[Bound<'_, PyUntypedArray>],
        deadline: Option<Instant>,
    ) -> PyResult<()> {
        let slices = byte_slices(&self.leaves, arrays);
        if self.leaves.spec.payload_size() < DETACH_WRITE_BYTES {
            // Fast path: room in the window, the write is one short syscall.
            if let Some(mut sender) = self.sender.try_lock() {
                match sender.send(&slices, Some(Instant::now())) {
                    // No room yet, or the socket filled mid-sample: the loop below waits, and
                    // resumes a started sample where it stopped.
                    Err(EchoError::TimedOut | EchoError::Stalled) => {}
                    other => return other.map_err(|e| error_in(Call::Send, e)),
                }
            }
        }
        let sender = &self.sender;
        let mut deadline = deadline;
        loop {
            let done = wait_detached(py, deadline, |slice_end| {
                let mut sender = sender.try_lock_until(slice_end)?;
                match sender.send(&slices, Some(slice_end)) {
                    Err(EchoError::TimedOut | EchoError::Stalled) => None,
                    other => Some(other),
                }
            });
            match done {
                Ok(Some(result)) => return result.map_err(|e| error_in(Call::Send, e)),
                // The user's timeout only bounds the wait for window room: a sample whose
                // first bytes are on the wire is finished (or the stream would be misaligned).
                Ok(None) if sender.lock().in_progress() > 0 => deadline = None,
                Ok(None) => return Err(error_in(Call::Send, EchoError::TimedOut)),
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

/// The server's handshake must describe our leaves: same count, element sizes and shapes.
fn check_server_spec(ours: &LeafSpecs, theirs: &DataSpec, host: &str, port: u16) -> PyResult<()> {
    let mismatch = |detail: String| {
        PyValueError::new_err(format!(
            "the server at {host}:{port} stores samples of another layout: {detail}"
        ))
    };
    if theirs.len() != ours.len() {
        return Err(mismatch(format!(
            "it has {} leaves, data_sample has {}",
            theirs.len(),
            ours.len()
        )));
    }
    for (i, (mine, server)) in ours.spec.arrays().iter().zip(theirs.arrays()).enumerate() {
        if mine.shape() != server.shape() || mine.dtype_size() != server.dtype_size() {
            return Err(mismatch(format!(
                "leaf {}: server expects shape {} with {}-byte elements, data_sample has shape {} with {}-byte elements",
                ours.names[i],
                py_shape(server.shape()),
                server.dtype_size(),
                py_shape(mine.shape()),
                mine.dtype_size()
            )));
        }
    }
    Ok(())
}
