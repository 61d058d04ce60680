//! One live connection of a client: its socket and shared-memory writer, the ack counts it
//! shares with its reader thread ([`Reading`]), which reads the acks, heartbeats and the
//! server's closing notice, and wakes a sender waiting on shared memory when the link is lost.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering::{Acquire, Release};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;

use super::options::LOG_TARGET;
use super::OFFER_GRACE;
use crate::codec::LeafCodecs;
use crate::spec::DataSpec;
use crate::sync::{Arc, AtomicBool, AtomicU64, AtomicU8, Signal};
use crate::transport::shm::worker::{LossBell, ShmWriter};
use crate::transport::wire::params::{self, Chunk, Fetch};
use crate::transport::wire::v2::{self, Beat, Closing, Offer};
use crate::transport::wire::ACK;

/// Ack bookkeeping of one connection, shared with its reader thread.
#[derive(Default)]
pub(super) struct Acks {
    /// Acknowledgements received on this connection.
    pub(super) acked: AtomicU64,
    /// Set (with `reason`) when the connection is gone.
    pub(super) lost: AtomicBool,
    /// Set with `lost` when reconnecting would not help (the server refused what we sent).
    pub(super) fatal: AtomicBool,
    /// The [`v2::Closing`] reason the server gave before it closed (0: none).
    pub(super) closing: AtomicU8,
    /// The latest [`v2::PERSISTED`] mark on this connection (0: none yet): every sample of
    /// the session before it is in a completed checkpoint.
    pub(super) persisted: AtomicU64,
    /// The latest version of the learner's parameters it announced ([`params::VERSION`];
    /// 0: none yet).
    pub(super) params_version: AtomicU64,
    /// The parameter fetch in flight and its answer.
    pub(super) fetch: Mutex<FetchSlot>,
    pub(super) reason: Mutex<String>,
    pub(super) changed: Signal,
}

/// The parameter fetches in flight ([`params::FETCH`]), answered in order: each with its id,
/// what it asked and the size of the client's parameters; then the answers not taken yet
/// (each fetch's id, the chunk and its bytes), in order. A fetch that timed out or was
/// given up is answered later all the same: its answer is taken off the wire, and dropped
/// when a later fetch's answer is awaited.
#[derive(Default)]
pub(super) struct FetchSlot {
    pub(super) asked: std::collections::VecDeque<(u64, Fetch, u64)>,
    pub(super) answers: std::collections::VecDeque<(u64, Chunk, Vec<u8>)>,
    pub(super) next_id: u64,
    /// Buffers of answers already taken, kept for the next chunks (a chunk is read straight
    /// into one): no allocation, page fault or zeroing per chunk once a fetch is under way.
    spare: Vec<Vec<u8>>,
}

/// The most answer buffers a [`FetchSlot`] keeps: one per request a fetch has in flight.
const SPARE_BUFFERS: usize = 4;

impl FetchSlot {
    /// A buffer of `len` bytes for a chunk's answer (a kept one when there is one).
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        let mut bytes = self.spare.pop().unwrap_or_default();
        // Kept buffers are mostly a whole chunk already: nothing to zero.
        bytes.resize(len, 0);
        bytes
    }

    /// Takes back an answer's buffer once its bytes were used.
    pub(super) fn recycle(&mut self, bytes: Vec<u8>) {
        if self.spare.len() < SPARE_BUFFERS && bytes.capacity() > 0 {
            self.spare.push(bytes);
        }
    }
}

/// A parameter chunk whose header was read and whose bytes are still arriving: the reader
/// reads them from the socket straight into its answer's buffer.
pub(super) struct Incoming {
    id: u64,
    chunk: Chunk,
    bytes: Vec<u8>,
    filled: usize,
}

impl Acks {
    pub(super) fn lose(&self, reason: String) {
        let mut slot = self.reason.lock();
        if slot.is_empty() {
            *slot = reason;
        }
        drop(slot);
        // ORDERING: Release pairs with `is_lost`'s Acquire: the reason is written first.
        self.lost.store(true, Release);
        self.changed.notify_all();
    }

    pub(super) fn is_lost(&self) -> bool {
        // ORDERING: Acquire pairs with the Release in `lose`.
        self.lost.load(Acquire)
    }

    pub(super) fn acked(&self) -> u64 {
        // ORDERING: Acquire pairs with the reader's Release `fetch_add` (only counts matter,
        // but Acquire keeps "acked" meaningful to callers reading other state after it).
        self.acked.load(Acquire)
    }

    pub(super) fn reason(&self) -> String {
        self.reason.lock().clone()
    }
}

/// What the writer and the heartbeat (on the reader thread) share.
pub(super) struct Writing {
    /// A frame is partly written: no heartbeat may go in between.
    pub(super) mid_frame: bool,
    pub(super) last_write: Instant,
}

