//! A blocking TCP client for rollout workers: connect, negotiate wire v1 or v2, stream samples.
//!
//! Each sample goes out with one vectored write straight from the caller's leaf buffers (no
//! joined copy), unless the client reconnects: then it keeps a copy of every unacknowledged
//! sample to send again. A background thread reads the acks and counts them (and, on v2,
//! sends heartbeats and watches the server's); `send` blocks while `max_inflight` samples are
//! unacknowledged, and `wait` until every sample is. When the server goes away, every blocked
//! call returns [`EchoError::Disconnected`] promptly, or, with reconnection on, blocks while
//! the client reconnects and resends.
//!
//! Negotiation ([`super::wire::v2`]): an echo server greets with the v1 handshake and then a
//! v2 offer (or the offer alone when it has a token); id-echo 0.2.1 sends the handshake
//! alone. With [`Protocol::Auto`] the client waits [`OFFER_GRACE`] after a v1 handshake for
//! an offer; without one it speaks v1, so it never writes a v2 byte to a v1 server.
//!
//! | module        | holds                                                                  |
//! |---------------|------------------------------------------------------------------------|
//! | this one      | [`TcpSender`]: its state, connecting, what it reports                  |
//! | `options`     | [`ClientConfig`], [`Protocol`], [`SharedMemory`], [`Resolver`]         |
//! | `connecting`  | one connection's connect and handshake ([`Connecting`])                |
//! | `dialing`     | a first connection with retries ([`Dialing`])                          |
//! | `link`        | a live connection and its ack reader thread                            |
//! | `sending`     | `send`, `send_rows`, checks, retention, frame bytes                    |
//! | `recovery`    | waiting for acks, reconnecting, resuming, resending, `close`           |
//!
//! The shared-memory mechanisms a client uses (attaching, the ring's writer side, the bells)
//! live in [`super::shm`].

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::Ordering::Acquire;
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::codec::LeafCodecs;
use crate::error::EchoError;
use crate::spec::DataSpec;
use crate::sync::Arc;
use crate::transport::shm::worker::loss_bell;
use crate::transport::wire::v2::{self, Beat, Closing};
use link::{Acks, Established, Link, Reading, Writing};

mod connecting;
mod dialing;
mod fetching;
mod link;
mod options;
mod recovery;
mod sending;

pub use connecting::Connecting;
pub use dialing::Dialing;
pub use options::{ClientConfig, Protocol, Resolve, Resolver, SharedMemory};

/// How long a client in [`Protocol::Auto`] waits after a v1 handshake for a v2 offer. An echo
/// server writes both at once, so only a lost segment delays the offer this long.
pub const OFFER_GRACE: Duration = Duration::from_millis(100);
/// How long a client waits on the shared-memory space bell before it checks its deadline and
/// the connection again.
const SHM_SLICE: Duration = Duration::from_millis(50);
/// The most iovecs one vectored write takes (Linux's `IOV_MAX`).
const MAX_IOVECS: usize = 1024;
/// How long one blocking write may take before `send` checks its deadline again.
const WRITE_SLICE: Duration = Duration::from_millis(50);
/// How long [`TcpSender::connect`] waits in one [`Connecting::poll`].
const CONNECT_SLICE: Duration = Duration::from_millis(50);
/// First and largest pause between reconnection attempts (each is jittered to 50-100%).
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A sample kept until it is acknowledged, to send again after a reconnect.
struct Retained {
    /// The frame's bytes: header, then payload.
    frame: Box<[u8]>,
}

/// A reconnection in progress.
struct Recovery {
    since: Instant,
    attempt: u32,
    next_try: Instant,
    connecting: Option<Connecting>,
    last_error: String,
}

