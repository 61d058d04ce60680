//! The byte budget: the bound on the bytes of sample buffers every connection together holds
//! ([`IngressConfig::max_buffered_bytes`](super::IngressConfig::max_buffered_bytes)), the
//! connections waiting for some to be freed, and the share of it shared-memory segments
//! reserve ([`SegmentReservation`]).

use std::sync::Weak;

use parking_lot::Mutex;

use super::{Connection, Ingress};
use crate::metrics::Counter;
use crate::sync::{Arc, AtomicUsize};

use std::sync::atomic::Ordering::Relaxed;

/// The bound on the bytes of sample buffers every connection together holds
/// ([`IngressConfig::max_buffered_bytes`](super::IngressConfig::max_buffered_bytes)), and the
/// connections waiting for some to be freed.
pub(super) struct ByteBudget {
    pub(super) limit: usize,
    /// Bytes of buffers that exist now.
    pub(super) allocated: AtomicUsize,
    /// Connections that found the budget spent, each once: woken on every release. A
    /// connection registers and makes its last try under this lock; a release returns its
    /// bytes and then always takes the lock to wake. So either the release's lock comes after
    /// the registration (the connection is woken), or before it, and then the last try, which
    /// the lock orders after the returned bytes, sees them. No lost wake-up.
    pub(super) waiting: Mutex<Vec<Weak<Connection>>>,
    /// `waiting.len()`, readable without the lock: a hint for recycling drainers, which free
    /// buffers instead of pooling them while somebody waits.
    pub(super) num_waiting: Counter,
    /// Of `allocated`, the bytes of shared-memory segments ([`Ingress::reserve_segment`]): at
    /// most half of `limit`, so pooled buffers for TCP connections always have the rest.
    pub(super) segments: AtomicUsize,
}

impl ByteBudget {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            limit,
            allocated: AtomicUsize::new(0),
            waiting: Mutex::new(Vec::new()),
            num_waiting: Counter::default(),
            segments: AtomicUsize::new(0),
        }
    }

    /// The most bytes shared-memory segments may hold together.
    pub(super) fn segment_limit(&self) -> usize {
        self.limit / 2
    }

    /// Takes `bytes` for a segment if they fit under both limits.
    pub(super) fn try_take_segment(&self, bytes: usize) -> bool {
        let limit = self.segment_limit();
        // ORDERING: Relaxed — as in `try_take`: a bound on allocation that publishes nothing.
        let fits = self
            .segments
            .fetch_update(Relaxed, Relaxed, |a| a.checked_add(bytes).filter(|&n| n <= limit))
            .is_ok();
        if fits && !self.try_take(bytes) {
            // ORDERING: Relaxed — as above.
            self.segments.fetch_sub(bytes, Relaxed);
            return false;
        }
        fits
    }

    pub(super) fn segments(&self) -> usize {
        // ORDERING: Relaxed — a statistics read.
        self.segments.load(Relaxed)
    }

    /// Takes `bytes` if they fit under the limit.
    pub(super) fn try_take(&self, bytes: usize) -> bool {
        // ORDERING: Relaxed — the count only bounds allocation (every read-modify-write sees
        // the latest value, so the bound holds); it publishes no memory. The wake-up protocol
        // relies on the `waiting` lock, not on this.
        self.allocated
            .fetch_update(Relaxed, Relaxed, |a| a.checked_add(bytes).filter(|&n| n <= self.limit))
            .is_ok()
    }

    /// Gives `bytes` back and wakes every waiting connection. Not on the steady-state path:
    /// buffers are pooled, and only freed when a connection closes or others wait for bytes.
    pub(super) fn release(&self, bytes: usize) {
        // ORDERING: Relaxed — see `try_take`; the `waiting` lock below orders it before a
        // registered connection's last try.
        self.allocated.fetch_sub(bytes, Relaxed);
        let waiting = {
            let mut guard = self.waiting.lock();
            self.num_waiting.set(0);
            std::mem::take(&mut *guard)
        };
        for conn in waiting.iter().filter_map(Weak::upgrade) {
            conn.waker.wake();
        }
    }

    /// `bytes`, or `false` after registering `conn` to be woken by the next release.
    pub(super) fn take_or_wait(&self, bytes: usize, conn: &Arc<Connection>) -> bool {
        if self.try_take(bytes) {
            return true;
        }
        let mut waiting = self.waiting.lock();
        if !waiting.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(conn))) {
            waiting.push(Arc::downgrade(conn));
            self.num_waiting.set(waiting.len() as u64);
        }
        // Under the lock (see `waiting`): a release before the registration woke nobody, but
        // its bytes are seen here.
        self.try_take(bytes)
    }

    pub(super) fn allocated(&self) -> usize {
        // ORDERING: Relaxed — a statistics read.
        self.allocated.load(Relaxed)
    }
}

