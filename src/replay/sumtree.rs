//! A sum tree over a fixed number of non-negative priorities: the index behind prioritized
//! sampling. It owns three parallel binary trees over the same leaves (sums, maxima, minima)
//! and promises O(log n) [`SumTree::set`], O(1) [`SumTree::total`], [`SumTree::max`] and
//! [`SumTree::min`], O(log n) [`SumTree::find`] / [`SumTree::sample`] / [`SumTree::argmin`],
//! and no allocation after [`SumTree::new`].
//!
//! ```text
//!  level 3 (root)                    [0,5)                  n = 5 leaves (any n >= 1)
//!  level 2                [0,4)                [4,5)
//!  level 1          [0,2)       [2,4)       [4,5)     pad   levels below the root are padded
//!  level 0 (leaves) p0   p1     p2   p3     p4   pad        to an even length with the
//!                                                           identity (0 for sum/max, +inf
//!                                                           for min)
//!  node k of level l has children 2k and 2k+1 of level l-1 (one array per tree, level by
//!  level), so each node covers a contiguous range of leaf indices, in index order.
//! ```
//!
//! Invariants (checked by the unit tests below and by `tests/prop_sumtree.rs`):
//! 1. Every stored priority is finite, `>= 0` (never `-0.0`) and at most
//!    [`SumTree::priority_limit`], so no sum can overflow to infinity.
//! 2. Every internal node is *recomputed from its two children* (`sum = l + r`, `max`, `min`),
//!    never adjusted by a delta. The tree is therefore a pure function of its leaves: after any
//!    sequence of updates it is bit-identical to [`SumTree::rebuild`], with no drift.
//! 3. Hence a subtree's sum is exactly `0.0` if and only if every leaf under it is zero or
//!    empty (a float sum of non-negative numbers is zero only if all of them are), and
//!    [`SumTree::find`] only ever descends into subtrees whose sum is positive: it never
//!    returns an index whose priority is zero, whatever `u` and whatever the rounding.
//! 4. A leaf is *empty* (never set, or cleared) or *occupied* (its bit in an occupancy
//!    bitmap). Empty leaves weigh 0 in the sums and are left out of [`SumTree::max`],
//!    [`SumTree::min`] and [`SumTree::argmin`]; an occupied leaf may have priority 0 (it is
//!    never sampled but is still the minimum).
//! 5. A [`SumTree::sums_only`] tree keeps the same `sum` array, bit for bit, as a full tree
//!    given the same operations, and no `max`/`min` arrays at all.
//!
//! Precision: sums are f64 and pairwise (a balanced tree), so `total()` is within about
//! `depth * 2^-53` (relative) of the exact sum of the leaves, `depth = ceil(log2 n)`: about
//! `2.2e-15` for a million leaves, however many updates happened. See `docs/design/sumtree.md`.

use crate::error::EchoError;

/// Levels a tree can have: leaves plus one level per halving of a `usize` width.
const MAX_LEVELS: usize = usize::BITS as usize + 1;

/// Descents `sample_stratified` runs in lockstep (their cache misses overlap).
const LANES: usize = 16;

/// Why a [`SumTree`] refused a call. None of these is a bug: each one is an argument (or, for
/// [`SumTreeError::Empty`], a state) the caller can check for, and the tree is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum SumTreeError {
    /// A tree needs at least one leaf.
    #[error("sum tree capacity must be at least 1, got 0")]
    ZeroCapacity,
    /// The tree's nodes do not fit in memory (or in `usize`).
    #[error("cannot allocate a sum tree of {capacity} leaves")]
    CapacityTooLarge {
        /// The capacity asked for.
        capacity: usize,
    },
    /// A leaf index at or past the capacity.
    #[error("index {index} is out of range for a sum tree of capacity {capacity}")]
    IndexOutOfRange {
        /// The index given.
        index: usize,
        /// The tree's capacity.
        capacity: usize,
    },
    /// A priority that is NaN, negative or infinite.
    #[error("priority must be finite and >= 0, got {priority}")]
    InvalidPriority {
        /// The priority given.
        priority: f64,
    },
    /// A finite priority so large that the total could overflow.
    #[error("priority {priority} exceeds the largest allowed priority {limit}")]
    PriorityTooLarge {
        /// The priority given.
        priority: f64,
        /// [`SumTree::priority_limit`] of the tree.
        limit: f64,
    },
    /// `sample_stratified` got a different number of uniforms than output slots.
    #[error(
        "stratified sampling needs one uniform per output slot: {uniforms} uniforms, batch {batch}"
    )]
    LengthMismatch {
        /// Length of the uniforms slice.
        uniforms: usize,
        /// Length of the output slice (the batch size).
        batch: usize,
    },
    /// Sampling from a tree whose total is zero (every leaf empty or zero).
    #[error("nothing to sample: every priority in the sum tree is zero")]
    Empty,
}