/// One established connection.
pub(super) struct Link {
    pub(super) stream: TcpStream,
    /// 1 or 2.
    pub(super) version: u8,
    /// Sequence number of the first sample sent on this connection.
    pub(super) base: u64,
    pub(super) acks: Arc<Acks>,
    pub(super) writing: Arc<Mutex<Writing>>,
    pub(super) reader: Option<JoinHandle<()>>,
    /// The shared-memory channel samples go through, if one was attached.
    pub(super) shm: Option<ShmWriter>,
    /// The leaves this connection sends compressed (v2 over TCP, as the reply named them).
    pub(super) codecs: Option<Arc<LeafCodecs>>,
    /// The server serves parameter fetches on this connection (reply bit 6).
    pub(super) params: bool,
}

impl Link {
    pub(super) fn acked_total(&self) -> u64 {
        // On shared memory "acknowledged" is "taken by the server": it copied the sample
        // into its queue, as a TCP ack says.
        self.base + self.shm.as_ref().map_or_else(|| self.acks.acked(), ShmWriter::taken)
    }

    /// Closes the socket and joins the reader.
    pub(super) fn shut(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shut();
    }
}

/// What a finished handshake gives.
pub(super) struct Established {
    pub(super) stream: TcpStream,
    pub(super) version: u8,
    pub(super) spec: DataSpec,
    pub(super) accept: Option<v2::Accept>,
    /// Bytes received after the handshake (acks or heartbeats), for the reader.
    pub(super) leftover: Vec<u8>,
    /// v1 by [`Protocol::Auto`](super::Protocol::Auto)'s choice: a late offer is possible and
    /// skipped.
    pub(super) skip_offer: bool,
    /// The shared-memory channel attached during the handshake.
    pub(super) shm: Option<ShmWriter>,
}

/// The reader thread's state: counts acks, answers and watches heartbeats (v2).
pub(super) struct Reading {
    pub(super) stream: TcpStream,
    pub(super) acks: Arc<Acks>,
    pub(super) writing: Arc<Mutex<Writing>>,
    pub(super) beat: Option<Beat>,
    pub(super) version: u8,
    /// v1 chosen by `Auto`: an offer may still arrive before the first ack; skip it.
    pub(super) skip_offer: bool,
    /// Bytes received and not yet processed.
    pub(super) pending: Vec<u8>,
    /// A parameter chunk being read into its answer's buffer, bypassing `pending`.
    pub(super) incoming: Option<Incoming>,
    pub(super) last_heard: Instant,
    /// The server sends [`v2::PERSISTED`] notices (it accepted a durable hello).
    pub(super) durable: bool,
    /// The server sends parameter chunks and version notices (reply bit 6).
    pub(super) params: bool,
    /// On shared memory: the space bell, rung when the connection is lost so that a `send`
    /// or `wait` sleeping on it notices at once.
    pub(super) wake_on_loss: Option<LossBell>,
}

impl Reading {
    pub(super) fn run(&mut self) {
        if let Err(reason) = self.read_loop() {
            self.acks.lose(reason);
            if let Some(bell) = &self.wake_on_loss {
                crate::transport::shm::ring::Bell::ring(bell);
            }
        }
    }

