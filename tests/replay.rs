//! Replay tables end to end: statistics of every sampler (fixed seeds, chi-square), removers,
//! `max_times_sampled`, priority updates, and every rate limiter's invariant under a
//! concurrent producer and consumer, checked from the limiter's own counters. Every wait has
//! a deadline, so a deadlock fails the test instead of hanging it.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{decode, tagged_payload, tagged_spec, wait_until, PATIENCE};
use echo::replay::{
    RateLimit, RemoverKind, ReplayBatch, ReplayConfig, ReplayConsumer, SamplerKind, Table,
};
use echo::{ArraySpec, DataSpec, EchoError, Leaves, Payloads};

fn id_spec() -> DataSpec {
    DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap()
}

fn put(table: &Table, id: u64, priority: Option<f64>) {
    let bytes = id.to_le_bytes();
    table.insert(&Leaves(&[&bytes]), priority, Some(Instant::now() + PATIENCE)).unwrap();
}

fn read<T: Copy>(table: &Table, batch: ReplayBatch, leaf: usize) -> Vec<T> {
    let ptr = table.batch_ptr(batch.half, leaf).cast::<T>();
    (0..table.config().batch_size)
        // SAFETY: the consumer just assembled `batch`; the half holds `batch_size` values of
        // this leaf's type and nothing writes it until the second `sample` after this one.
        .map(|i| unsafe { ptr.wrapping_add(i).read_unaligned() })
        .collect()
}

fn sample(consumer: &mut ReplayConsumer) -> ReplayBatch {
    consumer.sample(Some(Instant::now() + PATIENCE)).expect("a batch within the patience")
}

/// Pearson's statistic of `counts` against expected `draws * weights / sum(weights)`.
fn chi_square(counts: &[u64], weights: &[f64], draws: u64) -> f64 {
    let total: f64 = weights.iter().sum();
    counts
        .iter()
        .zip(weights)
        .map(|(&c, &w)| {
            let expected = draws as f64 * w / total;
            assert!(expected >= 50.0, "too few draws per cell: {expected}");
            (c as f64 - expected).powi(2) / expected
        })
        .sum()
}

#[test]
fn uniform_sampling_is_uniform() {
    let n = 100;
    let mut config = ReplayConfig::new(64, n);
    config.seed = Some(11);
    let table = Table::new(id_spec(), config).unwrap();
    for id in 0..n as u64 {
        put(&table, id, None);
    }
    let mut consumer = table.consumer().unwrap();
    let mut counts = vec![0u64; n];
    let batches = 2_000;
    for _ in 0..batches {
        let batch = sample(&mut consumer);
        for id in read::<u64>(&table, batch, 0) {
            counts[id as usize] += 1;
        }
        let probabilities = read::<f64>(&table, batch, 2);
        assert!(probabilities.iter().all(|&p| p == 0.01), "uniform probability is 1/n");
    }
    // 99 degrees of freedom: the 0.1% critical value is 148.2 (the seed is fixed, so this is
    // deterministic; a biased sampler lands in the thousands).
    let chi2 = chi_square(&counts, &vec![1.0; n], batches * 64);
    assert!(chi2 < 148.2, "chi-square {chi2} rejects uniformity");
}

