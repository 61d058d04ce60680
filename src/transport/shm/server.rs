//! The learner's side of a v2 connection's shared-memory path: offered in the reply,
//! attached over a Unix socket, then inserted straight from the segment into the backend
//! (waiting in the segment while the backend is full). The TCP connection stays open for
//! heartbeats, the goodbye and errors; [`crate::transport::tcp`] calls [`prepare`] while it
//! builds its reply and [`serve`] once it is sent.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};

use super::{Reader, Samples, ShmEnd as End, SHM_OFF};
use crate::error::EchoError;
use crate::ingress::{Connection, Ingress, SegmentReservation, TransportEvent};
use crate::params::Params;
use crate::sync::AsyncBell;
use crate::transport::direct;
use crate::transport::shm;
use crate::transport::tcp::checks::check_meta;
use crate::transport::tcp::frames::serve_fetch;
use crate::transport::tcp::link::{closed, completed, published, Link, ServerClosing, Woke, NEVER};
use crate::transport::tcp::session::LOG_TARGET;
use crate::transport::tcp::session::{Session, Shared};
use crate::transport::wire::params;
use crate::transport::wire::v2::{self, ShmOffer};

/// How long a channel refused by the backend waits for its bell before it tries again
/// anyway (see `wait_for_room`).
const ROOM_RETRY: Duration = Duration::from_millis(20);
/// How long a client has to attach the channel it was offered.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an attaching peer has to present its nonce.
const NONCE_TIMEOUT: Duration = Duration::from_secs(2);
/// Peers of the learner's uid refused (wrong nonce, none in time) before the offer is
/// withdrawn. Another user's attaches are refused without counting: the client is never one
/// of them (`hand_over` takes only the learner's uid), so counting them would let any local
/// user withdraw the offer and fail the client's connection. `ATTACH_TIMEOUT` bounds those.
const MAX_ATTEMPTS: usize = 8;

/// A channel offered and not attached yet. The segment itself is created only for a
/// peer that proved itself (`hand_over`): any local process can ask for an offer over
/// TCP, and ~8 MiB of reserved pages per ask would be a cheap way to exhaust memory.
pub(crate) struct Prepared {
    pub(crate) offer: ShmOffer,
    payload_size: usize,
    /// Bytes of the segment it will get ([`shm::segment_len`]).
    segment_len: usize,
    listener: UnixListener,
}

/// A channel for `peer`, or why it cannot have one.
pub(crate) fn prepare(
    shared: &Shared,
    peer: SocketAddr,
    link: &Link<'_>,
) -> Result<Prepared, String> {
    if !shared.shared_memory {
        return Err(SHM_OFF.into());
    }
    let local = link.local_addr().map_err(|e| format!("no local address: {e}"))?;
    if !shm::same_host(peer.ip(), local.ip()) {
        return Err(format!(
            "the client ({}) is not on the learner's host ({})",
            peer.ip(),
            local.ip()
        ));
    }
    let payload_size = shared.ingress.backend().spec().payload_size();
    let segment_len = shm::segment_len(payload_size).ok_or("samples too large for a segment")?;
    if let Some(why) = shared.ingress.segment_shortfall(segment_len) {
        return Err(why);
    }
    let name = shm::random_name().map_err(|e| e.to_string())?;
    let listener = shm::listen(&name)
        .and_then(UnixListener::from_std)
        .map_err(|e| format!("cannot listen on a Unix socket: {e}"))?;
    let nonce = v2::random().map_err(|e| e.to_string())?;
    Ok(Prepared { offer: ShmOffer { name, nonce }, payload_size, segment_len, listener })
}