impl From<SumTreeError> for EchoError {
    /// Every sum tree error becomes [`EchoError::Config`] (a `ValueError`) with its message.
    fn from(err: SumTreeError) -> Self {
        EchoError::Config(err.to_string())
    }
}

/// A fixed-capacity sum tree (with parallel max and min trees) over priorities `f64 >= 0`.
///
/// Leaves start empty. The tree stores whatever weights it is given: a prioritized sampler
/// stores `priority^exponent` and gets probabilities proportional to it.
#[derive(Debug, Clone)]
pub struct SumTree {
    /// Number of leaves; never 0.
    capacity: usize,
    /// Number of occupied leaves (those whose `min` entry is finite).
    len: usize,
    /// Number of levels, leaves (level 0) to root (level `levels - 1`, one node). `1` when
    /// `capacity == 1`: the leaf is the root.
    levels: usize,
    /// `offsets[l]` is where level `l` starts in `sum`, `max` and `min`; `offsets[levels]` is
    /// their length. Every level below the root has an even stored length, so node `2k + 1`
    /// exists whenever node `2k` does.
    offsets: [usize; MAX_LEVELS + 1],
    /// `widths[l]`: nodes of level `l` that cover at least one leaf (`ceil(capacity / 2^l)`).
    /// Nodes past it are padding and always hold the identity.
    widths: [usize; MAX_LEVELS],
    /// Index of the root in all three arrays (`offsets[levels - 1]`).
    root: usize,
    /// Leaf priorities (0 for empty leaves and padding); each internal node is `l + r` of its
    /// children, computed exactly that way (invariant 2).
    sum: Box<[f64]>,
    /// Like `sum` with `max(l, r)`. Empty leaves hold 0, which is harmless because every
    /// priority is `>= 0` and `max()` answers `None` when nothing is occupied. Empty (never
    /// allocated) in a [`SumTree::sums_only`] tree.
    max: Box<[f64]>,
    /// Like `sum` with `min(l, r)`. Empty leaves and padding hold `+inf`. Empty in a
    /// [`SumTree::sums_only`] tree.
    min: Box<[f64]>,
    /// Whether `max` and `min` are kept (false for [`SumTree::sums_only`]).
    extrema: bool,
    /// Bit `i` is set if and only if leaf `i` is occupied.
    occupied: Box<[u64]>,
    /// Largest priority `set` accepts: `f64::MAX / 2^levels`, so that no sum overflows.
    priority_limit: f64,
}

impl SumTree {
    /// A tree of `capacity` empty leaves. This is the only allocation the tree makes: three
    /// arrays of about `2 * capacity` f64 each (48 bytes per leaf).
    ///
    /// # Errors
    /// [`SumTreeError::ZeroCapacity`] if `capacity` is 0, [`SumTreeError::CapacityTooLarge`]
    /// if the node count overflows `usize` or the memory cannot be allocated.
    pub fn new(capacity: usize) -> Result<Self, SumTreeError> {
        Self::build(capacity, true)
    }

    /// A tree of `capacity` empty leaves that keeps only the sums (16 bytes per leaf): every
    /// `set` and `clear` then updates one array per level instead of three. Everything but
    /// [`SumTree::max`], [`SumTree::min`] and [`SumTree::argmin`] (which answer `None`)
    /// behaves exactly, bit for bit, as in a [`SumTree::new`] tree. What a prioritized sampler
    /// needs.
    ///
    /// # Errors
    /// As [`SumTree::new`].
    pub fn sums_only(capacity: usize) -> Result<Self, SumTreeError> {
        Self::build(capacity, false)
    }

