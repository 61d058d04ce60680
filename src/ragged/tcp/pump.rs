//! Pumps: threads that each serve the shared-memory pipes of many workers, so that a learner
//! with many same-host workers runs a few busy threads rather than one per worker, each woken
//! for a frame or two (on a machine with fewer cores than workers those wake-ups, and the
//! threads' contention for the table's lock, cost more than the frames' copies).
//!
//! A worker's connection thread hands its attached pipe to a pump ([`serve`]) and waits. The
//! pump takes, from each of its pipes in turn, every frame that is whole in the pipe: it reads
//! the header where it lies, checks it with the TCP parser's own check, and inserts the body
//! from the pipe straight into the table without waiting for room (a full table leaves the
//! frame where it is, and the pump waits for room on one insert at a time). When none of its
//! pipes has a whole frame it sleeps on all their data bells at once (and on their TCP
//! sockets, whose end is the worker's).
//!
//! Anything else goes back to the connection thread, which goes on with the blocking reader
//! for the rest of the connection, where every other case is handled: a frame larger than
//! the pipe (it streams through), one the parser or the table refuses (the reader meets it
//! again and reports it to the worker), a goodbye or an unknown byte, the worker's socket
//! ending (the reader takes what was committed before), the server closing.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::shm::PipeInput;
use super::{Ahead, InPlace, Owned, Shared, INSERT_SLICE};
use crate::error::EchoError;
use crate::ragged::table::GroupSource;
use crate::ragged::wire::{peek_frame, Peeked};
use crate::transport::shm::bell::EventFd;
use crate::transport::shm::pipe::PIPE_CAPACITY;
use crate::transport::shm::ring::Bell;

/// The most frames a pump takes from one pipe before it looks at the next.
const TURN_FRAMES: usize = 64;
/// How long a pump's sleep lasts at most before it looks at the server's closing again.
const SLEEP_SLICE: Duration = Duration::from_millis(200);
/// How long one insert of a stalled pump waits for room (then every pipe is tried again).
const ROOM_WAIT: Duration = Duration::from_millis(5);

/// A pipe handed to a pump, with what goes back to its connection thread.
struct Lease {
    input: PipeInput,
    owned: Owned,
    back: mpsc::Sender<Returned>,
    /// How far the worker had committed when the pump last left the pipe without a whole
    /// frame at its front: it sleeps until a worker commits past that (a worker that stops
    /// half-way through a frame costs it nothing).
    seen: u64,
}

impl Lease {
    /// Whether the worker committed bytes the pump has not looked at.
    fn news(&self) -> bool {
        let pipe = self.input.pipe();
        pipe.ready().map_or(true, |ready| pipe.head() + ready > self.seen)
    }
}

/// A pipe a pump gave back, and why.
pub(super) struct Returned {
    pub(super) input: PipeInput,
    pub(super) owned: Owned,
    /// False: the worker's session went to a newer connection of the same worker, which
    /// resends what this one did not store; the connection ends.
    pub(super) go_on: bool,
}

/// One pump: its pipes arrive in `inbox`, and `bell` wakes it for them.
pub(super) struct Pump {
    inbox: Mutex<Inbox>,
    bell: EventFd,
    /// Pipes handed to it and not given back.
    load: AtomicUsize,
}

#[derive(Default)]
struct Inbox {
    leases: Vec<Lease>,
    /// The pump's thread has ended (the server is closing): it takes no more pipes.
    stopped: bool,
}

/// The pumps of a server, started as pipes are attached.
#[derive(Default)]
pub(super) struct Pumps(Mutex<Vec<Arc<Pump>>>);

/// Serves `input` (a worker's attached pipe) on a pump until the pump gives it back (at
/// once if no pump could be started, or the server is closing: the caller then reads the
/// pipe itself). `None` only if the pump's thread panicked.
pub(super) fn serve(shared: &Arc<Shared>, input: PipeInput, owned: Owned) -> Option<Returned> {
    let Some(pump) = pick(shared) else {
        return Some(Returned { input, owned, go_on: true });
    };
    let (back, returned) = mpsc::channel();
    {
        let mut inbox = pump.inbox.lock();
        if inbox.stopped {
            return Some(Returned { input, owned, go_on: true });
        }
        inbox.leases.push(Lease { input, owned, back, seen: 0 });
    }
    // ORDERING: Relaxed — a load estimate for picking pumps.
    pump.load.fetch_add(1, Ordering::Relaxed);
    pump.bell.ring();
    let got = returned.recv().ok();
    // ORDERING: Relaxed — as above.
    pump.load.fetch_sub(1, Ordering::Relaxed);
    got
}

