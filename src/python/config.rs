//! Settings as they cross from Python: each read once, into the core's own types, and
//! checked in one place.
//!
//! - [`LayoutArg`]: the example's leaves, from `echo._pytree.TreeLayout`.
//! - [`ServerConfig`]: `echo.Server`'s arguments (the `ServerConfig` dataclass of `echo._server_args`),
//!   turned into a [`BackendConfig`] by [`ServerConfig::backend`], which is where the FIFO
//!   and replay arguments are checked against each other.
//! - The replay strategies (`echo.replay.Uniform()`, ... frozen dataclasses) become
//!   [`SamplerKind`], [`RemoverKind`] and [`RateLimit`]; their values are checked by the
//!   core (`check_strategy` runs that check when a strategy is built).
//! - The codecs (`echo.Zstd(level)`, `echo.Lz4()`, frozen dataclasses) become [`Codec`] in
//!   [`codec`], and go back to Python as those objects in [`codec_object`]; the core checks
//!   the level ([`Codec::validate`], run by [`check_codec`] when a codec is built).
//! - [`TcpArg`] is `echo.TcpTransport`.

use numpy::PyArrayDescr;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyType};

use super::errors::to_pyerr;
use crate::backend::BackendConfig;
use crate::codec::Codec;
use crate::replay::{AtEnd, RateLimit, RemoverKind, ReplayConfig, SamplerKind, SequenceConfig};
use crate::transport::tcp::TcpConfig;
use crate::transport::wire::v2::Layout;
use crate::versions::{Admission, VersionsConfig};
use std::time::Duration;

/// One leaf of the example: `echo._pytree.LeafSpec`.
#[derive(FromPyObject)]
pub(crate) struct LeafArg<'py> {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: Bound<'py, PyArrayDescr>,
}

/// The example's structure as the core needs it: `echo._pytree.TreeLayout`.
#[derive(FromPyObject)]
pub(crate) struct LayoutArg<'py> {
    /// Every leaf in flattened order.
    pub(crate) leaves: Vec<LeafArg<'py>>,
    /// The example's keys in leaf order when it is a flat dict of arrays.
    pub(crate) flat_keys: Option<Vec<Bound<'py, PyString>>>,
}

/// `echo.TcpTransport`, whose fields the dataclass has already checked.
#[derive(FromPyObject)]
pub(crate) struct TcpArg {
    host: String,
    port: u16,
    num_threads: usize,
    max_connections: usize,
    pub(crate) max_buffered_bytes: usize,
    token: Option<String>,
    heartbeat_timeout: Option<f64>,
    session_timeout: f64,
    shared_memory: bool,
}

impl TcpArg {
    /// The TCP server's settings (the rest go to the ingress); `layout` is the example's.
    pub(crate) fn tcp_config(&self, layout: Layout) -> PyResult<TcpConfig> {
        Ok(TcpConfig {
            host: self.host.clone(),
            port: self.port,
            num_threads: self.num_threads,
            max_connections: self.max_connections,
            token: resolve_token(self.token.as_deref())?,
            heartbeat_timeout: seconds("heartbeat_timeout", self.heartbeat_timeout)?,
            session_timeout: seconds("session_timeout", Some(self.session_timeout))?
                .unwrap_or(Duration::MAX),
            layout: Some(layout),
            shared_memory: self.shared_memory,
            codecs: Vec::new(),
            restored_sessions: Vec::new(),
            params: None,
            versions: None,
        })
    }
}

/// The environment variable a token is read from when none is given.
pub(crate) const TOKEN_VAR: &str = "ECHO_TOKEN";