    fn build(capacity: usize, extrema: bool) -> Result<Self, SumTreeError> {
        if capacity == 0 {
            return Err(SumTreeError::ZeroCapacity);
        }
        let too_large = SumTreeError::CapacityTooLarge { capacity };
        let mut offsets = [0; MAX_LEVELS + 1];
        let mut widths = [0; MAX_LEVELS];
        let mut levels = 0;
        let mut width = capacity;
        let mut nodes = 0usize;
        loop {
            offsets[levels] = nodes;
            widths[levels] = width;
            levels += 1;
            let stored = if width == 1 { Some(1) } else { width.checked_add(width & 1) };
            nodes = stored.and_then(|s| nodes.checked_add(s)).ok_or(too_large)?;
            if width == 1 {
                break;
            }
            width = width.div_ceil(2);
        }
        offsets[levels] = nodes;
        let mut priority_limit = f64::MAX;
        for _ in 0..levels {
            priority_limit /= 2.0;
        }
        Ok(Self {
            capacity,
            len: 0,
            levels,
            offsets,
            widths,
            root: offsets[levels - 1],
            sum: filled(nodes, 0.0).ok_or(too_large)?,
            max: filled(if extrema { nodes } else { 0 }, 0.0).ok_or(too_large)?,
            min: filled(if extrema { nodes } else { 0 }, f64::INFINITY).ok_or(too_large)?,
            extrema,
            occupied: filled(capacity.div_ceil(64), 0u64).ok_or(too_large)?,
            priority_limit,
        })
    }

    /// Number of leaves.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of occupied leaves (set and not cleared since), zero priorities included.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no leaf is occupied.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The largest priority [`SumTree::set`] accepts: `f64::MAX / 2^levels` with
    /// `levels = ceil(log2 n) + 1` (above `1e288` for any capacity), which keeps every sum
    /// finite.
    pub fn priority_limit(&self) -> f64 {
        self.priority_limit
    }

    /// Sets leaf `index` to `priority` (occupying it if it was empty). O(log n). A `-0.0`
    /// priority is stored as `0.0`.
    ///
    /// # Errors
    /// [`SumTreeError::IndexOutOfRange`] if `index >= capacity`,
    /// [`SumTreeError::InvalidPriority`] if `priority` is NaN, negative or infinite,
    /// [`SumTreeError::PriorityTooLarge`] if it exceeds [`SumTree::priority_limit`]. On error
    /// the tree is unchanged.
    pub fn set(&mut self, index: usize, priority: f64) -> Result<(), SumTreeError> {
        self.check_index(index)?;
        if !priority.is_finite() || priority < 0.0 {
            return Err(SumTreeError::InvalidPriority { priority });
        }
        if priority > self.priority_limit {
            return Err(SumTreeError::PriorityTooLarge { priority, limit: self.priority_limit });
        }
        if !self.is_occupied(index) {
            self.len += 1;
            self.occupied[index / 64] |= 1 << (index % 64);
        }
        // `+ 0.0` turns `-0.0` into `0.0` and leaves every other value alone.
        let priority = priority + 0.0;
        self.write_leaf(index, priority, priority);
        Ok(())
    }

    /// Empties leaf `index`: it weighs nothing and leaves `max`/`min`/`argmin`. O(log n).
    /// Clearing an empty leaf does nothing.
    ///
    /// # Errors
    /// [`SumTreeError::IndexOutOfRange`] if `index >= capacity`.
    pub fn clear(&mut self, index: usize) -> Result<(), SumTreeError> {
        self.check_index(index)?;
        if self.is_occupied(index) {
            self.len -= 1;
            self.occupied[index / 64] &= !(1 << (index % 64));
            self.write_leaf(index, 0.0, f64::INFINITY);
        }
        Ok(())
    }

    /// The priority of leaf `index`, or `None` if the leaf is empty or `index >= capacity`.
    pub fn get(&self, index: usize) -> Option<f64> {
        // Leaves are the first `capacity` entries of `sum`.
        (index < self.capacity && self.is_occupied(index)).then(|| self.sum[index])
    }

    /// The sum of all priorities. O(1).
    pub fn total(&self) -> f64 {
        self.sum[self.root]
    }

    /// The largest priority among occupied leaves, `None` if no leaf is occupied or the tree
    /// is [`SumTree::sums_only`]. O(1).
    pub fn max(&self) -> Option<f64> {
        (self.len > 0 && self.extrema).then(|| self.max[self.root])
    }

    /// The smallest priority among occupied leaves (zero priorities included), `None` if no
    /// leaf is occupied or the tree is [`SumTree::sums_only`]. O(1).
    pub fn min(&self) -> Option<f64> {
        (self.len > 0 && self.extrema).then(|| self.min[self.root])
    }

