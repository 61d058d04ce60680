//! The notifier thread of a ragged TCP ingress: the notices the learner hands it (persisted,
//! versions), written in order per connection without waiting on any worker, and a heartbeat every third of each worker's heartbeat
//! timeout, so that a worker takes a silent connection as lost (a partition, a learner host
//! gone without a word) and connects again.

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

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

/// The notifier thread: writes the notices [`super::RaggedTcp::notify`] hands it, in order
/// per connection, and the heartbeats that are due, until the server closes. It never
/// waits on one worker: a notice its connection cannot take now (the worker stopped
/// reading, or a long write of its own holds the connection) is kept and tried again
/// at the next tick, while the other workers' notices go out.
pub(super) fn notify_loop(shared: &Shared) {
    let mut backlog = Backlog::default();
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
            backlog.push(writer, notice);
        }
        backlog.flush(shared);
        beat(shared);
    }
}

/// The notices not yet written, per connection (keyed by its writer's address).
#[derive(Default)]
struct Backlog {
    waiting: HashMap<usize, Waiting>,
}

/// A connection's notices not yet written, oldest first.
struct Waiting {
    writer: Arc<Mutex<TcpStream>>,
    notices: Vec<Vec<u8>>,
}

/// How long a flush waits for a connection that another thread is writing to (its
/// acknowledgements take microseconds; a worker that stopped reading holds it up to the
/// write timeout, and is tried again at the next tick).
const WRITER_WAIT: Duration = Duration::from_micros(200);

impl Backlog {
    /// Queues `notice` for `writer`'s connection. A notice is state, not an event: one of
    /// the same kind still waiting (persisted up to, the latest version: a kind byte and a
    /// u64) is replaced by whichever says more, so what waits for a stalled worker is
    /// bounded by the kinds of notice, however many it misses.
    fn push(&mut self, writer: Arc<Mutex<TcpStream>>, notice: Vec<u8>) {
        let waiting = self
            .waiting
            .entry(Arc::as_ptr(&writer) as usize)
            .or_insert_with(|| Waiting { writer, notices: Vec::new() });
        let same = waiting.notices.iter_mut().find(|n| n.len() == 9 && n[0] == notice[0]);
        match same {
            Some(old) if notice.len() == 9 => {
                if value(&notice) > value(old) {
                    *old = notice;
                }
            }
            _ => waiting.notices.push(notice),
        }
    }

    /// Writes what each connection can take now, and forgets connections that ended.
    fn flush(&mut self, shared: &Shared) {
        if self.waiting.is_empty() {
            return;
        }
        self.waiting.retain(|_, waiting| waiting.write() == Written::Partly);
        if self.waiting.is_empty() {
            return;
        }
        let open: std::collections::HashSet<usize> =
            shared.conns.lock().iter().map(|c| Arc::as_ptr(&c.writer) as usize).collect();
        self.waiting.retain(|key, _| open.contains(key));
    }
}

/// The u64 a 9-byte notice carries after its kind byte.
fn value(notice: &[u8]) -> u64 {
    u64::from_le_bytes(notice[1..9].try_into().expect("a 9-byte notice"))
}

#[derive(PartialEq, Eq)]
enum Written {
    /// Every notice went out.
    All,
    /// Some wait for the next tick.
    Partly,
    /// The connection failed: its worker reconnects and hears the latest then.
    Gone,
}

impl Waiting {
    /// Writes its notices in order while the socket takes them without waiting.
    fn write(&mut self) -> Written {
        let Some(stream) = self.writer.try_lock_for(WRITER_WAIT) else {
            return Written::Partly;
        };
        while let Some(notice) = self.notices.first() {
            match send_now(&stream, notice) {
                Ok(n) if n == notice.len() => {}
                Ok(0) => return Written::Partly,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Written::Partly,
                // Part of a notice went out: the rest must follow before any other byte on
                // this stream (rare: a buffer with room for less than one notice).
                Ok(n) => {
                    if (&*stream).write_all(&notice[n..]).is_err() {
                        return Written::Gone;
                    }
                }
                Err(_) => return Written::Gone,
            }
            self.notices.remove(0);
        }
        Written::All
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
            // Its fate (sent, or no room, or a closing socket) is the worker's timeout's to
            // judge.
            let _ = send_now(&stream, &[v2::BEAT]);
        }
    }
}

/// Writes what of `bytes` the send buffer of `stream` has room for now (none:
/// `WouldBlock`).
#[cfg(unix)]
fn send_now(stream: &TcpStream, bytes: &[u8]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    #[cfg(target_os = "linux")]
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    #[cfg(not(target_os = "linux"))]
    let flags = libc::MSG_DONTWAIT;
    // SAFETY: `bytes` is a live slice of its length, sent on the stream's own open
    // descriptor; `send` reads at most that many bytes of it.
    let sent = unsafe { libc::send(stream.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), flags) };
    usize::try_from(sent).map_err(|_| std::io::Error::last_os_error())
}

/// Writes `bytes` to `stream` (no non-blocking send here).
#[cfg(not(unix))]
fn send_now(mut stream: &TcpStream, bytes: &[u8]) -> std::io::Result<usize> {
    stream.write_all(bytes).map(|()| bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(kind: u8, value: u64) -> Vec<u8> {
        let mut bytes = vec![kind];
        bytes.extend_from_slice(&value.to_le_bytes());
        bytes
    }

    #[test]
    fn a_waiting_notice_is_replaced_by_a_newer_one_of_its_kind_only() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let writer = Arc::new(Mutex::new(stream));
        let mut backlog = Backlog::default();
        for (kind, value) in [(7, 3), (5, 10), (7, 9), (7, 4), (5, 8), (5, 12)] {
            backlog.push(writer.clone(), notice(kind, value));
        }
        let waiting = &backlog.waiting[&(Arc::as_ptr(&writer) as usize)];
        assert_eq!(waiting.notices, vec![notice(7, 9), notice(5, 12)]);
    }

    #[test]
    fn notices_go_out_in_order_to_a_reading_peer() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        let mut waiting = Waiting {
            writer: Arc::new(Mutex::new(stream)),
            notices: vec![notice(5, 1), notice(7, 2)],
        };
        assert!(waiting.write() == Written::All);
        let mut got = [0u8; 18];
        peer.read_exact(&mut got).unwrap();
        assert_eq!(got.to_vec(), [notice(5, 1), notice(7, 2)].concat());
    }
}
