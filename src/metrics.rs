//! Detailed metrics: CAS counters and latency histograms, behind the `detailed-metrics` cargo
//! feature.
//!
//! The rule: hot paths never touch atomics or histograms directly; they call the methods here.
//! Without the feature every type is zero-sized and every method an empty `#[inline]` body, so
//! call sites need no `#[cfg]` and the default build pays nothing (not even a timestamp).
//!
//! Always-on statistics (notify count, ingress depths, ...) live with the code that owns them
//! (`store`, `ingress`) but all go through one small type, `Counter`, so the one reason
//! their atomics may be `Relaxed` is written down once.

use crate::sync::AtomicU64;

use std::sync::atomic::Ordering::Relaxed;

/// A histogram summary in nanoseconds. All zero when nothing was recorded or the feature is off.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HistSummary {
    /// Samples recorded.
    pub count: u64,
    /// Smallest value.
    pub min_ns: u64,
    /// Largest value.
    pub max_ns: u64,
    /// Mean value.
    pub mean_ns: f64,
    /// Median.
    pub p50_ns: u64,
    /// 90th percentile.
    pub p90_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
}

/// The detailed counters and histograms at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DetailedSnapshot {
    /// Successful write-cursor CAS operations (one per reservation).
    pub cas_success_total: u64,
    /// Failed write-cursor CAS operations (another writer got there first).
    pub cas_failure_total: u64,
    /// Times a writer found the ring full and had to wait for the consumer.
    pub reservation_retries_total: u64,
    /// One drainer round: popping, inserting, recycling.
    pub drain_round: HistSummary,
    /// Copying one reservation's samples into the ring.
    pub memcpy: HistSummary,
    /// One sample's wait in its connection queue, push to pop.
    pub queue_dwell: HistSummary,
}

/// Whether this build records detailed metrics.
pub const ENABLED: bool = cfg!(feature = "detailed-metrics");

/// An always-on statistics value: an event count, or a gauge that one owner sets.
///
/// Every access is `Relaxed`, and that is the point of the type: a counter is only ever read
/// for a snapshot (`stats()`, `SampleInfo`) or a heuristic that tolerates a stale value (the
/// ingress's least-loaded drainer); it publishes no other memory, and no thread acts on its
/// value together with other memory. Atomicity (no lost updates) is all it needs. Anything
/// that synchronises must use a real atomic with its own `ORDERING:` reason instead.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    /// A counter starting at `value`.
    pub(crate) fn new(value: u64) -> Self {
        Self(AtomicU64::new(value))
    }

    #[inline]
    pub(crate) fn add(&self, n: u64) {
        // ORDERING: Relaxed — statistics (see the type's docs).
        self.0.fetch_add(n, Relaxed);
    }

    #[inline]
    pub(crate) fn sub(&self, n: u64) {
        // ORDERING: Relaxed — statistics (see the type's docs).
        self.0.fetch_sub(n, Relaxed);
    }

    #[inline]
    pub(crate) fn set(&self, value: u64) {
        // ORDERING: Relaxed — statistics (see the type's docs).
        self.0.store(value, Relaxed);
    }

    #[inline]
    pub(crate) fn get(&self) -> u64 {
        // ORDERING: Relaxed — statistics (see the type's docs).
        self.0.load(Relaxed)
    }
}

#[cfg(feature = "detailed-metrics")]
mod imp {
    use std::time::Instant;

    use crossbeam_utils::CachePadded;
    use hdrhistogram::Histogram;
    use parking_lot::Mutex;

    use super::{Counter, HistSummary};

    /// A point in time (a real `Instant` in this build).
    #[derive(Debug, Clone, Copy)]
    pub struct Stamp(Instant);

    impl Stamp {
        #[inline]
        pub fn now() -> Self {
            Self(Instant::now())
        }
    }