/// The token to use: `given`, else `$ECHO_TOKEN` (empty: none).
///
/// # Errors
/// `ValueError` for an empty `given` token.
pub(crate) fn resolve_token(given: Option<&str>) -> PyResult<Option<Vec<u8>>> {
    match given {
        Some("") => Err(PyValueError::new_err(format!(
            "token must be a non-empty string (or None to read ${TOKEN_VAR}), got ''"
        ))),
        Some(token) => Ok(Some(token.as_bytes().to_vec())),
        None => Ok(std::env::var(TOKEN_VAR).ok().filter(|t| !t.is_empty()).map(String::into_bytes)),
    }
}

/// A positive number of seconds (`None`: no limit) as a `Duration`; too large for one: none.
///
/// # Errors
/// `ValueError` naming `what` for zero, negative or NaN.
pub(crate) fn seconds(what: &str, value: Option<f64>) -> PyResult<Option<Duration>> {
    let Some(value) = value else { return Ok(None) };
    if value.is_nan() || value <= 0.0 {
        return Err(PyValueError::new_err(format!(
            "{what} must be a positive number of seconds or None, got {value}"
        )));
    }
    Ok(Duration::try_from_secs_f64(value).ok())
}

/// A strategy object and how Python prints it (for messages that name it).
pub(crate) struct Strategy<T> {
    pub(crate) kind: T,
    pub(crate) repr: String,
}

/// What `sampler=` selects: the FIFO ring, or a replay table drawing with `SamplerKind`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum SamplerArg {
    Fifo,
    Replay(SamplerKind),
}

/// `echo.Server`'s arguments (`echo._server_args.ServerConfig`), types already checked in Python.
pub(crate) struct ServerConfig {
    pub(crate) batch_size: usize,
    num_buffers: usize,
    pub(crate) num_drainers: usize,
    /// `None`: [`crate::ingress::IngressConfig::queue_size_for`] the payload size.
    pub(crate) producer_queue_size: Option<usize>,
    pub(crate) sampler: Strategy<SamplerArg>,
    remover: Option<Strategy<RemoverKind>>,
    rate_limiter: Option<Strategy<RateLimit>>,
    max_size: Option<usize>,
    max_times_sampled: u32,
    seed: Option<u64>,
    sequence: Option<SequenceConfig>,
    /// Per leaf: how it is stored (`None` raw), as `echo.server` resolved `compress=`.
    compress: Vec<Option<Codec>>,
    max_bytes: Option<u64>,
    /// `Server(name=...)`, checked non-empty in Python.
    pub(crate) name: String,
    /// `Server(policy_versions=..., max_staleness=..., admission=...)`: whether samples
    /// carry versions, and the bound.
    pub(crate) versions: Option<VersionsConfig>,
}

/// The policy version settings: kept when `policy_versions` or a bound is given; `admission`
/// is `"drop"` or `"block"` (a bound's; checked in Python as well).
fn versions_arg(
    kept: bool,
    max_staleness: Option<u64>,
    admission: &str,
) -> PyResult<Option<VersionsConfig>> {
    let admission = match admission {
        "drop" => Admission::Drop,
        "block" => Admission::Block,
        other => {
            return Err(PyValueError::new_err(format!(
                "admission must be 'drop' or 'block', got '{other}'"
            )))
        }
    };
    Ok((kept || max_staleness.is_some()).then_some(VersionsConfig { max_staleness, admission }))
}

/// `echo.Sequence`, whose fields the dataclass has checked (types and ranges); `at_end`'s word
/// is checked here.
fn sequence_arg(obj: &Bound<'_, PyAny>) -> PyResult<SequenceConfig> {
    let at_end: String = obj.getattr("at_end")?.extract()?;
    let at_end = match at_end.as_str() {
        "pad" => AtEnd::Pad,
        "shift" => AtEnd::Shift,
        "drop" => AtEnd::Drop,
        other => {
            return Err(PyValueError::new_err(format!(
                "Sequence(at_end) must be 'pad', 'shift' or 'drop', got '{other}'"
            )))
        }
    };
    Ok(SequenceConfig {
        length: obj.getattr("length")?.extract()?,
        period: obj.getattr("period")?.extract()?,
        at_end,
        max_streams: obj.getattr("max_streams")?.extract()?,
    })
}