/// Bytes of the ingress's byte budget held for a buffer outside the connections' pools: a
/// compressed frame's body as it is read ([`Connection::grow_hold`](super::Connection::grow_hold)),
/// or the compressed leaves a sample carries to a table that keeps them ([`Packed`]). Given
/// back, waking connections that wait for bytes, when dropped.
pub struct BudgetHold {
    budget: Arc<ByteBudget>,
    bytes: usize,
}

impl BudgetHold {
    pub(super) fn new(budget: &Arc<ByteBudget>) -> Self {
        Self { budget: Arc::clone(budget), bytes: 0 }
    }

    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Adds `more` bytes, or `false` after registering `conn` to be woken by the next release.
    pub(super) fn grow_or_wait(&mut self, more: usize, conn: &Arc<Connection>) -> bool {
        let grown = self.budget.take_or_wait(more, conn);
        if grown {
            self.bytes += more;
        }
        grown
    }

    /// The byte budget's limit (`max_buffered_bytes`).
    pub fn limit(&self) -> usize {
        self.budget.limit
    }
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.release(self.bytes);
        }
    }
}

impl std::fmt::Debug for BudgetHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BudgetHold").field("bytes", &self.bytes).finish()
    }
}

/// A sample's compressed leaves as they arrived, kept for a table that stores them so,
/// counted in the byte budget until the drainer has inserted them (and dropped this).
#[derive(Debug)]
pub struct Packed {
    bytes: Box<[u8]>,
    _hold: BudgetHold,
}

impl Packed {
    /// `bytes`, whose length `hold` holds.
    pub fn new(bytes: Box<[u8]>, hold: BudgetHold) -> Self {
        debug_assert_eq!(bytes.len(), hold.bytes());
        Self { bytes, _hold: hold }
    }
}

impl std::ops::Deref for Packed {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Bytes of the ingress's byte budget held by one shared-memory segment, from
/// [`Ingress::reserve_segment`]; given back (waking connections that wait for bytes) when
/// dropped, with the segment.
pub struct SegmentReservation {
    budget: Arc<ByteBudget>,
    bytes: usize,
}

impl Drop for SegmentReservation {
    fn drop(&mut self) {
        // ORDERING: Relaxed — see `ByteBudget::try_take`.
        self.budget.segments.fetch_sub(self.bytes, Relaxed);
        self.budget.release(self.bytes);
    }
}

impl std::fmt::Debug for SegmentReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentReservation").field("bytes", &self.bytes).finish()
    }
}

impl Ingress {
    /// Reserves `bytes` of the byte budget (`max_buffered_bytes`) for a shared-memory
    /// segment, which holds its samples as pooled buffers hold TCP's. Segments together get
    /// at most half of the budget, so TCP connections always have the other half; beyond
    /// that (or when the budget is spent) the connection uses TCP, and the error says why.
    ///
    /// # Errors
    /// Why the bytes are not available, for the client's log and `SharedMemoryError`.
    pub fn reserve_segment(&self, bytes: usize) -> Result<SegmentReservation, String> {
        if self.budget.try_take_segment(bytes) {
            return Ok(SegmentReservation { budget: Arc::clone(&self.budget), bytes });
        }
        Err(self
            .segment_shortfall(bytes)
            .unwrap_or_else(|| "the byte budget was just spent".into()))
    }

    /// Whether a segment of `bytes` would fit now ([`Ingress::reserve_segment`] without
    /// reserving): `None`, or why not.
    pub fn segment_shortfall(&self, bytes: usize) -> Option<String> {
        let (used, limit) = (self.budget.segments(), self.budget.segment_limit());
        if used.saturating_add(bytes) > limit {
            return Some(format!(
                "the learner's shared-memory segments already hold {used} of the {limit} bytes \
                 they may (half of max_buffered_bytes); a segment needs {bytes}"
            ));
        }
        let allocated = self.budget.allocated();
        (allocated.saturating_add(bytes) > self.budget.limit).then(|| {
            format!(
                "the learner's ingress buffers hold {allocated} of max_buffered_bytes ({}); a \
                 segment needs {bytes}",
                self.budget.limit
            )
        })
    }
}
