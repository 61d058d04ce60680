//! The sequence lock of a published-parameters slot in shared memory: one writer (the
//! learner's `publish`, serialised by its own lock) rewrites a slot while readers in other
//! processes copy it, and a reader keeps a copy only if no write overlapped it. Readers never
//! block the writer and never write; a torn copy is thrown away and read again.
//!
//! ```text
//!  writer                                  reader
//!  ──────                                  ──────
//!  s = seq (its own, even)                 s1 = seq            (Acquire; odd: being written)
//!  seq = s + 1                 (Relaxed)   copy version and bytes
//!  fence(Release)                          fence(Acquire)
//!  write version and bytes                 s2 = seq            (Relaxed)
//!  seq = s + 2                 (Release)   kept iff s1 == s2 and s1 is even
//! ```
//!
//! If the reader's copy saw any write of a pass, its fence makes that pass's odd store (made
//! before the writer's release fence) visible to its second load, so `s2 != s1`; if `s1`
//! is even and equal to `s2`, every byte it copied was written before `s1`'s store, by the
//! writes its Acquire synchronised with. `tests/loom_seqlock.rs` checks it on loom's atomics
//! (the bytes there are relaxed atomics: in shared memory they are plain copies, which the
//! seqlock discards when torn).

use crate::sync::{fence, AtomicU64};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// Runs `write` (which rewrites the slot `seq` guards) as one pass of the sequence lock. Only
/// one writer may run at a time (the caller serialises them).
pub fn write_with<R>(seq: &AtomicU64, write: impl FnOnce() -> R) -> R {
    // ORDERING: Relaxed — only this (serialised) writer stores `seq`.
    let start = seq.load(Relaxed);
    // ORDERING: Relaxed — made visible before the writes by the fence below.
    seq.store(start | 1, Relaxed);
    // ORDERING: Release — orders the odd store before the writes: a reader whose copy sees
    // one of them sees `seq` changed on its second load (after its Acquire fence).
    fence(Release);
    let out = write();
    // ORDERING: Release pairs with the reader's Acquire first load: a reader that sees this
    // even value sees every write of the pass.
    seq.store((start | 1) + 1, Release);
    out
}

/// Runs `read` (which copies the slot `seq` guards) and returns what it returned if no write
/// overlapped it; `None` if one did (or was under way): read again.
pub fn read_with<R>(seq: &AtomicU64, read: impl FnOnce() -> R) -> Option<R> {
    // ORDERING: Acquire pairs with the writer's Release store of the even value.
    let before = seq.load(Acquire);
    if before & 1 == 1 {
        return None;
    }
    let out = read();
    // ORDERING: Acquire — orders the copy before the second load: a write the copy saw has
    // its pass's odd store visible to that load.
    fence(Acquire);
    // ORDERING: Relaxed — ordered by the fence above.
    (seq.load(Relaxed) == before).then_some(out)
}
