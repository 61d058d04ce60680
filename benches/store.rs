//! Criterion microbenchmarks of the store's hot paths (no Python involved):
//! - `insert_sample/*`: one writer inserting single samples while the consumer drains batches,
//!   for the small (2 leaves, 20 B) and large (40 leaves, ~200 KB) samples of the Python bench;
//! - `contention/*`: 1..8 writer threads inserting small samples into one store (CAS
//!   reservation under contention), consumer draining.
//!
//! Run with `cargo bench --bench store` (`just bench`). `detailed-metrics` stays off.

use std::hint::black_box;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use echo::{ArraySpec, DataSpec, Leaves, Store};

fn small_spec() -> DataSpec {
    DataSpec::new(vec![ArraySpec::new(vec![4], 4).unwrap(), ArraySpec::new(vec![1], 4).unwrap()])
        .unwrap()
}

fn large_spec() -> DataSpec {
    DataSpec::new((0..40).map(|_| ArraySpec::new(vec![1280], 4).unwrap()).collect()).unwrap()
}

/// Inserts `iters` samples from `writers` threads while this thread consumes every batch,
/// touching one byte per leaf; returns the elapsed time.
fn run(spec: &DataSpec, batch_size: usize, writers: usize, iters: u64) -> Duration {
    let per_writer = iters.div_ceil(writers as u64).div_ceil(batch_size as u64) * batch_size as u64;
    let total = per_writer * writers as u64;
    let store = Store::new(spec.clone(), batch_size, 4).unwrap();
    let mut consumer = store.consumer().unwrap();
    let leaves: Vec<Vec<u8>> = spec.arrays().iter().map(|a| vec![7u8; a.num_bytes()]).collect();
    let start = Instant::now();
    let handles: Vec<_> = (0..writers)
        .map(|_| {
            let store = Arc::clone(&store);
            let leaves = leaves.clone();
            thread::spawn(move || {
                let refs: Vec<&[u8]> = leaves.iter().map(Vec::as_slice).collect();
                for _ in 0..per_writer {
                    store.insert(&Leaves(&refs), None).unwrap();
                }
            })
        })
        .collect();
    for _ in 0..total / batch_size as u64 {
        consumer.sample(None).unwrap();
        for leaf in 0..spec.len() {
            black_box(consumer.read_leaf(leaf, |b| b[0]));
        }
    }
    let elapsed = start.elapsed();
    for h in handles {
        h.join().unwrap();
    }
    elapsed
}

fn insert_sample(c: &mut Criterion) {
    let mut group = c.benchmark_group("insert_sample");
    for (name, spec, batch_size) in [("small", small_spec(), 32), ("large", large_spec(), 64)] {
        group.throughput(Throughput::Bytes(spec.payload_size() as u64));
        group.bench_function(name, |b| b.iter_custom(|iters| run(&spec, batch_size, 1, iters)));
    }
    group.finish();
}

fn contention(c: &mut Criterion) {
    let mut group = c.benchmark_group("contention");
    let spec = small_spec();
    group.throughput(Throughput::Elements(1));
    for writers in [1, 2, 4, 8] {
        group.bench_with_input(BenchmarkId::from_parameter(writers), &writers, |b, &w| {
            b.iter_custom(|iters| run(&spec, 32, w, iters));
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = insert_sample, contention
}
criterion_main!(benches);
