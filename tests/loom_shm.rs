//! loom models of the shared-memory ring's index protocol (`src/transport/shm/ring.rs`): a producer that
//! commits samples into a ring of one or two slots and sleeps on the space bell when it is
//! full, then waits until every sample is taken (what `close()` does), and a consumer that
//! takes them in order and sleeps on the data bell when there are none.
//!
//! Run with `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --test
//! loom_shm --target-dir target/loom`. `Indices` is the real code, on loom's atomics and
//! fences; the bells stand in for the eventfds with the same semantics (a ring before the
//! wait is kept), and wait with no timeout, so a lost wake-up is a deadlock loom reports. The
//! slots are loom `UnsafeCell`s, so a slot read that is not ordered after its write (or a
//! write before the previous read of the slot) is a data race loom reports.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU32, AtomicU64};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

use echo::transport::shm::ring::{spans, Bell, Indices};

/// An eventfd's semantics: a ring sets the count; a wait returns once it is set and resets it.
#[derive(Default)]
struct LoomBell {
    rung: Mutex<bool>,
    cond: Condvar,
}

impl Bell for LoomBell {
    fn ring(&self) {
        *self.rung.lock().unwrap() = true;
        self.cond.notify_one();
    }
}

impl LoomBell {
    fn wait(&self) {
        let mut rung = self.rung.lock().unwrap();
        while !*rung {
            rung = self.cond.wait(rung).unwrap();
        }
        *rung = false;
    }
}

struct Ring {
    tail: AtomicU64,
    head: AtomicU64,
    reader_sleeping: AtomicU32,
    writer_sleeping: AtomicU32,
    slots: Vec<UnsafeCell<u64>>,
    data: LoomBell,
    space: LoomBell,
}

impl Ring {
    fn new(slots: usize) -> Self {
        Self {
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
            reader_sleeping: AtomicU32::new(0),
            writer_sleeping: AtomicU32::new(0),
            slots: (0..slots).map(|_| UnsafeCell::new(0)).collect(),
            data: LoomBell::default(),
            space: LoomBell::default(),
        }
    }

    fn indices(&self) -> Indices<'_> {
        Indices {
            tail: &self.tail,
            head: &self.head,
            reader_sleeping: &self.reader_sleeping,
            writer_sleeping: &self.writer_sleeping,
            slots: self.slots.len() as u64,
        }
    }

    /// The producer's wait until `ready` (`Writer::wait_taken`): raise the flag, look again,
    /// sleep on the space bell only if still not ready.
    fn producer_wait(&self, ready: impl Fn(&Indices<'_>) -> bool) {
        let ix = self.indices();
        while !ready(&ix) {
            Indices::sleep_begin(ix.writer_sleeping);
            if !ready(&ix) {
                self.space.wait();
            }
            Indices::sleep_end(ix.writer_sleeping);
        }
    }
}

fn model(slots: usize, items: u64) {
    loom::model(move || {
        let ring = Arc::new(Ring::new(slots));
        let producer = {
            let ring = Arc::clone(&ring);
            thread::spawn(move || {
                let ix = ring.indices();
                for i in 0..items {
                    ring.producer_wait(|ix| ix.has_room(i));
                    let slot = &ring.slots[(i % slots as u64) as usize];
                    // SAFETY: loom checks this write against every read of the slot.
                    slot.with_mut(|p| unsafe { *p = i + 100 });
                    ix.commit(i + 1, &ring.data);
                }
                // `close()`: wait until the consumer took everything.
                ring.producer_wait(|ix| ix.taken() >= items);
            })
        };
        let ix = ring.indices();
        for head in 0..items {
            loop {
                if ix.committed(head).unwrap() > head {
                    break;
                }
                Indices::sleep_begin(ix.reader_sleeping);
                if ix.committed(head).unwrap() == head {
                    ring.data.wait();
                }
                Indices::sleep_end(ix.reader_sleeping);
            }
            let slot = &ring.slots[(head % slots as u64) as usize];
            // SAFETY: loom checks this read against every write of the slot.
            let value = slot.with(|p| unsafe { *p });
            assert_eq!(value, head + 100, "sample {head}");
            ix.release(head + 1, &ring.space);
        }
        producer.join().unwrap();
        assert_eq!(ix.taken(), items);
    });
}

