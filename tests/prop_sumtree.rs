//! The sum tree against a naive model (a `Vec<Option<f64>>` of leaves, scanned linearly):
//! - `tree_matches_naive_model`: random sequences of set/clear/get/find/sample/stratified
//!   sampling on capacities 1..200, with valid and invalid priorities and indices. Totals
//!   agree within a relative epsilon, `len`/`get`/`max`/`min`/`argmin` exactly, `find` agrees
//!   with a linear scan of the cumulative sums at targets away from leaf boundaries, and at any
//!   target (NaN, negative, past the total) returns an occupied leaf with a positive priority.
//! - `find_is_monotone`: a larger target never gives a smaller index.
//! - `sampling_frequencies_match_priorities` / `..._stratified` / `..._skewed`: 1e6 draws with
//!   a fixed seed, chi-square against `priority / total`, zero-priority leaves never drawn.
//! - `nothing_allocates_after_construction`: a counting global allocator.
//!
//! `PROPTEST_CASES` sets the number of cases (default 256); `scripts/valgrind.sh` uses 16.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use echo::replay::sumtree::{SumTree, SumTreeError};
use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, TestRng};

/// Uniforms in `[0, 1)` with 53 random bits from proptest's ChaCha generator, fixed by `seed`.
struct Uniforms(TestRng);

impl Uniforms {
    fn new(seed: u64) -> Self {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        Self(TestRng::from_seed(RngAlgorithm::ChaCha, &key))
    }

    fn uniform(&mut self) -> f64 {
        self.0.random()
    }
}

/// The naive model: one optional priority per leaf.
struct Model(Vec<Option<f64>>);

impl Model {
    fn total(&self) -> f64 {
        self.0.iter().flatten().sum()
    }
    fn positive(&self, i: usize) -> bool {
        self.0[i].is_some_and(|p| p > 0.0)
    }
    fn first_positive(&self) -> Option<usize> {
        (0..self.0.len()).find(|&i| self.positive(i))
    }
    fn last_positive(&self) -> Option<usize> {
        (0..self.0.len()).rev().find(|&i| self.positive(i))
    }
    /// Sum of the priorities before leaf `i`.
    fn cum_before(&self, i: usize) -> f64 {
        self.0[..i].iter().flatten().sum()
    }
    /// The leaf `find(u)` must return, by linear scan.
    fn scan(&self, u: f64) -> Option<usize> {
        let mut cum = 0.0;
        for (i, p) in self.0.iter().enumerate() {
            cum += p.unwrap_or(0.0);
            if u < cum {
                return Some(i);
            }
        }
        None
    }
}

#[derive(Debug, Clone)]
enum Op {
    Set {
        index: usize,
        priority: f64,
    },
    Clear {
        index: usize,
    },
    /// Find at a point inside a positive leaf (picked by `pick`), `frac` of the way through it.
    FindInside {
        pick: usize,
        frac: f64,
    },
    /// Find at an arbitrary target, scaled by the total when `scaled`.
    FindAny {
        u: f64,
        scaled: bool,
    },
    /// Find a few ulps below the total, where rounding is most likely to stray.
    FindNearTotal {
        ulps: u64,
    },
    Sample {
        uniform: f64,
    },
    Stratified {
        batch: usize,
        seed: u64,
        mismatch: bool,
    },
}

fn priority() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0..10.0,
        2 => Just(0.0),
        1 => Just(-0.0),
        2 => (-30i32..30).prop_map(|e| 10f64.powi(e)),
        1 => prop_oneof![Just(1e-300), Just(5e-324), Just(1e300), Just(f64::MAX), Just(1e289)],
        1 => prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-1.0),
            Just(-1e-300)
        ],
    ]
}

fn op(capacity: usize) -> impl Strategy<Value = Op> {
    // Indices run a little past the capacity so that out-of-range errors are exercised.
    let index = 0..capacity + 2;
    prop_oneof![
        6 => (index.clone(), priority()).prop_map(|(index, priority)| Op::Set { index, priority }),
        1 => index.prop_map(|index| Op::Clear { index }),
        3 => (any::<usize>(), 0.01f64..0.99).prop_map(|(pick, frac)| Op::FindInside { pick, frac }),
        2 => prop_oneof![
            (-0.2f64..1.2).prop_map(|u| Op::FindAny { u, scaled: true }),
            any::<f64>().prop_map(|u| Op::FindAny { u, scaled: false }),
        ],
        1 => (1u64..8).prop_map(|ulps| Op::FindNearTotal { ulps }),
        1 => prop_oneof![-0.5f64..1.5, any::<f64>()].prop_map(|uniform| Op::Sample { uniform }),
        1 => (1usize..64, any::<u64>(), prop::bool::weighted(0.1))
            .prop_map(|(batch, seed, mismatch)| Op::Stratified { batch, seed, mismatch }),
    ]
}

