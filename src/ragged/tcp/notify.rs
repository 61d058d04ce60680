//! The notifier thread of a ragged TCP ingress: the notices the learner hands it (persisted,
//! versions), written in order, and a heartbeat every third of each worker's heartbeat
//! timeout, so that a worker takes a silent connection as lost (a partition, a learner host
//! gone without a word) and connects again.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use std::io::Write;

use super::Shared;
use crate::transport::wire::v2::{self, Hello};

/// How often the notifier looks at whose heartbeat is due.
const BEAT_TICK: Duration = Duration::from_millis(50);
/// The shortest time between two heartbeats to one worker.
const FASTEST_BEAT: Duration = Duration::from_millis(50);

/// A connection's heartbeats, from its hello: one every third of the worker's heartbeat
/// timeout, the first one due a third after `now`; none when it asked for none.
pub(super) fn beat_for(hello: &Hello, now: Instant) -> Option<(Duration, Instant)> {
    (hello.heartbeat_ms > 0).then(|| {
        let every = (Duration::from_millis(u64::from(hello.heartbeat_ms)) / 3).max(FASTEST_BEAT);
        (every, now + every)
    })
}

/// The notifier thread: writes the notices [`super::RaggedTcp::notify`] hands it, in order,
/// and the heartbeats that are due, until the server closes.
pub(super) fn notify_loop(shared: &Shared) {
    loop {
        let batch = {
            let mut notices = shared.notices.lock();
            // ORDERING: SeqCst — pairs with `close`, which sets the flag, then wakes us
            // under this lock.
            while notices.is_empty() && !shared.closing.load(Ordering::SeqCst) {
                if shared.noticed.wait_for(&mut notices, BEAT_TICK).timed_out() {
                    break;
                }
            }
            std::mem::take(&mut *notices)
        };
        // ORDERING: SeqCst — as above.
        if batch.is_empty() && shared.closing.load(Ordering::SeqCst) {
            return;
        }
        for (writer, notice) in batch {
            let _ = writer.lock().write_all(&notice);
        }
        beat(shared);
    }
}

/// Sends a heartbeat byte to each connection whose heartbeat is due. Never blocks: a
/// connection whose writer is busy (its acknowledgements, a chunk: bytes the worker reads
/// as well) or whose socket buffer is full (its worker is not reading) is skipped this time,
/// so that one stalled worker does not hold up the others' heartbeats.
fn beat(shared: &Shared) {
    let now = Instant::now();
    let due: Vec<_> = {
        let mut conns = shared.conns.lock();
        conns
            .iter_mut()
            .filter_map(|conn| {
                let (every, next) = conn.beat.as_mut()?;
                if now < *next {
                    return None;
                }
                *next = now + *every;
                Some(conn.writer.clone())
            })
            .collect()
    };
    for writer in due {
        if let Some(stream) = writer.try_lock() {
            send_now(&stream, v2::BEAT);
        }
    }
}

/// Writes `byte` to `stream` if its send buffer has room now, else nothing.
#[cfg(unix)]
fn send_now(stream: &std::net::TcpStream, byte: u8) {
    use std::os::fd::AsRawFd;
    #[cfg(target_os = "linux")]
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    #[cfg(not(target_os = "linux"))]
    let flags = libc::MSG_DONTWAIT;
    // SAFETY: one byte from a live local, on the stream's own open descriptor; the result
    // (sent, or EAGAIN with a full buffer, or an error on a closing socket) is only a
    // heartbeat's fate, which the worker's timeout judges.
    let _ = unsafe { libc::send(stream.as_raw_fd(), (&raw const byte).cast(), 1, flags) };
}

/// Writes `byte` to `stream` (no non-blocking send here).
#[cfg(not(unix))]
fn send_now(mut stream: &std::net::TcpStream, byte: u8) {
    let _ = stream.write_all(&[byte]);
}
