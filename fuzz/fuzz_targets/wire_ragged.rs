//! Arbitrary bytes into a ragged server's group-frame parser, as a hostile worker sends
//! them: the header (`decode_head`) and, for a compressed frame, its body (`unpack_body`).
//!
//! Never a panic, and a header that decodes:
//! - holds 1 to the server's batch size of samples;
//! - has every ragged leaf within its `max_len` and equal lengths inside a length group;
//! - announces a body no larger than that many of the largest samples, each compressed leaf
//!   at most its codec's worst case (what the server allocates before reading it);
//! - re-encodes to the bytes it came from (a plain frame);
//! - for a compressed frame, its body either unpacks into exactly the samples' raw bytes, or
//!   is refused with a protocol error; a body the worker side packs round-trips.
//!
//! The first byte picks the frame kind (plain or compressed, with or without priority) and
//! the codecs (zstd or LZ4 on the completion's tokens and the prompt); the rest is the frame
//! after its kind byte, then its body.
#![no_main]

use echo::codec::Codec;
use echo::ragged::wire::{
    decode_head, encode_head, encode_packed, is_packed, unpack_body, Outgoing, GROUP, GROUP_PACKED,
    GROUP_PACKED_PRIORITY, GROUP_PRIORITY,
};
use echo::EchoError;
use libfuzzer_sys::fuzz_target;

#[path = "common/rollouts.rs"]
mod rollouts;
use rollouts::spec;

const MAX_SAMPLES: usize = 16;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, frame)) = data.split_first() else { return };
    let kind = [GROUP, GROUP_PRIORITY, GROUP_PACKED, GROUP_PACKED_PRIORITY][usize::from(pick % 4)];
    let codec = if pick & 4 == 0 { Codec::Zstd { level: 1 } } else { Codec::Lz4 };
    // The connection's codecs: the prompt and the tokens compressed, or none.
    let codecs = if pick & 8 == 0 { vec![Some(codec), Some(codec), None, None] } else { vec![] };
    let spec = spec();
    let decoded = decode_head(&spec, &codecs, MAX_SAMPLES, kind, frame);
    let Ok(Some((head, used))) = decoded else {
        if is_packed(kind) && codecs.is_empty() {
            assert!(matches!(decoded, Err(EchoError::Protocol(_))), "refused without codecs");
        }
        return;
    };
    assert!((1..=MAX_SAMPLES).contains(&head.samples));
    let columns = spec.columns();
    let worst: usize = columns
        .iter()
        .zip(&codecs)
        .map(|(c, codec)| codec.map_or(c.max_bytes(), |codec| codec.bound(c.max_bytes())))
        .sum::<usize>()
        .max(spec.max_sample_bytes());
    assert!(head.body_len <= head.samples * worst);
    assert_eq!(head.rows.len(), head.samples * columns.len());
    for rows in head.rows.chunks(columns.len()) {
        for (column, &n) in columns.iter().zip(rows) {
            assert!(n <= column.max_rows());
        }
        assert_eq!(rows[1], rows[2], "the completion group shares one length");
    }
    let empty: Vec<&[u8]> = vec![&[]; columns.len()];
    let samples: Vec<Outgoing<'_>> =
        head.rows.chunks(columns.len()).map(|rows| Outgoing { rows, leaves: &empty }).collect();
    if !is_packed(kind) {
        // Re-encode: the same header bytes.
        let again = encode_head(&spec, &samples, head.priority).unwrap();
        assert_eq!(again[0], kind);
        assert_eq!(&again[1..], &frame[..used]);
        return;
    }
    // The body: whatever follows the header, cut or padded to its announced length.
    let mut body = frame[used..].to_vec();
    body.resize(head.body_len, 0);
    let mut raw = Vec::new();
    let raw_len: usize = head
        .rows
        .chunks(columns.len())
        .flat_map(|rows| columns.iter().zip(rows).map(|(c, &n)| c.row_bytes() * n))
        .sum();
    match unpack_body(&spec, &codecs, &head, &body, &mut raw) {
        Ok(packed) => {
            assert_eq!(raw.len(), raw_len);
            assert_eq!(packed.len(), head.rows.len());
            for range in packed.into_iter().flatten() {
                assert!(range.end <= body.len());
            }
        }
        Err(err) => assert!(matches!(err, EchoError::Protocol(_)), "{err}"),
    }
    // What a worker packs from these rows (the fuzzed bytes as values) unpacks to them.
    let values: Vec<u8> = body.iter().copied().cycle().take(raw_len).collect();
    let mut at = 0;
    let mut leaves: Vec<Vec<&[u8]>> = Vec::new();
    for rows in head.rows.chunks(columns.len()) {
        let mut sample = Vec::new();
        for (column, &n) in columns.iter().zip(rows) {
            let len = column.row_bytes() * n;
            sample.push(&values[at..at + len]);
            at += len;
        }
        leaves.push(sample);
    }
    let outgoing: Vec<Outgoing<'_>> = head
        .rows
        .chunks(columns.len())
        .zip(&leaves)
        .map(|(rows, sample)| Outgoing { rows, leaves: sample })
        .collect();
    let packed = encode_packed(&spec, &codecs, &outgoing, head.priority).unwrap();
    let (again, used) = decode_head(&spec, &codecs, MAX_SAMPLES, packed[0], &packed[1..])
        .unwrap()
        .expect("a whole header");
    assert_eq!(again.rows, head.rows);
    unpack_body(&spec, &codecs, &again, &packed[1 + used..], &mut raw).unwrap();
    assert_eq!(raw, values);
});
