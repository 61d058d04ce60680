//! What `RingServer` (FIFO store) and `ReplayTable` share: the TCP ingress slot, the blocking
//! insert loop, the numpy layouts of a batch and the counters snapshot.

use std::sync::OnceLock;
use std::time::Instant;

use numpy::npyffi::npy_intp;
use parking_lot::{Mutex, MutexGuard};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::errors::{insert_error, sample_timeout, to_pyerr, ServerClosedError};
use super::info::{HistSnapshot, SampleInfo};
use super::leaves::LeafSpecs;
use super::views::LeafLayout;
use super::{detach, wait_detached};
use crate::ingress::{Ingress, IngressConfig};
use crate::metrics::{self, DetailedSnapshot};
use crate::replay::{ReplayBatch, ReplayConsumer, ReplayStats};
use crate::store::{Consumer, InsertError, SampleError, Sink, StoreStats};
use crate::sync::Arc;
use crate::transport::tcp::TcpConfig;
use crate::transport::TcpIngress;

/// Samples at or above this many bytes are copied with the GIL released.
pub(crate) const DETACH_COPY_BYTES: usize = 64 * 1024;

/// The numpy layout of every leaf of a batch: `[batch_size, *leaf_shape]` with its dtype.
pub(crate) fn batch_layouts(
    py: Python<'_>,
    leaves: &LeafSpecs,
    batch_size: usize,
) -> PyResult<Vec<LeafLayout>> {
    leaves
        .shapes
        .iter()
        .zip(&leaves.descrs)
        .map(|(shape, descr)| {
            let dims = std::iter::once(batch_size)
                .chain(shape.iter().copied())
                .map(|d| {
                    npy_intp::try_from(d)
                        .map_err(|_| PyValueError::new_err(format!("dimension {d} is too large")))
                })
                .collect::<PyResult<Vec<_>>>()?;
            Ok(LeafLayout { descr: descr.clone_ref(py), dims })
        })
        .collect()
}

/// Runs `insert(deadline)` (one sample, or a few) until it succeeds: first without releasing
/// the GIL when the sample is small (the common case of free room costs no thread switch),
/// then in GIL-free slices that honour Ctrl-C, until `deadline`.
pub(crate) fn insert_blocking(
    py: Python<'_>,
    payload_size: usize,
    deadline: Option<Instant>,
    insert: impl Fn(Option<Instant>) -> Result<(), InsertError> + Sync,
) -> PyResult<()> {
    if payload_size < DETACH_COPY_BYTES {
        match insert(Some(Instant::now())) {
            Ok(()) => return Ok(()),
            Err(InsertError::TimedOut { inserted: 0 }) => {}
            Err(err) => return Err(insert_error(err)),
        }
    }
    let done = wait_detached(py, deadline, |slice_end| match insert(Some(slice_end)) {
        Ok(()) => Some(Ok(())),
        Err(InsertError::TimedOut { inserted: 0 }) => None,
        Err(err) => Some(Err(err)),
    })?;
    match done {
        Some(Ok(())) => Ok(()),
        Some(Err(err)) => Err(insert_error(err)),
        None => Err(insert_error(InsertError::TimedOut { inserted: 0 })),
    }
}

/// A consumer that `sample()` waits on: the FIFO store's or a replay table's.
pub(crate) trait BlockingSample: Send {
    /// What a successful sample hands back.
    type Batch: Send;
    /// Waits until `deadline` for the next batch.
    fn sample_until(&mut self, deadline: Instant) -> Result<Self::Batch, SampleError>;
}

impl BlockingSample for Consumer {
    type Batch = u64;
    fn sample_until(&mut self, deadline: Instant) -> Result<u64, SampleError> {
        self.sample(Some(deadline))
    }
}

impl BlockingSample for ReplayConsumer {
    type Batch = ReplayBatch;
    fn sample_until(&mut self, deadline: Instant) -> Result<ReplayBatch, SampleError> {
        self.sample(Some(deadline))
    }
}

