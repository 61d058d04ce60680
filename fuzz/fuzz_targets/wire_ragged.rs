//! Arbitrary bytes into a ragged server's group-frame header parser, as a hostile worker
//! sends them.
//!
//! Never a panic, and a header that decodes:
//! - holds 1 to the server's batch size of samples;
//! - has every ragged leaf within its `max_len` and equal lengths inside a length group;
//! - announces a body no larger than that many of the largest samples (what the server
//!   allocates before reading it);
//! - re-encodes to the bytes it came from.
//!
//! The first byte picks the frame kind (even: without priority, odd: with), the rest is the
//! frame after its kind byte.
#![no_main]

use echo::ragged::wire::{decode_head, encode_head, Outgoing, GROUP, GROUP_PRIORITY};
use libfuzzer_sys::fuzz_target;

#[path = "common/rollouts.rs"]
mod rollouts;
use rollouts::spec;

const MAX_SAMPLES: usize = 16;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, frame)) = data.split_first() else { return };
    let kind = if pick % 2 == 0 { GROUP } else { GROUP_PRIORITY };
    let spec = spec();
    let Ok(Some((head, used))) = decode_head(&spec, MAX_SAMPLES, kind, frame) else { return };
    assert!((1..=MAX_SAMPLES).contains(&head.samples));
    assert!(head.body_len <= head.samples * spec.max_sample_bytes());
    let columns = spec.columns();
    assert_eq!(head.rows.len(), head.samples * columns.len());
    for rows in head.rows.chunks(columns.len()) {
        for (column, &n) in columns.iter().zip(rows) {
            assert!(n <= column.max_rows());
        }
        assert_eq!(rows[1], rows[2], "the completion group shares one length");
    }
    // Re-encode: the same header bytes.
    let empty: Vec<&[u8]> = vec![&[]; columns.len()];
    let samples: Vec<Outgoing<'_>> =
        head.rows.chunks(columns.len()).map(|rows| Outgoing { rows, leaves: &empty }).collect();
    let again = encode_head(&spec, &samples, head.priority).unwrap();
    assert_eq!(again[0], kind);
    assert_eq!(&again[1..], &frame[..used]);
});
