//! Replay tables against a naive model (proptest): random sequences of inserts (with and
//! without priorities), samples and priority updates, for every sampler, remover and
//! `max_times_sampled` in {0, 1, 2}, on tables of at most 8 items. After every operation the
//! table and the model agree on which items are in the table and with which priority; every
//! sampled item is one the model holds, with the probability the model computes, the times
//! sampled the model counts, and (LIFO) in the model's order; eviction and removal after k
//! draws remove exactly the items the model removes (min-priority ties: the oldest).

use std::collections::BTreeMap;
use std::time::Instant;

use echo::replay::{RemoverKind, ReplayBatch, ReplayConfig, SamplerKind, Table};
use echo::{ArraySpec, DataSpec, EchoError, Leaves};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Insert { priority: Option<f64> },
    Sample,
    Update { pick: usize, unknown: bool, priority: f64 },
}

#[derive(Debug, Clone)]
struct Case {
    batch_size: usize,
    max_size: usize,
    sampler: SamplerKind,
    remover: RemoverKind,
    max_times_sampled: u32,
    ops: Vec<Op>,
}

/// The model: live items by key (keys are insertion numbers), each with its priority and
/// times sampled.
#[derive(Debug, Default)]
struct Model {
    items: BTreeMap<u64, (f64, u32)>,
    next_key: u64,
    max_priority: f64,
}

impl Model {
    fn victim(&self, remover: RemoverKind) -> u64 {
        match remover {
            RemoverKind::Fifo => *self.items.keys().next().unwrap(),
            RemoverKind::Lifo => *self.items.keys().next_back().unwrap(),
            // The lowest priority; among equals the oldest (the smallest key).
            RemoverKind::MinPriority => {
                let min = self
                    .items
                    .iter()
                    .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0).then(a.0.cmp(b.0)))
                    .unwrap();
                *min.0
            }
        }
    }

    fn probability(&self, sampler: SamplerKind, key: u64) -> f64 {
        match sampler {
            SamplerKind::Uniform => 1.0 / self.items.len() as f64,
            SamplerKind::Prioritized { exponent } => {
                let total: f64 = self.items.values().map(|(p, _)| p.powf(exponent)).sum();
                self.items[&key].0.powf(exponent) / total
            }
            SamplerKind::Lifo => 1.0,
        }
    }
}

fn case() -> impl Strategy<Value = Case> {
    let sampler = prop_oneof![
        Just(SamplerKind::Uniform),
        Just(SamplerKind::Lifo),
        prop_oneof![Just(0.0), Just(0.5), Just(1.0), Just(2.0)]
            .prop_map(|exponent| SamplerKind::Prioritized { exponent }),
    ];
    let remover = prop_oneof![
        Just(RemoverKind::Fifo),
        Just(RemoverKind::Lifo),
        Just(RemoverKind::MinPriority)
    ];
    // Few distinct priorities, so that equal priorities (ties) are common.
    let priority = || prop_oneof![0.1f64..10.0, Just(1.0), Just(2.0), Just(0.5)];
    let op = prop_oneof![
        4 => proptest::option::of(priority()).prop_map(|priority| Op::Insert { priority }),
        3 => Just(Op::Sample),
        2 => (any::<usize>(), prop::bool::weighted(0.2), priority())
            .prop_map(|(pick, unknown, priority)| Op::Update { pick, unknown, priority }),
    ];
    (1usize..4, 0usize..5, sampler, remover, 0u32..3, proptest::collection::vec(op, 1..80))
        .prop_map(|(batch_size, extra, sampler, remover, max_times_sampled, ops)| Case {
            batch_size,
            max_size: batch_size + extra,
            sampler,
            remover,
            max_times_sampled,
            ops,
        })
}

fn read<T: Copy>(table: &Table, batch: ReplayBatch, leaf: usize) -> Vec<T> {
    let ptr = table.batch_ptr(batch.half, leaf).cast::<T>();
    (0..table.config().batch_size)
        // SAFETY: the consumer just assembled `batch`; its half holds `batch_size` values of
        // this leaf's type, and nothing writes it before the second next `sample`.
        .map(|i| unsafe { ptr.wrapping_add(i).read_unaligned() })
        .collect()
}

