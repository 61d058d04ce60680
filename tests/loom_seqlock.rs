//! loom model of the published-parameters slot's sequence lock
//! (`src/transport/shm/seqlock.rs`): a writer rewrites a slot of two words twice while a
//! reader copies it; every copy the lock keeps holds one pass's words, never a mix.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test --release --test loom_seqlock --target-dir
//! target/loom`. The words are loom atomics read and written `Relaxed` (in shared memory
//! they are plain copies that the lock discards when torn), so only the lock's own orderings
//! keep a copy consistent.
#![cfg(loom)]

use loom::sync::atomic::AtomicU64;
use loom::sync::Arc;
use loom::thread;
use std::sync::atomic::Ordering::Relaxed;

use echo::transport::shm::seqlock::{read_with, write_with};

struct Slot {
    seq: AtomicU64,
    words: [AtomicU64; 2],
}

#[test]
fn a_kept_copy_is_one_pass_never_a_mix() {
    loom::model(|| {
        let slot = Arc::new(Slot {
            seq: AtomicU64::new(0),
            words: [AtomicU64::new(0), AtomicU64::new(0)],
        });
        let writer = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || {
                for pass in 1..=2 {
                    write_with(&slot.seq, || {
                        slot.words[0].store(pass, Relaxed);
                        slot.words[1].store(pass, Relaxed);
                    });
                }
            })
        };
        for _ in 0..2 {
            let copy =
                read_with(&slot.seq, || (slot.words[0].load(Relaxed), slot.words[1].load(Relaxed)));
            if let Some((a, b)) = copy {
                assert_eq!(a, b, "a torn copy was kept");
            }
        }
        writer.join().unwrap();
        let last = read_with(&slot.seq, || slot.words[0].load(Relaxed));
        assert_eq!(last, Some(2), "after the writer, a copy is kept and is its last pass");
    });
}