/// The least loaded pump, starting one while there are fewer than half the cores (at least
/// one, at most 8).
fn pick(shared: &Arc<Shared>) -> Option<Arc<Pump>> {
    let mut pumps = shared.pumps.0.lock();
    let wanted = std::thread::available_parallelism().map_or(1, |n| n.get() / 2).clamp(1, 8);
    if pumps.len() < wanted {
        let pump = Arc::new(Pump {
            inbox: Mutex::new(Inbox::default()),
            bell: EventFd::new().ok()?,
            load: AtomicUsize::new(0),
        });
        let (theirs, serving) = (Arc::clone(&pump), Arc::clone(shared));
        let thread = std::thread::Builder::new()
            .name("echo-ragged-pump".into())
            .spawn(move || run(&serving, &theirs))
            .ok()?;
        shared.threads.lock().push(thread);
        pumps.push(pump);
    }
    // ORDERING: Relaxed — an estimate.
    pumps.iter().min_by_key(|p| p.load.load(Ordering::Relaxed)).cloned()
}

/// What one turn at a pipe did.
enum Turn {
    /// Stored `frames` frames (maybe 0); `full`: the next one found no room.
    Took { frames: usize, full: bool },
    /// The pipe goes back to its connection thread.
    Back { go_on: bool },
}

/// A pump's thread: serves its pipes until the server closes, then gives every one back.
fn run(shared: &Shared, pump: &Pump) {
    let mut leases: Vec<Lease> = Vec::new();
    let mut head = Vec::new();
    let mut stalled = false;
    loop {
        leases.append(&mut pump.inbox.lock().leases);
        // ORDERING: SeqCst — pairs with `close`: the connection threads go on with the
        // blocking reader, which ends as the server closes.
        if shared.closing.load(Ordering::SeqCst) {
            for lease in leases.drain(..) {
                give_back(lease, true);
            }
            // Under the inbox's lock: a pipe handed over after this goes back at once.
            let mut inbox = pump.inbox.lock();
            if inbox.leases.is_empty() {
                inbox.stopped = true;
                return;
            }
            continue;
        }
        let (mut took, mut full) = (0, false);
        // One insert of a round after a round that found no room waits for some.
        let mut room_wait = stalled.then(|| Instant::now() + ROOM_WAIT);
        let mut i = 0;
        while i < leases.len() {
            match turn(shared, &mut leases[i], &mut head, &mut room_wait) {
                Turn::Took { frames, full: f } => {
                    took += frames;
                    full |= f;
                    i += 1;
                }
                Turn::Back { go_on } => give_back(leases.swap_remove(i), go_on),
            }
        }
        stalled = took == 0 && full;
        if took > 0 || full {
            continue;
        }
        sleep(pump, &mut leases);
    }
}

fn give_back(lease: Lease, go_on: bool) {
    let Lease { input, owned, back, .. } = lease;
    // The connection thread waits for it; it is gone only if its thread panicked.
    let _ = back.send(Returned { input, owned, go_on });
}

/// Takes the whole frames at the front of `lease`'s pipe (at most [`TURN_FRAMES`]).
fn turn(
    shared: &Shared,
    lease: &mut Lease,
    head: &mut Vec<u8>,
    room_wait: &mut Option<Instant>,
) -> Turn {
    let spec = shared.table.spec();
    let max_samples = shared.table.config().batch_size.min(usize::from(u16::MAX));
    let mut frames = 0;
    while frames < TURN_FRAMES {
        let pipe = lease.input.pipe();
        let Ok(committed) = pipe.ready() else {
            return Turn::Back { go_on: true }; // a corrupt tail: the reader reports it
        };
        // Left here without a whole frame: what the next look must go past.
        lease.seen = pipe.head() + committed;
        let ready = usize::try_from(committed).unwrap_or(usize::MAX);
        let peeked = peek_frame(spec, max_samples, ready, PIPE_CAPACITY, head, |at, out| {
            pipe.copy_ahead(at as u64, out);
        });
        let (frame, head_bytes, total) = match peeked {
            Peeked::Partial => break,
            Peeked::Heartbeat => {
                lease.input.pipe_mut().skip(1);
                continue;
            }
            Peeked::Elsewhere => return Turn::Back { go_on: true },
            Peeked::Whole { head, head_bytes, total } => (head, head_bytes, total),
        };
        let body = Shifted { pipe: lease.input.pipe(), by: 1 + head_bytes };
        let source = InPlace::new(&body, &frame, spec.columns());
        let deadline = room_wait.unwrap_or_else(Instant::now);
        match store_once(shared, &lease.owned, &source, frame.priority, deadline) {
            Ok(Some(())) => {}
            Ok(None) => {
                *room_wait = None;
                return Turn::Took { frames, full: true };
            }
            Err(Stop::SessionLost) => return Turn::Back { go_on: false },
            Err(Stop::Refused) => return Turn::Back { go_on: true },
        }
        lease.input.pipe_mut().skip(total as u64);
        // ORDERING: Relaxed — a statistics counter.
        shared.counters.samples.fetch_add(frame.samples as u64, Ordering::Relaxed);
        if lease.input.ack_stored(frame.samples).is_err() {
            return Turn::Back { go_on: true };
        }
        frames += 1;
    }
    Turn::Took { frames, full: false }
}

