//! The pyo3 bindings, `echo._echo`: the only code in the crate that knows about Python.
//!
//! It converts and checks arguments, releases the GIL around everything that blocks, maps
//! errors to exceptions and builds numpy views. The rule for blocking: wait with the GIL
//! released in slices of at most [`SLICE`], and between slices re-attach to run
//! `check_signals`, so Ctrl-C raises `KeyboardInterrupt` promptly.
//!
//! Interpreter exit: CPython ends a daemon thread that tries to re-take the GIL during
//! finalisation by unwinding it from inside `PyEval_RestoreThread`, which aborts the process
//! if that thread is inside Rust frames. So every GIL-released section goes through
//! [`detach`]: on its way out it announces itself in [`REATTACHING`] and then checks
//! [`INTERPRETER_EXITING`]; set, it parks forever instead (and dies quietly with the process).
//! The `atexit` hook (registered by `echo/__init__.py`) sets the flag and then, with the GIL
//! released, waits for the threads already past the check to get the GIL back. Both sides use
//! SeqCst (a Dekker pair), so a thread either sees the flag or is waited for.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod checkpoint;
mod client;
mod config;
mod errors;
mod info;
mod leaves;
mod ragged;
mod ragged_leaves;
mod ragged_sender;
mod server;
mod views;

/// Longest stretch spent with the GIL released before checking for signals.
const SLICE: Duration = Duration::from_millis(50);

static INTERPRETER_EXITING: AtomicBool = AtomicBool::new(false);
/// Threads between their exit check and re-taking the GIL.
static REATTACHING: AtomicUsize = AtomicUsize::new(0);
/// Longest the `atexit` hook waits for reattaching threads.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// `py.detach(f)`, safe at interpreter exit (see the module docs).
pub(crate) fn detach<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    let out = py.detach(|| {
        let out = f();
        // ORDERING: SeqCst — pairs with `_interpreter_exiting`: the increment and our load of
        // the flag, and its store of the flag and load of the count, are totally ordered.
        REATTACHING.fetch_add(1, Ordering::SeqCst);
        // ORDERING: SeqCst — see above.
        if INTERPRETER_EXITING.load(Ordering::SeqCst) && !is_exit_thread() {
            // ORDERING: SeqCst — see above.
            REATTACHING.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        out
    });
    // ORDERING: SeqCst — see above; we hold the GIL again.
    REATTACHING.fetch_sub(1, Ordering::SeqCst);
    out
}

/// Runs `f` with the GIL re-taken from inside a [`detach`]ed section (a callback the core
/// makes while a call waits detached), with the same exit protocol: at interpreter exit it
/// parks instead of taking the GIL.
pub(crate) fn reattach<T>(f: impl for<'py> FnOnce(Python<'py>) -> T) -> T {
    // ORDERING: SeqCst — as in `detach`: the increment and our load of the flag, and the
    // exit hook's store of the flag and load of the count, are totally ordered.
    REATTACHING.fetch_add(1, Ordering::SeqCst);
    // ORDERING: SeqCst — see above.
    if INTERPRETER_EXITING.load(Ordering::SeqCst) && !is_exit_thread() {
        // ORDERING: SeqCst — see above.
        REATTACHING.fetch_sub(1, Ordering::SeqCst);
        loop {
            std::thread::park();
        }
    }
    let out = Python::attach(f);
    // ORDERING: SeqCst — see above; the GIL is released again.
    REATTACHING.fetch_sub(1, Ordering::SeqCst);
    out
}

/// The thread that ran the `atexit` hook: it finalises the interpreter, holds the GIL through
/// it, and must keep working (e.g. an earlier-registered `atexit` handler calling `close()`).
static EXIT_THREAD: std::sync::OnceLock<std::thread::ThreadId> = std::sync::OnceLock::new();