    /// The lowest index among occupied leaves holding [`SumTree::min`], `None` if no leaf is
    /// occupied or the tree is [`SumTree::sums_only`]. O(log n).
    pub fn argmin(&self) -> Option<usize> {
        if self.len == 0 || !self.extrema {
            return None;
        }
        let mut k = 0;
        for level in (0..self.levels - 1).rev() {
            let child = self.offsets[level] + 2 * k;
            // Ties go left, so the lowest index wins; the root's min is finite, so the path
            // follows finite (occupied) entries down to a leaf.
            k = 2 * k + usize::from(self.min[child + 1] < self.min[child]);
        }
        Some(k)
    }

    /// The leaf `i` with `cumsum[i-1] <= prefix_sum < cumsum[i]`, where `cumsum[i]` is the sum
    /// of priorities `0..=i`; `None` if [`SumTree::total`] is 0. O(log n).
    ///
    /// Never returns an index whose priority is zero (or an empty leaf): `prefix_sum >= total`
    /// (or `+inf`) gives the last leaf with a positive priority, `prefix_sum <= 0` (or NaN)
    /// the first, and a boundary blurred by rounding resolves to a positive neighbour. Leaf
    /// boundaries are exact up to about `depth * 2^-53 * total`.
    pub fn find(&self, prefix_sum: f64) -> Option<usize> {
        let total = self.total();
        (total > 0.0).then(|| self.descend([prefix_sum], total)[0])
    }

    /// Draws one leaf with probability `priority / total`, given `uniform` drawn from
    /// `[0, 1)`: `find(uniform * total)`. `None` if the total is 0. O(log n).
    ///
    /// Out-of-range `uniform`s are clamped (NaN counts as 0), so any input gives a valid
    /// positive-priority leaf.
    pub fn sample(&self, uniform: f64) -> Option<usize> {
        let total = self.total();
        (total > 0.0).then(|| self.descend([uniform * total], total)[0])
    }

    /// Stratified sampling as in prioritized experience replay: `[0, total)` is cut into
    /// `batch = out.len()` equal segments and `out[i]` is drawn from segment `i` at position
    /// `uniforms[i]` (each in `[0, 1)`; out-of-range values are clamped to `[0, 1]`, NaN to 0).
    /// The result is sorted by index, and every index has a positive priority. O(batch log n),
    /// no allocation.
    ///
    /// # Errors
    /// [`SumTreeError::LengthMismatch`] if `uniforms.len() != out.len()`,
    /// [`SumTreeError::Empty`] if the batch is not empty and the total is 0. `out` is
    /// untouched on error.
    pub fn sample_stratified(
        &self,
        uniforms: &[f64],
        out: &mut [usize],
    ) -> Result<(), SumTreeError> {
        if uniforms.len() != out.len() {
            return Err(SumTreeError::LengthMismatch {
                uniforms: uniforms.len(),
                batch: out.len(),
            });
        }
        if out.is_empty() {
            return Ok(());
        }
        let total = self.total();
        if total <= 0.0 {
            return Err(SumTreeError::Empty);
        }
        #[allow(clippy::cast_precision_loss)] // batch sizes and indices are far below 2^52
        let segment = total / out.len() as f64;
        // `LANES` descents at a time, in lockstep, so their cache misses overlap. A short last
        // chunk pads with target 0 and drops those results.
        for (chunk, (outs, uniforms)) in
            out.chunks_mut(LANES).zip(uniforms.chunks(LANES)).enumerate()
        {
            let mut targets = [0.0; LANES];
            for (lane, (target, &uniform)) in targets.iter_mut().zip(uniforms).enumerate() {
                let uniform = if uniform > 0.0 { uniform.min(1.0) } else { 0.0 };
                #[allow(clippy::cast_precision_loss)]
                let segment_index = (chunk * LANES + lane) as f64;
                *target = (segment_index + uniform) * segment;
            }
            let found = self.descend(targets, total);
            outs.copy_from_slice(&found[..outs.len()]);
        }
        Ok(())
    }

    /// Recomputes every internal node from the leaves. O(n).
    ///
    /// Because `set` and `clear` already recompute each ancestor from its children (invariant
    /// 2), this never changes a bit of a tree built through the public API: there is no drift
    /// to correct, so nothing calls it periodically. It is the reference the tests compare
    /// the incremental tree against (bit for bit).
    pub fn rebuild(&mut self) {
        for level in 1..self.levels {
            let (below, here) = (self.offsets[level - 1], self.offsets[level]);
            for k in 0..self.widths[level] {
                let (node, child) = (here + k, below + 2 * k);
                self.recompute(node, child);
            }
        }
    }

