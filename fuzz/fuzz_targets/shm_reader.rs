//! A hostile worker's shared memory: arbitrary writes into a real segment (header, indices,
//! slot headers and payloads, interleaved with honest commits), then the learner's reader
//! drains it the way the connection task does.
//!
//! Never a panic, never an access outside the segment (ASan), and:
//! - `available` either errs (a tail behind the head, or more than `slots` ahead) or reports
//!   at most `slots` samples;
//! - `copy_next` only returns a sample whose header, as copied, names the expected sequence
//!   number and known flags; the reader's head only moves by `advance`.
//!
//! Input: byte 0 picks the payload size (1..=256) and byte 1 the slot count (1..=8); then
//! records of `op: u8 | offset: u16 | len: u8 | bytes`: even ops scribble `bytes` at `offset`
//! (scaled over the whole segment), odd ops commit one honest sample through a real writer
//! first (when there is room).
#![no_main]

use echo::transport::shm::{Reader, HEADER_LEN, OFF_TAIL};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [size, slots, rest @ ..] = data else { return };
    let payload = 1 + usize::from(*size);
    let slots = 1 + usize::from(slots % 8);
    let Ok(mut reader) = Reader::with_slots(payload, slots) else { return };
    let stride = (64 + payload).next_multiple_of(64);
    let len = HEADER_LEN + slots * stride;
    let mut honest_tail = 0u64;
    let mut input = rest;
    let mut buf = vec![0u8; payload];
    for _ in 0..256 {
        let [op, lo, hi, n, tail @ ..] = input else { break };
        let take = usize::from(*n).min(tail.len());
        let (bytes, next) = tail.split_at(take);
        input = next;
        let offset = usize::from(u16::from_le_bytes([*lo, *hi])) * len / 65536;
        if op % 2 == 0 {
            reader.scribble(offset, bytes);
        } else if honest_tail < reader.head() + slots as u64 {
            // An honest commit: the slot header and the tail, as a writer makes them.
            let index = (honest_tail % slots as u64) as usize;
            let at = HEADER_LEN + index * stride;
            let mut header = [0u8; 64];
            header[..8].copy_from_slice(&honest_tail.to_le_bytes());
            reader.scribble(at, &header);
            honest_tail += 1;
            reader.scribble(OFF_TAIL, &honest_tail.to_le_bytes());
        }
        drain(&mut reader, slots, &mut buf);
    }
    drain(&mut reader, slots, &mut buf);
});

fn drain(reader: &mut Reader, slots: usize, buf: &mut [u8]) {
    for _ in 0..=slots {
        let head = reader.head();
        match reader.available() {
            Err(corrupt) => {
                assert_eq!(corrupt.head, head);
                return;
            }
            Ok(0) => return,
            Ok(n) => assert!(n <= slots as u64, "{n} available in {slots} slots"),
        }
        match reader.copy_next(buf) {
            Ok(_) => reader.advance(),
            Err(_) => {
                assert_eq!(reader.head(), head);
                return;
            }
        }
        assert_eq!(reader.head(), head + 1);
    }
}
