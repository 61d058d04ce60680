//! One connection's socket ([`Link`]): buffered reads into the staging buffer or straight
//! into a payload buffer, acks written in runs, heartbeats, waits for buffer or queue space,
//! pushes into the ingress, and the closing notice. Also the small types its waits return,
//! the error ([`invalid`]) it ends a connection with, and its timings ([`STAGING`],
//! [`NOTICE_GRACE`], [`NEVER`]).

use std::io;
#[cfg(target_os = "linux")]
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{watch, Notify};

use super::session::LOG_TARGET;
use super::session::{Activity, Session};
use crate::ingress::{BudgetHold, Connection, Packed, StepMark};
use crate::transport::direct;
use crate::transport::wire::params;
use crate::transport::wire::v2::{self, Beat, Refusal, Reply};
use crate::transport::wire::ACK;

/// Bytes read from a socket at a time for small samples.
pub(super) const STAGING: usize = 64 * 1024;
/// How long [`TcpServer::close`](super::TcpServer::close) waits for the connections to take
/// their closing notice (each flushes its acks, says why, and reads until its client hangs up).
pub(super) const NOTICE_GRACE: Duration = Duration::from_secs(1);
/// A sleep that stands for "no heartbeat timer" in a `select!` whose branch is disabled.
pub(crate) const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// A pooled buffer being filled; given back to its connection if the task stops first (an
/// aborted task must not keep its share of the byte budget).
pub(super) struct Pooled<'c> {
    pub(super) conn: &'c Connection,
    pub(super) buf: Option<Box<[u8]>>,
}

impl Pooled<'_> {
    pub(super) fn bytes(&mut self) -> &mut [u8] {
        self.buf.as_mut().expect("present until pushed")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.conn.return_buffer(buf);
        }
    }
}

/// One connection's socket: buffered reads, batched acks and heartbeats.
pub(crate) struct Link<'a> {
    pub(super) reader: OwnedReadHalf,
    pub(super) writer: OwnedWriteHalf,
    pub(super) staging: Vec<u8>,
    /// Unread bytes are `staging[lo..hi]`.
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) staging_len: usize,
    /// Samples queued and not yet acknowledged.
    pub(super) acks: usize,
    pub(crate) beat: Option<Beat>,
    pub(super) last_write: Instant,
    pub(super) last_heard: Instant,
    pub(crate) activity: &'a Activity,
    pub(super) epoch: Instant,
    /// The server's closing state (see [`TcpServer::close`](super::TcpServer::close)).
    pub(crate) closing: watch::Receiver<u8>,
    /// A durable session's: what tells its client how far it is persisted.
    pub(crate) notices: Option<Notices>,
    /// A connection that serves parameter fetches: what tells its client of new versions.
    pub(crate) versions: Option<Versions>,
}

/// A connection's [`params::VERSION`] notices: sent whenever a version newer than the one
/// the client was last told is published.
pub(crate) struct Versions {
    pub(super) latest: watch::Receiver<u64>,
    pub(super) told: u64,
}