fn run(case: &Case) -> Result<(), TestCaseError> {
    let mut config = ReplayConfig::new(case.batch_size, case.max_size);
    config.sampler = case.sampler;
    config.remover = case.remover;
    config.max_times_sampled = case.max_times_sampled;
    config.seed = Some(7);
    let spec = DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap();
    let table = Table::new(spec, config).unwrap();
    let mut consumer = table.consumer().unwrap();
    let mut model = Model { max_priority: 1.0, ..Model::default() };
    let (k, b) = (case.max_times_sampled, case.batch_size);
    let mut unknown_total = 0;
    for op in &case.ops {
        match *op {
            Op::Insert { priority } => {
                let key = model.next_key;
                let bytes = key.to_ne_bytes();
                table.insert(&Leaves(&[&bytes]), priority, None).unwrap();
                if model.items.len() == case.max_size {
                    let victim = model.victim(case.remover);
                    model.items.remove(&victim);
                }
                let priority = priority.unwrap_or(model.max_priority);
                model.max_priority = model.max_priority.max(priority);
                model.items.insert(key, (priority, 0));
                model.next_key += 1;
            }
            Op::Sample => {
                // Only when the model can fill a whole batch now: otherwise the table keeps
                // a partial batch for the next call, which this model does not follow.
                let draws_left: u64 = if k == 0 {
                    if model.items.is_empty() {
                        0
                    } else {
                        u64::MAX
                    }
                } else {
                    model.items.values().map(|&(_, t)| u64::from(k - t)).sum()
                };
                if draws_left < b as u64 {
                    if model.items.is_empty() {
                        let now = Some(Instant::now());
                        prop_assert!(matches!(consumer.sample(now), Err(EchoError::TimedOut)));
                    }
                    continue;
                }
                let batch = consumer.sample(None).unwrap();
                let keys: Vec<u64> = read(&table, batch, 1);
                let ids: Vec<u64> = read(&table, batch, 0);
                let probabilities: Vec<f64> = read(&table, batch, 2);
                let times: Vec<u32> = read(&table, batch, 3);
                prop_assert_eq!(&keys, &ids, "the key is the item's insertion number");
                // The keys a LIFO draw must return, in order: k == 0 takes the newest first,
                // in rounds of at most the table's size; k > 0 one at a time, newest live.
                let mut lifo_order = Vec::new();
                if case.sampler == SamplerKind::Lifo && k == 0 {
                    while lifo_order.len() < b {
                        let round = model.items.keys().rev().take(b - lifo_order.len());
                        lifo_order.extend(round.copied());
                    }
                }
                for (i, (&key, (&p, &t))) in
                    keys.iter().zip(probabilities.iter().zip(&times)).enumerate()
                {
                    prop_assert!(
                        model.items.contains_key(&key),
                        "drew key {} not in the table",
                        key
                    );
                    if case.sampler == SamplerKind::Lifo {
                        let newest = *model.items.keys().next_back().unwrap();
                        let expected = if k == 0 { lifo_order[i] } else { newest };
                        prop_assert_eq!(key, expected, "LIFO draw {}", i);
                    }
                    let expected = if k == 0 && case.sampler != SamplerKind::Lifo {
                        // One round for the whole batch: every probability is from its start.
                        None
                    } else {
                        Some(model.probability(case.sampler, key))
                    };
                    if let Some(expected) = expected {
                        prop_assert!(
                            (p - expected).abs() <= 1e-9 * expected,
                            "p {} vs {}",
                            p,
                            expected
                        );
                    }
                    let entry = model.items.get_mut(&key).unwrap();
                    entry.1 += 1;
                    prop_assert_eq!(t, entry.1, "times_sampled of key {}", key);
                    if k > 0 && entry.1 >= k {
                        model.items.remove(&key);
                    }
                }
                if k == 0 && case.sampler != SamplerKind::Lifo {
                    // Check the probabilities against the table as it was when drawn (times
                    // sampled do not change it).
                    for (&key, &p) in keys.iter().zip(&probabilities) {
                        let expected = model.probability(case.sampler, key);
                        prop_assert!(
                            (p - expected).abs() <= 1e-9 * expected,
                            "p {} vs {}",
                            p,
                            expected
                        );
                    }
                }
            }
            Op::Update { pick, unknown, priority } => {
                let key = if unknown || model.items.is_empty() {
                    model.next_key + 1_000 + pick as u64 % 1_000
                } else {
                    *model.items.keys().nth(pick % model.items.len()).unwrap()
                };
                let skipped = table.update_priorities(&[key], &[priority]).unwrap();
                if let Some(entry) = model.items.get_mut(&key) {
                    prop_assert_eq!(skipped, 0);
                    entry.0 = priority;
                    model.max_priority = model.max_priority.max(priority);
                } else {
                    prop_assert_eq!(skipped, 1);
                    unknown_total += 1;
                }
            }
        }
        let stats = table.stats();
        prop_assert_eq!(stats.size as usize, model.items.len());
        prop_assert_eq!(stats.unknown_keys, unknown_total);
        for (&key, &(priority, _)) in &model.items {
            prop_assert_eq!(table.priority(key), Some(priority), "priority of key {}", key);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn table_matches_naive_model(case in case()) {
        run(&case)?;
    }
}
