//! Arbitrary bytes in a worker's shared-memory pipe, as a pump of a ragged server peeks at
//! them (`peek_frame`), checked against the blocking reader that the pump hands everything
//! else to (`decode_head` on the same bytes as they arrive).
//!
//! Walking the bytes frame by frame, never a panic, never a read past the bytes that are
//! there (the peek reads through a closure that indexes only them), and at each frame:
//! - a heartbeat byte is one to skip;
//! - a frame the reader decodes whole, within the pipe's size, is `Whole` with the reader's
//!   very header, header length and frame length, once every byte is there (`Partial`
//!   before);
//! - a frame the reader refuses, or larger than the pipe, or any other byte, is
//!   `Elsewhere` (the reader then meets it and reports it); a header still arriving is
//!   `Partial`, unless its announced size alone is larger than the pipe.
//!
//! The first two bytes pick the pipe's size (64 bytes to 64 KiB, so frames larger than the
//! pipe are common), the rest are the pipe's bytes.
#![no_main]

use echo::ragged::wire::{decode_head, head_len, peek_frame, Peeked, GROUP, GROUP_PRIORITY};
use echo::transport::wire::v2::HEARTBEAT;
use libfuzzer_sys::fuzz_target;

#[path = "common/rollouts.rs"]
mod rollouts;

const MAX_SAMPLES: usize = 16;

fuzz_target!(|data: &[u8]| {
    let Some((size, mut rest)) = data.split_first_chunk::<2>() else { return };
    let limit = 64 + usize::from(u16::from_le_bytes(*size));
    let spec = rollouts::spec();
    let mut scratch = Vec::new();
    loop {
        let bytes = rest;
        let peeked = peek_frame(&spec, MAX_SAMPLES, bytes.len(), limit, &mut scratch, |at, out| {
            out.copy_from_slice(&bytes[at..at + out.len()]);
        });
        let Some(&kind) = bytes.first() else {
            assert_eq!(peeked, Peeked::Partial, "nothing there");
            return;
        };
        match kind {
            HEARTBEAT => {
                assert_eq!(peeked, Peeked::Heartbeat);
                rest = &bytes[1..];
                continue;
            }
            GROUP | GROUP_PRIORITY => {}
            _ => {
                assert_eq!(peeked, Peeked::Elsewhere, "byte {kind:#04x}");
                return;
            }
        }
        match decode_head(&spec, &[], MAX_SAMPLES, kind, &bytes[1..]) {
            Err(_) => {
                assert_eq!(peeked, Peeked::Elsewhere, "a header the reader refuses");
                return;
            }
            Ok(None) => {
                // The header is not all there: the count says how long it will be.
                let announced = bytes.get(1..3).map(|n| {
                    let n = usize::from(u16::from_le_bytes([n[0], n[1]]));
                    1 + head_len(&spec, &[], kind, n)
                });
                match announced {
                    Some(len) if len > limit => assert_eq!(peeked, Peeked::Elsewhere),
                    _ => assert_eq!(peeked, Peeked::Partial, "a header still arriving"),
                }
                return;
            }
            Ok(Some((head, used))) => {
                let total = 1 + used + head.body_len;
                if total > limit {
                    assert_eq!(peeked, Peeked::Elsewhere, "larger than the pipe");
                    return;
                }
                if bytes.len() < total {
                    assert_eq!(peeked, Peeked::Partial, "a body still arriving");
                    return;
                }
                assert_eq!(peeked, Peeked::Whole { head, head_bytes: used, total });
                rest = &bytes[total..];
            }
        }
    }
});
