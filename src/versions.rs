//! Policy versions on samples: which version of the learner's parameters produced each
//! sample, and the staleness bound that keeps samples of too old a policy from the learner.
//!
//! A server that keeps versions stores one more leaf after the sample's: the version, a
//! little-endian `u64` ([`version_leaf`]). It travels in the sample's payload like any leaf
//! (a v2 client that agreed on it appends it; in-process inserts have it appended), so every
//! path into the backend (frames, shared memory, the in-place read, checkpoints) carries it
//! without knowing what it means. Batches hand it out as `Sample.versions`.
//!
//! With a bound `k` ([`PolicyVersions::max_staleness`]) a sample of version `v` is stale once
//! the latest published version exceeds `v + k`. A stale sample never reaches the learner:
//! inserts drop it ([`Fresh`], counted in `stale_at_insert`), and a replay table removes an
//! item that became stale while it waited when a draw meets it (`stale_at_sample`). Versions
//! only grow, so a stale sample never becomes fresh again, and each is counted once.

use crate::metrics::Counter;
use crate::source::{SampleSource, StepTag};
use crate::spec::ArraySpec;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Bytes of the version leaf.
pub const VERSION_BYTES: usize = 8;
/// The version leaf's name in a v2 layout.
pub const VERSION_LEAF_NAME: &str = "policy_version";

/// The version leaf: one little-endian `u64` per sample.
pub fn version_leaf() -> ArraySpec {
    ArraySpec::new(Vec::new(), VERSION_BYTES).expect("an 8-byte scalar")
}

/// What a server does with samples older than its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Stale samples are dropped (at insert) or skipped (at sample time) and counted.
    Drop,
    /// As `Drop`, and a v2 client whose attached version is more than the bound behind the
    /// latest blocks in `send` until it has newer parameters: stale samples are not made.
    Block,
}

/// How a server keeps policy versions: its bound, and what happens to stale samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionsConfig {
    /// A sample more than this many versions behind the latest is stale (`None`: no bound,
    /// versions are only recorded).
    pub max_staleness: Option<u64>,
    /// What happens to stale samples.
    pub admission: Admission,
}

/// A server's policy-version settings and counters, shared by its backend (which checks
/// them) and its transport (which tells clients the bound).
pub struct PolicyVersions {
    /// The latest version the learner published (0: none yet).
    latest: AtomicU64,
    max_staleness: Option<u64>,
    admission: Admission,
    /// The version leaf's index in the backend's spec (its last leaf).
    leaf: usize,
    stale_at_insert: Counter,
    stale_at_sample: Counter,
    /// Samples handed to the learner with a version, the sum of their lags behind the
    /// latest version when handed out, and the largest lag.
    handed: Counter,
    lag_sum: Counter,
    lag_max: Counter,
}

impl std::fmt::Debug for PolicyVersions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyVersions")
            .field("max_staleness", &self.max_staleness)
            .field("admission", &self.admission)
            .finish_non_exhaustive()
    }
}

/// What [`PolicyVersions::counts`] reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StaleCounts {
    /// Samples dropped as they went in: older than the bound already.
    pub at_insert: u64,
    /// Items removed when a draw met them: they became stale while they waited.
    pub at_sample: u64,
    /// Samples (steps of windows) handed to the learner with a version.
    pub handed: u64,
    /// The sum of their lags behind the latest version as they were handed out.
    pub lag_sum: u64,
    /// The largest such lag.
    pub lag_max: u64,
}

impl PolicyVersions {
    /// Versions stored in leaf `leaf`, bounded by `max_staleness` (`None`: kept, never
    /// dropped); none published yet.
    pub fn new(leaf: usize, max_staleness: Option<u64>, admission: Admission) -> Self {
        Self {
            latest: AtomicU64::new(0),
            max_staleness,
            admission,
            leaf,
            stale_at_insert: Counter::new(0),
            stale_at_sample: Counter::new(0),
            handed: Counter::new(0),
            lag_sum: Counter::new(0),
            lag_max: Counter::new(0),
        }
    }

    /// The bound: a sample more than this many versions behind the latest is stale.
    pub fn max_staleness(&self) -> Option<u64> {
        self.max_staleness
    }

