//! Arbitrary bytes as the body of a compressed sample frame (wire v2, 0x14..=0x17): what a
//! hostile client sends after `body_len`, decoded as the server does (`LeafCodecs::unpack_body`
//! into a sample-sized buffer).
//!
//! Never a panic, never a write outside the sample (AddressSanitizer), and a body that
//! decodes re-encodes: packing the decoded sample again and decoding that gives the same
//! sample, and the packed part the server would keep is exactly the rest of the body.
//!
//! Byte 0 of the input picks the codecs of a three-leaf layout (8 raw bytes, then 300 and 64
//! bytes): bit 0 LZ4 instead of zstd for leaf 1; bit 1 leaf 2 compressed too, bit 2 with LZ4.
#![no_main]

use echo::codec::{Codec, LeafCodecs};
use echo::{ArraySpec, DataSpec, Leaves};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, body)) = data.split_first() else { return };
    let spec = DataSpec::new(vec![
        ArraySpec::new(vec![8], 1).unwrap(),
        ArraySpec::new(vec![300], 1).unwrap(),
        ArraySpec::new(vec![16], 4).unwrap(),
    ])
    .unwrap();
    let codec = |lz4: bool| if lz4 { Codec::Lz4 } else { Codec::Zstd { level: 1 } };
    let leaf2 = (mode & 2 != 0).then(|| codec(mode & 4 != 0));
    let codecs = LeafCodecs::new(&spec, vec![None, Some(codec(mode & 1 != 0)), leaf2]).unwrap();
    let mut payload = vec![0u8; spec.payload_size()];
    let Ok(at) = codecs.unpack_body(body, &mut payload) else { return };
    assert!(at <= body.len());
    codecs.check_item(&body[at..]).expect("a body that decodes has a well-formed item");
    let leaves: Vec<&[u8]> = (0..spec.len()).map(|l| &payload[spec.leaf_range(l)]).collect();
    let mut again = Vec::new();
    codecs.pack_body(&Leaves(&leaves), 0, &mut again);
    assert!(again.len() <= codecs.max_body(), "our own bodies fit the server's cap");
    let mut back = vec![0u8; spec.payload_size()];
    codecs.unpack_body(&again, &mut back).expect("our own body decodes");
    assert_eq!(back, payload, "decode, encode, decode gives the same sample");
});
