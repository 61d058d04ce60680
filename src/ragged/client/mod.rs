//! A worker's connection to a ragged server: wire v2's handshake, then one group frame per
//! `send_group` ([`super::wire`]), over TCP or, on the learner's host, through a
//! shared-memory pipe the server offers (the same bytes; see
//! [`crate::transport::shm::pipe`]). Samples are checked against the spec before they are
//! sent (lengths, length groups, the server's largest group), so a bad sample raises at
//! the caller and nothing of it goes out. A reader thread per connection counts the
//! acknowledgements (a pipe's are a count in its segment) and keeps the server's error or
//! closing notice for the next call.
//!
//! With `reconnect`, the sender keeps a copy of every frame until its samples are
//! acknowledged. When the connection drops (or the server says it is restarting) it
//! connects again within `reconnect` with the same session id, saying how many samples it
//! has seen acknowledged; the server answers how many of the session's samples it has
//! stored, and the sender resends the frames after that: every sample is stored once.
//!
//! Over TCP, the leaves the server's reply names codecs for (its `compress=`) are compressed
//! by the sending thread (a compressed group frame). A frame kept to resend goes to a later
//! connection as it is when that connection agreed on the same codecs, else as the plain
//! frame of the same samples.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::spec::RaggedSpec;
use super::wire::{encode_head, encode_packed, to_plain, Outgoing};
use crate::codec::Codec;
use crate::error::EchoError;
use crate::transport::client::Resolver;
use crate::transport::wire::v2::{self, Closing, Layout};

/// The first pause between two reconnection attempts (doubling up to [`LONGEST_PAUSE`]).
const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between two reconnection attempts.
const LONGEST_PAUSE: Duration = Duration::from_secs(1);
/// How often a send waiting for newer weights looks at the worker's `policy_version`.
const ADMISSION_SLICE: Duration = Duration::from_millis(20);

/// The codecs a connection agreed on, one per leaf of the frames' spec (empty: none).
type Codecs = Arc<[Option<Codec>]>;

/// A frame kept to resend: the session's sample count after it, its bytes, and the codecs
/// it was compressed with (`None`: a plain frame).
struct Retained {
    end: u64,
    frame: Vec<u8>,
    packed: Option<Codecs>,
}

/// What the reader thread of one connection learned.
#[derive(Debug, Default)]
struct State {
    /// Acknowledgements received over TCP on this connection.
    acked: u64,
    /// Samples of the session in a checkpoint the server completed, as its latest
    /// persisted notice said (durable connections).
    persisted: u64,
    /// Parameter fetches asked on this connection and the answers read, in order.
    fetch: FetchSlot,
    error: Option<String>,
    closing: Option<Closing>,
    ended: bool,
    /// The server sent nothing for this long, its heartbeat timeout: the connection is
    /// taken as lost.
    silent: Option<Duration>,
}

/// A connection's parameter fetches: each asked (its id, the fetch, the size its answer must
/// have) until its answer (the chunk's header and bytes) is read, in order.
#[derive(Debug, Default)]
struct FetchSlot {
    next_id: u64,
    asked: VecDeque<(u64, crate::transport::wire::params::Fetch, u64)>,
    answers: VecDeque<(u64, crate::transport::wire::params::Chunk, Vec<u8>)>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    /// Waits for a change, or fails once `deadline` has passed.
    fn wait(
        &self,
        state: &mut parking_lot::MutexGuard<'_, State>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        match deadline {
            Some(d) if Instant::now() >= d => return Err(EchoError::TimedOut),
            Some(d) => {
                let _ = self.changed.wait_until(state, d);
            }
            None => self.changed.wait(state),
        }
        Ok(())
    }
}

/// Why a connection can no longer be used, if it cannot.
fn failure(state: &State) -> Option<EchoError> {
    if let Some(why) = &state.error {
        return Some(EchoError::Protocol(format!("the server refused a sample: {why}")));
    }
    match state.closing {
        Some(Closing::Final) => Some(EchoError::ServerClosed("the server closed".into())),
        Some(Closing::Restarting) => {
            Some(EchoError::Disconnected("the server is restarting".into()))
        }
        None if state.ended => Some(EchoError::Disconnected(match state.silent {
            Some(t) => format!(
                "the server sent nothing for {:.1} s (heartbeat_timeout): the connection is \
                 taken as lost",
                t.as_secs_f64()
            ),
            None => "the server closed the connection".into(),
        })),
        None => None,
    }
}