    /// What happens to stale samples.
    pub fn admission(&self) -> Admission {
        self.admission
    }

    /// The version leaf's index in the backend's spec.
    pub fn leaf(&self) -> usize {
        self.leaf
    }

    /// The latest published version (0: none yet).
    pub fn latest(&self) -> u64 {
        // ORDERING: Relaxed — a bound read on its own: an insert racing a publish may judge
        // by the version before it, as if it had run a moment earlier.
        self.latest.load(Relaxed)
    }

    /// Records a publish of `version` (versions only grow).
    pub fn set_latest(&self, version: u64) {
        // ORDERING: Relaxed — see `latest`.
        self.latest.fetch_max(version, Relaxed);
    }

    /// The oldest version a sample may have to reach the learner now: 0 (any) without a
    /// bound, and with blocking admission, which keeps the bound at the source and drops
    /// nothing.
    pub fn floor(&self) -> u64 {
        match (self.max_staleness, self.admission) {
            (Some(k), Admission::Drop) => self.latest().saturating_sub(k),
            _ => 0,
        }
    }

    /// The version sample `sample` of `src` carries in its version leaf.
    pub fn version_of(&self, src: &(impl SampleSource + ?Sized), sample: usize) -> u64 {
        read_version(src, sample, self.leaf)
    }

    /// Counts `n` samples dropped at insert.
    pub fn note_stale_at_insert(&self, n: u64) {
        self.stale_at_insert.add(n);
    }

    /// Counts `n` items removed at sample time.
    pub fn note_stale_at_sample(&self, n: u64) {
        self.stale_at_sample.add(n);
    }

    /// Counts a batch handed to the learner: `versions` are its samples' (little-endian
    /// `u64`s, as the version leaf holds them); their lags are taken against the latest now.
    /// Versions of 0 beside a latest of 0 (nothing published) lag 0.
    pub fn note_handed(&self, versions: &[u8]) {
        let latest = self.latest();
        let (mut n, mut sum, mut max) = (0u64, 0u64, 0u64);
        for v in versions.chunks_exact(VERSION_BYTES) {
            let lag = latest.saturating_sub(u64::from_le_bytes(v.try_into().expect("8 bytes")));
            (n, sum, max) = (n + 1, sum.saturating_add(lag), max.max(lag));
        }
        self.handed.add(n);
        self.lag_sum.add(sum);
        if max > self.lag_max.get() {
            // Only the consumer (one thread, under the server's consumer lock) writes it.
            self.lag_max.set(max);
        }
    }

    /// The counters.
    pub fn counts(&self) -> StaleCounts {
        StaleCounts {
            at_insert: self.stale_at_insert.get(),
            at_sample: self.stale_at_sample.get(),
            handed: self.handed.get(),
            lag_sum: self.lag_sum.get(),
            lag_max: self.lag_max.get(),
        }
    }

    /// The samples of `src` that are not stale now, as a source over them, or `None` when
    /// every sample is fresh (insert `src` itself). Once the insert returned, count the stale
    /// ones it went past with [`Fresh::stale_consumed`] (an insert cut short by a deadline
    /// goes on later with the rest, which is judged again then).
    pub fn fresh<'a, S: SampleSource + ?Sized>(&self, src: &'a S) -> Option<Fresh<'a, S>> {
        let floor = self.floor();
        if floor == 0 {
            return None;
        }
        let n = src.num_samples();
        let kept: Vec<usize> = (0..n).filter(|&i| self.version_of(src, i) >= floor).collect();
        if kept.len() == n {
            return None;
        }
        Some(Fresh { src, kept, consumed: AtomicUsize::new(0) })
    }
}

/// The version in leaf `leaf` of sample `sample` of `src` (0 if the leaf is not 8 bytes).
pub fn read_version(src: &(impl SampleSource + ?Sized), sample: usize, leaf: usize) -> u64 {
    let mut bytes = [0u8; VERSION_BYTES];
    if src.leaf_len(sample, leaf) != VERSION_BYTES {
        return 0;
    }
    src.copy_leaf(sample, leaf, &mut bytes);
    u64::from_le_bytes(bytes)
}

