//! Criterion microbenchmarks of the sum tree on 1e6 leaves, every leaf set to a priority in
//! `[0.1, 1.1)`, keys and uniforms drawn by an inline xorshift (about 1 ns each, included in
//! the numbers; random keys defeat the cache as real updates do):
//! - `sumtree_1e6/set`: one `set` of a random leaf to a random priority (elements = sets);
//! - `sumtree_1e6/sample`: one `sample` (elements = draws);
//! - `sumtree_1e6/stratified_256`: one batch-256 `sample_stratified` (elements = draws, so
//!   batches/s is elements/s / 256);
//! - `sumtree_1e6/update_256`: 256 `set`s of random leaves, what `update_priorities` of 256
//!   keys costs in the tree (elements = updates);
//! - `sumtree_1e6/argmin`: the exact minimum's lowest index.
//!
//! Run with `cargo bench --bench sumtree`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use echo::replay::sumtree::SumTree;

const LEAVES: usize = 1_000_000;
const BATCH: usize = 256;

/// xorshift64*: keys and uniforms for the benchmark loops.
struct XorShift(u64);

impl XorShift {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    #[allow(clippy::cast_precision_loss)] // 53 bits convert exactly
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A key in `0..n` (multiply-shift, no modulo bias worth measuring).
    fn key(&mut self, n: usize) -> usize {
        let wide = u128::from(self.next_u64()) * n as u128;
        usize::try_from(wide >> 64).unwrap_or(0)
    }
}

fn full_tree(rng: &mut XorShift) -> SumTree {
    let mut tree = SumTree::new(LEAVES).unwrap();
    for i in 0..LEAVES {
        tree.set(i, 0.1 + rng.uniform()).unwrap();
    }
    tree
}

fn sumtree(c: &mut Criterion) {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut tree = full_tree(&mut rng);
    let mut group = c.benchmark_group("sumtree_1e6");

    group.throughput(Throughput::Elements(1));
    group.bench_function("set", |b| {
        b.iter(|| {
            let (key, priority) = (rng.key(LEAVES), 0.1 + rng.uniform());
            tree.set(black_box(key), black_box(priority)).unwrap();
        });
    });
    group.bench_function("sample", |b| {
        b.iter(|| black_box(tree.sample(black_box(rng.uniform()))));
    });
    group.bench_function("argmin", |b| {
        b.iter(|| black_box(black_box(&tree).argmin()));
    });

    group.throughput(Throughput::Elements(BATCH as u64));
    let (mut uniforms, mut out) = ([0.0; BATCH], [0usize; BATCH]);
    group.bench_function("stratified_256", |b| {
        b.iter(|| {
            uniforms.iter_mut().for_each(|u| *u = rng.uniform());
            tree.sample_stratified(black_box(&uniforms), &mut out).unwrap();
            black_box(&out);
        });
    });
    group.bench_function("update_256", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                let (key, priority) = (rng.key(LEAVES), 0.1 + rng.uniform());
                tree.set(black_box(key), black_box(priority)).unwrap();
            }
        });
    });
    group.finish();
}

criterion_group!(benches, sumtree);
criterion_main!(benches);