    /// The descent behind `find`, `sample` and `sample_stratified`: `N` independent
    /// descents in lockstep, one level at a time, so that a batch's cache misses overlap.
    /// Needs `total > 0`.
    fn descend<const N: usize>(&self, targets: [f64; N], total: f64) -> [usize; N] {
        // Negative and NaN targets become 0 (the first positive leaf); targets at or past the
        // total are replaced by the last positive leaf at the end.
        let mut u = targets.map(|t| if t > 0.0 { t } else { 0.0 });
        let mut k = [0usize; N];
        // We only ever enter nodes whose sum is positive (invariant 3): left when `u < l`
        // (then `l > 0` since `u >= 0`), right only when `r > 0`, and left with `u >= l` when
        // `r == 0` (then `l` equals the parent's positive sum). So the leaf we end on is
        // positive, and `u - l >= 0` always.
        for level in (0..self.levels - 1).rev() {
            let nodes = &self.sum[self.offsets[level]..];
            for (k, u) in k.iter_mut().zip(&mut u) {
                let (left, right) = (nodes[2 * *k], nodes[2 * *k + 1]);
                let go_right = *u >= left && right > 0.0;
                *k = 2 * *k + usize::from(go_right);
                *u -= if go_right { left } else { 0.0 };
            }
        }
        if targets.iter().any(|&t| t >= total) {
            let last = self.last_positive();
            for (k, &t) in k.iter_mut().zip(&targets) {
                if t >= total {
                    *k = last;
                }
            }
        }
        k
    }

    /// The highest-index leaf with a positive priority. Needs `total > 0`.
    fn last_positive(&self) -> usize {
        let mut k = 0;
        for level in (0..self.levels - 1).rev() {
            let child = self.offsets[level] + 2 * k;
            k = 2 * k + usize::from(self.sum[child + 1] > 0.0);
        }
        k
    }

    fn check_index(&self, index: usize) -> Result<(), SumTreeError> {
        if index < self.capacity {
            Ok(())
        } else {
            Err(SumTreeError::IndexOutOfRange { index, capacity: self.capacity })
        }
    }

    /// Writes leaf `index` (`value` into sum and max, `min_value` into min) and recomputes
    /// its ancestors from their children, bottom-up.
    fn is_occupied(&self, index: usize) -> bool {
        self.occupied[index / 64] & (1 << (index % 64)) != 0
    }

    fn write_leaf(&mut self, index: usize, value: f64, min_value: f64) {
        self.sum[index] = value;
        if self.extrema {
            self.max[index] = value;
            self.min[index] = min_value;
        }
        let mut k = index;
        for level in 1..self.levels {
            let child = self.offsets[level - 1] + (k & !1);
            k /= 2;
            self.recompute(self.offsets[level] + k, child);
        }
    }

    /// Sets node `node` from its children `child` and `child + 1`.
    fn recompute(&mut self, node: usize, child: usize) {
        self.sum[node] = self.sum[child] + self.sum[child + 1];
        if self.extrema {
            self.max[node] = self.max[child].max(self.max[child + 1]);
            self.min[node] = self.min[child].min(self.min[child + 1]);
        }
    }
}

