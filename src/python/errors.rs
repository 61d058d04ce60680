//! The exception hierarchy and the one mapping from core errors to Python exceptions.
//!
//! Builtins users already catch are the bases: a closed server is a `RuntimeError`, a lost
//! peer a `ConnectionError`, bad sizes a `ValueError`, allocation failure a `MemoryError`,
//! operating-system failures the matching `OSError` subclass.

use pyo3::exceptions::{
    PyConnectionError, PyMemoryError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;

use crate::error::EchoError;
use crate::store::{InsertError, SampleError};

pyo3::create_exception!(
    echo._echo,
    ServerClosedError,
    PyRuntimeError,
    "The server was closed: nothing more can be submitted or started."
);
pyo3::create_exception!(
    echo._echo,
    ConnectionClosedError,
    PyConnectionError,
    "The connection to the peer is closed (by `close()` or because the peer went away)."
);

/// Converts a core error into the Python exception a user expects.
pub(crate) fn to_pyerr(err: EchoError) -> PyErr {
    match err {
        EchoError::Config(_)
        | EchoError::SizeMismatch { .. }
        | EchoError::PayloadSize { .. }
        | EchoError::LeafCount { .. }
        | EchoError::Priority(_) => PyValueError::new_err(err.to_string()),
        EchoError::OutOfMemory { .. } => PyMemoryError::new_err(err.to_string()),
        EchoError::Closed => ServerClosedError::new_err(err.to_string()),
        EchoError::Io(io) => io.into(),
    }
}

pub(crate) fn insert_error(err: InsertError) -> PyErr {
    match err {
        InsertError::Invalid(e) => to_pyerr(e),
        InsertError::Closed { .. } => ServerClosedError::new_err("submit(): the server is closed"),
        InsertError::TimedOut { .. } => PyTimeoutError::new_err(
            "submit(): timed out waiting for space (or for the rate limiter)",
        ),
    }
}

pub(crate) fn sample_timeout(err: SampleError) -> PyErr {
    debug_assert_eq!(err, SampleError::TimedOut);
    PyTimeoutError::new_err("sample(): no full batch arrived before the timeout")
}