fn case() -> impl Strategy<Value = (usize, Vec<Op>)> {
    (1usize..200)
        .prop_flat_map(|capacity| (Just(capacity), proptest::collection::vec(op(capacity), 1..120)))
}

/// `i` is an occupied leaf with a positive priority.
fn check_positive(model: &Model, i: Option<usize>) -> Result<(), TestCaseError> {
    let i = i.ok_or_else(|| TestCaseError::fail("no index despite a positive total"))?;
    prop_assert!(
        i < model.0.len() && model.positive(i),
        "index {i} has priority {:?}",
        model.0.get(i)
    );
    Ok(())
}

fn check_state(tree: &SumTree, model: &Model) -> Result<(), TestCaseError> {
    let occupied: Vec<(usize, f64)> =
        model.0.iter().enumerate().filter_map(|(i, p)| p.map(|p| (i, p))).collect();
    prop_assert_eq!(tree.len(), occupied.len());
    let expected = model.total();
    let total = tree.total();
    prop_assert!((total - expected).abs() <= 1e-12 * expected, "total {total} vs model {expected}");
    // Exactly zero when and only when every leaf is zero or empty (no drift residue).
    prop_assert_eq!(total == 0.0, expected == 0.0);
    let max = occupied.iter().map(|&(_, p)| p).reduce(f64::max);
    let min = occupied.iter().map(|&(_, p)| p).reduce(f64::min);
    prop_assert_eq!(tree.max(), max);
    prop_assert_eq!(tree.min(), min);
    let argmin = min.and_then(|m| occupied.iter().find(|&&(_, p)| p == m).map(|&(i, _)| i));
    prop_assert_eq!(tree.argmin(), argmin);
    for (i, p) in model.0.iter().enumerate() {
        prop_assert_eq!(tree.get(i).map(f64::to_bits), p.map(f64::to_bits), "leaf {}", i);
    }
    prop_assert_eq!(tree.get(model.0.len()), None);
    Ok(())
}

fn apply(tree: &mut SumTree, model: &mut Model, op: Op) -> Result<(), TestCaseError> {
    let capacity = model.0.len();
    match op {
        Op::Set { index, priority } => {
            let result = tree.set(index, priority);
            if index >= capacity {
                prop_assert_eq!(result, Err(SumTreeError::IndexOutOfRange { index, capacity }));
            } else if !priority.is_finite() || priority < 0.0 {
                prop_assert!(
                    matches!(result, Err(SumTreeError::InvalidPriority { .. })),
                    "{:?}",
                    result
                );
            } else if priority > tree.priority_limit() {
                prop_assert!(
                    matches!(result, Err(SumTreeError::PriorityTooLarge { .. })),
                    "{:?}",
                    result
                );
            } else {
                prop_assert_eq!(result, Ok(()));
                model.0[index] = Some(priority + 0.0);
            }
        }
        Op::Clear { index } => {
            let result = tree.clear(index);
            if index >= capacity {
                prop_assert_eq!(result, Err(SumTreeError::IndexOutOfRange { index, capacity }));
            } else {
                prop_assert_eq!(result, Ok(()));
                model.0[index] = None;
            }
        }
        Op::FindInside { pick, frac } => {
            let positive: Vec<usize> = (0..capacity).filter(|&i| model.positive(i)).collect();
            if positive.is_empty() {
                prop_assert_eq!(tree.find(0.5), None);
                return Ok(());
            }
            let j = positive[pick % positive.len()];
            let p = model.0[j].unwrap_or(0.0);
            let u = model.cum_before(j) + frac * p;
            let found = tree.find(u);
            check_positive(model, found)?;
            // Away from the boundaries (by far more than any rounding), find agrees with the
            // linear scan exactly.
            let margin = frac.min(1.0 - frac) * p;
            if margin > 1e-9 * model.total() {
                prop_assert_eq!(found, Some(j), "u = {}", u);
                prop_assert_eq!(model.scan(u), Some(j));
            }
        }
        Op::FindAny { u, scaled } => {
            let u = if scaled { u * tree.total() } else { u };
            let found = tree.find(u);
            if model.total() == 0.0 {
                prop_assert_eq!(found, None);
            } else {
                check_positive(model, found)?;
                if u >= tree.total() {
                    prop_assert_eq!(found, model.last_positive(), "u = {} >= total", u);
                } else if u.is_nan() || u <= 0.0 {
                    prop_assert_eq!(found, model.first_positive(), "u = {}", u);
                }
            }
        }
        Op::FindNearTotal { ulps } => {
            let total = tree.total();
            let found = tree.find(f64::from_bits(total.to_bits().saturating_sub(ulps)));
            if total == 0.0 {
                prop_assert_eq!(found, None);
            } else {
                check_positive(model, found)?;
            }
        }
        Op::Sample { uniform } => {
            let found = tree.sample(uniform);
            if model.total() == 0.0 {
                prop_assert_eq!(found, None);
            } else {
                check_positive(model, found)?;
            }
        }
        Op::Stratified { batch, seed, mismatch } => {
            let mut rng = Uniforms::new(seed);
            let uniforms: Vec<f64> =
                (0..batch + usize::from(mismatch)).map(|_| rng.uniform()).collect();
            let mut out = vec![usize::MAX; batch];
            let result = tree.sample_stratified(&uniforms, &mut out);
            if mismatch {
                let expected = SumTreeError::LengthMismatch { uniforms: batch + 1, batch };
                prop_assert_eq!(result, Err(expected));
            } else if model.total() == 0.0 {
                prop_assert_eq!(result, Err(SumTreeError::Empty));
            } else {
                prop_assert_eq!(result, Ok(()));
                prop_assert!(out.windows(2).all(|w| w[0] <= w[1]), "unsorted {:?}", out);
                for &i in &out {
                    check_positive(model, Some(i))?;
                }
            }
        }
    }
    Ok(())
}

