//! Arbitrary bytes as a sequence table's snapshot (`sequence.npy` in a checkpoint directory,
//! which a tampered or corrupt checkpoint controls): decoded as `Server.restore` decodes it,
//! then restored into a new table of the seed's geometry (`Sequence(4)`, 64 steps, batches of
//! 2, one 8-byte leaf), which checks every index, count and state the bytes name.
//!
//! Never a panic and never an access out of bounds (AddressSanitizer), and:
//! - a snapshot that decodes encodes to bytes that decode to the same encoding again;
//! - a snapshot the table accepts leaves a table that samples and takes a new step.
//!
//! The seeds (fuzz/corpus/sequence_snapshot/) are real snapshots of that geometry, with and
//! without open episodes, so mutations start from bytes that pass the format checks.
#![no_main]

use std::time::Instant;

use echo::replay::{LeafRows, ReplayConfig, SequenceConfig, SequenceSnapshot, SequenceTable};
use echo::{ArraySpec, DataSpec, EpisodeEnd, StepLeaves, StepTag};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(snapshot) = SequenceSnapshot::decode(data) else { return };
    let encoded = snapshot.encode();
    let again = SequenceSnapshot::decode(&encoded).expect("an encoded snapshot decodes");
    assert_eq!(again.encode(), encoded, "encoding is stable");
    let spec = DataSpec::new(vec![ArraySpec::new(vec![], 8).unwrap()]).unwrap();
    let config = ReplayConfig { seed: Some(1), ..ReplayConfig::new(2, 64) };
    let table = SequenceTable::new(spec, config, SequenceConfig::new(4)).unwrap();
    // The steps' bytes: as many as the snapshot says it stored (restore checks the count).
    let steps = vec![0u8; snapshot.steps().min(1 << 16) * 8];
    if table.restore(&snapshot, &[LeafRows::Raw(&steps)], &[&[]]).is_err() {
        return;
    }
    let mut consumer = table.consumer().unwrap();
    if table.stats().windows.size > 0 {
        let _ = consumer.sample(Some(Instant::now()));
    }
    let step = 7u64.to_ne_bytes();
    let leaves = [&step[..]];
    let source = StepLeaves(&leaves, StepTag { stream: 0, end: EpisodeEnd::Terminated });
    let _ = table.insert(&source, None, Some(Instant::now()));
});
