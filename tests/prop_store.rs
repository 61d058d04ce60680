//! Sequential property test: random sequences of non-blocking inserts and samples against a
//! simple model (a counter of written ids and of batches handed out). Checks FIFO order,
//! exact contents, capacity (writers stop exactly when the ring is full, counting the batch
//! the consumer holds) and partial inserts at the full mark.

use std::time::Instant;

use echo::{ArraySpec, DataSpec, EchoError, InsertError, Payloads, Store};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Insert(usize),
    Sample,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![(1usize..7).prop_map(Op::Insert), Just(Op::Sample)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_fifo_model(
        batch_size in 1usize..5,
        num_batches in 2usize..5,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let spec = DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap();
        let store = Store::new(spec, batch_size, num_batches).unwrap();
        let mut consumer = store.consumer().unwrap();
        let capacity = (batch_size * num_batches) as u64;
        let bs = batch_size as u64;
        // Model: ids 0.. are written in order; `sampled` batches were handed out; the last one
        // is held until the next sample.
        let (mut written, mut sampled, mut holding) = (0u64, 0u64, false);
        for op in ops {
            match op {
                Op::Insert(n) => {
                    let released = if holding { (sampled - 1) * bs } else { sampled * bs };
                    let room = capacity - (written - released);
                    let expected = (n as u64).min(room);
                    let payloads: Vec<[u8; 8]> =
                        (written..written + n as u64).map(u64::to_le_bytes).collect();
                    let refs: Vec<&[u8]> = payloads.iter().map(|p| &p[..]).collect();
                    let result = store.insert(&Payloads::new(store.spec(), &refs).unwrap(), Some(Instant::now()));
                    match result {
                        Ok(()) => prop_assert_eq!(expected, n as u64),
                        Err(InsertError { inserted, error: EchoError::TimedOut }) => {
                            prop_assert!(expected < n as u64);
                            prop_assert_eq!(inserted as u64, expected);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e:?}"),
                    }
                    written += expected;
                }
                Op::Sample => {
                    let result = consumer.sample(Some(Instant::now()));
                    holding = false; // sample() releases the held batch first, in any case
                    if written >= (sampled + 1) * bs {
                        prop_assert!(matches!(result, Ok(b) if b == sampled), "{result:?}");
                        let ids: Vec<u64> = consumer.read_leaf(0, |b| {
                            b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
                        });
                        let expected: Vec<u64> = (sampled * bs..(sampled + 1) * bs).collect();
                        prop_assert_eq!(ids, expected);
                        sampled += 1;
                        holding = true;
                    } else {
                        prop_assert!(matches!(result, Err(EchoError::TimedOut)));
                    }
                }
            }
            let stats = consumer.stats();
            prop_assert_eq!(stats.write_cursor, written);
            let complete = written / bs;
            prop_assert_eq!(stats.notify_count, complete);
            prop_assert_eq!(stats.store_size, written - sampled * bs);
        }
    }
}
