//! The exception hierarchy and the one mapping from core errors to Python exceptions.
//!
//! Builtins users already catch are the bases: a lost peer is a `ConnectionError`
//! (`ConnectionClosedError`), a closed server a `ConnectionClosedError` that is also a
//! `RuntimeError` (`ServerClosedError`: a worker loop written against `except
//! ConnectionClosedError` ends when its learner closes for good, and in-process code that
//! catches `RuntimeError` still does), bad sizes and layouts a `ValueError`, a deadline a
//! `TimeoutError`, allocation failure a `MemoryError`, operating-system failures the matching
//! `OSError` subclass. Every other binding module goes through [`to_pyerr`] or [`error_in`].

use pyo3::exceptions::{
    PyConnectionError, PyMemoryError, PyPermissionError, PyRuntimeError, PyTimeoutError,
    PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::error::EchoError;
use crate::replay::{InsertHoldback, SampleHoldback};

pyo3::create_exception!(
    echo._echo,
    ConnectionClosedError,
    PyConnectionError,
    "The connection to the peer is closed (by `close()` or because the peer went away)."
);
pyo3::create_exception!(
    echo._echo,
    ServerClosedError,
    ConnectionClosedError,
    "The server was closed: nothing more can be submitted or started, and a worker's \
     connection to it is closed for good. A `ConnectionClosedError` and a `RuntimeError`."
);

/// Makes `ServerClosedError` a `RuntimeError` too, as it was before it became a
/// `ConnectionClosedError` (so `except RuntimeError` around `submit()` still catches it).
/// `create_exception!` takes one base; the class is a heap type whose bases may be set,
/// and the two are layout-compatible (`RuntimeError` adds no fields to `BaseException`).
/// Called once, at module init, before the class is handed out.
pub(crate) fn add_server_closed_bases(py: Python<'_>) -> PyResult<()> {
    let bases = PyTuple::new(
        py,
        [py.get_type::<ConnectionClosedError>(), py.get_type::<PyRuntimeError>()],
    )?;
    py.get_type::<ServerClosedError>().setattr("__bases__", bases)
}

pyo3::create_exception!(
    echo._echo,
    CheckpointError,
    PyValueError,
    "A checkpoint cannot be restored: a file is missing, truncated or corrupted (its SHA-256 \
     differs from the manifest's), its format version is newer than this echo reads, or the \
     example does not match its layout. The message names the file and what is wrong."
);

pyo3::create_exception!(
    echo._echo,
    SharedMemoryError,
    PyConnectionError,
    "`shared_memory=True` and the same-host shared-memory path cannot be had (the message says why)."
);

/// The Python call an error happened in: it names the call in messages about the call itself
/// (closed, timed out), and says what the call was waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    Start,
    Submit,
    Sample,
    Send,
    Wait,
    Params,
    Persisted,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Self::Start => "start()",
            Self::Submit => "submit()",
            Self::Sample => "sample()",
            Self::Send => "send()",
            Self::Wait => "wait()",
            Self::Params => "params()",
            Self::Persisted => "wait_persisted()",
        }
    }

    fn timed_out(self) -> &'static str {
        match self {
            Self::Start => "timed out",
            Self::Submit => "timed out waiting for space (or for the rate limiter)",
            Self::Sample => "no full batch arrived before the timeout",
            Self::Send | Self::Wait => "timed out waiting for acknowledgements",
            Self::Params => {
                "no version of the parameters that new was published before the timeout"
            }
            Self::Persisted => "timed out waiting for a checkpoint to persist every sample sent",
        }
    }
}

/// A core error raised by `call`, as the exception a Python user expects.
pub(crate) fn error_in(call: Call, err: EchoError) -> PyErr {
    match err {
        EchoError::Closed => {
            ServerClosedError::new_err(format!("{}: the server is closed", call.name()))
        }
        EchoError::TimedOut => {
            PyTimeoutError::new_err(format!("{}: {}", call.name(), call.timed_out()))
        }
        EchoError::Stalled => {
            PyTimeoutError::new_err(format!("{}: timed out in the middle of a sample", call.name()))
        }
        other => to_pyerr(other),
    }
}

/// The `TimeoutError` of a `sample()` whose deadline passed. A replay table says what held
/// it back (`holdback`, with `limiter` the rate limiter's repr): the limiter and its counters,
/// or an empty table, so a user waiting on the limiter does not go looking for a missing
/// producer. The FIFO ring (no `holdback`) keeps the plain message.
pub(crate) fn sample_timed_out(holdback: Option<&SampleHoldback>, limiter: &str) -> PyErr {
    let call = Call::Sample;
    match holdback {
        None => error_in(call, EchoError::TimedOut),
        Some(holdback) => PyTimeoutError::new_err(format!(
            "{}: {}: {}",
            call.name(),
            call.timed_out(),
            holdback.explain(limiter)
        )),
    }
}

/// The `TimeoutError` of a `submit()` (or `submit_batch()`, `call` naming it, after
/// `inserted` of its rows) whose deadline passed. A replay or sequence table says what held
/// it back (`holdback`, with `limiter` the rate limiter's repr), as `sample()`'s timeout
/// does: a prefill that outran the limiter learns so, and where it stops. The FIFO ring (no
/// `holdback`) keeps the plain message.
pub(crate) fn submit_timed_out(
    call: &str,
    inserted: Option<(usize, usize)>,
    holdback: Option<&InsertHoldback>,
    limiter: &str,
) -> PyErr {
    let mut text = match inserted {
        None => format!("{call}: {}", Call::Submit.timed_out()),
        Some((done, n)) => format!(
            "{call}: timed out after inserting {done} of the {n} rows (the first {done}, in \
             order); submit the rest again"
        ),
    };
    if let Some(holdback) = holdback {
        text += &format!(": {}", holdback.explain(limiter));
    }
    PyTimeoutError::new_err(text)
}

/// A core error as the exception a Python user expects (messages as the core words them).
pub(crate) fn to_pyerr(err: EchoError) -> PyErr {
    match err {
        EchoError::Config(_)
        | EchoError::SizeMismatch { .. }
        | EchoError::PayloadSize { .. }
        | EchoError::LeafCount { .. }
        | EchoError::Priority(_)
        | EchoError::Sample(_)
        | EchoError::Protocol(_) => PyValueError::new_err(err.to_string()),
        EchoError::OutOfMemory { .. } => PyMemoryError::new_err(err.to_string()),
        EchoError::Auth(msg) => PyPermissionError::new_err(msg),
        EchoError::Closed => ServerClosedError::new_err(err.to_string()),
        EchoError::ServerClosed(msg) => ServerClosedError::new_err(msg),
        EchoError::TimedOut | EchoError::Stalled => PyTimeoutError::new_err(err.to_string()),
        EchoError::Disconnected(msg) => ConnectionClosedError::new_err(msg),
        EchoError::Busy(msg) => PyRuntimeError::new_err(msg),
        EchoError::SharedMemory(msg) => SharedMemoryError::new_err(msg),
        EchoError::Checkpoint(msg) => CheckpointError::new_err(msg),
        EchoError::Io(io) => io.into(),
    }
}
