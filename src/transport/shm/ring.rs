//! The index protocol of a same-host shared-memory channel: one producer (a worker's
//! `TcpSender`), one consumer (the learner's connection task), a ring of `slots` fixed-size
//! slots, and two bells, one per direction.
//!
//! ```text
//!  producer (worker)                              consumer (learner)
//!  ─────────────────                              ──────────────────
//!  room: tail - head.load(Acquire) < slots        t = tail.load(Acquire); check t - head <= slots
//!  write slot tail % slots                        copy slot head % slots out, then validate it
//!  tail.store(tail + 1, Release)                  head.store(head + 1, Release)
//!  fence(SeqCst)                                  fence(SeqCst)
//!  reader_sleeping? -> ring the data bell         writer_sleeping? -> ring the space bell
//!
//!  sleeping (either side, on its own flag):
//!  flag.store(1, Relaxed); fence(SeqCst); look again (tail or head) -> nothing: wait on bell;
//!  flag.store(0, Relaxed)
//! ```
//!
//! Each side publishes its index and then fences; each sleeper raises its flag and then fences
//! before its last look. The two `SeqCst` fences form a Dekker pair (as in
//! [`crate::doorbell`]): either the sleeper's last look sees the new index, or the publisher's
//! load sees the raised flag and rings. A bell keeps a ring that arrives before the wait (an
//! eventfd's counter; a count under a mutex in the loom models), so that ring is not lost
//! either. Spurious wake-ups are harmless: both sides look again after every wait.
//!
//! The consumer never trusts the shared memory: it keeps its own `head` (it only ever stores
//! it), and [`Indices::committed`] rejects a `tail` behind `head` or more than `slots` ahead
//! of it. A producer that scribbles on `head` or the flags only confuses itself.
//!
//! The type is compiled in loom builds too, on the `src/sync.rs` facade, so
//! `tests/loom_shm.rs` model-checks this very code. Public but hidden from the docs only so
//! the loom models (integration tests) can reach it.

use crate::sync::{fence, AtomicU32, AtomicU64};

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};

/// A bell: one side rings, the other waits (elsewhere) until it was rung at least once
/// since its last wait. A ring before the wait must not be lost.
pub trait Bell {
    /// Wakes the waiter (now, or at its next wait).
    fn ring(&self);
}

/// The shared indices of one ring. Both `tail` and `head` are absolute sample counts (they
/// never wrap in practice: 2^64 samples); slot `i` holds sample `i % slots`.
#[derive(Clone, Copy)]
pub struct Indices<'a> {
    /// Samples committed by the producer. Written only by the producer.
    pub tail: &'a AtomicU64,
    /// Samples taken by the consumer. Written only by the consumer.
    pub head: &'a AtomicU64,
    /// Non-zero while the consumer sleeps (or is about to) on the data bell.
    pub reader_sleeping: &'a AtomicU32,
    /// Non-zero while the producer sleeps (or is about to) on the space bell.
    pub writer_sleeping: &'a AtomicU32,
    /// Slots in the ring (at least 1).
    pub slots: u64,
}

/// The producer broke the protocol: the consumer ends the channel (the producer's own
/// samples are the only casualties).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corrupt {
    /// The `tail` read.
    pub tail: u64,
    /// The consumer's own `head`.
    pub head: u64,
}

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the worker's shared-memory ring is corrupt: tail {} with head {}",
            self.tail, self.head
        )
    }
}