/// Whether a reconnection may cure `err`: the connection was lost or refused, not the
/// samples, the token or the layout.
fn retryable(err: &EchoError) -> bool {
    matches!(err, EchoError::Io(_) | EchoError::Disconnected(_))
}

/// What a server's acceptance says the sender must keep to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Terms {
    /// The most samples a group frame may hold (the server's batch size).
    max_group: usize,
    /// `Some(k)`: every sample ends with its policy version (a `u64`), the server keeps
    /// them, and a sample more than `k` versions behind the latest the server announced
    /// waits for newer weights (`u64::MAX`: never waits).
    versions: Option<u64>,
    /// A replay table: it takes priorities (a FIFO table refuses a frame with one).
    replay: bool,
}

/// How a [`RaggedSender`] connects.
#[derive(Debug, Clone)]
pub struct SenderOptions {
    /// The server's secret, if it has one.
    pub token: Option<Vec<u8>>,
    /// How long connecting (and attaching shared memory) may take.
    pub timeout: Duration,
    /// At most this many samples wait for their acknowledgement at once.
    pub max_inflight: usize,
    /// The same-host shared-memory pipe: `None` when the server offers it, `Some(true)`
    /// required (an error without it), `Some(false)` never.
    pub shared_memory: Option<bool>,
    /// `Some(limit)`: connect again (for up to `limit` each time) when the connection is
    /// lost, resending what was not stored; `None`: a lost connection is an error.
    pub reconnect: Option<Duration>,
    /// Asked for the address before every connection attempt (`echo.ray`: the shard's
    /// learner, wherever it runs now), instead of `host:port`.
    pub resolver: Option<Resolver>,
    /// `Some(limit)`: the first connection is retried (a refused or lost connection, no
    /// address yet) for up to `limit`; `None`: one attempt.
    pub dial: Option<Duration>,
    /// `Some(bytes)`: durable: every frame is kept until a checkpoint the server completed
    /// holds it (not only until it is stored), at most `bytes` of them (a send waits for
    /// room), and resent to a restored server; needs `reconnect`.
    pub durable: Option<usize>,
    /// Compress the leaves the server asks for (its `compress=`) over TCP.
    pub wire_compression: bool,
    /// `Some(t)`: the server sends a heartbeat every third of `t`, and a connection it sends
    /// nothing on for `t` is taken as lost (a half-open connection: a partition, a learner
    /// host gone without a word); with `reconnect` the sender then connects again.
    pub heartbeat: Option<Duration>,
}

impl Default for SenderOptions {
    fn default() -> Self {
        Self {
            token: None,
            timeout: Duration::from_secs(10),
            max_inflight: 256,
            shared_memory: None,
            reconnect: None,
            resolver: None,
            dial: None,
            durable: None,
            wire_compression: true,
            heartbeat: None,
        }
    }
}

/// What waits use of a connection, without its lock: its reader's state, its pipe's
/// acknowledgements, and the samples stored before it.
#[derive(Clone)]
struct View {
    shared: Arc<Shared>,
    acks: Option<Arc<pipe::Acks>>,
    /// Samples of the session stored before this connection (its `resume_seq`).
    base: u64,
    /// The codecs this connection agreed on (over TCP only).
    codecs: Codecs,
    /// The learner's parameter region, handed over with the pipe: fetches copy from it.
    region: Option<Arc<Mutex<pipe::Region>>>,
}

impl View {
    /// Samples of the session acknowledged.
    fn acked(&self) -> u64 {
        self.base
            + self.acks.as_ref().map_or_else(|| self.shared.state.lock().acked, |a| a.stored())
    }

    fn failure(&self) -> Option<EchoError> {
        failure(&self.shared.state.lock())
    }

    /// Waits until `target` samples of the session are acknowledged.
    fn wait_acked(&self, target: u64, deadline: Option<Instant>) -> Result<(), EchoError> {
        if let Some(acks) = &self.acks {
            let want = target.saturating_sub(self.base);
            return acks.wait_stored(want, deadline, &|| self.failure().is_some()).map_err(
                |stop| match stop {
                    pipe::Stop::TimedOut => EchoError::TimedOut,
                    pipe::Stop::Lost => self.failure().unwrap_or_else(|| {
                        EchoError::Disconnected("the server closed the connection".into())
                    }),
                },
            );
        }
        let mut state = self.shared.state.lock();
        loop {
            if self.base + state.acked >= target {
                return Ok(());
            }
            if let Some(err) = failure(&state) {
                return Err(err);
            }
            self.shared.wait(&mut state, deadline)?;
        }
    }
}