#[test]
fn prioritized_sampling_follows_priority_to_the_exponent() {
    let (n, exponent) = (50, 0.6);
    let mut config = ReplayConfig::new(32, n);
    config.sampler = SamplerKind::Prioritized { exponent };
    config.seed = Some(12);
    let table = Table::new(id_spec(), config).unwrap();
    let priorities: Vec<f64> = (0..n).map(|i| (i + 1) as f64).collect();
    for (id, &p) in priorities.iter().enumerate() {
        put(&table, id as u64, Some(p));
    }
    let weights: Vec<f64> = priorities.iter().map(|p| p.powf(exponent)).collect();
    let total: f64 = weights.iter().sum();
    let mut consumer = table.consumer().unwrap();
    let mut counts = vec![0u64; n];
    let batches = 8_000;
    for _ in 0..batches {
        let batch = sample(&mut consumer);
        let ids = read::<u64>(&table, batch, 0);
        let keys = read::<u64>(&table, batch, 1);
        let probabilities = read::<f64>(&table, batch, 2);
        for ((&id, &key), &p) in ids.iter().zip(&keys).zip(&probabilities) {
            counts[id as usize] += 1;
            assert_eq!(key, id, "keys are insertion numbers");
            let expected = weights[id as usize] / total;
            assert!((p - expected).abs() < 1e-12 * expected.max(1.0), "p {p} vs {expected}");
        }
    }
    // 49 degrees of freedom: the 0.1% critical value is 85.4. Under uniform sampling this
    // statistic would be about 24,000.
    let chi2 = chi_square(&counts, &weights, batches * 32);
    assert!(chi2 < 85.4, "chi-square {chi2} rejects p^{exponent}");
}

#[test]
fn update_priorities_takes_effect_for_the_next_batch() {
    let mut config = ReplayConfig::new(32, 32);
    config.sampler = SamplerKind::Prioritized { exponent: 1.0 };
    config.seed = Some(13);
    let table = Table::new(id_spec(), config).unwrap();
    for id in 0..20 {
        put(&table, id, None);
    }
    let mut consumer = table.consumer().unwrap();
    let first = read::<u64>(&table, sample(&mut consumer), 0);
    assert!(first.iter().any(|&id| id != 7));
    let keys: Vec<u64> = (0..20).collect();
    let mut priorities = vec![0.0; 20];
    priorities[7] = 5.0;
    assert_eq!(table.update_priorities(&keys, &priorities).unwrap(), 0);
    let batch = sample(&mut consumer);
    assert_eq!(read::<u64>(&table, batch, 0), vec![7; 32]);
    assert_eq!(read::<f64>(&table, batch, 2), vec![1.0; 32]);
    // times_sampled counts every draw of item 7, including the ones in the first batch.
    let before = first.iter().filter(|&&id| id == 7).count() as u32;
    let times = read::<u32>(&table, batch, 3);
    assert_eq!(times, (before + 1..=before + 32).collect::<Vec<_>>());
}

#[test]
fn max_times_sampled_hands_every_item_out_exactly_k_times() {
    let mut config = ReplayConfig::new(10, 100);
    config.max_times_sampled = 3;
    config.seed = Some(14);
    let table = Table::new(id_spec(), config).unwrap();
    for id in 0..100 {
        put(&table, id, None);
    }
    let mut consumer = table.consumer().unwrap();
    let mut counts = [0u32; 100];
    for _ in 0..30 {
        let batch = sample(&mut consumer);
        for (id, times) in
            read::<u64>(&table, batch, 0).into_iter().zip(read::<u32>(&table, batch, 3))
        {
            counts[id as usize] += 1;
            assert_eq!(times, counts[id as usize], "times_sampled is the draw number");
        }
    }
    assert!(counts.iter().all(|&c| c == 3), "{counts:?}");
    let stats = table.stats();
    assert_eq!((stats.size, stats.removed_max_times_sampled), (0, 100));
    assert!(matches!(
        consumer.sample(Some(Instant::now() + Duration::from_millis(10))),
        Err(EchoError::TimedOut)
    ));
}

/// The ids left in a table after inserting `0..inserts` (with `priority(id)`).
fn survivors(remover: RemoverKind, inserts: u64, priority: impl Fn(u64) -> f64) -> Vec<u64> {
    let mut config = ReplayConfig::new(3, 3);
    config.remover = remover;
    config.sampler = SamplerKind::Lifo;
    let table = Table::new(id_spec(), config).unwrap();
    for id in 0..inserts {
        put(&table, id, Some(priority(id)));
    }
    assert_eq!(table.stats().evicted, inserts - 3);
    let mut consumer = table.consumer().unwrap();
    let mut ids = read::<u64>(&table, sample(&mut consumer), 0);
    ids.sort_unstable();
    ids
}