impl Indices<'_> {
    // ----- producer -----

    /// Producer: whether there is a free slot for sample `tail` (the producer's own count).
    /// The Acquire pairs with the consumer's Release in [`Indices::release`]: the slot it
    /// freed has been copied out before the producer overwrites it.
    pub fn has_room(&self, tail: u64) -> bool {
        // ORDERING: Acquire pairs with the consumer's Release store of `head` in `release`:
        // its copy of the slot we are about to reuse happened before.
        tail.wrapping_sub(self.head.load(Acquire)) < self.slots
    }

    /// Producer of a byte pipe (the ring's units are bytes): how many units are free after
    /// `written` (the producer's own count, committed or not). The Acquire is `has_room`'s.
    pub fn room(&self, written: u64) -> u64 {
        // ORDERING: Acquire pairs with the consumer's Release store of `head` in `release`,
        // as in `has_room`.
        self.slots.saturating_sub(written.wrapping_sub(self.head.load(Acquire)))
    }

    /// Producer: samples the consumer has taken so far.
    pub fn taken(&self) -> u64 {
        // ORDERING: Acquire pairs with the consumer's Release in `release` (see `has_room`).
        self.head.load(Acquire)
    }

    /// Producer: commits every sample before `tail` (their slots are written) and rings the
    /// data bell if the consumer sleeps or is about to.
    pub fn commit(&self, tail: u64, bell: &impl Bell) {
        // ORDERING: Release publishes the slot writes before it to the consumer's Acquire load
        // in `committed`.
        self.tail.store(tail, Release);
        // ORDERING: SeqCst fence, the publisher's half of the Dekker pair with `sleep_begin`'s
        // fence on the consumer side: either its last look sees this tail, or the load below
        // sees its raised flag.
        fence(SeqCst);
        // ORDERING: Relaxed — ordered after the store by the fence above.
        if self.reader_sleeping.load(Relaxed) != 0 {
            bell.ring();
        }
    }

    // ----- consumer -----

    /// Consumer: the producer's committed count, checked against the consumer's own `head`:
    /// at most `slots` ahead and never behind.
    ///
    /// # Errors
    /// [`Corrupt`] if the producer wrote an impossible `tail`.
    pub fn committed(&self, head: u64) -> Result<u64, Corrupt> {
        // ORDERING: Acquire pairs with the producer's Release in `commit`: the slots before
        // this tail are written.
        let tail = self.tail.load(Acquire);
        if tail < head || tail - head > self.slots {
            return Err(Corrupt { tail, head });
        }
        Ok(tail)
    }

    /// Consumer: every sample before `head` is copied out; hands their slots back and rings
    /// the space bell if the producer sleeps or is about to.
    pub fn release(&self, head: u64, bell: &impl Bell) {
        // ORDERING: Release: our copies out of the freed slots happen before the producer's
        // Acquire in `has_room` lets it overwrite them.
        self.head.store(head, Release);
        // ORDERING: SeqCst fence, the publisher's half of the Dekker pair with the producer's
        // `sleep_begin` (see `commit`).
        fence(SeqCst);
        // ORDERING: Relaxed — ordered after the store by the fence above.
        if self.writer_sleeping.load(Relaxed) != 0 {
            bell.ring();
        }
    }

    /// Consumer: [`Indices::release`] for a producer that says which count it waits for:
    /// rings only if it sleeps and `head` reached its `target` (see
    /// [`Indices::sleep_for`]), so a producer waiting for many is woken once, not once per
    /// step.
    pub fn release_to(&self, head: u64, target: &AtomicU64, bell: &impl Bell) {
        // ORDERING: Release, as in `release`.
        self.head.store(head, Release);
        // ORDERING: SeqCst fence, as in `release`; the producer stores `target` before its
        // own fence in `sleep_for`, so a flag seen raised here comes with its target.
        fence(SeqCst);
        // ORDERING: Relaxed, both — ordered after the store by the fence above, and after
        // the producer's stores by its fence.
        if self.writer_sleeping.load(Relaxed) != 0 && head >= target.load(Relaxed) {
            bell.ring();
        }
    }

    // ----- either side -----

    /// Producer: [`Indices::sleep_begin`] on `flag`, saying it waits until `head` reaches
    /// `want` (for a consumer that publishes with [`Indices::release_to`]).
    pub fn sleep_for(flag: &AtomicU32, target: &AtomicU64, want: u64) {
        // ORDERING: Relaxed — published by the SeqCst fence in `sleep_begin`, before the
        // flag can be seen after the consumer's fence.
        target.store(want, Relaxed);
        Self::sleep_begin(flag);
    }

    /// Raises `flag` (the caller's own: `reader_sleeping` for the consumer, `writer_sleeping`
    /// for the producer) before the caller's last look at the other side's index. After this
    /// the caller looks again, waits on its bell only if there is still nothing, and calls
    /// [`Indices::sleep_end`] once awake.
    pub fn sleep_begin(flag: &AtomicU32) {
        // ORDERING: Relaxed store + SeqCst fence: the sleeper's half of the Dekker pair with
        // the fence in `commit`/`release`; the fence orders this store before the last look.
        flag.store(1, Relaxed);
        fence(SeqCst);
    }

    /// Lowers `flag` once awake (or when the last look found something).
    pub fn sleep_end(flag: &AtomicU32) {
        // ORDERING: Relaxed — the flag guards no data and only saves rings while we are awake;
        // a publisher that reads this 0 instead of our next 1 fences before our next look,
        // which then sees its index.
        flag.store(0, Relaxed);
    }
}

/// Where `len` units from absolute position `pos` lie in a ring of `slots` units: one span,
/// or two when they wrap past its end (the second one then starts at 0). Each is (start,
/// length); an empty second span has length 0. `len` is at most `slots`.
pub fn spans(pos: u64, len: usize, slots: usize) -> [(usize, usize); 2] {
    let start = usize::try_from(pos % slots.max(1) as u64).expect("< slots");
    let first = len.min(slots - start);
    [(start, first), (0, len - first)]
}