mod fetch;
mod link;
/// The worker's side of the shared-memory pipe (Linux), or its stand-in elsewhere.
#[cfg(target_os = "linux")]
#[path = "pipe_linux.rs"]
mod pipe;
#[cfg(not(target_os = "linux"))]
#[path = "pipe_off.rs"]
mod pipe;

use link::{Dial, Link};

/// The sending side of a worker.
pub struct RaggedSender {
    spec: RaggedSpec,
    /// With policy versions: `spec` and the version leaf, which frames are encoded with.
    stamped: Option<RaggedSpec>,
    /// The version a sample carries when its send names none.
    policy_version: AtomicU64,
    dial: Dial,
    link: Mutex<Link>,
    /// A copy of the current connection's [`View`], for waits that must not hold `link`.
    view: Mutex<View>,
    /// Samples of the session sent (the next one's sequence number).
    sent: AtomicU64,
    /// With `reconnect`: every frame whose samples are not known to be stored, with the
    /// session's sample count after it.
    retained: Mutex<VecDeque<Retained>>,
    /// What the first server accepted; a reconnection must find the same.
    terms: Terms,
    max_inflight: u64,
    reconnects: AtomicU64,
    resent: AtomicU64,
    /// Where the latest reconnection resumed: the samples the server said it had.
    resumed_from: Mutex<Option<u64>>,
    /// What the server said when it last closed a connection of this sender.
    closing: Mutex<Option<Closing>>,
    /// Why reconnecting failed, once it has: every later call fails with it.
    given_up: Mutex<Option<String>>,
    /// Durable: the persisted mark earlier connections heard (a new one starts from 0).
    persisted_before: AtomicU64,
    /// Durable: sends that waited for room in `durable` bytes, and the seconds they waited.
    durable_waits: Mutex<(u64, f64)>,
    /// Sends that waited for newer weights, and the seconds they waited.
    admission_waits: Mutex<(u64, f64)>,
    /// See [`RaggedSender::take_held_back`].
    held_back: Mutex<Option<(u64, u64, u64)>>,
    /// Whole versions fetched, and the seconds the fetches took.
    fetches: Mutex<(u64, f64)>,
}

impl RaggedSender {
    /// Connects to `host:port` and completes the handshake for samples of `spec`, described
    /// as `layout`, as `options` say.
    ///
    /// # Errors
    /// [`EchoError::Io`] / [`EchoError::Disconnected`] if the server cannot be reached;
    /// [`EchoError::Protocol`] if it refuses the layout (naming the leaf) or is not a ragged
    /// server; [`EchoError::Auth`] for a wrong or missing token;
    /// [`EchoError::SharedMemory`] if shared memory is required and not to be had.
    pub fn connect(
        host: &str,
        port: u16,
        spec: RaggedSpec,
        layout: Layout,
        options: SenderOptions,
    ) -> Result<Self, EchoError> {
        let max_inflight = options.max_inflight.max(1) as u64;
        let first = options.dial;
        let session = v2::random()?;
        let dial = Dial {
            host: host.into(),
            port,
            layout,
            options,
            session,
            last: Mutex::new(None),
            announced: Arc::new(AtomicU64::new(0)),
        };
        let (link, terms) = match first {
            Some(limit) => dial.open_retrying(0, Instant::now() + limit)?,
            None => dial.open(0)?,
        };
        let view = link.view.clone();
        let sent = AtomicU64::new(view.base);
        let stamped = terms.versions.map(|_| spec.with_version_leaf());
        Ok(Self {
            spec,
            stamped,
            policy_version: AtomicU64::new(0),
            dial,
            link: Mutex::new(link),
            view: Mutex::new(view),
            sent,
            retained: Mutex::new(VecDeque::new()),
            terms,
            max_inflight,
            reconnects: AtomicU64::new(0),
            resent: AtomicU64::new(0),
            resumed_from: Mutex::new(None),
            closing: Mutex::new(None),
            given_up: Mutex::new(None),
            persisted_before: AtomicU64::new(0),
            durable_waits: Mutex::new((0, 0.0)),
            admission_waits: Mutex::new((0, 0.0)),
            held_back: Mutex::new(None),
            fetches: Mutex::new((0, 0.0)),
        })
    }

    /// Whether frames are kept until a checkpoint holds them.
    pub fn durable(&self) -> bool {
        self.dial.options.durable.is_some()
    }

    /// Samples of the session in a checkpoint the server completed (durable; else 0).
    pub fn persisted(&self) -> u64 {
        let view = self.view.lock().clone();
        self.persisted_on(&view)
    }