#[test]
fn each_remover_evicts_the_right_item() {
    assert_eq!(survivors(RemoverKind::Fifo, 6, |_| 1.0), [3, 4, 5]);
    assert_eq!(survivors(RemoverKind::Lifo, 6, |_| 1.0), [0, 1, 5]);
    // Priorities 5, 1, 4, 2, 3, 9: each insert past 3 evicts the current minimum.
    let p = |id: u64| [5.0, 1.0, 4.0, 2.0, 3.0, 9.0][id as usize];
    assert_eq!(survivors(RemoverKind::MinPriority, 6, p), [0, 2, 5]);
}

/// A LIFO table of `max_size` items, batches of 4, that hands each item out once, holding
/// ids `0..max_size`; and its consumer.
fn lifo_once(max_size: usize) -> (Arc<Table>, ReplayConsumer) {
    let mut config = ReplayConfig::new(4, max_size);
    config.sampler = SamplerKind::Lifo;
    config.max_times_sampled = 1;
    let table = Table::new(id_spec(), config).unwrap();
    for id in 0..max_size as u64 {
        put(&table, id, None);
    }
    let consumer = table.consumer().unwrap();
    (table, consumer)
}

#[test]
fn lifo_sampler_hands_out_the_newest_items_newest_first() {
    let (table, mut consumer) = lifo_once(10);
    assert_eq!(read::<u64>(&table, sample(&mut consumer), 0), [9, 8, 7, 6]);
    put(&table, 10, None);
    assert_eq!(read::<u64>(&table, sample(&mut consumer), 0), [10, 5, 4, 3]);
}

/// Runs `writers` producers inserting `per_writer` tagged samples each and one consumer
/// sampling batches until every producer is done and the table refuses more, while a monitor
/// checks `check(inserts, samples)` on the limiter's counters. Returns how often each
/// `(producer, seq)` was received.
fn contend(
    config: ReplayConfig,
    writers: u32,
    per_writer: u64,
    check: impl Fn(u64, u64) + Send + 'static,
) -> HashMap<(u32, u64), u32> {
    let table = Table::new(tagged_spec(), config).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..writers)
        .map(|producer| {
            let table = Arc::clone(&table);
            thread::spawn(move || {
                for seq in 0..per_writer {
                    let payload = tagged_payload(producer, seq);
                    let payloads = [&payload[..]];
                    let source = Payloads::new(table.spec(), &payloads).unwrap();
                    table
                        .insert(&source, None, Some(Instant::now() + PATIENCE))
                        .unwrap_or_else(|e| panic!("producer {producer} seq {seq}: {e}"));
                }
            })
        })
        .collect();
    let monitor = {
        let (table, done) = (Arc::clone(&table), Arc::clone(&done));
        thread::spawn(move || {
            // ORDERING: Relaxed — a stop flag; the limiter counts are read under the lock.
            while !done.load(Ordering::Relaxed) {
                let (inserts, samples) = table.limiter_counts();
                check(inserts, samples);
                thread::yield_now();
            }
        })
    };
    let mut consumer = table.consumer().unwrap();
    let mut seen = HashMap::new();
    let batch_size = table.config().batch_size;
    let started = Instant::now();
    // Once the producers are done, a limiter that never blocks sampling (MinSize) would let
    // this loop run forever: it stops after this many more batches.
    let mut after_done = 100;
    let producers_done =
        |producers: &[thread::JoinHandle<()>]| producers.iter().all(|p| p.is_finished());
    loop {
        assert!(started.elapsed() < 3 * PATIENCE, "the consumer ran for {:?}", started.elapsed());
        // Short waits, with the producers' state read after each: they may finish while the
        // consumer waits for a batch the limiter will never allow. A deadlock still fails the
        // test: the producers' own inserts time out after PATIENCE and panic, which ends them,
        // and the join below reports it.
        match consumer.sample(Some(Instant::now() + Duration::from_millis(200))) {
            Ok(batch) => {
                let leaves: [Vec<u8>; 3] = [0, 1, 2].map(|leaf| {
                    let bytes = table.spec().arrays()[leaf].num_bytes() * batch_size;
                    // SAFETY: as in `read`: the batch is ours until the second next sample.
                    unsafe { std::slice::from_raw_parts(table.batch_ptr(batch.half, leaf), bytes) }
                        .to_vec()
                });
                for i in 0..batch_size {
                    *seen.entry(decode(&leaves, i)).or_insert(0) += 1;
                }
                if producers_done(&producers) {
                    after_done -= 1;
                    if after_done == 0 {
                        break;
                    }
                }
            }
            Err(EchoError::TimedOut) if producers_done(&producers) => break,
            Err(EchoError::TimedOut) => {}
            Err(err) => panic!("consumer: {err} after {:?}", started.elapsed()),
        }
    }
    for p in producers {
        p.join().unwrap();
    }
    // ORDERING: Relaxed — see the monitor.
    done.store(true, Ordering::Relaxed);
    monitor.join().unwrap();
    seen
}