/// Waits for the client to attach (or decline), then serves the channel until the client
/// leaves.
pub(crate) async fn serve(
    link: &mut Link<'_>,
    shared: &Shared,
    session: &Session,
    prepared: Prepared,
    parameters: Option<&Params>,
) -> io::Result<End> {
    let Prepared { offer, payload_size, segment_len, listener } = prepared;
    let deadline = tokio::time::Instant::now() + ATTACH_TIMEOUT;
    let mut attempts = 0;
    let (mut reader, _reservation) = loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted?;
                let stranger = shm::peer_uid(stream.as_fd()).is_ok_and(|uid| uid != shm::own_uid());
                let segment = (&*shared.ingress, segment_len);
                // The published parameters' region too, to a worker that fetches them.
                let region = parameters.and_then(Params::region).map(|r| r.fd().as_raw_fd());
                match hand_over(&stream, &offer, payload_size, segment, region).await {
                    Ok(attached) => break attached,
                    Err(why) if stranger => {
                        // At DEBUG: a flood of them must not take the learner's GIL once per record.
                        log::debug!(target: LOG_TARGET, "refused another user's shared-memory attach: {why}");
                    }
                    Err(why) => {
                        log::warn!(target: LOG_TARGET, "refused a shared-memory attach: {why}");
                        attempts += 1;
                        if attempts >= MAX_ATTEMPTS {
                            return Err(link.fail("too many refused shared-memory attaches").await);
                        }
                    }
                }
            }
            byte = link.next_byte() => match byte? {
                None => return Ok(End::Closed),
                Some(v2::HEARTBEAT) => {}
                Some(v2::BYE) => return Ok(End::Goodbye),
                Some(v2::SHM_DECLINE) => return Ok(End::Declined),
                Some(other) => {
                    return Err(link
                        .fail(&format!("frame type {other:#04x} before the shared memory was attached"))
                        .await)
                }
            },
            () = tokio::time::sleep_until(deadline) => {
                return Err(link
                    .fail(&format!("the shared memory was not attached within {ATTACH_TIMEOUT:?}"))
                    .await)
            }
        }
    };
    drop(listener);
    shared.ingress.note(TransportEvent::Shm);
    drain(link, shared, session, &mut reader, parameters).await
}