    /// The persisted mark as `view`'s connection and the earlier ones heard it.
    fn persisted_on(&self, view: &View) -> u64 {
        let heard = view.shared.state.lock().persisted;
        // ORDERING: Relaxed — only raised under `link`; a stale value only keeps more.
        heard.max(self.persisted_before.load(Ordering::Relaxed))
    }

    /// Where the frames kept for resending start: past what is persisted (durable) or
    /// stored (acknowledged) on `view`'s connection.
    fn kept_after(&self, view: &View) -> u64 {
        if self.durable() {
            self.persisted_on(view)
        } else {
            view.acked()
        }
    }

    /// Durable sends that waited for room, and the seconds they waited in all.
    pub fn durable_waits(&self) -> (u64, f64) {
        *self.durable_waits.lock()
    }

    /// Waits until every sample sent is in a checkpoint the server completed (durable),
    /// reconnecting and resending meanwhile.
    ///
    /// # Errors
    /// [`EchoError::TimedOut`]; as [`RaggedSender::flush`] for a connection that is gone.
    pub fn wait_persisted(&self, deadline: Option<Instant>) -> Result<(), EchoError> {
        loop {
            let view = self.view.lock().clone();
            // ORDERING: Relaxed — see `wait_window`.
            let sent = self.sent.load(Ordering::Relaxed);
            if self.persisted_on(&view) >= sent {
                return Ok(());
            }
            if let Some(err) = view.failure() {
                self.recover_from(&view, err, deadline)?;
                continue;
            }
            let mut state = view.shared.state.lock();
            if state.persisted < sent && failure(&state).is_none() {
                view.shared.wait(&mut state, deadline)?;
            }
        }
    }

    /// Durable: waits until a frame of `bytes` fits beside the frames not yet persisted (at
    /// most `durable` bytes; a frame alone always fits).
    fn wait_durable(&self, bytes: usize, deadline: Option<Instant>) -> Result<(), EchoError> {
        let Some(limit) = self.dial.options.durable else { return Ok(()) };
        let mut started = None;
        let result = loop {
            let view = self.view.lock().clone();
            let kept = self.kept_bytes(self.persisted_on(&view));
            if kept == 0 || kept + bytes <= limit {
                break Ok(());
            }
            started.get_or_insert_with(Instant::now);
            if let Some(err) = view.failure() {
                if let Err(err) = self.recover_from(&view, err, deadline) {
                    break Err(err);
                }
                continue;
            }
            let mut state = view.shared.state.lock();
            if failure(&state).is_none() {
                if let Err(err) = view.shared.wait(&mut state, deadline) {
                    break Err(err);
                }
            }
        };
        if let Some(started) = started {
            let mut waits = self.durable_waits.lock();
            waits.0 += 1;
            waits.1 += started.elapsed().as_secs_f64();
        }
        result
    }

    /// Bytes of the kept frames past `after` samples.
    fn kept_bytes(&self, after: u64) -> usize {
        let retained = self.retained.lock();
        retained.iter().filter(|r| r.end > after).map(|r| r.frame.len()).sum()
    }

    /// The spec samples are checked against.
    pub fn spec(&self) -> &RaggedSpec {
        &self.spec
    }

    /// The latest version of the learner's parameters it announced (0: none yet).
    pub fn params_version(&self) -> u64 {
        // ORDERING: Relaxed — a version read on its own (reader threads raise it).
        self.dial.announced.load(Ordering::Relaxed)
    }

    /// Sends that waited for newer weights (`admission="block"`), and the seconds they
    /// waited in all.
    pub fn admission_waits(&self) -> (u64, f64) {
        *self.admission_waits.lock()
    }