#[test]
fn one_slot_three_samples_every_sample_once_in_order_and_no_lost_wakeup() {
    model(1, 3);
}

#[test]
fn two_slots_three_samples_every_sample_once_in_order_and_no_lost_wakeup() {
    model(2, 3);
}

/// The byte pipe's use of the same protocol (`src/transport/shm/pipe.rs`): the unit is a
/// byte, the producer writes frames of several bytes as far as there is room
/// ([`Indices::room`], [`spans`] for the wrap), commits early when the pipe is full, and
/// the consumer reads whatever is committed, in chunks of any size.
fn pipe_model(capacity: usize, frames: &'static [usize]) {
    loom::model(move || {
        let ring = Arc::new(Ring::new(capacity));
        let total: usize = frames.iter().sum();
        let producer = {
            let ring = Arc::clone(&ring);
            thread::spawn(move || {
                let ix = ring.indices();
                let mut written = 0u64;
                for &len in frames {
                    let mut left = len;
                    while left > 0 {
                        if ix.room(written) == 0 {
                            ix.commit(written, &ring.data);
                            ring.producer_wait(|ix| ix.room(written) > 0);
                        }
                        let n = left.min(ix.room(written) as usize);
                        for (start, len) in spans(written, n, capacity) {
                            for k in start..start + len {
                                let byte = written + (k - start) as u64;
                                // SAFETY: loom checks this write against every read.
                                ring.slots[k].with_mut(|p| unsafe { *p = byte + 100 });
                            }
                            written += len as u64;
                        }
                        left -= n;
                    }
                    ix.commit(written, &ring.data);
                }
                ring.producer_wait(|ix| ix.taken() >= written);
            })
        };
        let ix = ring.indices();
        let mut head = 0u64;
        while head < total as u64 {
            let tail = loop {
                let tail = ix.committed(head).unwrap();
                if tail > head {
                    break tail;
                }
                Indices::sleep_begin(ix.reader_sleeping);
                if ix.committed(head).unwrap() == head {
                    ring.data.wait();
                }
                Indices::sleep_end(ix.reader_sleeping);
            };
            let n = (tail - head) as usize;
            for (start, len) in spans(head, n, capacity) {
                for k in start..start + len {
                    // SAFETY: loom checks this read against every write of the cell.
                    let value = ring.slots[k].with(|p| unsafe { *p });
                    assert_eq!(value, head + 100, "byte {head}");
                    head += 1;
                }
            }
            ix.release(head, &ring.space);
        }
        producer.join().unwrap();
        assert_eq!(ix.taken(), total as u64);
    });
}

#[test]
fn pipe_of_two_bytes_frames_larger_than_it_every_byte_once_in_order() {
    pipe_model(2, &[3, 1]);
}

/// A byte pipe's acknowledgements (`PipeReader::acknowledge`, `PipeAcks::wait_stored`): the
/// consumer publishes each count stored with [`Indices::release_to`], ringing only when the
/// count reached the producer's target; the producer says which count it waits for with
/// [`Indices::sleep_for`]. A lost wake-up (the target reached, the producer asleep, no ring)
/// is a deadlock loom reports.
fn acks_model(stored: u64, targets: &'static [u64]) {
    loom::model(move || {
        let ring = Arc::new(Ring::new(1));
        let target = Arc::new(AtomicU64::new(0));
        let waiter = {
            let (ring, target) = (Arc::clone(&ring), Arc::clone(&target));
            thread::spawn(move || {
                let ix = ring.indices();
                for &want in targets {
                    while ix.taken() < want {
                        Indices::sleep_for(ix.writer_sleeping, &target, want);
                        if ix.taken() < want {
                            ring.space.wait();
                        }
                        Indices::sleep_end(ix.writer_sleeping);
                    }
                }
            })
        };
        let ix = ring.indices();
        for n in 1..=stored {
            ix.release_to(n, &target, &ring.space);
        }
        waiter.join().unwrap();
    });
}

#[test]
fn acks_wake_a_producer_waiting_for_a_count_once_it_is_reached() {
    acks_model(3, &[2, 3]);
}