impl<'py> FromPyObject<'_, 'py> for ServerConfig {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let get = |name: &str| obj.getattr(name);
        let optional = |name: &str| -> PyResult<Option<Bound<'py, PyAny>>> {
            let value = get(name)?;
            Ok((!value.is_none()).then_some(value))
        };
        Ok(Self {
            batch_size: get("batch_size")?.extract()?,
            num_buffers: get("num_buffers")?.extract()?,
            num_drainers: get("num_drainers")?.extract()?,
            producer_queue_size: get("producer_queue_size")?.extract()?,
            sampler: sampler(&get("sampler")?)?,
            remover: optional("remover")?.map(|r| remover(&r)).transpose()?,
            rate_limiter: optional("rate_limiter")?.map(|r| rate_limiter(&r)).transpose()?,
            max_size: get("max_size")?.extract()?,
            max_times_sampled: get("max_times_sampled")?.extract()?,
            seed: get("seed")?.extract()?,
            sequence: optional("sequence")?.map(|s| sequence_arg(&s)).transpose()?,
            compress: get("compress")?
                .try_iter()?
                .map(|leaf| {
                    let leaf = leaf?;
                    if leaf.is_none() {
                        Ok(None)
                    } else {
                        codec(&leaf).map(Some)
                    }
                })
                .collect::<PyResult<_>>()?,
            max_bytes: get("max_bytes")?.extract()?,
            name: get("name")?.extract()?,
            versions: versions_arg(
                get("policy_versions")?.extract()?,
                get("max_staleness")?.extract()?,
                &get("admission")?.extract::<String>()?,
            )?,
        })
    }
}

impl ServerConfig {
    /// The backend these arguments describe. The replay-only arguments are refused with the
    /// FIFO sampler, and `max_size` is required with any other.
    pub(crate) fn backend(&self) -> PyResult<BackendConfig> {
        let batch_size = self.batch_size;
        let SamplerArg::Replay(sampler) = self.sampler.kind else {
            if self.sequence.is_some() {
                return Err(PyValueError::new_err(format!(
                    "sequence= needs a replay sampler (Uniform(), Prioritized(), Lifo()), got \
                     sampler={}: the FIFO ring hands out each single sample once, a sequence \
                     table samples windows of steps",
                    self.sampler.repr
                )));
            }
            return Ok(BackendConfig::Fifo { batch_size, num_batches: self.fifo_num_batches()? });
        };
        let Some(max_size) = self.max_size else {
            let what = if self.sequence.is_some() { "steps" } else { "items" };
            return Err(PyValueError::new_err(format!(
                "max_size is required with sampler={}: the table pre-allocates max_size {what} \
                 (e.g. max_size=1_000_000)",
                self.sampler.repr
            )));
        };
        if let Some(sequence) = self.sequence {
            if let Some(r) = self.remover.as_ref().filter(|r| r.kind != RemoverKind::Fifo) {
                return Err(PyValueError::new_err(format!(
                    "remover={} does not apply to a sequence table: it evicts its oldest chunks \
                     of steps (and every window holding one) when max_size steps are stored",
                    r.repr
                )));
            }
            return Ok(BackendConfig::Sequence(self.replay_config(sampler, max_size), sequence));
        }
        if max_size < batch_size {
            return Err(PyValueError::new_err(format!(
                "max_size must be >= {batch_size}, got {max_size}"
            )));
        }
        Ok(BackendConfig::Replay(self.replay_config(sampler, max_size)))
    }

    fn replay_config(&self, sampler: SamplerKind, max_size: usize) -> ReplayConfig {
        ReplayConfig {
            batch_size: self.batch_size,
            max_size,
            sampler,
            remover: self.remover.as_ref().map_or(RemoverKind::Fifo, |r| r.kind),
            rate_limit: self.rate_limiter.as_ref().map_or(RateLimit::MinSize(1), |r| r.kind),
            max_times_sampled: self.max_times_sampled,
            seed: self.seed,
            compress: if self.compresses() { self.compress.clone() } else { Vec::new() },
            max_bytes: self.max_bytes,
        }
    }