#[test]
fn queue_with_max_times_sampled_one_delivers_every_sample_exactly_once_under_contention() {
    let mut config = ReplayConfig::new(16, 256);
    config.rate_limit = RateLimit::Queue(64);
    config.max_times_sampled = 1;
    let (writers, per_writer) = (4, 5_000);
    let seen = contend(config, writers, per_writer, |inserts, samples| {
        assert!(samples <= inserts, "sampled {samples} of {inserts}");
        assert!(inserts - samples <= 64, "{} unsampled items in a Queue(64)", inserts - samples);
    });
    // 20,000 samples in batches of 16: every one exactly once, intact.
    assert_eq!(seen.len() as u64, u64::from(writers) * per_writer);
    assert!(seen.values().all(|&c| c == 1));
}

#[test]
fn sample_to_insert_ratio_keeps_its_window_and_never_deadlocks_with_big_batches() {
    // The example: 8 samples per insert, min size 1000, error buffer 100, with a batch
    // (256) larger than the window's half-width: batches are drawn in rounds, no deadlock.
    let (spi, min_size, buffer) = (8.0, 1_000, 100.0);
    let mut config = ReplayConfig::new(256, 10_000);
    config.rate_limit = RateLimit::sample_to_insert_ratio(spi, min_size, buffer);
    config.seed = Some(15);
    let (min_diff, max_diff) = (min_size as f64 * spi - buffer, min_size as f64 * spi + buffer);
    let seen = contend(config, 2, 2_000, move |inserts, samples| {
        let diff = inserts as f64 * spi - samples as f64;
        assert!(diff <= max_diff, "diff {diff} above {max_diff}");
        assert!(samples == 0 || diff >= min_diff, "diff {diff} below {min_diff}");
    });
    // 4,000 inserts allow (4000 * 8 - 7900) = 24,100 samples: 94 full batches.
    let sampled: u32 = seen.values().sum();
    assert_eq!(sampled, 94 * 256);
}

#[test]
fn min_size_never_samples_before_the_size_under_contention() {
    let mut config = ReplayConfig::new(32, 100_000);
    config.rate_limit = RateLimit::MinSize(5_000);
    config.sampler = SamplerKind::Prioritized { exponent: 0.6 };
    config.max_times_sampled = 0;
    let seen = contend(config, 3, 3_000, |inserts, samples| {
        // Nothing is evicted (max_size is larger than all inserts), so the table holds every
        // insert: no sample may happen before 5,000 of them.
        assert!(samples == 0 || inserts >= 5_000, "sampled {samples} after {inserts} inserts");
    });
    // Every batch drawn is full and made of inserted samples; the consumer ran until the
    // producers were done, so it drew at least once after the table reached 5,000.
    assert!(!seen.is_empty());
}

