//! A hostile worker's byte pipe (a ragged worker's shared memory): arbitrary writes into a
//! real pipe segment (its header, its indices, its bytes), interleaved with honest writes,
//! then the learner reads what is committed, as its connection thread does.
//!
//! Never a panic, never an access outside the segment (ASan), and:
//! - a read either errs (a tail behind the head, or more than the capacity ahead) and leaves
//!   the head where it was, or returns at most what fits the buffer and moves the head by
//!   exactly that;
//! - while the worker only writes honestly, the bytes read are the bytes written, in order.
//!
//! Input: byte 0 picks the capacity (1..=256 bytes) and byte 1 the read buffer (1..=64
//! bytes); then records of `op: u8 | offset: u16 | len: u8 | bytes`: ops divisible by 3
//! scribble `bytes` at `offset` (scaled over the whole segment), the others write `bytes`
//! honestly (as much as there is room for) and commit them; each record is followed by a
//! read.
#![no_main]

use echo::transport::shm::pipe::{PipeReader, DATA};
use echo::transport::shm::OFF_TAIL;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [capacity, chunk, rest @ ..] = data else { return };
    let capacity = 1 + usize::from(*capacity);
    let Ok(mut reader) = PipeReader::new(capacity) else { return };
    let len = DATA + capacity;
    let mut buf = vec![0u8; 1 + usize::from(chunk % 64)];
    // What an honest worker wrote and the learner has not read yet; None once scribbled on.
    let mut honest: Option<std::collections::VecDeque<u8>> = Some(Default::default());
    let mut tail = 0u64;
    let mut input = rest;
    for _ in 0..256 {
        let [op, lo, hi, n, more @ ..] = input else { break };
        let take = usize::from(*n).min(more.len());
        let (bytes, next) = more.split_at(take);
        input = next;
        if op % 3 == 0 {
            let offset = usize::from(u16::from_le_bytes([*lo, *hi])) * len / 65536;
            reader.scribble(offset, bytes);
            honest = None;
        } else {
            let room = capacity as u64 - (tail - reader.head().min(tail)).min(capacity as u64);
            let bytes = &bytes[..bytes.len().min(room as usize)];
            for (k, &b) in bytes.iter().enumerate() {
                let at = DATA + ((tail + k as u64) % capacity as u64) as usize;
                reader.scribble(at, &[b]);
            }
            tail += bytes.len() as u64;
            reader.scribble(OFF_TAIL, &tail.to_le_bytes());
            if let Some(queue) = honest.as_mut() {
                queue.extend(bytes);
            }
        }
        let head = reader.head();
        match reader.try_read(&mut buf) {
            Err(_) => assert_eq!(reader.head(), head, "a refused read moves nothing"),
            Ok(n) => {
                assert!(n <= buf.len());
                assert_eq!(reader.head(), head + n as u64);
                if let Some(queue) = honest.as_mut() {
                    let want: Vec<u8> = queue.drain(..n).collect();
                    assert_eq!(&buf[..n], &want[..], "the bytes written, in order");
                }
            }
        }
    }
});