/// A connection to an echo server.
pub struct TcpSender {
    config: Arc<ClientConfig>,
    /// The server's address (the last one connected to, or being reconnected to), and the
    /// same as `host:port` for messages.
    target: (String, u16),
    address: String,
    spec: DataSpec,
    session: [u8; 16],
    /// The connection; `None` while reconnecting, or after `close`.
    link: Option<Link>,
    version: u8,
    replay: bool,
    /// `Some(max_rows)` when the server is a sequence table (it takes step frames).
    steps: Option<u32>,
    /// Samples accepted by `send` (the sequence number of the next one).
    sent: u64,
    /// Samples wholly written on the current connection (retention only; else `sent`).
    written: u64,
    /// Bytes of the frame at `written` (or of the sample being sent) already written.
    in_progress: usize,
    /// Acknowledged samples of past connections (their total when the last one dropped).
    acked_floor: u64,
    /// With reconnection: every sample from `retained_base` to `sent`, as frames.
    retained: VecDeque<Retained>,
    retained_base: u64,
    /// Buffers of acknowledged frames, reused by the next retained ones.
    spare: Vec<Box<[u8]>>,
    reconnect: bool,
    recovery: Option<Recovery>,
    /// Why the client can no longer send (reconnection gave up, or was never on).
    failed: Option<String>,
    /// `failed` because the server closed for good (with reconnection on, which then stops).
    final_close: bool,
    /// What the server's last closing notice said, if one came.
    server_closing: Option<Closing>,
    closed: bool,
    reconnects: u64,
    resent: u64,
    /// The sample the server resumed the session at on the latest reconnect.
    resumed_from: Option<u64>,
    /// A sample accepted into `retained` by a `send` that returned before it was written.
    carry: bool,
    /// Whether samples go through shared memory.
    shm: bool,
    /// The compressed frame being written (from byte `in_progress` on), when the connection
    /// sends compressed frames; kept across calls so a stalled write finishes the same bytes.
    packing: Vec<u8>,
    /// Durable acknowledgements: the most bytes of frames kept until they are persisted.
    durable: Option<usize>,
    /// Bytes of the frames in `retained`.
    retained_bytes: usize,
    /// The largest persisted mark of past connections.
    persisted_floor: u64,
    /// The latest parameter version past connections announced.
    params_floor: u64,
    /// A parameter fetch that timed out: how far it got, and the requests it left in flight.
    fetching: Option<fetching::Fetching>,
    /// Sends that waited for the durable byte budget, and the seconds they waited.
    durable_waits: u64,
    /// A send is waiting for the durable byte budget (across the calls a sliced deadline
    /// makes), counted once in `durable_waits`.
    budget_blocked: bool,
    durable_wait_s: f64,
    /// What each payload holds: the sample's leaves, then (when the server keeps policy
    /// versions) the version leaf.
    wire_spec: DataSpec,
    /// `Some(admit)` once a server that keeps policy versions accepted us: payloads end with
    /// the version, and a send waits while the worker is more than `admit` versions behind
    /// (`u64::MAX`: never). Fixed by the first connection: retained frames are of its form.
    versions: Option<u64>,
    /// The version samples carry by default: the newest this client fetched.
    policy_version: u64,
    /// The newest version this worker is known to act with: fetched, or given to a send.
    newest_version: u64,
    /// The version the frame being written carries (kept across the calls that finish it).
    frame_version: u64,
    /// Sends that waited for newer parameters (admission), and the seconds they waited; a
    /// send waiting across sliced calls is counted once.
    admission_waits: u64,
    admission_blocked: bool,
    admission_wait_s: f64,
    /// When the fetch in progress started, and the fetches completed with their seconds.
    fetch_started: Option<Instant>,
    fetches: (u64, f64),
}

impl TcpSender {
    /// Connects, negotiates and starts the ack reader, all within `timeout`.
    ///
    /// # Errors
    /// As [`TcpSender::connecting`] and [`Connecting::poll`].
    pub fn connect(config: ClientConfig, timeout: Duration) -> Result<Self, EchoError> {
        let mut dialing = Self::connecting(config, Instant::now().checked_add(timeout), None)?;
        loop {
            if let Some(sender) = dialing.poll(Instant::now() + CONNECT_SLICE)? {
                return Ok(sender);
            }
        }
    }

    /// Starts connecting; drive it with [`Dialing::poll`] until it returns the client.
    /// `deadline` bounds everything (name resolution, the TCP connect, the whole handshake,
    /// and with retries every attempt and pause); `None` waits as long as it takes.
    /// `attempt_timeout` bounds each attempt when the client retries (with reconnection or a
    /// resolver, see [`Dialing`]); `None`: each may take until the deadline.
    ///
    /// # Errors
    /// [`EchoError::Config`] for bad settings.
    pub fn connecting(
        config: ClientConfig,
        deadline: Option<Instant>,
        attempt_timeout: Option<Duration>,
    ) -> Result<Dialing, EchoError> {
        config.validate()?;
        let now = Instant::now();
        Ok(Dialing {
            retry: config.retries(),
            config: Arc::new(config),
            session: v2::random()?,
            started: now,
            deadline,
            attempt_timeout,
            attempt: 0,
            next_try: now,
            current: None,
            last: None,
        })
    }