/// Why a pump stops storing a pipe's frames.
enum Stop {
    /// A newer connection of the worker owns its session.
    SessionLost,
    /// The table refused the frame, or is closed: the blocking reader meets it again.
    Refused,
}

/// Stores a frame unless the table has no room by `deadline`: `Ok(None)` then.
fn store_once(
    shared: &Shared,
    owned: &Owned,
    source: &InPlace<'_>,
    priority: Option<f64>,
    deadline: Instant,
) -> Result<Option<()>, Stop> {
    // Under the session's lock, as the blocking reader stores (see `super::store`).
    let _turn = owned.session.turn.lock();
    if owned.session.owner() != owned.id {
        return Err(Stop::SessionLost);
    }
    let deadline = deadline.min(Instant::now() + INSERT_SLICE);
    let stored = || {
        // ORDERING: Relaxed — under the table's lock (see `Session::stored`).
        owned.session.stored.fetch_add(source.samples() as u64, Ordering::Relaxed);
    };
    match shared.table.insert_from_then(source, priority, Some(deadline), stored) {
        Ok(_) => {
            owned.stored_one();
            Ok(Some(()))
        }
        Err(EchoError::TimedOut) => Ok(None),
        Err(_) => Err(Stop::Refused),
    }
}

/// A pipe's bytes from `by` bytes past what was read: a frame's body behind its header.
struct Shifted<'a> {
    pipe: &'a crate::transport::shm::pipe::PipeReader,
    by: usize,
}

impl Ahead for Shifted<'_> {
    fn copy_ahead(&self, offset: usize, out: &mut [u8]) {
        self.pipe.copy_ahead((self.by + offset) as u64, out);
    }
}

/// Sleeps until a pipe's worker commits, a socket ends, a pipe is handed over, or a slice
/// passes. Leases whose socket ended go back to their threads.
fn sleep(pump: &Pump, leases: &mut Vec<Lease>) {
    for lease in leases.iter() {
        lease.input.pipe().sleep_begin();
    }
    // After raising the flags: a commit before them is seen here, one after rings.
    if !leases.iter().any(Lease::news) {
        let mut polls: Vec<libc::pollfd> = Vec::with_capacity(2 * leases.len() + 1);
        let fd = |fd: RawFd, events| libc::pollfd { fd, events, revents: 0 };
        polls.push(fd(std::os::fd::AsRawFd::as_raw_fd(&pump.bell), libc::POLLIN));
        for lease in leases.iter() {
            let pipe = lease.input.pipe();
            polls.push(fd(pipe.data_fd(), libc::POLLIN));
            polls.push(fd(pipe.watch_fd().unwrap_or(-1), libc::POLLIN | libc::POLLRDHUP));
        }
        let ms = libc::c_int::try_from(SLEEP_SLICE.as_millis()).unwrap_or(libc::c_int::MAX);
        let count = libc::nfds_t::try_from(polls.len()).unwrap_or(libc::nfds_t::MAX);
        // SAFETY: `polls` holds `count` valid pollfds (a negative fd is ignored by poll).
        let woken = unsafe { libc::poll(polls.as_mut_ptr(), count, ms) };
        if woken > 0 {
            if polls[0].revents != 0 {
                pump.bell.drain();
            }
            // Back to their threads: the leases whose socket has something to say (its end,
            // or a byte the reader refuses).
            let ended: Vec<usize> =
                (0..leases.len()).filter(|&i| polls[2 + 2 * i].revents != 0).collect();
            for lease in leases.iter() {
                lease.input.pipe().sleep_end();
            }
            for &i in ended.iter().rev() {
                give_back(leases.swap_remove(i), true);
            }
            return;
        }
    }
    for lease in leases.iter() {
        lease.input.pipe().sleep_end();
    }
}