    fn read_loop(&mut self) -> Result<(), String> {
        let every = self.beat.map(|b| b.every);
        self.stream.set_read_timeout(every).map_err(|e| e.to_string())?;
        // Parameter chunks come up to 1 MiB at a time: read them in large pieces.
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            self.process()?;
            // A chunk's bytes go from the socket straight into its answer's buffer (one copy
            // in user space, by the caller into its own); anything else through `pending`.
            let into = match &mut self.incoming {
                Some(incoming) => &mut incoming.bytes[incoming.filled..],
                None => &mut buf[..],
            };
            match self.stream.read(into) {
                Ok(0) => return Err("the server closed the connection".into()),
                Ok(n) => {
                    self.last_heard = Instant::now();
                    match &mut self.incoming {
                        Some(incoming) => {
                            incoming.filled += n;
                            if incoming.filled == incoming.bytes.len() {
                                if let Some(whole) = self.incoming.take() {
                                    self.answer(whole);
                                }
                            }
                        }
                        None => self.pending.extend_from_slice(&buf[..n]),
                    }
                    // The server's own heartbeats (or acks) may arrive more often than our
                    // read timeout: ours are due by our last write, not by a quiet socket.
                    self.heartbeat()?;
                }
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    self.heartbeat()?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("the connection failed: {e}")),
            }
        }
    }

    /// Sends a heartbeat if nothing was written for a while; fails if the server has been
    /// silent too long.
    pub(super) fn heartbeat(&mut self) -> Result<(), String> {
        let Some(beat) = self.beat else { return Ok(()) };
        if let Some(dead_after) = beat.dead_after {
            if self.last_heard.elapsed() >= dead_after {
                let _ = self.stream.shutdown(Shutdown::Both);
                return Err(format!("no heartbeat from the server for {dead_after:?}"));
            }
        }
        if let Some(mut writing) = self.writing.try_lock() {
            if !writing.mid_frame && writing.last_write.elapsed() >= beat.every {
                // A short write with the writer's lock held; a full socket buffer means data
                // is flowing anyway.
                if self.stream.write(&[v2::HEARTBEAT]).is_ok() {
                    writing.last_write = Instant::now();
                }
            }
        }
        Ok(())
    }

    /// A chunk read whole: its answer, for the fetch that awaits it.
    fn answer(&self, incoming: Incoming) {
        let Incoming { id, chunk, bytes, .. } = incoming;
        self.acks.fetch.lock().answers.push_back((id, chunk, bytes));
        self.acks.changed.notify_all();
    }

    /// Consumes the complete messages in `pending`.
    pub(super) fn process(&mut self) -> Result<(), String> {
        let mut used = 0;
        let mut acked = 0u64;
        let mut heard = false;
        let result = loop {
            let Some(&byte) = self.pending.get(used) else { break Ok(()) };
            match byte {
                ACK => {
                    acked += 1;
                    used += 1;
                    self.skip_offer = false;
                }
                v2::BEAT if self.version == 2 => used += 1,
                params::VERSION if self.params => {
                    let Some(version) = params::parse_version(&self.pending[used..]) else {
                        break Ok(());
                    };
                    used += params::VERSION_LEN;
                    // ORDERING: Release pairs with the Acquire in `TcpSender::params_version`;
                    // a monotonic number, announced by the notify below.
                    self.acks.params_version.fetch_max(version, Release);
                    heard = true;
                }
                params::CHUNK | params::PACKED if self.params => {
                    let mut slot = self.acks.fetch.lock();
                    let Some(&(id, asked, size)) = slot.asked.front() else {
                        break Err("protocol error: a parameter chunk nobody asked for".into());
                    };
                    let chunk = match Chunk::parse(&self.pending[used..], &asked, size) {
                        Ok(Some(chunk)) => chunk,
                        Ok(None) => break Ok(()),
                        Err(e) => break Err(format!("protocol error: {e}")),
                    };
                    slot.asked.pop_front();
                    let start = used + chunk.header_len();
                    let len = chunk.wire_len();
                    let have = (self.pending.len() - start).min(len);
                    let mut bytes = slot.buffer(len);
                    bytes[..have].copy_from_slice(&self.pending[start..start + have]);
                    used = start + have;
                    if have < len {
                        // The rest is read from the socket straight into `bytes`; nothing
                        // follows it in `pending`.
                        self.incoming = Some(Incoming { id, chunk, bytes, filled: have });
                        break Ok(());
                    }
                    slot.answers.push_back((id, chunk, bytes));
                    heard = true;
                }
                v2::PERSISTED if self.durable => {
                    let Some(mark) = v2::parse_persisted(&self.pending[used..]) else {
                        break Ok(());
                    };
                    used += v2::PERSISTED_LEN;
                    // ORDERING: Release pairs with the Acquire in `TcpSender::persisted`;
                    // a monotonic mark, announced by the notify below.
                    self.acks.persisted.fetch_max(mark, Release);
                    heard = true;
                }
                v2::CLOSING if self.version == 2 => {
                    let Some(&why) = self.pending.get(used + 1) else { break Ok(()) };
                    used += 2;
                    let Some(closing) = Closing::from_byte(why) else {
                        break Err(format!("protocol error: a closing notice with reason {why}"));
                    };
                    // ORDERING: Release, before `lose` sets `lost`: whoever sees the loss sees
                    // why (Acquire in `TcpSender::recover`).
                    self.acks.closing.store(why, Release);
                    // Every ack came before the notice, and nothing more will: hang up, so
                    // the server need not wait for us.
                    let _ = self.stream.shutdown(Shutdown::Both);
                    break Err(match closing {
                        Closing::Final => "the server closed for good (Server.close())".into(),
                        Closing::Restarting => {
                            "the server is restarting (Server.close(restarting=True))".into()
                        }
                    });
                }
                v2::ERROR if self.version == 2 => {
                    match v2::parse_error(&self.pending[used + 1..]) {
                        Ok(Some((message, len))) => {
                            // ORDERING: Release, before `lose` sets `lost`: whoever sees
                            // the loss sees that it is fatal (Acquire in `recover`).
                            self.acks.fatal.store(true, Release);
                            used += 1 + len;
                            break Err(format!("the server closed the connection: {message}"));
                        }
                        Ok(None) => break Ok(()),
                        Err(e) => break Err(format!("protocol error: {e}")),
                    }
                }
                b'E' if self.skip_offer => match Offer::parse(&self.pending[used..]) {
                    Ok(Some(_)) => {
                        log::warn!(
                            target: LOG_TARGET, "the server's offer of wire protocol 2 arrived after {OFFER_GRACE:?}; \
                             this connection speaks protocol 1"
                        );
                        used += v2::OFFER_LEN;
                        self.skip_offer = false;
                    }
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(format!("protocol error: {e}")),
                },
                bad => {
                    break Err(format!("protocol error: expected ack byte 0x01, got {bad:#04x}"));
                }
            }
        };
        self.pending.drain(..used);
        if acked > 0 {
            // ORDERING: Release pairs with the Acquire in `Acks::acked`.
            self.acks.acked.fetch_add(acked, Release);
        }
        if acked > 0 || heard {
            self.acks.changed.notify_all();
        }
        result
    }
}