    /// What `compress=` chose, per leaf (empty or all `None`: nothing): the leaves a replay or
    /// sequence table stores compressed, and those v2 clients send compressed over TCP.
    pub(crate) fn wire_codecs(&self) -> &[Option<Codec>] {
        &self.compress
    }

    /// Whether `compress=` chose any leaf.
    fn compresses(&self) -> bool {
        self.compress.iter().any(Option::is_some)
    }

    /// Checks the replay-only arguments against the FIFO ring; returns its batch count.
    fn fifo_num_batches(&self) -> PyResult<usize> {
        let refuse = |what: String, why: &str| {
            Err(PyValueError::new_err(format!(
                "{what} needs a replay sampler (Uniform(), Prioritized(), Lifo()){why}"
            )))
        };
        if let Some(r) = self.remover.as_ref().filter(|r| r.kind != RemoverKind::Fifo) {
            return refuse(
                format!("remover={}", r.repr),
                ": the FIFO ring frees each batch once read",
            );
        }
        if self.max_size.is_some() {
            return refuse(
                "max_size".into(),
                "; the FIFO ring holds num_buffers * batch_size samples",
            );
        }
        if self.max_times_sampled > 1 {
            return refuse(
                format!("max_times_sampled={}", self.max_times_sampled),
                ": FIFO hands out each sample once",
            );
        }
        if self.seed.is_some() {
            return refuse("seed".into(), ": FIFO sampling is not random");
        }
        if self.max_bytes.is_some() {
            return refuse(
                "max_bytes".into(),
                "; the FIFO ring holds num_buffers * batch_size samples",
            );
        }
        match &self.rate_limiter {
            None => Ok(self.num_buffers),
            Some(Strategy { kind: RateLimit::Queue(size), .. }) => {
                let size = usize::try_from(*size).unwrap_or(usize::MAX);
                Ok(size.div_ceil(self.batch_size).max(2))
            }
            Some(other) => refuse(
                format!("rate_limiter={}", other.repr),
                ": the FIFO ring hands out each sample once, as soon as a full batch is in; \
                 use Queue(size) to size it",
            ),
        }
    }

    /// How Python prints the rate limiter, for messages: the user's object's `repr`, or the
    /// replay default `MinSize(min_size=1)` (as the dataclass prints it).
    pub(crate) fn limiter_repr(&self) -> String {
        self.rate_limiter
            .as_ref()
            .map_or_else(|| RateLimit::MinSize(1).to_string(), |r| r.repr.clone())
    }

    /// `num_buffers=3` or `max_size=100, sampler=Uniform()`: the backend's size, for reprs.
    pub(crate) fn describe(&self, backend: &BackendConfig) -> String {
        match backend {
            BackendConfig::Fifo { num_batches, .. } => format!("num_buffers={num_batches}"),
            BackendConfig::Replay(c) => {
                format!("max_size={}, sampler={}", c.max_size, self.sampler.repr)
            }
            BackendConfig::Sequence(c, seq) => format!(
                "max_size={}, sampler={}, sequence=Sequence(length={}, period={}, at_end='{}')",
                c.max_size,
                self.sampler.repr,
                seq.length,
                seq.period,
                seq.at_end.name()
            ),
        }
    }
}