proptest! {
    // `ProptestConfig::default()` reads PROPTEST_CASES (the valgrind run lowers it).
    #![proptest_config(ProptestConfig::default())]

    #[test]
    fn tree_matches_naive_model((capacity, ops) in case()) {
        let mut tree = SumTree::new(capacity).unwrap();
        let mut model = Model(vec![None; capacity]);
        prop_assert_eq!(tree.capacity(), capacity);
        for op in ops {
            apply(&mut tree, &mut model, op)?;
            check_state(&tree, &model)?;
        }
        // No drift: the incrementally updated tree is the one a rebuild computes.
        let mut rebuilt = tree.clone();
        rebuilt.rebuild();
        prop_assert_eq!(rebuilt.total().to_bits(), tree.total().to_bits());
    }

    #[test]
    fn find_is_monotone(
        priorities in proptest::collection::vec(prop_oneof![Just(0.0), 0.0f64..5.0], 1..200),
        mut targets in proptest::collection::vec(-0.1f64..1.1, 1..50),
    ) {
        let mut tree = SumTree::new(priorities.len()).unwrap();
        for (i, &p) in priorities.iter().enumerate() {
            tree.set(i, p).unwrap();
        }
        targets.sort_by(f64::total_cmp);
        let found: Vec<Option<usize>> = targets.iter().map(|&t| tree.find(t * tree.total())).collect();
        prop_assert!(found.windows(2).all(|w| w[0] <= w[1]), "{:?}", found);
    }
}

/// Chi-square statistic of `counts` against `expected` (over leaves with a positive
/// expectation), and the number of such leaves. Leaves with zero expectation must be 0.
fn chi_square(counts: &[u64], weights: &[f64], draws: u64) -> (f64, usize) {
    let total: f64 = weights.iter().sum();
    let (mut chi2, mut cells) = (0.0, 0);
    for (&count, &weight) in counts.iter().zip(weights) {
        #[allow(clippy::cast_precision_loss)] // counts are far below 2^52
        let (count, draws) = (count as f64, draws as f64);
        if weight == 0.0 {
            assert!(count == 0.0, "a zero-priority leaf was drawn {count} times");
            continue;
        }
        let expected = draws * weight / total;
        assert!(expected >= 50.0, "too few draws per cell for chi-square: {expected}");
        chi2 += (count - expected).powi(2) / expected;
        cells += 1;
    }
    (chi2, cells)
}

/// Wilson-Hilferty approximation of the chi-square quantile with `df` degrees of freedom at
/// standard-normal quantile `z`.
fn chi_square_quantile(df: usize, z: f64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let k = df as f64;
    let h = 2.0 / (9.0 * k);
    k * (1.0 - h + z * h.sqrt()).powi(3)
}

/// z = 4.26: a one-in-100,000 tail on each side (the seeds are fixed, so the result is
/// deterministic; the bound only has to be one an unbiased sampler meets comfortably).
const Z: f64 = 4.26;

/// Draws needed for the frequency tests (debug builds take about a second).
const DRAWS: u64 = 1_000_000;