/// The fresh samples of a source, in order: what an insert puts in when some were stale. The
/// source's [`SampleSource::inserted`] still hears of every sample it gave, the stale ones as
/// the kept ones around them go in (so the ingress's counts and durable marks stay exact).
pub struct Fresh<'a, S: ?Sized> {
    src: &'a S,
    /// The indices (in `src`) of the samples kept.
    kept: Vec<usize>,
    /// Samples of `src` reported to its `inserted` so far.
    consumed: AtomicUsize,
}

impl<S: SampleSource + ?Sized> Fresh<'_, S> {
    /// Reports every sample of `src` as consumed when none is kept (the backend, given no
    /// sample, reports none): call once the insert returned.
    pub fn finish(&self) {
        // ORDERING: Relaxed — only the inserting thread calls `inserted` and this (the
        // backends call `inserted` on the thread that inserts).
        let consumed = self.consumed.load(Relaxed);
        let n = self.src.num_samples();
        if self.kept.is_empty() && consumed < n {
            // ORDERING: Relaxed — as the load above.
            self.consumed.store(n, Relaxed);
            self.src.inserted(n - consumed);
        }
    }

    /// The stale samples among those consumed so far: what the insert dropped.
    pub fn stale_consumed(&self) -> usize {
        let consumed = self.consumed();
        consumed - self.kept.iter().take_while(|&&i| i < consumed).count()
    }

    /// Samples of `src` that went in or were dropped so far: where an insert that stopped
    /// part-way (a timeout) goes on.
    pub fn consumed(&self) -> usize {
        // ORDERING: Relaxed — see `finish`.
        self.consumed.load(Relaxed)
    }
}

impl<S: SampleSource + ?Sized> SampleSource for Fresh<'_, S> {
    fn num_samples(&self) -> usize {
        self.kept.len()
    }
    fn num_leaves(&self, sample: usize) -> usize {
        self.src.num_leaves(self.kept[sample])
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        self.src.leaf(self.kept[sample], leaf)
    }
    fn priority(&self, sample: usize) -> Option<f64> {
        self.src.priority(self.kept[sample])
    }
    fn leaf_len(&self, sample: usize, leaf: usize) -> usize {
        self.src.leaf_len(self.kept[sample], leaf)
    }
    fn copy_leaf(&self, sample: usize, leaf: usize, dst: &mut [u8]) {
        self.src.copy_leaf(self.kept[sample], leaf, dst);
    }
    fn inserted(&self, count: usize) {
        // The kept samples `0..done` are in: every sample of `src` before the next kept one
        // is consumed (the stale ones between are dropped).
        // ORDERING: Relaxed — see `finish`.
        let before = self.consumed.load(Relaxed);
        let done = self.kept.iter().take_while(|&&i| i < before).count() + count;
        let upto = self.kept.get(done).copied().unwrap_or_else(|| self.src.num_samples());
        if upto > before {
            // ORDERING: Relaxed — as the load above.
            self.consumed.store(upto, Relaxed);
            self.src.inserted(upto - before);
        }
    }
    fn packed(&self, sample: usize) -> Option<&[u8]> {
        self.src.packed(self.kept[sample])
    }
    fn step(&self, sample: usize) -> StepTag {
        self.src.step(self.kept[sample])
    }
}

/// In-process samples with the version leaf appended: every sample of `src` (which has the
/// sample's leaves only) carries `version`.
pub struct Stamped<'a> {
    src: &'a dyn SampleSource,
    version: [u8; VERSION_BYTES],
}

impl<'a> Stamped<'a> {
    /// `src`'s samples, each of version `version`.
    pub fn new(src: &'a dyn SampleSource, version: u64) -> Self {
        Self { src, version: version.to_le_bytes() }
    }

    fn is_version(&self, sample: usize, leaf: usize) -> bool {
        leaf == self.src.num_leaves(sample)
    }
}