/// The class `echo.replay.<name>`.
pub(crate) fn strategy_class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    static REPLAY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let module =
        REPLAY.get_or_try_init(py, || Ok::<_, PyErr>(py.import("echo.replay")?.unbind()))?;
    Ok(module.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

/// The class `echo.compression.<name>`.
fn codec_class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    static COMPRESSION: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let module = COMPRESSION
        .get_or_try_init(py, || Ok::<_, PyErr>(py.import("echo.compression")?.unbind()))?;
    Ok(module.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

/// The name of the first of `names` that `obj` is an instance of (`class` looks them up).
fn instance_of<'a, 'py>(
    obj: &Bound<'py, PyAny>,
    names: &[&'a str],
    class: fn(Python<'py>, &str) -> PyResult<Bound<'py, PyType>>,
) -> PyResult<Option<&'a str>> {
    for &name in names {
        if obj.is_instance(class(obj.py(), name)?.as_any())? {
            return Ok(Some(name));
        }
    }
    Ok(None)
}

/// The name of the first of the strategies `names` that `obj` is an instance of.
fn which<'a>(obj: &Bound<'_, PyAny>, names: &[&'a str]) -> PyResult<Option<&'a str>> {
    instance_of(obj, names, strategy_class)
}

/// A codec, `echo.Zstd(level)` or `echo.Lz4()`, as the core's [`Codec`], its level checked.
///
/// # Errors
/// `TypeError` for another object, `ValueError` for a level out of range.
pub(crate) fn codec(obj: &Bound<'_, PyAny>) -> PyResult<Codec> {
    let codec = match instance_of(obj, &["Zstd", "Lz4"], codec_class)? {
        Some("Zstd") => Codec::Zstd { level: obj.getattr("level")?.extract()? },
        Some(_) => Codec::Lz4,
        None => return Err(wrong_type("a codec", "echo.Zstd(...) or echo.Lz4()", obj)),
    };
    codec.validate().map_err(to_pyerr)?;
    Ok(codec)
}

/// One published leaf as `_publish` takes it from the Python layer: shape, itemsize, bytes.
pub(crate) type PublishedLeaf<'py> = (Vec<usize>, usize, numpy::PyReadonlyArray1<'py, u8>);

/// `_publish`'s arguments as the parameter store takes them: the leaves' spec, their
/// bytes, and the codec `compress` names (`None`: raw).
pub(crate) type PublishArgs<'a> = (crate::spec::DataSpec, Vec<&'a [u8]>, Option<Codec>);

/// [`PublishArgs`] from the Python layer's leaves and `compress`. Shared by both servers'
/// bindings.
pub(crate) fn publish_args<'a>(
    leaves: &'a [PublishedLeaf<'_>],
    compress: Option<&Bound<'_, PyAny>>,
) -> PyResult<PublishArgs<'a>> {
    let codec = compress.map(codec).transpose()?;
    let spec = leaves
        .iter()
        .map(|(shape, itemsize, _)| crate::spec::ArraySpec::new(shape.clone(), *itemsize))
        .collect::<Result<Vec<_>, _>>()
        .and_then(crate::spec::DataSpec::new)
        .map_err(to_pyerr)?;
    let bytes = leaves
        .iter()
        .map(|(_, _, data)| {
            data.as_slice().map_err(|e| PyValueError::new_err(format!("publish(): {e}")))
        })
        .collect::<PyResult<Vec<&[u8]>>>()?;
    Ok((spec, bytes, codec))
}

/// `codec` as the Python object `echo.Zstd(level, force=True)` or `echo.Lz4(force=True)`:
/// `force`, since a codec the core holds was accepted for its leaf already.
pub(crate) fn codec_object(py: Python<'_>, codec: Codec) -> PyResult<Py<PyAny>> {
    let made = match codec {
        Codec::Zstd { level } => codec_class(py, "Zstd")?.call1((level, true))?,
        Codec::Lz4 => codec_class(py, "Lz4")?.call1((true,))?,
    };
    Ok(made.unbind())
}

/// Checks a codec's values where the core defines them (called by `echo.Zstd` once its
/// fields have the right types): `ValueError` saying what is wrong.
#[pyfunction]
pub(crate) fn check_codec(codec: &Bound<'_, PyAny>) -> PyResult<()> {
    self::codec(codec).map(drop)
}

