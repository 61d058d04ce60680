//! Criterion microbenchmark of the ingress drain round (no sockets, no Python):
//! - `drain_round/K`: samples/s moved from K connection queues into a FIFO [`Store`] by one
//!   drainer thread, for K = 1, 16 and 64, with small (40 B, 2 leaves) samples.
//!
//! Three threads, as in the server minus the sockets:
//! - one producer thread stands in for the K transport tasks. It owns every connection (each
//!   queue keeps exactly one producer, as in the server), and in round-robin passes fills each
//!   queue until it is full or the connection is out of buffers, exactly as a transport task
//!   would with a socket that always has data. When a whole pass pushes nothing it parks until
//!   a connection's [`SpaceWaker`] fires (the drainer recycled its buffers);
//! - the drainer (`num_drainers: 1`, so every connection is on it and the number is one
//!   drainer's round, not a race between drainers for ring space);
//! - this thread as the learner: it takes every batch and reads one byte per leaf.
//!
//! The store and queues have the Python `Server`'s defaults (batch 32, 3 batches, queue 8),
//! so at K = 64 one round pops up to 512 samples and waits for ring space like the server
//! does. The timed part is from the first push to the last batch taken; starting the ingress
//! and registering the connections is not timed.
//!
//! Run with `cargo bench --bench ingress`. `detailed-metrics` stays off.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use echo::backend::Backend;
use echo::ingress::{Ingress, IngressConfig, SpaceWaker};
use echo::{ArraySpec, DataSpec, Store};

const BATCH_SIZE: usize = 32;
const NUM_BATCHES: usize = 3;
const QUEUE_SIZE: usize = 8;
/// No single measurement may take longer than this (the bench would otherwise hang on a bug).
const MAX_RUN: Duration = Duration::from_secs(120);
/// How long the producer parks at most when every connection is full (wake-ups are explicit;
/// this only bounds the cost of a lost one).
const PRODUCER_PARK: Duration = Duration::from_millis(1);

/// `obs: f32[8]` + `reward: f32[2]`: 40 bytes, the size of a small RL transition.
fn small_spec() -> DataSpec {
    DataSpec::new(vec![ArraySpec::new(vec![8], 4).unwrap(), ArraySpec::new(vec![2], 4).unwrap()])
        .unwrap()
}

/// Wakes the producer thread when one of its connections has a free buffer or queue slot.
struct Unpark(Thread);

impl SpaceWaker for Unpark {
    fn wake(&self) {
        self.0.unpark();
    }
}

/// Moves `iters` samples (rounded up to whole batches) through `conns` connection queues into
/// the store and out through the consumer; returns the time for `iters` of them.
fn run(conns: usize, iters: u64) -> Duration {
    let total = iters.div_ceil(BATCH_SIZE as u64) * BATCH_SIZE as u64;
    let store = Store::new(small_spec(), BATCH_SIZE, NUM_BATCHES).unwrap();
    let mut consumer = store.consumer().unwrap();
    let backend = Backend::Fifo(Arc::clone(&store));
    let config = IngressConfig::new(1, QUEUE_SIZE);
    let ingress = Ingress::start(backend, config).unwrap();
    assert_eq!(store.spec().payload_size(), 40);
    let ready = Arc::new(Barrier::new(2));
    let deadline = Instant::now() + MAX_RUN;

    let producer = {
        let (ingress, ready) = (Arc::clone(&ingress), Arc::clone(&ready));
        thread::spawn(move || {
            let me = thread::current();
            let queues: Vec<_> =
                (0..conns).map(|_| ingress.register(Box::new(Unpark(me.clone())))).collect();
            ready.wait();
            let mut pushed = 0u64;
            'send: while Instant::now() < deadline {
                let before = pushed;
                for conn in &queues {
                    while let Some(mut buf) = conn.take_buffer() {
                        // Stands in for the socket read: every byte of the payload is written.
                        buf.fill(pushed as u8);
                        if let Err(buf) = conn.try_push(buf) {
                            conn.return_buffer(buf);
                            break;
                        }
                        pushed += 1;
                        if pushed == total {
                            break 'send;
                        }
                    }
                }
                if pushed == before {
                    thread::park_timeout(PRODUCER_PARK);
                }
            }
            for conn in &queues {
                conn.close();
            }
            pushed
        })
    };

    ready.wait();
    let start = Instant::now();
    for _ in 0..total / BATCH_SIZE as u64 {
        if let Err(err) = consumer.sample(Some(deadline)) {
            panic!("ingress bench: no batch within {MAX_RUN:?} ({err}): a drainer is stuck");
        }
        for leaf in 0..store.spec().len() {
            black_box(consumer.read_leaf(leaf, |b| b[0]));
        }
    }
    let elapsed = start.elapsed();
    let pushed = producer.join().unwrap();
    store.close();
    ingress.shutdown();
    // Read after the drainer is joined: it counts a round only once its insert has returned,
    // which can be after the consumer already took the batch.
    let inserted = ingress.snapshot().samples_inserted_total;
    assert_eq!((pushed, inserted), (total, total), "every pushed sample reaches the store");
    // Up to a batch more than `iters` went through; report the time `iters` of them took.
    elapsed.mul_f64(iters as f64 / total as f64)
}

fn drain_round(c: &mut Criterion) {
    let mut group = c.benchmark_group("drain_round");
    group.throughput(Throughput::Elements(1));
    for conns in [1usize, 16, 64] {
        group.bench_with_input(BenchmarkId::from_parameter(conns), &conns, |b, &k| {
            b.iter_custom(|iters| run(k, iters));
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = drain_round
}
criterion_main!(benches);