/// A boxed slice of `len` copies of `value`, or `None` if it cannot be allocated.
fn filled<T: Copy>(len: usize, value: T) -> Option<Box<[T]>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).ok()?;
    v.resize(len, value);
    Some(v.into_boxed_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(priorities: &[f64]) -> SumTree {
        let mut t = SumTree::new(priorities.len()).unwrap();
        for (i, &p) in priorities.iter().enumerate() {
            t.set(i, p).unwrap();
        }
        t
    }

    #[test]
    fn a_sums_only_tree_matches_a_full_tree_bit_for_bit() {
        let mut state = 3u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for capacity in [1, 2, 3, 7, 64, 65, 1000] {
            let (mut full, mut sums) =
                (SumTree::new(capacity).unwrap(), SumTree::sums_only(capacity).unwrap());
            assert!(sums.max.is_empty() && sums.min.is_empty(), "no extrema allocated");
            for _ in 0..2_000 {
                let index = (next() % capacity as u64) as usize;
                if next() % 4 == 0 {
                    full.clear(index).unwrap();
                    sums.clear(index).unwrap();
                } else {
                    let priority = (next() % 1000) as f64 / 7.0;
                    full.set(index, priority).unwrap();
                    sums.set(index, priority).unwrap();
                }
                assert_eq!(full.sum, sums.sum);
                assert_eq!(
                    (full.len(), full.total().to_bits()),
                    (sums.len(), sums.total().to_bits())
                );
                assert_eq!(full.get(index), sums.get(index));
                let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
                assert_eq!(full.sample(u), sums.sample(u));
                assert_eq!((sums.max(), sums.min(), sums.argmin()), (None, None, None));
            }
            assert_no_drift(&sums);
        }
    }

    /// Checks invariant 2 directly: every node equals its recomputation, bit for bit.
    fn assert_no_drift(t: &SumTree) {
        let mut rebuilt = t.clone();
        rebuilt.rebuild();
        let bits = |a: &[f64]| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&t.sum), bits(&rebuilt.sum));
        assert_eq!(bits(&t.max), bits(&rebuilt.max));
        assert_eq!(bits(&t.min), bits(&rebuilt.min));
    }

    #[test]
    fn levels_are_padded_to_even_lengths_for_any_capacity() {
        for (capacity, levels, nodes) in [(1, 1, 1), (2, 2, 3), (3, 3, 7), (5, 4, 13), (8, 4, 15)] {
            let t = SumTree::new(capacity).unwrap();
            assert_eq!((t.levels, t.offsets[t.levels]), (levels, nodes), "capacity {capacity}");
            assert_eq!(t.widths[t.levels - 1], 1);
            assert_eq!(t.root, nodes - 1);
        }
    }

    #[test]
    fn zero_and_absurd_capacities_are_errors_not_aborts() {
        assert_eq!(SumTree::new(0).unwrap_err(), SumTreeError::ZeroCapacity);
        for capacity in [usize::MAX, usize::MAX / 4] {
            assert_eq!(
                SumTree::new(capacity).unwrap_err(),
                SumTreeError::CapacityTooLarge { capacity }
            );
        }
    }

    #[test]
    fn a_new_tree_is_empty() {
        let t = SumTree::new(7).unwrap();
        assert_eq!((t.len(), t.total()), (0, 0.0));
        assert!(t.is_empty());
        assert_eq!((t.max(), t.min(), t.argmin()), (None, None, None));
        assert_eq!((t.find(0.0), t.sample(0.5), t.get(3)), (None, None, None));
        assert_eq!(t.sample_stratified(&[0.5], &mut [0]), Err(SumTreeError::Empty));
    }

    #[test]
    fn set_get_total_max_min_follow_the_leaves() {
        let mut t = tree(&[1.0, 0.0, 2.0, 3.0, 0.5]);
        assert_eq!((t.len(), t.total(), t.max(), t.min()), (5, 6.5, Some(3.0), Some(0.0)));
        assert_eq!((t.get(1), t.get(3), t.get(5)), (Some(0.0), Some(3.0), None));
        assert_eq!(t.argmin(), Some(1));
        // Lowering the maximum lowers `max()`: it is a tree, not a running maximum.
        t.set(3, 0.25).unwrap();
        assert_eq!((t.total(), t.max(), t.min()), (3.75, Some(2.0), Some(0.0)));
        t.set(1, 4.0).unwrap();
        assert_eq!((t.max(), t.min(), t.argmin()), (Some(4.0), Some(0.25), Some(3)));
        assert_no_drift(&t);
    }

    #[test]
    fn cleared_leaves_leave_len_max_min_and_argmin() {
        let mut t = tree(&[0.0, 5.0, 0.0]);
        t.clear(0).unwrap();
        t.clear(0).unwrap(); // clearing an empty leaf does nothing
        assert_eq!((t.len(), t.get(0), t.min(), t.argmin()), (2, None, Some(0.0), Some(2)));
        t.clear(2).unwrap();
        assert_eq!((t.min(), t.argmin(), t.max()), (Some(5.0), Some(1), Some(5.0)));
        t.clear(1).unwrap();
        assert_eq!((t.len(), t.total(), t.max(), t.min(), t.argmin()), (0, 0.0, None, None, None));
        assert_eq!(t.clear(3), Err(SumTreeError::IndexOutOfRange { index: 3, capacity: 3 }));
        assert_no_drift(&t);
    }

    #[test]
    fn argmin_breaks_ties_towards_the_lowest_index() {
        let t = tree(&[3.0, 1.0, 2.0, 1.0, 1.0]);
        assert_eq!(t.argmin(), Some(1));
    }

    #[test]
    fn bad_priorities_and_indices_are_errors_and_change_nothing() {
        let mut t = tree(&[1.0, 2.0, 3.0]);
        let before = t.clone();
        for p in [f64::NAN, -1.0, -f64::MIN_POSITIVE, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(matches!(t.set(1, p), Err(SumTreeError::InvalidPriority { .. })), "{p}");
        }
        let limit = t.priority_limit();
        assert!(limit > 1e288);
        assert_eq!(
            t.set(0, f64::MAX),
            Err(SumTreeError::PriorityTooLarge { priority: f64::MAX, limit })
        );
        assert_eq!(t.set(3, 1.0), Err(SumTreeError::IndexOutOfRange { index: 3, capacity: 3 }));
        assert_eq!((t.total(), t.len(), t.get(1)), (before.total(), 3, Some(2.0)));
        assert_eq!(t.sum, before.sum);
        let err: EchoError = SumTreeError::InvalidPriority { priority: -1.0 }.into();
        assert!(matches!(err, EchoError::Config(msg) if msg.contains("-1")));
    }

    #[test]
    fn priorities_at_the_limit_keep_the_total_finite() {
        let mut t = SumTree::new(5).unwrap();
        for i in 0..5 {
            t.set(i, t.priority_limit()).unwrap();
        }
        assert!(t.total().is_finite());
        assert_eq!(t.sample(0.999), Some(4));
    }

    #[test]
    fn negative_zero_is_stored_as_zero() {
        let t = tree(&[-0.0, 1.0]);
        assert_eq!(t.get(0).map(f64::to_bits), Some(0.0f64.to_bits()));
        assert_eq!(t.min().map(f64::to_bits), Some(0.0f64.to_bits()));
    }

    #[test]
    fn find_follows_the_cumulative_sums() {
        // cumsum = [1, 1, 3, 6]: [0,1) -> 0, [1,3) -> 2, [3,6) -> 3. Exact in binary.
        let t = tree(&[1.0, 0.0, 2.0, 3.0]);
        let cases = [(0.0, 0), (0.999, 0), (1.0, 2), (2.5, 2), (3.0, 3), (5.999, 3)];
        for (u, i) in cases {
            assert_eq!(t.find(u), Some(i), "u = {u}");
        }
        // Out of range: clamped to the first / last positive leaf.
        for (u, i) in [(6.0, 3), (1e300, 3), (f64::INFINITY, 3), (-1.0, 0), (f64::NAN, 0)] {
            assert_eq!(t.find(u), Some(i), "u = {u}");
        }
    }

    #[test]
    fn find_never_returns_a_zero_priority_leaf() {
        let t = tree(&[0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0]);
        for u in [-1.0, 0.0, 2.5, 4.999_999, 5.0, 7.0, f64::NAN, f64::INFINITY] {
            assert_eq!(t.find(u), Some(2), "u = {u}");
        }
        // Last positive leaf with trailing zeros and empties: u at and just past the total.
        let mut t = tree(&[0.1, 0.2, 0.3, 0.0, 0.0]);
        t.clear(4).unwrap();
        for u in [t.total(), f64::from_bits(t.total().to_bits() - 1), t.total() * (1.0 + 1e-15)] {
            assert_eq!(t.find(u), Some(2), "u = {u}");
        }
    }

    #[test]
    fn rounding_at_a_boundary_never_lands_on_an_empty_subtree() {
        // Many 0.1s: the left sums are inexact; aim u just below and at each boundary of the
        // trailing positive leaf, with all-zero subtrees to its right.
        let mut priorities = vec![0.1; 100];
        priorities.extend([0.0; 28]);
        let t = tree(&priorities);
        let total = t.total();
        let mut u = total;
        for _ in 0..64 {
            u = f64::from_bits(u.to_bits() - 1);
            let i = t.find(u).unwrap();
            assert!(i < 100, "u = {u} gave {i}");
        }
    }

    #[test]
    fn a_target_that_rounds_past_a_subtree_still_lands_on_a_positive_leaf() {
        // Leaves [a, 0, b, 0]. For `u` just below the total, `u - a` can round up to `b`; the
        // descent then sees `u' >= b` at the node over [b, 0] and must not step right onto
        // the zero leaf. Search for such cases and check every one.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f64::from(u32::try_from(state >> 32).unwrap()) / f64::from(u32::MAX)
        };
        let mut dangerous = 0;
        let mut tree = SumTree::new(4).unwrap();
        for _ in 0..20_000 {
            let (left, right) = (uniform(), uniform());
            tree.set(0, left).unwrap();
            tree.set(2, right).unwrap();
            let mut u = tree.total();
            for _ in 0..4 {
                u = f64::from_bits(u.to_bits() - 1);
                dangerous += usize::from(u >= left && u - left >= right);
                let i = tree.find(u).unwrap();
                assert!(i == 0 || i == 2, "leaves [{left}, 0, {right}, 0], u = {u}: leaf {i}");
            }
        }
        assert!(dangerous > 0, "the search found no target that rounds past the subtree");
    }

    #[test]
    fn priorities_returning_to_zero_leave_an_exactly_zero_total() {
        // The classic drift of delta-updated trees: 0.1 + 0.2 - 0.3 != 0 in floating point.
        let mut t = SumTree::new(6).unwrap();
        for round in 0..100u32 {
            for i in 0..6u32 {
                t.set(i as usize, 0.1 * f64::from(i + round % 7)).unwrap();
            }
            for i in 0..6 {
                t.set(i, 0.0).unwrap();
            }
            assert_eq!(t.total().to_bits(), 0.0f64.to_bits());
        }
        assert_eq!(t.sample(0.5), None);
        assert_no_drift(&t);
    }

    #[test]
    fn random_updates_leave_no_drift() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut t = SumTree::new(37).unwrap();
        for _ in 0..5000 {
            let i = usize::try_from(next() % 37).unwrap();
            match next() % 4 {
                0 => t.clear(i).unwrap(),
                _ => t.set(i, f64::from(u32::try_from(next() >> 40).unwrap()) * 1e-3).unwrap(),
            }
        }
        assert_no_drift(&t);
    }

    #[test]
    fn sample_clamps_out_of_range_uniforms() {
        let t = tree(&[0.0, 1.0, 1.0, 0.0]);
        for (r, i) in [(0.0, 1), (0.49, 1), (0.5, 2), (0.999, 2), (1.0, 2), (7.0, 2), (-3.0, 1)] {
            assert_eq!(t.sample(r), Some(i), "uniform {r}");
        }
        assert_eq!(t.sample(f64::NAN), Some(1));
    }

    #[test]
    fn stratified_sampling_draws_one_leaf_per_segment() {
        // Equal priorities and batch == capacity: segment i is exactly leaf i.
        let t = tree(&[1.0; 9]);
        let mut out = [usize::MAX; 9];
        t.sample_stratified(&[0.0, 0.3, 0.999, 0.5, 1.0, -1.0, f64::NAN, 0.7, 0.1], &mut out)
            .unwrap();
        // uniform 1.0 (clamped) is the segment's end, which belongs to the next leaf.
        assert_eq!(out, [0, 1, 2, 3, 5, 5, 6, 7, 8]);
        let mut small = [0; 2];
        assert_eq!(
            t.sample_stratified(&[0.5], &mut small),
            Err(SumTreeError::LengthMismatch { uniforms: 1, batch: 2 })
        );
        assert_eq!(t.sample_stratified(&[], &mut []), Ok(()));
    }

    #[test]
    fn stratified_samples_are_sorted_and_positive() {
        let t = tree(&[0.0, 3.0, 0.0, 0.5, 0.0, 0.0, 2.0, 0.0]);
        let uniforms: Vec<f64> = (0..32).map(|i| f64::from(i * 7 % 32) / 32.0).collect();
        let mut out = [0; 32];
        t.sample_stratified(&uniforms, &mut out).unwrap();
        assert!(out.windows(2).all(|w| w[0] <= w[1]), "{out:?}");
        assert!(out.iter().all(|&i| t.get(i).unwrap() > 0.0), "{out:?}");
    }

    #[test]
    fn a_single_leaf_tree_works() {
        let mut t = SumTree::new(1).unwrap();
        assert_eq!(t.sample(0.5), None);
        t.set(0, 2.0).unwrap();
        assert_eq!(
            (t.total(), t.max(), t.argmin(), t.sample(0.5)),
            (2.0, Some(2.0), Some(0), Some(0))
        );
        let mut out = [9; 3];
        t.sample_stratified(&[0.1, 0.2, 0.3], &mut out).unwrap();
        assert_eq!(out, [0; 3]);
    }
}