fn is_exit_thread() -> bool {
    EXIT_THREAD.get() == Some(&std::thread::current().id())
}

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
        let out = detach(py, || attempt(slice_end));
        if out.is_some() {
            return Ok(out);
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

/// A deadline that has passed: "try once, do not wait", without reading the clock on every
/// insert (the clock is only read when the insert would have to wait).
pub(crate) fn already_passed() -> Instant {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// `timeout` in seconds (`None`: wait forever) as a deadline. A timeout too large for a
/// `Duration` or an `Instant` (`1e30`, `inf`) means no limit, like `None`.
///
/// # Errors
/// `ValueError` for NaN or a negative number.
pub(crate) fn deadline_from_timeout(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    deadline_after("timeout", timeout)
}

/// [`deadline_from_timeout`] for the argument called `name`.
pub(crate) fn deadline_after(name: &str, seconds: Option<f64>) -> PyResult<Option<Instant>> {
    match seconds {
        None => Ok(None),
        Some(t) if t >= 0.0 => {
            Ok(Duration::try_from_secs_f64(t).ok().and_then(|d| Instant::now().checked_add(d)))
        }
        Some(t) => Err(PyValueError::new_err(format!(
            "{name} must be None or a number of seconds >= 0, got {t}"
        ))),
    }
}

/// Forwards Rust `log` records (connection errors, refused connections) to Python's `logging`
/// under their module names (`echo.transport.tcp`, ...), through the same exit guard as
/// [`detach`]: a transport thread never takes the GIL once the interpreter is exiting.
struct ExitSafeLogger(pyo3_log::Logger);

impl ExitSafeLogger {
    fn guarded(&self, f: impl FnOnce(&pyo3_log::Logger) -> bool) -> bool {
        // ORDERING: SeqCst — the same Dekker pair as in `detach`.
        REATTACHING.fetch_add(1, Ordering::SeqCst);
        // ORDERING: SeqCst — see above.
        let out = !INTERPRETER_EXITING.load(Ordering::SeqCst) && f(&self.0);
        // ORDERING: SeqCst — see above.
        REATTACHING.fetch_sub(1, Ordering::SeqCst);
        out
    }
}

impl log::Log for ExitSafeLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.guarded(|l| l.enabled(metadata))
    }

    fn log(&self, record: &log::Record<'_>) {
        self.guarded(|l| {
            l.log(record);
            true
        });
    }

    fn flush(&self) {
        self.guarded(|l| {
            l.flush();
            true
        });
    }
}

static LOG_RESET: std::sync::OnceLock<pyo3_log::ResetHandle> = std::sync::OnceLock::new();

fn install_logger(py: Python<'_>) -> PyResult<()> {
    let logger = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels)?
        .filter(log::LevelFilter::Debug);
    let handle = logger.reset_handle();
    if log::set_boxed_logger(Box::new(ExitSafeLogger(logger))).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
        let _ = LOG_RESET.set(handle);
    }
    Ok(())
}

/// Forgets the cached Python logger levels: call after changing `logging` levels once echo
/// has started logging (the bridge caches them for speed).
#[pyfunction]
fn reset_log_cache() {
    if let Some(handle) = LOG_RESET.get() {
        handle.reset();
    }
}

/// Called by an `atexit` hook: from now on, threads finishing a wait park instead of
/// re-taking the GIL; the ones already on their way back get it before we return.
#[pyfunction]
fn _interpreter_exiting(py: Python<'_>) {
    let _ = EXIT_THREAD.set(std::thread::current().id());
    // ORDERING: SeqCst — pairs with `detach` (see there).
    INTERPRETER_EXITING.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + EXIT_GRACE;
    // Not `detach`: this thread must come back.
    py.detach(|| {
        // ORDERING: SeqCst — pairs with `detach`.
        while REATTACHING.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

#[pymodule]
fn _echo(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    install_logger(py)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("RING_ALIGN", crate::RING_ALIGN)?;
    m.add("DETAILED_METRICS", crate::metrics::ENABLED)?;
    m.add_class::<server::PyServerCore>()?;
    m.add_class::<client::PyTcpSender>()?;
    m.add_class::<views::RingLease>()?;
    m.add_class::<views::BatchCopy>()?;
    m.add_class::<ragged::RaggedCore>()?;
    m.add_class::<ragged::RaggedCopy>()?;
    m.add_class::<ragged_sender::PyRaggedSender>()?;
    m.add_class::<info::SampleInfo>()?;
    m.add_class::<info::HistSnapshot>()?;
    m.add_class::<checkpoint::PyOpenedCheckpoint>()?;
    m.add_class::<server::PySampleWriter>()?;
    m.add("CheckpointError", py.get_type::<errors::CheckpointError>())?;
    m.add("CHECKPOINT_FORMAT_VERSION", crate::checkpoint::FORMAT_VERSION)?;
    m.add_function(wrap_pyfunction!(checkpoint::open_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::clean_checkpoint_leftovers, m)?)?;
    errors::add_server_closed_bases(py)?;
    m.add("ServerClosedError", py.get_type::<errors::ServerClosedError>())?;
    m.add("ConnectionClosedError", py.get_type::<errors::ConnectionClosedError>())?;
    m.add("SharedMemoryError", py.get_type::<errors::SharedMemoryError>())?;
    m.add_function(wrap_pyfunction!(_interpreter_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(reset_log_cache, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_strategy, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_codec, m)?)?;
    m.add_function(wrap_pyfunction!(info::_sample_info, m)?)?;
    Ok(())
}