/// Checks an attaching peer (same uid as ours, the right nonce), then reserves the
/// segment's bytes in the ingress's budget, creates the segment and the bells, and sends
/// them to it. The reservation lives as long as the segment.
async fn hand_over(
    stream: &UnixStream,
    offer: &ShmOffer,
    payload_size: usize,
    (ingress, segment_len): (&Ingress, usize),
    params_region: Option<std::os::fd::RawFd>,
) -> Result<(Reader, SegmentReservation), String> {
    let uid = shm::peer_uid(stream.as_fd()).map_err(|e| format!("no peer credentials: {e}"))?;
    if uid != shm::own_uid() {
        return Err(format!("the peer runs as uid {uid}, the learner as {}", shm::own_uid()));
    }
    let mut nonce = [0u8; v2::SHM_NONCE_LEN];
    let read = async {
        let mut at = 0;
        while at < nonce.len() {
            stream.readable().await?;
            match stream.try_read(&mut nonce[at..]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    match tokio::time::timeout(NONCE_TIMEOUT, read).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("no nonce: {e}")),
        Err(_) => return Err(format!("no nonce within {NONCE_TIMEOUT:?}")),
    }
    // Constant time: every byte is compared.
    if nonce.iter().zip(&offer.nonce).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 {
        return Err("wrong nonce".into());
    }
    let reservation = ingress.reserve_segment(segment_len)?;
    let reader =
        Reader::new(payload_size).map_err(|e| format!("cannot create the segment: {e}"))?;
    let mut fds = reader.fds().to_vec();
    fds.extend(params_region);
    loop {
        stream.writable().await.map_err(|e| e.to_string())?;
        match stream.try_io(Interest::WRITABLE, || {
            shm::send_fds(stream.as_raw_fd(), shm::ATTACH_MESSAGE, &fds)
        }) {
            Ok(()) => return Ok((reader, reservation)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("cannot send the segment: {e}")),
        }
    }
}

/// Takes every committed sample, in order, and sleeps on the data bell (or the TCP
/// connection) when there are none. Ends when the client leaves, once every committed
/// sample is taken.
///
/// A sample is taken (the worker's acknowledgement) when it is inserted into the backend,
/// straight from the segment: one copy, always. While the backend has no room (or a
/// restore or checkpoint holds inserts) the samples wait in the segment and this task on
/// the backend's insert bell, never a thread; the worker's own ring then fills and its
/// `send` waits, as a TCP worker's does when its window is full. The session's ingress
/// queue is not used, so nothing of this connection is ever queued behind the backend.
async fn drain(
    link: &mut Link<'_>,
    shared: &Shared,
    session: &Session,
    reader: &mut Reader,
    parameters: Option<&Params>,
) -> io::Result<End> {
    let ingress = &shared.ingress;
    let backend = ingress.backend();
    let conn = &session.conn;
    let mut leaves = Vec::new();
    let mut offset = 0;
    for array in backend.spec().arrays() {
        leaves.push((offset, array.num_bytes()));
        offset += array.num_bytes();
    }
    // SAFETY: the `EventFd` owns its descriptor (an `OwnedFd`, a fresh duplicate) and
    // neither closes nor replaces it while the `AsyncFd` owns it; `as_raw_fd` always
    // returns that one descriptor.
    let data =
        unsafe { AsyncFd::register_with_interest(reader.data.try_clone()?, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
    let mut metas = Vec::with_capacity(reader.slots());
    let mut ending = None;
    // The segment is this connection's queue: what it holds counts as queued and pending
    // (as of each look), and nothing once the channel ends, however it ends.
    let _look = SegmentLook(conn);
    loop {
        // A worker that keeps the segment busy never makes this task wait for it: the
        // server's closing is looked at here too.
        if *link.closing.borrow() != 0 {
            return Err(io::Error::other(ServerClosing));
        }
        let available = match reader.available() {
            Ok(n) => n,
            Err(corrupt) => return Err(link.fail(&corrupt.to_string()).await),
        };
        conn.note_segment_depth(available);
        if available > 0 {
            // Every header first (copied out, then checked): a bad one ends the channel
            // before any sample of this run goes in.
            metas.clear();
            for seq in reader.head()..reader.head() + available {
                match reader.check(seq) {
                    Ok(meta) => metas.push(meta),
                    Err(why) => return Err(link.fail(&format!("shared-memory slot: {why}")).await),
                }
            }
            for meta in &metas {
                if let Err(why) = check_meta(backend, meta) {
                    return Err(link.fail(&why).await);
                }
                conn.note_row(meta.row);
                link.hold_stream(conn, &session.space, meta.row).await?;
            }
            let bell = backend.insert_bell();
            let mut done = 0;
            while done < metas.len() {
                // Straight from the segment into the backend, without waiting. When it
                // has no room the rest stay in the segment, untaken: the worker's ring
                // fills and its `send` waits, which is the backpressure, and every
                // sample is still copied once. The bell is read before the insert, so
                // room freed in between is not missed.
                let rung = bell.rung();
                let samples = Samples::new(reader, reader.head(), &metas[done..], &leaves)
                    .with_streams(conn.stream(0));
                // Counted as the backend takes them in, before the commit that can wake
                // the consumer (as a drainer counts), never after the insert returns.
                let (inserted, error) = direct::insert_from_segment(backend, conn, samples);
                done += inserted;
                if inserted > 0 {
                    // Working before the worker sees its samples taken (acknowledged):
                    // an acknowledged connection is never evicted as idle.
                    link.activity.complete();
                }
                reader.advance_by(inserted as u64);
                // ORDERING: Relaxed — as in `serve_frames`: written only under `owner`.
                session.next_seq.fetch_add(inserted as u64, Relaxed);
                match error {
                    None => {}
                    Some(EchoError::TimedOut) => {
                        // What a drainer's insert would have spent waiting inside the
                        // backend, this task spends here: counted the same way (a replay
                        // table's `insert_blocked_ns`). A timeout that was only the
                        // table's lock being busy counts too; the wait is short then.
                        // The segment's depth as the wait starts and ends (what the
                        // worker committed meanwhile is queued too), as a drainer's round
                        // records its queues' depths.
                        look(reader, conn);
                        let waited = Instant::now();
                        let woke = wait_for_room(link, conn, bell, rung).await;
                        // The backend's wait (ring or rate limiter), and backpressure on
                        // the worker: its segment was not taken from meanwhile.
                        backend.note_insert_blocked(waited.elapsed());
                        conn.note_blocked_for(waited.elapsed());
                        woke?;
                        look(reader, conn);
                    }
                    Some(EchoError::Closed) => return Ok(End::Closed),
                    Some(other) => return Err(link.fail(&other.to_string()).await),
                }
                // Busy taking samples we write nothing else: heartbeats keep the client's
                // watch quiet, and a durable client hears of a completed checkpoint.
                keep_beating(link).await;
                link.tell_if_persisted().await?;
                link.tell_version().await?;
            }
            continue;
        }
        if let Some(end) = ending {
            return Ok(end);
        }
        reader.sleep_begin();
        if reader.available().map_or(true, |n| n > 0) {
            reader.sleep_end();
            continue;
        }
        // Taken out while the link waits for its client (the select borrows both).
        let (mut notices, mut versions) = (link.notices.take(), link.versions.take());
        let woke = tokio::select! {
            byte = link.next_byte() => Some(byte),
            ready = data.readable() => {
                let mut guard = ready?;
                reader.data.drain();
                guard.clear_ready();
                None
            }
            () = completed(&mut notices) => None,
            () = published(&mut versions) => None,
        };
        (link.notices, link.versions) = (notices, versions);
        link.tell_persisted().await?;
        link.tell_version().await?;
        let byte = woke.transpose()?;
        reader.sleep_end();
        match byte {
            None | Some(Some(v2::HEARTBEAT)) => {}
            // Whatever the client committed before it left goes in first.
            Some(None) => ending = Some(End::Closed),
            Some(Some(v2::BYE)) => ending = Some(End::Goodbye),
            // The samples go through the segment; parameter fetches over the connection.
            Some(Some(params::FETCH)) if parameters.is_some() => {
                serve_fetch(link, parameters.expect("matched")).await?;
            }
            Some(Some(v2::SHM_DECLINE)) if reader.head() == 0 => {
                if reader.available().map_or(true, |n| n > 0) {
                    return Err(link
                        .fail("declined shared memory after committing samples to it")
                        .await);
                }
                return Ok(End::Declined);
            }
            Some(Some(other)) => {
                return Err(link
                    .fail(&format!("frame type {other:#04x} on a shared-memory connection"))
                    .await)
            }
        }
    }
}

/// Records how many samples `reader`'s segment holds committed and not yet taken (a
/// corrupt tail is left to the next look, which ends the channel).
fn look(reader: &Reader, conn: &Connection) {
    if let Ok(committed) = reader.available() {
        conn.note_segment_depth(committed);
    }
}

/// Zeroes its connection's segment depth when the channel's task ends (returns, fails or
/// is cancelled): samples left in the segment never go in.
struct SegmentLook<'a>(&'a Connection);

impl Drop for SegmentLook<'_> {
    fn drop(&mut self) {
        self.0.note_segment_depth(0);
    }
}

/// Waits until the backend rings after `rung` (room, a thaw, the end of a restore, or
/// its close), or [`ROOM_RETRY`] has passed, sending heartbeats meanwhile; the server's
/// closing ends the wait (the error `is_closing` knows).
///
/// The retry: an insert that does not wait also times out when the table's lock is
/// merely busy, and then nothing may ring (the consumer that held it may be waiting for
/// inserts itself). Trying again after a short while turns that into a delay, never a
/// stall; a real refusal is seen under the lock and rung for as before.
async fn wait_for_room(
    link: &mut Link<'_>,
    conn: &Connection,
    bell: &AsyncBell,
    rung: u64,
) -> io::Result<()> {
    conn.note_blocked();
    let retry = tokio::time::sleep(ROOM_RETRY);
    tokio::pin!(retry);
    loop {
        let every = link.beat.map(|beat| beat.every);
        let woke = tokio::select! {
            () = bell.rung_since(rung) => Woke::Done(()),
            () = &mut retry => Woke::Done(()),
            () = closed(&mut link.closing) => Woke::Closing,
            () = tokio::time::sleep(every.unwrap_or(NEVER)), if every.is_some() => Woke::Beat,
            () = completed(&mut link.notices) => Woke::Persisted,
            () = published(&mut link.versions) => Woke::Published,
        };
        match woke {
            Woke::Done(()) => return Ok(()),
            Woke::Closing => return Err(io::Error::other(ServerClosing)),
            Woke::Beat => keep_beating(link).await,
            Woke::Persisted => link.tell_persisted().await?,
            Woke::Published => link.tell_version().await?,
        }
    }
}

/// A heartbeat if one is due. The samples a worker committed are taken even after its
/// socket is gone (a worker killed while the ring was full, say), as TCP bytes already
/// in the kernel are read after their sender died: a heartbeat that cannot be written
/// stops the heartbeats, not the channel. The end of the stream ends it, once every
/// committed sample is in.
async fn keep_beating(link: &mut Link<'_>) {
    if let Err(err) = link.tick(false).await {
        log::debug!(target: LOG_TARGET, "the shared-memory worker's connection is gone ({err}); taking the rest");
        link.beat = None;
    }
}