fn wrong_type(what: &str, expected: &str, obj: &Bound<'_, PyAny>) -> PyErr {
    let got = obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
    PyTypeError::new_err(format!("{what} must be {expected}, got {got}"))
}

fn strategy<T>(obj: &Bound<'_, PyAny>, kind: T) -> PyResult<Strategy<T>> {
    Ok(Strategy { kind, repr: obj.repr()?.to_string() })
}

/// `sampler=`: `Fifo()`, `Lifo()`, `Uniform()` or `Prioritized(exponent)`.
pub(crate) fn sampler(obj: &Bound<'_, PyAny>) -> PyResult<Strategy<SamplerArg>> {
    let kind = match which(obj, &["Fifo", "Lifo", "Uniform", "Prioritized"])? {
        Some("Fifo") => SamplerArg::Fifo,
        Some("Lifo") => SamplerArg::Replay(SamplerKind::Lifo),
        Some("Uniform") => SamplerArg::Replay(SamplerKind::Uniform),
        Some(_) => SamplerArg::Replay(SamplerKind::Prioritized {
            exponent: obj.getattr("exponent")?.extract()?,
        }),
        None => {
            return Err(wrong_type(
                "sampler",
                "Fifo(), Lifo(), Uniform() or Prioritized(exponent)",
                obj,
            ))
        }
    };
    strategy(obj, kind)
}

/// `remover=`: `Fifo()`, `Lifo()` or `MinPriority()`.
pub(crate) fn remover(obj: &Bound<'_, PyAny>) -> PyResult<Strategy<RemoverKind>> {
    let kind = match which(obj, &["Fifo", "Lifo", "MinPriority"])? {
        Some("Fifo") => RemoverKind::Fifo,
        Some("Lifo") => RemoverKind::Lifo,
        Some(_) => RemoverKind::MinPriority,
        None => return Err(wrong_type("remover", "Fifo(), Lifo() or MinPriority()", obj)),
    };
    strategy(obj, kind)
}

/// `rate_limiter=`: `MinSize(n)`, `SampleToInsertRatio(...)` or `Queue(size)`.
pub(crate) fn rate_limiter(obj: &Bound<'_, PyAny>) -> PyResult<Strategy<RateLimit>> {
    let kind = match which(obj, &["MinSize", "SampleToInsertRatio", "Queue"])? {
        Some("MinSize") => RateLimit::MinSize(obj.getattr("min_size")?.extract()?),
        Some("Queue") => RateLimit::Queue(obj.getattr("size")?.extract()?),
        Some(_) => {
            let (min_diff, max_diff) = obj.getattr("window")?.extract()?;
            RateLimit::SampleToInsertRatio {
                samples_per_insert: obj.getattr("samples_per_insert")?.extract()?,
                min_size_to_sample: obj.getattr("min_size_to_sample")?.extract()?,
                min_diff,
                max_diff,
            }
        }
        None => {
            return Err(wrong_type(
                "rate_limiter",
                "MinSize(n), SampleToInsertRatio(...) or Queue(size)",
                obj,
            ))
        }
    };
    strategy(obj, kind)
}

/// Checks a strategy's values where the core defines them (called by the strategy
/// dataclasses once their fields have the right types): `ValueError` saying what is wrong.
#[pyfunction]
pub(crate) fn check_strategy(strategy: &Bound<'_, PyAny>) -> PyResult<()> {
    if which(strategy, &["Sequence"])?.is_some() {
        return sequence_arg(strategy).map(drop);
    }
    if which(strategy, &["MinSize", "SampleToInsertRatio", "Queue"])?.is_some() {
        return rate_limiter(strategy)?.kind.check().map_err(to_pyerr);
    }
    if which(strategy, &["Prioritized"])?.is_some() {
        if let SamplerArg::Replay(kind) = sampler(strategy)?.kind {
            return kind.check().map_err(to_pyerr);
        }
    }
    Ok(())
}
