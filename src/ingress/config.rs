//! The ingress's settings ([`IngressConfig`]): drainers, queue sizes, the idle park and the
//! byte budget, checked once by [`IngressConfig::validate`] before the ingress starts.

use std::thread;
use std::time::Duration;

use crate::error::EchoError;

/// The `log` target of everything the ingress logs: the logger `echo.ingress` in Python,
/// whichever file of the module the record comes from (the user guides name it).
pub(crate) const LOG_TARGET: &str = "echo::ingress";

/// Ingress settings. Build them with [`IngressConfig::new`], then change fields as needed.
#[derive(Debug, Clone, Copy)]
pub struct IngressConfig {
    /// The most drainer threads to run. [`Ingress::start`](super::Ingress::start) runs at
    /// most one per available CPU: more drainers than cores only race each other for ring
    /// space and serve connections unevenly (measured: same throughput, 3x the spread between
    /// connections).
    pub num_drainers: usize,
    /// Capacity of each connection's queue, in samples.
    pub queue_size: usize,
    /// How long an idle drainer sleeps before looking again on its own; `None`: until woken.
    /// Wake-ups are explicit, so this only bounds the cost of a lost one (a bug). Tests set
    /// `None` so that a lost wake-up hangs and their watchdog catches it.
    pub idle_park: Option<Duration>,
    /// The most bytes of sample buffers all connections together may hold: samples queued
    /// (acknowledged, not yet in the backend), in a drainer's round, being read, and each
    /// connection's pool of empty buffers. At the bound a connection that needs a new buffer
    /// waits (it stops reading, so it stops acknowledging) until buffers are freed; nothing
    /// acknowledged is ever dropped. At least one sample's bytes.
    pub max_buffered_bytes: usize,
}

impl IngressConfig {
    /// The default [`IngressConfig::idle_park`]: 100 ms.
    pub const DEFAULT_IDLE_PARK: Duration = Duration::from_millis(100);

    /// The largest [`IngressConfig::queue_size`]: every connection allocates its queue and
    /// pool (`2 * queue_size + 1` pointers) up front, so an absurd size must fail here.
    pub const MAX_QUEUE_SIZE: usize = 1 << 16;

    /// The default [`IngressConfig::max_buffered_bytes`]: 1 GiB.
    pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 1 << 30;

    /// Bytes of samples [`IngressConfig::queue_size_for`] lets one connection queue.
    pub const AUTO_QUEUE_BYTES: usize = 64 << 10;

    /// The queue size used when none is given: enough samples for [`Self::AUTO_QUEUE_BYTES`],
    /// at least 8 and at most 256. A connection's task stops reading when its queue is full,
    /// until its drainer has popped it; a queue of 8 small samples makes that round trip (a
    /// drainer wake-up) the limit of one connection (measured: `send_batch` of 64 ~120-byte
    /// rows went 2.4x per-row `send` with 8, 13.6x with 256). Large samples keep 8: their
    /// copy, not the wake-up, is the limit, and 8 of them already hold ~1.6 MB at 200 KB.
    pub fn queue_size_for(payload_size: usize) -> usize {
        (Self::AUTO_QUEUE_BYTES / payload_size.max(1)).clamp(8, 256)
    }

    /// `num_drainers` drainers, queues of `queue_size`, the default `idle_park` and
    /// `max_buffered_bytes`.
    pub fn new(num_drainers: usize, queue_size: usize) -> Self {
        Self {
            num_drainers,
            queue_size,
            idle_park: Some(Self::DEFAULT_IDLE_PARK),
            max_buffered_bytes: Self::DEFAULT_MAX_BUFFERED_BYTES,
        }
    }

    /// Drainer threads actually started: `num_drainers`, capped at the available CPUs.
    pub fn effective_drainers(&self) -> usize {
        let cpus = thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        self.num_drainers.min(cpus).max(1)
    }

    /// Checks the values for samples of `payload_size` bytes.
    ///
    /// # Errors
    /// [`EchoError::Config`] if a count is zero or the byte bound holds no sample.
    pub fn validate(&self, payload_size: usize) -> Result<(), EchoError> {
        if self.num_drainers == 0 {
            return Err(EchoError::Config("the ingress needs at least 1 drainer, got 0".into()));
        }
        if self.queue_size == 0 || self.queue_size > Self::MAX_QUEUE_SIZE {
            return Err(EchoError::Config(format!(
                "a connection queue holds 1 to {} samples, got {}",
                Self::MAX_QUEUE_SIZE,
                self.queue_size
            )));
        }
        if self.max_buffered_bytes < payload_size {
            return Err(EchoError::Config(format!(
                "max_buffered_bytes ({}) must hold at least one sample ({payload_size} bytes)",
                self.max_buffered_bytes
            )));
        }
        Ok(())
    }
}