#[test]
fn min_size_holds_sampling_back_until_the_table_is_big_enough() {
    let mut config = ReplayConfig::new(8, 1_000);
    config.rate_limit = RateLimit::MinSize(500);
    let table = Table::new(id_spec(), config).unwrap();
    let mut consumer = table.consumer().unwrap();
    for id in 0..499 {
        put(&table, id, None);
    }
    // The sample parks on the limiter until its deadline, and all of that counts as blocked:
    // at least the time from when this thread sees it parked to the deadline.
    let deadline = Instant::now() + Duration::from_millis(200);
    let waiter = thread::spawn(move || {
        let result = consumer.sample(Some(deadline));
        (consumer, result)
    });
    wait_until("the sample parks", || table.waiting_samples() == 1 || waiter.is_finished());
    let floor = deadline.saturating_duration_since(Instant::now());
    let (mut consumer, result) = waiter.join().unwrap();
    assert!(matches!(result, Err(EchoError::TimedOut)), "{result:?}");
    let stats = table.stats();
    assert_eq!(stats.size, 499);
    let blocked = Duration::from_nanos(stats.sample_blocked_ns);
    assert!(blocked > Duration::ZERO && blocked >= floor, "blocked {blocked:?}, parked {floor:?}");
    put(&table, 499, None);
    sample(&mut consumer);
}

#[test]
fn blocked_inserts_are_timed_and_released_by_sampling() {
    let mut config = ReplayConfig::new(2, 100);
    config.rate_limit = RateLimit::Queue(4);
    let table = Table::new(id_spec(), config).unwrap();
    for id in 0..4 {
        put(&table, id, None);
    }
    let insert = |id: u64, timeout: Duration| {
        let table = Arc::clone(&table);
        thread::spawn(move || {
            let bytes = id.to_le_bytes();
            table.insert(&Leaves(&[&bytes]), None, Some(Instant::now() + timeout))
        })
    };
    // The queue is full: a writer parks until a sample makes room ...
    let writer = insert(4, PATIENCE);
    wait_until("the writer parks", || table.waiting_inserts() == 1);
    let writer_parked = Instant::now();
    // ... and one with a deadline parks beside it and gives up at the deadline, its wait
    // counted (the other one's is counted when it ends).
    let timeout = Duration::from_millis(100);
    let deadline = Instant::now() + timeout;
    let timed_out = insert(9, timeout);
    wait_until("both park", || table.waiting_inserts() == 2 || timed_out.is_finished());
    let floor = deadline.saturating_duration_since(Instant::now());
    let err = timed_out.join().unwrap().unwrap_err();
    assert!(matches!(err, echo::InsertError { inserted: 0, error: EchoError::TimedOut }), "{err}");
    assert!(!writer.is_finished(), "nothing was sampled: the first writer still waits");
    let timed = Duration::from_nanos(table.stats().insert_blocked_ns);
    assert!(timed > Duration::ZERO && timed >= floor, "blocked {timed:?}, parked {floor:?}");
    // The first writer has been parked since before `writer_parked`, and a sample releases it.
    let released = Instant::now();
    let mut consumer = table.consumer().unwrap();
    sample(&mut consumer);
    writer.join().unwrap().unwrap();
    let stats = table.stats();
    let waited = Duration::from_nanos(stats.insert_blocked_ns) - timed;
    assert!(waited >= released - writer_parked, "blocked {waited:?}, parked longer");
    assert!(released - writer_parked >= timeout, "the timed-out insert ran in between");
    assert_eq!(stats.inserted, 5);
}

#[test]
fn batch_area_alternates_halves_and_keeps_the_previous_batch_intact() {
    let (table, mut consumer) = lifo_once(8);
    let first = sample(&mut consumer);
    let second = sample(&mut consumer);
    assert_ne!(first.half, second.half);
    assert_eq!((first.sequence, second.sequence), (0, 1));
    assert_eq!(read::<u64>(&table, first, 0), [7, 6, 5, 4], "still intact after the next sample");
    assert_eq!(read::<u64>(&table, second, 0), [3, 2, 1, 0]);
}
