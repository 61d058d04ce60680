//! The pyo3 bindings, `echo._echo`: the only code in the crate that knows about Python.
//!
//! It converts and checks arguments, releases the GIL around everything that blocks, maps
//! errors to exceptions and builds numpy views. The rule for blocking: wait with the GIL
//! released in slices of at most [`SLICE`], and between slices re-attach to run
//! `check_signals`, so Ctrl-C raises `KeyboardInterrupt` promptly.
//!
//! Interpreter exit: CPython ends a daemon thread that tries to re-take the GIL during
//! finalisation by unwinding it from inside `PyEval_RestoreThread`, which would abort the
//! process if that thread were inside Rust frames. An `atexit` hook (registered by
//! `echo/__init__.py`) sets [`INTERPRETER_EXITING`]; a thread that finishes a wait after that
//! parks forever instead of re-attaching, and dies quietly with the process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod errors;
mod info;
mod server;
mod views;

/// Longest stretch spent with the GIL released before checking for signals.
const SLICE: Duration = Duration::from_millis(50);

static INTERPRETER_EXITING: AtomicBool = AtomicBool::new(false);

/// Runs `attempt(slice_end)` with the GIL released until it returns `Some`, checking for
/// signals between slices. Returns `None` if `deadline` passes first.
pub(crate) fn wait_detached<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut attempt: impl FnMut(Instant) -> Option<T> + Send,
) -> PyResult<Option<T>> {
    loop {
        let slice_end = Instant::now() + SLICE;
        let slice_end = deadline.map_or(slice_end, |d| d.min(slice_end));
        let out = py.detach(|| {
            let out = attempt(slice_end);
            park_if_exiting();
            out
        });
        if out.is_some() {
            return Ok(out);
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

fn park_if_exiting() {
    // ORDERING: Relaxed — the flag carries no data; a thread that misses it for one slice
    // parks after the next one.
    if INTERPRETER_EXITING.load(Ordering::Relaxed) {
        loop {
            std::thread::park();
        }
    }
}

/// `timeout` in seconds (`None`: wait forever) as a deadline.
pub(crate) fn deadline_from_timeout(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => {
            Ok(Instant::now().checked_add(Duration::from_secs_f64(t)))
        }
        Some(t) => Err(PyValueError::new_err(format!(
            "timeout must be None or a finite number of seconds >= 0, got {t}"
        ))),
    }
}

/// Called by an `atexit` hook: from now on, threads finishing a wait park instead of
/// re-taking the GIL (see the module docs).
#[pyfunction]
fn _interpreter_exiting() {
    // ORDERING: Relaxed — see `park_if_exiting`.
    INTERPRETER_EXITING.store(true, Ordering::Relaxed);
}

#[pymodule]
fn _echo(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("RING_ALIGN", crate::RING_ALIGN)?;
    m.add_class::<server::PyRingServer>()?;
    m.add_class::<views::RingLease>()?;
    m.add_class::<info::SampleInfo>()?;
    m.add_class::<info::HistSnapshot>()?;
    m.add("ServerClosedError", py.get_type::<errors::ServerClosedError>())?;
    m.add("ConnectionClosedError", py.get_type::<errors::ConnectionClosedError>())?;
    m.add_function(wrap_pyfunction!(_interpreter_exiting, m)?)?;
    Ok(())
}