    fn from_established(connecting: &Connecting, est: Established) -> Self {
        let config = Arc::clone(&connecting.config);
        let reconnect = est.version == 2 && config.reconnect_timeout.is_some();
        let replay = est.accept.as_ref().is_some_and(|a| a.replay);
        let steps = est.accept.as_ref().and_then(|a| a.steps);
        let mut sender = Self {
            target: connecting.target.clone(),
            address: connecting.address.clone(),
            spec: est.spec.clone(),
            session: connecting.session,
            link: None,
            version: est.version,
            replay,
            steps,
            sent: 0,
            written: 0,
            in_progress: 0,
            acked_floor: 0,
            retained: VecDeque::new(),
            retained_base: 0,
            spare: Vec::new(),
            reconnect,
            recovery: None,
            failed: None,
            final_close: false,
            server_closing: None,
            closed: false,
            reconnects: 0,
            resent: 0,
            resumed_from: None,
            carry: false,
            shm: est.shm.is_some(),
            packing: Vec::new(),
            durable: config.durable,
            retained_bytes: 0,
            persisted_floor: 0,
            params_floor: 0,
            fetching: None,
            durable_waits: 0,
            budget_blocked: false,
            durable_wait_s: 0.0,
            wire_spec: est.spec.clone(),
            versions: est.accept.as_ref().and_then(|a| a.versions),
            policy_version: 0,
            newest_version: 0,
            frame_version: 0,
            admission_waits: 0,
            admission_blocked: false,
            admission_wait_s: 0.0,
            fetch_started: None,
            fetches: (0, 0.0),
            config,
        };
        match sender.install(est) {
            Ok(()) => {}
            Err(err) => sender.failed = Some(err.to_string()),
        }
        sender
    }

    /// Starts the reader on an established connection and makes it the current one.
    fn install(&mut self, est: Established) -> Result<(), EchoError> {
        let Established { stream, version, accept, leftover, skip_offer, shm, .. } = est;
        let versions = accept.as_ref().and_then(|a| a.versions);
        if versions.is_some() != self.versions.is_some() {
            return Err(EchoError::Protocol(format!(
                "the server at {} {} the policy version of each sample, and did not when this \
                 client first connected: the samples it keeps to resend are of the other form \
                 (restart the worker)",
                self.address,
                if versions.is_some() { "now keeps" } else { "no longer keeps" }
            )));
        }
        self.versions = versions;
        self.wire_spec = match versions {
            Some(_) => {
                let mut arrays = self.spec.arrays().to_vec();
                arrays.push(crate::versions::version_leaf());
                DataSpec::new(arrays)?
            }
            None => self.spec.clone(),
        };
        let durable = accept.as_ref().is_some_and(|a| a.durable);
        let params = accept.as_ref().is_some_and(|a| a.params);
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(Some(WRITE_SLICE))?;
        let base = accept.as_ref().map_or(0, |a| a.resume_seq);
        let beat =
            accept.as_ref().and_then(|a| Beat::new(self.config.heartbeat_timeout, a.heartbeat_ms));
        let acks = Arc::new(Acks::default());
        let writing =
            Arc::new(Mutex::new(Writing { mid_frame: false, last_write: Instant::now() }));
        let reader = {
            let mut reading = Reading {
                stream: stream.try_clone()?,
                acks: Arc::clone(&acks),
                writing: Arc::clone(&writing),
                beat,
                version,
                skip_offer,
                pending: leftover,
                incoming: None,
                durable,
                params,
                last_heard: Instant::now(),
                wake_on_loss: match &shm {
                    Some(writer) => Some(loss_bell(writer)?),
                    None => None,
                },
            };
            thread::Builder::new().name("echo-client-acks".into()).spawn(move || reading.run())?
        };
        self.shm = shm.is_some();
        // Compressed frames only over TCP, and only if we asked (the reply names codecs only
        // then, but a server may be wrong).
        let codecs = match (accept.and_then(|a| a.codecs), &shm) {
            (Some(codecs), None) if self.config.wire_compression => {
                Some(Arc::new(LeafCodecs::new(&self.wire_spec, codecs)?))
                    .filter(|codecs| codecs.max_body() <= u32::MAX as usize)
            }
            _ => None,
        };
        self.link = Some(Link {
            stream,
            version,
            base,
            acks,
            writing,
            reader: Some(reader),
            shm,
            codecs,
            params,
        });
        Ok(())
    }

    /// The server's sample layout.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// The wire protocol spoken: 1 or 2.
    pub fn protocol(&self) -> u8 {
        self.version
    }