impl SampleSource for Stamped<'_> {
    fn num_samples(&self) -> usize {
        self.src.num_samples()
    }
    fn num_leaves(&self, sample: usize) -> usize {
        self.src.num_leaves(sample) + 1
    }
    fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
        if self.is_version(sample, leaf) {
            return &self.version;
        }
        self.src.leaf(sample, leaf)
    }
    fn priority(&self, sample: usize) -> Option<f64> {
        self.src.priority(sample)
    }
    fn leaf_len(&self, sample: usize, leaf: usize) -> usize {
        if self.is_version(sample, leaf) {
            return VERSION_BYTES;
        }
        self.src.leaf_len(sample, leaf)
    }
    fn copy_leaf(&self, sample: usize, leaf: usize, dst: &mut [u8]) {
        if self.is_version(sample, leaf) {
            dst.copy_from_slice(&self.version);
            return;
        }
        self.src.copy_leaf(sample, leaf, dst);
    }
    fn inserted(&self, count: usize) {
        self.src.inserted(count);
    }
    fn step(&self, sample: usize) -> StepTag {
        self.src.step(sample)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Payloads;
    use crate::spec::DataSpec;
    use std::cell::Cell;

    struct Counting<'a> {
        payloads: Payloads<'a, Vec<u8>>,
        inserted: Cell<usize>,
    }

    impl SampleSource for Counting<'_> {
        fn num_samples(&self) -> usize {
            self.payloads.num_samples()
        }
        fn num_leaves(&self, sample: usize) -> usize {
            self.payloads.num_leaves(sample)
        }
        fn leaf(&self, sample: usize, leaf: usize) -> &[u8] {
            self.payloads.leaf(sample, leaf)
        }
        fn inserted(&self, count: usize) {
            self.inserted.set(self.inserted.get() + count);
        }
    }

    fn payload(id: u8, version: u64) -> Vec<u8> {
        let mut p = vec![id];
        p.extend_from_slice(&version.to_le_bytes());
        p
    }

    #[test]
    fn stale_samples_are_left_out_and_still_reported_as_consumed() {
        let spec =
            DataSpec::new(vec![ArraySpec::new(vec![1], 1).unwrap(), version_leaf()]).unwrap();
        let versions = PolicyVersions::new(1, Some(2), Admission::Drop);
        versions.set_latest(10);
        assert_eq!(versions.floor(), 8);
        let raw: Vec<Vec<u8>> = [(0, 7), (1, 9), (2, 3), (3, 8), (4, 1), (5, 2)]
            .iter()
            .map(|&(id, v)| payload(id, v))
            .collect();
        let src =
            Counting { payloads: Payloads::new(&spec, &raw).unwrap(), inserted: Cell::new(0) };
        let fresh = versions.fresh(&src).expect("some are stale");
        let ids: Vec<u8> = (0..fresh.num_samples()).map(|i| fresh.leaf(i, 0)[0]).collect();
        assert_eq!(ids, [1, 3]);
        fresh.inserted(1); // sample 1 in: samples 0 and 1 consumed, 2 (stale) too up to 3
        assert_eq!(src.inserted.get(), 3);
        assert_eq!(fresh.stale_consumed(), 2);
        fresh.inserted(1); // sample 3 in: everything
        assert_eq!(src.inserted.get(), 6);
        fresh.finish();
        assert_eq!(src.inserted.get(), 6);
        assert_eq!(fresh.stale_consumed(), 4);
    }

    #[test]
    fn an_all_stale_source_is_reported_by_finish() {
        let spec = DataSpec::new(vec![version_leaf()]).unwrap();
        let versions = PolicyVersions::new(0, Some(0), Admission::Drop);
        versions.set_latest(5);
        let raw = vec![1u64.to_le_bytes().to_vec(), 4u64.to_le_bytes().to_vec()];
        let src =
            Counting { payloads: Payloads::new(&spec, &raw).unwrap(), inserted: Cell::new(0) };
        let fresh = versions.fresh(&src).unwrap();
        assert_eq!(fresh.num_samples(), 0);
        fresh.finish();
        assert_eq!(src.inserted.get(), 2);
        assert_eq!(fresh.stale_consumed(), 2);
        let raw = vec![5u64.to_le_bytes().to_vec()];
        let src =
            Counting { payloads: Payloads::new(&spec, &raw).unwrap(), inserted: Cell::new(0) };
        assert!(versions.fresh(&src).is_none(), "the latest version is fresh");
    }
}