/// Resolves when a version is published (never without version notices).
pub(crate) async fn published(versions: &mut Option<Versions>) {
    if let Some(v) = versions {
        if v.latest.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending::<()>().await;
}

/// A durable connection's [`v2::PERSISTED`] notices: sent whenever a checkpoint completes and
/// its session's persisted mark moved past what the client was told.
pub(crate) struct Notices {
    /// Changes when a checkpoint completes.
    pub(super) completed: watch::Receiver<u64>,
    pub(super) session: Arc<Session>,
    /// The mark the client was last told.
    pub(super) told: u64,
}

/// Resolves when a checkpoint completed (never without notices, or once the server is gone).
pub(crate) async fn completed(notices: &mut Option<Notices>) {
    if let Some(n) = notices {
        if n.completed.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending::<()>().await;
}

/// Resolves once the server is closing (never, if its state is dropped first).
pub(crate) async fn closed(closing: &mut watch::Receiver<u8>) {
    if closing.wait_for(|state| *state != 0).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The error a connection ends with when the server closes (see [`is_closing`]).
#[derive(Debug)]
pub(crate) struct ServerClosing;

impl std::fmt::Display for ServerClosing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the server is closing")
    }
}

impl std::error::Error for ServerClosing {}

pub(super) fn is_closing(err: &io::Error) -> bool {
    err.get_ref().is_some_and(|inner| inner.is::<ServerClosing>())
}

pub(super) fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// What a connection waiting for its client (or for space) woke up to.
pub(crate) enum Woke<T> {
    Done(T),
    Closing,
    Beat,
    /// A checkpoint completed (durable sessions).
    Persisted,
    /// A version of the parameters was published (connections that serve them).
    Published,
}

impl Link<'_> {
    /// Our address on this connection.
    #[cfg(target_os = "linux")]
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        self.writer.local_addr()
    }

    pub(super) fn local(&self) -> String {
        self.writer.local_addr().map_or_else(|_| "?".into(), |a| a.to_string())
    }

    /// Bytes read during negotiation that belong to the stream.
    pub(super) fn stage(&mut self, bytes: Vec<u8>) {
        (self.lo, self.hi) = (0, bytes.len());
        if !bytes.is_empty() {
            self.staging = bytes;
            let len = self.staging_len.max(self.staging.len());
            self.staging.resize(len, 0);
        }
    }

    pub(super) async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.writer.write_all(bytes).await?;
        self.last_write = Instant::now();
        Ok(())
    }

    /// Writes the pending acks, as runs of ack bytes.
    async fn flush(&mut self) -> io::Result<()> {
        const ACKS: [u8; 4096] = [ACK; 4096];
        while self.acks > 0 {
            let n = self.acks.min(ACKS.len());
            self.writer.write_all(&ACKS[..n]).await?;
            self.acks -= n;
            self.last_write = Instant::now();
        }
        Ok(())
    }

    /// Tells a durable client how far its session is persisted, if that moved since it was
    /// last told: after the acks of those samples.
    pub(crate) async fn tell_persisted(&mut self) -> io::Result<()> {
        let Some(notices) = &self.notices else { return Ok(()) };
        // ORDERING: Relaxed — the watch we woke on orders the session's store before it.
        let mark = notices.session.persisted.load(Relaxed);
        if mark <= notices.told {
            return Ok(());
        }
        self.flush().await?;
        self.write(&v2::encode_persisted(mark)).await?;
        if let Some(notices) = &mut self.notices {
            notices.told = mark;
        }
        Ok(())
    }

    /// [`Link::tell_persisted`] if a checkpoint completed since the last look, without
    /// waiting for one: for a loop too busy to wait on [`completed`] (shared memory's).
    #[cfg(target_os = "linux")]
    pub(crate) async fn tell_if_persisted(&mut self) -> io::Result<()> {
        let Some(notices) = &mut self.notices else { return Ok(()) };
        if !notices.completed.has_changed().unwrap_or(false) {
            return Ok(());
        }
        notices.completed.borrow_and_update();
        self.tell_persisted().await
    }

    /// Tells a client that fetches parameters of the latest version, if it is newer than
    /// what it was last told.
    pub(crate) async fn tell_version(&mut self) -> io::Result<()> {
        let Some(versions) = &self.versions else { return Ok(()) };
        let latest = *versions.latest.borrow();
        if latest <= versions.told {
            return Ok(());
        }
        self.write(&params::encode_version(latest)).await?;
        if let Some(versions) = &mut self.versions {
            versions.told = latest;
        }
        Ok(())
    }

    /// Refuses the hello with `why` (best effort: the peer may be gone).
    pub(super) async fn refuse(&mut self, why: Refusal, message: &str) {
        let _ = self.write(&Reply::Refused(why, message.into()).encode()).await;
        let _ = self.writer.shutdown().await;
    }

    /// Tells a v2 peer why we close (after its acks), and returns the error to end with.
    pub(crate) async fn fail(&mut self, message: &str) -> io::Error {
        if self.flush().await.is_ok() {
            let _ = self.write(&v2::encode_error(message)).await;
            let _ = self.writer.shutdown().await;
        }
        invalid(message.into())
    }

    /// Between awaits for the peer or for space: a heartbeat if we have been quiet, an error
    /// if the peer has been silent too long (`reading`: only while we wait for it).
    pub(crate) async fn tick(&mut self, reading: bool) -> io::Result<()> {
        let Some(beat) = self.beat else { return Ok(()) };
        if let Some(dead_after) = beat.dead_after {
            if reading && self.last_heard.elapsed() >= dead_after {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no heartbeat from the client for {dead_after:?}"),
                ));
            }
        }
        if self.last_write.elapsed() >= beat.every {
            self.flush().await?;
            self.write(&[v2::BEAT]).await?;
        }
        Ok(())
    }

    /// One socket read into `target`, or into the staging buffer when `target` is `None`;
    /// acks are flushed first (we are about to block). 0 at end of stream.
    pub(super) async fn read(&mut self, mut target: Option<&mut [u8]>) -> io::Result<usize> {
        self.flush().await?;
        loop {
            let into: &mut [u8] = match target.as_deref_mut() {
                Some(t) => t,
                None => {
                    if self.staging.is_empty() {
                        self.staging = vec![0u8; self.staging_len];
                    }
                    &mut self.staging
                }
            };
            let every = self.beat.map(|beat| beat.every);
            let woke = tokio::select! {
                n = self.reader.read(into) => Woke::Done(n),
                () = closed(&mut self.closing) => Woke::Closing,
                () = tokio::time::sleep(every.unwrap_or(NEVER)), if every.is_some() => {
                    Woke::Beat
                }
                () = completed(&mut self.notices) => Woke::Persisted,
                () = published(&mut self.versions) => Woke::Published,
            };
            let n = match woke {
                Woke::Done(n) => n?,
                Woke::Closing => return Err(io::Error::other(ServerClosing)),
                Woke::Beat => {
                    self.tick(true).await?;
                    continue;
                }
                Woke::Persisted => {
                    self.tell_persisted().await?;
                    continue;
                }
                Woke::Published => {
                    self.tell_version().await?;
                    continue;
                }
            };
            self.activity.read(self.epoch);
            self.last_heard = Instant::now();
            if target.is_none() {
                (self.lo, self.hi) = (0, n);
            }
            return Ok(n);
        }
    }

    /// The next byte of the stream; `None` at a clean end of stream.
    pub(crate) async fn next_byte(&mut self) -> io::Result<Option<u8>> {
        if self.lo == self.hi && self.read(None).await? == 0 {
            return Ok(None);
        }
        self.lo += 1;
        Ok(Some(self.staging[self.lo - 1]))
    }

    /// Fills `buf` (`len` bytes) from the stream: `false` if the stream ended before its
    /// first byte; an `UnexpectedEof` error if it ended after (a partial sample is never
    /// queued). Reads of at least half the staging size go straight into `buf`.
    pub(super) async fn fill(&mut self, buf: &mut [u8], len: usize) -> io::Result<bool> {
        let mut filled = 0;
        while filled < len {
            if self.lo < self.hi {
                let n = (self.hi - self.lo).min(len - filled);
                buf[filled..filled + n].copy_from_slice(&self.staging[self.lo..self.lo + n]);
                (self.lo, filled) = (self.lo + n, filled + n);
                continue;
            }
            let direct = len - filled >= self.staging_len / 2;
            let n = if direct {
                self.read(Some(&mut buf[filled..len])).await?
            } else {
                self.read(None).await?
            };
            if n == 0 {
                return if filled == 0 {
                    Ok(false)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("peer closed mid-sample ({filled} of {len} bytes)"),
                    ))
                };
            }
            if direct {
                filled += n;
            }
        }
        Ok(true)
    }

    /// Reads the next sample from the socket straight into a free slot of the FIFO ring
    /// ([`direct::insert_in_place`]), skipping the pooled buffer and the drainer's
    /// copy. Only for samples large enough to be read with their own system call anyway (at
    /// least half the staging buffer), and only when the kernel already holds all of the
    /// sample's bytes (FIONREAD, plus what is staged), so the read cannot wait: a slow peer
    /// never holds a ring slot. `false` (nothing read) when that does not hold, when the ring
    /// has no free slot or something of this connection is still queued: read it into a
    /// pooled buffer then.
    ///
    /// # Errors
    /// Only if the kernel returns fewer bytes than FIONREAD promised (it must not): the slot
    /// is committed anyway (it cannot be taken back), its missing bytes zero, the error
    /// logged, and the connection ends.
    pub(super) async fn read_in_place(&mut self, conn: &Connection) -> io::Result<bool> {
        let len = conn.payload_size();
        if len < self.staging_len / 2 {
            return Ok(false);
        }
        let staged = self.hi - self.lo;
        let Some(mut in_kernel) = self.readable_bytes() else { return Ok(false) };
        if staged == 0 && in_kernel == 0 {
            // Idle: wait for the peer here rather than in a read into a pooled buffer, so a
            // sample that arrives whole (one segment, or a burst) still goes in place.
            self.wait_readable().await?;
            in_kernel = self.readable_bytes().unwrap_or(0);
        }
        if staged.saturating_add(in_kernel) < len {
            return Ok(false);
        }
        let from_staging = staged.min(len);
        let staging = &self.staging[self.lo..self.lo + from_staging];
        let reader = &self.reader;
        let Some(read) = direct::insert_in_place(conn, reader, staging) else {
            return Ok(false);
        };
        self.lo += from_staging;
        if from_staging < len {
            self.activity.read(self.epoch);
            self.last_heard = Instant::now();
        }
        if let Err(err) = &read {
            log::error!(target: LOG_TARGET, "echo: a sample read in place came up short and was zeroed: {err}");
        }
        read.map(|()| true)
    }

    /// Waits until the socket has something to read (or its end), flushing acks first and
    /// sending heartbeats meanwhile, like [`Link::read`].
    async fn wait_readable(&mut self) -> io::Result<()> {
        self.flush().await?;
        loop {
            let readable = self.reader.as_ref().readable();
            match self.beat {
                None => return readable.await,
                Some(beat) => match tokio::time::timeout(beat.every, readable).await {
                    Ok(ready) => return ready,
                    Err(_) => self.tick(true).await?,
                },
            }
        }
    }

    /// Bytes waiting in the socket's receive buffer (FIONREAD); `None` if it cannot say.
    #[cfg(unix)]
    pub(super) fn readable_bytes(&self) -> Option<usize> {
        use std::os::fd::AsRawFd;
        let fd = self.reader.as_ref().as_raw_fd();
        let mut bytes: libc::c_int = 0;
        // SAFETY: FIONREAD on a socket descriptor we own writes one `c_int` to `bytes`.
        let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut bytes) };
        (rc == 0).then(|| usize::try_from(bytes).unwrap_or(0))
    }

    #[cfg(not(unix))]
    pub(super) fn readable_bytes(&self) -> Option<usize> {
        None
    }

    /// Waits for space (a buffer or a queue slot), sending heartbeats meanwhile.
    async fn wait_space(&mut self, conn: &Connection, space: &Notify) -> io::Result<()> {
        self.flush().await?;
        conn.note_blocked();
        let waited = Instant::now();
        let every = self.beat.map(|beat| beat.every);
        let woke = tokio::select! {
            () = space.notified() => Woke::Done(()),
            () = closed(&mut self.closing) => Woke::Closing,
            () = tokio::time::sleep(every.unwrap_or(NEVER)), if every.is_some() => {
                Woke::Beat
            }
            () = completed(&mut self.notices) => Woke::Persisted,
            () = published(&mut self.versions) => Woke::Published,
        };
        conn.note_blocked_for(waited.elapsed());
        match woke {
            Woke::Done(()) => Ok(()),
            Woke::Closing => Err(io::Error::other(ServerClosing)),
            Woke::Beat => self.tick(false).await,
            Woke::Persisted => self.tell_persisted().await,
            Woke::Published => self.tell_version().await,
        }
    }

    /// Ends the connection because the server closes: flushes the acks, tells a client that
    /// understands it why ([`v2::CLOSING`]), half-closes, and reads (discarding) until the
    /// client hangs up or [`NOTICE_GRACE`] passes, so that unread bytes do not make the
    /// kernel reset the connection over acks still on their way.
    pub(super) async fn closing_notice(&mut self, notices: bool) {
        let why = *self.closing.borrow();
        if self.flush().await.is_err() {
            return;
        }
        if notices && self.write(&[v2::CLOSING, why]).await.is_err() {
            return;
        }
        let _ = self.writer.shutdown().await;
        let mut sink = [0u8; 4096];
        let _ = tokio::time::timeout(NOTICE_GRACE, async {
            while matches!(self.reader.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }

    /// A buffer to fill, waiting for one if the pool is empty.
    pub(super) async fn buffer<'c>(
        &mut self,
        conn: &'c Arc<Connection>,
        space: &Notify,
    ) -> io::Result<Pooled<'c>> {
        loop {
            if let Some(buf) = conn.take_buffer() {
                return Ok(Pooled { conn, buf: Some(buf) });
            }
            self.wait_space(conn, space).await?;
        }
    }

    /// Adds `more` bytes of the byte budget to `hold`, waiting (as for a buffer) while the
    /// budget is spent.
    pub(super) async fn grow_hold(
        &mut self,
        conn: &Arc<Connection>,
        space: &Notify,
        hold: &mut BudgetHold,
        more: usize,
    ) -> io::Result<()> {
        while !conn.grow_hold(hold, more) {
            self.wait_space(conn, space).await?;
        }
        Ok(())
    }

    /// Holds what row `row`'s stream costs a sequence table in the byte budget before a step
    /// of it goes in ([`Connection::hold_stream`]), waiting (as for a buffer) while the budget
    /// is spent. A no-op for rows already held and for backends without streams.
    pub(crate) async fn hold_stream(
        &mut self,
        conn: &Arc<Connection>,
        space: &Notify,
        row: u32,
    ) -> io::Result<()> {
        while !conn.hold_stream(row) {
            self.wait_space(conn, space).await?;
        }
        Ok(())
    }

    /// Queues a filled buffer (with `packed`, the sample's compressed leaves as they arrived,
    /// for a table that stores them so), waiting while the queue is full.
    pub(super) async fn push(
        &mut self,
        conn: &Connection,
        space: &Notify,
        mut pooled: Pooled<'_>,
        mut packed: Option<Packed>,
        priority: Option<f64>,
        mark: StepMark,
    ) -> io::Result<()> {
        let mut buf = pooled.buf.take().expect("present until pushed");
        loop {
            match conn.try_push_packed(buf, packed.take(), priority, mark) {
                Ok(()) => return Ok(()),
                Err((back, kept)) => {
                    packed = kept;
                    // Back in the guard while we wait: an abort gives it back to the pool.
                    pooled.buf = Some(back);
                    self.wait_space(conn, space).await?;
                    buf = pooled.buf.take().expect("put back above");
                }
            }
        }
    }
}