/// 777 leaves (not a power of two) with priorities in [0.25, 4), some zero, some cleared.
fn mixed_tree() -> (SumTree, Vec<f64>) {
    let mut rng = Uniforms::new(0xDEAD_BEEF_1234_5678);
    let mut tree = SumTree::new(777).unwrap();
    let mut weights = vec![0.0; 777];
    for (i, w) in weights.iter_mut().enumerate() {
        *w = match i % 10 {
            3 => 0.0,
            _ => 0.25 + 3.75 * rng.uniform(),
        };
        tree.set(i, *w).unwrap();
    }
    for i in (5..777).step_by(50) {
        tree.clear(i).unwrap();
        weights[i] = 0.0;
    }
    // Overwrite some priorities several times so the tree is not just freshly built.
    for i in (0..777).step_by(7) {
        if weights[i] > 0.0 {
            tree.set(i, 100.0).unwrap();
            tree.set(i, weights[i]).unwrap();
        }
    }
    (tree, weights)
}

#[test]
fn sampling_frequencies_match_priorities() {
    let (tree, weights) = mixed_tree();
    let mut rng = Uniforms::new(42);
    let mut counts = vec![0u64; weights.len()];
    for _ in 0..DRAWS {
        counts[tree.sample(rng.uniform()).unwrap()] += 1;
    }
    let (chi2, cells) = chi_square(&counts, &weights, DRAWS);
    let (low, high) = (chi_square_quantile(cells - 1, -Z), chi_square_quantile(cells - 1, Z));
    assert!(low < chi2 && chi2 < high, "chi2 = {chi2} outside ({low}, {high}), df = {}", cells - 1);
}

#[test]
fn stratified_sampling_frequencies_match_priorities() {
    let (tree, weights) = mixed_tree();
    let mut rng = Uniforms::new(7);
    let mut counts = vec![0u64; weights.len()];
    let (mut uniforms, mut out) = ([0.0; 256], [0usize; 256]);
    let batches = DRAWS / 256;
    for _ in 0..batches {
        uniforms.iter_mut().for_each(|u| *u = rng.uniform());
        tree.sample_stratified(&uniforms, &mut out).unwrap();
        for &i in &out {
            counts[i] += 1;
        }
    }
    // Stratification only lowers the variance, so only the upper bound applies.
    let (chi2, cells) = chi_square(&counts, &weights, batches * 256);
    let high = chi_square_quantile(cells - 1, Z);
    assert!(chi2 < high, "chi2 = {chi2} above {high}, df = {}", cells - 1);
}

#[test]
fn sampling_frequencies_match_skewed_priorities() {
    // Priorities 1.1^i over 64 leaves (a 400x spread), in a tree of 100 with the rest empty.
    let mut tree = SumTree::new(100).unwrap();
    let mut weights = vec![0.0; 100];
    for (i, w) in weights.iter_mut().enumerate().take(64) {
        *w = 1.1f64.powi(i32::try_from(i).unwrap());
        tree.set(i, *w).unwrap();
    }
    let mut rng = Uniforms::new(0x5EED);
    let mut counts = vec![0u64; 100];
    for _ in 0..DRAWS {
        counts[tree.sample(rng.uniform()).unwrap()] += 1;
    }
    let (chi2, cells) = chi_square(&counts, &weights, DRAWS);
    let (low, high) = (chi_square_quantile(cells - 1, -Z), chi_square_quantile(cells - 1, Z));
    assert!(low < chi2 && chi2 < high, "chi2 = {chi2} outside ({low}, {high}), df = {}", cells - 1);
}

/// Counts allocations made by the current thread, so other test threads do not interfere.
struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract is `System`'s; the counter is a const-initialised thread-local
// `Cell` without a destructor, so touching it never allocates or re-enters the allocator.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` via `alloc`/`realloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded unchanged; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn nothing_allocates_after_construction() {
    let mut tree = SumTree::new(1000).unwrap();
    let mut rng = Uniforms::new(3);
    let (mut uniforms, mut out) = ([0.0; 64], [0usize; 64]);
    let before = ALLOCATIONS.with(Cell::get);
    for i in 0..1000 {
        tree.set(i, 1.0).unwrap();
    }
    for i in 0..10_000usize {
        tree.set(i % 1000, rng.uniform()).unwrap();
        if i % 3 == 0 {
            tree.clear((i * 7) % 1000).unwrap();
        }
        let _ = tree.set(i % 1000, f64::NAN); // errors do not allocate either
        let _ = (tree.sample(rng.uniform()), tree.find(rng.uniform()), tree.argmin());
        let _ = (tree.total(), tree.max(), tree.min(), tree.get(i % 1000));
        uniforms.iter_mut().for_each(|u| *u = rng.uniform());
        tree.sample_stratified(&uniforms, &mut out).unwrap();
    }
    tree.rebuild();
    assert_eq!(ALLOCATIONS.with(Cell::get) - before, 0);
}