    /// With `admission="block"`: waits until a sample of `version` is at most the server's
    /// bound behind the latest version it announced, that is until the worker acts with
    /// newer weights (`policy_version` set by another thread) or the version announced
    /// stops running ahead. `version` `None`: the worker's `policy_version`, read again as
    /// it waits.
    fn wait_admitted(
        &self,
        version: Option<u64>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let Some(bound) = self.terms.versions.filter(|&k| k != u64::MAX) else { return Ok(()) };
        let behind = |v: u64| self.params_version().saturating_sub(v) > bound;
        let mut started = None;
        let result = loop {
            let v = version.unwrap_or_else(|| self.policy_version());
            if !behind(v) {
                break Ok(());
            }
            started.get_or_insert_with(Instant::now);
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break Err(EchoError::TimedOut);
            }
            let view = self.view.lock().clone();
            if let Some(err) = view.failure() {
                if let Err(err) = self.recover_from(&view, err, deadline) {
                    break Err(err);
                }
                continue;
            }
            // A newer `policy_version` comes from another thread without a signal: look
            // again every slice.
            let slice = Instant::now() + ADMISSION_SLICE;
            let mut state = view.shared.state.lock();
            let _ = view.shared.wait(&mut state, Some(deadline.map_or(slice, |d| d.min(slice))));
        };
        if let Some(started) = started {
            let mut waits = self.admission_waits.lock();
            waits.0 += 1;
            waits.1 += started.elapsed().as_secs_f64();
        }
        if matches!(result, Err(EchoError::TimedOut)) {
            let v = version.unwrap_or_else(|| self.policy_version());
            *self.held_back.lock() = Some((v, self.params_version(), bound));
        }
        result
    }

    /// Why the last send that timed out was held back, if it waited for newer weights:
    /// (the version it would carry, the latest announced, the bound). Taken once.
    pub fn take_held_back(&self) -> Option<(u64, u64, u64)> {
        self.held_back.lock().take()
    }

    /// Whether the server keeps policy versions: every sample carries one.
    pub fn keeps_versions(&self) -> bool {
        self.stamped.is_some()
    }

    /// The version a sample carries when its send names none (0 until set).
    pub fn policy_version(&self) -> u64 {
        // ORDERING: Relaxed — a setting read on its own.
        self.policy_version.load(Ordering::Relaxed)
    }

    /// Sets the version samples carry when their send names none.
    pub fn set_policy_version(&self, version: u64) {
        // ORDERING: Relaxed — a setting read on its own (a send racing the store takes
        // either version, as if it had run a moment earlier or later).
        self.policy_version.store(version, Ordering::Relaxed);
    }

    /// Whether frames go through a shared-memory pipe (else over TCP).
    pub fn uses_shared_memory(&self) -> bool {
        self.view.lock().acks.is_some()
    }

    /// (sent, acknowledged) samples.
    pub fn counts(&self) -> (u64, u64) {
        let view = self.view.lock().clone();
        // ORDERING: Relaxed — a count written only under `link`, read for statistics.
        (self.sent.load(Ordering::Relaxed), view.acked())
    }

    /// The session id every connection of this sender presents.
    pub fn session(&self) -> [u8; 16] {
        self.dial.session
    }

    /// (reconnections, samples resent after one).
    pub fn recoveries(&self) -> (u64, u64) {
        // ORDERING: Relaxed — statistics counters.
        (self.reconnects.load(Ordering::Relaxed), self.resent.load(Ordering::Relaxed))
    }

    /// Where the latest reconnection resumed (the samples the server said it already had,
    /// so the first one sent again), or `None` before any.
    pub fn resumed_from(&self) -> Option<u64> {
        *self.resumed_from.lock()
    }

    /// What the server said the last time it closed a connection of this sender, if it ever
    /// did (`None` also when a connection vanished without a word).
    pub fn server_closing(&self) -> Option<Closing> {
        let view = self.view.lock().clone();
        let current = view.shared.state.lock().closing;
        current.or(*self.closing.lock())
    }

    /// The codec of each leaf of `spec` this connection compresses (`None`: raw); empty
    /// when every leaf goes raw (shared memory, a server without `compress=`, or
    /// `wire_compression` off).
    pub fn wire_codecs(&self) -> Vec<Option<Codec>> {
        let codecs = self.view.lock().codecs.clone();
        codecs.iter().take(self.spec.columns().len()).copied().collect()
    }

    /// Bytes of frames kept to resend (with `reconnect`: those not known to be stored;
    /// frames stored since the last send are let go at the next one, and not counted here).
    pub fn retained_bytes(&self) -> usize {
        let view = self.view.lock().clone();
        self.kept_bytes(self.kept_after(&view))
    }

    /// `err`, or a reconnection (with `link` locked) when it is a lost connection and the
    /// sender reconnects: for up to `reconnect`, or until the call's `deadline`
    /// ([`EchoError::TimedOut`]; the next call tries again).
    fn recover(
        &self,
        link: &mut Link,
        err: EchoError,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        if let Some(why) = self.given_up.lock().clone() {
            return Err(EchoError::Disconnected(why));
        }
        let Some(limit) = self.dial.options.reconnect else { return Err(err) };
        // A server closed for good is the end, unless a resolver may name another one
        // (`echo.ray`: the shard's next learner, or another shard).
        let moved =
            self.dial.options.resolver.is_some() && matches!(err, EchoError::ServerClosed(_));
        if !retryable(&err) && !moved {
            return Err(err);
        }
        log::debug!("ragged worker: reconnecting after: {err}");
        let reconnected = self.reconnect(link, limit, deadline);
        if let Err(err @ EchoError::Disconnected(_)) = &reconnected {
            // Its frames may have reached the server or not: this sender sends no more.
            *self.given_up.lock() =
                Some(format!("the connection was lost and could not be re-established: {err}"));
        }
        reconnected
    }

    /// Connects again (for up to `limit`, or until `deadline`) and resends what the server
    /// has not stored.
    fn reconnect(
        &self,
        link: &mut Link,
        limit: Duration,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let until = Instant::now() + limit;
        let mut pause = FIRST_PAUSE;
        loop {
            // A durable worker claims only what is persisted: a restored server may hold less
            // than it acknowledged, and the worker kept the rest.
            let seen = self.kept_after(&link.view);
            let heard = link.view.shared.state.lock().persisted;
            // ORDERING: Relaxed — raised only under `link`, which we hold.
            self.persisted_before.fetch_max(heard, Ordering::Relaxed);
            if let Some(said) = link.view.shared.state.lock().closing {
                *self.closing.lock() = Some(said);
            }
            link.close(false);
            let last = match self.dial.open(seen) {
                Ok((mut fresh, terms)) if terms != self.terms => {
                    // Another server than the one the frames are made for (its batch size
                    // or its policy versions changed): they would not fit it.
                    fresh.close(false);
                    return Err(EchoError::Protocol(format!(
                        "reconnected to a server that takes groups of at most {} samples{}, \
                         where the first took {}{}: not the same server",
                        terms.max_group,
                        if terms.versions.is_some() { " with policy versions" } else { "" },
                        self.terms.max_group,
                        if self.terms.versions.is_some() { " with policy versions" } else { "" },
                    )));
                }
                Ok((fresh, _)) => {
                    *self.resumed_from.lock() = Some(fresh.view.base);
                    *link = fresh;
                    *self.view.lock() = link.view.clone();
                    // ORDERING: Relaxed — a statistics counter.
                    self.reconnects.fetch_add(1, Ordering::Relaxed);
                    match self.resend(link) {
                        Ok(()) => return Ok(()),
                        Err(err) if retryable(&err) => err,
                        Err(err) => return Err(err),
                    }
                }
                Err(err) if retryable(&err) => err,
                Err(err) => return Err(err),
            };
            let now = Instant::now();
            let left = until.saturating_duration_since(now);
            if left.is_zero() {
                return Err(EchoError::Disconnected(format!(
                    "could not reconnect within {limit:?}: {last}"
                )));
            }
            let call_left = deadline.map_or(left, |d| d.saturating_duration_since(now));
            if call_left.is_zero() {
                return Err(EchoError::TimedOut);
            }
            std::thread::sleep(pause.min(left).min(call_left));
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
    }

    /// Resends on a fresh connection every retained frame the server has not stored. The
    /// frames it has stored are let go, unless the worker is durable: those it keeps until
    /// a checkpoint holds them (a learner restored from an earlier checkpoint than the
    /// frames needs them again), and resends none of them now.
    fn resend(&self, link: &mut Link) -> Result<(), EchoError> {
        let stored = link.view.base;
        let release = if self.durable() { self.persisted_on(&link.view) } else { stored };
        let mut retained = self.retained.lock();
        while retained.front().is_some_and(|r| r.end <= release) {
            retained.pop_front();
        }
        // Frames are stored whole, so the first one not stored starts at `stored`.
        for kept in retained.iter().filter(|r| r.end > stored) {
            match self.plain_for(link, kept.packed.as_ref(), &kept.frame)? {
                Some(plain) => link.write(&[&plain], None)?,
                None => link.write(&[&kept.frame], None)?,
            }
        }
        let samples = retained.back().map_or(0, |r| r.end.saturating_sub(stored));
        // ORDERING: Relaxed — a statistics counter.
        self.resent.fetch_add(samples, Ordering::Relaxed);
        Ok(())
    }

    /// Sends `samples` as one group frame (a single sample when there is one), waiting until
    /// `deadline` while `max_inflight` samples are unacknowledged.
    ///
    /// # Errors
    /// [`EchoError::Sample`] for a sample the server would refuse (nothing is sent);
    /// [`EchoError::TimedOut`]; the server's error, closing or disconnection (with
    /// `reconnect`: once reconnecting failed).
    pub fn send_group(
        &self,
        samples: &[Outgoing<'_>],
        priority: Option<f64>,
        version: Option<u64>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        if samples.is_empty() {
            return Err(EchoError::Sample("a group needs at least one sample, got none".into()));
        }
        if samples.len() > self.terms.max_group {
            return Err(EchoError::Sample(format!(
                "a group of {} samples is larger than a batch (batch_size {})",
                samples.len(),
                self.terms.max_group
            )));
        }
        self.wait_admitted(version, deadline)?;
        if version.is_some() && self.stamped.is_none() {
            return Err(EchoError::Config(
                "version= needs a server that keeps policy versions (policy_versions=True or \
                 max_staleness=); this one keeps none"
                    .into(),
            ));
        }
        if let Some(p) = priority.filter(|p| !p.is_finite() || *p < 0.0) {
            return Err(EchoError::Priority(format!(
                "a priority must be finite and >= 0, got {p}"
            )));
        }
        if priority.is_some() && !self.terms.replay {
            return Err(EchoError::Priority(
                "the server's table is FIFO: it takes no priorities (a priority needs a replay \
                 table)"
                    .into(),
            ));
        }
        let columns = self.spec.columns();
        for sample in samples {
            for got in [sample.rows.len(), sample.leaves.len()] {
                if got != columns.len() {
                    return Err(self.spec.leaf_count(got));
                }
            }
            let rows = |i: usize| if columns[i].is_ragged() { sample.rows[i] } else { 1 };
            self.spec.check_with(rows, |i| sample.leaves[i].len())?;
        }
        // With versions, every sample ends with its version (a fixed leaf of the server's).
        let stamp = version.unwrap_or_else(|| self.policy_version()).to_le_bytes();
        let stamped: Vec<(Vec<usize>, Vec<&[u8]>)> = match &self.stamped {
            None => Vec::new(),
            Some(_) => samples
                .iter()
                .map(|s| {
                    let rows = s.rows.iter().copied().chain([1]).collect();
                    let leaves = s.leaves.iter().copied().chain([&stamp[..]]).collect();
                    (rows, leaves)
                })
                .collect(),
        };
        let outgoing: Vec<Outgoing<'_>>;
        let (spec, samples) = match &self.stamped {
            None => (&self.spec, samples),
            Some(spec) => {
                outgoing = stamped.iter().map(|(r, l)| Outgoing { rows: r, leaves: l }).collect();
                (spec, &outgoing[..])
            }
        };
        let head = encode_head(spec, samples, priority)?;
        if let Some(why) = self.given_up.lock().clone() {
            return Err(EchoError::Disconnected(why));
        }
        self.wait_window(deadline)?;
        // Over TCP, the leaves the server named codecs for go compressed, by this thread.
        let codecs = self.view.lock().codecs.clone();
        let packed = codecs.iter().any(Option::is_some);
        let frame =
            if packed { encode_packed(spec, &codecs, samples, priority)? } else { Vec::new() };
        let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + samples.len() * 5);
        if packed {
            parts.push(&frame);
        } else {
            parts.push(&head);
            parts.extend(samples.iter().flat_map(|s| s.leaves.iter().copied()));
        }
        self.wait_durable(parts.iter().map(|p| p.len()).sum(), deadline)?;
        self.write(&parts, samples.len() as u64, packed.then_some(codecs), deadline)
    }

    /// `frame`, compressed with `packed` (`None`: a plain frame), as `link` takes it: `None`
    /// when it takes the frame as it is (the same codecs), else the plain frame of its
    /// samples.
    fn plain_for(
        &self,
        link: &Link,
        packed: Option<&Codecs>,
        frame: &[u8],
    ) -> Result<Option<Vec<u8>>, EchoError> {
        match packed {
            Some(codecs) if **codecs != *link.view.codecs => {
                let spec = self.stamped.as_ref().unwrap_or(&self.spec);
                to_plain(spec, codecs, frame).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Waits until fewer than `max_inflight` samples are unacknowledged (with a full window:
    /// until half of it is free, one wake-up for many samples stored).
    fn wait_window(&self, deadline: Option<Instant>) -> Result<(), EchoError> {
        loop {
            let view = self.view.lock().clone();
            if let Some(err) = view.failure() {
                self.recover_from(&view, err, deadline)?;
                continue;
            }
            // ORDERING: Relaxed — written only under `link`; a stale value only waits less.
            let sent = self.sent.load(Ordering::Relaxed);
            if sent.saturating_sub(view.acked()) < self.max_inflight {
                return Ok(());
            }
            let target = sent - self.max_inflight / 2;
            match view.wait_acked(target, deadline) {
                Ok(()) => return Ok(()),
                Err(err) => self.recover_from(&view, err, deadline)?,
            }
        }
    }

    /// [`RaggedSender::recover`] from an error met on the connection `view` shows, unless
    /// another thread has replaced that connection already.
    fn recover_from(
        &self,
        view: &View,
        err: EchoError,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let mut link = self.link.lock();
        if !Arc::ptr_eq(&link.view.shared, &view.shared) {
            return Ok(()); // reconnected meanwhile
        }
        self.recover(&mut link, err, deadline)
    }

    /// Writes one frame of `samples` samples (`parts`) on the current connection; with
    /// `reconnect`, keeps a copy until its samples are stored.
    fn write(
        &self,
        parts: &[&[u8]],
        samples: u64,
        packed: Option<Codecs>,
        deadline: Option<Instant>,
    ) -> Result<(), EchoError> {
        let mut link = self.link.lock();
        // ORDERING: Relaxed — `sent` is written only under `link`, which we hold.
        let end = self.sent.load(Ordering::Relaxed) + samples;
        // Compressed for a connection that has been replaced since: plain for this one.
        let plain = match &packed {
            Some(_) => self.plain_for(&link, packed.as_ref(), parts[0])?,
            None => None,
        };
        let (parts, packed) = match &plain {
            Some(plain) => (&[&plain[..]][..], None),
            None => (parts, packed),
        };
        if self.dial.options.reconnect.is_some() {
            let acked = self.kept_after(&link.view);
            let mut retained = self.retained.lock();
            while retained.front().is_some_and(|r| r.end <= acked) {
                retained.pop_front();
            }
            retained.push_back(Retained { end, frame: parts.concat(), packed });
        }
        match link.write(parts, deadline) {
            Ok(()) => {}
            Err(EchoError::TimedOut) => {
                // Nothing of the frame was written.
                if self.dial.options.reconnect.is_some() {
                    self.retained.lock().pop_back();
                }
                return Err(EchoError::TimedOut);
            }
            Err(err) if self.dial.options.reconnect.is_none() => return Err(err),
            Err(err) => {
                // The frame is retained, and counted as sent from here on however the
                // reconnection ends: a connection that took it may have stored it, so the
                // session's numbering goes past it. A reconnection cut short by the call's
                // deadline resends it with the next call's.
                let recovered = self.recover(&mut link, err, deadline);
                // ORDERING: Relaxed — see above.
                self.sent.store(end, Ordering::Relaxed);
                return match recovered {
                    Err(EchoError::TimedOut) | Ok(()) => Ok(()),
                    Err(err) => Err(err),
                };
            }
        }
        // ORDERING: Relaxed — see above.
        self.sent.store(end, Ordering::Relaxed);
        Ok(())
    }

    /// Sends `frame` as it is, counted as no sample: what a hostile worker can send, for
    /// tests.
    ///
    /// # Errors
    /// As [`RaggedSender::send_group`].
    #[doc(hidden)]
    pub fn send_raw(&self, frame: &[u8], deadline: Option<Instant>) -> Result<(), EchoError> {
        self.link.lock().write(&[frame], deadline)
    }

    /// Waits until every sample sent is acknowledged (stored by the server).
    ///
    /// # Errors
    /// [`EchoError::TimedOut`]; the server's error, closing or disconnection while samples
    /// are unacknowledged (with `reconnect`: once reconnecting failed).
    pub fn flush(&self, deadline: Option<Instant>) -> Result<(), EchoError> {
        loop {
            let view = self.view.lock().clone();
            // ORDERING: Relaxed — see `wait_window`.
            let sent = self.sent.load(Ordering::Relaxed);
            match view.wait_acked(sent, deadline) {
                Ok(()) => return Ok(()),
                Err(EchoError::TimedOut) => return Err(EchoError::TimedOut),
                Err(err) => self.recover_from(&view, err, deadline)?,
            }
        }
    }

    /// Says goodbye and closes the connection (without waiting for acknowledgements: call
    /// [`RaggedSender::flush`] first for that).
    pub fn close(&self) {
        self.link.lock().close(true);
    }
}

impl std::fmt::Debug for RaggedSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = if self.uses_shared_memory() { "shm" } else { "tcp" };
        write!(f, "RaggedSender({path}, {:?})", self.counts())
    }
}

impl Drop for RaggedSender {
    fn drop(&mut self) {
        self.close();
    }
}
