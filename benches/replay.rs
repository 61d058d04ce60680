//! Criterion microbenchmarks of replay tables holding 1e6 small items (obs `f32[8]`,
//! action `i32`, reward `f32`: 40 bytes), the sizes the replay targets are stated in:
//! - `replay_1e6/sample_uniform_256`, `sample_prioritized_256`: one batch of 256 drawn and
//!   gathered into the batch area (elements = items, so batches/s = elements/s / 256);
//! - `replay_1e6/update_priorities_256`: `update_priorities` of 256 random live keys
//!   (elements = keys);
//! - `insert/fifo_store`, `insert/prioritized_table`, `insert/uniform_table`: one insert of
//!   one item, single thread, into a FIFO store whose consumer keeps up and into full 1e6
//!   tables that evict on every insert (elements = items).
//!
//! Run with `cargo bench --bench replay`. The Python-level comparison with Reverb and TorchRL
//! is `benches/suites/replay_tables.py`.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use echo::replay::{ReplayConfig, ReplayConsumer, SamplerKind, Table};
use echo::{ArraySpec, DataSpec, Leaves, Store};

const ITEMS: usize = 1_000_000;
const BATCH: usize = 256;

fn spec() -> DataSpec {
    DataSpec::new(vec![
        ArraySpec::new(vec![8], 4).unwrap(),
        ArraySpec::new(vec![], 4).unwrap(),
        ArraySpec::new(vec![], 4).unwrap(),
    ])
    .unwrap()
}

fn item() -> ([u8; 32], [u8; 4], [u8; 4]) {
    ([1; 32], [2; 4], [3; 4])
}

fn full_table(sampler: SamplerKind) -> (Arc<Table>, ReplayConsumer) {
    let mut config = ReplayConfig::new(BATCH, ITEMS);
    config.sampler = sampler;
    config.seed = Some(1);
    let table = Table::new(spec(), config).unwrap();
    let (obs, action, reward) = item();
    for i in 0..ITEMS {
        let priority = 0.1 + (i % 1000) as f64 / 1000.0;
        table.insert(&Leaves(&[&obs, &action, &reward]), Some(priority), None).unwrap();
    }
    let consumer = table.consumer().unwrap();
    (table, consumer)
}

fn sampling(c: &mut Criterion) {
    let mut group = c.benchmark_group("replay_1e6");
    group.throughput(Throughput::Elements(BATCH as u64));
    let (uniform, mut consumer) = full_table(SamplerKind::Uniform);
    group.bench_function("sample_uniform_256", |b| {
        b.iter(|| black_box(consumer.sample(None).unwrap()));
    });
    drop((consumer, uniform));
    let (prioritized, mut consumer) = full_table(SamplerKind::Prioritized { exponent: 0.6 });
    group.bench_function("sample_prioritized_256", |b| {
        b.iter(|| black_box(consumer.sample(None).unwrap()));
    });
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut keys = [0u64; BATCH];
    let mut priorities = [0.0f64; BATCH];
    group.bench_function("update_priorities_256", |b| {
        b.iter(|| {
            for (key, priority) in keys.iter_mut().zip(&mut priorities) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *key = state % ITEMS as u64;
                *priority = (state >> 11) as f64 / (1u64 << 53) as f64 + 0.01;
            }
            black_box(prioritized.update_priorities(&keys, &priorities).unwrap())
        });
    });
    group.finish();
}

fn inserting(c: &mut Criterion) {
    let mut group = c.benchmark_group("insert");
    group.throughput(Throughput::Elements(1));
    let (obs, action, reward) = item();
    let leaves = [&obs[..], &action[..], &reward[..]];

    // FIFO: the store is sized like the tables' batch; a consumer thread keeps it drained, so
    // this measures the insert path, not waiting for space.
    let store = Store::new(spec(), BATCH, 64).unwrap();
    let mut consumer = store.consumer().unwrap();
    let drain = std::thread::spawn(move || while consumer.sample(None).is_ok() {});
    group.bench_function("fifo_store", |b| {
        b.iter(|| store.insert(&Leaves(&leaves), None).unwrap());
    });
    store.close();
    drain.join().unwrap();

    for (name, sampler) in [
        ("prioritized_table", SamplerKind::Prioritized { exponent: 0.6 }),
        ("uniform_table", SamplerKind::Uniform),
    ] {
        let (table, _consumer) = full_table(sampler);
        group.bench_function(name, |b| {
            b.iter(|| table.insert(&Leaves(&leaves), None, None).unwrap());
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_secs(1));
    targets = sampling, inserting
}
criterion_main!(benches);