    /// Which path samples take: `"shm"` (same-host shared memory) or `"tcp"`.
    pub fn transport_path(&self) -> &'static str {
        if self.shm {
            "shm"
        } else {
            "tcp"
        }
    }

    /// `Some(max_rows)` when the server is a sequence table: samples are steps of rows
    /// `0..max_rows` of this client, and may end their episode.
    pub fn takes_steps(&self) -> Option<u32> {
        self.steps
    }

    /// Whether the server takes priorities (v2 with a replay table).
    pub fn takes_priorities(&self) -> bool {
        self.replay
    }

    /// Samples sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Samples acknowledged so far.
    pub fn acked(&self) -> u64 {
        match &self.link {
            Some(link) => link.acked_total().max(self.acked_floor),
            None => self.acked_floor,
        }
    }

    /// With durable acknowledgements: every sample before this one is in a checkpoint the
    /// server completed (as its latest notice said); 0 before one, and without.
    pub fn persisted(&self) -> u64 {
        let latest = self.link.as_ref().map_or(0, |link| {
            // ORDERING: Acquire pairs with the reader's Release `fetch_max`.
            link.acks.persisted.load(Acquire)
        });
        latest.max(self.persisted_floor)
    }

    /// The sample up to which nothing needs keeping any more: the acknowledged ones, or
    /// with durable acknowledgements the acknowledged and persisted ones.
    fn releasable(&self) -> u64 {
        let acked = self.acked();
        if self.durable.is_some() {
            acked.min(self.persisted())
        } else {
            acked
        }
    }

    /// Bytes of the frames kept to resend (with reconnection): with durable
    /// acknowledgements, until they are persisted, at most the budget.
    pub fn retained_bytes(&self) -> usize {
        self.retained_bytes
    }

    /// `send` calls that waited for the durable byte budget (until a checkpoint persisted
    /// what they kept), and the seconds they waited in all.
    pub fn durable_waits(&self) -> (u64, f64) {
        (self.durable_waits, self.durable_wait_s)
    }

    /// `Some(admit)` when the server keeps policy versions (each sample carries one): a send
    /// waits while this worker is more than `admit` versions behind the learner (`u64::MAX`:
    /// never); `None` when it does not keep them.
    pub fn policy_versions(&self) -> Option<u64> {
        self.versions
    }

    /// The version samples carry when a send names none: the newest this client fetched (0
    /// before the first fetch).
    pub fn policy_version(&self) -> u64 {
        self.policy_version
    }

    /// Sets the version samples carry when a send names none (a worker that gets its
    /// parameters another way).
    pub fn set_policy_version(&mut self, version: u64) {
        self.policy_version = version;
        self.newest_version = self.newest_version.max(version);
    }

    /// While a send waits for newer parameters (blocking admission): the newest version this
    /// worker acts with, the learner's latest, and the bound.
    pub fn held_back(&self) -> Option<(u64, u64, u64)> {
        let admit = self.versions.filter(|_| self.admission_blocked)?;
        Some((self.newest_version, self.params_version(), admit))
    }

    /// `send` calls that waited for newer parameters (a server with blocking admission), and
    /// the seconds they waited in all.
    pub fn admission_waits(&self) -> (u64, f64) {
        (self.admission_waits, self.admission_wait_s)
    }

    /// What the server said the last time it closed a connection of this client: for good
    /// ([`Closing::Final`]) or restarting; `None` if it never did (it is up, or it vanished
    /// without a word, as a crash does).
    pub fn server_closing(&self) -> Option<Closing> {
        // Only once the connection counts as lost: the reader stores the notice just before
        // it marks the loss, and a caller who saw the notice must find the next `send`
        // reconnecting, not writing to the closed connection (whose sample would be resent).
        let latest = self.link.as_ref().filter(|link| link.acks.is_lost()).and_then(|link| {
            // ORDERING: Acquire pairs with the reader's Release store (see `recover`); it
            // was stored before the loss `is_lost` saw.
            Closing::from_byte(link.acks.closing.load(Acquire))
        });
        latest.or(self.server_closing)
    }

    /// Successful reconnections so far.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// Samples sent again after reconnections.
    pub fn resent(&self) -> u64 {
        self.resent
    }

    /// Where the latest reconnection resumed: the number of this client's samples the server
    /// said it already had (sample numbers count from 0, so the first one resent, if any).
    /// Samples from there to [`sent`](Self::sent) at that moment were sent again. `None`
    /// before any reconnection.
    pub fn resumed_from(&self) -> Option<u64> {
        self.resumed_from
    }

    /// Bytes of a sample written so far by a `send` that returned [`EchoError::Stalled`]
    /// (with reconnection: non-zero while an accepted sample is not yet written).
    pub fn in_progress(&self) -> usize {
        if self.carry {
            self.in_progress.max(1)
        } else {
            self.in_progress
        }
    }

    /// The leaves the current connection sends compressed, as the server's reply named them;
    /// `None` when it sends them raw (v1, shared memory, no codecs offered or wanted).
    pub fn wire_codecs(&self) -> Option<&LeafCodecs> {
        self.link.as_ref().and_then(|link| link.codecs.as_deref())
    }
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        // Do not wait for acks on drop; say goodbye (v2, between frames: the server forgets the
        // session, which no reconnect will resume), release the socket and the thread.
        self.closed = true;
        if let Some(link) = self.link.take() {
            if link.version == 2 && self.in_progress == 0 && !link.acks.is_lost() {
                let _guard = link.writing.lock();
                let _ = (&link.stream).write_all(&[v2::BYE]);
            }
        }
    }
}