/// Waits for `consumer`'s next batch in GIL-free slices that honour Ctrl-C. Returns the
/// consumer, still locked (so nobody samples over the batch while it is turned into arrays),
/// and the batch; `None` once the server is closed.
///
/// # Errors
/// `TimeoutError` when `deadline` passes first, `KeyboardInterrupt` on Ctrl-C.
pub(crate) fn sample_blocking<'a, C: BlockingSample>(
    py: Python<'_>,
    consumer: &'a Mutex<C>,
    deadline: Option<Instant>,
) -> PyResult<Option<(MutexGuard<'a, C>, C::Batch)>> {
    // The mutex serialises `sample()` calls from several Python threads; it is only ever
    // taken with the GIL released, so it cannot deadlock against the GIL.
    let got = wait_detached(py, deadline, |slice_end| {
        let mut guard = consumer.try_lock_until(slice_end)?;
        match guard.sample_until(slice_end) {
            Ok(batch) => Some(Ok((guard, batch))),
            Err(SampleError::Closed) => Some(Err(SampleError::Closed)),
            Err(SampleError::TimedOut) => None,
        }
    })?;
    match got {
        Some(Ok(held)) => Ok(Some(held)),
        Some(Err(_closed)) => Ok(None),
        None => Err(sample_timeout(SampleError::TimedOut)),
    }
}

/// The TCP ingress of a server, once started.
#[derive(Default)]
pub(crate) struct TcpSlot {
    tcp: Mutex<Option<TcpIngress>>,
    /// The drainer pool behind `tcp`, for counters (kept after `close`).
    ingress: OnceLock<Arc<Ingress>>,
}

impl TcpSlot {
    /// Starts the drainer pool and the TCP server feeding `sink`; returns the bound port.
    #[allow(clippy::too_many_arguments)] // one per Python keyword argument
    pub(crate) fn start(
        &self,
        py: Python<'_>,
        sink: Arc<dyn Sink>,
        closed: bool,
        host: String,
        port: u16,
        num_threads: usize,
        max_connections: usize,
        num_drainers: usize,
        queue_size: usize,
    ) -> PyResult<u16> {
        if closed {
            return Err(ServerClosedError::new_err("start(): the server is closed"));
        }
        let mut slot = self.tcp.lock();
        if slot.is_some() || self.ingress.get().is_some() {
            return Err(PyValueError::new_err("start(): the TCP transport is already running"));
        }
        let config = TcpConfig { host, port, num_threads, max_connections };
        let started = detach(py, || {
            TcpIngress::start(sink, IngressConfig { num_drainers, queue_size }, &config)
        })
        .map_err(to_pyerr)?;
        let port = started.local_addr().port();
        let _ = self.ingress.set(started.ingress());
        *slot = Some(started);
        Ok(port)
    }

    /// Stops the transport (if running) and joins its threads; `close_sink` runs first, with
    /// the GIL released, so drainers blocked on a full sink return.
    pub(crate) fn close(&self, py: Python<'_>, close_sink: impl FnOnce() + Send) {
        let tcp = self.tcp.lock().take();
        detach(py, move || {
            close_sink();
            drop(tcp); // shuts the transport down and joins its threads
        });
    }

    /// Stops the transport without the GIL dance (for `Drop`).
    pub(crate) fn shutdown(&self) {
        drop(self.tcp.lock().take());
    }

    pub(crate) fn reset_histograms(&self) {
        if let Some(ingress) = self.ingress.get() {
            ingress.reset_histograms();
        }
    }

    /// A `SampleInfo` from the sink's counters plus the ingress's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn info(
        &self,
        py: Python<'_>,
        stats: &StoreStats,
        replay: &ReplayStats,
        detailed: Option<DetailedSnapshot>,
        sequence: u64,
        wait_ns: u64,
        zero_hist: &Py<HistSnapshot>,
    ) -> PyResult<SampleInfo> {
        let ingress = self.ingress.get().map(|i| i.snapshot()).unwrap_or_default();
        let detailed = metrics::ENABLED.then(|| {
            let mut d = detailed.unwrap_or_default();
            if let Some(ingress) = self.ingress.get() {
                (d.drain_round, d.queue_dwell) = ingress.detailed();
            }
            d
        });
        SampleInfo::new(
            py,
            stats,
            replay,
            &ingress,
            detailed.as_ref(),
            sequence,
            wait_ns,
            zero_hist,
        )
    }
}