    /// A latency histogram, 1 ns to 60 s at 2 significant digits (1% resolution; keeps a
    /// snapshot's percentile scan in the microseconds).
    #[derive(Debug)]
    pub struct Histo(Mutex<Histogram<u64>>);

    impl Default for Histo {
        fn default() -> Self {
            Self::new()
        }
    }

    impl Histo {
        pub fn new() -> Self {
            let h = Histogram::new_with_bounds(1, 60_000_000_000, 2).expect("valid bounds");
            Self(Mutex::new(h))
        }

        /// Records the time elapsed since `start`.
        #[inline]
        pub fn record_since(&self, start: Stamp) {
            let ns = u64::try_from(start.0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.0.lock().saturating_record(ns);
        }

        pub fn reset(&self) {
            self.0.lock().reset();
        }

        pub fn summary(&self) -> HistSummary {
            summarize(Some(&*self.0.lock()))
        }
    }

    fn summarize(h: Option<&Histogram<u64>>) -> HistSummary {
        match h {
            Some(h) if !h.is_empty() => HistSummary {
                count: h.len(),
                min_ns: h.min(),
                max_ns: h.max(),
                mean_ns: h.mean(),
                p50_ns: h.value_at_quantile(0.50),
                p90_ns: h.value_at_quantile(0.90),
                p99_ns: h.value_at_quantile(0.99),
            },
            _ => HistSummary::default(),
        }
    }

    /// A detailed event counter on its own cache line.
    #[derive(Debug, Default)]
    pub struct DetailedCounter(CachePadded<Counter>);

    impl DetailedCounter {
        #[inline]
        pub fn add(&self, n: u64) {
            self.0.add(n);
        }

        pub fn get(&self) -> u64 {
            self.0.get()
        }
    }
}

#[cfg(not(feature = "detailed-metrics"))]
mod imp {
    use super::HistSummary;

    /// A point in time: nothing at all in this build.
    #[derive(Debug, Clone, Copy)]
    pub struct Stamp;

    impl Stamp {
        #[inline(always)]
        pub fn now() -> Self {
            Self
        }
    }

    /// A histogram that records nothing.
    #[derive(Debug, Default)]
    pub struct Histo;

    impl Histo {
        pub fn new() -> Self {
            Self
        }
        #[inline(always)]
        pub fn record_since(&self, _start: Stamp) {}
        pub fn reset(&self) {}
        pub fn summary(&self) -> HistSummary {
            HistSummary::default()
        }
    }

    /// A counter that counts nothing.
    #[derive(Debug, Default)]
    pub struct DetailedCounter;

    impl DetailedCounter {
        #[inline(always)]
        pub fn add(&self, _n: u64) {}
        pub fn get(&self) -> u64 {
            0
        }
    }
}

pub(crate) use imp::{DetailedCounter, Histo, Stamp};

/// The store's detailed metrics (writers record them).
#[derive(Debug, Default)]
pub(crate) struct StoreMetrics {
    pub(crate) cas_success: DetailedCounter,
    pub(crate) cas_failure: DetailedCounter,
    pub(crate) reservation_retries: DetailedCounter,
    pub(crate) memcpy: Histo,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_histograms_follow_the_feature() {
        let m = StoreMetrics::default();
        m.cas_success.add(3);
        let start = Stamp::now();
        for _ in 0..5 {
            m.memcpy.record_since(start);
        }
        let summary = m.memcpy.summary();
        if ENABLED {
            assert_eq!(m.cas_success.get(), 3);
            assert_eq!(summary.count, 5);
            assert!(summary.min_ns <= summary.p50_ns && summary.p50_ns <= summary.max_ns);
            m.memcpy.reset();
            assert_eq!(m.memcpy.summary().count, 0);
        } else {
            assert_eq!(m.cas_success.get(), 0);
            assert_eq!(summary, HistSummary::default());
            assert_eq!(std::mem::size_of::<StoreMetrics>(), 0, "the default build pays nothing");
        }
    }
}
